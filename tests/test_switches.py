"""The zero-cost switches of the 8xH100 records (Polar Express Newton-Schulz, MuonEq-R, MIN_LR, WD taper,
SmearGate with the BOS fix, the sparse attention head-output gate): each against a plain reference written
from its paper/PR description, off = today's code, and all of them on in a smoke run and in the packed file.
"""

import dataclasses
import math
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from quant.policy import QuantPolicy
from model.gpt import BOS_TOKEN_ID, GPT, SWITCH_CONFIG, build_model_config
from model.gates import smear_previous_token, sparse_head_gate
from model.stack import looped_layer_order
from trainer.muon_switches import POLAR_EXPRESS_COEFFS
from trainer.optim import JORDAN_COEFFS, Muon, build_optimizers, newton_schulz, split_params
from trainer.schedule import lr_multiplier
from trainer.wd_taper import wd_taper_multiplier
from primitives.settings import Hyperparameters

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_train import read_result, run_trainer, trainer_env  # noqa: E402

ALL_SWITCHES = {"MUON_NS_COEFFS": "polar_express", "MUON_ROW_NORMALIZE": "1", "MIN_LR": "0.1",
                "WD_TAPER_START_FRAC": "0.7", "WD_TAPER_FINAL_MULT": "0.5", "SMEAR_GATE_ENABLED": "1",
                "SPARSE_ATTN_GATE_ENABLED": "1", "GATE_WINDOW": "8", "NUM_LOOPS": "1", "LOOP_START": "1", "LOOP_END": "1",
                "ENABLE_LOOPING_AT": "0.5", "DOC_PACKED_ATTENTION": "1", "LN_SCALE": "1", "SKIP_GATES_ENABLED": "1",
                "PARALLEL_START_LAYER": "1"}
NS_COEFFS = {"jordan": JORDAN_COEFFS, "polar_express": POLAR_EXPRESS_COEFFS}  # MUON_NS_COEFFS's choices
TINY = dict(vocab_size=64, num_layers=2, model_dim=32, num_heads=4, num_kv_heads=2, mlp_mult=2.0, rope_dims=4,
            xsa_last_n=1)


def jordan_iteration_as_before(g, steps, eps=1e-7):
    """newton_schulz as it was before MUON_NS_COEFFS (fixed coefficients written out)."""
    x = g.bfloat16()
    tall = x.size(-2) > x.size(-1)
    x = x.mT if tall else x
    x = x / x.norm(dim=(-2, -1), keepdim=True).clamp(min=eps)
    for _ in range(steps):
        gram = x @ x.mT
        x = torch.baddbmm(x, torch.baddbmm(gram, gram, gram, beta=-4.7750, alpha=2.0315), x, beta=3.4445)
    return x.mT if tall else x


def test_default_coefficients_are_todays_iteration_bit_for_bit():
    torch.manual_seed(0)
    g = torch.randn(3, 48, 80)
    assert torch.equal(newton_schulz(g, 5), jordan_iteration_as_before(g, 5))
    assert torch.equal(newton_schulz(g.mT, 5), jordan_iteration_as_before(g.mT, 5))


@pytest.mark.parametrize("shape", [(4, 64, 128), (4, 128, 64)])
def test_polar_express_is_closer_to_the_polar_factor_than_jordan(shape):
    """After 5 steps, the singular values of the Polar Express iterate lie closer to 1, and the iterate
    closer to the SVD polar factor U V^T, than with Keller Jordan's coefficients (which end in ~[0.68, 1.14])."""
    torch.manual_seed(1)
    g = torch.randn(*shape)
    u, _, vh = torch.linalg.svd(g, full_matrices=False)
    polar = u @ vh
    worst, error = {}, {}
    for name, coeffs in NS_COEFFS.items():
        out = newton_schulz(g, 5, coeffs=coeffs).float()
        worst[name] = (torch.linalg.svdvals(out) - 1).abs().max().item()
        error[name] = ((out - polar).norm(dim=(-2, -1)) / polar.norm(dim=(-2, -1))).max().item()
    assert worst["jordan"] > 0.3 and worst["polar_express"] < 0.16
    assert error["polar_express"] < 0.6 * error["jordan"]
    # past the 5-step table the converged quintic (15/8, -10/8, 3/8) runs: more steps, closer still
    assert NS_COEFFS["polar_express"][-1] == (1.875, -1.25, 0.375)
    out7 = newton_schulz(g, 7, coeffs=NS_COEFFS["polar_express"]).float()
    assert (torch.linalg.svdvals(out7) - 1).abs().max().item() < worst["polar_express"] / 2


