"""Quantization policy: which tensor is stored in which format, chosen by parameter name.

Defaults: every matrix starts at int8 per-row and the fit (quant/fit.py, QUANT_FIT=1) steps tensors
down only as far as the byte budget needs: on one H100 the budget rarely binds (the best sp8192
1-GPU run stores every matrix in int8 at 15.82 MB), on 8 GPUs it does. Float16 passthrough for
vectors and control tensors (norm gains, attn/mlp scales, resid_mix, q_gain, skip weights, gates:
few bytes, and int8 there cost the reference PR more bpb than it saved bytes).

Groups, decided in this order (`group_of`, `bits_for`):
  1. the first matching QUANT_OVERRIDES substring wins (bits 0 = float passthrough);
  2. "control": fewer than 2 dims, or a name containing a control pattern -> float passthrough;
  3. `fitted`: the fit's per-tensor choice (exact parameter name -> bits);
  4. "embed": a name containing "emb" (tok_emb, embed) or "lm_head" -> embed_bits;
     "attn": ".attn." -> attn_bits;  "mlp": ".mlp." -> mlp_bits (quantized whatever their size);
     "other": other matrices -> other_bits when numel > passthrough_max_numel, else float passthrough.
A group's bits 0 (the default) means "not set": int8 to start with, and the fit may step its tensors
down; bits set explicitly (QUANT_ATTN_BITS=6, ...) or by an override are never changed by the fit.
Tensors with more than 2 dims are quantized as [shape[0], prod(rest)].

Environment (all optional; every field F reads QUANT_<F upper-cased>; an unknown QUANT_* name gets a
warning line, a bad value a ValueError naming the variable):
  QUANT_ATTN_BITS  QUANT_MLP_BITS  QUANT_EMBED_BITS  QUANT_OTHER_BITS   (2..8; unset: chosen by the fit)
  QUANT_MATRIX_BITS           sets attn and mlp bits at once (QUANT_ATTN_BITS / QUANT_MLP_BITS win)
  QUANT_FLOAT_DTYPE=float16|float32|bfloat16   storage of unquantized float tensors
  QUANT_PASSTHROUGH_MAX_NUMEL=65536   "other" matrices up to this size stay float
  QUANT_GPTQ_LITE=1           GPTQ-lite clip search (0: plain max-abs, as the QAT forward; bools are 0/1)
  QUANT_GPTQ=1                full GPTQ (quant/gptq.py) for the matrices with a calibration Hessian
  QUANT_PRUNE_FRACTION=0      zero this fraction of smallest-|w| weights of each quantized matrix
  QUANT_PACKING=auto|int8|bits   QUANT_SHUFFLE=auto|on|off   QUANT_COMPRESSOR=auto|zlib|zstd|lzma|brotli
  QUANT_FIT=1                 the most precise bits that fit BYTE_BUDGET (quant/fit.py)
  QUANT_OVERRIDES="blocks.0.:8,lm_head:0"   substring:bits pairs, first match wins
  QUANT_FITTED="blocks.3.mlp.fc.weight:6"   name:bits pairs, normally written by the fit itself
  QUANT_CONTROL_PATTERNS="attn_scale,mlp_scale,..."  replaces the default control patterns
  QUANT_SDCLIP=0              row scale k * std(row) / qmax instead of the clip search (quant/sdclip.py);
                              k per group: QUANT_SDCLIP_K_ATTN=13 _MLP=11.5 _EMBED=15 _OTHER=12.85 (0: that group
                              keeps the GPTQ-lite clip search)
  QUANT_LQER=0                rank-QUANT_LQER_RANK (4) correction of the QUANT_LQER_TOP_N (3) tensors with the
                              largest quantization error, int4 factors (quant/lqer.py)
  QUANT_GPTQ_RECORDS=0        PR #1855's GPTQ arithmetic: float32 factorization, damping before act-order, inputs that
                              never fire zeroed (quant/gptq.py; the default factors in float64)
  QUANT_GATE_INT8=0           attention gates (names ending ".attn_gate_w", 2-D, 32..8192 values) in int8 rows at
                              max |row| / 127 (PR #1855; the fit leaves them there); otherwise float passthrough
  QUANT_LQER_ASYM=0           with QUANT_LQER: PR #1855's factor form (A = U S in int2, B = V^T in signed int4 per 64)
  QUANT_GROUPED=0             also try the grouped container: role groups, rows sorted, a coder each (quant/grouped.py)
  QUANT_BASELINE_CLIP=0       PR #1617's rows (the official baseline's rule): clip at this |w| quantile (0.9999984),
                              scale max(clip / qmax, 1 / qmax) rounded with in float32, stored float16; QAT alike;
                              vectors rounded per tensor (int8 or an override's bits), kept as float32 values
  QUANT_GPTQ_EMBED=1          full GPTQ on the embedding / output head too, with the Hessian of the head's input
                              (the final norm's output; 0: the embedding gets the GPTQ-lite clip search)
A preset may set any of them (primitives/presets.py PRESET_QUANT, e.g. 8xh100-pr1855's quantizer); the environment
wins over the preset. from_env validates each variable on its own (a one-field policy) and prefixes the message with the
variable and its raw value.
"""

