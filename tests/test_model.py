"""Model, optimizer split, schedules, QAT gate and EMA of train_gpt.py (CPU)."""

import math

import pytest
import torch
import torch.nn.functional as F

from primitives.rowquant import fake_quantize_per_row
from quant.policy import QuantPolicy
from model.attention import attention
from model.gpt import (
    GPT,
    apply_partial_rope,
    build_model_config,
    count_train_flops_per_token,
    embed_as,
    exclusive_self_attention,
)
from trainer.optim import Muon, build_optimizers, split_params
from trainer.schedule import EMA, lr_multiplier, muon_momentum_at, qat_active
from primitives.settings import Hyperparameters

TINY = dict(vocab_size=64, num_layers=4, model_dim=32, num_heads=4, num_kv_heads=2, mlp_mult=3.0,
            rope_dims=4, xsa_last_n=2)


def tiny_model(seed=0, **overrides):
    torch.manual_seed(seed)
    model = GPT(**{**TINY, **overrides})
    model.init_weights()
    return model


def test_forward_shapes_and_loss_is_mean_cross_entropy():
    model = tiny_model()
    x = torch.randint(0, 64, (3, 16))
    y = torch.randint(0, 64, (3, 16))
    logits = model.forward_logits(x)
    assert logits.shape == (3, 16, 64) and logits.dtype == torch.float32
    assert logits.abs().max() <= 30.0
    ref = F.cross_entropy(logits.reshape(-1, 64), y.reshape(-1))
    assert torch.allclose(model(x, y), ref)
    # near-uniform at init: loss close to ln(V)
    assert abs(model(x, y).item() - math.log(64)) < 0.5


def test_causality_future_tokens_do_not_change_past_logits():
    model = tiny_model()
    x = torch.randint(0, 64, (1, 12))
    x2 = x.clone()
    x2[0, 8:] = (x2[0, 8:] + 1) % 64
    a, b = model.forward_logits(x), model.forward_logits(x2)
    assert torch.allclose(a[:, :8], b[:, :8], atol=1e-6)
    assert not torch.allclose(a[:, 8:], b[:, 8:])


def test_parallel_residual_block_matches_the_gpt_j_formula():
    """PARALLEL_RESIDUAL_START=2 of 4 layers: blocks 2 and 3 compute x + a*attn(n) + m*mlp(n) with one
    n = rms_norm(mix(x, x0)); blocks 0 and 1 stay sequential; -1 is the plain model, bit for bit."""
    model = tiny_model(parallel_residual_start=2)
    assert [b.parallel for b in model.blocks] == [False, False, True, True]
    torch.manual_seed(1)
    for p in model.parameters():  # leave the init's ones/zeros so a dropped term shows
        if p.ndim == 1 or p.shape[0] == 2:
            p.data.add_(0.3 * torch.randn_like(p))
    t, dim = 10, TINY["model_dim"]
    freqs = torch.outer(torch.arange(t, dtype=torch.float32), model.rope_inv_freq)
    cos, sin = freqs.cos(), freqs.sin()
    x, x0 = torch.randn(2, t, dim), torch.randn(2, t, dim)
    for i, block in enumerate(model.blocks):
        mixed = block.resid_mix[0] * x + block.resid_mix[1] * x0
        n = F.rms_norm(mixed, (dim,))
        one = torch.ones(dim)  # the unscaled outputs, scaled here
        parallel = mixed + block.attn_scale * block.attn(n, cos, sin, one) + block.mlp_scale * block.mlp(n, one)
        after_attn = mixed + block.attn_scale * block.attn(n, cos, sin, one)
        serial = after_attn + block.mlp_scale * block.mlp(F.rms_norm(after_attn, (dim,)), one)
        out = block(x, x0, cos, sin)
        assert torch.allclose(out, parallel if i >= 2 else serial, atol=1e-6), i
        assert not torch.allclose(parallel, serial, atol=1e-3)
    ids = torch.randint(0, 64, (2, 12))
    assert torch.equal(tiny_model(parallel_residual_start=-1).forward_logits(ids), tiny_model().forward_logits(ids))
    assert not torch.allclose(tiny_model(parallel_residual_start=0).forward_logits(ids), tiny_model().forward_logits(ids))


