"""tools/gpu_check.py: one line without CUDA; its whole code path on the CPU twins (--cpu-twin)."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
TWIN_ENV = {"PRESET": "smoke", "NUM_LAYERS": "2", "MODEL_DIM": "64", "NUM_HEADS": "4", "NUM_KV_HEADS": "2",
            "ROPE_DIMS": "8", "XSA_LAST_N": "1", "TRAIN_SEQ_LEN": "64", "TRAIN_BATCH_TOKENS": "256",
            "EVAL_BATCH_SEQS": "2", "WARMUP_STEPS": "1", "OMP_NUM_THREADS": "1"}


def run_check(*args, **env):
    full_env = {k: v for k, v in os.environ.items() if not k.startswith(("PRESET", "DATA_PATH"))}
    full_env.update(env, PYTHONPATH=str(REPO))
    return subprocess.run([sys.executable, str(REPO / "tools/gpu_check.py"), *args], cwd=REPO, env=full_env,
                          capture_output=True, text=True, timeout=600)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only message")
def test_without_cuda_one_line_and_exit_2():
    proc = run_check()
    assert proc.returncode == 2 and proc.stdout == ""
    assert re.fullmatch(r"gpu_check: needs a CUDA GPU \(torch \S+ sees none\); .*--cpu-twin`\n", proc.stderr)


@pytest.mark.slow
def test_cpu_twin_runs_every_check_and_passes():
    proc = run_check("--cpu-twin", "--steps", "2", **TWIN_ENV)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    checks = [line[4:].split("  ")[0].strip() for line in proc.stdout.splitlines() if line[:4] in ("ok  ", "FAIL")]
    assert checks == ["torch / CUDA", "flash-attn", "attention backend", "GPU", "compile + warmup", "graph breaks",
                      "recompiles after step 1", "train step", "train step, QAT on", "losses finite", "peak memory",
                      "forward vs CPU fp32", "QAT fake-quant == export", "eval recompiles", "sliding eval",
                      "projected full-val eval"]
    assert "attention backend         flash stand-in" in proc.stdout
    assert re.search(r"forward vs CPU fp32 +loss [\d.]+ vs [\d.]+ \(rel \S+, bf16 tolerance 1e-2\)", proc.stdout)
    # the QAT row checks the bits QAT trains for: int8 when no QUANT_*_BITS is set (the fit's start)
    assert re.search(r"QAT fake-quant == export +int8 \[\d+, \d+\] eager on cpu: max \|diff\| 0\.0e\+00", proc.stdout)
    assert re.search(r"projected full-val eval +stride 64: \d+ s, stride 96: \d+ s, stride 128: \d+ s", proc.stdout)
    assert proc.stdout.rstrip().endswith("gpu_check: all checks passed")
