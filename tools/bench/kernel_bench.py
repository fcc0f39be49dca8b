"""Kernel bench: attention fwd+bwd and the training loss on every kernel this machine has, at the preset's shape.

    python -m tools.bench.kernel_bench             # a CUDA GPU: the preset's micro-batch shape
    python -m tools.bench.kernel_bench --cpu-twin  # the CPU twins at a tiny shape (plumbing; timings say nothing)

Attention: q [B, T, H, D], k/v [B, T, Hkv, D] bf16, causal, with B the preset's sequences per micro-batch
(TRAIN_BATCH_TOKENS / GRAD_ACCUM_STEPS / TRAIN_SEQ_LEN, with the accumulation the trainer resolves on a GPU),
on SDPA's cuDNN / flash / memory-efficient backends (GQA through enable_gqa) and on each flash-attn the kit's
dispatch (model.attention.resolve_attention_backend) can import: FA3, FA4, FA2. Loss: x [B*T, d] bf16 @ the
tied head [V, d] -> softcap -> cross entropy, fwd+bwd, on each LOSS_KERNEL the kit has. Every row gives
the median of the timed calls (CUDA events), TFLOP/s (attention: causal, fwd 2*B*H*T*T*D, bwd 2.5x fwd),
peak memory above the inputs, and the largest difference from the first row (the agreement check).
Rows are printed as `ROW<TAB>configuration<TAB>result<TAB>note` lines as they are measured (gpu_report).
"""

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import model.attention as kit_attention  # noqa: E402
import primitives.settings as kit_settings  # noqa: E402


def emit(config: str, result: str, note: str = "") -> None:
    print(f"ROW\t{config}\t{result}\t{note}", flush=True)


def time_call(fn, device: torch.device, warmup: int = 3, iters: int = 10) -> tuple:
    """(median ms, peak bytes above the memory in use before) of fn() on `device`."""
    for _ in range(warmup):
        fn()
    times = []
    if device.type == "cuda":
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        for _ in range(iters):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            b.synchronize()
            times.append(a.elapsed_time(b))
        return statistics.median(times), torch.cuda.max_memory_allocated() - base
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        times.append(1000 * (time.perf_counter() - t0))
    return statistics.median(times), 0


def attention_shape(hp, twin: bool) -> tuple:
    if twin:
        return 2, 64, 4, 2, 16
    return hp.micro_batch_seqs(1, True), hp.train_seq_len, hp.num_heads, hp.num_kv_heads, hp.model_dim // hp.num_heads


def sdpa_variant(backend_name: str):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    def run(q, k, v):
        with sdpa_kernel([getattr(SDPBackend, backend_name)]):
            y = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                               is_causal=True, enable_gqa=k.size(2) != q.size(2))
        return y.transpose(1, 2)
    return run


def kit_variant(name: str, device: torch.device, head_dim: int):
    """The kit's dispatch with ATTN_BACKEND=name (resolved now: call just before timing it), or None with
    the reason it cannot run here."""
    try:
        got = kit_attention.resolve_attention_backend(name, device, log=lambda *a: None, head_dim=head_dim)
    except ValueError as err:
        return None, str(err)
    return (kit_attention.attention, "") if got == name else (None, f"resolved to {got}")


def bench_attention(hp, device: torch.device, twin: bool) -> None:
    b, t, h, hkv, d = attention_shape(hp, twin)
    gen = torch.Generator(device=device).manual_seed(0)
    q, k, v = (torch.randn(b, t, n, d, device=device, dtype=torch.bfloat16, generator=gen) for n in (h, hkv, hkv))
    dout = torch.randn(b, t, h, d, device=device, dtype=torch.bfloat16, generator=gen)
    flops = 3.5 * 2 * b * h * t * t * d  # causal fwd (2 matmuls over half the T x T) + bwd at 2.5x
    shape = f"B{b} T{t} H{h}/{hkv} D{d}"
    variants = []
    if device.type == "cuda":
        variants += [(f"SDPA {n.split('_')[0].lower()}", sdpa_variant(n), "")
                     for n in ("CUDNN_ATTENTION", "FLASH_ATTENTION", "EFFICIENT_ATTENTION")]
    else:
        variants.append(("SDPA math (CPU)", sdpa_variant("MATH"), ""))
    for name in ("fa3", "fa4", "fa2"):  # resolved one at a time, right before each is timed
        variants.append((f"kit ATTN_BACKEND={name}", name, ""))
    reference = None
    for label, fn, why in variants:
        if isinstance(fn, str):
            fn, why = kit_variant(fn, device, d) if device.type == "cuda" else twin_variant(fn)
        if fn is None:
            emit(f"attention {label}", "not available", why)
            continue
        leaves = [x.detach().requires_grad_() for x in (q, k, v)]

        def step(fn=fn, leaves=leaves):
            out = fn(*leaves)
            out.backward(dout)
            return out
        try:
            out = step().detach().float()
            ms, peak = time_call(step, device)
        except Exception as err:  # a backend that refuses this shape/dtype is a row, not the end of the bench
            emit(f"attention {label}", "failed", f"{type(err).__name__}: {str(err).splitlines()[0][:160]}")
            continue
        if reference is None:
            reference, diff = out, 0.0
        diff = (out - reference).abs().max().item()
        emit(f"attention {label}", f"{ms:.2f} ms fwd+bwd",
             f"{shape}; {flops / ms / 1e9:.0f} TFLOP/s; peak +{peak / 2**20:.0f} MiB; max |out diff| {diff:.1e}")
    if device.type == "cuda":  # leave the process on plain SDPA, as before the bench
        kit_attention.resolve_attention_backend("sdpa", device, log=lambda *a: None)


