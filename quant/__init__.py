"""Post-training quantization, QAT fake-quant, bit packing, compression and the artifact codec.

Modules: core (per-row intN quantization, GPTQ-lite, fake-quant), packing (intN bit packing),
policy (which tensor gets which format), codec (container + safetensors payload), artifact
(export with budget fitting, load), estimate (artifact size before training).
CLI (not bundled): `python -m quant inspect FILE`, `python -m quant estimate`.
"""
