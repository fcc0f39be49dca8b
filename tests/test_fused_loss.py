"""The fused linear + softcap + cross-entropy loss (model/fused_loss.py, LOSS_KERNEL) on its CPU twin.

The CUDA kernel is Liger-Kernel's (tests/test_gpu.py compares it with the plain loss and with this twin on a
GPU); here the op's CPU kernel must equal the plain F.linear -> softcap -> F.cross_entropy loss and its
gradients, under torch.compile(fullgraph=True), inside the model and through the trainer's loop.
"""

import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import model.fused_loss as fused_loss
from model.fused_loss import (choose_loss_kernel, chunk_tokens, linear_softcap_ce, linear_softcap_cross_entropy,
                              linear_softcap_nll, resolve_loss_kernel)
from model.gpt import GPT, build_model_config, count_train_flops_per_token
from primitives.settings import Hyperparameters
from trainer.runfolder import RUN_ONLY_SETTINGS

SOFTCAP = 30.0


def plain_loss(x, weight, target, softcap=SOFTCAP):
    """GPT.forward_logits + F.cross_entropy: the torch path the fused op replaces."""
    logits = F.linear(x, weight.to(x.dtype)).float()
    return F.cross_entropy(softcap * torch.tanh(logits / softcap), target)


def inputs(n=300, d=32, v=200, seed=0, scale=2.0):
    """x [n, d], weight [v, d] leaves and targets; n=300 is not a multiple of the chunk (64 here): 5 chunks."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, d, generator=g).requires_grad_()
    weight = (scale * torch.randn(v, d, generator=g)).requires_grad_()  # logits up to ~+-50: the softcap bends them
    return x, weight, torch.randint(0, v, (n,), generator=g)


def loss_and_grads(fn, x, weight, target, scale=3.0):
    x, weight = x.detach().clone().requires_grad_(), weight.detach().clone().requires_grad_()
    loss = fn(x, weight, target)
    (scale * loss).backward()  # grad_output != 1: the op's autograd must scale dx and dW
    return loss.detach(), x.grad, weight.grad


@pytest.fixture
def fused_on():
    """GPT.forward through the fused op (its CPU twin), as resolve_loss_kernel("liger") sets it on CUDA."""
    saved = fused_loss._FUSED_LOSS[:]
    fused_loss._FUSED_LOSS[:] = [True]
    yield
    fused_loss._FUSED_LOSS[:] = saved


def test_chunks_are_liger_s():
    # Liger: inc_factor = cdiv(V, D); chunk = next_power_of_2(cdiv(N, inc_factor)), at most N
    assert chunk_tokens(65536, 8192, 512) == 4096
    assert chunk_tokens(300, 200, 32) == 64
    assert chunk_tokens(5, 8192, 512) == 1
    assert chunk_tokens(7, 10, 512) == 7


def test_twin_equals_the_plain_loss_and_its_gradients_in_float32():
    x, weight, target = inputs()
    got = loss_and_grads(lambda a, b, t: linear_softcap_cross_entropy(a, b, t, SOFTCAP), x, weight, target)
    ref = loss_and_grads(plain_loss, x, weight, target)
    assert ref[0].item() > 3.0  # a real loss, not ~0
    torch.testing.assert_close(got[0], ref[0], rtol=1e-6, atol=0)
    for a, b in zip(got[1:], ref[1:]):
        assert a.dtype == b.dtype == torch.float32
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)


def test_twin_in_bf16_under_autocast_matches_the_plain_loss_at_bf16_tolerance(monkeypatch):
    """Under autocast x and the float32 weight reach the op as bf16 (Liger's one dtype); the gradients come back
    through the casts as float32, like F.linear's under autocast."""
    x, weight, target = inputs(seed=1)
    seen, check = [], fused_loss._check_contract
    monkeypatch.setattr(fused_loss, "_check_contract", lambda a, b, *rest: seen.append((a.dtype, b.dtype)) or check(a, b, *rest))
    with torch.autocast("cpu", torch.bfloat16):
        fused = loss_and_grads(lambda a, b, t: linear_softcap_cross_entropy(a, b, t, SOFTCAP), x, weight, target)
        ref = loss_and_grads(plain_loss, x, weight, target)
    fp32 = loss_and_grads(plain_loss, x, weight, target)
    assert seen == [(torch.bfloat16, torch.bfloat16)]
    torch.testing.assert_close(fused[0], ref[0], rtol=2e-3, atol=0)
    torch.testing.assert_close(fused[0], fp32[0], rtol=2e-2, atol=0)
    for a, b in zip(fused[1:], ref[1:]):
        assert a.dtype == torch.float32
        torch.testing.assert_close(a, b, rtol=2e-2, atol=2e-2 * b.abs().max().item())


def test_op_contract_refuses_what_liger_cannot_take():
    x, weight, target = (t.detach() for t in inputs(n=8))
    expected = r"linear_softcap_ce: expected x \[N, D\] and weight \[V, D\] of one float dtype, int64 target \[N\], " \
        r"softcap > 0; got "
    with pytest.raises(RuntimeError, match=expected + r"torch.bfloat16\[8, 32\], torch.float32\[200, 32\]"):
        linear_softcap_ce(x.bfloat16(), weight, target, SOFTCAP)
    with pytest.raises(RuntimeError, match=expected + r".*, torch.int32\[8\], 30.0$"):
        linear_softcap_ce(x, weight, target.int(), SOFTCAP)
    with pytest.raises(RuntimeError, match=expected + r".*, torch.int64\[7\]"):
        linear_softcap_ce(x, weight, target[:7], SOFTCAP)
    with pytest.raises(RuntimeError, match=expected + r"torch.float32\[8, 32\], torch.float32\[200, 16\]"):
        linear_softcap_ce(x, weight[:, :16], target, SOFTCAP)
    with pytest.raises(RuntimeError, match=expected + r".*, 0.0$"):
        linear_softcap_ce(x, weight, target, 0.0)
    with pytest.raises(RuntimeError, match=expected + r"torch.int64\[8, 32\]"):  # the fake (meta) kernel checks it too
        linear_softcap_ce(x.to("meta", torch.int64), weight.to("meta"), target.to("meta"), SOFTCAP)


def test_op_registration_passes_opcheck():
    """Schema, fake kernel, autograd registration and their agreement (torch.library.opcheck)."""
    x, weight, target = inputs(n=40, d=16, v=50)
    torch.library.opcheck(linear_softcap_ce, (x, weight, target, SOFTCAP))
    torch.library.opcheck(linear_softcap_nll, (x.detach(), weight.detach(), target, SOFTCAP))


def test_compiled_fullgraph_equals_eager_with_no_graph_break():
    from torch._dynamo.utils import counters

    x, weight, target = inputs(n=96, seed=2)
    eager = loss_and_grads(lambda a, b, t: linear_softcap_cross_entropy(a, b, t, SOFTCAP), x, weight, target)
    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(lambda a, b, t: linear_softcap_cross_entropy(a, b, t, SOFTCAP), fullgraph=True)
    got = loss_and_grads(compiled, x, weight, target)
    assert sum(counters["graph_break"].values()) == 0
    for a, b in zip(got, eager):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-8)


