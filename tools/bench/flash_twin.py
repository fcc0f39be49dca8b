"""CPU twins of the CUDA-only behaviours the trainer meets on an H100.

A CPU never shows how flash-attn or CUDA autocast behave, so tests (and `tools/gpu_check.py --cpu-twin`)
plug in stand-ins that fail the way the GPU would:

- `flash_attn_standin(q, k, v, causal=True)`: a stand-in for `flash_attn_interface.flash_attn_func`
  (FA3) / `flash_attn.flash_attn_func` (FA2), registered with `torch.library.custom_op` as a forward
  and a backward op with fake (meta/FakeTensor) implementations, like FA3's
  `flash_attn_3::_flash_attn_forward/_backward`. It enforces flash-attn's contract and computes with
  SDPA. Contract (flash-attn csrc `mha_fwd` checks; hopper/flash_api.cpp): q, k, v fp16 or bf16
  ("FlashAttention only support fp16 and bf16 data type"), all one dtype ("query and key must have
  the same dtype"), 4-D [B, T, H, D] with H a multiple of Hkv, the same B/T/D, head dim a multiple
  of 8 and <= 256, contiguous last dim; the kit only asks for causal attention. The backward fake
  refuses the meta device, as FA3's does (it calls `torch.cuda.get_device_capability(q.device)`,
  which raises on a meta tensor): so a FLOP count on meta that reaches the kernel fails here too.
- `cuda_autocast_rms_norm()`: a context manager that registers, for the AutocastCPU dispatch key,
  the float32 policy CUDA autocast has for `rms_norm` from torch 2.12 (pytorch/pytorch#188955): inputs
  cast to float32, float32 out. With it, CPU bf16 autocast hands attention float32 q/k and a
  bfloat16 v, as an H100 does.
- `plugged_fa4_twin()`: routes attention through the FA4 custom ops of model/fa4.py, whose CPU
  implementation is FA4's twin (ATTN_BACKEND=fa4 on a CPU).
"""

import contextlib

import torch
import torch.nn.functional as F

FLASH_DTYPES = (torch.float16, torch.bfloat16)


def _check_contract(q, k, v, causal):
    if not causal:
        raise RuntimeError("flash stand-in: the kit only calls causal attention")
    if q.dtype not in FLASH_DTYPES:
        raise RuntimeError(f"FlashAttention only support fp16 and bf16 data type (q is {q.dtype})")
    if k.dtype != q.dtype or v.dtype != q.dtype:
        raise RuntimeError(f"query and key must have the same dtype (q {q.dtype}, k {k.dtype}, v {v.dtype})")
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise RuntimeError(f"flash stand-in: expected [B, T, H, D] tensors, got {list(q.shape)}, {list(k.shape)}")
    b, t, h, d = q.shape
    if k.shape != v.shape or k.shape[0] != b or k.shape[1] != t or k.shape[3] != d:
        raise RuntimeError(f"flash stand-in: k/v shape {list(k.shape)} does not match q {list(q.shape)}")
    if h % k.shape[2]:
        raise RuntimeError(f"Number of heads in key/value must divide number of heads in query ({h} vs {k.shape[2]})")
    if d % 8 or d > 256:
        raise RuntimeError(f"flash stand-in: head dim {d} must be a multiple of 8 and <= 256")
    if any(x.stride(-1) != 1 for x in (q, k, v)):
        raise RuntimeError("Input tensor must have contiguous last dimension")


def _sdpa(q, k, v):
    y = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True,
                                       enable_gqa=k.size(2) != q.size(2))
    return y.transpose(1, 2).contiguous()


@torch.library.custom_op("pgkit_twin::flash_fwd", mutates_args=())
def flash_fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool) -> torch.Tensor:
    _check_contract(q, k, v, causal)
    return _sdpa(q, k, v)


@flash_fwd.register_fake
def _flash_fwd_fake(q, k, v, causal):
    _check_contract(q, k, v, causal)
    return torch.empty_like(q).contiguous()


