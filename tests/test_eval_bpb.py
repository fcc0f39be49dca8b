"""Byte LUTs against an independent decode-based count on real text, and val_bpb of known models."""

import math

import pytest
import torch

from eval.bpb import build_sentencepiece_luts, count_scored_bytes
from eval.offline import count_stream_bytes, load_sentencepiece_luts
from eval.roundtrip import eval_roundtrip
from eval.sliding import eval_sliding
from test_eval_support import UniformLM, load_sp, read_docs, real_stream, tokenizer_path

VOCABS = (1024, 2048, 4096, 8192)


def decode_bytes(sp, ids: list[int]) -> int:
    """Independent byte count of the targets of [BOS] + ids: decode each run of ordinary pieces
    between special ids (BOS/EOS/PAD/UNK count 0 bytes; SentencePiece drops the leading space of
    the first piece it decodes, as the challenge drops the space after a boundary token)."""
    special = {sp.bos_id(), sp.eos_id(), sp.pad_id(), sp.unk_id()}
    total, run = 0, []
    for t in ids + [sp.bos_id()]:
        if t in special:
            total += len(sp.decode(run).encode("utf-8")) if run else 0
            run = []
        else:
            run.append(t)
    return total


def sample_docs() -> list[str]:
    docs = (read_docs("fineweb_textfixer") + read_docs("c4_olmo_fixtures") + read_docs("nemotron_cc", 120)
            + read_docs("fineweb_edu", 60))
    return list(dict.fromkeys(docs))  # without ../shared every name gives the same sample documents


@pytest.fixture(scope="module")
def docs():
    return sample_docs()


@pytest.mark.parametrize("vocab_size", VOCABS)
def test_lut_bytes_equal_decoded_bytes_on_real_text(vocab_size, docs):
    sp = load_sp(vocab_size)
    luts = build_sentencepiece_luts(sp, vocab_size)
    assert [t.dtype for t in luts] == [torch.int16, torch.bool, torch.bool]
    num_unk_docs = num_byte_docs = 0
    stream, expected_total = [], 0
    for doc in docs:
        ids = sp.encode(doc)
        tokens = torch.tensor([sp.bos_id()] + ids)
        lut_bytes = count_stream_bytes(tokens, luts)
        expected = decode_bytes(sp, ids)
        assert lut_bytes == expected, (vocab_size, doc[:80])
        num_unk_docs += sp.unk_id() in ids
        num_byte_docs += any(sp.is_byte(t) for t in ids)
        stream += [sp.bos_id()] + ids
        expected_total += expected
    # The concatenated val-style stream (BOS between documents) counts the same bytes.
    assert count_stream_bytes(torch.tensor(stream), luts) == expected_total
    # The sample must exercise the hard cases: <unk> without byte fallback, byte pieces with it.
    if sp.piece_to_id("<0x41>") == sp.unk_id():
        assert num_unk_docs > 10 and num_byte_docs == 0
    else:
        assert num_byte_docs > 10 and num_unk_docs == 0


def test_bytes_are_tokenizer_agnostic(docs):
    # Documents every tokenizer covers without <unk>: all four count the same bytes, equal to the
    # UTF-8 length of the normalized text.
    sps = {v: load_sp(v) for v in VOCABS}
    luts = {v: build_sentencepiece_luts(sps[v], v) for v in VOCABS}
    clean = [d for d in docs if sps[1024].unk_id() not in sps[1024].encode(d)][:150]
    assert len(clean) > 100
    for doc in clean:
        counts = {v: count_stream_bytes(torch.tensor([1] + sps[v].encode(doc)), luts[v]) for v in VOCABS}
        normalized = sps[8192].decode(sps[8192].encode(doc))
        assert set(counts.values()) == {len(normalized.encode("utf-8"))}, counts


def test_lut_rules_by_piece():
    sp = load_sp(8192)
    base, space, boundary = build_sentencepiece_luts(sp, 8192 + 8)
    assert base.numel() == 8200 and boundary[8192:].all() and (base[8192:] == 0).all()
    for special in (sp.pad_id(), sp.bos_id(), sp.eos_id(), sp.unk_id()):
        assert boundary[special] and base[special] == 0 and not space[special]
    byte_ids = [i for i in range(8192) if sp.is_byte(i)]
    assert len(byte_ids) == 256 and (base[byte_ids] == 1).all() and not space[byte_ids].any()  # not 3, not 6
    the = sp.piece_to_id("\u2581the")
    assert base[the] == 3 and space[the] and not boundary[the]
    bare_space = sp.piece_to_id("\u2581")
    assert base[bare_space] == 0 and space[bare_space]
    # The space counts after an ordinary token, not after BOS or <unk>.
    prev = [sp.piece_to_id("a"), sp.bos_id(), sp.unk_id(), bare_space]
    tokens = torch.tensor([i for p in prev for i in (p, the)])  # each prev followed by "▁the"
    counts = count_scored_bytes(tokens, torch.arange(0, 8, 2), (base, space, boundary))
    assert counts.tolist() == [4, 3, 3, 4]


def test_load_luts_checks(tmp_path):
    path = tokenizer_path(1024)
    with pytest.raises(ValueError, match="VOCAB_SIZE=512"):
        load_sentencepiece_luts(path, 512)
    with pytest.raises(FileNotFoundError, match="TOKENIZER_PATH"):
        load_sentencepiece_luts(tmp_path / "missing.model", 1024)
    assert load_sentencepiece_luts(path, 1100)[0].numel() == 1100


def test_luts_of_a_larger_model_vocab_and_an_empty_stream():
    sp = load_sp(1024)
    base, space, boundary = build_sentencepiece_luts(sp, 1030)
    assert base.numel() == space.numel() == boundary.numel() == 1030 and boundary[1024:].all()
    assert count_stream_bytes(torch.tensor([1]), (base, space, boundary)) == 0


@pytest.mark.parametrize("vocab_size", (1024, 8192))
def test_uniform_logits_give_log2_vocab_times_tokens_per_byte(vocab_size):
    sp = load_sp(vocab_size)
    luts = build_sentencepiece_luts(sp, vocab_size)
    tokens = real_stream(sp, num_docs=4, max_tokens=1500)
    model = UniformLM(vocab_size)
    # Independent byte count of all targets: decode per document segment of the stream.
    ids = tokens.tolist()
    cuts = [i for i, t in enumerate(ids) if t == sp.bos_id()] + [len(ids)]
    num_bytes = sum(decode_bytes(sp, ids[a + 1 : b]) for a, b in zip(cuts, cuts[1:]))
    res = eval_sliding(model, tokens, luts, seq_len=128, stride=32, batch_seqs=8, device="cpu", log=lambda m: None)
    assert res["num_scored_tokens"] == tokens.numel() - 1 and res["num_bytes"] == num_bytes
    assert res["val_loss"] == pytest.approx(math.log(vocab_size), rel=1e-6)
    assert res["val_bpb"] == pytest.approx(math.log2(vocab_size) * (tokens.numel() - 1) / num_bytes, rel=1e-6)
    # Roundtrip: truncated to ((N-1)//L)*L + 1 tokens.
    seq_len = 128
    kept = ((tokens.numel() - 1) // seq_len) * seq_len
    loss, bpb = eval_roundtrip(model, tokens, luts, seq_len=seq_len, batch_seqs=3, device="cpu")
    assert loss == pytest.approx(math.log(vocab_size), rel=1e-6)
    assert bpb == pytest.approx(math.log2(vocab_size) * kept / count_stream_bytes(tokens[: kept + 1], luts), rel=1e-6)
