"""Layer 3: post-training quantization, bit packing, compression and the artifact codec.

Bundled into the counted train_gpt.py (only what the trainer run calls): policy (which tensor
gets which format, QUANT_* env), artifact (bit packing, container + payload codec, export with budget fitting, load), estimate
(artifact size before training); the per-row rounding rule they share with QAT is
primitives/rowquant.py. Not bundled: offline (helpers for the CLI, the bench and tests).
CLI (not bundled): `python -m quant inspect FILE`, `python -m quant estimate`.
"""
