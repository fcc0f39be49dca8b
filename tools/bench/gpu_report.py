"""GPU report: everything the kit measures on one GPU, in one call and one table (a pod's first command).

    python tools/gpu_report.py                      # all sections that fit in --budget-s (default 480 s)
    python tools/gpu_report.py --reference PATH     # + the official train_gpt.py beside the kit at its shape
    python tools/gpu_report.py --compare ../kit-old          # + another checkout's step, same machine and settings
    python tools/gpu_report.py --record PATH/pr1855/train_gpt.py  # + PR #1855's script beside PRESET=8xh100-pr1855
    python tools/gpu_report.py --sections step,gpu_check --out report.md
    python tools/gpu_report.py --cpu-twin           # no GPU: the same plan through the CPU twins (plumbing only)

Sections (each one or more child processes with their own time limit and process group, so one that
fails or hangs costs its row, never the report). They run essentials first: kernels, the step with the
default kernels and with plain SDPA, baseline, pytest and the preset's gpu_check; then each optional kernel
alone, --compare, microbatch and the frontier preset's gpu_check, as far as --budget-s allows:
  kernels    attention fwd+bwd at the preset's shape on every backend this machine has (SDPA cuDNN /
             flash / efficient, FA3, FA4 through the kit's dispatch) and the loss on each kernel
             (tools/bench/kernel_bench.py)
  step       the preset's compiled training step (tools/bench_step.py): ms/step, tokens/s, MFU and peak
             memory for the default kernels (ATTN_BACKEND=auto, LOSS_KERNEL=auto), plain SDPA + torch loss,
             and each optional kernel alone (where installed; none that would repeat the default's)
  baseline   the kit at the official baseline's shape (9L d512 MLP2 seq1024), and with --reference the
             official script itself on the same data (needs DATA_PATH / TOKENIZER_PATH of that vocabulary)
  pytest     `python -m pytest -m gpu` (the CUDA kernels against their references)
  gpu_check  tools/gpu_check.py's rows (compile, recompiles, CUDA vs CPU, QAT, eval projections) for the
             preset, and last the same for the 1xh100-frontier candidate (its eval projection)
  microbatch the step at half and twice the preset's sequences per micro-batch (GRAD_ACCUM_STEPS 8 and 2 at
             the default preset, 32 and 128 sequences; step gives 64)
  record     with --record: the kit at PRESET=8xh100-pr1855 beside PR #1855's own train_gpt.py on one GPU, the
             same shape, data (the preset's CaseOps DATA_PATH / TOKENIZER_PATH) and steps (tools/bench_step.py
             --reference). The record imports FlashAttention-3, which no PyPI wheel provides: where FA3 is not
             installed, its `flash_attn_interface` is FA2's functions (FA3_SHIM), so its ms/step is FA2's,
             not its FA3 timing; without FA2 either, the row reports no time
Before the timed sections, `--precompile N` (default 4 on a GPU) runs the essential step configurations
of the kit (default kernels, SDPA, the baseline shape; never the reference script) once with two steps,
N at a time, for at most half the budget, so the Inductor caches are warm and those timed children
compile in seconds; an optional row compiles in its own time. On one H100 (2026-11-26/27 timings) the essentials
take ~8-9 minutes and every section ~14: `--budget-s 900` runs them all.
The compile rows are therefore not compile times: gpu_check's first-compile figure is warm too.

The report is written row by row to --out (markdown) and printed at the end: a run cut short keeps
what it measured. Each row says its source command. `--cpu-twin` runs every section on the CPU at a
tiny shape (the FA4 and fused-loss twins, the trainer on the CPU, gpu_check --cpu-twin): its timings
say nothing about a GPU. Exit 0 when every run section gave its rows, 1 when one failed, 2 on bad input.
"""

