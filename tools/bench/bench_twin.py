"""`tools/bench_step.py --cpu-twin`: the training step's H100 memory traffic, measured on a CPU.

Prints, for one micro-batch at the preset's shape (TRAIN_BATCH_TOKENS / 8 micro-batches, as on one GPU; the
trainer's model with its QUANT_* QAT bit widths, before QAT starts):
the generated forward and backward modules' Triton kernels and launches, the bytes they move (Inductor's
per-kernel estimate x launches; matmuls and attention are extern calls, not counted; "unread in-place": the
part of it Inductor charges as reads of in-place outputs the kernel never loads), their float32
[tokens x hidden]-or-larger buffers, and the worst ptxas spill (bytes per thread, sm_90a) of their fused
reductions, each at its least-spilling launch config (the spill autotuning cannot avoid); then the CPU
bf16-autocast census of float32 [B, T, model_dim] activations saved for backward (tools/bench/step_twin.py).
With `--profile ROWS`, each module's ROWS kernels that move the most bytes (where to look for waste).
Predictions from generated code, not timings: at ~3 TB/s on an H100 SXM, 1 GiB moved costs ~0.36 ms.
"""

import sys

import torch

from primitives.settings import OFFICIAL_GRAD_ACCUM
from quant.policy import QuantPolicy
from tools.bench.step_twin import generate_cuda_step, kernel_stats, ptxas_spills, saved_activation_census, triton_status

H100_BYTES_PER_S = 3.0e12  # a round figure for an H100 SXM's HBM3 (datasheet: 3.35 TB/s)


def twin_rows(paths: dict, num_tokens: int, model_dim: int, work_dir, spills: bool = True) -> list:
    """[(part, stats, worst spill row or None, its kernel name)] for the forward and backward modules: per fused
    reduction its least-spilling launch config, and the kernel whose least is the largest."""
    rows = []
    for part in ("forward", "backward"):
        stats = kernel_stats(paths[part])
        worst, worst_name = None, ""
        for kernel in stats.kernels if spills else []:
            if "reduction" not in kernel.kind or not kernel.launches:
                continue
            # autotuning may pick any of a kernel's configs: its least-spilling config is the spill it cannot avoid
            row = min(ptxas_spills(kernel, work_dir), key=lambda r: r["spill_stores_bytes"])
            if worst is None or row["spill_stores_bytes"] > worst["spill_stores_bytes"]:
                worst, worst_name = row, kernel.name
        rows.append((part, stats, worst, worst_name))
    return rows


def top_kernels(stats, rows: int) -> list:
    """The `rows` kernels of a module that move the most bytes (all launches), as printable lines."""
    ranked = sorted(stats.kernels, key=lambda k: -k.bytes * k.launches)[:rows]
    return [f"  {k.bytes * k.launches / 2**30:7.3f} GiB  {k.launches:3d} x {k.bytes / 2**20:8.1f} MiB  {k.kind:<22} {k.name}"
            for k in ranked]


def run_twin(hp, out_dir, log=print, top: int = 0) -> int:
    """Generate and report (see the module docstring); 2 with one line when this torch cannot."""
    why = triton_status()
    if why:
        print(f"bench_step --cpu-twin: {why}", file=sys.stderr)
        return 2
    config = {k: getattr(hp, k) for k in ("vocab_size", "num_layers", "model_dim", "num_heads", "num_kv_heads",
                                          "mlp_mult", "mlp_activation", "tie_embeddings", "rope_base", "rope_dims",
                                          "logit_softcap", "qk_gain_init", "xsa_last_n", "parallel_residual_start")}
    try:  # the trainer's model: QAT bit widths from QUANT_*, QAT not yet on (the first 1 - QAT_START_FRAC of the run)
        policy = QuantPolicy.from_env()
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    # per micro-batch of the official script's size (32 x 2048 at the default preset): the unit of docs/benchmarks.md
    batch = max(1, hp.train_batch_tokens // (OFFICIAL_GRAD_ACCUM * hp.train_seq_len))
    num_tokens = batch * hp.train_seq_len
    try:
        paths = generate_cuda_step(config, batch, hp.train_seq_len, out_dir, qat_policy=policy, log=log)
    except RuntimeError as err:
        print(f"bench_step --cpu-twin: {str(err).splitlines()[0]}", file=sys.stderr)
        return 2
    log(f"bench_step --cpu-twin: torch {torch.__version__}, preset {hp.preset}, one micro-batch of {batch} x "
        f"{hp.train_seq_len} tokens, {hp.num_layers}L d{hp.model_dim}, vocab {hp.vocab_size} (predictions, not timings)")
    log(f"{'module':<9} {'kernels':>7} {'launches':>8} {'GiB moved':>9} {'unread in-place':>15} {'~ms @3TB/s':>10} "
        f"{'fp32 full-size':>14}  worst unavoidable spill")
    for part, stats, worst, name in twin_rows(paths, num_tokens, hp.model_dim, f"{out_dir}/ptxas"):
        gib = stats.bytes_moved / 2**30
        spill = (f"{worst['spill_stores_bytes']} B stores, {worst['registers']} regs, {worst['num_warps']} warps "
                 f"{worst['config']} ({name})" if worst else "none")
        full = len(stats.full_size_fp32(num_tokens, hp.model_dim))
        log(f"{part:<9} {len(stats.kernels):>7} {sum(k.launches for k in stats.kernels):>8} {gib:>9.2f} "
            f"{stats.unread_inplace_bytes / 2**30:>15.2f} {1000 * stats.bytes_moved / H100_BYTES_PER_S:>10.1f} "
            f"{full:>14}  {spill}")
        if top:
            log(f"{part}: the {top} kernels that move the most (GiB all launches, launches x MiB each, kind, name)")
            for line in top_kernels(stats, top):
                log(line)
        if stats.unestimated:
            log(f"WARNING: {part}: {len(stats.unestimated)} launched kernels carry no byte estimate "
                f"({', '.join(stats.unestimated[:3])}...; e.g. combo kernels): its GiB moved is a lower bound")
    census = saved_activation_census(config, 1, hp.train_seq_len)
    log(f"saved for backward (CPU bf16 autocast, 1 x {hp.train_seq_len}): {len(census.residual_fp32())} float32 "
        f"[B, T, {hp.model_dim}] residual tensors; float32 {census.bytes_by_dtype(True).get(torch.float32, 0) / 2**20:.1f} "
        f"MiB, bf16 {census.bytes_by_dtype(True).get(torch.bfloat16, 0) / 2**20:.1f} MiB")
    log(f"generated code: {paths['forward']}, {paths['backward']}")
    return 0
