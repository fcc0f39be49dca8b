"""`--help` of every command answers at once: the arguments are parsed before torch is imported
(importing torch takes seconds, ~30 s on a loaded machine)."""

import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SCRIPTS = sorted(str(p.relative_to(REPO)) for p in [*REPO.glob("tools/*.py"), *REPO.glob("tools/sweeps/*.py")]
                 if 'if __name__ == "__main__"' in p.read_text(encoding="utf-8")
                 and p.name != "audit_parse.py")  # a stdlib-only helper run by other interpreters, no --help
PROBE = """import contextlib, io, runpy, sys
sys.argv = [sys.argv[1], "--help"]
out = io.StringIO()
try:
    with contextlib.redirect_stdout(out):
        {run}
except SystemExit as e:
    code = e.code
else:
    code = "no exit"
print(code, "torch" in sys.modules, "usage:" in out.getvalue())
"""


def _probe(run: str, target: str):
    proc = subprocess.run([sys.executable, "-c", PROBE.format(run=run), target], cwd=REPO, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return proc.stdout.split()


@pytest.mark.parametrize("script", SCRIPTS)
def test_help_of_a_tool_does_not_import_torch(script):
    code, torch_imported, usage = _probe("runpy.run_path(sys.argv[0], run_name='__main__')", script)
    assert (code, usage) == ("0", "True"), script
    assert torch_imported == "False", f"{script} --help imported torch"


@pytest.mark.parametrize("module", ["eval", "quant"])
def test_help_of_python_m_eval_and_quant_does_not_import_torch(module):
    code, torch_imported, usage = _probe("runpy.run_module(sys.argv[0], run_name='__main__', alter_sys=True)", module)
    assert (code, usage, torch_imported) == ("0", "True", "False")


def test_the_list_covers_the_benchmarks():
    assert {"tools/bench_step.py", "tools/bench_quant.py", "tools/make_record.py", "tools/sweep.py",
            "tools/prepare_data.py"} <= set(SCRIPTS)


def test_gpu_check_help_states_the_cpu_twin_default_steps():
    """gpu_check builds its parser before torch is imported, so its help's step count is a copy of
    tools/bench/cpu_twin_size.py's (which imports torch): the two must agree."""
    from tools.bench.cpu_twin_size import CPU_TWIN_STEPS
    from tools.bench.gpu_check import CPU_TWIN_STEPS_HELP, build_parser

    assert CPU_TWIN_STEPS_HELP == CPU_TWIN_STEPS
    assert f"{CPU_TWIN_STEPS} with --cpu-twin" in " ".join(build_parser().format_help().split())
