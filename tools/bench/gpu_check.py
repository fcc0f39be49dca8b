"""GPU check: prove the trainer's CUDA path on this machine in a few minutes (a pod preflight).

    python tools/gpu_check.py                 # the default preset on synthetic tokens, <= ~5 min on an H100
    DATA_PATH=... python tools/gpu_check.py   # real train shards, and the real val token count
    PRESET=8xh100 python tools/gpu_check.py   # any preset / env override, as for train_gpt.py

Runs the trainer's own code (trainer_loop.train with its compiled model, batched Muon, fused AdamW,
EMA, late QAT, and the eval engine) and prints one table: versions and the attention backend; the
GPU and whether it is an H100 SXM (the leaderboard's machine); compile time, graph breaks and
recompiles; ms per step, tokens/s, MFU and peak memory after warmup; the step-time change when QAT
switches on; CUDA vs CPU forward agreement at bf16 tolerance; QAT fake-quant equal to the export
rounding on the GPU; sliding-eval ms per window and the projected full-val eval time at strides 64,
96 and 128; with `--micro-batches`, the step at half and twice the sequences per micro-batch.

Verdicts: FAIL only for what makes a run wrong or over a limit (a crash, graph breaks, recompiles,
CUDA/CPU mismatch, QAT mismatch, the projected eval over EVAL_MAX_SECONDS at the stride the run
would use); WARN, with the expected cost, for what is only slower (SDPA instead of FA3/FA4, a GPU other
than an H100 SXM, an eval stride raised to fit the clock). Exit 0 (warnings allowed), 1 on a FAIL,
2 (one line, no traceback) without CUDA or on a setting that cannot run.

`--cpu-twin` runs the same checks on the CPU with the CUDA twins of tools/bench/flash_twin.py (flash-attn
stand-in, or with ATTN_BACKEND=fa4 FA4's twin; bf16 autocast with CUDA's float32 rms_norm), at a small shape
(CPU_TWIN_SHAPE; about a minute on 2 cores; shape variables set in the environment win;
tools/bench/cpu_twin_size.py) unless `--preset-size` asks for the preset's own shape, which is refused
(one line) when its estimated memory is more than the machine has available. Its timings say nothing about a GPU.

With DATA_PATH set (or the preset's dataset folder present) the data inputs (shards, tokenizer,
manifest) are checked first, by the trainer's own checks (trainer.checks.check_inputs), before any
model is allocated: a bad shard is one line and exit 2.
"""

import argparse
import contextlib
import dataclasses
import math
import re
import statistics
import sys
import time
from pathlib import Path

GPU_CHECK_STEPS = 20  # timed steps on a GPU, with QAT off, then as many with QAT on
CPU_TWIN_STEPS_HELP = 3  # tools/bench/cpu_twin_size.py CPU_TWIN_STEPS (imports torch); a test keeps them equal


def micro_batch_rows(ctx, hp, loader, num_steps: int, base_ms: float) -> list:
    """`--micro-batches`: the step at half and at twice the default sequences per micro-batch (GRAD_ACCUM_STEPS
    x2 and /2, where the batch splits evenly: Hyperparameters.other_micro_batches), QAT off, compiled as the
    trainer compiles it and timed as the train step row is (the median of its windows); one row each with ms per
    step against base_ms (the default's, QAT off) and peak memory. A smaller micro-batch lowers the peak; a larger
    one can run faster where memory allows (each size compiles its own graph)."""
    is_cuda = ctx.device.type == "cuda"
    default_seqs, rows = hp.micro_batch_seqs(ctx.world_size, is_cuda), []
    window, num_steps = step_windows(num_steps)
    for a, seqs in hp.other_micro_batches(ctx.world_size, is_cuda):
        run = dataclasses.replace(hp, grad_accum_steps=a, iterations=num_steps, max_wallclock_seconds=0.0,
                                  qat_start_frac=0.0, train_log_every=window, val_loss_every=0,
                                  warmup_steps=max(2, hp.warmup_steps), checkpoint_every=0, resume=False)
        ms = statistics.median(window_ms(timed_train(ctx, run, loader)[2], window, num_steps, hp.train_batch_tokens))
        rows.append(Row(f"train step, {seqs} seqs/micro-batch",
                        f"{ms:.1f} ms ({100 * (ms / base_ms - 1):+.1f}% against {default_seqs} seqs; GRAD_ACCUM_STEPS={a}), "
                        f"peak {peak_memory(ctx)}"))
    return rows


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cpu-twin", action="store_true",
                        help="run on the CPU with the CUDA twins, at a small shape (about a minute)")
    parser.add_argument("--preset-size", action="store_true",
                        help="with --cpu-twin: the preset's own shape (refused when it does not fit in memory)")
    parser.add_argument("--steps", type=int, help=f"timed steps with QAT off, then as many with QAT on (default "
                                                  f"{GPU_CHECK_STEPS}; {CPU_TWIN_STEPS_HELP} with --cpu-twin)")
    parser.add_argument("--micro-batches", action="store_true",
                        help="also time the step at half and twice the sequences per micro-batch (~1 min more each)")
    return parser


