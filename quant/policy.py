"""Quantization policy: which tensor is stored in which format, chosen by parameter name.

Defaults (the records' lessons): int6 per-row for attention and MLP matrices, int8 per-row for the
tied embedding (it is also the output head, errors there hit every logit), float16 passthrough for
vectors and control tensors (norm gains, attn/mlp scales, resid_mix, q_gain, skip weights, gates:
few bytes, and int8 there cost the reference PR more bpb than it saved bytes).

Groups, decided in this order:
  1. the first matching QUANT_OVERRIDES substring wins (bits 0 = float passthrough);
  2. "control": fewer than 2 dims, or a name containing a control pattern -> float passthrough;
  3. "embed": tok_emb / lm_head / embed -> embed_bits;  "attn": ".attn." -> attn_bits;
     "mlp": ".mlp." -> mlp_bits (these three are quantized whatever their size);
  4. "other": other matrices -> other_bits when numel > passthrough_max_numel, else float passthrough.
Tensors with more than 2 dims are quantized as [shape[0], prod(rest)].

Environment (all optional; an unknown QUANT_* name gets a warning, a bad value a ValueError):
  QUANT_ATTN_BITS=6  QUANT_MLP_BITS=6  QUANT_EMBED_BITS=8  QUANT_OTHER_BITS=8   (2..8)
  QUANT_MATRIX_BITS           sets attn and mlp bits at once (QUANT_ATTN_BITS / QUANT_MLP_BITS win)
  QUANT_FLOAT_DTYPE=float16|float32|bfloat16   storage of unquantized float tensors
  QUANT_PASSTHROUGH_MAX_NUMEL=65536   "other" matrices up to this size stay float
  QUANT_GPTQ_LITE=1           GPTQ-lite clip search (0: plain max-abs, as the QAT forward)
  QUANT_PRUNE_FRACTION=0      zero this fraction of smallest-|w| weights of each quantized matrix
  QUANT_PACKING=auto|int8|bits          QUANT_COMPRESSOR=auto|zlib|zstd|lzma
  QUANT_FIT=1                 step down bits / prune until the artifact fits BYTE_BUDGET
  QUANT_OVERRIDES="blocks.0.:8,lm_head:0"   substring:bits pairs, first match wins
  QUANT_CONTROL_PATTERNS="attn_scale,mlp_scale,..."  replaces the default control patterns
"""

import dataclasses
import json
import os
import warnings

from quant.core import QUANT_MAX_BITS, QUANT_MIN_BITS
from quant.packing import QUANT_PACKINGS

QUANT_COMPRESSORS = ("zlib", "zstd", "lzma")
QUANT_PASSTHROUGH_DTYPES = ("float16", "float32", "bfloat16")
QUANT_DEFAULT_CONTROL_PATTERNS = (
    "attn_scale", "mlp_scale", "resid_mix", "q_gain", "skip_weight", "smear", "gate", "gain", "lambda", "norm",
)
_QUANT_ENV_FIELDS = {
    "QUANT_ATTN_BITS": ("attn_bits", int), "QUANT_MLP_BITS": ("mlp_bits", int),
    "QUANT_EMBED_BITS": ("embed_bits", int), "QUANT_OTHER_BITS": ("other_bits", int),
    "QUANT_FLOAT_DTYPE": ("float_dtype", str), "QUANT_PASSTHROUGH_MAX_NUMEL": ("passthrough_max_numel", int),
    "QUANT_GPTQ_LITE": ("gptq_lite", bool), "QUANT_PRUNE_FRACTION": ("prune_fraction", float),
    "QUANT_PACKING": ("packing", str), "QUANT_COMPRESSOR": ("compressor", str),
    "QUANT_FIT": ("fit", bool), "QUANT_OVERRIDES": ("overrides", tuple),
    "QUANT_CONTROL_PATTERNS": ("control_patterns", tuple),
}
QUANT_ENV_NAMES = tuple(_QUANT_ENV_FIELDS) + ("QUANT_MATRIX_BITS",)  # for the trainer's unknown-variable check


def _quant_parse_env(var: str, raw: str, kind):
    try:
        if kind is bool:
            if raw.strip().lower() not in ("0", "1", "true", "false"):
                raise ValueError(raw)
            return raw.strip().lower() in ("1", "true")
        if kind is tuple and var == "QUANT_OVERRIDES":
            pairs = [item.rsplit(":", 1) for item in raw.split(",") if item.strip()]
            return tuple((pat.strip(), int(bits)) for pat, bits in pairs)
        if kind is tuple:
            return tuple(p.strip() for p in raw.split(",") if p.strip())
        return kind(raw.strip())
    except ValueError:
        expected = {bool: "0 or 1", int: "an integer", float: "a number", str: "a name"}.get(kind, "")
        if var == "QUANT_OVERRIDES":
            expected = "comma-separated substring:bits pairs, e.g. 'blocks.0.:8,lm_head:0'"
        raise ValueError(f"{var}={raw!r}: expected {expected}") from None


