"""Step bench: the kit's compiled training step beside a reference train_gpt.py on one GPU, in one table.

    python tools/bench_step.py                                   # the default preset, synthetic tokens
    NUM_LAYERS=9 MLP_MULT=2 TRAIN_SEQ_LEN=1024 XSA_LAST_N=0 ROPE_DIMS=64 DATA_PATH=... TOKENIZER_PATH=... \
        python tools/bench_step.py --reference PATH/official_train_gpt.py --profile
    python tools/bench_step.py --cpu-twin                        # no GPU: the step's generated CUDA code

The kit runs in this process through trainer_loop.train (its compiled model, Muon, AdamW, EMA), with the
loop's own timing: warmup steps (compile) are run and undone, then `--steps` steps with no host sync
except at the ends; ms/step = train_batch_tokens / tokens per second over steps 2..N. The reference runs
as its own process with the same shape settings by the challenge's env names (NUM_LAYERS, MODEL_DIM,
NUM_HEADS, NUM_KV_HEADS, MLP_MULT, TRAIN_SEQ_LEN, TRAIN_BATCH_TOKENS, VOCAB_SIZE, ITERATIONS, ...) on the
same DATA_PATH; its ms/step comes from its `step:N/M ... train_time:Tms` lines between step 10 and step N.
MFU for both = one FLOP count (trainer_model.count_train_flops_per_token: torch.utils.flop_counter on the
meta device, the kit's model at that shape; the official baseline has the same matmuls) x tokens/s over
the H100's dense bf16 peak. With --reference and GRAD_ACCUM_STEPS unset, the kit runs the official script's
micro-batch (OFFICIAL_GRAD_ACCUM micro-steps on one GPU), not its own default. `--profile` adds each side's
top CUDA kernels (torch.profiler, full names).

Without CUDA it exits 2 with one line. `--cpu-twin` instead generates the step's CUDA/Triton code on the
CPU (tools/bench/step_twin.py: needs the `triton` package, no GPU) and reports bytes moved per micro-batch,
float32 full-size [tokens x hidden] buffers and ptxas spills of the fused reductions for sm_90a.
"""

import argparse
import dataclasses
import os
import re
import subprocess
import sys
import time
from pathlib import Path


