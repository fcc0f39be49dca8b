"""Artifact size projection from parameter shapes alone, before training starts.

Model, per tensor with shape [R, C] quantized to N bits (the policy decides N):
    bytes = R * C * bits_per_value(N, C) / 8 + 2 * R          (fp16 scale per row, counted raw)
float passthrough tensors count numel * itemsize raw, plus a fixed container/metadata overhead
and a per-tensor safetensors/metadata overhead.

bits_per_value was MEASURED (tools/bench_quant.py --calibrate) on Gaussian weights, GPTQ-lite
clip search, int8 containers, zstd level 22 (the usual auto winner): about 5.39 bits per int6
value at row length C = 512, falling 0.02-0.07 bits per doubling of C (the row max grows, the step
widens). Assumption: trained matrices are no less compressible than Gaussian ones; their heavier
tails (larger row max relative to the bulk) make them compress better, so the projection is an
upper bound in practice (the bench compares it with real exports). Pruning is ignored (it only
shrinks the artifact).
"""

import math

from quant.policy import QuantPolicy

# bits -> (bits per stored value at row length 512, fewer bits per doubling of the row length);
# measured on Gaussian rows (tools/bench_quant.py --calibrate), rounded up at the 2nd decimal
QUANT_EST_BITS_PER_VALUE = {
    2: (0.82, 0.03), 3: (2.19, 0.03), 4: (3.30, 0.03), 5: (4.38, 0.03), 6: (5.40, 0.02), 7: (6.39, 0.065), 8: (7.41, 0.065),
}
QUANT_EST_FIXED_BYTES = 1200  # container header, model config, policy JSON (compressed)
QUANT_EST_PER_TENSOR_BYTES = 60  # safetensors header entries + per-tensor quant metadata (compressed)
_QUANT_EST_ITEMSIZE = {"float16": 2, "bfloat16": 2, "float32": 4}


def quant_bits_per_value(bits: int, row_len: int) -> float:
    """Projected compressed bits per quantized value for `bits`-bit rows of length row_len."""
    log_c = min(max(math.log2(max(row_len, 1)), 7.0), 12.0)
    base, slope = QUANT_EST_BITS_PER_VALUE[bits]
    return base - slope * (log_c - 9.0)


def quant_estimate_tensor_bytes(name: str, shape, policy: QuantPolicy) -> float:
    """Projected compressed bytes of one tensor (without the fixed overhead). ValueError on a bad shape."""
    try:
        dims = tuple(int(d) for d in shape)
    except (TypeError, ValueError):
        dims = (-1,)
    if any(d < 0 for d in dims):
        raise ValueError(f"param_shapes[{name!r}]={shape!r}: expected a tuple of non-negative ints")
    numel = math.prod(dims)
    bits = policy.bits_for(name, dims) if numel else None
    if bits is None:
        return numel * _QUANT_EST_ITEMSIZE[policy.float_dtype] + QUANT_EST_PER_TENSOR_BYTES
    rows = dims[0]
    return numel * quant_bits_per_value(bits, numel // rows) / 8 + 2 * rows + 2 * QUANT_EST_PER_TENSOR_BYTES


def estimate_artifact_bytes(param_shapes: dict, policy=None) -> int:
    """Projected artifact (model) bytes for param_shapes (name -> shape tuple) under `policy`.

    policy: QuantPolicy, default QuantPolicy.from_env(). Code bytes are NOT included.
    ValueError for a shape that is not a tuple/list of non-negative ints.
    """
    policy = QuantPolicy.from_env() if policy is None else policy
    total = QUANT_EST_FIXED_BYTES + sum(quant_estimate_tensor_bytes(n, s, policy) for n, s in param_shapes.items())
    return int(math.ceil(total))