@dataclasses.dataclass(frozen=True)
class QuantPolicy:
    """Frozen description of the export format; see the module docstring for fields and env vars."""

    attn_bits: int = 6
    mlp_bits: int = 6
    embed_bits: int = 8
    other_bits: int = 8
    float_dtype: str = "float16"
    passthrough_max_numel: int = 65_536
    gptq_lite: bool = True
    prune_fraction: float = 0.0
    packing: str = "auto"
    compressor: str = "auto"
    fit: bool = True
    overrides: tuple = ()
    control_patterns: tuple = QUANT_DEFAULT_CONTROL_PATTERNS

    def __post_init__(self):
        object.__setattr__(self, "overrides", tuple((str(p), int(b)) for p, b in self.overrides))
        object.__setattr__(self, "control_patterns", tuple(str(p) for p in self.control_patterns))
        for field in ("attn_bits", "mlp_bits", "embed_bits", "other_bits"):
            bits = getattr(self, field)
            if not isinstance(bits, int) or not QUANT_MIN_BITS <= bits <= QUANT_MAX_BITS:
                raise ValueError(f"QuantPolicy.{field}={bits!r}: expected {QUANT_MIN_BITS}..{QUANT_MAX_BITS}")
        for pattern, bits in self.overrides:
            if bits != 0 and not QUANT_MIN_BITS <= bits <= QUANT_MAX_BITS:
                raise ValueError(f"QuantPolicy.overrides {pattern!r}:{bits}: bits must be 0 or {QUANT_MIN_BITS}..{QUANT_MAX_BITS}")
        checks = (
            ("float_dtype", QUANT_PASSTHROUGH_DTYPES), ("packing", ("auto",) + QUANT_PACKINGS),
            ("compressor", ("auto",) + QUANT_COMPRESSORS),
        )
        for field, allowed in checks:
            if getattr(self, field) not in allowed:
                raise ValueError(f"QuantPolicy.{field}={getattr(self, field)!r}: expected one of {allowed}")
        if not 0.0 <= self.prune_fraction < 1.0:
            raise ValueError(f"QuantPolicy.prune_fraction={self.prune_fraction!r}: expected [0, 1)")
        if self.passthrough_max_numel < 0:
            raise ValueError(f"QuantPolicy.passthrough_max_numel={self.passthrough_max_numel!r}: expected >= 0")

    @classmethod
    def from_env(cls, environ=None) -> "QuantPolicy":
        """Policy from QUANT_* variables of `environ` (default os.environ). ValueError names the var."""
        env = os.environ if environ is None else environ
        for var in env:
            if var.startswith("QUANT_") and var not in QUANT_ENV_NAMES:
                warnings.warn(f"unknown variable {var} ignored; known: {', '.join(sorted(_QUANT_ENV_FIELDS))}", stacklevel=2)
        kwargs = {field: _quant_parse_env(var, env[var], kind) for var, (field, kind) in _QUANT_ENV_FIELDS.items() if var in env}
        if "QUANT_MATRIX_BITS" in env:
            bits = _quant_parse_env("QUANT_MATRIX_BITS", env["QUANT_MATRIX_BITS"], int)
            kwargs = {"attn_bits": bits, "mlp_bits": bits, **kwargs}
        try:
            return cls(**kwargs)
        except ValueError as err:
            names = {field: var for var, (field, _) in _QUANT_ENV_FIELDS.items()}
            raise ValueError(f"{err} (check {', '.join(names[f] for f in kwargs) or 'the defaults'}"
                             f"{', QUANT_MATRIX_BITS' if 'QUANT_MATRIX_BITS' in env else ''})") from None

    def to_dict(self) -> dict:
        """JSON-serializable dict of every field (tuples become lists, as after a JSON round trip)."""
        return json.loads(json.dumps(dataclasses.asdict(self)))

    @classmethod
    def from_dict(cls, d: dict) -> "QuantPolicy":
        """Inverse of to_dict; ValueError on unknown fields or bad values."""
        names = {f.name for f in dataclasses.fields(cls)}
        if not isinstance(d, dict) or not set(d) <= names:
            raise ValueError(f"policy {d!r}: expected a dict with fields from {sorted(names)}")
        return cls(**d)

    def group_of(self, name: str, shape) -> str:
        """Group of a tensor: 'control', 'embed', 'attn', 'mlp' or 'other' (overrides not applied)."""
        if len(shape) < 2 or any(p in name for p in self.control_patterns):
            return "control"
        if "tok_emb" in name or "lm_head" in name or "embed" in name:
            return "embed"
        if ".attn." in name:
            return "attn"
        return "mlp" if ".mlp." in name else "other"

    def bits_for(self, name: str, shape) -> int | None:
        """Bits for parameter `name` of `shape` (tuple or torch.Size), or None for float passthrough."""
        for pattern, bits in self.overrides:
            if pattern in name:
                return bits or None
        group = self.group_of(name, shape)
        if group == "control":
            return None
        if group == "other":
            numel = 1
            for dim in shape:
                numel *= int(dim)
            return self.other_bits if numel > self.passthrough_max_numel else None
        return getattr(self, f"{group}_bits")