if __name__ == "__main__":  # --help and usage errors answer before torch is imported
    build_parser().parse_args()

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import model.attention as trainer_attention  # noqa: E402
import trainer.checks as trainer_checks  # noqa: E402
import trainer.context as trainer_context  # noqa: E402
import trainer.sgd_timing as sgd_timing  # noqa: E402
import trainer.ttt_eval as trainer_ttt  # noqa: E402
import shards.loader as trainer_loader  # noqa: E402
import trainer.loop as trainer_loop  # noqa: E402
import model.gpt as trainer_model  # noqa: E402
import primitives.settings as trainer_settings  # noqa: E402
from eval.sliding import count_sliding_windows, eval_sliding  # noqa: E402
from eval.ttt_plan import lora_work_at, plan_ttt_eval  # noqa: E402
from eval.ttt_modes import TTT_MODES  # noqa: E402
from shards.format import load_validation_tokens  # noqa: E402
from model.fused_loss import resolve_loss_kernel  # noqa: E402
from primitives.rowquant import dequantize_per_row, fake_quantize_per_row, quantize_per_row  # noqa: E402
from quant.policy import QuantPolicy  # noqa: E402
from tools.bench.bench_eval import VAL_TOKENS_BY_VOCAB  # noqa: E402  (val split tokens per vocabulary)
from tools.bench.cpu_twin_size import CPU_TWIN_STEPS, cpu_twin_settings, data_given  # noqa: E402

FINEWEB_VAL_DOCS = 50_000  # the challenge's val split: the first 50,000 FineWeb documents (design facts)
H100_SXM_SMS = 132  # H100 SXM5 has 132 SMs; the PCIe card 114 (NVIDIA H100 datasheet)



