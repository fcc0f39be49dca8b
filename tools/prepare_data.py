"""Prepare challenge-format data: token shards (`fineweb_{train,val}_NNNNNN.bin`) + manifest.json.

Subcommands (run from the repo root; `python -m tools.prepare_data ...` works too):

  fineweb    Download a cached FineWeb export (shards + tokenizer) from a Hugging Face dataset repo,
             driven by the repo's manifest like the official data/cached_challenge_fineweb.py. The
             official repo willdepueoai/parameter-golf (the default) serves only sp1024; the sp4096
             and sp8192 exports of the same documents are in kevclark/parameter-golf. One command
             per variant (a --train-shards above what the repo has is refused, naming the count; 14
             shards of 100M tokens cover a 1-GPU preset's ~1.1B tokens in 600 s, 80 the 8xh100's):
               python tools/prepare_data.py fineweb --variant sp1024 --train-shards 14
               python tools/prepare_data.py fineweb --variant sp4096 --train-shards 14 --repo-id kevclark/parameter-golf
               python tools/prepare_data.py fineweb --variant sp8192 --train-shards 14 --repo-id kevclark/parameter-golf
             -> data/datasets/fineweb10B_<variant>/ (+ manifest.json in our format: source repo id,
                tokenizer sha256), data/tokenizers/fineweb_<vocab>_bpe.{model,vocab} and the repo's
                own manifest, fetched fresh on every run, in
                data/hub_manifests/<owner>/<name>/<remote root>/manifest.json. Needs the network.
  jsonl      Shard your own text with an existing SentencePiece model (offline):
               python tools/prepare_data.py jsonl --input docs.jsonl --tokenizer M.model \
                   --out data/datasets/mydocs_sp1024 --val-docs 50000
             Inputs: `.jsonl` (one `{"text": ...}` object per line; blank lines ignored) or `.txt`
             (documents are separated by one or more blank lines; the lines of a document keep
             their newlines); either may be gzipped (`.gz`).
  tokenizer  Train a SentencePiece BPE model with the official settings (offline):
               python tools/prepare_data.py tokenizer --input docs.jsonl --vocab-size 1024 \
                   --out data/tokenizers/mydocs_1024_bpe
  sample     Offline default for a fresh machine: ~380 documents of real English text that ships
             with Python (pydoc_data.topics), a 1024-vocab tokenizer trained on the train split
             and the shards, in one command (a few seconds):
               python tools/prepare_data.py sample --out data
             -> data/text/pydoc_sample.jsonl, data/tokenizers/pydoc_sample_1024_bpe.model,
                data/datasets/pydoc_sample_sp1024/. Deterministic for a given Python version (the
                help texts change between Python releases).

Shard format and document layout are the official ones: every document is [BOS] + sp.encode(text)
with no EOS, the first --val-docs documents form the val split and the rest train, shards hold
100,000,000 tokens (a document may continue in the next shard; val and train never share one).
Train documents whose hash equals a val document's hash are dropped, so the splits are disjoint;
doc hash = first 16 hex chars of sha256(UTF-8 text), one per line in doc_hashes_{val,train}.txt.
Every file is written as `name.tmp` and renamed; manifest.json is written last.
"""

import argparse
import gzip
import hashlib
import io
import json
import os
import random
import re
import shutil
import sys
import time
import zlib
from pathlib import Path, PurePosixPath

import numpy as np
import sentencepiece as spm
from tqdm import tqdm

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:  # `python tools/prepare_data.py` puts tools/, not the repo, on sys.path
    sys.path.insert(0, str(REPO_ROOT))

from tools.cli_errors import USER_ERRORS, ArgumentParser, report_user_error  # noqa: E402
from trainer.files import atomic_write_bytes  # noqa: E402
from trainer.shards import SHARD_MANIFEST_FORMAT, SHARD_TOKENS_PER_FILE, read_shard_header, write_data_shard  # noqa: E402

OFFICIAL_NUM_VAL_DOCS = 50_000
DOC_HASH_HEX_CHARS = 16
ENCODE_BATCH_DOCS = 1024
MAX_UINT16_VOCAB = 65536
DEFAULT_HF_REPO_ID = "willdepueoai/parameter-golf"
LARGE_VOCAB_HF_REPO_ID = "kevclark/parameter-golf"  # sp4096 / sp8192 exports of the same documents
HUB_MANIFESTS_DIR = "hub_manifests"
DEFAULT_HF_REMOTE_ROOT = "datasets"
JSONL_SUFFIXES = (".jsonl", ".json", ".ndjson")
TEXT_SUFFIXES = (".txt", ".text", ".md")
# Settings of the official SentencePiece exports (openai/parameter-golf
# data/download_hf_docs_and_tokenize.py, build_sentencepiece_tokenizer).
SP_TRAINER_OPTIONS = {
    "model_type": "bpe",
    "character_coverage": 0.999,
    "byte_fallback": True,
    "split_digits": True,
    "normalization_rule_name": "nmt_nfkc",
    "add_dummy_prefix": False,
    "pad_id": 0,
    "bos_id": 1,
    "eos_id": 2,
    "unk_id": 3,
    "hard_vocab_limit": False,
}
SAMPLE_NAME = "pydoc_sample"
SAMPLE_MIN_DOC_CHARS = 1200
SAMPLE_SHUFFLE_SEED = 1337
SAMPLE_VAL_FRACTION = 0.1
OFFLINE_MODES_HINT = (
    "Offline alternatives: `python tools/prepare_data.py sample --out data` (real English text that "
    "ships with Python, no network) or `python tools/prepare_data.py jsonl --input DOCS.jsonl "
    "--tokenizer MODEL --out DIR --val-docs N` (your own text)."
)


