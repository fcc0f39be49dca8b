"""SentencePiece models of the data tools (tools/prepare_data.py): load and check one (ids fit uint16
shards, a BOS exists), and train a BPE model with the settings of the official exports."""

import io
import time
from pathlib import Path

import sentencepiece as spm

from tools.data.data_files import fsync_replace

MAX_UINT16_VOCAB = 65536
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


def train_tokenizer(docs_factory, vocab_size: int, out_prefix, *, input_sentence_size: int = 1_000_000,
                    max_sentence_length=None, byte_fallback: bool = True, seed: int = 0, verbose=False,
                    log=print, stage=None) -> Path:
    """Train a SentencePiece BPE model with the official settings; returns PREFIX.model.

    Each document (NUL -> space, stripped, empties skipped, as the official export does) is one
    sentence; at most input_sentence_size of them are sampled (seeded). Documents longer than
    max_sentence_length bytes (SentencePiece default 4192) are skipped by the trainer, as in the
    official export. Writes PREFIX.model and PREFIX.vocab via temporary names + rename; the bytes
    depend only on the documents and options (trained in memory, so no path is stored). With a
    `stage` (tools/data/data_stage.py) both stay temporary until the caller commits, and the temporary
    model's path is returned.
    Raises ValueError for vocab_size outside [8, 65536] or a failed training run.
    """
    if not 8 <= vocab_size <= MAX_UINT16_VOCAB:
        raise ValueError(f"--vocab-size must be in [8, {MAX_UINT16_VOCAB}], got {vocab_size}")
    out_prefix = Path(out_prefix)
    if stage is None:
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
    model_tmp = stage.file(model_path) if stage else model_path.with_name(model_path.name + ".tmp")
    vocab_tmp = stage.file(vocab_path) if stage else vocab_path.with_name(vocab_path.name + ".tmp")
    try:
        model_tmp.write_bytes(model_bytes.getvalue())
        with open(vocab_tmp, "w", encoding="utf-8", newline="\n") as f:  # same text as spm_train's PREFIX.vocab
            f.writelines(f"{sp.id_to_piece(i)}\t{sp.get_score(i):g}\n" for i in range(sp.vocab_size()))
        if stage is None:
            fsync_replace(model_tmp, model_path)
            fsync_replace(vocab_tmp, vocab_path)
    finally:
        if stage is None:  # a staged write is committed or removed by its caller
            model_tmp.unlink(missing_ok=True)
            vocab_tmp.unlink(missing_ok=True)
    if sp.vocab_size() != vocab_size:
        log(f"warning: {model_path} has {sp.vocab_size()} pieces, fewer than --vocab-size {vocab_size} "
            "(hard_vocab_limit=False and too little text)")
    log(f"trained {model_path} (vocab {sp.vocab_size()}) in {time.perf_counter() - t0:.1f}s")
    return model_tmp if stage else model_path
