"""The trainer package: settings, presets, shards, model, optimizers, schedules, run context, loop, checks.

`train_gpt.py` at the repository root is the entry (`python train_gpt.py`, `torchrun ... train_gpt.py`);
tools/bundle.py concatenates these modules with quant/ and eval/ into the shipped single file.
"""