class HubUnreachableError(RuntimeError):
    """The Hugging Face Hub could not be reached (no network, offline mode, DNS, timeout)."""


# ----------------------------------------------------------------------------- small helpers


def doc_hash(text: str) -> str:
    """Document hash used for split-disjointness checks: first 16 hex chars of sha256(UTF-8)."""
    return hashlib.sha256(text.encode("utf-8")).hexdigest()[:DOC_HASH_HEX_CHARS]


def sha256_file(path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _fsync_replace(tmp: Path, path: Path) -> None:
    with open(tmp, "rb+") as f:
        os.fsync(f.fileno())
    os.replace(tmp, path)


def manifest_header(tokenizer_path: Path, vocab_size: int, bos_id: int) -> dict:
    """The keys every manifest.json starts with (format, tokenizer identity, BOS, no EOS)."""
    return {"format": SHARD_MANIFEST_FORMAT, "format_version": 1, "tokenizer": tokenizer_path.name,
            "tokenizer_sha256": sha256_file(tokenizer_path), "vocab_size": vocab_size, "bos_id": bos_id,
            "append_eos": False}


def write_json_atomic(path, obj) -> None:
    atomic_write_bytes(path, (json.dumps(obj, indent=2) + "\n").encode())


def _input_kind(path: Path) -> str:
    suffixes = [s.lower() for s in path.suffixes]
    if suffixes[-1:] == [".gz"]:
        suffixes = suffixes[:-1]
    suffix = suffixes[-1] if suffixes else ""
    if suffix in JSONL_SUFFIXES:
        return "jsonl"
    if suffix in TEXT_SUFFIXES:
        return "text"
    raise ValueError(f"input {path}: unsupported file type {suffix or '(none)'!r}; expected one of "
                     f"{', '.join(JSONL_SUFFIXES + TEXT_SUFFIXES)} (optionally .gz)")


def check_inputs(paths) -> list[Path]:
    """Resolve input paths; FileNotFoundError / ValueError before any long work."""
    if not paths:
        raise ValueError("no --input files given")
    out = []
    for p in paths:
        p = Path(p)
        if p.is_dir():
            raise ValueError(f"--input {p}: is a folder; expected a .jsonl or .txt file (optionally .gz)")
        if not p.is_file():
            raise FileNotFoundError(f"--input {p}: no such file; expected a .jsonl or .txt file (optionally .gz)")
        _input_kind(p)
        out.append(p)
    return out


def iter_documents(paths):
    """Yield the documents (str) of the input files in order.

    `.jsonl`: one JSON object with a string "text" per line (blank lines skipped).
    `.txt`: documents separated by one or more blank (whitespace-only) lines.
    Raises ValueError naming file and line for bad JSON, a missing "text" or non-UTF-8 bytes, and
    naming the file for a truncated or damaged .gz.
    """
    for path in paths:
        path = Path(path)
        kind = _input_kind(path)
        opener = gzip.open if path.suffix.lower() == ".gz" else open
        lineno = 0
        try:
            with opener(path, "rb") as raw:
                f = _decoded_lines(raw, path)
                if kind == "jsonl":
                    for lineno, line in enumerate(f, 1):
                        if not line.strip():
                            continue
                        try:
                            obj = json.loads(line)
                        except json.JSONDecodeError as exc:
                            raise ValueError(f"{path}:{lineno}: invalid JSON: {exc.msg} (column {exc.colno})") from None
                        if not isinstance(obj, dict) or not isinstance(obj.get("text"), str):
                            raise ValueError(f'{path}:{lineno}: expected a JSON object with a string "text" field')
                        yield obj["text"]
                else:
                    block = []
                    for line in f:
                        if line.strip():
                            block.append(line.rstrip("\n"))
                        elif block:
                            yield "\n".join(block)
                            block = []
                    if block:
                        yield "\n".join(block)
        except (EOFError, zlib.error, gzip.BadGzipFile) as exc:
            raise ValueError(f"{path}: damaged or truncated gzip file after line {lineno} ({exc}); expected a "
                             "complete .gz file") from None


def _decoded_lines(raw, path):
    """Lines of the binary file `raw` as str (newlines kept as "\n"), each decoded on its own so that
    a non-UTF-8 byte is reported on its own line: ValueError "PATH:LINE: not UTF-8 text"."""
    for lineno, line in enumerate(raw, 1):
        try:
            text = line.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise ValueError(f"{path}:{lineno}: not UTF-8 text ({exc.reason} at byte {exc.start} of the line); "
                             "expected UTF-8") from None
        yield text[:-2] + "\n" if text.endswith("\r\n") else text


def load_tokenizer(path) -> spm.SentencePieceProcessor:
    """Load a SentencePiece model and check it can write uint16 shards with a BOS per document."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"tokenizer model {path} does not exist")
    try:
        sp = spm.SentencePieceProcessor(model_file=str(path))
    except (OSError, RuntimeError) as exc:
        raise ValueError(f"tokenizer {path}: not a SentencePiece model: {exc}") from None
    check_tokenizer(sp, path)
    return sp


def check_tokenizer(sp, name) -> None:
    """ValueError if vocab_size > 65536 (ids must fit uint16) or the model has no BOS id."""
    vocab_size = int(sp.vocab_size())
    if vocab_size > MAX_UINT16_VOCAB:
        raise ValueError(f"tokenizer {name}: vocab_size {vocab_size} > {MAX_UINT16_VOCAB}: ids do not fit uint16 shards")
    if int(sp.bos_id()) < 0:
        raise ValueError(f"tokenizer {name}: has no BOS id; every document must start with [BOS]")


# ----------------------------------------------------------------------------- sharding


class _SplitWriter:
    """Accumulates one split's tokens and writes full shards of `shard_tokens` tokens."""

    def __init__(self, out_dir: Path, split: str, shard_tokens: int):
        self.out_dir, self.split, self.shard_tokens = out_dir, split, shard_tokens
        self.buf = None
        self.fill = 0
        self.shards: list[str] = []
        self.num_docs = 0
        self.num_tokens = 0

    def add(self, tokens: np.ndarray) -> None:
        if self.buf is None:
            self.buf = np.empty(self.shard_tokens, dtype=np.uint16)
        self.num_docs += 1
        self.num_tokens += tokens.size
        pos = 0
        while pos < tokens.size:
            take = min(self.shard_tokens - self.fill, tokens.size - pos)
            self.buf[self.fill:self.fill + take] = tokens[pos:pos + take]
            self.fill += take
            pos += take
            if self.fill == self.shard_tokens:
                self.flush()

    def flush(self) -> None:
        if self.fill == 0:
            return
        name = f"fineweb_{self.split}_{len(self.shards):06d}.bin"
        write_data_shard(self.out_dir / name, self.buf[:self.fill])
        self.shards.append(name)
        self.fill = 0


def _clear_outputs(out_dir: Path) -> None:
    # Only files this tool owns; a half-rewritten dir must not keep an old (valid-looking) manifest.
    for pattern in ("manifest.json", "fineweb_train_*.bin", "fineweb_val_*.bin", "doc_hashes_*.txt", "*.tmp"):
        for stale in out_dir.glob(pattern):
            stale.unlink()


def shard_documents(docs_factory, tokenizer_path, out_dir, *, num_val_docs: int, max_docs=None,
                    shard_tokens: int = SHARD_TOKENS_PER_FILE, source=None, progress=True, log=print) -> dict:
    """Tokenize documents into challenge shards + doc hash files + manifest.json in `out_dir`.

    docs_factory() must return a fresh iterable of str each call: pass 1 validates and counts
    (errors before the long work), pass 2 encodes in batches of 1024 with sp.encode(list).
    Each document becomes [BOS] + sp.encode(text) (uint16, no EOS). The first num_val_docs
    documents are val; train documents whose hash is a val hash are dropped and counted.
    Returns the manifest dict. Raises ValueError for no documents, num_val_docs outside
    [1, num_docs), bad --max-docs/--shard-tokens, or ids >= vocab_size.
    """
    out_dir = Path(out_dir)
    if shard_tokens <= 0:
        raise ValueError(f"--shard-tokens must be positive, got {shard_tokens}")
    if max_docs is not None and max_docs <= 0:
        raise ValueError(f"--max-docs must be positive, got {max_docs}")
    if num_val_docs <= 0:
        raise ValueError(f"--val-docs must be positive, got {num_val_docs}")
    sp = load_tokenizer(tokenizer_path)
    vocab_size, bos_id = int(sp.vocab_size()), int(sp.bos_id())

    num_docs = 0
    val_hashes = set()
    for text in docs_factory():  # pass 1: validate every line, count, hash the val docs
        if max_docs is not None and num_docs >= max_docs:
            break
        if num_docs < num_val_docs:
            val_hashes.add(doc_hash(text))
        num_docs += 1
    if num_docs == 0:
        raise ValueError("input holds no documents")
    if num_val_docs >= num_docs:
        raise ValueError(f"--val-docs {num_val_docs} must be smaller than the number of documents ({num_docs}) "
                         "so that the train split is not empty")

    out_dir.mkdir(parents=True, exist_ok=True)
    _clear_outputs(out_dir)
    writers = {s: _SplitWriter(out_dir, s, shard_tokens) for s in ("val", "train")}
    hash_tmp = {s: out_dir / f"doc_hashes_{s}.txt.tmp" for s in ("val", "train")}
    hash_files = {s: open(p, "w", encoding="ascii", newline="\n") for s, p in hash_tmp.items()}
    num_dropped = 0
    t0 = time.perf_counter()
    bar = tqdm(total=num_docs, unit="doc", desc=f"tokenize {out_dir.name}", disable=not progress, file=sys.stderr)
    try:
        index = 0
        batch: list[str] = []

        def encode_batch(texts):
            nonlocal index, num_dropped
            for text, ids in zip(texts, sp.encode(texts, out_type=int), strict=True):
                split = "val" if index < num_val_docs else "train"
                index += 1
                h = doc_hash(text)
                if split == "train" and h in val_hashes:
                    num_dropped += 1
                    continue
                if split == "train":
                    writers["val"].flush()  # val and train never share a shard
                toks = np.empty(len(ids) + 1, dtype=np.int64)
                toks[0] = bos_id
                toks[1:] = ids
                if toks.size and (int(toks.max()) >= vocab_size or int(toks.min()) < 0):
                    raise ValueError(f"document {index - 1}: token id outside [0, {vocab_size}) from {tokenizer_path}")
                writers[split].add(toks.astype(np.uint16))
                hash_files[split].write(h + "\n")
            bar.update(len(texts))

        for text in docs_factory():
            if index + len(batch) >= num_docs:
                break
            batch.append(text)
            if len(batch) == ENCODE_BATCH_DOCS:
                encode_batch(batch)
                batch = []
        if batch:
            encode_batch(batch)
        assert index == num_docs, (index, num_docs)
        for w in writers.values():
            w.flush()
    finally:
        bar.close()
        for f in hash_files.values():
            f.close()
    for split, tmp in hash_tmp.items():
        _fsync_replace(tmp, out_dir / f"doc_hashes_{split}.txt")
    if writers["train"].num_docs == 0:
        raise ValueError(f"all {num_dropped} train documents duplicate val documents; the train split is empty")
    if num_dropped:
        log(f"dropped {num_dropped} train documents identical to val documents (splits kept disjoint)")

    tokenizer_path = Path(tokenizer_path)
    manifest = {
        **manifest_header(tokenizer_path, vocab_size, bos_id),
        "shard_tokens": shard_tokens,
        "splits": {
            split: {
                "num_docs": w.num_docs,
                "num_tokens": w.num_tokens,
                "shards": w.shards,
                "doc_hashes_file": f"doc_hashes_{split}.txt",
            }
            for split, w in writers.items()
        },
        "source": dict(source or {}, tokenizer_path=str(tokenizer_path), num_input_docs=num_docs,
                       num_val_docs_requested=num_val_docs, max_docs=max_docs),
    }
    manifest["splits"]["train"]["num_dropped_overlap_docs"] = num_dropped
    write_json_atomic(out_dir / "manifest.json", manifest)
    seconds = time.perf_counter() - t0
    log(f"wrote {out_dir}: val {writers['val'].num_docs} docs {writers['val'].num_tokens} tokens "
        f"({len(writers['val'].shards)} shards), train {writers['train'].num_docs} docs "
        f"{writers['train'].num_tokens} tokens ({len(writers['train'].shards)} shards) in {seconds:.1f}s")
    return manifest


def prepare_jsonl_dataset(inputs, tokenizer_path, out_dir, *, num_val_docs: int, max_docs=None,
                          shard_tokens: int = SHARD_TOKENS_PER_FILE, progress=True, log=print) -> dict:
    """`jsonl` subcommand: shard .jsonl/.txt inputs with an existing tokenizer (see shard_documents)."""
    paths = check_inputs(inputs)
    if Path(out_dir).exists() and not Path(out_dir).is_dir():
        raise ValueError(f"--out {out_dir}: is a file; expected a dataset folder (created if missing)")
    load_tokenizer(tokenizer_path)  # fail on a bad model before reading the inputs
    source = {"command": "jsonl", "inputs": [str(p) for p in paths],
              "input_bytes": [p.stat().st_size for p in paths]}
    return shard_documents(lambda: iter_documents(paths), tokenizer_path, out_dir, num_val_docs=num_val_docs,
                           max_docs=max_docs, shard_tokens=shard_tokens, source=source, progress=progress, log=log)


# ----------------------------------------------------------------------------- tokenizer


def train_tokenizer(docs_factory, vocab_size: int, out_prefix, *, input_sentence_size: int = 1_000_000,
                    max_sentence_length=None, byte_fallback: bool = True, seed: int = 0, verbose=False,
                    log=print) -> Path:
    """Train a SentencePiece BPE model with the official settings; returns PREFIX.model.

    Each document (NUL -> space, stripped, empties skipped, as the official export does) is one
    sentence; at most input_sentence_size of them are sampled (seeded). Documents longer than
    max_sentence_length bytes (SentencePiece default 4192) are skipped by the trainer, as in the
    official export. Writes PREFIX.model and PREFIX.vocab via temporary names + rename; the bytes
    depend only on the documents and options (trained in memory, so no path is stored).
    Raises ValueError for vocab_size outside [8, 65536] or a failed training run.
    """
    if not 8 <= vocab_size <= MAX_UINT16_VOCAB:
        raise ValueError(f"--vocab-size must be in [8, {MAX_UINT16_VOCAB}], got {vocab_size}")
    out_prefix = Path(out_prefix)
    out_prefix.parent.mkdir(parents=True, exist_ok=True)

    def sentences():
        for text in docs_factory():
            text = text.replace("\x00", " ").strip()
            if text:
                yield text

    options = dict(SP_TRAINER_OPTIONS, vocab_size=vocab_size, byte_fallback=byte_fallback,
                   input_sentence_size=input_sentence_size, shuffle_input_sentence=True)
    if max_sentence_length is not None:
        options["max_sentence_length"] = max_sentence_length
    spm.set_random_generator_seed(seed)
    t0 = time.perf_counter()
    model_bytes = io.BytesIO()  # in memory: no model_prefix path baked into the proto -> same bytes anywhere
    try:
        spm.SentencePieceTrainer.train(sentence_iterator=sentences(), model_writer=model_bytes,
                                       minloglevel=0 if verbose else 2, **options)
    except RuntimeError as exc:
        raise ValueError(f"SentencePiece training for {out_prefix} failed: {exc}") from None
    sp = spm.SentencePieceProcessor(model_proto=model_bytes.getvalue())
    model_path = out_prefix.with_name(out_prefix.name + ".model")
    vocab_path = out_prefix.with_name(out_prefix.name + ".vocab")
    tmp = model_path.with_name(model_path.name + ".tmp")
    tmp.write_bytes(model_bytes.getvalue())
    _fsync_replace(tmp, model_path)
    tmp = vocab_path.with_name(vocab_path.name + ".tmp")  # same text as spm_train's PREFIX.vocab
    with open(tmp, "w", encoding="utf-8", newline="\n") as f:
        f.writelines(f"{sp.id_to_piece(i)}\t{sp.get_score(i):g}\n" for i in range(sp.vocab_size()))
    _fsync_replace(tmp, vocab_path)
    if sp.vocab_size() != vocab_size:
        log(f"warning: {model_path} has {sp.vocab_size()} pieces, fewer than --vocab-size {vocab_size} "
            "(hard_vocab_limit=False and too little text)")
    log(f"trained {model_path} (vocab {sp.vocab_size()}) in {time.perf_counter() - t0:.1f}s")
    return model_path


# ----------------------------------------------------------------------------- sample


def sample_documents() -> list[str]:
    """Real English documents from Python's own help texts (stdlib pydoc_data.topics), shuffled.

    Each help topic is split at blank lines into paragraphs; consecutive paragraphs of one topic
    are joined ("\\n\\n") until a document holds >= 1200 characters. Exact duplicates (some
    topics share text) are removed, then the order is shuffled with seed 1337 (the official
    export also shuffles its documents). Deterministic for one Python version.
    """
    from pydoc_data.topics import topics

    docs = []
    for key in sorted(topics):
        block: list[str] = []
        for para in re.split(r"\n[ \t]*\n", topics[key]):
            para = para.strip("\n")
            if not para.strip():
                continue
            block.append(para)
            if sum(len(p) for p in block) >= SAMPLE_MIN_DOC_CHARS:
                docs.append("\n\n".join(block))
                block = []
        if block:
            docs.append("\n\n".join(block))
    docs = list(dict.fromkeys(docs))
    random.Random(SAMPLE_SHUFFLE_SEED).shuffle(docs)
    return docs


def build_sample(out_root, *, vocab_size: int = 1024, num_val_docs=None, shard_tokens: int = SHARD_TOKENS_PER_FILE,
                 progress=True, log=print) -> dict:
    """`sample` subcommand: text + tokenizer + shards under out_root, no network.

    Writes out_root/text/pydoc_sample.jsonl, out_root/tokenizers/pydoc_sample_<V>_bpe.{model,vocab}
    (trained on the train documents only, so the tokenizer never saw val text) and
    out_root/datasets/pydoc_sample_sp<V>/. num_val_docs defaults to 10% of the documents.
    Returns {"data_path", "tokenizer_path", "vocab_size", "manifest"}.
    """
    out_root = Path(out_root)
    docs = sample_documents()
    if num_val_docs is None:
        num_val_docs = max(1, round(len(docs) * SAMPLE_VAL_FRACTION))
    if not 0 < num_val_docs < len(docs):
        raise ValueError(f"--val-docs must be in [1, {len(docs) - 1}] for the sample, got {num_val_docs}")
    if not 8 <= vocab_size <= MAX_UINT16_VOCAB:  # before anything is written
        raise ValueError(f"--vocab-size must be in [8, {MAX_UINT16_VOCAB}], got {vocab_size}")
    if shard_tokens <= 0:
        raise ValueError(f"--shard-tokens must be positive, got {shard_tokens}")
    text_path = out_root / "text" / f"{SAMPLE_NAME}.jsonl"
    text_path.parent.mkdir(parents=True, exist_ok=True)
    tmp = text_path.with_name(text_path.name + ".tmp")
    tmp.write_text("".join(json.dumps({"text": d}, ensure_ascii=False) + "\n" for d in docs), encoding="utf-8")
    _fsync_replace(tmp, text_path)
    prefix = out_root / "tokenizers" / f"{SAMPLE_NAME}_{vocab_size}_bpe"
    model_path = train_tokenizer(lambda: iter(docs[num_val_docs:]), vocab_size, prefix, log=log)
    trained_vocab = spm.SentencePieceProcessor(model_file=str(model_path)).vocab_size()
    if trained_vocab != vocab_size:
        raise ValueError(f"sample tokenizer {model_path} has {trained_vocab} pieces, expected {vocab_size}")
    data_path = out_root / "datasets" / f"{SAMPLE_NAME}_sp{vocab_size}"
    source = {"command": "sample", "text": "pydoc_data.topics (Python standard library help texts)",
              "python_version": sys.version.split()[0], "text_file": str(text_path),
              "shuffle_seed": SAMPLE_SHUFFLE_SEED, "min_doc_chars": SAMPLE_MIN_DOC_CHARS}
    manifest = shard_documents(lambda: iter(docs), model_path, data_path, num_val_docs=num_val_docs,
                               shard_tokens=shard_tokens, source=source, progress=progress, log=log)
    return {"data_path": data_path, "tokenizer_path": model_path, "vocab_size": vocab_size, "manifest": manifest}


# ----------------------------------------------------------------------------- fineweb (Hugging Face)


def dataset_dir_for_variant(variant: str) -> str:
    """Official dataset dir name: sp1024 -> fineweb10B_sp1024, byte260 -> fineweb10B_byte260."""
    if variant == "byte260" or re.fullmatch(r"sp[0-9]+", variant):
        return f"fineweb10B_{variant}"
    raise ValueError(f"--variant {variant!r}: expected sp<VOCAB_SIZE> (e.g. sp1024) or byte260")


def local_path_for_remote(remote_path: str, remote_root: str, out_root) -> Path:
    """Map `<remote_root>/datasets/X` -> out_root/datasets/X, `<remote_root>/tokenizers/X` ->
    out_root/tokenizers/X, `<remote_root>/manifest.json` -> out_root/manifest.json."""
    parts = PurePosixPath(remote_path).parts
    if remote_root and parts[:1] == (remote_root,):
        parts = parts[1:]
    if not parts or any(p in ("..", ".", "") or "/" in p or "\\" in p for p in parts) or PurePosixPath(remote_path).is_absolute():
        raise ValueError(f"refusing remote path {remote_path!r} (empty, absolute or with '..')")
    return Path(out_root).joinpath(*parts)


_REPO_ID_PART = re.compile(r"[A-Za-z0-9](?:[A-Za-z0-9._-]*[A-Za-z0-9])?")


def check_repo_id(repo_id) -> tuple:
    """Split a Hugging Face repo id `owner/name` into (owner, name), each safe as a path part.

    Raises ValueError naming --repo-id for anything else: not two parts, characters other than
    letters, digits, '-', '_', '.', a part starting or ending with '-'/'.', or containing '..'/'--'.
    """
    parts = repo_id.split("/") if isinstance(repo_id, str) else []
    if len(parts) != 2 or not all(_REPO_ID_PART.fullmatch(p) and ".." not in p and "--" not in p for p in parts):
        raise ValueError(f"--repo-id {repo_id!r}: expected a Hugging Face dataset repo id 'owner/name' (letters, "
                         f"digits, '-', '_', '.'), e.g. {DEFAULT_HF_REPO_ID} or {LARGE_VOCAB_HF_REPO_ID}")
    return parts[0], parts[1]


def hub_manifest_remote_path(remote_root: str) -> str:
    return f"{remote_root}/manifest.json" if remote_root else "manifest.json"


def hub_manifest_local_path(out_root, repo_id: str, remote_root: str = DEFAULT_HF_REMOTE_ROOT) -> Path:
    """Where the manifest of dataset repo `repo_id` is kept, one per repo (and remote root):
    out_root/hub_manifests/<owner>/<name>/<remote_root>/manifest.json.
    Raises ValueError for a repo id that is not `owner/name` or a remote root with '..'."""
    owner, name = check_repo_id(repo_id)
    return local_path_for_remote(hub_manifest_remote_path(remote_root), "", Path(out_root) / HUB_MANIFESTS_DIR / owner / name)


def hf_download(repo_id: str, remote_path: str) -> Path:
    """Download one file of the dataset repo into the Hugging Face cache; return its cached path."""
    from huggingface_hub import hf_hub_download

    remote = PurePosixPath(remote_path)
    subfolder = None if str(remote.parent) == "." else str(remote.parent)
    return Path(hf_hub_download(repo_id=repo_id, filename=remote.name, subfolder=subfolder, repo_type="dataset"))


_UNREACHABLE_NAMES = {"LocalEntryNotFoundError", "OfflineModeIsEnabled", "ConnectionError", "ConnectError",
                      "ConnectTimeout", "TimeoutError", "TimeoutException", "NetworkError", "gaierror"}


def _is_unreachable(exc: BaseException) -> bool:
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if any(cls.__name__ in _UNREACHABLE_NAMES for cls in type(exc).__mro__):
            return True
        exc = exc.__cause__ or exc.__context__
    return False


def download_fineweb(variant: str, train_shards: int, out_root="data", *, repo_id: str = DEFAULT_HF_REPO_ID,
                     remote_root: str = DEFAULT_HF_REMOTE_ROOT, downloader=hf_download, progress=True,
                     log=print) -> dict:
    """`fineweb` subcommand: official cached export, manifest-driven (as data/cached_challenge_fineweb.py).

    Reads `<remote_root>/manifest.json` of the dataset repo, downloaded again on every call and kept
    per repo (hub_manifest_local_path; when the hub is unreachable a kept copy is used, with a warning):
    `datasets[]` entries {name, tokenizer_name, stats: {files_train, files_val, docs_val, ...}} and
    `tokenizers[]` entries {name, vocab_size, bos_id, model_path, vocab_path}. Fetches all val
    shards, train shards 0..train_shards-1 and the tokenizer files that are not already present,
    then writes our manifest.json into the dataset dir (no doc hashes: the overlap check is
    skipped there; it records the repo id and the tokenizer's sha256, so a tokenizer file already
    present from another repo shows). downloader(repo_id, remote_path) -> cached file path
    (injectable for tests). Raises ValueError for a bad variant / repo id / shard count / manifest
    (before any download for the first two), HubUnreachableError offline.
    """
    dataset_name = dataset_dir_for_variant(variant)
    if train_shards < 0:
        raise ValueError(f"--train-shards must be >= 0, got {train_shards}")
    out_root = Path(out_root)
    hub_manifest_path = hub_manifest_local_path(out_root, repo_id, remote_root)

    def fetch(remote_path: str, dest=None) -> Path:
        # With an explicit dest (the hub manifest) always download; else a present file is kept
        # (a shard only when its header is valid).
        fresh = dest is not None
        dest = dest if fresh else local_path_for_remote(remote_path, remote_root, out_root)
        if not fresh and dest.is_file():
            if dest.suffix != ".bin":
                return dest
            try:
                read_shard_header(dest)
                return dest
            except ValueError as exc:
                log(f"re-downloading damaged {dest}: {exc}")
        try:
            cached = Path(downloader(repo_id, remote_path)).resolve(strict=True)
        except Exception as exc:
            if _is_unreachable(exc):
                raise HubUnreachableError(f"cannot reach the Hugging Face Hub for dataset repo {repo_id} "
                                          f"(file {remote_path}): {type(exc).__name__}: {exc}\n{OFFLINE_MODES_HINT}") from exc
            raise ValueError(f"cannot download {remote_path} from dataset repo {repo_id}: {type(exc).__name__}: {exc}") from exc
        dest.parent.mkdir(parents=True, exist_ok=True)
        tmp = dest.with_name(dest.name + ".tmp")
        tmp.unlink(missing_ok=True)
        try:
            os.link(cached, tmp)  # the HF cache blob: hard link when on the same filesystem
        except OSError:
            shutil.copyfile(cached, tmp)
        _fsync_replace(tmp, dest)
        if dest.suffix == ".bin":
            read_shard_header(dest)
        return dest

    try:
        fetch(hub_manifest_remote_path(remote_root), hub_manifest_path)
    except HubUnreachableError as exc:
        if not hub_manifest_path.is_file():
            raise
        log(f"warning: {str(exc).splitlines()[0]}; using the copy kept in {hub_manifest_path} (may be stale)")
    try:
        hub_manifest = json.loads(hub_manifest_path.read_text(encoding="utf-8"))
        entry = next((d for d in hub_manifest.get("datasets", []) if d.get("name") == dataset_name), None)
    except (json.JSONDecodeError, AttributeError, TypeError) as exc:
        raise ValueError(f"{hub_manifest_path}: not a dataset manifest: {exc}") from None
    if entry is None:
        names = [d.get("name") for d in hub_manifest.get("datasets", [])]
        hint = ""
        if variant in ("sp4096", "sp8192") and repo_id != LARGE_VOCAB_HF_REPO_ID:
            hint = f"; the {variant} export is in --repo-id {LARGE_VOCAB_HF_REPO_ID}"
        raise ValueError(f"dataset {dataset_name} (--variant {variant}) not in {hub_manifest_path} (dataset repo "
                         f"{repo_id}); available: {names}{hint}")
    stats = entry.get("stats") or {}
    try:
        num_train_available, num_val_files = int(stats["files_train"]), int(stats["files_val"])
    except (KeyError, TypeError, ValueError):
        raise ValueError(f"{hub_manifest_path}: dataset {dataset_name} lacks stats.files_train/files_val") from None
    if train_shards > num_train_available:
        raise ValueError(f"--train-shards {train_shards}: {variant} has only {num_train_available} train shards on {repo_id}")
    tok_entry = next((t for t in hub_manifest.get("tokenizers", []) if t.get("name") == entry.get("tokenizer_name")), None)
    if tok_entry is None:
        raise ValueError(f"{hub_manifest_path}: tokenizer {entry.get('tokenizer_name')!r} of {dataset_name} not listed")
    tok_files = [str(tok_entry[k]) for k in ("model_path", "vocab_path", "path") if tok_entry.get(k)]
    if not tok_files:
        raise ValueError(f"{hub_manifest_path}: tokenizer entry {tok_entry.get('name')!r} lists no files")

    prefix = f"{remote_root}/" if remote_root else ""
    remote_files = [f"{prefix}datasets/{dataset_name}/fineweb_val_{i:06d}.bin" for i in range(num_val_files)]
    remote_files += [f"{prefix}datasets/{dataset_name}/fineweb_train_{i:06d}.bin" for i in range(train_shards)]
    remote_files += [f"{prefix}{p}" for p in tok_files]
    for remote in tqdm(remote_files, desc=f"download {dataset_name}", unit="file", disable=not progress, file=sys.stderr):
        fetch(remote)

    data_path = out_root / "datasets" / dataset_name
    tokenizer_path = local_path_for_remote(f"{prefix}{tok_files[0]}", remote_root, out_root)
    bos_id = int(tok_entry.get("bos_id", entry.get("bos_id", 1)))
    vocab_size = int(tok_entry.get("vocab_size", entry.get("vocab_size", 0)))
    if tokenizer_path.suffix == ".model":
        vocab_size = int(load_tokenizer(tokenizer_path).vocab_size())
    splits = {}
    for split in ("val", "train"):
        names = sorted(p.name for p in data_path.glob(f"fineweb_{split}_*.bin"))
        num_tokens = num_docs = 0
        for name in names:
            num_tokens += read_shard_header(data_path / name)
            tokens = np.memmap(data_path / name, dtype="<u2", mode="r", offset=1024)
            num_docs += int(np.count_nonzero(tokens == bos_id))  # one BOS per document (official layout)
        splits[split] = {"num_docs": num_docs, "num_tokens": num_tokens, "shards": names}
    if stats.get("docs_val") is not None and int(stats["docs_val"]) != splits["val"]["num_docs"]:
        log(f"warning: {splits['val']['num_docs']} BOS tokens in val shards, hub manifest says docs_val={stats['docs_val']}")
    manifest = {
        **manifest_header(tokenizer_path, vocab_size, bos_id),
        "splits": splits,
        "source": {"command": "fineweb", "repo_id": repo_id, "remote_root": remote_root, "variant": variant,
                   "dataset": dataset_name, "num_train_shards_available": num_train_available,
                   "hub_stats": stats, "note": "no document hashes published: train/val overlap not checkable"},
    }
    write_json_atomic(data_path / "manifest.json", manifest)
    log(f"{dataset_name}: val {splits['val']['num_tokens']} tokens, train {len(splits['train']['shards'])} shards "
        f"{splits['train']['num_tokens']} tokens")
    return {"data_path": data_path, "tokenizer_path": tokenizer_path, "vocab_size": vocab_size, "manifest": manifest}


# ----------------------------------------------------------------------------- CLI


def build_parser() -> argparse.ArgumentParser:
    parser = ArgumentParser(prog="prepare_data.py", description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("fineweb", help="download the official cached FineWeb shards (network)")
    p.add_argument("--variant", default="sp1024", help="sp<VOCAB_SIZE> or byte260 (default sp1024)")
    p.add_argument("--train-shards", type=int, default=80, help="train shards of 100M tokens (default 80, official)")
    p.add_argument("--out-root", default="data", help="writes OUT_ROOT/datasets/ and OUT_ROOT/tokenizers/ (default data)")
    p.add_argument("--repo-id", default=os.environ.get("MATCHED_FINEWEB_REPO_ID", DEFAULT_HF_REPO_ID),
                   help=f"Hugging Face dataset repo owner/name (default {DEFAULT_HF_REPO_ID}, env MATCHED_FINEWEB_REPO_ID): "
                        f"the default serves only sp1024; for sp4096 and sp8192 use --repo-id {LARGE_VOCAB_HF_REPO_ID}")
    p.add_argument("--remote-root", default=os.environ.get("MATCHED_FINEWEB_REMOTE_ROOT_PREFIX", DEFAULT_HF_REMOTE_ROOT))

    p = sub.add_parser("jsonl", help="shard .jsonl/.txt documents with an existing SentencePiece model")
    p.add_argument("--input", nargs="+", required=True, help=".jsonl ({\"text\": ...} per line) or .txt (blank-line separated)")
    p.add_argument("--tokenizer", required=True, help="SentencePiece .model")
    p.add_argument("--out", required=True, help="dataset dir to write")
    p.add_argument("--val-docs", type=int, required=True, help=f"first N documents = val (official {OFFICIAL_NUM_VAL_DOCS})")
    p.add_argument("--max-docs", type=int, default=None, help="read at most M documents in total")
    p.add_argument("--shard-tokens", type=int, default=SHARD_TOKENS_PER_FILE, help="tokens per shard (default 100,000,000)")

    p = sub.add_parser("tokenizer", help="train a SentencePiece BPE model with the official settings")
    p.add_argument("--input", nargs="+", required=True)
    p.add_argument("--vocab-size", type=int, required=True)
    p.add_argument("--out", required=True, help="PREFIX: writes PREFIX.model and PREFIX.vocab")
    p.add_argument("--input-sentence-size", type=int, default=1_000_000, help="max documents sampled for training")
    p.add_argument("--max-docs", type=int, default=None, help="use only the first M documents")
    p.add_argument("--max-sentence-length", type=int, default=None,
                   help="bytes; longer documents are skipped (SentencePiece default 4192)")
    p.add_argument("--no-byte-fallback", action="store_true", help="like the published sp1024/2048/4096 models")
    p.add_argument("--verbose", action="store_true", help="show SentencePiece's training log")

    p = sub.add_parser("sample", help="offline: Python's help texts -> tokenizer + shards")
    p.add_argument("--out", default="data", help="root dir (default data): text/, tokenizers/, datasets/")
    p.add_argument("--vocab-size", type=int, default=1024)
    p.add_argument("--val-docs", type=int, default=None, help="default: 10%% of the documents")
    p.add_argument("--shard-tokens", type=int, default=SHARD_TOKENS_PER_FILE)
    return parser


def _print_paths(result: dict) -> None:
    print(f"DATA_PATH={result['data_path']}")
    print(f"TOKENIZER_PATH={result['tokenizer_path']}")
    print(f"VOCAB_SIZE={result['vocab_size']}")


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    t0 = time.perf_counter()
    log = lambda msg: print(msg, file=sys.stderr, flush=True)  # noqa: E731  stdout keeps only the paths
    try:
        if args.command == "fineweb":
            _print_paths(download_fineweb(args.variant, args.train_shards, args.out_root, repo_id=args.repo_id,
                                          remote_root=args.remote_root, log=log))
        elif args.command == "jsonl":
            manifest = prepare_jsonl_dataset(args.input, args.tokenizer, args.out, num_val_docs=args.val_docs,
                                             max_docs=args.max_docs, shard_tokens=args.shard_tokens, log=log)
            _print_paths({"data_path": args.out, "tokenizer_path": args.tokenizer, "vocab_size": manifest["vocab_size"]})
        elif args.command == "tokenizer":
            paths = check_inputs(args.input)
            max_docs = args.max_docs

            def docs():
                for i, text in enumerate(iter_documents(paths)):
                    if max_docs is not None and i >= max_docs:
                        return
                    yield text

            print(train_tokenizer(docs, args.vocab_size, args.out, input_sentence_size=args.input_sentence_size,
                                  max_sentence_length=args.max_sentence_length, byte_fallback=not args.no_byte_fallback,
                                  verbose=args.verbose, log=log))
        elif args.command == "sample":
            result = build_sample(args.out, vocab_size=args.vocab_size, num_val_docs=args.val_docs,
                                  shard_tokens=args.shard_tokens, log=log)
            _print_paths(result)
            log(f"sample ready in {time.perf_counter() - t0:.1f}s; smoke run: DATA_PATH={result['data_path']} "
                f"TOKENIZER_PATH={result['tokenizer_path']} VOCAB_SIZE={result['vocab_size']} PRESET=smoke python train_gpt.py")
    except HubUnreachableError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 3
    except USER_ERRORS as exc:  # a bad input (or an unwritable --out): one line, exit 2
        return report_user_error(exc)
    return 0


if __name__ == "__main__":
    sys.exit(main())
