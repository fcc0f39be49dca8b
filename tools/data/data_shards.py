"""Challenge shards from documents (tools/prepare_data.py jsonl / sample): every document becomes
[BOS] + sp.encode(text) in uint16 shards of 100,000,000 tokens, the first --val-docs documents are val,
train duplicates of val documents are dropped, plus doc_hashes_{val,train}.txt and manifest.json."""

import hashlib
import sys
import time
from pathlib import Path

import numpy as np
from tqdm import tqdm

from tools.data.data_files import fsync_replace, manifest_header, sha256_file, write_json_atomic
from tools.data.data_stage import staged_writes
from tools.data.data_text import check_inputs, iter_documents
from tools.data.data_tokenizer import load_tokenizer
from shards.caseops import CASEOPS_TRANSFORM, encode_caseops, encode_with_original_bytes
from shards.format import SHARD_TOKENS_PER_FILE, write_data_shard

OFFICIAL_NUM_VAL_DOCS = 50_000
DOC_HASH_HEX_CHARS = 16
ENCODE_BATCH_DOCS = 1024


def doc_hash(text: str) -> str:
    """Document hash used for split-disjointness checks: first 16 hex chars of sha256(UTF-8)."""
    return hashlib.sha256(text.encode("utf-8")).hexdigest()[:DOC_HASH_HEX_CHARS]


class _SplitWriter:
    """Accumulates one split's tokens and writes full shards of `shard_tokens` tokens."""

    def __init__(self, out_dir: Path, split: str, shard_tokens: int):
        self.out_dir, self.split, self.shard_tokens = out_dir, split, shard_tokens
        self.buf = None
        self.fill = 0
        self.shards: list[str] = []
        self.num_docs = 0
        self.num_tokens = 0
        self.num_bytes = 0

    def add(self, tokens: np.ndarray) -> None:
        if self.buf is None:
            self.buf = np.empty(self.shard_tokens, dtype=np.uint16)
        self.num_docs += 1
        self.num_tokens += tokens.size
        if self.split == "val_bytes":  # the byte sidecar's total
            self.num_bytes += int(tokens.sum(dtype=np.int64))
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