def muon_reference(params, grads_per_step, *, lr, momentum, wd, row_normalize, coeffs):
    """Muon written plainly, one matrix at a time: buf = m buf + (1 - m) g; u = (1 - m) g + m buf (Nesterov);
    MuonEq-R: each row of u divided by its L2 norm; u = NS5(u); p = p (1 - lr wd) - lr sqrt(max(1, R/C)) u."""
    params = [p.clone() for p in params]
    bufs = [torch.zeros_like(p) for p in params]
    for grads in grads_per_step:
        for i, (p, g) in enumerate(zip(params, grads)):
            bufs[i] = momentum * bufs[i] + (1 - momentum) * g
            u = (1 - momentum) * g + momentum * bufs[i]
            if row_normalize:
                u = torch.stack([row / max(row.norm().item(), 1e-7) for row in u])
            u = newton_schulz(u[None], 5, coeffs=coeffs)[0].float()
            params[i] = p * (1 - lr * wd) - lr * max(1, p.size(0) / p.size(1)) ** 0.5 * u
    return params


@pytest.mark.parametrize("row_normalize", [False, True])
def test_muon_row_normalize_matches_the_plain_reference(row_normalize):
    torch.manual_seed(2)
    shapes = [(24, 16), (24, 16), (16, 40)]
    start = [torch.randn(s) for s in shapes]
    grads = [[torch.randn(s) * (1 + torch.arange(s[0])[:, None]) for s in shapes] for _ in range(3)]  # uneven rows
    params = [torch.nn.Parameter(p.clone()) for p in start]
    opt = Muon(params, lr=0.05, momentum=0.9, weight_decay=0.1, row_normalize=row_normalize, ns_coeffs="polar_express")
    for step_grads in grads:
        for p, g in zip(params, step_grads):
            p.grad = g.clone()
        opt.step()
    ref = muon_reference(start, grads, lr=0.05, momentum=0.9, wd=0.1, row_normalize=row_normalize,
                         coeffs=NS_COEFFS["polar_express"])
    for p, r in zip(params, ref):
        torch.testing.assert_close(p.detach(), r, rtol=0, atol=2e-5)
    other = muon_reference(start, grads, lr=0.05, momentum=0.9, wd=0.1, row_normalize=not row_normalize,
                           coeffs=NS_COEFFS["polar_express"])
    assert max((p.detach() - o).abs().max().item() for p, o in zip(params, other)) > 1e-3  # the switch matters


def test_min_lr_floors_only_the_warmdown_and_zero_is_todays_schedule():
    for progress in (0.0, 0.5, 0.79, 0.8, 0.9, 0.97, 1.0):
        assert lr_multiplier(progress, 0.2, 0.0) == lr_multiplier(progress, 0.2) == max(0.0, min(1.0, (1 - progress) / 0.2))
    assert lr_multiplier(0.5, 0.2, 0.1) == 1.0
    assert lr_multiplier(0.9, 0.2, 0.1) == pytest.approx(0.5)
    assert lr_multiplier(0.99, 0.2, 0.1) == 0.1 and lr_multiplier(1.0, 0.2, 0.1) == 0.1
    assert lr_multiplier(1.0, 0.0, 0.1) == 1.0  # no warmdown: nothing to floor


def test_wd_taper_is_flat_then_linear_to_the_final_multiple():
    taper = [wd_taper_multiplier(p, 0.7, 0.5) for p in (0.0, 0.7, 0.8, 0.85, 1.0)]
    assert taper == pytest.approx([1.0, 1.0, 1.0 - 0.5 / 3, 0.75, 0.5])
    assert all(wd_taper_multiplier(p, 0.7, 1.0) == 1.0 for p in (0.0, 0.9, 1.0))  # off
    assert wd_taper_multiplier(1.0, 1.0, 0.5) == 1.0 and wd_taper_multiplier(0.5, 0.0, 0.0) == 0.5


