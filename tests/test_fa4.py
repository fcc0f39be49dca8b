"""ATTN_BACKEND=fa4: the FA4 custom ops (model/fa4.py) and their CPU twin, the backend choice, the routing.

On the CPU pgkit::fa4_fwd / pgkit::fa4_bwd run the twin: FA4's asserts, exact float32 math, the lse layout
FA4's backward consumes. The CUDA path (the real kernels) is tests/test_gpu.py's, under `pytest -m gpu`.
"""

import math
import types

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

import model.attention as trainer_attention
import model.fa4 as fa4
from model.attention import attention
from model.gpt import build_model_config, count_train_flops_per_token
from primitives.settings import Hyperparameters
from test_cuda_twins import run_train_in_process, tiny_model
from tools.bench.flash_twin import cuda_autocast_rms_norm, plugged_fa4_twin


def qkv(b=2, t=48, h=8, hkv=4, d=32, dtype=torch.bfloat16, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(b, t, n, d, generator=g).to(dtype) for n in (h, hkv, hkv)]


def sdpa_fp32(q, k, v):
    return F.scaled_dot_product_attention(*(x.float().transpose(1, 2) for x in (q, k, v)), is_causal=True,
                                          enable_gqa=True).transpose(1, 2)


class OpLog(TorchDispatchMode):
    """Records the names of the ops dispatched below autograd."""

    def __init__(self):
        super().__init__()
        self.names = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.append(str(func))
        return func(*args, **(kwargs or {}))


# ----------------------------------------------------------------------------------------------- the twin


def test_twin_forward_backward_and_lse_match_sdpa_with_gqa():
    """bf16, 8 query heads on 4 KV heads: out, lse and every gradient at bf16 tolerance of fp32 SDPA."""
    q, k, v = (x.requires_grad_() for x in qkv())
    out, lse = fa4.fa4_fwd(q, k, v)
    assert out.dtype == torch.bfloat16 and out.shape == q.shape and out.is_contiguous()
    assert lse.dtype == torch.float32 and lse.shape == (2, 8, 48)  # FA4's layout: [B, H, T]
    ref_q, ref_k, ref_v = (x.detach().float().requires_grad_() for x in (q, k, v))
    ref = sdpa_fp32(ref_q, ref_k, ref_v)
    torch.testing.assert_close(out.float(), ref, atol=2e-2, rtol=2e-2)
    kf = ref_k.detach().repeat_interleave(2, 2)
    scores = torch.einsum("bthd,bshd->bhts", ref_q.detach(), kf) / math.sqrt(32)
    scores = scores.masked_fill(~torch.ones(48, 48, dtype=torch.bool).tril(), -math.inf)
    torch.testing.assert_close(lse, scores.logsumexp(-1), atol=2e-2, rtol=1e-3)
    grad = torch.randn(out.shape, generator=torch.Generator().manual_seed(9))
    out.backward(grad.bfloat16())
    ref.backward(grad)
    for ours, theirs in ((q, ref_q), (k, ref_k), (v, ref_v)):
        assert ours.grad.dtype == torch.bfloat16 and ours.grad.shape == theirs.shape
        torch.testing.assert_close(ours.grad.float(), theirs.grad, atol=5e-2, rtol=3e-2)


def test_twin_backward_recomputes_p_from_the_lse_it_is_given():
    """A flash backward rebuilds P = exp(S - lse) from the saved lse: lse + 1 scales dV by 1/e."""
    q, k, v = qkv()
    out, lse = fa4.fa4_fwd(q, k, v)
    dout = torch.randn(out.shape, generator=torch.Generator().manual_seed(3)).bfloat16()
    _, _, dv = fa4.fa4_bwd(dout, q, k, v, out, lse)
    _, _, dv_shifted = fa4.fa4_bwd(dout, q, k, v, out, lse + 1)
    torch.testing.assert_close(dv_shifted.float(), dv.float() / math.e, atol=2e-2, rtol=2e-2)
    assert dv.abs().max() > 0.5


@pytest.mark.parametrize("how, message", [
    ("fp32", "inputs must be float16 or bfloat16"),
    ("mixed", "must have the same dtype"),
    ("heads", "num_head must be divisible by num_head_kv"),
    ("headdim12", r"\(head_dim, head_dim_v\)=\(12, 12\) is not supported on SM90"),
    ("headdim264", r"\(head_dim, head_dim_v\)=\(264, 264\) is not supported on SM90"),
    ("3d", r"must be \[B, T, H, D\]"),
    ("kv_batch", "k, v shapes do not match q"),
])
def test_twin_refuses_what_fa4_asserts(how, message):
    q, k, v = qkv(d=264 if how == "headdim264" else 12 if how == "headdim12" else 32, h=6 if how == "heads" else 8)
    q, k, v = {"fp32": lambda: (q.float(), k.float(), v.float()), "mixed": lambda: (q, k, v.half()),
               "3d": lambda: (q[0], k[0], v[0]), "kv_batch": lambda: (q, k[:1], v[:1])}.get(how, lambda: (q, k, v))()
    with pytest.raises(AssertionError, match=message):
        fa4.fa4_fwd(q, k, v)
    with pytest.raises(AssertionError, match=message):  # the fake (what torch.compile traces) asserts the same
        with torch._subclasses.fake_tensor.FakeTensorMode() as mode:
            fa4.fa4_fwd(*(mode.from_tensor(x) for x in (q, k, v)))


