"""The blocks' attn_scale / mlp_scale folded into the output projections' weights (CastedLinear.scaled)."""

import contextlib
from unittest import mock

import torch
import torch.nn.functional as F

from model.gpt import GPT, CastedLinear
from primitives.rowquant import fake_quantize_per_row

TINY = dict(vocab_size=64, num_layers=3, model_dim=32, num_heads=4, num_kv_heads=2, mlp_mult=3.0, rope_dims=4,
            xsa_last_n=1)


def unfolded(self, x, scale):
    """The formula before the fold: the module's output, then times the scale."""
    return self(x) * scale.to(x.dtype)


def perturbed_model(dtype=torch.float64, **overrides):
    torch.manual_seed(0)
    model = GPT(**{**TINY, **overrides})
    model.init_weights()
    for p in model.parameters():  # off the init's ones and zeros, so a dropped or doubled scale shows
        p.data.add_(0.2 * torch.randn_like(p))
    return model.to(dtype)


def loss_and_grads(model, ids):
    model.zero_grad(set_to_none=True)
    loss = model(ids, ids.roll(-1, 1))
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def test_folded_scales_give_the_plain_formulas_loss_and_every_gradient():
    """float64: the fold changes where the scale is applied, nothing else; the scales' gradients (from the weight
    gradient) and the projections' gradients equal autograd's through the scaled output."""
    ids = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(1))
    for parallel in (-1, 1):
        model = perturbed_model(parallel_residual_start=parallel)
        loss, grads = loss_and_grads(model, ids)
        with mock.patch.object(CastedLinear, "scaled", unfolded):
            ref_loss, ref = loss_and_grads(model, ids)
        assert torch.allclose(loss, ref_loss, rtol=1e-12), parallel
        for name, g in ref.items():
            assert torch.allclose(grads[name], g, rtol=1e-9, atol=1e-12), (parallel, name)
        assert grads["blocks.0.mlp_scale"].abs().sum() > 0 and grads["blocks.0.attn_scale"].abs().sum() > 0


def test_a_forward_hook_still_sees_the_unscaled_projection():
    """LoRA TTT's and GPTQ's hooks on mlp.proj see proj(h) (and may change it) before the scale, as before."""
    model = perturbed_model(torch.float32)
    proj, seen = model.blocks[0].mlp.proj, []
    handle = proj.register_forward_hook(lambda mod, args, out: seen.append((args[0], out)))
    try:
        model.forward_logits(torch.randint(0, 64, (1, 8)))
    finally:
        handle.remove()
    (h, out), = seen
    assert torch.allclose(out, F.linear(h, proj.weight), atol=1e-6)
    assert not torch.allclose(out, F.linear(h, proj.weight) * model.blocks[0].mlp_scale, atol=1e-3)


def test_the_folded_weight_is_the_fake_quantized_weight_times_the_scale_while_qat_is_on():
    lin = CastedLinear(16, 8)
    torch.manual_seed(0)
    lin.weight.data.normal_()
    scale = torch.rand(8) + 0.5
    lin.qat_bits, lin.qat_on = 6, True
    expect = (fake_quantize_per_row(lin.weight, 6) * scale[:, None]).to(torch.bfloat16)
    assert torch.equal(lin.weight_as(torch.bfloat16, scale), expect)
    x = torch.randn(4, 16)
    assert torch.allclose(lin.scaled(x, scale), F.linear(x, fake_quantize_per_row(lin.weight, 6)) * scale, atol=1e-5)


def test_under_bf16_autocast_the_fold_rounds_no_worse_than_scaling_the_output():
    """CPU bf16 autocast (CUDA's dtypes): the loss's and the gradients' error against the float64 formula, folded
    against unfolded. The fold multiplies the scale into the weight in float32 before the one bf16 rounding."""
    ids = torch.randint(0, 64, (4, 32), generator=torch.Generator().manual_seed(2))
    exact_loss, exact = loss_and_grads(perturbed_model(torch.float64), ids)

    def errors(patch: bool):
        model = perturbed_model(torch.float32)
        with torch.autocast("cpu", torch.bfloat16), (mock.patch.object(CastedLinear, "scaled", unfolded) if patch
                                                     else contextlib.nullcontext()):
            loss, grads = loss_and_grads(model, ids)
        flat = torch.cat([grads[n].double().flatten() for n in exact])
        ref = torch.cat([g.flatten() for g in exact.values()])
        return abs(loss.double() - exact_loss).item(), ((flat - ref).norm() / ref.norm()).item()

    folded, plain = errors(False), errors(True)
    assert folded[1] < 0.05 and plain[1] < 0.05  # bf16 gradients: a few percent at most
    assert folded[1] <= 1.25 * plain[1], (folded, plain)
    assert folded[0] <= 2 * plain[0] + 1e-3, (folded, plain)
