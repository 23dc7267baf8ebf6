"""The RL job (`experiments/train.py`): the EARL loop and what it is built from.

trainer    `Trainer`: one EARL step (plan, reshard, roll out, dispatch, experience, train) on the
           run layer (`earl_jax.run`)
assembly   what a run is built from: the model, the stage programs' settings, the profile and
           the selector on it, the engines
planning   each stage's decision and its compiled program, step by step (`StagePlanner`)
placement  where the parameters and the train state live, and their moves between layouts
"""