TINY = dict(vocab_size=96, num_layers=2, model_dim=32, num_heads=4, num_kv_heads=2, mlp_mult=2.0, rope_dims=4,
            xsa_last_n=1)


@pytest.mark.parametrize("tie", [True, False])
def test_model_forward_through_the_fused_op_equals_the_plain_loss(fused_on, tie, monkeypatch):
    import model.fused_loss as fused_loss  # GPT.forward calls its fused_loss, which calls the op here

    calls = []
    monkeypatch.setattr(fused_loss, "linear_softcap_cross_entropy",
                        lambda *a: calls.append(a[1].shape) or linear_softcap_cross_entropy(*a))
    torch.manual_seed(0)
    model = GPT(**TINY, tie_embeddings=tie)
    model.init_weights(0.5)  # a large std: confident logits, the softcap matters
    if not tie:
        torch.nn.init.normal_(model.lm_head.weight, std=0.5)
    x, y = (torch.randint(0, 96, (3, 20), generator=torch.Generator().manual_seed(s)) for s in (1, 2))
    fused = model(x, y)
    fused.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    logits = model.forward_logits(x)
    plain = F.cross_entropy(logits.reshape(-1, logits.size(-1)), y.reshape(-1))
    plain.backward()
    assert calls == [(96, 32)]  # the head [V, D]: tied embedding or lm_head
    torch.testing.assert_close(fused, plain, rtol=1e-6, atol=0)
    for n, p in model.named_parameters():
        torch.testing.assert_close(grads[n], p.grad, rtol=1e-4, atol=1e-7, msg=n)


