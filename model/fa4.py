"""FlashAttention-4 (PyPI flash-attn-4, CuTe-DSL) as torch custom ops, with a CPU twin of its contract.

pgkit::fa4_fwd (q, k, v) -> (out, lse) and pgkit::fa4_bwd (dout, q, k, v, out, lse) -> (dq, dk, dv), causal, softmax
scale 1/sqrt(D), called as flash_attn.cute.interface.FlashAttnFunc calls _flash_attn_fwd / _flash_attn_bwd.
q [B, T, H, D], k/v [B, Tk, Hkv, D] fp16/bf16, one dtype, H % Hkv == 0 (query head h reads KV head h // (H // Hkv));
out [B, T, H, D] in q's dtype, lse float32 [B, H, T] (natural-log sum of exps of the scaled scores).
On CUDA the FA4 kernels run (imported once, on first use); elsewhere the twin computes the same math in float32
(its backward recomputes P from lse, as a flash backward does; the package's only: a record's train_gpt.py, which
takes FA4 on CUDA alone, does not carry it). In the package the twin and the fakes (what torch.compile traces)
assert FA4's checks first (AssertionError); a record's file leaves them to FA4, which asserts them as it runs.
"""

import functools
import importlib
import math

import torch

from primitives.env import BUNDLE_KIND

# the packed train_gpt.py holds FA4 only for runs that may pick it (kit/bundle_when.py)
PACKED_WHEN = "ATTN_BACKEND in ('auto', 'fa4')"

# load_fa4(): flash_attn.cute.interface, imported once (ImportError/OSError/RuntimeError when missing or broken)
load_fa4 = functools.cache(lambda: importlib.import_module("flash_attn.cute.interface"))