@torch.library.custom_op("pgkit_twin::flash_bwd", mutates_args=())
def flash_bwd(grad_out: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> list[torch.Tensor]:
    # Causal softmax attention backward in float32 (a custom op runs below autograd, so by hand):
    # P = softmax(q k^T / sqrt(D)), dV = P^T dO, dS = P * (dO V^T - rowsum(dO * O)), dQ = dS K / sqrt(D),
    # dK = dS^T Q / sqrt(D); GQA: KV heads are repeated for the forward and their grads summed back.
    group = q.size(2) // k.size(2)
    qf, kf, vf, go = (x.float().transpose(1, 2) for x in (q, k.repeat_interleave(group, 2),
                                                          v.repeat_interleave(group, 2), grad_out))
    scale = q.size(-1) ** -0.5
    t = q.size(1)
    mask = torch.ones(t, t, dtype=torch.bool, device=q.device).tril()
    p = torch.softmax((qf @ kf.mT * scale).masked_fill(~mask, float("-inf")), dim=-1)
    dv = p.mT @ go
    dp = go @ vf.mT
    ds = p * (dp - (dp * p).sum(-1, keepdim=True))
    dq, dk = ds @ kf * scale, ds.mT @ qf * scale
    b, h, _, d = dk.shape
    dk, dv = (x.view(b, h // group, group, t, d).sum(2) for x in (dk, dv))
    return [x.transpose(1, 2).to(q.dtype).contiguous() for x in (dq, dk, dv)]


@flash_bwd.register_fake
def _flash_bwd_fake(grad_out, q, k, v):
    if q.device.type == "meta":  # FA3: torch.cuda.get_device_capability(q.device) raises on meta
        raise RuntimeError("flash stand-in backward called on the meta device (FA3's fake queries the CUDA device)")
    return [torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)]


def _setup_context(ctx, inputs, output):
    q, k, v, _ = inputs
    ctx.save_for_backward(q, k, v)


def _backward(ctx, grad_out):
    dq, dk, dv = flash_bwd(grad_out.contiguous(), *ctx.saved_tensors)
    return dq, dk, dv, None


flash_fwd.register_autograd(_backward, setup_context=_setup_context)


def flash_attn_standin(q, k, v, causal=False):
    """flash_attn_func(q, k, v, causal=...) stand-in: q [B, T, H, D], k/v [B, T, Hkv, D] -> [B, T, H, D].

    Same dtype out as in (fp16/bf16). RuntimeError for anything flash-attn refuses (see module docstring).
    """
    return flash_fwd(q, k, v, causal)


@contextlib.contextmanager
def plugged_flash_standin():
    """Route trainer_attention.attention through the stand-in (as resolve_attention_backend does with FA3)."""
    import model.attention as trainer_attention

    saved = trainer_attention._FLASH_ATTN[:]
    trainer_attention._FLASH_ATTN[:] = [flash_attn_standin, None]
    try:
        yield
    finally:
        trainer_attention._FLASH_ATTN[:] = saved


def _rms_norm_fp32(input, normalized_shape, weight=None, eps=None):
    keys = torch._C.DispatchKeySet(torch._C.DispatchKey.AutocastCPU)
    with torch._C._ExcludeDispatchKeyGuard(keys):
        return torch.ops.aten.rms_norm(input.float(), normalized_shape,
                                       None if weight is None else weight.float(), eps)


@contextlib.contextmanager
def cuda_autocast_rms_norm():
    """While active, CPU autocast runs aten::rms_norm in float32 and returns float32, as CUDA autocast
    does from torch 2.12 (the `AutocastCUDA` fp32 policy; pytorch/pytorch#188955)."""
    lib = torch.library.Library("aten", "IMPL")
    lib.impl("rms_norm", _rms_norm_fp32, "AutocastCPU")
    try:
        yield
    finally:
        lib._destroy()


@contextlib.contextmanager
def plugged_fa4_twin():
    """Route trainer_attention.attention through pgkit::fa4_fwd (model/fa4.py) as resolve_attention_backend does
    with ATTN_BACKEND=fa4 on a GPU; on the CPU the op runs FA4's twin (its contract, exact math)."""
    import model.attention as trainer_attention
    from model.fa4 import flash_attn_func

    saved = trainer_attention._FLASH_ATTN[:]
    trainer_attention._FLASH_ATTN[:] = [flash_attn_func, None]
    try:
        yield
    finally:
        trainer_attention._FLASH_ATTN[:] = saved
