"""The supervised warm start of code RL (`experiments/sft.py`).

examples  the examples (a code episode's first turn, or a repair, answered by the reference) and
          their bucketed, seeded batches
steps     `SFTBatch`, the next-token loss and the update (built as programs of objective 'sft')
job       `SFTConfig` and `SFTRun`, on the run layer and the executable cache
"""