import dataclasses
import json
import lzma
import math
import os
import zlib
from collections.abc import Callable

import brotli
import zstandard

from primitives.env import BUNDLE_KIND, parse_env_value, warn_unknown_env
from primitives.presets import DEFAULT_PRESET, PRESET_QUANT

QUANT_COMPRESSORS = ("zlib", "zstd", "lzma", "brotli")  # container ids 1..4 (quant/artifact.py)


# the coders by the id the artifact (quant/artifact.py) and the grouped container's streams (quant/grouped.py) store:
# 0 stored (grouped streams only), 1 zlib (level 9), 2 zstd (level 22), 3 LZMA (.lzma "alone" format,
# preset 9 | extreme), 4 brotli (quality 11, window 2**24)
def quant_compress(raw: bytes, coder: int, /) -> bytes:
    """raw compressed by coder id `coder` (0..4, the comment above)."""
    return (raw if not coder else zlib.compress(raw, 9) if coder == 1 else zstandard.ZstdCompressor(22).compress(raw)
            if coder == 2 else lzma.compress(raw, lzma.FORMAT_ALONE, preset=9 | lzma.PRESET_EXTREME) if coder == 3
            else brotli.compress(raw, quality=11, lgwin=24))


def quant_inflate(data: bytes, coder: int, n: int, /) -> bytes:
    """Inverse of quant_compress, its output capped at n + 1 bytes (no zip bombs: a stream that inflates to more
    than its declared n bytes comes out n + 1 long; stored data as it is). An id above 4 is read as LZMA (the
    package's readers check the id first)."""
    return (data if not coder else zstandard.ZstdDecompressor().stream_reader(data).read(n + 1) if coder == 2
            else brotli.Decompressor().process(data, output_buffer_limit=n + 1) if coder == 4
            else (zlib.decompressobj() if coder == 1 else lzma.LZMADecompressor(lzma.FORMAT_ALONE)).decompress(data, n + 1))


