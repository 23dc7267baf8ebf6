"""The supervised warm start of code RL (`experiments/sft.py`).

examples  the examples (a code episode's first turn, or a repair, answered by the reference) and
          their bucketed, seeded batches
job       `SFTConfig`, the train and held-out programs, and `SFTRun` on the run layer
"""