def smear_reference(x, ids, gate_w, lam):
    out = x.clone()
    for b in range(x.size(0)):
        for t in range(1, x.size(1)):
            if ids[b, t] != BOS_TOKEN_ID:
                gate = lam.item() / (1 + math.exp(-float(gate_w[0] @ x[b, t, :gate_w.size(1)])))
                out[b, t] = x[b, t] + gate * x[b, t - 1]
    return out


def test_smear_gate_matches_loops_and_nothing_crosses_a_bos():
    torch.manual_seed(3)
    ids = torch.tensor([[5, 7, BOS_TOKEN_ID, 9, 4, BOS_TOKEN_ID, 3], [BOS_TOKEN_ID, 2, 2, 8, BOS_TOKEN_ID, 6, 6]])
    x, gate_w, lam = torch.randn(2, 7, 16), torch.randn(1, 6), torch.tensor([0.7])
    got = smear_previous_token(x, ids, gate_w, lam)
    torch.testing.assert_close(got, smear_reference(x, ids, gate_w, lam), rtol=1e-6, atol=1e-6)
    bos = ids == BOS_TOKEN_ID
    assert torch.equal(got[bos], x[bos]) and not torch.equal(got[~bos][1:], x[~bos][1:])
    x2 = x.clone()
    x2[0, :2] += 5.0  # the document before the BOS at position 2 changes: nothing from it reaches 2 onwards
    assert torch.equal(smear_previous_token(x2, ids, gate_w, lam)[0, 2:], got[0, 2:])
    assert torch.equal(smear_previous_token(x, ids, gate_w, torch.zeros(1)), x)  # zero init: the identity


def test_sparse_head_gate_matches_loops():
    torch.manual_seed(4)
    y, x, gate_w = torch.randn(2, 5, 4, 8), torch.randn(2, 5, 32), torch.randn(4, 12)
    got = sparse_head_gate(y, x, gate_w, 0.5)
    ref = torch.empty_like(y)
    for b in range(2):
        for t in range(5):
            for h in range(4):
                ref[b, t, h] = y[b, t, h] / (1 + math.exp(-0.5 * float(gate_w[h] @ x[b, t, :12])))
    torch.testing.assert_close(got, ref, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(sparse_head_gate(y, x, torch.zeros(4, 12), 1.0), y / 2)  # zero init: 0.5


def test_switches_off_leave_the_model_config_and_parameters_as_today():
    hp = Hyperparameters(run_id="x")
    config = build_model_config(hp)
    assert not set(SWITCH_CONFIG) & set(config)
    model = GPT(**config)
    assert not [n for n, _ in model.named_parameters() if "gate" in n or "smear" in n]
    assert build_optimizers(model, hp, is_cuda=False).muon.ns_coeffs == NS_COEFFS["jordan"]


def test_gates_reach_the_model_adamw_and_float_storage():
    hp = dataclasses.replace(Hyperparameters(run_id="x", **{k: v for k, v in TINY.items() if k != "vocab_size"}),
                             smear_gate_enabled=True, sparse_attn_gate_enabled=True, gate_window=8)
    config = build_model_config(hp)
    assert {k: config[k] for k in SWITCH_CONFIG if k in config} == dict(  # the scale is GPT's default: left out
        smear_gate_enabled=True, sparse_attn_gate_enabled=True, gate_window=8)
    model = GPT(**config)
    shapes = {n: tuple(p.shape) for n, p in model.named_parameters() if "gate" in n or "smear" in n}
    assert shapes == {"smear_gate_w": (1, 8), "smear_lambda": (1,), **{f"blocks.{i}.attn.attn_gate_w": (4, 8)
                                                                         for i in range(hp.num_layers)}}
    groups = split_params(model)
    assert set(shapes) <= set(groups["scalar"]) and not set(shapes) & set(groups["muon"])
    policy = QuantPolicy()
    assert all(policy.bits_for(n, s) is None for n, s in shapes.items())  # float passthrough


def test_gated_model_learns_the_gates_and_stays_causal():
    torch.manual_seed(5)
    model = GPT(**TINY, smear_gate_enabled=True, sparse_attn_gate_enabled=True, gate_window=8)
    model.init_weights()
    ids = torch.randint(0, 64, (2, 12))
    ids[:, 6] = BOS_TOKEN_ID
    loss = model(ids, torch.roll(ids, -1, 1))
    loss.backward()
    assert model.smear_lambda.grad.abs().item() > 0 and model.blocks[0].attn.attn_gate_w.grad.abs().sum() > 0
    with torch.no_grad():
        model.smear_lambda.fill_(1.0)
        model.smear_gate_w.normal_()
        logits = model.forward_logits(ids)
        changed = ids.clone()
        changed[:, 9:] = (changed[:, 9:] + 1) % 64
        torch.testing.assert_close(model.forward_logits(changed)[:, :9], logits[:, :9])


def test_bad_switch_values_are_refused_naming_the_variable():
    for env, message in (({"MUON_NS_COEFFS": "cubic"}, "MUON_NS_COEFFS='cubic': expected one of jordan, polar_express"),
                         ({"MIN_LR": "1.5"}, "MIN_LR=1.5: expected a finite number in [0, 1]"),
                         ({"GATE_WINDOW": "0"}, "GATE_WINDOW=0: expected a whole number >= 1")):
        with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]")):
            Hyperparameters.from_env({"RUN_ID": "x", **env}, log=lambda *_: None)


