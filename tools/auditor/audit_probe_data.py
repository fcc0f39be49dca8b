"""The run probe's toy data: a val split and a train split in the official shard format, made with
the folder's tokenizer or the challenge's (data/tokenizers), and their byte truth.

Documents are BOS followed by segments of ordinary pieces (no control, unknown, unused or byte pieces):
one of PHRASES fixed phrases of PHRASE_TOKENS pieces, then SEGMENT_ANCHORS pieces. In the val split each
anchor appears once and each phrase many times (sp1024: 6 documents of 168 tokens, each phrase 18 times):
an anchor locates the scored targets around it (tools/auditor/audit_probe_trace.py), and the phrases are
repeated text, so an eval-time n-gram or phrase cache sees contexts it has counted before and switches on
(closed PRs #806, #880, #887). The train split draws its anchors with replacement and holds the same
phrases (a cache prefilled from training data matches them too: PR #945). The decoded text is plain UTF-8.
`perturbed(val, t)` changes every token from index t on (condition 1's second run).
"""

from __future__ import annotations

import ast
import json
import re
from pathlib import Path

import numpy as np

CHALLENGE_VOCABS = (1024, 2048, 4096, 8192)
VAL_DOC_TOKENS = 168
VAL_DOCS = 6
SEGMENT_ANCHORS = 8
PHRASES = 4
PHRASE_TOKENS = 6
TRAIN_TOKENS = 40_000
WARMUP_MAX_TOKENS = 20_000  # the longest warm-up prefix the probe writes (eval time grows with it)
WARMUP_MARGIN_TOKENS = 512  # scored past the threshold before the anchored split starts
_EVALISH = re.compile(r"eval|score|val|ttt|ngram|cache|mix", re.I)
_COUNTISH = re.compile(r"token|count|seen|scored|total", re.I)
_ORDER_OPS = (ast.Lt, ast.LtE, ast.Gt, ast.GtE)


def challenge_tokenizer(vocab_size: int, shared: Path) -> Path | None:
    path = Path(shared) / "data" / "tokenizers" / f"fineweb_{vocab_size}_bpe.model"
    return path if path.is_file() else None


def pick_tokenizer(script: str, folder: Path, shared: Path) -> tuple:
    """(tokenizer path, vocab size, source words) for the script: a *.model in the folder whose name
    the script's TOKENIZER_PATH default names; else the challenge's sp1024 when the script reads
    VOCAB_SIZE and TOKENIZER_PATH or DATA_DIR (the official layout names the tokenizer by the
    vocabulary); else the challenge model of its VOCAB_SIZE default (8192 when it reads none).
    ValueError when none of them is here."""
    default = re.search(r"""["']TOKENIZER_PATH["']\s*,\s*(?:\n\s*)?f?["']([^"']+)""", script)
    vocab = re.search(r"""["']VOCAB_SIZE["']\s*,\s*["']?(\d+)""", script)
    vocab_size = int(vocab.group(1)) if vocab else 8192
    if default:
        name = Path(default.group(1)).name
        local = [p for p in Path(folder).rglob("*.model") if p.name == name]
        if local:
            return local[0], vocab_size, f"the folder's {local[0].relative_to(folder)}"
        m = re.search(r"fineweb_(\d+)_bpe\.model$", name)
        if m and challenge_tokenizer(int(m.group(1)), shared):
            vocab_size = int(m.group(1))
    reads = set(re.findall(r"""["']([A-Z_]+)["']""", script))
    if "VOCAB_SIZE" in reads and reads & {"TOKENIZER_PATH", "DATA_DIR"} and challenge_tokenizer(CHALLENGE_VOCABS[0], shared):
        vocab_size = CHALLENGE_VOCABS[0]  # its own settings allow the smallest challenge vocabulary: a cheaper sweep
    path = challenge_tokenizer(vocab_size, shared)
    if path is None:
        raise ValueError(f"no tokenizer for VOCAB_SIZE={vocab_size} (the challenge's are in {shared}/data/tokenizers)")
    return path, vocab_size, f"the challenge's {path.name}"


