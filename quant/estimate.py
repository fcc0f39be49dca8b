"""Artifact size projection from parameter shapes alone, before training starts.

Model, per tensor with shape [R, C] quantized to N bits (the policy decides N):
    bytes = R * C * bits_per_value(N, C) / 8 + 2 * R + 120      (fp16 scale per row, counted raw)
float passthrough tensors count numel * itemsize + 60 raw; plus 1200 bytes for the container,
model config and policy JSON. (120 / 60: per-tensor header entry, compressed.)

bits_per_value(N, C) = base[N] - slope[N] * (clamp(log2 C, 7, 12) - 9) was MEASURED
(tools/bench_quant.py --calibrate) on Gaussian weights, GPTQ-lite clip search, int8 containers,
zstd level 22 (the usual auto winner): about 5.39 bits per int6 value at row length C = 512,
falling 0.02-0.07 bits per doubling of C (the row max grows, the step widens); rounded up at the
2nd decimal. It is a projection, NOT an upper bound: measured est/real (int8 + zstd) is 1.002 on
Gaussian weights, 1.18 (Student-t, 3 dof) and 1.12 (Laplace) on heavier-tailed ones (a larger row
max relative to the bulk: most values land near 0 and compress better), 0.92 on uniform ones
(every level used evenly), and 0.982-1.004 on tiny GPTs trained 8-200 Muon steps
(tests/test_quant_artifact.py, tests/test_train.py). The export's QUANT_FIT steps down when the real
artifact is over the budget. Pruning is ignored (it only shrinks the artifact).

With QUANT_SDCLIP=1 the row step is k * std / qmax, so the stored values are a rounded Gaussian (in
units of the row's std) whatever the weights' scale: bits per value = its entropy
    H(N, k) = -sum_i p_i log2 p_i,  p_i = P(|z - i * k / qmax| < k / (2 qmax)), z ~ N(0, 1),
the two outermost levels taking the tails, plus the coder's overhead: MEASURED (brotli-11 / zstd-22,
Gaussian rows of 256 and 1,024 values, N 4..8, k 6..40) 0.02-0.05 bits above H for H >= 2.3, 0.17 at
H = 1.5: counted as 0.05 for H >= 2, else 0.17. With QUANT_LQER=1 the QUANT_LQER_TOP_N largest quantized
matrices count their factors' exact bytes (quant/lqer.py lqer_nbytes; the export picks by error, not
size). The export logs the measured / estimated ratio of the policy it stored (`quant_estimate` line):
the value to set QUANT_ESTIMATE_SCALE to for that preset.
"""

import math

from quant.lqer import lqer_add_estimate
from quant.policy import QuantPolicy
from quant.sdclip import sdclip_bits_per_value, sdclip_k_for  # (there: a record's file holds it only with QUANT_SDCLIP=1)

# bits -> (bits per stored value at row length 512, fewer bits per doubling of the row length)
QUANT_EST_BITS_PER_VALUE = {2: (0.82, 0.03), 3: (2.19, 0.03), 4: (3.30, 0.03), 5: (4.38, 0.03), 6: (5.40, 0.02),
                            7: (6.39, 0.065), 8: (7.41, 0.065)}


def policy_tensor_bytes(name: str, shape: tuple, qp: QuantPolicy, nbits: int) -> float:
    """Projected compressed bytes of parameter `name`, a matrix of `shape` (ints, numel > 0), stored at `nbits`
    (2..8) under the policy qp, without its 120-byte header share: values plus the float16 scale of each row. The
    GPTQ-lite table, or the SDClip entropy where qp gives the tensor an SDClip k (QUANT_SDCLIP=1)."""
    n, k = math.prod(shape), qp.sdclip and sdclip_k_for(qp, name, shape)
    base, slope = QUANT_EST_BITS_PER_VALUE[nbits]
    return n * (sdclip_bits_per_value(nbits, k) if k else base - slope * (min(max(math.log2(n // shape[0]), 7), 12) - 9)
                ) / 8 + 2 * shape[0]


def estimate_artifact_bytes(param_shapes: dict, qp: QuantPolicy, scale: float = 1.0) -> int:
    """Projected artifact (model) bytes for param_shapes (name -> shape tuple of ints >= 0) under the policy qp.

    Code bytes are NOT included. Shapes come from the model (the CLI validates user-given ones:
    quant.offline.quant_check_shapes). scale: measured / estimated bytes to assume (a preset's
    QUANT_ESTIMATE_SCALE; trained H100 weights compress better than the Gaussian ones this is calibrated on),
    applied to the total.
    """
    total = 1200
    for name, shape in param_shapes.items():
        n = math.prod(shape)
        bits = n and qp.bits_for(name, shape)
        total += (policy_tensor_bytes(name, shape, qp, bits) + 120 if bits
                  else n * (4 if qp.float_dtype == "float32" else 2) + 60)
    if qp.lqer:
        total = lqer_add_estimate(total, param_shapes, qp)
    return math.ceil(total * scale)