def shard_documents(docs_factory, tokenizer_path, out_dir, *, num_val_docs: int, max_docs=None,
                    shard_tokens: int = SHARD_TOKENS_PER_FILE, source=None, progress=True, log=print,
                    stage=None, tokenizer_final=None, caseops: bool = False, canonical_val_docs: int = 0) -> dict:
    """Tokenize documents into challenge shards + doc hash files + manifest.json in `out_dir`.

    docs_factory() must return a fresh iterable of str each call: pass 1 validates and counts
    (errors before the long work), pass 2 encodes in batches of 1024 with sp.encode(list).
    Each document becomes [BOS] + sp.encode(text) (uint16, no EOS). The first num_val_docs
    documents are val; train documents whose hash is a val hash are dropped and counted.
    The dataset is written into a new folder beside `out_dir` that replaces it at the end
    (tools/data/data_stage.py): `stage` joins a larger write (the caller commits), else one is made here.
    `tokenizer_final`: the path the tokenizer will have when `tokenizer_path` is a temporary file.
    caseops: tokenize each document's CaseOps form (shards/caseops.py) and write the val byte sidecar
    (fineweb_val_bytes_*.bin, shards/sidecar.py); doc hashes stay those of the original text.
    canonical_val_docs: the stream's canonical val split is its first canonical_val_docs documents (0: none);
    a smaller num_val_docs would put the rest of them into train and is refused in pass 1 (check_val_split).
    Returns the manifest dict. Raises ValueError for no documents, num_val_docs outside
    [1, num_docs), a leaking split, bad --max-docs/--shard-tokens, or ids >= vocab_size; OSError naming `out_dir`.
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
        if num_docs == canonical_val_docs:  # known now: refused before the rest of the stream is read
            check_val_split(num_val_docs, canonical_val_docs, num_docs)
    check_val_split(num_val_docs, canonical_val_docs, num_docs)
    if num_docs == 0:
        raise ValueError("input holds no documents")
    if num_val_docs >= num_docs:
        raise ValueError(f"--val-docs {num_val_docs} must be smaller than the number of documents ({num_docs}) "
                         "so that the train split is not empty")
    header = manifest_header(Path(tokenizer_path), vocab_size, bos_id, name=Path(tokenizer_final or tokenizer_path).name)
    source = dict(source or {}, tokenizer_path=str(tokenizer_final or tokenizer_path), num_input_docs=num_docs,
                  num_val_docs_requested=num_val_docs, max_docs=max_docs)

    def write(stage):
        folder = stage.folder(out_dir)
        manifest, writers = _write_dataset(sp, docs_factory, folder, num_docs, num_val_docs, val_hashes,
                                           shard_tokens, progress, log, out_dir.name, caseops)
        manifest = {**header, **manifest, "source": source}
        if caseops:
            manifest["split_rule"] = {"canonical_val_docs": canonical_val_docs, "num_val_docs": num_val_docs}
        write_json_atomic(folder / "manifest.json", manifest)
        return manifest, writers

    t0 = time.perf_counter()
    if stage is not None:
        return write(stage)[0]
    with staged_writes(log) as own_stage:
        manifest, writers = write(own_stage)
    log(f"wrote {out_dir}: val {writers['val'].num_docs} docs {writers['val'].num_tokens} tokens "
        f"({len(writers['val'].shards)} shards), train {writers['train'].num_docs} docs "
        f"{writers['train'].num_tokens} tokens ({len(writers['train'].shards)} shards) in {time.perf_counter() - t0:.1f}s")
    return manifest


def check_val_split(num_val_docs: int, canonical_val_docs: int, num_docs_read: int) -> None:
    """ValueError with the number of canonical val documents a split of num_val_docs would put into train:
    the first min(canonical_val_docs, num_docs_read) documents of the stream are the canonical val split
    (PR #2018 / #2130 built CaseOps data with --val-docs 10000 where it is 50,000: 40,000 val documents
    trained on, and both were excluded)."""
    leaked = min(canonical_val_docs, num_docs_read) - num_val_docs
    if leaked > 0:
        raise ValueError(f"--val-docs {num_val_docs}: would put {leaked:,} documents of the canonical val split (the "
                         f"first {canonical_val_docs:,} documents of the stream) into train; expected --val-docs "
                         f"{canonical_val_docs} (or --canonical-val-docs 0 for text that is not the challenge's stream); "
                         "nothing written")


def _write_dataset(sp, docs_factory, folder: Path, num_docs, num_val_docs, val_hashes, shard_tokens, progress,
                   log, name, caseops=False):
    """Pass 2 of shard_documents, into the (staging) `folder`: shards, the CaseOps val byte sidecar and
    doc hash files."""
    vocab_size, bos_id = int(sp.vocab_size()), int(sp.bos_id())
    writers = {s: _SplitWriter(folder, s, shard_tokens) for s in ("val", "train") + ("val_bytes",) * caseops}
    hash_tmp = {s: folder / f"doc_hashes_{s}.txt.tmp" for s in ("val", "train")}
    hash_files = {s: open(p, "w", encoding="ascii", newline="\n") for s, p in hash_tmp.items()}
    num_dropped = 0
    bar = tqdm(total=num_docs, unit="doc", desc=f"tokenize {name}", disable=None if progress else True,
               file=sys.stderr)  # None: a bar on a terminal only, so an error stays one line in a log
    try:
        index = 0
        batch: list[str] = []

        def encode_batch(texts):
            nonlocal index, num_dropped
            if caseops:  # ids and each token's original bytes of the CaseOps form
                encoded = encode_with_original_bytes(sp, [encode_caseops(t) for t in texts])
            else:
                encoded = [(ids, None) for ids in sp.encode(texts, out_type=int)]
            for text, (ids, original_bytes) in zip(texts, encoded, strict=True):
                split = "val" if index < num_val_docs else "train"
                index += 1
                h = doc_hash(text)
                if split == "train" and h in val_hashes:
                    num_dropped += 1
                    continue
                if split == "train":
                    for w in writers.values():
                        if w.split != "train":
                            w.flush()  # val and train never share a shard
                toks = np.empty(len(ids) + 1, dtype=np.int64)
                toks[0] = bos_id
                toks[1:] = ids
                if toks.size and (int(toks.max()) >= vocab_size or int(toks.min()) < 0):
                    raise ValueError(f"document {index - 1}: token id outside [0, {vocab_size}) from the tokenizer")
                writers[split].add(toks.astype(np.uint16))
                if caseops and split == "val":  # BOS stands for no bytes of the text
                    writers["val_bytes"].add(np.array([0] + original_bytes, dtype=np.int64).astype(np.uint16))
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
        fsync_replace(tmp, folder / f"doc_hashes_{split}.txt")
    if writers["train"].num_docs == 0:
        raise ValueError(f"all {num_dropped} train documents duplicate val documents; the train split is empty")
    if num_dropped:
        log(f"dropped {num_dropped} train documents identical to val documents (splits kept disjoint)")
    manifest = {
        "shard_tokens": shard_tokens,
        "splits": {
            split: {
                "num_docs": w.num_docs,
                "num_tokens": w.num_tokens,
                "shards": w.shards,
                "shard_sha256": [sha256_file(folder / name) for name in w.shards],  # shards/format.py verify_dataset
                "doc_hashes_file": f"doc_hashes_{split}.txt",
            }
            for split, w in writers.items() if split != "val_bytes"
        },
    }
    if caseops:
        manifest["text_transform"] = CASEOPS_TRANSFORM
        manifest["val_bytes"] = {"shards": writers["val_bytes"].shards, "num_tokens": writers["val_bytes"].num_tokens,
                                 "num_bytes": writers["val_bytes"].num_bytes,
                                 "note": "original UTF-8 bytes per val token (0 for BOS and the CaseOps operators)"}
    manifest["splits"]["train"]["num_dropped_overlap_docs"] = num_dropped
    return manifest, writers


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