import argparse
import dataclasses
import os
import re
import shlex
import signal
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SECTIONS = ("kernels", "step", "baseline", "pytest", "gpu_check", "microbatch", "record")
# --record where FlashAttention-3 is missing: a folder put first on the record's PYTHONPATH holding this module as
# `flash_attn_interface`: FA2's functions under FA3's name (PR #1855 calls them as FA2 takes them and uses the output
# alone, which FA2 returns); a timing through it is FA2's kernels, not the record's FA3
FA3_SHIM = Path(tempfile.gettempdir()) / "gpu_report_fa3_shim"
FA3_SHIM_SOURCE = "from flash_attn import flash_attn_func, flash_attn_varlen_func  # noqa: F401 (FA2 as FA3)\n"
BASELINE_SHAPE = {"NUM_LAYERS": "9", "MLP_MULT": "2", "TRAIN_SEQ_LEN": "1024", "XSA_LAST_N": "0", "ROPE_DIMS": "64",
                  "QK_GAIN_INIT": "1.5", "QAT_START_FRAC": "0", "GRAD_ACCUM_STEPS": "8"}  # the official script's model
# and micro-batch (README: One H100), with or without --reference
CPU_TWIN_SHAPE = {"NUM_LAYERS": "2", "MODEL_DIM": "128", "NUM_HEADS": "4", "NUM_KV_HEADS": "2", "VOCAB_SIZE": "1024",
                  "TRAIN_SEQ_LEN": "64", "TRAIN_BATCH_TOKENS": "512", "XSA_LAST_N": "1", "COMPILE": "0"}
TIMED_STEPS = 12  # the step is flat after the first steps (../README: H100 logs); 12 keep each child short
WARMUP_STEPS = "5"  # compile/prime steps before timing (the trainer's default 20 only matters for a full run)


