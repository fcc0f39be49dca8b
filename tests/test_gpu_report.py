"""tools/gpu_report.py: its parsers on real H100 output, its plan, bad input, and a whole --cpu-twin run."""

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from tools.bench import gpu_report  # noqa: E402

SHARED_GPU = REPO.parent / "shared" / "gpu"
BENCH_OUT = """attention:sdpa
bench_step: NVIDIA H100 80GB HBM3, torch 2.11.0+cu130, preset 1xh100-sp8192, 524,288 tokens/step, seq 2048, 12 steps
             ms/step     tokens/s     MFU  peak mem   ratio
kit            414.1    1,266,081   27.2%  11.8 GiB   1.13x
reference      366.5    1,430,513   30.8%  10.0 GiB   1.00x
(MFU: ...)
"""


def job(section="step", label="x", parse=None):
    return gpu_report.Job(section, label, ["python"], {}, 10, parse)


def run_report(*args, **env):
    full = {k: v for k, v in os.environ.items() if not k.startswith(("PRESET", "DATA_PATH"))}
    full.update(env, PYTHONPATH=str(REPO))
    return subprocess.run([sys.executable, str(REPO / "tools/gpu_report.py"), *args], cwd=REPO, env=full,
                          capture_output=True, text=True, timeout=600)


def test_parse_bench_step_table_both_sides():
    rows = gpu_report.parse_bench(job(label="baseline shape"), BENCH_OUT, 0)
    assert rows == [
        ("step", "baseline shape, kit", "414.1 ms/step", "1,266,081 tok/s, MFU 27.2%, peak 11.8 GiB; attention:sdpa"),
        ("step", "baseline shape, official script", "366.5 ms/step", "1,430,513 tok/s, MFU 30.8%, peak 10.0 GiB")]


@pytest.mark.skipif(not (SHARED_GPU / "h100_gpu_check.log").is_file(), reason="needs ../shared/gpu")
def test_parse_gpu_check_rows_of_the_real_h100_log():
    text = (SHARED_GPU / "h100_gpu_check.log").read_text()
    rows = gpu_report.parse_check(job("gpu_check", "default preset"), text, 1)
    by_check = {r[1]: (r[2], r[3]) for r in rows}
    assert len(rows) == 17
    assert by_check["default preset: train step"][0].startswith("411.1 ms, 1,275,375 tok/s")
    assert by_check["default preset: attention backend"] == ("sdpa", "FAIL")
    assert by_check["default preset: compile + warmup"] == ("53.5 s (20 warmup steps, compile on)", "ok")


@pytest.mark.skipif(not (SHARED_GPU / "h100_pytest_gpu.log").is_file(), reason="needs ../shared/gpu")
def test_parse_pytest_summary_and_failures():
    text = (SHARED_GPU / "h100_pytest_gpu.log").read_text()
    rows = gpu_report.parse_pytest(job("pytest", "pytest -m gpu"), text, 1)
    assert rows == [("pytest", "pytest -m gpu", "1 failed, 2 passed, 536 deselected in 11.87s",
                     "tests/test_gpu.py::test_cuda_forward_matches_cpu_fp32_at_bf16_tolerance")]


def test_parse_pytest_names_the_slowest_tests_of_durations():
    text = ("F..\n============ slowest 5 durations ============\n44.12s call     tests/test_gpu.py::test_step\n"
            "9.80s setup    tests/test_gpu.py::test_a\n3.51s call     tests/test_gpu_step_ops.py::test_b\n"
            "FAILED tests/test_gpu.py::test_step - AssertionError\n1 failed, 2 passed, 9 deselected in 60.00s\n")
    rows = gpu_report.parse_pytest(job("pytest", "pytest -m gpu"), text, 1)
    assert rows == [("pytest", "pytest -m gpu", "1 failed, 2 passed, 9 deselected in 60.00s",
                     "tests/test_gpu.py::test_step / slowest: test_step 44 s, test_b 4 s")]


def test_parse_bench_keeps_the_kit_row_when_the_reference_failed():
    text = BENCH_OUT.replace("reference      366.5    1,430,513   30.8%  10.0 GiB   1.00x\n", "") + (
        "bench_step: the reference gave no time: reference exited 2: [\"can't open file\"]\n")
    rows = gpu_report.parse_bench(job(label="b"), text, 1)
    assert [r[1:3] for r in rows] == [("b, kit", "414.1 ms/step"), ("b, official script", "no result")]
    assert rows[1][3] == "reference exited 2: [\"can't open file\"]"


