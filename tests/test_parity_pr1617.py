"""PR #1617's own GPT (its train_gpt.py on the CPU stand-ins) against the kit's at PRESET=1xh100-sp4096, toy widths
that keep its structure (8 layers, XSA on the last 2, partial RoPE, U-Net skips): the same weights under the same
names, logits and loss; its sliding eval (tools/parity/parity_pr1617.py). Skips without ../shared."""

import pytest
import torch

from tools.parity.parity_models import PR1617_SCRIPT, kit_model, pr1617_model, toy_settings
from tools.parity.parity_pr1617 import compare_row_quant, compare_sliding, tail_rescored_targets
from tools.parity.standins import cpu_standins, import_script

pytestmark = pytest.mark.skipif(not PR1617_SCRIPT.is_file(), reason="needs ../shared/reference/pr1617")


def test_logits_and_loss_equal_the_records():
    module = import_script(PR1617_SCRIPT)
    hp = toy_settings("1xh100-sp4096")
    assert (hp.num_layers, hp.xsa_last_n, hp.mlp_mult, hp.qk_gain_init) == (8, 2, 3.0, 3.0)
    kit = kit_model(hp, noise=0.1)  # logits of magnitude ~10, as at PR #1855's parity
    record = pr1617_model(module, kit, hp)
    x, y = torch.randint(0, hp.vocab_size, (2, 2, hp.train_seq_len), generator=torch.Generator().manual_seed(0))
    with cpu_standins(), torch.no_grad():
        kit.eval(), record.eval()
        ref = record.forward_logits(x)
        logits_diff = (ref - kit.forward_logits(x)).abs().max().item()
        assert 1 < ref.abs().max() < 30
        loss_diff = abs(record(x, y).item() - kit(x, y).item())
    assert logits_diff <= 1e-5 and loss_diff <= 1e-6, (logits_diff, loss_diff)


def test_its_sliding_eval_scores_the_kits_model_as_its_own_and_differs_from_the_kits_rule_only_at_the_tail():
    """The record's eval_val_sliding on its model and on the kit's (same weights): val_loss and val_bpb to 1e-6
    (measured 2e-9). The kit's eval_sliding scores every target once; the record's tail windows score the last
    stride targets again with less context, so its number differs (by 8e-4 nats here); with a stream whose tail
    holds no re-scored target the two would be one rule, but the record always has one (tail_rescored_targets)."""
    module = import_script(PR1617_SCRIPT)
    hp = toy_settings("1xh100-sp4096")
    kit = kit_model(hp, noise=0.1)
    record = pr1617_model(module, kit, hp)
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, hp.vocab_size, (600,), generator=gen)
    luts = (torch.randint(1, 5, (hp.vocab_size,), generator=gen).to(torch.int16),
            torch.rand(hp.vocab_size, generator=gen) < 0.5, torch.rand(hp.vocab_size, generator=gen) < 0.1)
    d = compare_sliding(module, kit, record, tokens, luts, hp.train_seq_len, 16, 4)
    assert max(abs(a - b) for a, b in zip(d["record_on_record"], d["record_on_kit"])) <= 1e-6, d
    assert d["rescored"] == tail_rescored_targets(599, 64, 16) == 48
    assert abs(d["kit_on_kit"][0] - d["record_on_kit"][0]) > 1e-5, d  # the tail rule, not the model


def test_its_row_quantizer_against_the_kits_rounding_and_scale_floor():
    """PR #1617's quantize_float_tensor against the kit's quantize_per_row at its clip quantile 0.9999984: rows whose
    clip is above 1 differ only where rounding with the float32 scale and with the stored float16 scale disagree
    (measured 11 .. 107 codes of 16,384); rows of small weights differ in most codes: the record floors the scale at
    1 / qmax (the official baseline's clamp_min(1 / 127), a fixed grid of 1/31 at int6), the kit does not."""
    module = import_script(PR1617_SCRIPT)
    large = compare_row_quant(module, std=1.0)
    assert all(0 < r["codes"] < 0.01 * 16384 for r in large), large
    small = compare_row_quant(module, std=0.05)
    assert all(r["codes"] > 0.5 * 16384 for r in small), small


@pytest.mark.parametrize("noise", [0.05, 1.0])
def test_the_presets_quantizer_writes_its_dequantized_matrices(noise):
    """PR #1617's quantize_state_dict_int8 + dequantize_state_dict_int8 against the kit's export under the preset's
    quantizer (QUANT_BASELINE_CLIP=0.9999984, int6 attention in blocks 0-2, int8 rows elsewhere, resid_mix and
    skip_weights included; its vectors per tensor), the same weights: every tensor to 1e-6 (measured 0), small weights
    (its scale floor) and large.
    Its late-QAT fake quantization equals the kit's at the same rule, bit for bit."""
    from primitives.rowquant import fake_quantize_per_row
    from quant.policy import QuantPolicy
    from tools.parity.parity_pr1617 import compare_state_quant

    module = import_script(PR1617_SCRIPT)
    kit = kit_model(toy_settings("1xh100-sp4096"), noise=noise)
    d = compare_state_quant(module, {n: t.detach() for n, t in kit.state_dict().items()},
                            QuantPolicy.from_env({"PRESET": "1xh100-sp4096"}))
    matrices = {n: v for n, v in d.items() if v[1] != "float32"}
    assert {v[0] for v in matrices.values()} == {v[1] for v in matrices.values()} == {"int6", "int8"}
    assert len(matrices) == 8 * 7 + 2 and max(v[2] for v in matrices.values()) <= 1e-6, matrices
    vectors = {n: v for n, v in d.items() if v[1] == "float32"}  # its per-tensor values, kept in float32
    assert len(vectors) == 8 * 3 and {v[0] for v in vectors.values()} == {"int6 per tensor", "int8 per tensor"}
    assert max(v[2] for v in vectors.values()) <= 1e-6, vectors
    w = next(p for n, p in kit.named_parameters() if n == "blocks.0.attn.c_q.weight").detach()
    for bits in (6, 8):
        assert torch.equal(module.fake_quantize_ste(w, bits), fake_quantize_per_row(w, bits, module.INT8_CLIP_Q))
