"""Causal attention with GQA: the one device-specific dispatch point (FA3 -> FA4 -> FA2 -> SDPA), with
document-packed attention (no token attends across a BOS; PR #1855's varlen FlashAttention) as an option.

Shapes: B batch, T time (sequence), H query heads, Hkv key/value heads (GQA: H % Hkv == 0), D head dim.
"""

import contextlib
import importlib

import torch
import torch.nn.functional as F

from primitives.env import BUNDLE_KIND
from model.doc_attention import doc_attention, document_segments
from model.fa4 import fa4_function


# [flash_attn_func, flash_attn_varlen_func or None] of the flash-attn resolve_attention_backend chose, if any (the
# varlen function: its module's (FA3, FA2), for document-packed attention)
_FLASH_ATTN = []
# the flash-attn backends in ATTN_BACKEND=auto's order, and their modules
FLASH_MODULES = {"fa3": "flash_attn_interface", "fa4": "flash_attn.cute.interface", "fa2": "flash_attn"}
_SDPA_PRIORITY = contextlib.ExitStack()  # holds the process-wide SDPA backend order set by set_sdpa_priority


def set_sdpa_priority(capability: tuple, log=print) -> str:
    """Make the SDPA backends' order for a CUDA device of compute capability (major, minor) the process's
    (torch.nn.attention.sdpa_kernel with set_priority=True, torch >= 2.9: held open until the next call); logs and
    returns it as "cudnn_attention > ...".

    Hopper and newer (sm_90+): cuDNN, then flash, then memory-efficient (measured on an H100, torch 2.11,
    the default preset's attention fwd+bwd: cuDNN 1.75 ms, flash 2.62 ms, efficient 5.23 ms); older
    GPUs: flash, efficient, cuDNN. Math stays last so an unsupported shape still runs.
    Set before the first compile: Inductor picks the SDPA kernel when it traces.
    """
    from torch.nn.attention import SDPBackend, sdpa_kernel

    # SDPBackend's values: 0 math, 1 flash, 2 efficient (memory-efficient), 3 cuDNN
    order = [SDPBackend(i) for i in ((3, 1, 2, 0) if tuple(capability) >= (9, 0) else (1, 2, 3, 0))]
    _SDPA_PRIORITY.close()
    _SDPA_PRIORITY.enter_context(sdpa_kernel(order, set_priority=True))
    text = " > ".join(b.name.lower() for b in order)
    log(f"attention:sdpa priority {text} (sm_{capability[0]}{capability[1]})")
    return text


def sdpa_choice(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> str:
    """The SDPA backend torch would run for attention(q, k, v) ([B, T, H, D] inputs), e.g. "cudnn_attention"."""
    from torch.nn.attention import SDPBackend

    index = torch._fused_sdp_choice(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True,
                                    enable_gqa=k.size(2) != q.size(2))
    return next((b.name.lower() for b in SDPBackend.__members__.values() if int(b) == index), str(index))




def resolve_attention_backend(requested: str, device: torch.device, /, log=print, head_dim: int = 0) -> str:
    """Pick FA3 -> FA4 -> FA2 -> SDPA (FA4 only on sm_90/sm_100 and, head_dim given, a head dim it takes:
    model/fa4.py fa4_function). Forcing fa3/fa4/fa2 without CUDA, without the package, or fa4 where it cannot run
    raises ValueError.

    A CUDA run that ends on SDPA (flash-attn missing, or built for another torch: its import fails)
    logs a WARNING line with the import error (requirements-gpu.txt has the install lines) and sets
    SDPA's backend order for the GPU (set_sdpa_priority: cuDNN first on Hopper).
    """
    if device.type != "cuda":
        if requested in FLASH_MODULES:
            raise ValueError(f"ATTN_BACKEND={requested!r}: flash-attn needs CUDA, this run is on {device.type}")
        return "sdpa"
    errors = []
    for name in [*FLASH_MODULES, "sdpa"] if requested == "auto" else [requested]:
        if name == "sdpa":
            _FLASH_ATTN.clear()  # a process that resolved a flash-attn before (a bench) goes back to SDPA
            if errors:
                log(f"WARNING: attention falls back to PyTorch SDPA: {'; '.join(errors)}"
                    + (" (install: requirements-gpu.txt)" if BUNDLE_KIND == "package" else ""))
            set_sdpa_priority(torch.cuda.get_device_capability(device), log)
            return name
        module = FLASH_MODULES[name]
        try:
            # FA4's wheel makes flash_attn a namespace package: without FA2, flash_attn has no flash_attn_func
            mod = None if name == "fa4" else importlib.import_module(module)
            _FLASH_ATTN[:] = [fa4_function(device, head_dim) if mod is None else mod.flash_attn_func,
                              getattr(mod, "flash_attn_varlen_func", None)]
            return name
        except (ImportError, OSError, AttributeError, RuntimeError) as err:  # missing, or built for another torch/CUDA
            if requested != "auto":
                raise ValueError(f"ATTN_BACKEND={requested!r}: cannot use {module}: {err}") from None
            errors.append(f"{module}: {err}")


def doc_segments(input_ids: torch.Tensor, bos_id: int, /, varlen: bool | None = None):
    """The documents of input_ids int64 [B, T] (DOC_PACKED_ATTENTION): model/doc_attention.py's DocSegments, with
    cu_seqlens when varlen (default: a varlen kernel was resolved and the ids are on CUDA), else the dense mask."""
    return document_segments(input_ids, bos_id, bool(_FLASH_ATTN and _FLASH_ATTN[1]) and input_ids.is_cuda
                             if varlen is None else varlen)


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, docs=None) -> torch.Tensor:
    """Causal attention with GQA. q [B, T, H, D]; k, v [B, T, Hkv, D] -> [B, T, H, D] in v's dtype.

    The one device-specific dispatch point: flash-attn 3/4/2 on CUDA, PyTorch SDPA elsewhere (the CPU
    twin every test exercises; tests plug in model/fa4.py, whose CPU implementation is FA4's twin).
    Query head h reads KV head h // (H // Hkv) in all backends.
    flash-attn takes one fp16/bf16 dtype only, so q, k, v are cast to the autocast dtype (bf16 when
    not autocasting): from torch 2.12 CUDA autocast runs rms_norm in float32 (pytorch/pytorch#188955),
    so the rms-normed q/k arrive as float32 beside a bf16 v. SDPA casts its own inputs. On the meta
    device (FLOP counting) SDPA always runs: flash-attn's fake kernels query the CUDA device there.
    docs (doc_segments, DOC_PACKED_ATTENTION): each token reads only its own document (model/doc_attention.py).
    """
    flash = _FLASH_ATTN and q.device.type != "meta"
    if docs is not None:
        return doc_attention(q, k, v, docs, flash and _FLASH_ATTN[1])
    if flash:
        dev = q.device.type
        dt = torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else torch.bfloat16
        out = _FLASH_ATTN[0](q.to(dt), k.to(dt), v.to(dt), causal=True)
        return (out[0] if isinstance(out, tuple) else out).to(v.dtype)
    y = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True,
                                       enable_gqa=k.size(2) != q.size(2))
    return y.transpose(1, 2)