@pytest.mark.parametrize("autocast", [False, True])
def test_per_token_nll_through_the_fused_op_equals_forward_logits_cross_entropy(fused_on, autocast):
    """GPT.forward_nll (scoring: per-token NLL [B, T]) through linear_softcap_nll equals the cross entropy of
    forward_logits (float32 tight, bf16 autocast at bf16 tolerance), compiles fullgraph, and its mean is forward's."""
    torch.manual_seed(0)
    model = GPT(**TINY)
    model.init_weights(0.5)
    x, y = (torch.randint(0, 96, (3, 20), generator=torch.Generator().manual_seed(s)) for s in (1, 2))
    with torch.no_grad(), torch.autocast("cpu", torch.bfloat16, enabled=autocast):
        fused = model.forward_nll(x, y)
        compiled = torch.compile(model.forward_nll, fullgraph=True, dynamic=False)(x, y)
        mean = model(x, y)
        fused_loss._FUSED_LOSS.clear()
        plain = model.forward_nll(x, y)
        logits = model.forward_logits(x)
    reference = F.cross_entropy(logits.flatten(0, 1), y.flatten(), reduction="none").view(3, 20)
    assert fused.shape == (3, 20) and fused.dtype == torch.float32 and reference.max() - reference.min() > 1.0
    tol = 2e-2 if autocast else 1e-5
    torch.testing.assert_close(plain, reference, rtol=0, atol=0)
    torch.testing.assert_close(fused, reference, rtol=tol, atol=tol)
    torch.testing.assert_close(compiled, fused, rtol=tol, atol=tol)  # Inductor rounds the bf16 body its own way
    torch.testing.assert_close(mean, fused.mean(), rtol=1e-6, atol=0)


def test_flop_count_is_the_plain_loss_s_when_fused(fused_on):
    """On meta the model keeps the plain loss: the FLOP count (and so MFU) does not depend on LOSS_KERNEL."""
    fused_loss._FUSED_LOSS.clear()
    plain = count_train_flops_per_token(TINY, 64)
    fused_loss._FUSED_LOSS[:] = [True]
    assert count_train_flops_per_token(TINY, 64) == plain