def ordinary_pieces(sp) -> np.ndarray:
    ids = [i for i in range(sp.vocab_size()) if not (sp.is_control(i) or sp.is_unknown(i) or sp.is_unused(i)
                                                     or sp.is_byte(i))]
    return np.array(ids, dtype=np.int64)


def make_stream(sp, docs: int, doc_tokens: int, rng, *, distinct: bool = False, phrases=None,
                pieces=None) -> np.ndarray:
    """BOS + doc_tokens pieces, `docs` times: segments of one of `phrases` (int64 [PHRASES, PHRASE_TOKENS], none
    when None) followed by SEGMENT_ANCHORS random ordinary pieces; `distinct`: no anchor twice and no
    anchor inside a phrase (ValueError when the vocabulary has too few); `pieces`: what anchors are drawn from
    (ordinary_pieces(sp) when None)."""
    pieces, bos = ordinary_pieces(sp) if pieces is None else pieces, sp.bos_id()
    phrases = np.zeros((0, PHRASE_TOKENS), np.int64) if phrases is None else np.asarray(phrases, np.int64)
    seg = SEGMENT_ANCHORS + (PHRASE_TOKENS if len(phrases) else 0)
    n_seg = -(-doc_tokens // seg)
    anchors = np.setdiff1d(pieces, phrases.reshape(-1)) if distinct else pieces
    need = docs * n_seg * SEGMENT_ANCHORS
    if distinct and need > len(anchors):
        raise ValueError(f"{need} distinct anchor tokens: the tokenizer has {len(anchors)} ordinary pieces to spare")
    drawn = rng.choice(anchors, size=need, replace=not distinct).reshape(docs, n_seg, SEGMENT_ANCHORS)
    which = rng.integers(0, max(len(phrases), 1), size=(docs, n_seg))
    rows = []
    for d in range(docs):
        body = [np.concatenate([phrases[which[d, j]], drawn[d, j]]) if len(phrases) else drawn[d, j]
                for j in range(n_seg)]  # a document ends on anchors: its last scored tokens can be located
        rows.append(np.concatenate([[bos], np.concatenate(body)[:doc_tokens]]))
    return np.concatenate(rows).astype(np.int64)


def make_phrases(sp, rng) -> np.ndarray:
    """PHRASES phrases of PHRASE_TOKENS distinct ordinary pieces, no piece in two of them: int64 [PHRASES, PHRASE_TOKENS]."""
    return rng.choice(ordinary_pieces(sp), size=PHRASES * PHRASE_TOKENS, replace=False).reshape(PHRASES, PHRASE_TOKENS)


def warmup_tokens(source: str) -> int:
    """The largest scored-token count an eval-time cache waits for before it switches on: an int constant (100 to
    WARMUP_MAX_TOKENS) that a count-like name (token, count, seen, scored, total) is compared with inside an eval-like
    function (its name holds eval, score, val, ttt, ngram, cache or mix); 0 when none. Closed PR #720's Hedge
    mixer scores the plain softmax until `self.total_tokens < 10000` is false; PR #880's caches wait for 5,000."""
    from tools.auditor.audit_parse import parse_any

    try:
        tree = parse_any(source)[0]
    except (SyntaxError, ValueError, RecursionError):
        return 0
    found = [0]
    for fn in ast.walk(tree):
        if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)) or not _EVALISH.search(fn.name):
            continue
        for n in ast.walk(fn):
            if not (isinstance(n, ast.Compare) and len(n.ops) == 1 and isinstance(n.ops[0], _ORDER_OPS)):
                continue
            for a, b in ((n.left, n.comparators[0]), (n.comparators[0], n.left)):
                name = a.id if isinstance(a, ast.Name) else a.attr if isinstance(a, ast.Attribute) else ""
                if (_COUNTISH.search(name) and isinstance(b, ast.Constant) and type(b.value) is int
                        and 100 <= b.value <= WARMUP_MAX_TOKENS):
                    found.append(b.value)
    return max(found)