def twin_variant(name: str):
    """On the CPU: FA4's contract twin (model/fa4.py's CPU kernels); FA3/FA2 have none here."""
    if name != "fa4":
        return None, "no CPU twin"
    from model.fa4 import flash_attn_func

    return (lambda q, k, v: flash_attn_func(q, k, v, causal=True)), ""


def plain_loss(x, w, y, softcap):
    """The softcapped loss under autograd (GPT.forward's before model/softcap_loss.py): logits in x's dtype,
    softcap and cross entropy in float32 (float64 kept), the logits re-read by the backward. The reference of
    the tests of model/softcap_loss.py."""
    logits = F.linear(x, w.to(x.dtype))
    return F.cross_entropy(softcap * torch.tanh(logits.to(torch.promote_types(logits.dtype, torch.float32)) / softcap), y)


def loss_variants(device: torch.device) -> list:
    """(label, fn(x, w, y, softcap) -> mean loss, why-not): GPT.forward's loss with LOSS_KERNEL=torch (the
    logits' gradient made in the forward) and the plain autograd loss, compiled as the trainer compiles them
    (eager on the CPU twin), then the fused op (Liger on CUDA, its chunked twin on the CPU)."""
    from model import fused_loss
    from model.softcap_loss import head_softcap_cross_entropy

    def compiled(fn):
        return torch.compile(fn, fullgraph=True) if device.type == "cuda" else fn

    suffix = " (compiled)" if device.type == "cuda" else ""
    out = [(f"LOSS_KERNEL=torch{suffix}", compiled(head_softcap_cross_entropy), ""),
           (f"plain autograd softcap CE{suffix}", compiled(plain_loss), "")]
    try:
        name = "LOSS_KERNEL=liger" if device.type == "cuda" else "LOSS_KERNEL=liger twin (CPU)"
        if device.type == "cuda":
            fused_loss.choose_loss_kernel("liger", device)
        out.append((name, fused_loss.linear_softcap_cross_entropy, ""))
    except ValueError as err:
        out.append(("LOSS_KERNEL=liger", None, str(err)))
    return out


def bench_loss(hp, device: torch.device, twin: bool) -> None:
    b, t = attention_shape(hp, twin)[:2]
    n, dim, vocab = (b * t, 32, 256) if twin else (b * t, hp.model_dim, hp.vocab_size)
    gen = torch.Generator(device=device).manual_seed(0)
    x = torch.randn(n, dim, device=device, dtype=torch.bfloat16, generator=gen)
    w = (0.02 * torch.randn(vocab, dim, device=device, generator=gen))
    y = torch.randint(0, vocab, (n,), device=device, generator=gen)
    reference = None
    for name, fn, why in loss_variants(device):
        if fn is None:
            emit(f"loss {name}", "not available", why)
            continue
        xl, wl = x.detach().requires_grad_(), w.detach().requires_grad_()

        def step(fn=fn, xl=xl, wl=wl):
            xl.grad = wl.grad = None
            loss = fn(xl, wl, y, hp.logit_softcap)
            loss.backward()
            return loss
        try:
            loss = step().item()
            ms, peak = time_call(step, device)
        except Exception as err:
            emit(f"loss {name}", "failed", f"{type(err).__name__}: {str(err).splitlines()[0][:160]}")
            continue
        grads = torch.cat([xl.grad.float().flatten(), wl.grad.float().flatten()])
        if reference is None:
            reference = (loss, grads)
        diff = max(abs(loss - reference[0]), (grads - reference[1]).abs().max().item())
        emit(f"loss {name}", f"{ms:.2f} ms fwd+bwd",
             f"{n:,} tokens x {dim} -> {vocab}; peak +{peak / 2**20:.0f} MiB; loss {loss:.5f}; max diff {diff:.1e}")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cpu-twin", action="store_true", help="the CPU twins at a tiny shape")
    args = parser.parse_args(argv)
    if not args.cpu_twin and not torch.cuda.is_available():
        print("kernel_bench: needs a CUDA GPU; on a CPU run `python -m tools.bench.kernel_bench --cpu-twin`",
              file=sys.stderr)
        return 2
    try:
        hp = kit_settings.Hyperparameters.from_env(log=lambda msg: None)
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    device = torch.device("cpu" if args.cpu_twin else "cuda")
    bench_attention(hp, device, args.cpu_twin)
    bench_loss(hp, device, args.cpu_twin)
    return 0


if __name__ == "__main__":
    sys.exit(main())