def build_parser() -> argparse.ArgumentParser:
    """The command line, built without torch: `--help` and usage errors answer at once."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sections", default=",".join(SECTIONS), help=f"comma list of {', '.join(SECTIONS)} (default all)")
    p.add_argument("--budget-s", type=float, default=480.0, help="wall-clock seconds for the whole report (default 480)")
    p.add_argument("--reference", metavar="PATH", help="the official train_gpt.py to time beside the kit (baseline)")
    p.add_argument("--record", metavar="PATH", help="PR #1855's train_gpt.py to time beside PRESET=8xh100-pr1855 (record)")
    p.add_argument("--compare", metavar="DIR", help="another checkout of the kit (e.g. `git worktree add DIR <commit>`) "
                   "whose default step is timed beside this one's, same settings, same machine (step)")
    p.add_argument("--precompile", type=int, metavar="N", help="warm the compile caches N configurations at a time "
                   "before timing (default 4 on a GPU, 0 with --cpu-twin)")
    p.add_argument("--out", default="gpu_report.md", help="the markdown report, written row by row")
    p.add_argument("--cpu-twin", action="store_true", help="no GPU: every section through the CPU twins")
    return p


@dataclasses.dataclass
class Job:
    """One child process of a section: its command, environment overrides, time limit and row parser."""

    section: str
    label: str
    argv: list
    env: dict
    timeout_s: float
    parse: object  # (job, stdout + stderr, returncode) -> list of rows (section, configuration, result, note)
    precompile_argv: list = None  # the same configuration, compile + two steps (step jobs only)
    cwd: Path = REPO  # the checkout the child runs in (--compare: another one)

    @property
    def command(self) -> str:
        env = " ".join(f"{k}={shlex.quote(v)}" for k, v in sorted(self.env.items()))
        return f"{env} {shlex.join(self.argv)}".strip()


BENCH_ROW = re.compile(r"^(kit|reference)\s+([\d.]+)\s+([\d,]+)\s+([\d.]+)%\s+(n/a|[\d.]+ GiB)\s+([\d.]+)x\s*$", re.M)
CHECK_ROW = re.compile(r"^(ok|WARN|FAIL)\s+(.+?)\s{2,}(.+)$", re.M)
KERNEL_ROW = re.compile(r"^ROW\t([^\t\n]*)\t([^\t\n]*)\t([^\t\n]*)$", re.M)
PYTEST_TAIL = re.compile(r"^=*\s*(.*\b(?:passed|failed|skipped|deselected|error)\b.*?)\s*=*$", re.M)


def failure_note(text: str, returncode) -> str:
    """One line for a child that gave no rows: its exit and the last meaningful line of its output."""
    lines = [ln.strip() for ln in text.strip().splitlines() if ln.strip()]
    last = next((ln for ln in reversed(lines) if "Error" in ln or ln.startswith("error")), lines[-1] if lines else "")
    code = "timed out" if returncode is None else f"exit {returncode}"
    return f"{code}: {last[:200]}"


def parse_bench(job, text, returncode):
    rows = []
    for name, ms, tok_s, mfu, mem, _ratio in BENCH_ROW.findall(text):
        who = "official script" if name == "reference" else "kit"
        rows.append((job.section, f"{job.label}, {who}", f"{float(ms):.1f} ms/step",
                     f"{tok_s} tok/s, MFU {mfu}%, peak {mem}"))
    ref_failed = re.search(r"^bench_step: the reference gave no time: (.*)$", text, re.M)
    if ref_failed:
        rows.append((job.section, f"{job.label}, official script", "no result", ref_failed.group(1)))
    backend = re.search(r"^(attention:\S+|loss:\S+)", text, re.M)
    if rows and backend:
        kernels = sorted(set(re.findall(r"^(attention:[a-z0-9]+|loss:[a-z0-9]+)", text, re.M)))
        rows[0] = rows[0][:3] + (rows[0][3] + "; " + ", ".join(kernels),)
    return rows


def parse_check(job, text, returncode):
    return [(job.section, f"{job.label}: {check.strip()}", value.strip(), verdict)
            for verdict, check, value in CHECK_ROW.findall(text)]


def parse_kernels(job, text, returncode):
    return [(job.section, config, result, note) for config, result, note in KERNEL_ROW.findall(text)]


def parse_pytest(job, text, returncode):
    tails = PYTEST_TAIL.findall(text)
    failed = re.findall(r"^FAILED (\S+)", text, re.M)
    slowest = [f"{name.rpartition('::')[2]} {float(seconds):.0f} s"
               for seconds, name in re.findall(r"^([\d.]+)s call\s+(\S+)", text, re.M)[:3]]  # --durations
    note = "; ".join(failed) + (" / " if failed and slowest else "") + ("slowest: " + ", ".join(slowest) if slowest else "")
    return [(job.section, job.label, tails[-1] if tails else failure_note(text, returncode), note)]


def installed(module: str) -> bool:
    """Whether `module` can be found (not imported: a kernel library may still fail to load; its row says so)."""
    import importlib.util

    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def plan(args, env: dict) -> list:
    """The jobs of the chosen sections, in run order. env: the parent's environment (DATA_PATH etc.)."""
    py, twin = sys.executable, args.cpu_twin
    shape = dict(CPU_TWIN_SHAPE) if twin else {}
    timing = {"WARMUP_STEPS": WARMUP_STEPS}
    bench = [py, "tools/bench_step.py", "--steps", str(3 if twin else TIMED_STEPS)] + (["--cpu"] if twin else [])
    jobs = []

    def step_job(section, label, extra, reference=None, cwd=REPO, warm=True):
        """warm: precompiled before the timed sections (the essentials; an optional row compiles in its own time)."""
        argv = bench + (["--reference", reference] if reference else [])
        pre = [a if a != str(TIMED_STEPS) else "2" for a in bench]  # the kit's graphs only: the reference compiles its own
        jobs.append(Job(section, label, argv, {**shape, **timing, **extra}, 300, parse_bench,
                        None if twin or not warm else pre, Path(cwd)))

    sections = args.sections.split(",")
    if "kernels" in sections:
        jobs.append(Job("kernels", "kernel bench", [py, "-m", "tools.bench.kernel_bench"] + (["--cpu-twin"] if twin else []),
                        {}, 240, parse_kernels))
    if "step" in sections:
        step_job("step", "default kernels (auto)", {"ATTN_BACKEND": "auto", "LOSS_KERNEL": "auto"})
        step_job("step", "SDPA + torch loss", {"ATTN_BACKEND": "sdpa", "LOSS_KERNEL": "torch"})
    if "baseline" in sections:
        ref = None if twin else args.reference
        small = {k: v for k, v in BASELINE_SHAPE.items() if k not in ("TRAIN_SEQ_LEN", "ROPE_DIMS", "GRAD_ACCUM_STEPS")}
        step_job("baseline", "official baseline shape", small if twin else BASELINE_SHAPE, ref)
    if "pytest" in sections:
        jobs.append(Job("pytest", "pytest -m gpu", [py, "-m", "pytest", "-q", "-m", "gpu", "-p", "no:cacheprovider",
                                                     "--durations=5", "tests"], {}, 240, parse_pytest))
    check = [py, "tools/gpu_check.py"] + (["--cpu-twin", "--steps", "1"] if twin else [])
    if "gpu_check" in sections:
        jobs.append(Job("gpu_check", "default preset", check, {}, 300, parse_check))
    if "step" in sections:  # each optional kernel alone, where installed and not what auto already gave
        fa3 = installed("flash_attn_interface")
        if not twin and fa3 and installed("flash_attn.cute"):  # auto takes FA3 first (model/attention.py)
            step_job("step", "FA4 + torch loss", {"ATTN_BACKEND": "fa4", "LOSS_KERNEL": "torch"}, warm=False)
        if not twin and installed("liger_kernel"):  # LOSS_KERNEL=auto is the kit's own loss (model/fused_loss.py)
            step_job("step", "SDPA + liger loss", {"ATTN_BACKEND": "sdpa", "LOSS_KERNEL": "liger"}, warm=False)
        if args.compare:
            step_job("step", f"default kernels (auto), checkout {Path(args.compare).name}", {"ATTN_BACKEND": "auto"},
                     cwd=Path(args.compare).resolve(), warm=False)
    if "microbatch" in sections and not twin:
        for accum, seqs in micro_batch_sizes(env):
            step_job("microbatch", f"{seqs} sequences per micro-batch", {"GRAD_ACCUM_STEPS": str(accum)}, warm=False)
    if "gpu_check" in sections and not twin:
        jobs.append(Job("gpu_check", "1xh100-frontier", check, {"PRESET": "1xh100-frontier"}, 300, parse_check))
    if "record" in sections and getattr(args, "record", None) and not twin:
        record_plan(step_job, args.record, env)
    return jobs