def test_choose_and_resolve_loss_kernel():
    cpu, cuda = torch.device("cpu"), torch.device("cuda")  # a device object: no CUDA needed
    assert choose_loss_kernel("auto", cpu) == "torch" and choose_loss_kernel("torch", cuda) == "torch"
    with pytest.raises(ValueError, match="LOSS_KERNEL='liger': Liger-Kernel needs CUDA, this run is on cpu"):
        choose_loss_kernel("liger", cpu)
    with pytest.raises(ValueError, match="LOSS_KERNEL='fused': expected one of auto, liger, torch"):
        choose_loss_kernel("fused", cpu)
    try:
        import liger_kernel.ops.fused_linear_cross_entropy  # noqa: F401
        pytest.skip("liger_kernel imports here: the missing-package branch cannot be exercised")
    except Exception:
        pass
    assert choose_loss_kernel("auto", cuda) == "torch"  # CUDA without liger_kernel: the plain loss
    with pytest.raises(ValueError, match="LOSS_KERNEL='liger': cannot import liger_kernel.ops.fused_linear_cross_entropy"):
        choose_loss_kernel("liger", cuda)
    saved, lines = fused_loss._FUSED_LOSS[:], []
    try:
        fused_loss._FUSED_LOSS[:] = [True]
        assert resolve_loss_kernel("auto", cpu, lines.append) == "torch"
        assert lines == ["loss:torch"] and not fused_loss.fused_loss_active(cpu)
    finally:
        fused_loss._FUSED_LOSS[:] = saved


def test_liger_is_taken_only_when_it_passes_its_self_check(monkeypatch):
    """An importable liger_kernel whose kernel fails (raises, or computes another loss) is refused: auto falls back
    to the plain loss with a WARNING, LOSS_KERNEL=liger stops before the run."""
    import sys
    import types

    cpu = torch.device("cpu")
    twin = lambda x, w, t, c: (lambda r: (r[0].mean(), r[1], r[2]))(fused_loss.softcap_ce_twin(x, w, t, c))  # noqa: E731
    monkeypatch.setattr(fused_loss, "_linear_softcap_ce_liger", twin)
    assert fused_loss.liger_self_check(cpu) == ""
    uncapped = lambda x, w, t, c: twin(x, w, t, 1e9)  # noqa: E731 (no softcap)
    monkeypatch.setattr(fused_loss, "_linear_softcap_ce_liger", uncapped)
    assert fused_loss.liger_self_check(cpu).startswith("its loss differs from the plain loss's by")
    monkeypatch.setattr(fused_loss, "_linear_softcap_ce_liger", lambda *a: (a[0].sum(), *twin(*a)[1:]))  # sum, not mean
    assert fused_loss.liger_self_check(cpu).startswith("its loss differs")
    for name in ("liger_kernel", "liger_kernel.ops", "liger_kernel.ops.fused_linear_cross_entropy"):  # "importable"
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    cuda, lines = torch.device("cuda"), []  # here the check itself fails: no CUDA device to run it on
    if torch.cuda.is_available():
        pytest.skip("a CUDA device would run the check")
    assert choose_loss_kernel("auto", cuda, lines.append) == "torch" and lines == []  # auto: the measured faster loss
    with pytest.raises(ValueError, match=r"LOSS_KERNEL='liger': Liger-Kernel fails its check on cuda: \w+Error: .*; "
                                         "expected LOSS_KERNEL=auto or torch"):
        choose_loss_kernel("liger", cuda)


def test_loss_kernel_is_a_setting_outside_the_artifact_bound_like_attn_backend():
    with pytest.raises(ValueError, match="LOSS_KERNEL='fused': expected one of auto, liger, torch"):
        Hyperparameters.from_env({"PRESET": "smoke", "LOSS_KERNEL": "fused"}, log=lambda *_: None)
    hp = Hyperparameters.from_env({"PRESET": "smoke", "LOSS_KERNEL": "torch"}, log=lambda *_: None)
    assert hp.loss_kernel == "torch" and Hyperparameters().loss_kernel == "auto"
    config = build_model_config(hp)
    assert config == build_model_config(Hyperparameters.from_env({"PRESET": "smoke"}, log=lambda *_: None))
    assert not {"loss_kernel", "attn_backend"} & set(config)  # kernel choices: never in the artifact's config
    # RESUME=1 binds both kernel choices alike (each changes the trained weights' rounding)
    assert ("loss_kernel" in RUN_ONLY_SETTINGS) == ("attn_backend" in RUN_ONLY_SETTINGS) is False


