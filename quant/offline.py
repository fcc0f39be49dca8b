"""Helpers for the CLI (`python -m quant`), tools/bench_quant.py and the tests.

Not reached from train_gpt.py, so tools/bundle.py leaves this module out of the counted file:
whatever the trainer run does not call lives here rather than in core/policy/artifact/estimate.
"""

import dataclasses
import math
import os

from quant.artifact import quant_wrap_container
from quant.estimate import estimate_artifact_bytes
from quant.policy import QuantPolicy

QUANT_PACKINGS = ("int8", "bits")  # one offset byte per value / dense bit packing (see quant/artifact.py)
QUANT_DEFAULT_BYTE_BUDGET = 16_000_000


def quant_env_names() -> tuple:
    """Every QUANT_* variable QuantPolicy.from_env reads (QUANT_MATRIX_BITS and one per field)."""
    return ("QUANT_MATRIX_BITS",) + tuple("QUANT_" + f.name.upper() for f in dataclasses.fields(QuantPolicy))


def quant_byte_budget(byte_budget: int | None = None, environ: dict | None = None) -> int:
    """Budget in bytes: the argument, else env BYTE_BUDGET, else 16,000,000. ValueError if not > 0."""
    env = os.environ if environ is None else environ
    raw = byte_budget if byte_budget is not None else env.get("BYTE_BUDGET", QUANT_DEFAULT_BYTE_BUDGET)
    try:
        value = int(raw)
    except (TypeError, ValueError):
        value = -1
    if value <= 0:
        raise ValueError(f"BYTE_BUDGET={raw!r}: expected a positive integer number of bytes")
    return value


def quant_policy_from_dict(d: dict) -> QuantPolicy:
    """Inverse of QuantPolicy.to_dict (lists back to tuples); ValueError on unknown fields or bad values."""
    names = {f.name for f in dataclasses.fields(QuantPolicy)}
    if not isinstance(d, dict) or not set(d) <= names:
        raise ValueError(f"policy {d!r}: expected a dict with fields from {sorted(names)}")
    d = {"gptq_embed": False, **d}  # written since QUANT_GPTQ_EMBED exists: an artifact without it quantized without
    for key in ("overrides", "fitted"):
        if key in d:
            d[key] = tuple((str(p), int(b)) for p, b in d[key])
    if "control_patterns" in d:
        d["control_patterns"] = tuple(map(str, d["control_patterns"]))
    return QuantPolicy(**d)


def quant_check_shapes(param_shapes: dict) -> dict:
    """name -> shape (any sequence of ints) -> name -> tuple of ints; ValueError naming a bad one."""
    out = {}
    for name, shape in param_shapes.items():
        try:
            dims = tuple(int(d) for d in shape)
        except (TypeError, ValueError):
            dims = (-1,)
        if min(dims, default=0) < 0:
            raise ValueError(f"param_shapes[{name!r}]={shape!r}: expected a list of non-negative ints")
        out[name] = dims
    return out


def quant_estimate_tensor_bytes(name: str, shape: tuple, policy: QuantPolicy) -> float:
    """Projected compressed bytes of one tensor, without the fixed container overhead."""
    return estimate_artifact_bytes({name: shape}, policy) - estimate_artifact_bytes({}, policy)


def quant_compress(raw: bytes, compressor: str) -> bytes:
    """raw bytes compressed exactly as the artifact compresses its payload (without the header)."""
    return quant_wrap_container(raw, compressor)[14:]


def quant_piece_bytes(meta: dict) -> dict:
    """Stored payload bytes per tensor name (q + scale, or the passthrough data) from a decoded
    artifact's meta (decode_artifact(...)[2])."""
    import torch

    out = {}
    for name, shape, kind, _ in meta["tensors"]:
        numel = math.prod(shape)
        if isinstance(kind, int):
            container = 8 if meta["packing"] == "int8" else kind
            out[name] = -(-numel * container // 8) + 2 * shape[0]
        else:
            out[name] = numel * getattr(torch, kind).itemsize
    return out