def build_parser() -> argparse.ArgumentParser:
    """The command line, built without torch: `--help` and usage errors answer at once."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=50, help="timed steps per side after warmup (default 50)")
    parser.add_argument("--reference", metavar="PATH", help="a train_gpt.py to time beside the kit (own process)")
    parser.add_argument("--profile", nargs="?", const=25, type=int, metavar="ROWS",
                        help="add each side's top CUDA kernels (default 25 rows); with --cpu-twin, each module's "
                        "generated kernels that move the most bytes")
    parser.add_argument("--cpu-twin", action="store_true", help="no GPU: the step's generated CUDA code, on the CPU")
    parser.add_argument("--cpu", action="store_true", help="time the kit's step on the CPU (a plumbing check for "
                        "tools/gpu_report.py --cpu-twin: its timings say nothing about a GPU; no --reference)")
    parser.add_argument("--out-dir", default="runs/bench_step_twin", help="--cpu-twin: where the generated code goes")
    return parser


if __name__ == "__main__":  # --help and usage errors answer before torch is imported
    build_parser().parse_args()

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import model.attention as trainer_attention  # noqa: E402
import trainer.context as trainer_context  # noqa: E402
import shards.loader as trainer_loader  # noqa: E402
import trainer.loop as trainer_loop  # noqa: E402
import model.gpt as trainer_model  # noqa: E402
from model.fused_loss import resolve_loss_kernel  # noqa: E402
import primitives.settings as trainer_settings  # noqa: E402

SHAPE_ENV = ("NUM_LAYERS", "MODEL_DIM", "NUM_HEADS", "NUM_KV_HEADS", "MLP_MULT", "TRAIN_SEQ_LEN", "TRAIN_BATCH_TOKENS",
             "VOCAB_SIZE", "TIE_EMBEDDINGS", "DATA_PATH", "TOKENIZER_PATH", "SEED")
STEP_LINE = re.compile(r"^step:(\d+)/\d+ .*?train_time:(\d+)ms", re.M)
PEAK_LINE = re.compile(r"peak memory allocated: (\d+) MiB")
# PR #1855's step lines: `N/M train_loss: L train_time: T.Tm tok/s: R`, R = N x TRAIN_BATCH_TOKENS / elapsed seconds
RECORD_STEP_LINE = re.compile(r"^(\d+)/\d+ train_loss: \S+ train_time: \S+m tok/s: (\d+)", re.M)


@dataclasses.dataclass
class Side:
    """One column of the table: ms per step, tokens/s, peak memory (GiB, or None), kernel table text."""

    name: str
    ms_per_step: float
    tokens_per_step: int
    peak_gib: object = None
    kernels: str = ""

    @property
    def tokens_per_second(self) -> float:
        return 1000 * self.tokens_per_step / self.ms_per_step


def reference_env(hp, steps: int) -> dict:
    """The reference's environment: our shape settings by the challenge's names, ITERATIONS = steps, no
    wallclock cap, no validation during training; everything else as in os.environ."""
    env = dict(os.environ)
    values = {"NUM_LAYERS": hp.num_layers, "MODEL_DIM": hp.model_dim, "NUM_HEADS": hp.num_heads,
              "NUM_KV_HEADS": hp.num_kv_heads, "MLP_MULT": hp.mlp_mult, "TRAIN_SEQ_LEN": hp.train_seq_len,
              "TRAIN_BATCH_TOKENS": hp.train_batch_tokens, "VOCAB_SIZE": hp.vocab_size,
              "TIE_EMBEDDINGS": int(hp.tie_embeddings), "DATA_PATH": hp.data_path, "TOKENIZER_PATH": hp.tokenizer_path,
              "SEED": hp.seed}
    for name in SHAPE_ENV:
        value = values[name]
        env[name] = str(int(value)) if isinstance(value, float) and value.is_integer() else str(value)
    env.update(ITERATIONS=str(steps), MAX_WALLCLOCK_SECONDS="0", VAL_LOSS_EVERY="0", TRAIN_LOG_EVERY=str(steps),
               WARMUP_STEPS=str(hp.warmup_steps), PYTHONUNBUFFERED="1")
    return env


def parse_reference_log(text: str, tokens_per_step: int, first_step: int = 10) -> Side:
    """ms/step between the `step:first_step/...` line and the last step line of a reference log (their
    train_time difference / step difference); peak memory from its `peak memory allocated: N MiB` line.
    Raises ValueError when the log has fewer than two usable step lines. A log in PR #1855's form (it prints steps
    1-5 and every TRAIN_LOG_EVERY-th, with the running tok/s) gives each step's elapsed ms from its tok/s, from step 5 on.
    """
    points = {int(s): int(t) for s, t in STEP_LINE.findall(text)}
    if not points and RECORD_STEP_LINE.search(text):
        points = {int(s): 1000 * int(s) * tokens_per_step / int(r) for s, r in RECORD_STEP_LINE.findall(text) if int(r)}
        first_step = min(first_step, 5)
    later = sorted(s for s in points if s >= first_step)
    if len(later) < 2:
        raise ValueError(f"reference log: need step lines at step >= {first_step} and a later one, got steps "
                         f"{sorted(points)[:12]}")
    a, b = later[0], later[-1]
    peak = PEAK_LINE.search(text)
    return Side("reference", (points[b] - points[a]) / (b - a), tokens_per_step,
                int(peak.group(1)) / 1024 if peak else None)


PROFILE_WRAPPER = r"""
import runpy, sys, torch
from torch.profiler import ProfilerActivity, profile
with profile(activities=[ProfilerActivity.CUDA]) as prof:
    runpy.run_path(sys.argv[1], run_name="__main__")
