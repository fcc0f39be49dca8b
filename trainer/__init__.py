"""Layer 4, the trainer: run context, input checks, optimizers, schedules and EMA, the loop, signals
and resume, the run folder, the final evaluations and the export.

`train_gpt.py` at the repository root is the entry (`python train_gpt.py`, `torchrun ... train_gpt.py`);
tools/bundle.py concatenates these modules with primitives/, model/, shards/, quant/ and eval/ into
the shipped single file.
"""
