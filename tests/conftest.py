"""Shared pytest fixtures: real data from ../shared when present, offline fallbacks otherwise.

- `shared_dir`: Path of ../shared next to the repo (challenge tokenizers + real web text) or None.
- `real_text_docs`: list[str], the first 300 documents of shared data/text/fineweb_edu.jsonl, or
  the documents of `tools/prepare_data.py sample` (Python's help texts) without ../shared.
- `sp1024_model`: Path of a 1024-vocab SentencePiece model: the challenge's fineweb_1024_bpe.model
  from ../shared, else the `sample` tokenizer trained into a session tmp dir (~1 s).
- `tiny_dataset`: Path of a challenge-format dataset dir (shards + manifest.json + doc hashes)
  built once per session from `real_text_docs` with `sp1024_model`: the first 50 documents are val,
  65,536-token shards (with ../shared: ~2 val shards, ~7 train shards, ~530k tokens).
"""

import json
import os
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

if os.environ.get("PYTEST_XDIST_WORKER"):
    # `pytest -n 2` on 2 cores: one thread per worker and per process it starts (trainer runs read
    # NUM_THREADS; two spinning OpenMP threads per core made a tiny step ~25x slower, test_train.py)
    os.environ.setdefault("NUM_THREADS", "1")
    os.environ["OMP_NUM_THREADS"] = "1"
    # Inductor (torch.compile) compiles in this process, not in a pool of compile workers, each a fresh Python
    # importing torch (tests/test_attn_ops.py on one core: 137 -> 126 CPU s)
    os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")
    import torch

    torch.set_num_threads(1)

# The files that take the most CPU time (~50-180 s each on one core), started first: `pytest -n 2` hands out
# whole files (pytest.ini: --dist loadfile; --no-loadscope-reorder keeps this order) and a costly file started
# last leaves one core idle while the other finishes it. The rest follow in collection order.
HEAVY_FILES_FIRST = ("test_bad_inputs.py", "test_audit_probe.py", "test_attn_ops.py", "test_make_record.py",
                     "test_interrupt.py", "test_bundle.py", "test_train.py", "test_caseops_eval.py",
                     "test_caseops_data.py", "test_bundle_when.py", "test_train_ttt.py", "test_sweep.py",
                     "test_runfolder.py", "test_presets.py", "test_train_lora_ttt.py", "test_train_phased_ttt.py",
                     "test_parity_ttt.py", "test_quant_sdclip.py")


def pytest_collection_modifyitems(items):
    """The files of HEAVY_FILES_FIRST first, in that order; each file's tests keep their order."""
    rank = {name: i for i, name in enumerate(HEAVY_FILES_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))


SHARED_DIR = Path(__file__).resolve().parents[2] / "shared"
TINY_DATASET_NUM_DOCS = 300
TINY_DATASET_VAL_DOCS = 50
TINY_DATASET_SHARD_TOKENS = 65_536


@pytest.fixture(scope="session")
def shared_dir():
    return SHARED_DIR if SHARED_DIR.is_dir() else None


@pytest.fixture(scope="session")
def real_text_docs(shared_dir) -> list:
    if shared_dir is not None and (shared_dir / "data/text/fineweb_edu.jsonl").is_file():
        docs = []
        with open(shared_dir / "data/text/fineweb_edu.jsonl", encoding="utf-8") as f:
            for line in f:
                docs.append(json.loads(line)["text"])
                if len(docs) == TINY_DATASET_NUM_DOCS:
                    break
        return docs
    from tools.data.data_sample import sample_documents

    return sample_documents()


@pytest.fixture(scope="session")
def sp1024_model(shared_dir, tmp_path_factory) -> Path:
    if shared_dir is not None and (shared_dir / "data/tokenizers/fineweb_1024_bpe.model").is_file():
        return shared_dir / "data/tokenizers/fineweb_1024_bpe.model"
    from tools.data.data_sample import build_sample

    result = build_sample(tmp_path_factory.mktemp("sample_data"), progress=False, log=lambda msg: None)
    return Path(result["tokenizer_path"])


@pytest.fixture(scope="session")
def tiny_dataset(real_text_docs, sp1024_model, tmp_path_factory) -> Path:
    from tools.data.data_shards import prepare_jsonl_dataset

    root = tmp_path_factory.mktemp("tiny_dataset")
    text_path = root / "docs.jsonl"
    text_path.write_text("".join(json.dumps({"text": d}) + "\n" for d in real_text_docs), encoding="utf-8")
    out = root / "tiny_sp1024"
    prepare_jsonl_dataset([text_path], sp1024_model, out, num_val_docs=TINY_DATASET_VAL_DOCS,
                          shard_tokens=TINY_DATASET_SHARD_TOKENS, progress=False, log=lambda msg: None)
    return out


@pytest.fixture(scope="module")
def sp():
    """The challenge's sp1024 tokenizer (or the sample's without ../shared): the eval tests' (test_eval_support)."""
    from test_eval_support import load_sp

    return load_sp(1024)


@pytest.fixture(scope="module")
def luts(sp):
    """The byte-count lookup tables of `sp` (eval.bpb.build_sentencepiece_luts)."""
    from eval.bpb import build_sentencepiece_luts

    return build_sentencepiece_luts(sp, 1024)