print("=== bench_step kernels ===")
print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=int(sys.argv[2]), max_name_column_width=100000))
"""


def run_reference(path: str, hp, steps: int, profile_rows: int = 0, timeout_s: int = 1800) -> Side:
    """Time the reference script as its own process (and, with profile_rows, a second profiled run). It runs
    in its own folder, so `path` is made absolute first (a relative one named a file that was not there)."""
    path = str(Path(path).resolve())
    env = reference_env(hp, steps)
    proc = subprocess.run([sys.executable, path], env=env, capture_output=True, text=True, timeout=timeout_s,
                          cwd=Path(path).resolve().parent)
    if proc.returncode:
        raise RuntimeError(f"reference exited {proc.returncode}: {proc.stderr.strip().splitlines()[-1:]}")
    side = parse_reference_log(proc.stdout, hp.train_batch_tokens, first_step=min(10, steps // 2))
    if profile_rows:
        env.update(ITERATIONS=str(min(steps, 20)), TRAIN_LOG_EVERY="1000")
        prof = subprocess.run([sys.executable, "-c", PROFILE_WRAPPER, path, str(profile_rows)], env=env,
                              capture_output=True, text=True, timeout=timeout_s, cwd=Path(path).resolve().parent)
        side.kernels = prof.stdout.partition("=== bench_step kernels ===")[2].strip() or prof.stderr[-2000:]
    return side


def run_kit(hp, steps: int, profile_rows: int = 0) -> Side:
    """Time the kit's compiled step through trainer_loop.train (its loop's timing: no host sync per step)."""
    from tools.bench.gpu_check import SyntheticLoader

    hp = dataclasses.replace(hp, iterations=steps, max_wallclock_seconds=0.0, train_log_every=steps, val_loss_every=0,
                             warmup_steps=max(1, hp.warmup_steps), checkpoint_every=0, resume=False)
    ctx = trainer_context.setup_distributed(hp)
    head_dim = hp.model_dim // hp.num_heads
    print(f"attention:{trainer_attention.resolve_attention_backend(hp.attn_backend, ctx.device, print, head_dim)}")
    resolve_loss_kernel(hp.loss_kernel, ctx.device, print)  # as train_gpt.py does (prints loss:liger / loss:torch)
    if Path(hp.data_path).is_dir():
        loader = trainer_loader.DistributedTokenLoader(hp.data_path, hp.vocab_size, device=ctx.device)
    else:
        loader = SyntheticLoader(hp.vocab_size, ctx.device)
    config = trainer_model.build_model_config(hp)
    torch.manual_seed(hp.seed)
    model = trainer_model.GPT(**config).to(ctx.device)
    model.init_weights(hp.tied_embed_init_std)
    lines, ctx.log = [], (lambda msg="", console=True: lines.append(msg))
    cuda = ctx.device.type == "cuda"
    if cuda:
        torch.cuda.reset_peak_memory_stats(ctx.device)
    trainer_loop.train(ctx, hp, model, loader, flops_per_token=0.0)
    tok_s = [float(m.group(1)) for line in lines if line.startswith(f"step:{steps}/")
             and (m := re.search(r" tok_s:(\d+)", line))]
    side = Side("kit", 1000 * hp.train_batch_tokens / tok_s[0], hp.train_batch_tokens,
                torch.cuda.max_memory_allocated(ctx.device) / 2**30 if cuda else None)
    if profile_rows:
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            short = dataclasses.replace(hp, iterations=min(steps, 20), warmup_steps=1)
            trainer_loop.train(ctx, short, model, loader, flops_per_token=0.0)
        side.kernels = prof.key_averages().table(sort_by="cuda_time_total", row_limit=profile_rows,
                                                 max_name_column_width=100000)
    return side


def print_table(sides: list, flops_per_token: float, peak_flops: float) -> None:
    print(f"{'':<10} {'ms/step':>9} {'tokens/s':>12} {'MFU':>7} {'peak mem':>9} {'ratio':>7}")
    base = sides[-1].ms_per_step
    for s in sides:
        mem = f"{s.peak_gib:.1f} GiB" if s.peak_gib is not None else "n/a"
        print(f"{s.name:<10} {s.ms_per_step:>9.1f} {s.tokens_per_second:>12,.0f} "
              f"{100 * flops_per_token * s.tokens_per_second / peak_flops:>6.1f}% {mem:>9} {s.ms_per_step / base:>6.2f}x")
    print(f"(MFU: {flops_per_token / 1e9:.3f} GFLOP per token, fwd+bwd by torch.utils.flop_counter for both, "
          f"over {peak_flops / 1e12:.0f} TFLOP/s dense bf16; ratio: ms/step over the last row's)")


def official_micro_batch(hp):
    """hp with the official script's GRAD_ACCUM_STEPS when none is set: the micro-batch both sides then run."""
    return hp if hp.grad_accum_steps else dataclasses.replace(hp, grad_accum_steps=trainer_settings.OFFICIAL_GRAD_ACCUM)


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        hp = trainer_settings.Hyperparameters.from_env(log=lambda msg: None)
        hp = official_micro_batch(hp) if args.reference else hp
        hp.resolve_grad_accum(1, not (args.cpu_twin or args.cpu))
        if args.cpu and args.reference:
            raise ValueError("--reference: the reference script needs CUDA; --cpu times the kit alone")
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    if args.cpu_twin:
        from tools.bench.bench_twin import run_twin

        return run_twin(hp, args.out_dir, top=args.profile or 0)
    if not torch.cuda.is_available() and not args.cpu:
        print(f"bench_step: needs a CUDA GPU (torch {torch.__version__} sees none); on a CPU run "
              "`python tools/bench_step.py --cpu-twin`", file=sys.stderr)
        return 2
    if args.reference and not Path(args.reference).is_file():
        print(f"error: --reference {args.reference}: no such file", file=sys.stderr)
        return 2
    config = trainer_model.build_model_config(hp)
    flops = trainer_model.count_train_flops_per_token(config, hp.train_seq_len)
    t0 = time.perf_counter()
    sides = [run_kit(hp, args.steps, args.profile or 0)]
    failed = ""
    if args.reference:
        try:
            sides.append(run_reference(args.reference, hp, args.steps, args.profile or 0))
        except (RuntimeError, ValueError, subprocess.TimeoutExpired) as err:  # the kit's row still prints
            failed = f"bench_step: the reference gave no time: {str(err).splitlines()[0][:300]}"
        except KeyboardInterrupt:
            pass
    where = torch.cuda.get_device_name() if not args.cpu else "CPU (timings say nothing about a GPU)"
    print(f"bench_step: {where}, torch {torch.__version__}, preset {hp.preset}, "
          f"{hp.train_batch_tokens:,} tokens/step, seq {hp.train_seq_len}, {args.steps} steps per side "
          f"({time.perf_counter() - t0:.0f} s)")
    print_table(sides, flops, trainer_loop.H100_BF16_PEAK_FLOPS)
    for s in sides:
        if s.kernels:
            print(f"\n== top CUDA kernels: {s.name} ==\n{s.kernels}")
    if failed:
        print(failed, file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