@pytest.mark.parametrize("how, message", [
    ("lse_layout", r"lse must have shape \(batch_size, num_head, seqlen_q\)"),
    ("lse_dtype", "lse must be float32"),
    ("dout_dtype", "must have the same dtype"),
])
def test_twin_backward_refuses_what_fa4_asserts(how, message):
    q, k, v = qkv()
    out, lse = fa4.fa4_fwd(q, k, v)
    dout = torch.ones_like(out)
    lse = {"lse_layout": lse.transpose(1, 2), "lse_dtype": lse.bfloat16()}.get(how, lse)
    with pytest.raises(AssertionError, match=message):
        fa4.fa4_bwd(dout.half() if how == "dout_dtype" else dout, q, k, v, out, lse)


def test_causal_false_is_refused():
    with pytest.raises(ValueError, match="causal only"):
        fa4.flash_attn_func(*qkv())


# ----------------------------------------------------------------------------------------------- routing


def test_attention_routes_through_the_fa4_op_and_casts_fp32_qk():
    """attention() with FA4 selected calls pgkit::fa4_fwd (and pgkit::fa4_bwd in the backward) with one
    half dtype, also when CUDA-like autocast hands it float32 q/k beside a bf16 v."""
    q, k, v = qkv(dtype=torch.float32)
    q.requires_grad_()
    v = v.bfloat16()
    with plugged_fa4_twin(), torch.autocast("cpu", torch.bfloat16), OpLog() as log:
        y = attention(q, k, v)
        y.float().sum().backward()
    assert "pgkit.fa4_fwd.default" in log.names and "pgkit.fa4_bwd.default" in log.names
    assert y.dtype == torch.bfloat16 and q.grad.shape == q.shape and torch.isfinite(q.grad).all()
    torch.testing.assert_close(y.float(), sdpa_fp32(q.detach(), k, v), atol=3e-2, rtol=3e-2)
    with OpLog() as log:
        attention(q.detach().bfloat16(), k.bfloat16(), v)
    assert not any("pgkit" in n for n in log.names)  # unplugged: SDPA again


def test_compiled_fullgraph_through_the_fa4_op_has_no_graph_break(monkeypatch):
    """Inductor, fullgraph=True, on the CPU: the custom op is one opaque node (fake shapes from register_fake) that
    runs the twin at run time (forward and backward, 2 layers: 4 calls), and equals eager."""
    from torch._dynamo.utils import counters

    calls = []
    scores = fa4._scores
    monkeypatch.setattr(fa4, "_scores", lambda q, k: calls.append(q.shape) or scores(q, k))
    torch._dynamo.reset()
    counters.clear()
    model = tiny_model()
    x = torch.randint(0, 64, (2, 32), generator=torch.Generator().manual_seed(1))
    with plugged_fa4_twin(), torch.autocast("cpu", torch.bfloat16):
        eager = model(x, x)
        eager.backward()
        eager_grads = [p.grad.clone() for p in model.parameters()]
        model.zero_grad()
        assert len(calls) == 4
        compiled = torch.compile(model, fullgraph=True)(x, x)
        compiled.backward()
    assert sum(counters["graph_break"].values()) == 0 and counters["stats"]["unique_graphs"] == 1
    assert len(calls) == 8
    assert compiled.item() == pytest.approx(eager.item(), rel=1e-2)
    for ours, theirs in zip((p.grad for p in model.parameters()), eager_grads):
        torch.testing.assert_close(ours, theirs, atol=2e-2, rtol=5e-2)


def test_flop_count_on_meta_with_fa4_plugged():
    config = build_model_config(Hyperparameters(num_layers=2, model_dim=128, num_heads=2, num_kv_heads=1,
                                                rope_dims=16, xsa_last_n=1))
    plain = count_train_flops_per_token(config, 256)
    with plugged_fa4_twin():
        assert count_train_flops_per_token(config, 256) == plain > 2 * 3 * 2 * 2 * 256 * 128