def record_plan(step_job, record: str, env: dict) -> None:
    """The record row: the kit at PRESET=8xh100-pr1855 beside PR #1855's script (bench_step --reference); FA2 as its
    FlashAttention-3 where FA3 is not installed (FA3_SHIM written; the label says so)."""
    extra, kernels = {"PRESET": "8xh100-pr1855"}, "FA3"
    if not installed("flash_attn_interface"):
        FA3_SHIM.mkdir(exist_ok=True)
        (FA3_SHIM / "flash_attn_interface.py").write_text(FA3_SHIM_SOURCE, encoding="utf-8")
        extra["PYTHONPATH"] = os.pathsep.join(filter(None, (str(FA3_SHIM), env.get("PYTHONPATH", ""))))
        kernels = "FA2 as FA3" if installed("flash_attn") else "no FA3 or FA2: no time"
    step_job("record", f"8xh100-pr1855 on one GPU, record's attention {kernels}", extra, str(Path(record).resolve()),
             warm=False)


def micro_batch_sizes(env: dict) -> list:
    """[(GRAD_ACCUM_STEPS, sequences per micro-batch)] at half and twice the preset's micro-batch on one GPU
    (Hyperparameters.other_micro_batches, as gpu_check --micro-batches); [] for settings that do not resolve (the
    step rows report that error)."""
    from primitives.settings import Hyperparameters  # no torch

    try:
        return Hyperparameters.from_env(env, log=lambda *_: None).other_micro_batches(1, True)
    except ValueError:
        return []


def run_child(job: Job, argv: list, timeout_s: float):
    """(output, returncode or None when it ran out of time) of one child process. The child runs in its own
    process group, and a timeout kills the whole group: a grandchild (bench_step's reference run) left on the
    GPU would slow every later row."""
    path = os.pathsep.join(p for p in (str(job.cwd), os.environ.get("PYTHONPATH", "")) if p)
    env = {**os.environ, **job.env, "PYTHONUNBUFFERED": "1", "PYTHONPATH": path}
    with subprocess.Popen(argv, cwd=job.cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          start_new_session=True) as proc:
        try:
            return proc.communicate(timeout=max(1.0, timeout_s))[0], proc.returncode
        except subprocess.TimeoutExpired:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            return proc.communicate()[0] or "", None


class Report:
    """The markdown table, appended row by row to `path` (a cut-short run keeps what it measured)."""

    HEADER = "| section | configuration | result | note |\n|---|---|---|---|\n"

    def __init__(self, path: Path, title: str):
        self.path, self.rows = path, []
        path.write_text(f"{title}\n\n{self.HEADER}")

    def add(self, row) -> None:
        self.rows.append(row)
        cells = [str(c).replace("|", "/").replace("\n", " ") for c in row]
        with self.path.open("a") as f:
            f.write("| " + " | ".join(cells) + " |\n")