class SyntheticLoader:
    """Random train tokens on the device, with the DistributedTokenLoader interface train() uses."""

    def __init__(self, vocab_size, device, seed=0):
        self.vocab_size, self.device = vocab_size, device
        self.generator = torch.Generator(device=device).manual_seed(seed)
        self.shard_index, self.offset = 0, 0

    def seek(self, shard_index, offset):
        self.shard_index, self.offset = shard_index, offset

    def next_batch(self, local_tokens, seq_len):
        x = torch.randint(0, self.vocab_size, (local_tokens // seq_len, seq_len + 1), device=self.device,
                          generator=self.generator)
        return x[:, :-1], x[:, 1:]


class GraphCountingLoader:
    """Wraps a loader; records, at every batch, how many graphs dynamo has compiled so far, so the graphs
    compiled after the first step (recompiles) can be counted."""

    def __init__(self, inner):
        self.inner, self.graphs_seen = inner, []

    def __getattr__(self, name):  # shard_index, offset, seek: the inner loader's
        return getattr(self.inner, name)

    def next_batch(self, local_tokens, seq_len):
        from torch._dynamo.utils import counters

        self.graphs_seen.append(counters["stats"]["unique_graphs"])
        return self.inner.next_batch(local_tokens, seq_len)


# Measured on one H100 SXM, torch 2.11 (the kit's run of 2026-11-25): attention fwd+bwd at the default
# preset's shape per SDPA backend, ms. The kit's step at the default preset on cuDNN SDPA and with FA4 (one
# gpu_report call, 2026-11-27); PR #1617's log: 326 ms with FA3 on torch 2.9.1.
SDPA_MEASURED_MS = {"cudnn_attention": 1.75, "flash_attention": 2.62, "efficient_attention": 5.23}
SDPA_STEP_MS, FA4_STEP_MS, FA3_STEP_MS = 307.2, 299.0, 326
H100_PCIE = dict(sms=114, hbm_tb_s=2.0)  # vs SXM5: 132 SMs, 3.35 TB/s (NVIDIA H100 datasheet)


@dataclasses.dataclass
class Row:
    check: str
    value: str
    ok: bool = True  # False: FAIL (the run would be wrong or over a limit)
    warn: str = ""  # set: WARN with this expected cost (only slower)

    @property
    def verdict(self) -> str:
        return "FAIL" if not self.ok else "WARN" if self.warn else "ok"


def backend_row(device_type: str, backend: str, sdpa_kernel: str = "") -> Row:
    """The attention row: FA3/FA4/FA2 (or a CPU twin of them) and the CPU are ok; SDPA on CUDA is a WARN (slower,
    never wrong), its cost stated from the H100 measurements. sdpa_kernel: the SDPA backend torch picks (sdpa_choice)."""
    if device_type != "cuda" or backend != "sdpa":
        return Row("attention backend", backend)
    ms = SDPA_MEASURED_MS.get(sdpa_kernel)
    cost = (f"expected cost: the kit's step at this preset took {SDPA_STEP_MS:.0f} ms on cuDNN SDPA against "
            f"{FA4_STEP_MS:.0f} with FA4 (one H100, 32 sequences per micro-batch, measured)")
    if ms and sdpa_kernel != "cudnn_attention":
        cost += f"; {sdpa_kernel} is {ms / SDPA_MEASURED_MS['cudnn_attention']:.1f}x cuDNN's attention time"
    return Row("attention backend", f"sdpa ({sdpa_kernel or 'kernel unknown'}), flash-attn not importable",
               warn=cost + "; install FA3 or FA4: requirements-gpu.txt")


def flash_versions() -> str:
    """The flash-attn packages that import, with their versions ("not importable" when none). FA4's wheel makes
    `flash_attn` a namespace package: it counts as FA2 only with FA2's flash_attn_func."""
    import importlib
    import importlib.metadata

    found = []
    for module, name, dist in (("flash_attn_interface", "flash_attn_func", "flash_attn_3"),
                               ("flash_attn", "flash_attn_func", "flash-attn"),
                               ("flash_attn.cute.interface", "_flash_attn_fwd", "flash-attn-4")):
        with contextlib.suppress(Exception):
            getattr(importlib.import_module(module), name)
            version = "(version unknown)"
            with contextlib.suppress(Exception):
                version = importlib.metadata.version(dist)
            found.append(f"{dist} {version}")
    return ", ".join(found) or "not importable"


def gpu_row(name: str, num_sms: int, memory_gib: float) -> Row:
    """ok on an H100 SXM (the leaderboard's machine); WARN on anything else (timings differ, nothing breaks)."""
    value = f"{name}, {num_sms} SMs, {memory_gib:.0f} GiB"
    if "H100" in name and num_sms == H100_SXM_SMS:
        return Row("GPU", value + ", H100 SXM")
    cost = "NOT an H100 SXM: step and eval times differ from the leaderboard's"
    if "H100" in name and num_sms == H100_PCIE["sms"]:
        cost = (f"H100 PCIe: {H100_PCIE['sms']}/{H100_SXM_SMS} SMs and {H100_PCIE['hbm_tb_s']}/3.35 TB/s HBM (datasheet): "
                "expect slower steps (fewer steps in 600 s) and a slower eval than an SXM card")
    return Row("GPU", value, warn=cost)


def eval_projection_row(seconds_per_window: float, num_val_tokens: int, seq_len: int, eval_stride: int,
                        eval_max_seconds: float, auto_stride: bool, enforce: bool = True) -> Row:
    """Projected full-val eval (roundtrip + sliding) at strides 64/96/128 and at the stride the run would use.

    Seconds = seconds_per_window x (roundtrip windows + sliding windows at stride s) over num_val_tokens - 1
    targets. The run uses EVAL_STRIDE, or with EVAL_AUTO_STRIDE the smallest stride >= EVAL_STRIDE whose
    projection fits 90% of EVAL_MAX_SECONDS (trainer.evaluate.plan_eval_stride). FAIL if that projection is over
    EVAL_MAX_SECONDS (the eval limit); WARN if the stride had to grow (a slightly worse score, not a wrong one).
    enforce=False (the CPU twin, whose timings say nothing about a GPU): no verdict.
    """
    targets = num_val_tokens - 1

    def project(s):
        windows = count_sliding_windows(targets, seq_len, seq_len) + count_sliding_windows(targets, seq_len, s)
        return seconds_per_window * windows

    stride = eval_stride
    if auto_stride:
        stride = next((s for s in range(eval_stride, seq_len) if project(s) <= 0.9 * eval_max_seconds), seq_len)
    used = project(stride)
    value = (", ".join(f"stride {s}: {project(s):.0f} s" for s in (64, 96, 128))
             + f"; run's stride {stride}: {used:.0f} s ({targets + 1:,} val tokens, incl. roundtrip; "
             f"EVAL_MAX_SECONDS={eval_max_seconds:g})")
    warn = f"stride raised from EVAL_STRIDE={eval_stride} to {stride} to fit the clock" if stride != eval_stride else ""
    if not enforce:
        return Row("projected full-val eval", value + " (CPU twin: no verdict)")
    return Row("projected full-val eval", value, ok=used <= eval_max_seconds, warn=warn)


def versions_and_device(device, backend, sdpa_kernel="") -> list:
    rows = [Row("torch / CUDA", f"{torch.__version__} / {torch.version.cuda or 'none'}")]
    rows.append(Row("flash-attn", flash_versions()))
    rows.append(backend_row(device.type, backend, sdpa_kernel))
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        rows.append(gpu_row(props.name, props.multi_processor_count, props.total_memory / 2**30))
    else:
        rows.append(Row("GPU", f"none: CPU twin ({backend}, bf16 autocast, fp32 rms_norm)"))
    return rows


def timed_train(ctx, hp, loader) -> tuple:
    """trainer_loop.train() of a fresh model as the trainer builds it, its log captured:
    (model, result, log lines, seconds in all, FLOPs per token)."""
    from torch._dynamo.utils import counters

    config = trainer_model.build_model_config(hp)
    torch.manual_seed(hp.seed)
    model = trainer_model.GPT(**config).to(ctx.device)
    model.init_weights(hp.tied_embed_init_std)
    model.configure_qat(QuantPolicy.from_env())
    flops = trainer_model.count_train_flops_per_token(config, hp.train_seq_len)
    lines, log = [], ctx.log
    ctx.log = lambda msg="", console=True: lines.append(msg)
    torch._dynamo.reset()
    counters.clear()
    if ctx.device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(ctx.device)
    t0 = time.perf_counter()
    try:
        result = trainer_loop.train(ctx, hp, model, loader, flops_per_token=flops)
    finally:
        ctx.log = log
    return model, result, lines, time.perf_counter() - t0, flops


def step_tokens_per_second(lines: list, *steps: int) -> list:
    """tok/s of the trainer's `step:N/...` log lines at the given steps, in log order."""
    wanted = "|".join(map(str, steps))
    return [float(m.group(1)) for line in lines if (m := re.search(r" tok_s:(\d+)", line))
            and re.match(rf"step:({wanted})/", line)]


def step_windows(num_steps: int) -> tuple:
    """(window, steps): the timed steps logged in windows of a quarter of them, rounded up to whole windows."""
    window = max(1, num_steps // 4)
    return window, window * math.ceil(num_steps / window)


def window_ms(lines: list, window: int, num_steps: int, batch_tokens: int) -> list:
    """ms per step of each `window`-step window of a num_steps run logged every `window` steps, in order."""
    return [1000 * batch_tokens / t for t in step_tokens_per_second(lines, *range(window, num_steps + 1, window))]


def windowed_step_ms(lines: list, window: int, num_steps: int, batch_tokens: int) -> tuple:
    """(ms per step with QAT off, with QAT on, a note) from a 2 x num_steps run logged every `window` steps: each
    state's median over its windows. The note names the first window after the warmup (steps 2..window) when it
    is over 3 % slower than the QAT-off median: a transient the median leaves out (325 ms against 300-303 later
    on one H100, 2026-11-27), '' otherwise."""
    ms = window_ms(lines, window, 2 * num_steps, batch_tokens)
    ms_off, ms_on = statistics.median(ms[:len(ms) // 2]), statistics.median(ms[len(ms) // 2:])
    slow = window > 1 and ms[0] > 1.03 * ms_off
    return ms_off, ms_on, f"; the first {window - 1} steps after warmup {ms[0]:.1f} ms" if slow else ""


def peak_memory(ctx) -> str:
    return (f"{torch.cuda.max_memory_allocated(ctx.device) / 2**30:.1f} GiB" if ctx.device.type == "cuda"
            else "n/a on the CPU")


def training_rows(ctx, hp, loader, num_steps) -> tuple:
    """train() for warmup + 2 x num_steps steps, QAT on for the second half; returns (rows, model, ms per step
    with QAT off)."""
    from torch._dynamo.utils import counters

    # at least two warmup steps: the QAT-on graph compiles in warmup, not inside the QAT-on timing
    window, num_steps = step_windows(num_steps)  # the log's tok/s per window: a median, the first window apart
    hp = dataclasses.replace(hp, iterations=2 * num_steps, max_wallclock_seconds=0.0, qat_start_frac=0.5,
                             train_log_every=window, val_loss_every=0, warmup_steps=max(2, hp.warmup_steps),
                             checkpoint_every=0, resume=False)
    model, result, lines, total_seconds, flops = timed_train(ctx, hp, loader)
    steps, train_seconds, losses = result.steps, result.train_seconds, result.train_losses
    ms_off, ms_on, first = windowed_step_ms(lines, window, num_steps, hp.train_batch_tokens)
    tok_s = [1000 * hp.train_batch_tokens / ms_off]
    accum = hp.resolve_grad_accum(ctx.world_size, ctx.device.type == "cuda")
    # graphs once step 1 of warmup has run, and once warmup is over: after step 1 the run compiles exactly one
    # graph per state it will pass through (QAT on; looped), all in warmup (trainer.schedule.warmup_graph_states)
    after_first, after_warmup = loader.graphs_seen[accum], loader.graphs_seen[accum * hp.warmup_steps]
    graphs = counters["stats"]["unique_graphs"]
    states = (["QAT on"] * model.has_qat + ["looped"] * bool(hp.num_loops)) if ctx.compile else []
    breaks = sum(counters["graph_break"].values())
    peak = peak_memory(ctx)
    rows = [
        Row("compile + warmup", f"{total_seconds - train_seconds:.1f} s ({hp.warmup_steps} warmup steps, compile "
            f"{'on' if ctx.compile else 'off'})"),
        Row("graph breaks", str(breaks), ok=breaks == 0),
        Row("recompiles after step 1", f"{graphs - after_first} (expected {len(states)}: one per graph state "
            f"{', '.join(states) or 'none' if ctx.compile else '(compile off)'}, compiled in warmup; "
            f"{graphs - after_warmup} after warmup; QAT on "
            f"from step {num_steps}; {graphs} graphs in all)",
            ok=graphs - after_first == len(states) and graphs == after_warmup),
        Row("train step", f"{ms_off:.1f} ms, {tok_s[0]:,.0f} tok/s, "
                          f"MFU {100 * flops * tok_s[0] / trainer_loop.H100_BF16_PEAK_FLOPS:.1f}% "
            f"of H100 bf16 ({hp.preset}, {hp.train_batch_tokens:,} tok/step, accum {accum}; median of "
            f"{window}-step windows{first})"),
        Row("train step, QAT on", f"{ms_on:.1f} ms ({100 * (ms_on / ms_off - 1):+.1f}%)"),
        Row("losses finite", f"{losses[0]:.3f} -> {losses[-1]:.3f} over {steps} steps",
            ok=all(math.isfinite(v) for v in losses)),
        Row("peak memory", peak),
    ]
    return rows, model, ms_off


def agreement_rows(ctx, model, hp) -> list:
    """The trained model's forward on this device (autocast, chosen attention) vs float32 SDPA on the CPU;
    QAT fake-quant on this device vs the export rounding."""
    model.eval()
    x = torch.randint(0, hp.vocab_size, (1, hp.train_seq_len), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        with ctx.autocast():
            dev_loss = model(x.to(ctx.device), x.to(ctx.device)).float().item()
        saved = trainer_attention._FLASH_ATTN[:]
        trainer_attention._FLASH_ATTN.clear()
        try:
            ref = trainer_model.GPT(**trainer_model.build_model_config(hp))
            ref.load_state_dict({k: v.float().cpu() for k, v in model.state_dict().items()})
            cpu_loss = ref.eval()(x, x).item()
        finally:
            trainer_attention._FLASH_ATTN[:] = saved
    rel = abs(dev_loss - cpu_loss) / abs(cpu_loss)
    rows = [Row("forward vs CPU fp32", f"loss {dev_loss:.5f} vs {cpu_loss:.5f} (rel {rel:.1e}, bf16 tolerance 1e-2)",
                ok=rel < 1e-2)]
    name, w = next((n, p.detach()) for n, p in model.named_parameters() if n.endswith("mlp.fc.weight"))
    bits = model.get_submodule(name.rsplit(".", 1)[0]).qat_bits  # what configure_qat chose (unset groups: int8)
    export = dequantize_per_row(*quantize_per_row(w.float().cpu(), bits))
    eager = fake_quantize_per_row(w.float(), bits).cpu()
    rows.append(Row("QAT fake-quant == export", f"int{bits} {list(w.shape)} eager on {ctx.device.type}: max |diff| "
                    f"{(eager - export).abs().max():.1e}", ok=torch.equal(eager, export)))
    if ctx.compile:  # Triton may contract a multiply-add into an FMA: a rare value 1 ulp off is tolerated
        compiled = torch.compile(fake_quantize_per_row, dynamic=False)(w.float(), bits).cpu()
        moved = (compiled != export).float().mean().item()
        rows.append(Row("QAT fake-quant compiled", f"{100 * moved:.4f}% of values differ from export (limit 0.01%)",
                        ok=moved < 1e-4))
    model.train()
    return rows


# per row `timing` (eval/ttt_modes.py TTTMode.timing, trainer.ttt_eval.plan_timings): whether the
# projection needs batched LoRA timings (trainer.ttt_eval.time_lora_ttt) and the val split's documents
TTT_TIMED = dict(sgd=False, lora=True)


def timed_as_lora(hp) -> bool:
    """Whether TTT_MODE's row is planned from a LoRA scoring forward and adapter step (TTT_TIMED), not an SGD step."""
    return TTT_TIMED[TTT_MODES[hp.ttt_mode].timing]


def ttt_projection_row(seconds_per_window: float, step_seconds: float, num_val_tokens: int, hp,
                       world_size: int = 1, enforce: bool = True, lora_timings: tuple = None, lora_work=None) -> Row:
    """Projected full-val legal TTT eval of TTT_MODE as the trainer plans it (eval.ttt_plan.plan_ttt_eval, the
    EvalPlan the run would use): the settings as asked (TTT_EPOCHS, TTT_PHASES at EVAL_STRIDE) and what the plan
    keeps. seconds_per_window from the sliding eval; step_seconds: one SGD TTT update (trainer.sgd_timing.time_ttt_step);
    a mode timed as LoRA (its row's `timing`): lora_timings (scoring forward, batched adapter step:
    trainer.ttt_eval.time_lora_ttt) and lora_work (eval.ttt_plan.lora_work_at: the val split's schedule, counted or
    assumed; without timings: "not projected", a WARN "unverified" with TTT_ENABLED). With TTT_ENABLED, WARN when
    the plan cuts epochs or phases, coarsens the stride or skips TTT; without it, information only."""
    lora = timed_as_lora(hp)
    if lora and not lora_timings:  # no timings given: nothing to project
        return Row("projected TTT eval", f"TTT_MODE={hp.ttt_mode}: not projected by this check",
                   warn="unverified" * hp.ttt_enabled)
    timings = dict(forward_seconds=seconds_per_window * hp.eval_batch_seqs, step_seconds=step_seconds,
                   **(dict(lora=lora_timings, work_at=lora_work) if lora else {}))
    plan = plan_ttt_eval(hp, timings, num_val_tokens, world_size)
    if lora:
        forward_s, step_s = lora_timings
        work = lora_work(hp.eval_stride)
        docs = (f"{work['documents']:,} documents counted from the val data" if work["counted"] else
                f"{work['documents']:,} documents assumed (no DATA_PATH: the challenge's val split)")
        timed = (f"{1000 * forward_s:.1f} ms per scoring forward, {1000 * step_s:.1f} ms per batched adapter step; "
                 f"TTT_MODE={hp.ttt_mode}, {docs}, {work['rounds']:,} rounds of TTT_LORA_BATCH_DOCS="
                 f"{hp.ttt_lora_batch_docs} ({work['forwards']:,} forwards), ")
    else:
        timed = f"{1000 * step_seconds:.1f} ms per TTT step; " + (
            f"TTT_MODE={hp.ttt_mode}, TTT_PHASES={hp.ttt_phases}, " if plan.phases else "")
    kept = (f"stride {plan.stride}, {plan.epochs} epochs" + f", {plan.phases} phases" * bool(plan.phases) + ", "
            + (f"{plan.projected_seconds:.0f} s" if plan.epochs or not lora else "the sliding pass"))
    value = (f"{timed}TTT_EPOCHS={hp.ttt_epochs} at stride {hp.eval_stride}: {plan.wanted_seconds:.0f} s incl. "
             f"roundtrip; plan: {kept} (EVAL_MAX_SECONDS={hp.eval_max_seconds:g})")
    cut = (plan.epochs != hp.ttt_epochs or plan.stride != hp.eval_stride
           or (plan.phases and plan.phases != hp.ttt_phases))
    return ttt_row(value, hp, enforce, (plan.reason or "stride raised to fit the clock") if cut else "")


def ttt_row(value: str, hp, enforce: bool, warn: str) -> Row:
    """The "projected TTT eval" row: no verdict on a CPU twin, information without TTT_ENABLED, else `warn`
    (what the plan cut; "" when it keeps the settings)."""
    if not enforce:
        return Row("projected TTT eval", value + " (CPU twin: no verdict)")
    if not hp.ttt_enabled:
        return Row("projected TTT eval", value + " (TTT_ENABLED=0: information)")
    return Row("projected TTT eval", value, warn=warn)


def eval_rows(ctx, model, hp, num_val_tokens, val_tokens=None) -> list:
    """Sliding eval speed on synthetic tokens (the trainer's engine, compile and autocast), projected to the
    full val split: (roundtrip windows + sliding windows at stride s) x seconds per window. val_tokens (int64,
    the val split; None: none given): TTT_MODE=lora's documents, else FINEWEB_VAL_DOCS assumed."""
    from torch._dynamo.utils import counters

    model.eval()
    b, seq_len = hp.eval_batch_seqs, hp.train_seq_len
    n = seq_len + 8 * b * 64  # 8 batches of windows at stride 64 after the first window
    tokens = torch.randint(0, hp.vocab_size, (n + 1,), generator=torch.Generator().manual_seed(2))
    luts = (torch.ones(hp.vocab_size, dtype=torch.int16), torch.zeros(hp.vocab_size, dtype=torch.bool),
            torch.zeros(hp.vocab_size, dtype=torch.bool))
    common = dict(seq_len=seq_len, batch_seqs=b, device=ctx.device, autocast_dtype=ctx.autocast_dtype,
                  compile_model=ctx.compile, log=lambda msg: None)
    eval_sliding(model, tokens, luts, stride=64, **common)  # compile and warm
    graphs = counters["stats"]["unique_graphs"]
    result = eval_sliding(model, tokens, luts, stride=64, **common)
    recompiles = counters["stats"]["unique_graphs"] - graphs  # before the TTT step, which compiles its own graph
    per_window = result["eval_seconds"] / count_sliding_windows(n, seq_len, 64)
    step = sgd_timing.time_ttt_step(ctx, model, hp)  # last: its SGD steps (lr 1e-9) touch the weights
    lora = trainer_ttt.time_lora_ttt(ctx, model, hp) if timed_as_lora(hp) else None
    model.train()
    return [Row("eval recompiles", str(recompiles), ok=recompiles == 0),
            Row("sliding eval", f"{1000 * per_window:.2f} ms per window of {seq_len} (batch {b})"),
            eval_projection_row(per_window, num_val_tokens, seq_len, hp.eval_stride, hp.eval_max_seconds,
                                hp.eval_auto_stride, enforce=ctx.device.type == "cuda"),
            ttt_projection_row(per_window, step, num_val_tokens, hp, enforce=ctx.device.type == "cuda",
                               lora_timings=lora, lora_work=lora and lora_work_at(
                                   hp, num_val_tokens, 1, val_tokens, FINEWEB_VAL_DOCS))]


def print_table(rows) -> None:
    width = max(len(r.check) for r in rows)
    for r in rows:
        print(f"{r.verdict.replace('ok', 'ok '):<4} {r.check:<{width}}  {r.value}")
        if r.warn:
            print(f"{'':<5}{'':<{width}}  -> {r.warn}")


def sdpa_kernel_for(hp, device) -> str:
    """The SDPA backend torch picks for one layer's attention at this preset's training shape ('' off CUDA)."""
    if device.type != "cuda":
        return ""
    hd, b = hp.model_dim // hp.num_heads, hp.micro_batch_seqs(1, True)
    q = torch.zeros(b, hp.train_seq_len, hp.num_heads, hd, device=device, dtype=torch.bfloat16)
    k = torch.zeros(b, hp.train_seq_len, hp.num_kv_heads, hd, device=device, dtype=torch.bfloat16)
    with contextlib.suppress(RuntimeError, AttributeError):
        return trainer_attention.sdpa_choice(q, k, k)
    return ""


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    if args.steps is None:
        args.steps = CPU_TWIN_STEPS if args.cpu_twin else GPU_CHECK_STEPS
    if not torch.cuda.is_available() and not args.cpu_twin:
        print(f"gpu_check: needs a CUDA GPU (torch {torch.__version__} sees none); on a CPU, the same checks at a "
              "small shape (about a minute): `python tools/gpu_check.py --cpu-twin`", file=sys.stderr)
        return 2
    try:
        if args.steps < 1:
            raise ValueError(f"--steps={args.steps}: expected an integer >= 1")
        if args.preset_size and not args.cpu_twin:
            raise ValueError("--preset-size: only with --cpu-twin (on a GPU the preset's shape is the default)")
        hp = (cpu_twin_settings(args.preset_size) if args.cpu_twin else trainer_settings.Hyperparameters.from_env())
        hp.resolve_grad_accum(1, torch.cuda.is_available() and not args.cpu_twin)  # a batch that cannot split: exit 2
        if args.cpu_twin:
            hp = dataclasses.replace(hp, autocast="bf16")
        ctx = trainer_context.setup_distributed(hp)
        # the data inputs, by the trainer's own checks, before anything is allocated
        num_val = trainer_checks.check_inputs(hp, ctx)[2] if data_given(hp) else None
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    twin = contextlib.ExitStack()
    if args.cpu_twin:  # ATTN_BACKEND=fa4: the FA4 custom ops' CPU twin; otherwise the FA3/FA2 stand-in
        from tools.bench.flash_twin import cuda_autocast_rms_norm, plugged_fa4_twin, plugged_flash_standin

        fa4_twin = hp.attn_backend == "fa4"
        twin.enter_context(plugged_fa4_twin() if fa4_twin else plugged_flash_standin())
        twin.enter_context(cuda_autocast_rms_norm())
        backend = "fa4 twin" if fa4_twin else "flash stand-in"
    else:
        try:  # ATTN_BACKEND=fa3/fa4/fa2 that cannot run here: one line, exit 2
            backend = trainer_attention.resolve_attention_backend(hp.attn_backend, ctx.device, print,
                                                                  hp.model_dim // hp.num_heads)
            resolve_loss_kernel(hp.loss_kernel, ctx.device, print)  # the trainer's loss kernel (prints loss:...)
        except ValueError as err:
            print(f"error: {err}", file=sys.stderr)
            return 2
    with twin:
        rows = versions_and_device(ctx.device, backend, sdpa_kernel_for(hp, ctx.device) if backend == "sdpa" else "")
        if args.cpu_twin:
            rows.append(Row("CPU twin shape", f"{hp.num_layers}x{hp.model_dim}, seq {hp.train_seq_len}, "
                            f"{hp.train_batch_tokens:,} tok/step, vocab {hp.vocab_size} ("
                            f"{'the preset' if args.preset_size else 'small; --preset-size for the preset'}'s)"))
        if num_val is not None:
            loader = trainer_loader.DistributedTokenLoader(hp.data_path, hp.vocab_size, device=ctx.device)
        else:
            loader = SyntheticLoader(hp.vocab_size, ctx.device)
            num_val = VAL_TOKENS_BY_VOCAB.get(hp.vocab_size, VAL_TOKENS_BY_VOCAB[1024])
        train_rows, model, step_ms = training_rows(ctx, hp, GraphCountingLoader(loader), args.steps)
        val = None
        if timed_as_lora(hp) and data_given(hp):  # the documents of the val split the eval scores
            val = load_validation_tokens(hp.data_path, vocab_size=hp.vocab_size)
        rows += train_rows + agreement_rows(ctx, model, hp) + eval_rows(ctx, model, hp, num_val, val)
        if args.micro_batches:
            rows += micro_batch_rows(ctx, hp, loader, args.steps, step_ms)
    print_table(rows)
    failed, warned = [r.check for r in rows if not r.ok], [r.check for r in rows if r.ok and r.warn]
    tail = f" ({len(warned)} warning{'s' * (len(warned) != 1)}: {', '.join(warned)})" if warned else ""
    print(f"gpu_check: {'FAILED: ' + ', '.join(failed) if failed else 'all checks passed'}{tail}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
