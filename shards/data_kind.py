"""Which bytes score a val split: the tokenizer's (the official byte LUT, eval/bpb.py), or, for CaseOps data,
the original text's from the data's byte sidecar (shards/sidecar.py). A run says which with CASEOPS_ENABLED
(PR #1855's switch); `caseops_signs` says what the data is, and the trainer refuses a mismatch before any long
work: CaseOps data scored on the tokenizer's bytes would count operator pieces the text never had.

CaseOps data (PR #1729 / #1855, shards/caseops.py) is tokenized from transformed text with a tokenizer that
reserves the transform's operators; its val split comes with `fineweb_val_bytes_NNNNNN.bin` beside the val
shards, and its manifest says `text_transform: lossless_caps_caseops_v1`. Layer 2: standard library only.
"""

import json
from pathlib import Path

CASEOPS_OPERATORS = ("\ue001", "\ue002", "\ue003", "\ue004")  # TITLE, ALLCAPS, CAPNEXT, ESC
CASEOPS_TRANSFORM = "lossless_caps_caseops_v1"  # the records' name of the transform (manifest text_transform)
VAL_BYTES_PREFIX = "fineweb_val_bytes_"


def list_val_byte_shards(data_path) -> list:
    """Sorted `fineweb_val_bytes_*.bin` paths in `data_path` (empty when there are none)."""
    return sorted(Path(data_path).glob(f"{VAL_BYTES_PREFIX}*.bin"))


def reserves_caseops(sp) -> bool:
    """True when the SentencePiece model `sp` has each CaseOps operator as a piece of its own."""
    return all(sp.piece_to_id(op) != sp.unk_id() and sp.id_to_piece(sp.piece_to_id(op)) == op for op in CASEOPS_OPERATORS)


def read_manifest(data_path) -> dict:
    """`data_path/manifest.json` as a dict; {} when there is none or it cannot be read (shards/format.py
    check_data_manifest names a damaged one)."""
    try:
        return json.loads((Path(data_path) / "manifest.json").read_bytes())
    except (OSError, ValueError):
        return {}


def caseops_signs(data_path, sp, tokenizer_path) -> str | None:
    """Why `data_path`, read with the tokenizer `sp` (at `tokenizer_path`), is CaseOps data: its byte sidecar,
    its manifest's text_transform or a tokenizer that reserves the operators; None for plain data."""
    if list_val_byte_shards(data_path):
        return f"a byte sidecar {VAL_BYTES_PREFIX}*.bin"
    if read_manifest(data_path).get("text_transform") == CASEOPS_TRANSFORM:
        return f"its manifest says text_transform {CASEOPS_TRANSFORM}"
    return f"TOKENIZER_PATH={tokenizer_path} reserves the CaseOps operators" if reserves_caseops(sp) else None
