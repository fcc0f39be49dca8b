"""PR #1855's quantizer functions (its train_gpt.py on CPU stand-ins) against the kit's on the same weights and
Hessians (tools/parity/parity_quant.py; docs/parity.md). Skips without ../shared."""

import pytest

from tools.parity.parity_models import PR1855_SCRIPT, kit_model, packed_batch, record_model, toy_settings
from tools.parity.parity_quant import (compare_gate_rows, compare_gptq, compare_hessians, compare_lqer,
                                      compare_state_dict, record_quant_hparams, TOY_STATE_SHAPES)
from tools.parity.standins import import_script

pytestmark = pytest.mark.skipif(not PR1855_SCRIPT.is_file(), reason="needs ../shared/reference/pr1855")


@pytest.fixture(scope="module")
def module():
    return import_script(PR1855_SCRIPT)


def test_gptq_int6_and_int7_on_a_given_hessian_equal_the_records(module):
    for case in compare_gptq(module):
        assert case["scale"] == 0 and case["codes"] == 0 and case["max_abs"] <= 1e-6, case


def test_gptq_differs_where_an_input_never_fires_unless_in_the_records_arithmetic(module):
    # the record zeroes the weight columns of dead inputs (diag(H) = 0); the kit's default rounds them to nearest
    for case in compare_gptq(module, dead=3):
        assert case["scale"] == 0 and case["codes"] > 0 and case["max_abs"] > 1e-2, case
    for case in compare_gptq(module, dead=3, records=True) + compare_gptq(module, seed=1, records=True):
        assert case["codes"] == 0 and case["max_abs"] == 0, case


def test_gate_rows_int8_equal_the_records(module):
    for shape, case in compare_gate_rows(module).items():
        assert case["codes"] == 0 and case["max_abs"] == 0, (shape, case)


def test_lqer_forms_differ_and_both_reduce_the_error(module):
    d = compare_lqer(module)
    assert d["max_abs"] > 1e-3, d  # asym int2 A / signed int4 B (record) against min/scale int4 on both (kit)
    assert d["rel_err_record"] < 1 and d["rel_err_kit"] < 1, d


@pytest.mark.parametrize("looping", [False, True])
def test_hessians_equal_the_records_on_one_document_rows(module, looping):
    hp = toy_settings()
    kit = kit_model(hp)
    record = record_model(module, kit, hp)
    kit.looping_active = record.looping_active = looping
    x, y = packed_batch(2, hp.train_seq_len, hp.vocab_size, ([0], [0]))
    d = compare_hessians(module, kit, record, x, y)
    assert d.pop("only_kit") == [] and d.pop("only_record") == [] and len(d) == 6 * hp.num_layers + 1, d
    assert max(d.values()) <= 2e-6, d
    # several documents per row: the record calibrates without its document mask (forward_logits, no cu_seqlens), as
    # the preset's GPTQ_CALIB_CROSS_DOCS=1 does; the kit's default (its document mask) differs
    x, y = packed_batch(2, hp.train_seq_len, hp.vocab_size, ([0, 10, 30, 31, 50], [5, 40]))
    assert toy_settings().gptq_calib_cross_docs and kit.doc_packed_attention
    d = compare_hessians(module, kit, record, x, y, cross_docs=True)
    assert kit.doc_packed_attention and max(v for k, v in d.items() if not k.startswith("only")) <= 2e-6, d
    assert max(v for k, v in compare_hessians(module, kit, record, x, y).items() if not k.startswith("only")) > 0.1


def test_state_dict_gptq_equals_the_records_and_the_routing_differences_are_the_known_ones(module):
    h = record_quant_hparams(PR1855_SCRIPT.parent / "train_seed42.log")
    assert (h.matrix_bits, h.embed_bits, h.embed_clip_sigmas, h.lqer_rank, h.lqer_top_k, h.lqer_asym_group) == (
        6, 7, 14.0, 4, 3, 64)
    d = compare_state_dict(module, h, lqer=False)
    assert {n: v[:2] for n, v in d.items()} == {
        "tok_emb.weight": ("gptq (int7)", "int7"), "blocks.0.attn.c_q.weight": ("gptq (int6)", "int6"),
        "blocks.0.attn.c_k.weight": ("passthrough (float16)", "int6"), "blocks.0.mlp.fc.weight": ("gptq (int6)", "int6"),
        "blocks.0.attn.attn_gate_w": ("gate_int8_row", "float"), "blocks.0.attn_scale": ("passthrough (float16)", "float")}
    for name in ("tok_emb.weight", "blocks.0.attn.c_q.weight", "blocks.0.mlp.fc.weight", "blocks.0.attn_scale"):
        assert d[name][2] <= 1e-6, (name, d[name])
    assert d["blocks.0.attn.c_k.weight"][2] > 1e-2 and 0 < d["blocks.0.attn.attn_gate_w"][2] < 1e-3, d
    d = compare_state_dict(module, h, lqer=True)  # the LQER forms differ on the 3 tensors the record corrects
    assert all(d[n][0].endswith("+lqer_asym") and d[n][2] > 1e-3
               for n in ("tok_emb.weight", "blocks.0.attn.c_q.weight", "blocks.0.mlp.fc.weight")), d


@pytest.mark.parametrize("seed", [1, 2])
def test_state_dict_with_the_records_arithmetic_and_lqer_form_equals_the_records(module, seed):
    # QUANT_GPTQ_RECORDS=1 QUANT_LQER_ASYM=1 QUANT_GATE_INT8=1; c_k left out (its routing differs, above). The default float64
    # factorization flips a few codes here (6 and 1 of mlp.fc's 73,728): a one-step difference of 0.02
    h = record_quant_hparams(PR1855_SCRIPT.parent / "train_seed42.log")
    shapes = {n: s for n, s in TOY_STATE_SHAPES.items() if ".c_k." not in n}
    d = compare_state_dict(module, h, lqer=True, seed=seed, records=True, shapes=shapes)
    for name in ("tok_emb.weight", "blocks.0.attn.c_q.weight", "blocks.0.mlp.fc.weight"):
        assert d[name][0].endswith("+lqer_asym") and d[name][2] <= 1e-6, (name, d[name])
    assert d["blocks.0.attn.attn_gate_w"] == ("gate_int8_row", "int8", 0.0) and d["blocks.0.attn_scale"][2] == 0, d
    assert compare_state_dict(module, h, lqer=False, seed=seed, shapes=shapes)["blocks.0.mlp.fc.weight"][2] > 1e-2