@pytest.mark.slow
def test_training_steps_through_the_fa4_twin_track_fp32(tiny_dataset, tmp_path):
    """The trainer's loop, compiled, bf16 autocast with CUDA's fp32 rms_norm, attention through the FA4 op: finite
    losses near the fp32 SDPA run's, no graph break."""
    from torch._dynamo.utils import counters

    _, fp32_losses, _ = run_train_in_process(tiny_dataset, tmp_path, compile=False, autocast_dtype=None, num_kv_heads=2)
    torch._dynamo.reset()
    counters.clear()
    with plugged_fa4_twin(), cuda_autocast_rms_norm():
        _, losses, _ = run_train_in_process(tiny_dataset, tmp_path, compile=True, autocast_dtype=torch.bfloat16,
                                            num_kv_heads=2)
    assert sum(counters["graph_break"].values()) == 0
    assert losses == pytest.approx(fp32_losses, rel=0.03) and len(losses) == 6


# ----------------------------------------------------------------------------------------------- backend choice


@pytest.fixture
def on_gpu(monkeypatch):
    """A CUDA device of a chosen capability, and import_module answering from `modules` (ImportError otherwise)."""
    modules = {}

    def import_module(name):
        if name not in modules:
            raise ImportError(f"No module named {name!r}")
        return modules[name]

    def use(capability, **found):
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
        modules.clear()
        modules.update(found)

    import importlib

    monkeypatch.setattr(importlib, "import_module", import_module)
    fa4.load_fa4.cache_clear()
    saved = trainer_attention._FLASH_ATTN[:]
    yield use
    fa4.load_fa4.cache_clear()
    trainer_attention._FLASH_ATTN[:] = saved
    trainer_attention._SDPA_PRIORITY.close()


FA3 = types.SimpleNamespace(flash_attn_func=lambda *a, **k: None)
FA4_INTERFACE = types.SimpleNamespace(_flash_attn_fwd=None, _flash_attn_bwd=None)
FA4_NAMESPACE_FLASH_ATTN = types.SimpleNamespace()  # FA4's wheel: flash_attn is a namespace package without FA2


def test_auto_prefers_fa3_then_fa4(on_gpu):
    on_gpu((9, 0), flash_attn_interface=FA3, **{"flash_attn.cute.interface": FA4_INTERFACE})
    assert trainer_attention.resolve_attention_backend("auto", torch.device("cuda"), print, 64) == "fa3"
    on_gpu((9, 0), **{"flash_attn.cute.interface": FA4_INTERFACE, "flash_attn": FA4_NAMESPACE_FLASH_ATTN})
    lines = []
    assert trainer_attention.resolve_attention_backend("auto", torch.device("cuda"), lines.append, 64) == "fa4"
    assert trainer_attention._FLASH_ATTN == [fa4.flash_attn_func, None] and lines == []
    assert fa4.load_fa4() is FA4_INTERFACE


def test_auto_skips_fa4_off_sm90_sm100_and_for_a_head_dim_it_lacks(on_gpu):
    for capability, head_dim, why in (((8, 0), 64, "FA4 runs on sm_90/sm_100, not head dim 64 on sm_80"),
                                      ((12, 0), 0, "not head dim 0 on sm_120"),
                                      ((10, 0), 192, "not head dim 192 on sm_100")):
        on_gpu(capability, **{"flash_attn.cute.interface": FA4_INTERFACE})
        lines = []
        assert trainer_attention.resolve_attention_backend("auto", torch.device("cuda"), lines.append, head_dim) == "sdpa"
        assert lines[0].startswith("WARNING: attention falls back to PyTorch SDPA") and why in lines[0]
        with pytest.raises(ValueError, match=f"ATTN_BACKEND='fa4': cannot use flash_attn.cute.interface: .*{why}"):
            trainer_attention.resolve_attention_backend("fa4", torch.device("cuda"), lines.append, head_dim)


def test_fa4_wheel_without_fa2_does_not_crash_auto(on_gpu):
    """FA4 installed, its import broken (e.g. no cutlass DSL), FA2 absent: `flash_attn` still imports (a namespace
    package from FA4's wheel) without flash_attn_func; auto must fall back to SDPA with the reasons, not crash."""
    on_gpu((9, 0), flash_attn=FA4_NAMESPACE_FLASH_ATTN)
    lines = []
    assert trainer_attention.resolve_attention_backend("auto", torch.device("cuda"), lines.append) == "sdpa"
    assert "flash_attn.cute.interface: No module named" in lines[0] and "flash_attn: " in lines[0]
    assert "flash_attn_func" in lines[0]


def test_forcing_fa4_without_cuda_is_refused():
    with pytest.raises(ValueError, match="ATTN_BACKEND='fa4': flash-attn needs CUDA, this run is on cpu"):
        trainer_attention.resolve_attention_backend("fa4", torch.device("cpu"))
    assert Hyperparameters(attn_backend="fa4").attn_backend == "fa4"


def test_head_dim_rule_matches_fa4():
    assert [d for d in range(0, 300, 4) if fa4.head_dim_ok(d, 90)] == list(range(8, 257, 8))
    assert [d for d in range(0, 300, 4) if fa4.head_dim_ok(d, 100)] == list(range(8, 129, 8)) + [256]
