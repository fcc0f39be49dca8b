"""Causal attention with GQA: the one device-specific dispatch point (FA3 -> FA2 -> SDPA).

Shapes: B batch, T time (sequence), H query heads, Hkv key/value heads (GQA: H % Hkv == 0), D head dim.
"""

import importlib

import torch
import torch.nn.functional as F


_FLASH_ATTN = []  # the flash-attn function chosen by resolve_attention_backend, if any


def resolve_attention_backend(requested: str, device: torch.device, log=print) -> str:
    """Pick FA3 -> FA2 -> SDPA. Forcing fa3/fa2 without CUDA or without the package raises ValueError.

    A CUDA run that ends on SDPA (flash-attn missing, or built for another torch: its import fails)
    logs a WARNING line with the import error; requirements-gpu.txt has the install lines.
    """
    if device.type != "cuda":
        if requested in ("fa3", "fa2"):
            raise ValueError(f"ATTN_BACKEND={requested!r}: flash-attn needs CUDA, this run is on {device.type}")
        return "sdpa"
    errors = []
    for name in {"auto": ["fa3", "fa2", "sdpa"]}.get(requested, [requested]):
        if name == "sdpa":
            if errors:
                log(f"WARNING: attention falls back to PyTorch SDPA (slower than flash-attn): {'; '.join(errors)}"
                    " (install: requirements-gpu.txt)")
            return name
        module = {"fa3": "flash_attn_interface", "fa2": "flash_attn"}[name]
        try:
            _FLASH_ATTN[:] = [importlib.import_module(module).flash_attn_func]
            return name
        except (ImportError, OSError) as err:  # missing, or an extension built for another torch/CUDA
            if requested != "auto":
                raise ValueError(f"ATTN_BACKEND={requested!r}: cannot import {module}: {err}") from None
            errors.append(f"{module}: {err}")


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Causal attention with GQA. q [B, T, H, D]; k, v [B, T, Hkv, D] -> [B, T, H, D] in v's dtype.

    The one device-specific dispatch point: flash-attn 3/2 on CUDA, PyTorch SDPA elsewhere (the CPU
    twin every test exercises). Query head h reads KV head h // (H // Hkv) in all backends.
    flash-attn takes one fp16/bf16 dtype only, so q, k, v are cast to the autocast dtype (bf16 when
    not autocasting): from torch 2.12 CUDA autocast runs rms_norm in float32 (pytorch issue 188955),
    so the rms-normed q/k arrive as float32 beside a bf16 v. SDPA casts its own inputs. On the meta
    device (FLOP counting) SDPA always runs: flash-attn's fake kernels query the CUDA device there.
    """
    if _FLASH_ATTN and q.device.type != "meta":
        dev = q.device.type
        dt = torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else torch.bfloat16
        out = _FLASH_ATTN[0](q.to(dt), k.to(dt), v.to(dt), causal=True)
        return (out[0] if isinstance(out, tuple) else out).to(v.dtype)
    y = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                       is_causal=True, enable_gqa=k.size(2) != q.size(2))
    return y.transpose(1, 2)
