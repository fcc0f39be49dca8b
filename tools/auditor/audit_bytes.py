"""Canonical tokens per byte of the challenge's val splits, and the byte-accounting test (tools/audit.py).

val_bpb = val_loss / ln 2 * tokens / bytes, so every final log line implies tokens / bytes =
val_bpb * ln 2 / val_loss. For a given tokenizer and val split that ratio is a fact: a log whose
implied ratio is off by more than rounding counted the val bytes differently (a custom byte table
counting byte-fallback pieces as 3 bytes, or the leading space twice, ...), or scored other text.

`CANONICAL_TOKENS_PER_BYTE` holds the official values. None was measured here: this machine has no
official val data (`python -m eval bytes` needs the val shards). Each value is DERIVED from the
logs committed in github.com/openai/parameter-golf (`records/`), as the median of val_bpb * ln 2 /
val_loss over the final lines printed with 8 decimals (rounding error < 1e-8), grouped by tokenizer
file and logged val token count; the spread column is the min..max over those lines (scripts score
slightly different token subsets: the roundtrip eval drops the tail that does not fill a sequence,
so the logged count depends on the sequence length). Cross-check: val tokens / ratio gives the
val split's byte count, 151.07-151.08 M bytes for sp1024, sp4096 and sp8192 alike, as it must for
one set of documents (the byte260 split logs 151,130,112 tokens = bytes + one BOS per document).

With `--tokenizer M --data-path D` the auditor measures the ratio instead (`measure_tokens_per_byte`,
the same count as `python -m eval bytes`: all val tokens but the first, bytes by the official LUT).
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

from primitives.files import sha256_file

# Relative allowance for scoring a different subset of the same split (observed within-split spread
# of 8-decimal lines in the official logs: up to 6.5e-5); a 0.1% byte miscount is 5x larger.
SUBSET_ALLOWANCE = 2e-4
VAL_TOKENS_MATCH = 2e-4  # logged val token counts of one split differ by < one sequence (<= 8,192 tokens)


@dataclasses.dataclass(frozen=True)
class CanonicalRatio:
    """One tokenizer x val split. `tokenizer`: the .model file name; `sha256`: of that file where
    known; `dataset`: the official dataset dir name; `val_tokens`: a logged val token count of the
    split (None: not logged); `half_width`: relative uncertainty of the value itself."""

    key: str
    tokenizer: str
    vocab_size: int
    dataset: str | None
    val_tokens: int | None
    tokens_per_byte: float
    spread: tuple
    half_width: float
    sha256: tuple
    source: str


CANONICAL_TOKENS_PER_BYTE = (
    CanonicalRatio(
        "sp1024", "fineweb_1024_bpe.model", 1024, "fineweb10B_sp1024", 62_021_632, 0.4105208, (0.4105110, 0.4105219),
        0.0, ("849ea920119b5135ace5016137e82ab397738fc29d723d5f9a6b74c4e31af191",),
        "derived: median of 126 exact final lines, 20+ records (e.g. track_10min_16mb/2026-03-19_SlidingWindowEval, "
        "2026-03-25_ValCalib_GPTQ_XSA_BigramHash3072/train_seed42.log:82); HF willdepueoai/parameter-golf export; "
        "sha256 is of the copy in ../shared, believed identical (the official repo does not commit it)"),
    CanonicalRatio(
        "sp1024-early", "fineweb_1024_bpe.model", 1024, "fineweb10B_sp1024", 63_779_840, 0.4094495,
        (0.4094495, 0.4094495), 0.0, (),
        "derived: track_10min_16mb/2026-03-17_NaiveBaseline/train.log:448 (an earlier export of the val split, "
        "63,779,840 tokens)"),
    CanonicalRatio(
        "sp4096", "fineweb_4096_bpe.model", 4096, "fineweb10B_sp4096", 45_508_608, 0.3012338, (0.3012338, 0.3012370),
        0.0, (),
        "derived: 19 exact lines of track_10min_16mb/2026-04-01_Vocab4096_MLPMult4_WD085 and "
        "2026-04-04_SP4096_DepthRecurrence_ParallelResid_MuonEqR (HF kevclark/parameter-golf export)"),
    CanonicalRatio(
        "sp4096-b", "fineweb_4096_bpe.model", 4096, "fineweb10B_sp4096", 45_514_752, 0.3012727, (0.3012727, 0.3012727),
        0.0, (),
        "derived: 9 exact lines of track_10min_16mb/2026-04-03_MuonEqR_DepthRecurrence_WD090_AllInt6 (another "
        "sp4096 tokenizer of the same name: 45,514,752 val tokens)"),
    CanonicalRatio(
        "sp8192", "fineweb_8192_bpe.model", 8192, "fineweb10B_sp8192", 40_540_160, 0.2683389, (0.2683302, 0.2683420),
        0.0, (),
        "derived: median of 102 exact lines, track_10min_16mb/2026-04-05 .. 2026-04-16 SP8192 records "
        "(HF kevclark/parameter-golf export)"),
    CanonicalRatio(
        "sp8192-ternary", "fineweb_8192_bpe.model", 8192, "fineweb10B_sp8192", None, 0.2683848, (0.2683782, 0.2683913),
        2.45e-5, ("4e979c92754cc9d7bdebd9dfe5edf3fc0b41b38714b394e4297fa851e3afd516",),
        "derived: intersection of the rounding intervals of the 4-decimal final lines of "
        "track_10min_16mb/2026-03-24_74M_Ternary_UNet_FP8_10L_8192BPE_YaRN_NeoMuon (ternary_log_*.txt) and "
        "track_non_record_16mb/2026-03-24_106M_Binary_* (binary_log.txt); the tokenizer file is committed there "
        "(= the copy in ../shared); its val tokenization differs from the kevclark export"),
    CanonicalRatio(
        "sp8192-caseops", "fineweb_8192_bpe_lossless_caps_caseops_v1_reserved.model", 8192, None, 47_851_520, 0.3167206,
        (0.3167206, 0.3167412), 0.0, ("97754754561f20def5edd99765ca0668f880bd94e67316d54aa10ab25f45cc4d",),
        "derived: 75 exact lines, track_10min_16mb/2026-04-18 .. 2026-04-29 CaseOps records (bytes from the "
        "original text by a byte sidecar; tokenizer committed in those folders)"),
    CanonicalRatio(
        "byte260", "byte260", 260, "fineweb10B_byte260", 151_130_112, 1.0003309, (1.0003309, 1.0003310), 0.0, (),
        "derived: 3 exact lines of track_non_record_16mb/2026-03-29_HNet_ByteVsSubword_Study (byte-level: one token "
        "per byte plus one BOS per document)"),
)


def candidates(*, tokenizer_name=None, sha256=None, vocab_size=None, dataset=None, val_tokens=None,
               byte_level=False) -> list:
    """Table entries that may describe a run with these facts (any fact may be None = unknown).
    A known sha256 selects the entries listing that hash (none: an unknown tokenizer file); otherwise
    the tokenizer file name must match. Vocab size, dataset dir name and val token count must match
    when both sides know them."""
    pool = CANONICAL_TOKENS_PER_BYTE
    if sha256:  # a known tokenizer file: only the entries that list its hash
        pool = [c for c in pool if sha256 in c.sha256]
    out = []
    for c in pool:
        if byte_level != (c.key == "byte260"):
            continue
        if tokenizer_name and not sha256 and not byte_level and Path(tokenizer_name).name != c.tokenizer:
            continue
        if vocab_size and vocab_size != c.vocab_size:
            continue
        if dataset and c.dataset and Path(str(dataset).rstrip("/")).name != c.dataset:
            continue
        if val_tokens and c.val_tokens and abs(val_tokens - c.val_tokens) > VAL_TOKENS_MATCH * c.val_tokens:
            continue
        out.append(c)
    return out


def ratio_deviation(implied: float, canonical: float) -> float:
    """Relative deviation implied / canonical - 1."""
    return implied / canonical - 1.0


def tolerance(rounding: float, half_width: float = 0.0) -> float:
    """Relative tolerance: the printed values' rounding + the canonical value's uncertainty + the
    subset allowance."""
    return rounding + half_width + SUBSET_ALLOWANCE


def measure_tokens_per_byte(tokenizer_path, data_path) -> dict:
    """Measure the ratio on real data: all val shards of `data_path` (sorted), targets = every token
    but the first, bytes by the official LUT rule, or for CaseOps data by its val byte sidecar (the
    original text's bytes, shards/sidecar.py: a log that divided by the transformed text's bytes, its
    operators counted, is off by their share and fails). Uses eval.offline; imports torch. Returns
    {"tokens_per_byte", "val_tokens", "val_bytes", "sha256", "vocab_size", "val_byte_count"}. Raises
    FileNotFoundError / ValueError naming the path for missing or malformed inputs (a CaseOps split
    without its sidecar, a tokenizer that is not the data's)."""
    import sentencepiece as spm

    from eval.offline import count_stream_bytes, load_val_byte_luts
    from shards.format import load_validation_tokens

    path = Path(tokenizer_path)
    if not path.is_file():
        raise FileNotFoundError(f"--tokenizer {tokenizer_path}: no such file")
    vocab = int(spm.SentencePieceProcessor(model_file=str(path)).vocab_size())
    luts, byte_count = load_val_byte_luts(path, vocab, data_path)
    tokens = load_validation_tokens(data_path, vocab_size=vocab)
    num_bytes = count_stream_bytes(tokens, luts)
    if num_bytes <= 0:
        raise ValueError(f"--data-path {data_path}: the val split has no bytes")
    return {"tokens_per_byte": (tokens.numel() - 1) / num_bytes, "val_tokens": int(tokens.numel()),
            "val_bytes": int(num_bytes), "sha256": sha256_file(path), "vocab_size": vocab, "val_byte_count": byte_count}


def implied_ratio(val_loss: float, val_bpb: float) -> float | None:
    return val_bpb * math.log(2) / val_loss if val_loss > 0 else None


def expected_base_bytes(model_path) -> list:
    """Per-id byte count of the official LUT for a SentencePiece model: 0 for control / unknown / unused
    ids, 1 for a byte-fallback id (`<0xE2>` is one byte of text), else the UTF-8 bytes of the piece
    without its leading `▁` (that space is counted separately)."""
    import sentencepiece as spm

    sp = spm.SentencePieceProcessor(model_file=str(model_path))
    out = []
    for i in range(sp.vocab_size()):
        if sp.is_control(i) or sp.is_unknown(i) or sp.is_unused(i):
            out.append(0)
        elif sp.is_byte(i):
            out.append(1)
        else:
            out.append(len(sp.id_to_piece(i).removeprefix("\u2581").encode("utf-8")))
    return out


def shipped_byte_tables(folder: Path) -> list:
    """[(status, text)] for each byte table a folder ships (`*.npz` with a `base_bytes` array): "fail" when
    a SentencePiece model shipped beside it gives other byte counts (byte-fallback ids counted as 3
    bytes, the U+FFFD length: the Scylla rows removed from the leaderboard, PR #1289 / #1806), "pass"
    when they agree, "n/a" when no shipped tokenizer lets it be recomputed."""
    import numpy as np

    out = []
    models = sorted(folder.glob("*.model")) + sorted(folder.glob("*/*.model"))
    for table in sorted(folder.glob("*.npz")) + sorted(folder.glob("*/*.npz")):
        try:
            with np.load(table, allow_pickle=False) as z:
                if "base_bytes" not in z.files:
                    continue
                base = [int(v) for v in z["base_bytes"]]
        except (OSError, ValueError) as e:
            out.append(("n/a", f"{table.name}: not readable ({e})"))
            continue
        rel = table.relative_to(folder)
        fitting = []
        for model in models:
            try:
                want = expected_base_bytes(model)
            except (OSError, RuntimeError) as e:
                out.append(("n/a", f"{model.name}: not a readable SentencePiece model ({e})"))
                continue
            if len(want) <= len(base):
                fitting.append((model, want))
        if not fitting:
            out.append(("n/a", f"{rel} ships a byte table of {len(base):,} ids; no SentencePiece model in the folder "
                               f"recomputes it"))
            continue
        model, want = fitting[0]
        bad = [i for i, w in enumerate(want) if base[i] != w]
        if bad:
            ex = ", ".join(f"id {i}: {base[i]} not {want[i]}" for i in bad[:3])
            out.append(("fail", f"{rel}: {len(bad):,} of {len(want):,} ids count other bytes than {model.name} gives "
                                f"({ex}; byte-fallback ids count 1 byte)"))
        else:
            out.append(("pass", f"{rel}: all {len(want):,} ids match the bytes recomputed from {model.name}"))
    return out