def precompile(jobs: list, workers: int, deadline: float) -> tuple:
    """Run each step job's two-step twin, `workers` at a time, until `deadline`: (seconds, failed labels)."""
    todo = [j for j in jobs if j.precompile_argv]
    t0, failed = time.monotonic(), []
    if not todo or workers < 1:
        return 0.0, failed
    with ThreadPoolExecutor(workers) as pool:
        results = pool.map(lambda j: (j, run_child(j, j.precompile_argv, deadline - time.monotonic())), todo)
        failed = [j.label for j, (_, rc) in results if rc != 0]
    return time.monotonic() - t0, failed


def title_line(twin: bool) -> str:
    import platform

    try:
        import torch

        gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "no GPU"
        versions = f"torch {torch.__version__}, CUDA {torch.version.cuda}"
    except ImportError:
        gpu, versions = "no GPU", "torch missing"
    kind = "CPU TWIN: timings say nothing about a GPU" if twin else "measured"
    return (f"# gpu_report ({kind}): {gpu}, {versions}, Python {platform.python_version()}, "
            f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}")


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    bad = [s for s in args.sections.split(",") if s not in SECTIONS]
    if bad or args.budget_s <= 0 or (args.precompile is not None and args.precompile < 0):
        what = (f"--sections: unknown {', '.join(bad)} (expected a comma list of {', '.join(SECTIONS)})" if bad else
                f"--budget-s={args.budget_s}: expected > 0" if args.budget_s <= 0 else
                f"--precompile={args.precompile}: expected >= 0")
        print(f"error: {what}", file=sys.stderr)
        return 2
    if args.reference and not Path(args.reference).is_file():
        print(f"error: --reference {args.reference}: no such file", file=sys.stderr)
        return 2
    if args.record and not Path(args.record).is_file():
        print(f"error: --record {args.record}: no such file (expected PR #1855's train_gpt.py)", file=sys.stderr)
        return 2
    if args.compare and not (Path(args.compare) / "tools" / "bench_step.py").is_file():
        print(f"error: --compare {args.compare}: not a checkout of the kit (no tools/bench_step.py)", file=sys.stderr)
        return 2
    if not args.cpu_twin:
        import torch

        if not torch.cuda.is_available():
            print(f"gpu_report: needs a CUDA GPU (torch {torch.__version__} sees none); on a CPU run "
                  "`python tools/gpu_report.py --cpu-twin`", file=sys.stderr)
            return 2
    start = time.monotonic()
    deadline = start + args.budget_s
    jobs = plan(args, dict(os.environ))
    report = Report(Path(args.out), title_line(args.cpu_twin))
    workers = args.precompile if args.precompile is not None else (0 if args.cpu_twin else 4)
    if workers:
        print(f"gpu_report: warming the compile caches ({sum(bool(j.precompile_argv) for j in jobs)} configurations, "
              f"{workers} at a time)", flush=True)
        seconds, failed = precompile(jobs, workers, start + 0.5 * args.budget_s)
        report.add(("setup", f"precompile, {workers} at a time", f"{seconds:.0f} s",
                    f"failed: {', '.join(failed)}" if failed else "every configuration compiled"))
    status = 0
    for i, job in enumerate(jobs):
        left = deadline - time.monotonic()
        if left < 20:
            for rest in jobs[i:]:
                report.add((rest.section, rest.label, "not run", f"budget of {args.budget_s:.0f} s spent"))
            break
        print(f"gpu_report: [{job.section}] {job.label} ...", flush=True)
        t0 = time.monotonic()
        text, rc = run_child(job, job.argv, min(job.timeout_s, left))
        rows = job.parse(job, text, rc) if rc is not None or job.section == "kernels" else []
        if not rows or rc not in (0, 1):
            status = 1
            rows = rows or [(job.section, job.label, "no result", failure_note(text, rc))]
        for row in rows:
            report.add(row)
        report.add((job.section, f"{job.label}: command", f"{time.monotonic() - t0:.0f} s", f"`{job.command}`"))
    print(report.path.read_text())
    print(f"gpu_report: {len(report.rows)} rows in {time.monotonic() - start:.0f} s -> {report.path}")
    return status


if __name__ == "__main__":
    sys.exit(main())