def test_kernel_rows_end_at_their_line_when_warnings_follow():
    text = "ROW\tloss LOSS_KERNEL=liger\t4.87 ms fwd+bwd\tpeak +136 MiB\n/x.py:72: UserWarning: Memory\n  y = f(q)\n"
    assert gpu_report.parse_kernels(job("kernels"), text, 0) == [
        ("kernels", "loss LOSS_KERNEL=liger", "4.87 ms fwd+bwd", "peak +136 MiB")]


def test_failure_note_names_the_error_line_and_the_exit():
    assert gpu_report.failure_note("a\nValueError: bad shape\nwarning tail\n", 1) == "exit 1: ValueError: bad shape"
    assert gpu_report.failure_note("", None) == "timed out: "


def test_plan_on_a_gpu_covers_every_kernel_and_microbatch_and_warms_the_essentials(monkeypatch):
    monkeypatch.setattr(gpu_report, "installed", lambda module: True)
    args = argparse.Namespace(sections=",".join(gpu_report.SECTIONS), cpu_twin=False, reference="ref.py", compare=None)
    jobs = gpu_report.plan(args, {})
    step = [j for j in jobs if j.parse is gpu_report.parse_bench]
    assert [j.env.get("ATTN_BACKEND") for j in step if j.section == "step"] == ["auto", "sdpa", "fa4", "sdpa"]
    assert [j.env.get("GRAD_ACCUM_STEPS") for j in step if j.section == "microbatch"] == ["8", "2"]
    baseline = next(j for j in step if j.section == "baseline")
    assert baseline.argv[-2:] == ["--reference", "ref.py"] and baseline.env["NUM_LAYERS"] == "9"
    assert baseline.env["GRAD_ACCUM_STEPS"] == "8"  # the official script's micro-batch, with or without --reference
    warm = [j.label for j in step if j.precompile_argv]  # the essentials: the others compile in their own time
    assert warm == ["default kernels (auto)", "SDPA + torch loss", "official baseline shape"]
    for j in step:  # the warm-up twin is the kit's command with two steps, never the reference script's
        kit_argv = j.argv[:-2] if "--reference" in j.argv else j.argv
        assert j.precompile_argv in (None, [a if a != str(gpu_report.TIMED_STEPS) else "2" for a in kit_argv])
    assert [j.section for j in jobs][:6] == ["kernels", "step", "step", "baseline", "pytest", "gpu_check"]
    assert [j.env.get("PRESET") for j in jobs if j.section == "gpu_check"] == [None, "1xh100-frontier"]


def test_microbatch_rows_are_named_by_the_preset_s_own_sequences(monkeypatch):
    monkeypatch.setattr(gpu_report, "installed", lambda module: False)
    args = argparse.Namespace(sections="microbatch", cpu_twin=False, reference=None, compare=None)
    labels = lambda env: [(j.label, j.env["GRAD_ACCUM_STEPS"]) for j in gpu_report.plan(args, env)]
    assert labels({}) == [("32 sequences per micro-batch", "8"), ("128 sequences per micro-batch", "2")]
    assert labels({"TRAIN_SEQ_LEN": "1024"}) == [("64 sequences per micro-batch", "8"), ("256 sequences per micro-batch", "2")]
    assert labels({"TRAIN_BATCH_TOKENS": "1000"}) == []  # does not resolve: the step rows say why


def test_plan_skips_kernels_not_installed_and_repeats_of_the_default(monkeypatch):
    """No flash-attn: no FA4 row; Liger installed: its row (auto is the kit's own loss)."""
    monkeypatch.setattr(gpu_report, "installed", lambda module: module == "liger_kernel")
    args = argparse.Namespace(sections="step", cpu_twin=False, reference=None, compare=None)
    assert [j.label for j in gpu_report.plan(args, {})] == ["default kernels (auto)", "SDPA + torch loss",
                                                            "SDPA + liger loss"]


def test_plan_does_not_time_fa4_twice_when_auto_is_fa4(monkeypatch):
    """FA4 without FA3: auto resolves to FA4 (model/attention.py), so an FA4 row would repeat the default's."""
    monkeypatch.setattr(gpu_report, "installed", lambda module: module == "flash_attn.cute")
    args = argparse.Namespace(sections="step", cpu_twin=False, reference=None, compare=None)
    assert [j.label for j in gpu_report.plan(args, {})] == ["default kernels (auto)", "SDPA + torch loss"]


