"""The `caseops` subcommand of tools/prepare_data.py: CaseOps shards and the val byte sidecar from documents.

What the CaseOps records trained and scored on (PR #1729 / #1855 `prepare_caseops_data.py`): each
document's CaseOps form (shards/caseops.py) tokenized with the CaseOps sp8192 model as [BOS] + ids,
and for the val split `fineweb_val_bytes_NNNNNN.bin` beside `fineweb_val_NNNNNN.bin`: one uint16 per
val token, the original UTF-8 bytes it stands for (shards/sidecar.py). Shards of 10,000,000 tokens
as that script writes, so the files are byte-identical to its output on the same documents
(tests/test_caseops_data.py runs it); unlike it, the val split is the canonical first 50,000
documents unless told otherwise, a smaller one is refused before anything is written (the leak that
excluded PR #2018 and PR #2130), and the manifest holds every document's hash of both splits.
"""

from pathlib import Path

from tools.data.data_shards import OFFICIAL_NUM_VAL_DOCS, shard_documents
from tools.data.data_text import check_inputs, iter_documents
from tools.data.data_tokenizer import load_tokenizer
from shards.data_kind import CASEOPS_TRANSFORM, reserves_caseops

CASEOPS_SHARD_TOKENS = 10_000_000  # the reference prepare_caseops_data.py's SHARD_TOKENS


def prepare_caseops_dataset(inputs, tokenizer_path, out_dir, *, num_val_docs: int = OFFICIAL_NUM_VAL_DOCS,
                            canonical_val_docs: int = OFFICIAL_NUM_VAL_DOCS, max_docs=None,
                            shard_tokens: int = CASEOPS_SHARD_TOKENS, progress=True, log=print) -> dict:
    """Write a CaseOps dataset (shards, byte sidecar, doc hashes, manifest.json with text_transform) to out_dir.

    inputs: .jsonl / .txt files (optionally .gz, tools/data/data_text.py), read in order as one stream;
    the first num_val_docs documents are val. canonical_val_docs: the stream's canonical val split
    (official 50,000; 0 for text that is not the challenge's document stream). Raises ValueError for a
    tokenizer without the CaseOps operators, a split that leaks canonical val documents into train
    (naming how many), and what shard_documents refuses; all before anything is written.
    """
    paths = check_inputs(inputs)
    if Path(out_dir).exists() and not Path(out_dir).is_dir():
        raise ValueError(f"--out {out_dir}: is a file; expected a dataset folder (created if missing)")
    if canonical_val_docs < 0:
        raise ValueError(f"--canonical-val-docs must be >= 0, got {canonical_val_docs}")
    sp = load_tokenizer(tokenizer_path)
    if not reserves_caseops(sp):
        raise ValueError(f"--tokenizer {tokenizer_path}: does not reserve the CaseOps operators U+E001..U+E004 as pieces; "
                         "expected a CaseOps model (fineweb_8192_bpe_lossless_caps_caseops_v1_reserved.model)")
    if canonical_val_docs and num_val_docs > canonical_val_docs:
        log(f"warning: --val-docs {num_val_docs} is more than the canonical {canonical_val_docs}: val_bpb on this split "
            "is not comparable to the leaderboard's")
    source = {"command": "caseops", "inputs": [str(p) for p in paths], "input_bytes": [p.stat().st_size for p in paths],
              "text_transform": CASEOPS_TRANSFORM, "canonical_val_docs": canonical_val_docs}
    return shard_documents(lambda: iter_documents(paths), tokenizer_path, out_dir, num_val_docs=num_val_docs,
                           max_docs=max_docs, shard_tokens=shard_tokens, source=source, progress=progress, log=log,
                           caseops=True, canonical_val_docs=canonical_val_docs)