@dataclasses.dataclass(frozen=True)
class QuantPolicy:
    """Frozen description of the export format; see the module docstring for fields and env vars.

    Fields (type, default): attn_bits/mlp_bits/embed_bits/other_bits (int 0 = unset, or 2..8),
    float_dtype (str, float16), passthrough_max_numel (int, 65536), gptq_lite (bool, True), gptq
    (bool, True), gptq_embed (bool, True), prune_fraction (float in [0, 1), 0), packing (auto/int8/bits), shuffle
    (auto/on/off), compressor (auto/zlib/zstd/lzma/brotli), fit (bool, True), overrides (tuple of
    (substring, bits 0|2..8)), fitted (tuple of (name, bits 2..8)), control_patterns (tuple of
    substrings); quant.offline.quant_policy_from_dict turns the lists of a JSON round trip back into
    tuples. ValueError naming the field for a bad value (a negative passthrough_max_numel just
    quantizes every "other" matrix).
    """

    attn_bits: int = 0
    mlp_bits: int = 0
    embed_bits: int = 0
    other_bits: int = 0
    float_dtype: str = "float16"
    passthrough_max_numel: int = 65536
    gptq_lite: bool = True
    gptq: bool = True
    prune_fraction: float = 0.0
    packing: str = "auto"
    shuffle: str = "auto"
    compressor: str = "auto"
    fit: bool = True
    overrides: tuple = ()
    fitted: tuple = ()
    control_patterns: tuple = ("attn_scale", "mlp_scale", "resid_mix", "q_gain", "skip_weight", "smear", "gate",
                               "gain", "lambda", "norm")
    # QUANT_SDCLIP (quant/sdclip.py, PR #1394): row scale k * std / qmax, k per group (PR #1855 / #1586)
    sdclip: bool = False
    sdclip_k_attn: float = 13.0
    sdclip_k_mlp: float = 11.5
    sdclip_k_embed: float = 15.0
    sdclip_k_other: float = 12.85
    # QUANT_LQER (quant/lqer.py, PR #1797 / #1855): rank-r correction of the top-N tensors' error
    lqer: bool = False
    lqer_rank: int = 4
    lqer_top_n: int = 3
    # QUANT_LQER_ASYM: PR #1855's factor form (A = U S int2, one scale; B = V^T int4 signed per 64; quant/lqer.py)
    lqer_asym: bool = False
    # QUANT_GPTQ_RECORDS: PR #1855's GPTQ arithmetic (float32 factorization, its damping order, dead inputs zeroed)
    gptq_records: bool = False
    # QUANT_GATE_INT8: PR #1855's int8 rows (max |row| / 127) for the attention gates, else float passthrough
    gate_int8: bool = False
    # QUANT_GROUPED (quant/grouped.py, PR #1855 / #1218): role groups, sorted rows, one coder each
    grouped: bool = False
    # QUANT_GPTQ_EMBED (PR #1394, #1586): full GPTQ also on the tied embedding, with the head input's Hessian. On:
    # on the CPU proxy (docs/quantization.md, 2 seeds) -0.0045 / -0.0089 bpb with the embedding at int6, +0.0001 /
    # -0.0008 at int8. Always written to the artifact's policy (an artifact without the key predates it: off)
    gptq_embed: bool = True
    # QUANT_BASELINE_CLIP: the official baseline's per-row rule at this |w| quantile, as PR #1617 quantizes (0.9999984):
    # w clamped to the row clip, scale max(clip / qmax, 1 / qmax) in float32, stored float16, no GPTQ / clip search
    # (primitives/baseline_quant.py quantize_per_row_baseline); the late-QAT forward rounds alike; vectors per tensor (int8,
    # or an override's bits), kept as their float32 values (quantize_per_tensor_baseline). 0: off
    baseline_clip: float = 0.0

    if BUNDLE_KIND == "package":  # the policy's domain is the kit's preflight, as the settings' are (docs/bundle.md)
        def __post_init__(self) -> None:
            bits = (0, *range(2, 9))
            for name, want in dict(attn_bits=bits, mlp_bits=bits, embed_bits=bits, other_bits=bits,
                                   float_dtype=("float16", "float32", "bfloat16"), packing=("auto", "int8", "bits"),
                                   shuffle=("auto", "on", "off"), compressor=("auto",) + QUANT_COMPRESSORS).items():
                if getattr(self, name) not in want:
                    raise ValueError(f"{name}={getattr(self, name)!r}: expected one of {want}")
            if not 0 <= self.prune_fraction < 1 or any(b and b not in bits for _, b in self.overrides + self.fitted) \
                    or any(b == 0 for _, b in self.fitted):
                raise ValueError(f"prune_fraction={self.prune_fraction!r} / overrides={self.overrides} / fitted="
                                 f"{self.fitted}: expected [0, 1) / bits 0 or 2..8 / bits 2..8")
            for name in ("sdclip_k_attn", "sdclip_k_mlp", "sdclip_k_embed", "sdclip_k_other"):
                if not 0 <= getattr(self, name) <= 1000:
                    raise ValueError(f"{name}={getattr(self, name)!r}: expected a number in [0, 1000] (0: the clip search)")
            if not 0 <= self.baseline_clip <= 1:
                raise ValueError(f"baseline_clip={self.baseline_clip!r}: expected a quantile in [0, 1] (0: off)")
            if not 1 <= self.lqer_rank <= 64 or not 0 <= self.lqer_top_n <= 10_000:
                raise ValueError(f"lqer_rank={self.lqer_rank!r} / lqer_top_n={self.lqer_top_n!r}: expected 1..64 / 0..10000")

    @classmethod
    def from_env(cls, environ: dict | None = None, log: Callable = print) -> "QuantPolicy":
        """Policy from the QUANT_* variables of `environ` (default os.environ), over the QUANT_* values of its
        PRESET (primitives/presets.py PRESET_QUANT; a variable set in `environ` wins, as for other settings).

        Each variable is parsed by its field's type (primitives/env.py's parser; tuple: comma-separated
        items, for QUANT_OVERRIDES / QUANT_FITTED name:bits pairs) and validated on its own (a
        one-field policy). QUANT_MATRIX_BITS is read first, so QUANT_ATTN_BITS / QUANT_MLP_BITS win
        over it. An unknown QUANT_* name gets one `WARNING: unknown setting` line through `log` (as
        the trainer's settings do); ValueError naming the variable and its value for a value that
        does not parse or is out of range.
        """
        env = os.environ if environ is None else environ
        env = {**PRESET_QUANT.get(env.get("PRESET", DEFAULT_PRESET), {}), **env}  # the preset's, under the environment
        fields = dataclasses.fields(cls)
        if BUNDLE_KIND == "package":  # the unknown-variable warning is the kit's, as for the settings (docs/bundle.md)
            warn_unknown_env(env, {f"QUANT_{f.name.upper()}" for f in fields} | {"QUANT_MATRIX_BITS"}, ("QUANT_",), log)
        kwargs = {}
        for f in fields:
            name, kind = f.name, type(f.default)
            # QUANT_MATRIX_BITS first: QUANT_ATTN_BITS / QUANT_MLP_BITS win over it
            for var in ("QUANT_MATRIX_BITS",) * (name in ("attn_bits", "mlp_bits")) + (f"QUANT_{name.upper()}",):
                if var not in env:
                    continue
                raw = env[var]
                if kind is not tuple:  # names the variable in its own error
                    kwargs[name] = parse_env_value(var, raw, kind)
                try:
                    if kind is tuple:
                        items = [i for i in raw.replace(" ", "").split(",") if i]
                        kwargs[name] = (tuple((p, int(b)) for p, b in (i.split(":") for i in items))
                                        if name in ("overrides", "fitted") else tuple(items))
                    if BUNDLE_KIND == "package":  # the policy's domain (__post_init__), on this field alone
                        cls(**{name: kwargs[name]})
                except ValueError as err:
                    raise ValueError(f"{var}={raw!r}: {err}") from None
        return cls(**kwargs)

    def to_dict(self) -> dict:
        """JSON-serializable dict of every field (tuples become lists, as after a JSON round trip);
        the fields from sdclip on (SDClip, LQER, grouped, ...; gptq_embed aside, always written) only where they
        differ from their defaults (so that an artifact written without them keeps its bytes)."""
        d = json.loads(json.dumps(dataclasses.asdict(self)))
        newer = list(d)[list(d).index("sdclip"):]
        return {k: v for k, v in d.items() if k not in newer or k == "gptq_embed" or v != getattr(QuantPolicy, k)}

    def group_of(self, name: str, shape: tuple) -> str:
        """'control', 'embed', 'attn', 'mlp' or 'other' (overrides and passthrough size not applied)."""
        if len(shape) < 2 or any(p in name for p in self.control_patterns):
            return "control"
        return "embed" if "emb" in name or "lm_head" in name else "attn" if ".attn." in name \
            else "mlp" if ".mlp." in name else "other"

    def bits_for(self, name: str, shape: tuple) -> int | None:
        """Bits for parameter `name` of `shape` (tuple or torch.Size), or None for float passthrough."""
        for pattern, bits in self.overrides:
            if pattern in name:
                return bits or None
        if self.baseline_clip and len(shape) < 2:  # PR #1617's vectors: per-tensor int8 (quant/artifact.py)
            return 8
        if self.int8_gate(name, shape):
            return 8
        group = self.group_of(name, shape)
        if group == "control" or group == "other" and math.prod(shape) <= self.passthrough_max_numel:
            return None
        return dict(self.fitted).get(name) or getattr(self, group + "_bits") or 8

    def int8_gate(self, name: str, shape: tuple) -> bool:
        """True for an attention gate stored in int8 rows (QUANT_GATE_INT8; PR #1855's size window 32..8192)."""
        return self.gate_int8 and name.endswith(".attn_gate_w") and len(shape) == 2 and 32 <= math.prod(shape) <= 8192

    def fittable(self, name: str, shape: tuple) -> bool:
        """True when the fit may change this tensor's bits: QUANT_FIT=1, quantized, its group's bits
        not set explicitly and no override matches it."""
        return bool(self.fit and not self.int8_gate(name, shape) and self.bits_for(name, shape)
                    and not getattr(self, self.group_of(name, shape) + "_bits")
                    and not any(p in name for p, _ in self.overrides))

    def with_bits(self, name: str, bits: int) -> "QuantPolicy":
        """A copy with tensor `name` at `bits` in `fitted` (the fit's per-tensor choice)."""
        return dataclasses.replace(self, fitted=tuple((n, b) for n, b in self.fitted if n != name) + ((name, bits),))