def head_dim_ok(d: int, arch: int, /) -> bool:
    """FA4's head-dim rule for D == Dv at 2-byte dtypes (_validate_head_dims): a multiple of 8, 8..256 on sm_9x,
    8..128 or 256 on sm_10x/11x. arch: 90 for sm_90."""
    return d % 8 == 0 and 8 <= d <= (256 if arch // 10 == 9 else 128) or d == 256


def _need(ok, message):
    if not ok:
        raise AssertionError(message)


def _arch(t):  # the twin holds itself to sm_90's rules
    return 90 if t.device.type != "cuda" else (lambda m, n: 10 * m + n)(*torch.cuda.get_device_capability(t.device))


def _check(q, k, v, *rest):
    """FA4's asserts (interface.py) on q, k, v (+ out, dout, lse for the backward)."""
    _need(q.dtype in (torch.float16, torch.bfloat16), "inputs must be float16 or bfloat16")
    _need(all(x.dtype == q.dtype for x in (k, v, *rest[:2])), "q, k, v must have the same dtype")
    _need(q.dim() == k.dim() == v.dim() == 4, "q, k, v must be [B, T, H, D]")
    b, t, h, d = q.shape
    _need(k.shape == (b, k.size(1), k.size(2), d) and v.shape[:3] == k.shape[:3], "k, v shapes do not match q")
    _need(h % k.size(2) == 0, "num_head must be divisible by num_head_kv")
    arch = _arch(q)
    _need(head_dim_ok(d, arch) and head_dim_ok(v.size(3), arch),
          f"(head_dim, head_dim_v)=({d}, {v.size(3)}) is not supported on SM{arch}")
    if rest:
        out, dout, lse = rest
        _need(out.shape == dout.shape == (b, t, h, v.size(3)), "out, dout must be [B, T, H, Dv]")
        _need(lse.shape == (b, h, t), "lse must have shape (batch_size, num_head, seqlen_q)")
        _need(lse.dtype == torch.float32, "lse must be float32")


def _scores(q, k):
    """(q, k as float32 [B, H, T, D] with KV heads repeated, masked scaled scores [B, H, T, Tk], scale)."""
    qf, kf = (x.float().repeat_interleave(q.size(2) // x.size(2), 2).transpose(1, 2) for x in (q, k))
    scale = 1 / math.sqrt(q.size(3))
    s = qf @ kf.mT * scale
    t, tk = s.shape[-2:]  # causal, aligned bottom-right as in FA4 when T != Tk
    return qf, kf, s.masked_fill(~torch.ones(t, tk, dtype=torch.bool, device=q.device).tril(tk - t), -math.inf), scale


# explicit schemas: the packed train_gpt.py carries no annotations to infer them from
@torch.library.custom_op("pgkit::fa4_fwd", mutates_args=(), schema="(Tensor q, Tensor k, Tensor v) -> (Tensor, Tensor)")
def fa4_fwd(q, k, v):
    # CUDA: FA4 asserts its contract itself (the fake checks it while torch.compile traces); return_lse=True, as
    # inside a compiled graph q has no requires_grad and FA4 would not compute the lse the backward needs
    if BUNDLE_KIND == "package":  # the twin is the package's (tests, benches): a run takes FA4 on CUDA only
        if not q.is_cuda:
            return _twin_fwd(q, k, v)
    out, lse = load_fa4()._flash_attn_fwd(q, k, v, softmax_scale=None, causal=True, window_size_left=None,
                                      window_size_right=None, softcap=0.0, num_splits=1, pack_gqa=None,
                                      return_lse=True)[:2]
    return out.contiguous(), lse.contiguous()


def _twin_fwd(q, k, v):
    """pgkit::fa4_fwd's CPU kernel: FA4's math in float32."""
    _check(q, k, v)
    with torch.autocast(q.device.type, enabled=False):  # the twin's float32 math, also inside an autocast region
        _, _, s, _ = _scores(q, k)
        lse = s.logsumexp(-1)
        vf = v.float().repeat_interleave(q.size(2) // v.size(2), 2).transpose(1, 2)
        return ((s - lse[..., None]).exp() @ vf).transpose(1, 2).to(q.dtype).contiguous(), lse.contiguous()


@fa4_fwd.register_fake
def _fa4_fwd_fake(q, k, v):
    if BUNDLE_KIND == "package":  # the twin's contract at trace time; on CUDA FA4 asserts it itself, as it runs
        _check(q, k, v)
    b, t, h, _ = q.shape
    return q.new_empty(b, t, h, v.size(3)), q.new_empty(b, h, t, dtype=torch.float32)


@torch.library.custom_op("pgkit::fa4_bwd", mutates_args=(),
                         schema="(Tensor dout, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse) -> (Tensor, Tensor, Tensor)")
def fa4_bwd(dout, q, k, v, out, lse):
    if BUNDLE_KIND == "package":  # the twin (fa4_fwd)
        if not q.is_cuda:
            return _twin_bwd(dout, q, k, v, out, lse)
    grads = load_fa4()._flash_attn_bwd(q, k, v, out, dout, lse, softmax_scale=None, causal=True, softcap=0.0,
                                   window_size_left=None, window_size_right=None, deterministic=False)
    return tuple(x.contiguous() for x in grads[:3])


def _twin_bwd(dout, q, k, v, out, lse):
    """pgkit::fa4_bwd's CPU kernel: FA4's backward in float32, P recomputed from lse."""
    _check(q, k, v, out, dout, lse)
    # P = exp(S - lse); dV = P^T dO; dS = P (dO V^T - rowsum(dO * O)); dQ = dS K scale; dK = dS^T Q scale
    g = q.size(2) // k.size(2)
    with torch.autocast(q.device.type, enabled=False):
        qf, kf, s, scale = _scores(q, k)
        p = (s - lse[..., None]).exp()
        do, vf = dout.float().transpose(1, 2), v.float().repeat_interleave(g, 2).transpose(1, 2)
        ds = p * (do @ vf.mT - (do * out.float().transpose(1, 2)).sum(-1, keepdim=True))
        dk, dv = (x.view(k.size(0), k.size(2), g, *x.shape[2:]).sum(2) for x in (ds.mT @ qf * scale, p.mT @ do))
        return tuple(x.transpose(1, 2).to(q.dtype).contiguous() for x in (ds @ kf * scale, dk, dv))


@fa4_bwd.register_fake
def _fa4_bwd_fake(dout, q, k, v, out, lse):
    if BUNDLE_KIND == "package":  # (as _fa4_fwd_fake)
        _check(q, k, v, out, dout, lse)
    return tuple(torch.empty_like(x, memory_format=torch.contiguous_format) for x in (q, k, v))


def _setup_context(ctx, inputs, output):
    ctx.save_for_backward(*inputs, *output)
    ctx.mark_non_differentiable(output[1])


def _backward(ctx, dout, _dlse):
    return fa4_bwd(dout, *ctx.saved_tensors)


fa4_fwd.register_autograd(_backward, setup_context=_setup_context)


def fa4_function(device: torch.device, head_dim: int = 0, /):
    """flash_attn_func below, for attention on `device` (CUDA) with heads of head_dim (0: not checked), once FA4
    imports and can run there: sm_90/sm_100 only (its backward needs sm_90+, torch's FA4 router takes 9.x/10.x), a
    head dim it takes (head_dim_ok). ImportError (or the import's OSError/RuntimeError) otherwise."""
    major, minor = torch.cuda.get_device_capability(device)
    if major not in (9, 10) or not head_dim_ok(head_dim or 64, 10 * major + minor):  # 64: every arch takes it
        raise ImportError(f"FA4 runs on sm_90/sm_100, not head dim {head_dim} on sm_{major}{minor}")
    load_fa4()
    return flash_attn_func


def flash_attn_func(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = False) -> torch.Tensor:
    """flash_attn_func(q, k, v, causal=True) through pgkit::fa4_fwd: q [B, T, H, D], k/v [B, T, Hkv, D] ->
    [B, T, H, D] in q's dtype. ValueError for causal=False in the package (the ops are causal only; model.attention
    calls it causal)."""
    if BUNDLE_KIND == "package":
        if not causal:
            raise ValueError("the FA4 ops are causal only")
    return fa4_fwd(q, k, v)[0]
