"""`pytest -m gpu`: the fused loss (LOSS_KERNEL=liger, Liger-Kernel) on a real CUDA device against the plain
loss and the op's twin (skipped without CUDA or without liger_kernel: pip install liger-kernel==0.8.5)."""

import importlib.util

import pytest
import torch
import torch.nn.functional as F

import model.fused_loss as fused_loss
from model.fused_loss import (linear_softcap_ce, linear_softcap_cross_entropy, linear_softcap_nll, resolve_loss_kernel,
                              softcap_ce_twin)
from model.gpt import GPT

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
              pytest.mark.skipif(importlib.util.find_spec("liger_kernel") is None, reason="needs liger_kernel")]
SOFTCAP = 30.0


@pytest.fixture(autouse=True)
def exact_fp32_matmuls():
    """float32 matmuls in float32 (not TF32) for the float32 comparisons; the kernel choice restored after."""
    saved = torch.backends.cuda.matmul.allow_tf32, fused_loss._FUSED_LOSS[:]
    torch.backends.cuda.matmul.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, fused_loss._FUSED_LOSS[:] = saved


def head_inputs(n=16384, d=512, v=8192, seed=0):
    """The preset's head: x the final rms_norm output [n, d] (float32, as CUDA autocast returns it from torch 2.12),
    weight [v, d] float32 (the tied embedding, std giving logits of std ~2), random targets (loss ~ ln V + 1)."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = F.rms_norm(torch.randn(n, d, device="cuda", generator=g), (d,))
    weight = 0.1 * torch.randn(v, d, device="cuda", generator=g)
    return x, weight, torch.randint(0, v, (n,), device="cuda", generator=g)


def loss_and_grads(fn, x, weight, target, autocast):
    x, weight = x.clone().requires_grad_(), weight.clone().requires_grad_()
    with torch.autocast("cuda", torch.bfloat16, enabled=autocast):
        loss = fn(x, weight, target)
    (3 * loss).backward()
    return loss.detach().float(), x.grad, weight.grad


def plain(x, weight, target):
    logits = F.linear(x, weight).float()
    return F.cross_entropy(SOFTCAP * torch.tanh(logits / SOFTCAP), target)


def fused(x, weight, target):
    return linear_softcap_cross_entropy(x, weight, target, SOFTCAP)


@pytest.mark.parametrize("autocast, loss_rtol, grad_rtol", [(False, 1e-5, 1e-4), (True, 2e-3, 3e-2)])
def test_liger_loss_and_gradients_equal_the_plain_loss(autocast, loss_rtol, grad_rtol):
    x, weight, target = head_inputs()
    got, ref = loss_and_grads(fused, x, weight, target, autocast), loss_and_grads(plain, x, weight, target, autocast)
    assert 8.0 < ref[0].item() < 12.0
    torch.testing.assert_close(got[0], ref[0], rtol=loss_rtol, atol=0)
    for a, b in zip(got[1:], ref[1:]):
        assert a.dtype == torch.float32
        torch.testing.assert_close(a, b, rtol=grad_rtol, atol=grad_rtol * b.abs().max().item())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_liger_kernel_equals_the_twin_on_the_same_device(dtype):
    x, weight, target = (t.to(dtype) if t.is_floating_point() else t for t in head_inputs(n=4096, seed=1))
    liger = linear_softcap_ce(x, weight, target, SOFTCAP)  # the op's CUDA kernel
    nll, dx, dw = softcap_ce_twin(x, weight, target, SOFTCAP)
    assert [t.dtype for t in liger] == [torch.float32, dtype, dtype]
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    for a, b in zip(liger, (nll.mean(), dx, dw)):
        torch.testing.assert_close(a.float(), b.float(), rtol=tol, atol=tol * b.abs().max().item())
    per_token = linear_softcap_nll(x, weight, target, SOFTCAP)  # Liger's reduction="none", no gradients
    assert per_token.dtype == torch.float32 and per_token.shape == nll.shape
    torch.testing.assert_close(per_token, nll, rtol=tol, atol=tol * nll.abs().max().item())


def test_logits_are_never_materialized():
    """At the default preset's micro-batch (65,536 tokens, V=8192) the plain loss holds several copies of the
    logits (bf16, then float32 softcap and cross entropy: GBs); the fused loss, inputs and gradients included,
    stays under one bf16 copy (its logits live one 4,096-token chunk at a time)."""
    x, weight, target = head_inputs(n=65536, seed=2)
    logits_bytes = 65536 * 8192 * 2
    peaks = {}
    for name, fn in (("fused", fused), ("plain", plain)):
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        loss_and_grads(fn, x, weight, target, autocast=True)
        torch.cuda.synchronize()
        peaks[name] = torch.cuda.max_memory_allocated() - base
    assert peaks["plain"] > 2 * logits_bytes, peaks
    assert peaks["fused"] < logits_bytes, peaks


def test_compiled_model_trains_through_liger_like_the_plain_loss():
    """resolve_loss_kernel takes liger on CUDA; the compiled (fullgraph) bf16 model's loss and gradients match
    the plain loss's; no graph break."""
    from torch._dynamo.utils import counters

    assert resolve_loss_kernel("liger", torch.device("cuda"), log=lambda msg: None) == "liger"
    torch.manual_seed(0)
    model = GPT(vocab_size=8192, num_layers=2, model_dim=512, num_heads=8, num_kv_heads=4, mlp_mult=3.0, rope_dims=32,
                xsa_last_n=1).cuda()
    model.init_weights()
    x, y = (torch.randint(0, 8192, (4, 1024), device="cuda", generator=torch.Generator("cuda").manual_seed(s))
            for s in (1, 2))
    results = {}
    for name in ("liger", "torch"):
        fused_loss._FUSED_LOSS[:] = [True] if name == "liger" else []
        torch._dynamo.reset()
        counters.clear()
        model.zero_grad()
        with torch.autocast("cuda", torch.bfloat16):
            loss = torch.compile(model, fullgraph=True, dynamic=False)(x, y)
        loss.backward()
        assert sum(counters["graph_break"].values()) == 0
        results[name] = loss.item(), {n: p.grad.float().clone() for n, p in model.named_parameters()}
    assert results["liger"][0] == pytest.approx(results["torch"][0], rel=2e-3)
    for n, g in results["torch"][1].items():
        torch.testing.assert_close(results["liger"][1][n], g, rtol=5e-2, atol=5e-2 * g.abs().max().item(), msg=n)
