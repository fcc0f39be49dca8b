"""The offline `sample` dataset (tools/prepare_data.py sample): documents from Python's own help texts,
a tokenizer trained on their train split and the shards, with no network."""

import json
import random
import re
import sys
from pathlib import Path

import sentencepiece as spm

from tools.data.data_shards import shard_documents
from tools.data.data_stage import staged_writes
from tools.data.data_tokenizer import MAX_UINT16_VOCAB, train_tokenizer
from shards.format import SHARD_TOKENS_PER_FILE

SAMPLE_NAME = "pydoc_sample"
SAMPLE_MIN_DOC_CHARS = 1200
SAMPLE_SHUFFLE_SEED = 1337
SAMPLE_VAL_FRACTION = 0.1


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
    prefix = out_root / "tokenizers" / f"{SAMPLE_NAME}_{vocab_size}_bpe"
    data_path = out_root / "datasets" / f"{SAMPLE_NAME}_sp{vocab_size}"
    model_path = prefix.with_name(prefix.name + ".model")
    source = {"command": "sample", "text": "pydoc_data.topics (Python standard library help texts)",
              "python_version": sys.version.split()[0], "text_file": str(text_path),
              "shuffle_seed": SAMPLE_SHUFFLE_SEED, "min_doc_chars": SAMPLE_MIN_DOC_CHARS}
    with staged_writes(log) as stage:  # text, tokenizer and dataset renamed into place together at the end
        stage.folder(data_path)  # first: a failure names the dataset folder
        text_tmp = stage.file(text_path)
        text_tmp.write_text("".join(json.dumps({"text": d}, ensure_ascii=False) + "\n" for d in docs), encoding="utf-8")
        model_tmp = train_tokenizer(lambda: iter(docs[num_val_docs:]), vocab_size, prefix, log=log, stage=stage)
        trained_vocab = spm.SentencePieceProcessor(model_file=str(model_tmp)).vocab_size()
        if trained_vocab != vocab_size:
            raise ValueError(f"sample tokenizer {model_path} has {trained_vocab} pieces, expected {vocab_size}")
        manifest = shard_documents(lambda: iter(docs), model_tmp, data_path, num_val_docs=num_val_docs,
                                   shard_tokens=shard_tokens, source=source, progress=progress, log=log, stage=stage,
                                   tokenizer_final=model_path)
    log(f"wrote {data_path}, {model_path} and {text_path}")
    return {"data_path": data_path, "tokenizer_path": model_path, "vocab_size": vocab_size, "manifest": manifest}
