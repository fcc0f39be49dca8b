"""CaseOps: the reversible capitalization transform of the CaseOps records, and each token's original bytes.

Source: `lossless_caps_caseops_v1` of PR #1729 / #1855 (`lossless_caps.py`, its `encode_lossless_caps_v2`,
`decode_lossless_caps_v2` and `surface_piece_original_byte_counts`), written again here from that
specification. Over each maximal run of ASCII letters:
  - all lowercase: unchanged;
  - two or more letters, all uppercase: ALLCAPS + the run in lowercase;
  - an uppercase letter then only lowercase ones: TITLE + the run in lowercase;
  - anything else: TITLE + first letter if it is uppercase, then each later uppercase letter as
    CAPNEXT + its lowercase (a single uppercase letter is TITLE + its lowercase);
and an operator code point in the input is escaped as ESC + itself. Nothing else changes, so the
transformed text decodes to exactly the original (`decode_caseops(encode_caseops(x)) == x`).
The operators are private-use code points (3 UTF-8 bytes each) that the CaseOps tokenizer
(`fineweb_8192_bpe_lossless_caps_caseops_v1_reserved.model`) reserves as user-defined pieces.

A token's original bytes are the UTF-8 bytes of the text it stands for before the transform: its
piece's surface minus the operators (an escaped operator counts its own 3 bytes, its ESC none);
ASCII case never changes a byte count. Not bundled: the trainer reads the counts from the byte
sidecar (shards/sidecar.py), tools/prepare_data.py caseops writes them.
"""

import re

from shards.data_kind import CASEOPS_OPERATORS, CASEOPS_TRANSFORM  # noqa: F401  (importers take it from here too)

CASEOPS_TITLE, CASEOPS_ALLCAPS, CASEOPS_CAPNEXT, CASEOPS_ESC = CASEOPS_OPERATORS

_RUNS = re.compile("[A-Za-z]+|[\ue001-\ue004]")
_OPERATOR = re.compile("[\ue001-\ue004]")


class CaseOpsError(ValueError):
    """A text that no `encode_caseops` output can be (decode_caseops); the message names the position."""


def _encode_run(match: re.Match) -> str:
    run = match.group()
    if run in CASEOPS_OPERATORS:
        return CASEOPS_ESC + run
    if run.islower():
        return run
    low = run.lower()
    if len(run) > 1 and run.isupper():
        return CASEOPS_ALLCAPS + low
    if run[0].isupper() and run[1:].islower():  # "".islower() is False: "A" is encoded below
        return CASEOPS_TITLE + low
    head = CASEOPS_TITLE + low[0] if run[0].isupper() else run[0]
    return head + "".join(CASEOPS_CAPNEXT + c.lower() if c.isupper() else c for c in run[1:])


def encode_caseops(text: str) -> str:
    """The CaseOps form of `text` (str -> str; see the module docstring for the rules)."""
    return _RUNS.sub(_encode_run, text)


def decode_caseops(text: str) -> str:
    """The original of a CaseOps text: the inverse of `encode_caseops`.

    Raises CaseOpsError naming the position for a text `encode_caseops` never writes: an uppercase
    ASCII letter, ESC not followed by an operator, TITLE/ALLCAPS inside a word or not followed by
    a letter, CAPNEXT not followed by a letter, an operator after a pending one.
    """
    out = []
    pending = None  # TITLE, ALLCAPS or CAPNEXT waiting for its letter
    escaped = in_word = upper_word = False
    for pos, ch in enumerate(text):
        if escaped:
            if ch not in CASEOPS_OPERATORS:
                raise CaseOpsError(f"position {pos}: ESC before {ch!r}; expected an escaped operator")
            out.append(ch)
            escaped = in_word = upper_word = False
        elif "a" <= ch <= "z":
            if not in_word:
                upper_word, in_word = pending == CASEOPS_ALLCAPS, True
            elif pending in (CASEOPS_TITLE, CASEOPS_ALLCAPS):
                raise CaseOpsError(f"position {pos}: a word operator inside a word")
            out.append(ch.upper() if pending or upper_word else ch)
            pending = None
        elif ch in CASEOPS_OPERATORS:
            if pending:
                raise CaseOpsError(f"position {pos}: operator {ord(ch):#x} after a pending {ord(pending):#x}")
            if ch in (CASEOPS_TITLE, CASEOPS_ALLCAPS) and in_word:
                raise CaseOpsError(f"position {pos}: operator {ord(ch):#x} inside a word")
            escaped = ch == CASEOPS_ESC
            pending = None if escaped else ch
        elif "A" <= ch <= "Z":
            raise CaseOpsError(f"position {pos}: uppercase ASCII letter {ch!r}; CaseOps text holds lowercase only")
        else:
            if pending:
                raise CaseOpsError(f"position {pos}: operator {ord(pending):#x} not followed by an ASCII letter")
            out.append(ch)
            in_word = upper_word = False
    if escaped or pending:
        raise CaseOpsError(f"position {len(text)}: the text ends inside an operator; expected its letter")
    return "".join(out)


def piece_original_bytes(surfaces) -> list:
    """Original UTF-8 bytes of each piece of one CaseOps text, in order: `surfaces` are the exact text
    fragments the tokenizer's pieces cover (sentencepiece offsets / immutable proto `surface`;
    byte-fallback pieces of one character: the last holds it, the others are empty). Unescaped
    operators count 0, an escaped operator its 3 bytes (the escape may end the previous piece).
    Returns a list of int, one per piece."""
    counts, escaped = [], False
    for surface in surfaces:
        if not escaped and not _OPERATOR.search(surface):
            counts.append(len(surface.encode("utf-8")))
            continue
        num_bytes = 0
        for ch in surface:
            if escaped:
                num_bytes += len(ch.encode("utf-8"))
                escaped = False
            elif ch == CASEOPS_ESC:
                escaped = True
            elif ch not in CASEOPS_OPERATORS:
                num_bytes += len(ch.encode("utf-8"))
        counts.append(num_bytes)
    return counts


def encode_with_original_bytes(sp, transformed: list) -> list:
    """[(ids, original bytes per id)] for each CaseOps text of `transformed` (lists of int of one length).

    sp: a sentencepiece processor; the pieces and their surfaces come from one batched
    `encode(..., out_type="offset_mapping")` (sentencepiece >= 0.2.1; 0.2.0's
    `encode_as_immutable_proto` gives the same ids and surfaces)."""
    out = []
    for text, enc in zip(transformed, sp.encode(transformed, out_type="offset_mapping"), strict=True):
        out.append((list(enc["ids"]), piece_original_bytes(text[b:e] for b, e in enc["offsets"])))
    return out