@pytest.mark.slow
def test_smoke_preset_runs_with_every_switch_on(tiny_dataset, sp1024_model, tmp_path):
    run_trainer(trainer_env(tiny_dataset, sp1024_model, tmp_path, RUN_ID="switches", **ALL_SWITCHES))
    result = read_result(tmp_path, "switches")
    assert result["steps"] == 8 and all(math.isfinite(v) for v in result["train_losses"])
    assert math.isfinite(result["val_bpb_sliding"]) and result["val_bpb_roundtrip"] < 20
    hp = result["hyperparameters"]
    assert (hp["muon_ns_coeffs"], hp["smear_gate_enabled"], hp["min_lr"]) == ("polar_express", True, 0.1)
    assert "layer_loop:on step:4 progress:0.500 order:0,1,1" in (tmp_path / "switches" / "train.log").read_text()


@pytest.mark.slow
def test_packed_train_gpt_runs_with_every_switch_on(tiny_dataset, sp1024_model, tmp_path):
    """The packed train_gpt.py (tools/bundle.py), run from its own folder without PYTHONPATH, as a record's
    smoke run does: every switch on, 3 steps, the export and the final evals; its losses equal the package's."""
    import subprocess

    from kit.bundle import write_bundle

    folder = tmp_path / "record"
    write_bundle(folder)
    env = trainer_env(tiny_dataset, sp1024_model, tmp_path / "runs", RUN_ID="packed", ITERATIONS=3, **ALL_SWITCHES)
    env.pop("PYTHONPATH")
    proc = subprocess.run([sys.executable, "train_gpt.py"], cwd=folder, env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    packed = read_result(tmp_path / "runs", "packed")
    assert packed["bytes_code"] == (folder / "train_gpt.py").stat().st_size
    run_trainer(trainer_env(tiny_dataset, sp1024_model, tmp_path / "pkg", RUN_ID="packed", ITERATIONS=3, **ALL_SWITCHES))
    package = read_result(tmp_path / "pkg", "packed")
    assert packed["train_losses"] == package["train_losses"] and len(packed["train_losses"]) == 3
    assert packed["val_bpb_sliding"] == package["val_bpb_sliding"] and math.isfinite(packed["val_bpb_sliding"])


def test_looped_layer_order_is_the_records_layout():
    assert looped_layer_order(11, 2, 3, 5) == [0, 1, 2, 3, 4, 5, 3, 4, 5, 3, 4, 5, 6, 7, 8, 9, 10]
    assert looped_layer_order(7, 0, 3, 5) == list(range(7)) and looped_layer_order(4, 1, 1, 2) == [0, 1, 2, 1, 2, 3]


def looped_reference(model, ids, order):
    """The U-Net over a block sequence, written plainly: the first half's outputs are kept, the second half
    adds them back last-in first-out, each scaled by its skip weight, before running its block."""
    t = ids.size(1)
    freqs = torch.outer(torch.arange(t, dtype=torch.float32), model.rope_inv_freq)
    x = x0 = F.rms_norm(model.tok_emb(ids), (model.tok_emb.weight.size(1),))
    half, kept = len(order) // 2, []
    for i in order[:half]:
        x = model.blocks[i](x, x0, freqs.cos(), freqs.sin())
        kept.append(x)
    for j, i in enumerate(order[half:]):
        if j < len(order[:half]):
            x = x + model.skip_weights[j] * kept[half - 1 - j]
        x = model.blocks[i](x, x0, freqs.cos(), freqs.sin())
    x = F.rms_norm(x, (x.size(-1),))
    return model.logit_softcap * torch.tanh(F.linear(x, model.tok_emb.weight) / model.logit_softcap)


def test_depth_recurrence_reuses_the_blocks_and_follows_the_flag_under_compile():
    torch.manual_seed(6)
    plain = GPT(**{**TINY, "num_layers": 5})
    model = GPT(**{**TINY, "num_layers": 5}, num_loops=2, loop_start=1, loop_end=2)
    plain.init_weights()
    model.init_weights()
    # the same matrices; only the skip weights grow (order 0 1 2 1 2 1 2 3 4: 4 encoder outputs, 5 decoder blocks)
    assert model.skip_weights.shape == (4, 32) and plain.skip_weights.shape == (2, 32)
    assert {n for n, _ in model.named_parameters()} == {n for n, _ in plain.named_parameters()}
    with torch.no_grad():
        model.skip_weights.uniform_(0.5, 1.5)
    ids = torch.randint(0, 64, (2, 12))
    assert model.looping_active  # built from a config (the artifact's evaluation): looped
    with torch.no_grad():
        looped = model.forward_logits(ids)
        torch.testing.assert_close(looped, looped_reference(model, ids, [0, 1, 2, 1, 2, 1, 2, 3, 4]))
        model.looping_active = False
        unlooped = model.forward_logits(ids)
        torch.testing.assert_close(unlooped, looped_reference(model, ids, [0, 1, 2, 3, 4]))
        targets = torch.roll(ids, -1, 1)
        compiled = torch.compile(model, fullgraph=True, dynamic=False)  # compiles forward(ids, targets)
        eager_unlooped = model(targets, ids)
        torch.testing.assert_close(compiled(targets, ids), eager_unlooped, rtol=1e-5, atol=1e-5)
        model.looping_active = True  # a Python attribute: torch.compile must re-trace, not keep the first graph
        eager_looped = model(targets, ids)
        torch.testing.assert_close(compiled(targets, ids), eager_looped, rtol=1e-5, atol=1e-5)
    assert (looped - unlooped).abs().max() > 1e-3 and abs(eager_looped - eager_unlooped) > 1e-4


def test_flop_count_of_depth_recurrence_is_the_runs_mean_from_the_loop_start():
    """The looped graph counts 2 x 2 more block passes; from ENABLE_LOOPING_AT=0.35 of the steps the run's mean is
    0.35 plain + 0.65 looped, and of the wallclock the token-weighted (harmonic) mean, which is lower."""
    from model.gpt import count_train_flops_per_token

    plain_cfg = {**TINY, "num_layers": 5}
    loop_cfg = {**plain_cfg, "num_loops": 2, "loop_start": 1, "loop_end": 2}
    plain, looped = count_train_flops_per_token(plain_cfg, 64), count_train_flops_per_token(loop_cfg, 64)
    one_block = plain - count_train_flops_per_token({**TINY, "num_layers": 4}, 64)
    assert looped == pytest.approx(plain + 4 * one_block, rel=0.02) and looped > plain
    by_steps = count_train_flops_per_token(loop_cfg, 64, looping_from=0.35)
    assert by_steps == pytest.approx(0.35 * plain + 0.65 * looped, rel=1e-12)
    by_time = count_train_flops_per_token(loop_cfg, 64, looping_from=0.35, by_time=True)
    assert by_time == pytest.approx(1 / (0.35 / plain + 0.65 / looped), rel=1e-12) and plain < by_time < by_steps
    assert count_train_flops_per_token(plain_cfg, 64, looping_from=0.35) == plain  # no loops: the one graph