@pytest.mark.slow
def test_tiny_training_run_through_the_twin_equals_the_torch_loss(fused_on, tiny_dataset, tmp_path):
    """The trainer's loop (Muon, AdamW, QAT flip, tied embedding) through the fused op's CPU twin: the same
    per-step losses as LOSS_KERNEL=torch within float32 rounding."""
    from test_cuda_twins import run_train_in_process

    _, fused_losses, _ = run_train_in_process(tiny_dataset, tmp_path / "fused", compile=False, autocast_dtype=None)
    fused_loss._FUSED_LOSS.clear()
    _, torch_losses, _ = run_train_in_process(tiny_dataset, tmp_path / "torch", compile=False, autocast_dtype=None)
    assert all(math.isfinite(v) for v in fused_losses) and len(fused_losses) == 6
    # step 1 is the same forward; step 2 follows one update from the twin's gradients: equal to float32 rounding.
    # Later steps drift apart as any two float32 runs do (Muon's bf16 Newton-Schulz amplifies the last bits;
    # measured: 7e-8, 1e-6, 4e-7, 6e-5, 7e-5, 5e-4 relative)
    assert fused_losses[:2] == pytest.approx(torch_losses[:2], rel=1e-5)
    assert fused_losses == pytest.approx(torch_losses, rel=2e-3)
    assert fused_losses[-1] < fused_losses[0]


# ----------------------------------------------------------------------------------------------- Liger, interpreted

def interpret_liger_on_cpu() -> None:
    """Make Liger-Kernel's Triton kernel run on CPU tensors (TRITON_INTERPRET=1 set before triton's import), with
    three fixes to Triton 3.6's interpreter, none to Liger's math: a Python float argument becomes an fp32 scalar
    (as the compiler passes it), int() of its 1-element index arrays works on NumPy >= 2.4, and libdevice's tanh
    (an extern stub the interpreter cannot call) is tanh written in tl ops."""
    import numpy as np
    import triton
    import triton.language as tl
    from triton.runtime import interpreter as ti

    import liger_kernel.ops.cross_entropy as liger_ce

    globals()["tl"] = tl  # a jit function must see triton.language in its globals
    cvt, set_attr = ti._implicit_cvt, ti._LangPatchScope.set_attr
    ti._implicit_cvt = lambda a: tl.tensor(ti.TensorHandle(np.array([a], np.float32), tl.float32), tl.float32) \
        if isinstance(a, float) else cvt(a)
    ti._LangPatchScope.set_attr = lambda self, obj, name, value: set_attr(
        self, obj, name, (lambda t: int(t.handle.data.reshape(-1)[0])) if name == "__index__" else value)

    @triton.jit
    def tanh(x):
        e = tl.exp(-2.0 * tl.abs(x))
        return tl.where(x >= 0, (1.0 - e) / (1.0 + e), (e - 1.0) / (1.0 + e))

    liger_ce.tanh = tanh