def make_filler(sp, val: np.ndarray, phrases, n_tokens: int, rng) -> np.ndarray:
    """Documents (BOS + VAL_DOC_TOKENS pieces) of at least `n_tokens` tokens to put before the anchored val split:
    pieces drawn with replacement from the ordinary pieces that neither the phrases nor `val` hold (val's anchors
    stay unique; no phrase, whose repeats would make the prefix's 4-grams ambiguous). Its positions are located by
    their 4-grams (tools/auditor/audit_probe_trace.py ValIndex); a cache counts them and is warm when the
    anchored split, with its repeated phrases, starts."""
    pool = np.setdiff1d(ordinary_pieces(sp), np.concatenate([np.asarray(phrases).reshape(-1), val]))
    if len(pool) < 64:
        raise ValueError(f"a warm-up prefix needs filler pieces: the tokenizer has {len(pool)} to spare")
    docs = -(-n_tokens // (VAL_DOC_TOKENS + 1))
    return make_stream(sp, docs, VAL_DOC_TOKENS, rng, pieces=pool)


def perturbed(sp, val: np.ndarray, t: int) -> np.ndarray:
    """`val` with every token from index t on changed (BOS kept where it is): the non-BOS tokens there
    rotated by one place, so each piece keeps its count (an anchor stays unique)."""
    out, bos = val.copy(), sp.bos_id()
    idx = np.flatnonzero(val[t:] != bos) + t
    out[idx] = np.roll(val[idx], 1)
    return out


def write_split(data_dir: Path, val: np.ndarray, train: np.ndarray, bos: int, prefix: int = 0) -> None:
    from shards.format import write_data_shard

    data_dir.mkdir(parents=True, exist_ok=True)
    write_data_shard(data_dir / "fineweb_val_000000.bin", val)
    half = len(train) // 2
    write_data_shard(data_dir / "fineweb_train_000000.bin", train[:half])
    write_data_shard(data_dir / "fineweb_train_000001.bin", train[half:])
    np.save(data_dir / "probe_val.npy", val)
    np.save(data_dir / "probe_train.npy", train)
    (data_dir / "probe.json").write_text(json.dumps({"bos": int(bos), "prefix": int(prefix)}))


def write_byte_sidecar(data_dir: Path, sp, val: np.ndarray) -> None:
    """The CaseOps val byte sidecar (shards/sidecar.py: one uint16 per val token, 0 for BOS) of a plain split:
    each token's UTF-8 bytes in its document's text, for scripts that divide by a sidecar (PR #1855's line)."""
    from shards.format import write_data_shard

    bos = sp.bos_id()
    write_data_shard(Path(data_dir) / "fineweb_val_bytes_000000.bin",
                     np.array([0 if tok == bos else decoded_bytes(sp, val, [i]) for i, tok in enumerate(val.tolist())]))


def decoded_bytes(sp, val: np.ndarray, positions) -> int:
    """UTF-8 bytes of the text the scored targets decode to: each document's run of scored tokens
    decoded as one piece of text (SentencePiece drops the leading space of a document's first piece)."""
    scored = np.zeros(len(val), bool)
    scored[np.asarray(list(positions), dtype=np.int64)] = True
    bos, toks, total, start = sp.bos_id(), val.tolist(), 0, None

    # a run inside a document keeps its leading space: decoded after a plain-letters piece (the piece before it
    # may be a lone "▁", and SentencePiece strips every leading space of a decoded text, not one)
    letters = next(i for i in range(sp.vocab_size()) if sp.id_to_piece(i).isascii() and sp.id_to_piece(i).isalpha())

    def run_bytes(a: int, b: int) -> int:  # tokens a..b-1
        if a > 0 and toks[a - 1] != bos:
            return len(sp.decode([letters, *toks[a:b]]).encode("utf-8")) - len(sp.decode([letters]).encode("utf-8"))
        return len(sp.decode(toks[a:b]).encode("utf-8"))

    for i, tok in enumerate(toks + [bos]):
        inside = i < len(toks) and tok != bos and scored[i]
        if inside and start is None:
            start = i
        elif not inside and start is not None:
            total, start = total + run_bytes(start, i), None
    return total