def test_a_child_out_of_time_takes_its_grandchildren_with_it(tmp_path):
    """bench_step's reference run is a grandchild: left running, it would share the GPU with every later row."""
    pid_file = tmp_path / "grandchild.pid"
    script = ("import subprocess, sys, time; p = subprocess.Popen([sys.executable, '-c', 'import time; "
              f"time.sleep(60)']); open({str(pid_file)!r}, 'w').write(str(p.pid)); time.sleep(60)")
    j = gpu_report.Job("baseline", "b", [sys.executable, "-c", script], {}, 10, None, None, tmp_path)
    t0 = time.monotonic()
    text, rc = gpu_report.run_child(j, j.argv, 3.0)
    assert rc is None and time.monotonic() - t0 < 15  # not held until the grandchild closes the pipe
    pid = int(pid_file.read_text())
    deadline = time.monotonic() + 5
    while alive(pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not alive(pid)


def alive(pid: int) -> bool:
    """A process that runs (a zombie waiting for its reaper counts as gone)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_plan_times_another_checkout_in_its_own_folder(tmp_path):
    args = argparse.Namespace(sections="step", cpu_twin=False, reference=None, compare=str(tmp_path / "old"))
    other = [j for j in gpu_report.plan(args, {}) if j.cwd != gpu_report.REPO]
    assert [(j.label, j.cwd, j.argv[1]) for j in other] == [
        ("default kernels (auto), checkout old", tmp_path / "old", "tools/bench_step.py")]


@pytest.mark.parametrize("args, message", [
    (["--compare", "/tmp", "--cpu-twin"], "error: --compare /tmp: not a checkout of the kit (no tools/bench_step.py)"),
    (["--sections", "step,nope"], "error: --sections: unknown nope"),
    (["--budget-s", "0"], "error: --budget-s=0.0: expected > 0"),
    (["--reference", "/no/such/file.py", "--cpu-twin"], "error: --reference /no/such/file.py: no such file"),
])
def test_bad_input_one_line_exit_2(args, message):
    proc = run_report(*args)
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.startswith(message) and proc.stderr.count("\n") == 1


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only message")
def test_without_cuda_one_line_and_exit_2():
    proc = run_report()
    assert proc.returncode == 2 and proc.stderr.startswith("gpu_report: needs a CUDA GPU") and "--cpu-twin" in proc.stderr


@pytest.mark.slow
def test_cpu_twin_report_runs_every_section_it_plans(tmp_path):
    out = tmp_path / "report.md"
    proc = run_report("--cpu-twin", "--sections", "kernels,step,baseline", "--out", str(out), OMP_NUM_THREADS="1")
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    text = out.read_text()
    assert text.startswith("# gpu_report (CPU TWIN: timings say nothing about a GPU)")
    rows = [line.split(" | ") for line in text.splitlines() if line.startswith("| ") and "---" not in line][1:]
    sections = {r[0].strip("| ") for r in rows}
    assert sections == {"kernels", "step", "baseline"}
    kit_rows = [r for r in rows if r[1].endswith(", kit")]
    assert len(kit_rows) == 3 and all(r[2].endswith(" ms/step") and float(r[2].split()[0]) > 0 for r in kit_rows)
    assert any(r[1] == "attention SDPA math (CPU)" and r[2].endswith("ms fwd+bwd") for r in rows)
    assert any(r[1] == "loss LOSS_KERNEL=torch" and "loss " in r[3] for r in rows)


@pytest.mark.parametrize("have, label, shim", [
    ({"flash_attn_interface", "flash_attn"}, "FA3", False),
    ({"flash_attn"}, "FA2 as FA3", True),
    (set(), "no FA3 or FA2: no time", True)])
def test_plan_times_the_pr1855_record_beside_its_preset(monkeypatch, have, label, shim):
    """--record: the kit at PRESET=8xh100-pr1855 beside PR #1855's script; FA2 under FA3's module name where FA3 is
    missing (the row's label says which attention the record ran)."""
    monkeypatch.setattr(gpu_report, "installed", lambda module: module in have)
    args = argparse.Namespace(sections="record", cpu_twin=False, reference=None, compare=None, record="pr1855.py")
    (j,) = gpu_report.plan(args, {"PYTHONPATH": "/x"})
    assert j.env["PRESET"] == "8xh100-pr1855" and j.argv[-2:] == ["--reference", str(Path("pr1855.py").resolve())]
    assert j.label.endswith(label) and j.precompile_argv is None
    assert j.env.get("PYTHONPATH") == (f"{gpu_report.FA3_SHIM}{os.pathsep}/x" if shim else None)
    if shim:
        assert (gpu_report.FA3_SHIM / "flash_attn_interface.py").read_text() == gpu_report.FA3_SHIM_SOURCE