def test_parallel_residual_start_is_validated_and_reaches_the_model_config():
    hp = Hyperparameters.from_env({"PARALLEL_RESIDUAL_START": "6"}, log=lambda *_: None)
    assert build_model_config(hp)["parallel_residual_start"] == 6
    assert Hyperparameters.from_env({}, log=lambda *_: None).parallel_residual_start == -1
    for bad, expected in (("8", "-1 \\(off\\) or a layer index 0..7"), ("-2", "a whole number >= -1")):
        with pytest.raises(ValueError, match=f"PARALLEL_RESIDUAL_START={bad}: expected {expected}"):
            Hyperparameters.from_env({"PARALLEL_RESIDUAL_START": bad, "PRESET": "1xh100"}, log=lambda *_: None)


def plain_rope(x, base, dims):
    """Reference RoPE with complex numbers on the first `dims` dims, half-split pairing."""
    t = x.size(1)
    inv = 1.0 / base ** (torch.arange(0, dims, 2, dtype=torch.float64) / dims)
    ang = torch.outer(torch.arange(t, dtype=torch.float64), inv)  # [T, dims/2]
    z = torch.complex(x[..., : dims // 2].double(), x[..., dims // 2: dims].double())
    z = z * torch.exp(-1j * ang)[None, :, None, :]
    return torch.cat((z.real, z.imag), -1).float()


def test_partial_rope_rotates_only_the_first_dims():
    torch.manual_seed(0)
    x = torch.randn(2, 10, 3, 16)
    dims, base = 8, 10_000.0
    inv = 1.0 / base ** (torch.arange(0, dims, 2) / dims)
    freqs = torch.outer(torch.arange(10, dtype=torch.float32), inv)
    out = apply_partial_rope(x, freqs.cos(), freqs.sin())
    assert torch.equal(out[..., dims:], x[..., dims:])
    assert torch.allclose(out[..., :dims], plain_rope(x, base, dims), atol=1e-5)
    # rotation preserves the norm of the rotated part and position 0 is unrotated
    assert torch.allclose(out[..., :dims].norm(dim=-1), x[..., :dims].norm(dim=-1), atol=1e-5)
    assert torch.allclose(out[:, 0], x[:, 0])


def test_xsa_output_is_orthogonal_to_own_value_per_head_with_gqa():
    torch.manual_seed(0)
    b, t, h, hkv, d = 2, 7, 8, 2, 16
    q, k, v = torch.randn(b, t, h, d), torch.randn(b, t, hkv, d), torch.randn(b, t, hkv, d)
    y = attention(q, k, v)
    z = exclusive_self_attention(y, v)
    vn = F.normalize(v, dim=-1)
    group = h // hkv
    for head in range(h):
        own_v = vn[:, :, head // group]  # SDPA enable_gqa maps query head h to kv head h // group
        assert torch.allclose((z[:, :, head] * own_v).sum(-1), torch.zeros(b, t), atol=1e-5)
        # the removed part is exactly the projection onto own v (F.normalize, not rms_norm)
        proj = (y[:, :, head] * own_v).sum(-1, keepdim=True) * own_v
        assert torch.allclose(z[:, :, head], y[:, :, head] - proj, atol=1e-6)


def xsa_reference(y, v):
    """XSA as first written (F.normalize, autograd's backward): [B, T, H, D], [B, T, Hkv, D]."""
    b, t, h, d = y.shape
    yg = y.reshape(b, t, v.size(2), h // v.size(2), d)
    vn = F.normalize(v, dim=-1).unsqueeze(3)
    return (yg - (yg * vn).sum(-1, keepdim=True) * vn).reshape(b, t, h, d)


def test_xsa_projection_form_equals_the_normalize_form_with_its_gradients():
    """XSA as y - (y.v / |v|^2) v: torch.autograd.gradcheck in float64 (GQA groups of 2 and 4, one zero value
    vector, where F.normalize clamps), and forward and gradients equal to the F.normalize form."""
    torch.manual_seed(0)
    for h, hkv in ((4, 2), (8, 2), (4, 4)):
        y = torch.randn(2, 5, h, 8, dtype=torch.float64, requires_grad=True)
        v = torch.randn(2, 5, hkv, 8, dtype=torch.float64)
        v[0, 1, 0] = 0.0
        v.requires_grad_()
        assert torch.autograd.gradcheck(exclusive_self_attention, (y, v))
        grad = torch.randn_like(y)
        out = exclusive_self_attention(y, v)
        ref = xsa_reference(y, v)
        assert torch.allclose(out, ref, rtol=0, atol=1e-12)
        got, want = torch.autograd.grad(out, (y, v), grad), torch.autograd.grad(ref, (y, v), grad)
        assert all(torch.allclose(a, b, rtol=0, atol=1e-10) for a, b in zip(got, want))


def test_xsa_in_bf16_rounds_no_worse_than_the_normalize_form():
    """Under bf16 XSA computes in float32 and rounds once: its error against float64 is at most the F.normalize
    form's (which rounds each bf16 intermediate), forward and backward; eager and compiled agree."""
    torch.manual_seed(1)
    y64, v64, g64 = torch.randn(4, 64, 8, 64, dtype=torch.float64), torch.randn(4, 64, 4, 64, dtype=torch.float64), \
        torch.randn(4, 64, 8, 64, dtype=torch.float64)
    errors = {}
    compiled = torch.compile(exclusive_self_attention, backend="aot_eager", fullgraph=True)
    for name, fn in (("fused", exclusive_self_attention), ("compiled", compiled), ("normalize", xsa_reference)):
        y, v = y64.bfloat16().requires_grad_(), v64.bfloat16().requires_grad_()
        out = fn(y, v)
        assert out.dtype == torch.bfloat16
        gy, gv = torch.autograd.grad(out, (y, v), g64.bfloat16())
        yr, vr = y64.bfloat16().double().requires_grad_(), v64.bfloat16().double().requires_grad_()
        ref = xsa_reference(yr, vr)
        ry, rv = torch.autograd.grad(ref, (yr, vr), g64.bfloat16().double())
        errors[name] = [(a.double() - b).abs().max().item() for a, b in ((out, ref), (gy, ry), (gv, rv))]
    assert all(f <= n for f, n in zip(errors["fused"], errors["normalize"])), errors
    assert errors["compiled"] == errors["fused"], errors


def test_attention_gqa_matches_sdpa_with_repeated_kv():
    torch.manual_seed(0)
    q, k, v = torch.randn(2, 9, 4, 8), torch.randn(2, 9, 2, 8), torch.randn(2, 9, 2, 8)
    ref = F.scaled_dot_product_attention(q.transpose(1, 2), k.repeat_interleave(2, 2).transpose(1, 2),
                                         v.repeat_interleave(2, 2).transpose(1, 2), is_causal=True)
    assert torch.allclose(attention(q, k, v), ref.transpose(1, 2), atol=1e-6)


def test_optimizer_split_matrices_to_muon_rest_to_adamw():
    model = tiny_model()
    groups = split_params(model)
    assert set(groups["muon"]) == {f"blocks.{i}.{m}.weight" for i in range(4)
                                   for m in ("attn.c_q", "attn.c_k", "attn.c_v", "attn.proj", "mlp.fc", "mlp.proj")}
    assert groups["embed"] == ["tok_emb.weight"]
    assert "skip_weights" in groups["scalar"] and "blocks.0.resid_mix" in groups["scalar"]
    assert "blocks.0.attn.q_gain" in groups["scalar"]
    every = set(groups["muon"]) | set(groups["scalar"]) | set(groups["embed"]) | set(groups["head"])
    assert every == {n for n, _ in model.named_parameters()}
    hp = Hyperparameters()
    optimizers = build_optimizers(model, hp, is_cuda=False)
    muon, adam = optimizers.muon, optimizers.adamw
    assert isinstance(muon, Muon) and isinstance(adam, torch.optim.AdamW)
    assert muon.param_groups[0]["weight_decay"] == hp.muon_wd and adam.param_groups[0]["weight_decay"] == hp.adam_wd
    assert sum(len(g["params"]) for g in muon.param_groups) == len(groups["muon"])


def test_warmdown_and_qat_schedule_on_a_fake_clock():
    cap = 600.0
    # progress = elapsed / cap; warmdown over the last 40 %, QAT over the last 10 %
    lrs = [lr_multiplier(t / cap, 0.4) for t in (0, 300, 360, 480, 600)]
    assert lrs == pytest.approx([1.0, 1.0, 1.0, 0.5, 0.0])
    assert [qat_active(t / cap, 0.1) for t in (0, 500, 539, 540, 599)] == [False, False, False, True, True]
    assert not qat_active(0.99, 0.0) and lr_multiplier(0.99, 0.0) == 1.0
    hp = Hyperparameters(muon_momentum_warmup_steps=100, muon_momentum_warmup_frac=0)  # the default preset's 0.85 -> 0.95
    assert muon_momentum_at(0, hp) == pytest.approx(0.85) and muon_momentum_at(50, hp) == pytest.approx(0.90)
    assert muon_momentum_at(1000, hp) == pytest.approx(0.95)


def test_qat_switch_recompiles_the_compiled_model_once_and_keeps_fake_quant_out_until_then():
    """Design §4: a flag read inside a compiled model must not be constant-folded at first trace. The
    QAT-off graph holds no fake-quant op (no row amax); switching QAT on compiles exactly one more graph,
    and switching back and forth after that compiles nothing."""
    graphs = []

    def capture(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    model = tiny_model(xsa_last_n=0)
    model.configure_qat(QuantPolicy(mlp_bits=6, attn_bits=6))
    compiled = torch.compile(model.forward_logits, backend=capture, fullgraph=True)
    x = torch.randint(0, 64, (2, 8))
    with torch.no_grad():
        off = compiled(x)
        model.set_qat(True)
        on = compiled(x)
        model.set_qat(False)
        assert torch.equal(compiled(x), off)
        model.set_qat(True)
        assert torch.equal(compiled(x), on)
    assert len(graphs) == 2, "QAT on/off: expected exactly one recompile"
    amax = ["amax" in str(node.target) for node in graphs[0].graph.nodes], [
        "amax" in str(node.target) for node in graphs[1].graph.nodes]
    assert sum(amax[0]) == 0 and sum(amax[1]) == 6 * len(model.blocks)  # one per block matrix
    torch._dynamo.reset()


def test_qat_gate_switches_the_compiled_model_at_run_time():
    """The compiled model (aot_eager) follows set_qat on both sides of the flip, and equals eager."""
    model = tiny_model(xsa_last_n=0)
    block = model.blocks[0]
    for policy, mlp, attn in ((QuantPolicy(), 8, 8),  # no bits set: QUANT_FIT's start, int8
                              (QuantPolicy(mlp_bits=5, attn_bits=7), 5, 7),
                              (QuantPolicy(mlp_bits=6, attn_bits=6), 6, 6)):  # the bits the rest of this test checks
        model.configure_qat(policy)
        assert (block.mlp.fc.qat_bits, block.mlp.proj.qat_bits, block.attn.c_q.qat_bits) == (mlp, mlp, attn)
    compiled = torch.compile(model.forward_logits, backend="aot_eager", fullgraph=True)
    x = torch.randint(0, 64, (2, 8))
    with torch.no_grad():
        off_eager, off_compiled = model.forward_logits(x), compiled(x)
        model.set_qat(True)
        on_eager, on_compiled = model.forward_logits(x), compiled(x)
    assert torch.allclose(off_eager, off_compiled, atol=1e-5)
    assert not torch.allclose(off_compiled, on_compiled, atol=1e-4), "QAT gate was constant-folded"
    assert torch.allclose(on_eager, on_compiled, atol=1e-5)
    # with QAT on, every block matrix is used exactly as the export will round it
    lin = model.blocks[0].mlp.fc
    out = lin(torch.eye(lin.in_features))
    assert torch.equal(out.T, fake_quantize_per_row(lin.weight, 6).detach())


@pytest.mark.parametrize("compiled", [False, True])
def test_embed_as_equals_the_float32_gather_cast_after_it_values_and_gradient(compiled):
    """The bf16 gather (the compiled step keeps no float32 [B, T, D] copy) changes no value and no gradient:
    the table's gradient is summed in float32 as the float32 gather's is (a bf16 table's own backward sums
    in bf16 on a CPU); float32 runs take the plain gather."""
    torch.manual_seed(0)
    w = torch.randn(64, 16)
    ids = torch.randint(0, 64, (4, 512))  # each row gathered ~32 times: a bf16 sum would be visibly off
    grad = torch.randn(4, 512, 16).bfloat16()
    fn = torch.compile(embed_as, backend="aot_eager", fullgraph=True) if compiled else embed_as
    new, old = w.clone().requires_grad_(), w.clone().requires_grad_()
    out = fn(ids, new, torch.bfloat16)
    out.backward(grad)
    ref = F.embedding(ids, old).to(torch.bfloat16)
    ref.backward(grad)
    assert out.dtype == torch.bfloat16 and torch.equal(out, ref)
    assert new.grad.dtype == torch.float32 and torch.equal(new.grad, old.grad)
    plain = w.clone().requires_grad_()
    assert torch.equal(embed_as(ids, plain, torch.float32), F.embedding(ids, w))


def test_ema_matches_closed_form():
    lin = torch.nn.Linear(3, 2, bias=False)
    with torch.no_grad():
        lin.weight.fill_(1.0)
    ema = EMA(lin)
    expected = torch.ones(2, 3)
    for t, value in enumerate((2.0, 3.0, -1.0, 4.0)):
        with torch.no_grad():
            lin.weight.fill_(value)
        ema.update(0.2)
        d = [0.1, 2 / 11, 0.2, 0.2][t]  # warmup (1 + t) / (10 + t), then capped at the decay
        expected = d * expected + (1 - d) * value
    assert torch.allclose(ema.shadow[0], expected)
    ema.copy_to_model()
    assert torch.allclose(lin.weight, expected)


def test_flops_per_token_matches_the_6n_plus_attention_estimate():
    hp = Hyperparameters()
    config = build_model_config(hp)
    flops = count_train_flops_per_token(config, hp.train_seq_len)
    d, layers, t = hp.model_dim, hp.num_layers, hp.train_seq_len
    matmul_params = layers * (2 * d * d + 2 * d * d // 2 + 2 * d * 3 * d) + hp.vocab_size * d
    attn = layers * 2 * 2 * t * d  # QK^T and AV, forward, per token
    assert flops == pytest.approx(6 * matmul_params + 3 * attn, rel=0.02)


def test_the_step_s_inductor_options_are_the_ones_this_torch_knows():
    """torch.compile raises on an unknown option: the trainer passes only those this Inductor has (the records'
    torch 2.9.1 may lack the fusion cap)."""
    from unittest import mock

    import trainer.loop as loop

    assert loop.step_compile_options() == {"max_fusion_unique_io_buffers": 20}  # torch 2.13 has it
    with mock.patch.object(loop, "STEP_INDUCTOR_OPTIONS", {"max_fusion_unique_io_buffers": 20, "no_such_option": 1}):
        assert loop.step_compile_options() == {"max_fusion_unique_io_buffers": 20}


@pytest.mark.parametrize("num_layers", [4, 5])
def test_plain_models_run_blocks_is_run_stack_bit_for_bit(num_layers):
    """GPT.run_blocks (the plain U-Net, no model/stack.py switches) and model/stack.py's run_stack on the same model:
    the same residual stream and gradients, bit for bit (random weights: every skip and block contributes)."""
    from model.stack import run_stack, stack_init

    model = tiny_model(num_layers=num_layers, parallel_residual_start=num_layers - 1)  # last block GPT-J parallel
    assert not model.stacked
    assert stack_init(model, num_layers, 7, 0, 3, 5, 0, "mean") == 7  # the switches' attributes, all off
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.1 * torch.randn_like(p))
    x = torch.randn(2, 16, TINY["model_dim"], requires_grad=True)
    freqs = torch.outer(torch.arange(16.0), torch.rand(TINY["rope_dims"] // 2))
    outs = []
    for run in (model.run_blocks, lambda *a: run_stack(model, *a)):
        model.zero_grad()
        x.grad = None
        y = run(x, F.rms_norm(x, (x.size(-1),)), freqs.cos(), freqs.sin())
        y.square().sum().backward()
        outs.append((y.detach(), x.grad.clone(), [p.grad for p in model.parameters() if p.grad is not None]))
    (y0, gx0, gp0), (y1, gx1, gp1) = outs
    assert len(gp0) == len(gp1) == len(list(model.parameters())) - 1  # all but tok_emb (no head here)
    assert torch.equal(y0, y1) and torch.equal(gx0, gx1) and all(map(torch.equal, gp0, gp1))
    assert model.skip_weights.grad.abs().sum() > 0