def check_liger_interpreted() -> None:
    """The op's CUDA implementation (Liger's fused_linear_cross_entropy_forward, as called there) run on CPU by the
    interpreter: equal to the twin in float32 and bf16, and inside the model under torch.compile(fullgraph=True)."""
    interpret_liger_on_cpu()
    from model.fused_loss import _linear_softcap_ce_liger

    assert fused_loss.liger_self_check(torch.device("cpu")) == ""  # the real kernel passes the check the run makes

    from model.fused_loss import _linear_softcap_nll_liger

    for dtype, tol in ((torch.float32, 1e-6), (torch.bfloat16, 1e-2)):
        x, weight, target = (t.detach() for t in inputs(n=100, seed=3))
        x, weight = x.to(dtype), weight.to(dtype)
        twin = linear_softcap_ce(x, weight, target, SOFTCAP)
        liger = _linear_softcap_ce_liger(x, weight, target, SOFTCAP)
        assert [t.dtype for t in liger] == [torch.float32, dtype, dtype] and liger[0].shape == ()
        for a, b in zip(liger, twin):
            torch.testing.assert_close(a.float(), b.float(), rtol=tol, atol=tol * b.abs().max().item())
        nll = _linear_softcap_nll_liger(x, weight, target, SOFTCAP)  # reduction="none", no gradients
        assert nll.dtype == torch.float32 and nll.shape == (100,)
        torch.testing.assert_close(nll, linear_softcap_nll(x, weight, target, SOFTCAP), rtol=tol,
                                   atol=tol * nll.abs().max().item())
    torch.manual_seed(0)
    model = GPT(**TINY)
    model.init_weights(0.5)
    x, y = (torch.randint(0, 96, (2, 16), generator=torch.Generator().manual_seed(s)) for s in (1, 2))
    plain = model(x, y)
    plain.backward()
    ref = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    linear_softcap_ce.register_kernel("cpu")(_linear_softcap_ce_liger)
    fused_loss._FUSED_LOSS[:] = [True]
    loss = torch.compile(model, fullgraph=True, dynamic=False)(x, y)
    (2 * loss).backward()
    torch.testing.assert_close(loss, plain, rtol=1e-6, atol=0)
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.grad, 2 * ref[n], rtol=1e-4, atol=1e-7, msg=n)
    print("liger interpreted: ok")


@pytest.mark.slow
def test_liger_kernel_interpreted_on_cpu_equals_the_twin():
    """Where triton and liger_kernel import (e.g. a torch+triton venv with PYTHONPATH at liger-kernel==0.8.5's
    source), Liger's own kernel, interpreted on CPU, gives the twin's loss and gradients; skipped elsewhere."""
    import importlib.util
    import os
    import subprocess
    import sys

    if not (importlib.util.find_spec("triton") and importlib.util.find_spec("liger_kernel")):
        pytest.skip("needs triton and liger_kernel (the GPU stack's packages)")
    code = "import sys; sys.path[:0] = ['tests', '.']; import test_fused_loss; test_fused_loss.check_liger_interpreted()"
    proc = subprocess.run([sys.executable, "-c", code], env={**os.environ, "TRITON_INTERPRET": "1"},
                          cwd=Path(__file__).resolve().parents[1], capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0 and "liger interpreted: ok" in proc.stdout, proc.stderr[-3000:]


@pytest.mark.slow
def test_compiled_training_through_the_twin_has_no_graph_break_or_recompile(fused_on, tiny_dataset, tmp_path,
                                                                          monkeypatch):
    """The trainer's compiled step (fullgraph, bf16 autocast as on CUDA, the QAT flip at step 3) through the fused
    op: one training graph, no graph break, and losses that track the eager fp32 torch loss's."""
    from torch._dynamo.utils import counters

    from test_cuda_twins import run_train_in_process

    calls, twin = [], fused_loss.softcap_ce_twin
    monkeypatch.setattr(fused_loss, "softcap_ce_twin", lambda *a: calls.append(a[0].dtype) or twin(*a))
    torch._dynamo.reset()
    counters.clear()
    _, losses, lines = run_train_in_process(tiny_dataset, tmp_path / "fused", compile=True, autocast_dtype=torch.bfloat16)
    # one fused loss per step (then GPTQ calibration's forwards), in the autocast dtype
    assert len(calls) >= 6 and set(calls) == {torch.bfloat16}
    assert sum(counters["graph_break"].values()) == 0
    # the step before QAT, the step with QAT on (one graph per QAT state), and Muon's Newton-Schulz
    assert counters["stats"]["unique_graphs"] == 3, dict(counters["stats"])
    assert any(line.startswith("late_qat:on step:3") for line in lines)
    fused_loss._FUSED_LOSS.clear()
    _, reference, _ = run_train_in_process(tiny_dataset, tmp_path / "torch", compile=False, autocast_dtype=None)
    assert losses == pytest.approx(reference, rel=0.03)
