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
    checks = [line[4:].split("  ")[0].strip() for line in proc.stdout.splitlines() if line[:4] in ("ok  ", "WARN", "FAIL")]
    assert checks == ["torch / CUDA", "flash-attn", "attention backend", "GPU", "CPU twin shape", "compile + warmup",
                      "graph breaks",
                      "recompiles after step 1", "train step", "train step, QAT on", "losses finite", "peak memory",
                      "forward vs CPU fp32", "QAT fake-quant == export", "eval recompiles", "sliding eval",
                      "projected full-val eval", "projected TTT eval"]
    assert "attention backend         flash stand-in" in proc.stdout
    # compile is off in the CPU twin: no graph (with compile on, QAT's start compiles exactly one graph, in warmup,
    # tests/test_cuda_twins.py)
    assert re.search(r"recompiles after step 1 +0 \(expected 0: one per graph state \(compile off\), compiled in "
                     r"warmup; 0 after warmup; QAT on from step 2; 0 graphs in all\)", proc.stdout)
    assert re.search(r"forward vs CPU fp32 +loss [\d.]+ vs [\d.]+ \(rel \S+, bf16 tolerance 1e-2\)", proc.stdout)
    # the QAT row checks the bits QAT trains for: int8 when no QUANT_*_BITS is set (the fit's start)
    assert re.search(r"QAT fake-quant == export +int8 \[\d+, \d+\] eager on cpu: max \|diff\| 0\.0e\+00", proc.stdout)
    assert re.search(r"projected full-val eval +stride 64: \d+ s, stride 96: \d+ s, stride 128: \d+ s", proc.stdout)
    assert re.search(r"projected TTT eval +[\d.]+ ms per TTT step; TTT_EPOCHS=3 at stride 64: \d+ s incl. roundtrip; "
                     r"plan: stride \d+, [0-3] epochs, \d+ s \(EVAL_MAX_SECONDS=600\) \(CPU twin: no verdict\)", proc.stdout)
    assert proc.stdout.rstrip().endswith("gpu_check: all checks passed")


@pytest.mark.slow
@pytest.mark.parametrize("accum, expected", [("2", [("1", "4"), ("4", "1")]), ("4", [("2", "2")])])
def test_micro_batches_time_the_step_at_half_and_twice_the_sequences(accum, expected):
    """4 sequences per step: GRAD_ACCUM_STEPS=2 gives rows for 1 (accum 4) and 4 (accum 1) sequences; at 4, twice
    the accumulation (8) does not split the batch into whole sequences, so only half (2) is timed."""
    proc = run_check("--cpu-twin", "--steps", "1", "--micro-batches", **TWIN_ENV, GRAD_ACCUM_STEPS=accum)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    base = 4 // int(accum)
    rows = re.findall(rf"train step, (\d) seqs/micro-batch +([\d.]+) ms \(([+-][\d.]+)% against {base} seqs; "
                      r"GRAD_ACCUM_STEPS=(\d)\), peak n/a on the CPU", proc.stdout)
    assert [(seqs, a) for seqs, _, _, a in rows] == expected, proc.stdout
    assert all(float(ms) > 0 for _, ms, _, _ in rows)


# ----------------------------------------------------------------------------------------------- verdicts

def gpu_check_module():
    sys.path.insert(0, str(REPO))
    import tools.bench.gpu_check as gc

    return gc


def test_step_ms_is_each_qat_states_median_window_and_names_a_slow_first_window():
    """A 2 x 20-step run logged every 5 steps: the QAT-off ms is the median of its four windows, the first window
    (steps 2-5) is named when over 3 % slower (the H100 transient of 2026-11-27), and QAT on has its own median."""
    gc = gpu_check_module()
    tokens = 524_288
    ms = {5: 325.0, 10: 300.0, 15: 301.0, 20: 302.0, 25: 304.0, 30: 303.0, 35: 305.0, 40: 303.5}
    lines = ["step:1/40 train_loss:9.0 tok_s:1000"] + [
        f"step:{n}/40 train_loss:5.0 train_time:1ms step_avg:1ms tok_s:{1000 * tokens / v:.0f}" for n, v in ms.items()]
    off, on, note = gc.windowed_step_ms(lines, 5, 20, tokens)
    assert abs(off - 301.5) < 0.01 and abs(on - 303.75) < 0.01
    assert note == "; the first 4 steps after warmup 325.0 ms"
    ms[5] = 305.0
    lines = lines[:1] + [f"step:{n}/40 tok_s:{1000 * tokens / v:.0f}" for n, v in ms.items()]
    assert gc.windowed_step_ms(lines, 5, 20, tokens)[2] == ""


def test_backend_row_warns_for_sdpa_on_cuda_and_never_fails():
    gc = gpu_check_module()
    assert gc.backend_row("cuda", "fa3").verdict == "ok" and gc.backend_row("cpu", "sdpa").verdict == "ok"
    row = gc.backend_row("cuda", "sdpa", "cudnn_attention")
    assert row.ok and row.verdict == "WARN" and "307 ms on cuDNN SDPA against 299 with FA4" in row.warn and "requirements-gpu.txt" in row.warn
    slow = gc.backend_row("cuda", "sdpa", "efficient_attention")
    assert slow.ok and "efficient_attention is 3.0x cuDNN's attention time" in slow.warn


def test_backend_row_is_ok_for_fa4_and_its_twin_and_sdpa_names_fa4():
    gc = gpu_check_module()
    assert gc.backend_row("cuda", "fa4").verdict == "ok" and gc.backend_row("cpu", "fa4 twin").verdict == "ok"
    assert "install FA3 or FA4: requirements-gpu.txt" in gc.backend_row("cuda", "sdpa", "cudnn_attention").warn


def test_flash_versions_names_fa4_and_skips_its_namespace_flash_attn(monkeypatch):
    """FA4's wheel leaves `flash_attn` importable as a namespace package: that is not FA2."""
    import importlib
    import importlib.metadata
    import types

    gc = gpu_check_module()
    modules = {"flash_attn": types.SimpleNamespace(),
               "flash_attn.cute.interface": types.SimpleNamespace(_flash_attn_fwd=None)}

    def import_module(name):
        if name not in modules:
            raise ImportError(name)
        return modules[name]

    monkeypatch.setattr(importlib, "import_module", import_module)
    monkeypatch.setattr(importlib.metadata, "version", lambda dist: {"flash-attn-4": "4.0.0b36"}[dist])
    assert gc.flash_versions() == "flash-attn-4 4.0.0b36"
    modules.clear()
    assert gc.flash_versions() == "not importable"


@pytest.mark.slow
def test_cpu_twin_with_attn_backend_fa4_runs_through_the_fa4_twin():
    """Compiled, as on a GPU (COMPILE=1): the FA4 ops keep the graph whole, and the eval compiles nothing the
    second time (the row once counted the TTT step's own graph: a FAIL on an H100 that was no recompile)."""
    proc = run_check("--cpu-twin", "--steps", "1", **TWIN_ENV, ATTN_BACKEND="fa4", COMPILE="1", TTT_ENABLED="1",
                     TTT_MODE="lora", TTT_LORA_CHUNK_TOKENS="64")
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    assert re.search(r"ok +attention backend +fa4 twin\n", proc.stdout)
    assert re.search(r"ok +compile \+ warmup +[\d.]+ s \(\d+ warmup steps, compile on\)\n", proc.stdout)
    assert re.search(r"ok +graph breaks +0\n", proc.stdout)
    assert re.search(r"ok +recompiles after step 1 +1 \(expected 1: one per graph state QAT on, compiled in warmup; "
                     r"0 after warmup", proc.stdout)
    assert re.search(r"ok +eval recompiles +0\n", proc.stdout)
    assert re.search(r"projected TTT eval +[\d.]+ ms per scoring forward, [\d.]+ ms per batched adapter step; TTT_MODE="
                     r"lora, 50,000 documents assumed \(no DATA_PATH: the challenge's val split\), [\d,]+ rounds of "
                     r"TTT_LORA_BATCH_DOCS=64 \([\d,]+ forwards\), TTT_EPOCHS=3 at stride \d+: \d+ s incl\. roundtrip; "
                     r"plan: stride \d+, \d epochs",
                     proc.stdout)
    assert proc.stdout.rstrip().endswith("gpu_check: all checks passed")


def test_gpu_row_warns_off_the_h100_sxm():
    gc = gpu_check_module()
    assert gc.gpu_row("NVIDIA H100 80GB HBM3", 132, 79).verdict == "ok"
    pcie = gc.gpu_row("NVIDIA H100 PCIe", 114, 79)
    assert pcie.ok and pcie.verdict == "WARN" and "114/132 SMs" in pcie.warn
    assert gc.gpu_row("NVIDIA A100-SXM4-80GB", 108, 79).verdict == "WARN"


def test_eval_projection_row_fails_only_over_the_limit_at_the_runs_stride():
    gc = gpu_check_module()
    n, seq = 40_540_160, 2048
    # the H100's measured 0.49 ms/window: ~320 s at stride 64 -> ok, no stride change
    row = gc.eval_projection_row(0.49e-3, n, seq, 64, 600.0, auto_stride=True)
    assert row.verdict == "ok" and "stride 64: 320 s" in row.value and "run's stride 64: 320 s" in row.value
    # 2x slower: 642 s at 64 > 600 -> without auto stride a FAIL, with it a WARN at a larger stride that fits 540 s
    fixed = gc.eval_projection_row(1.0e-3, n, seq, 64, 600.0, auto_stride=False)
    assert not fixed.ok and fixed.verdict == "FAIL"
    auto = gc.eval_projection_row(1.0e-3, n, seq, 64, 600.0, auto_stride=True)
    assert auto.ok and auto.verdict == "WARN" and "stride raised from EVAL_STRIDE=64" in auto.warn
    stride = int(re.search(r"run's stride (\d+): (\d+) s", auto.value).group(1))
    assert stride > 64 and int(re.search(r"run's stride \d+: (\d+) s", auto.value).group(1)) <= 540
    # so slow that even stride = seq_len does not fit: FAIL even with auto stride
    assert gc.eval_projection_row(0.1, n, seq, 64, 600.0, auto_stride=True).verdict == "FAIL"


def test_ttt_projection_row_warns_when_the_plan_cuts_ttt():
    """The default preset on the sp8192 val split (40,540,160 tokens) at the H100's measured 0.49 ms per
    window and 1.27 M tokens/s fwd+bwd (a TTT step of 16 x 2048 tokens: 25.8 ms, issue 24): 3 epochs fit."""
    from primitives.settings import Hyperparameters

    gc = gpu_check_module()
    n, hp = 40_540_160, Hyperparameters(run_id="x", ttt_enabled=True)
    step = 16 * 2048 / 1.27e6
    row = gc.ttt_projection_row(0.49e-3, step, n, hp)
    # 1,238 chunks: 9,904 scoring batches of 64 windows (310.6 s) + 3 x 1,237 steps (95.8 s) + roundtrip 9.7 s
    assert row.verdict == "ok" and "TTT_EPOCHS=3 at stride 64: 416 s incl. roundtrip" in row.value
    assert "plan: stride 64, 3 epochs, 416 s" in row.value
    # a 4x slower step: 3 epochs at stride 64 project 703 s > 540 s; the plan keeps the epochs at a coarser
    # stride (EVAL_AUTO_STRIDE), or without it cuts to 1 epoch (2 epochs: 575 s; 1: 448 s)
    slow = gc.ttt_projection_row(0.49e-3, 4 * step, n, hp)
    assert slow.ok and slow.verdict == "WARN" and slow.warn == "stride raised to fit the clock"
    assert "TTT_EPOCHS=3 at stride 64: 703 s" in slow.value and "plan: stride 162, 3 epochs, 509 s" in slow.value
    fixed = gc.ttt_projection_row(0.49e-3, 4 * step, n, Hyperparameters(run_id="x", ttt_enabled=True,
                                                                          eval_auto_stride=False))
    assert fixed.verdict == "WARN" and fixed.warn == "TTT_EPOCHS=3 does not fit: 1"
    assert "plan: stride 64, 1 epochs, 448 s" in fixed.value
    off = gc.ttt_projection_row(0.49e-3, 4 * step, n, Hyperparameters(run_id="x"))
    assert off.verdict == "ok" and off.value.endswith("(TTT_ENABLED=0: information)")
    lora = gc.ttt_projection_row(0.49e-3, step, n, Hyperparameters(run_id="x", ttt_enabled=True, ttt_mode="lora"))
    assert lora.verdict == "WARN" and lora.value == "TTT_MODE=lora: not projected by this check"  # no chunked figure


def test_ttt_projection_row_of_phased_ttt_uses_the_phased_projection():
    """TTT_MODE=phased at the same timings: 3 phases x ceil((633,409 windows / 3 + 1) / 64) = 9,900 scoring
    batches (310.5 s) + 3 epochs x (206 + 412) steps of 32 sequences (47.8 s) + roundtrip 9.7 s = 368 s,
    where the chunked formula gives 416 s; the plan keeps the phases, and says so when it cuts them."""
    from primitives.settings import Hyperparameters

    gc = gpu_check_module()
    n, step = 40_540_160, 16 * 2048 / 1.27e6
    row = gc.ttt_projection_row(0.49e-3, step, n, Hyperparameters(run_id="x", ttt_enabled=True, ttt_mode="phased"))
    assert row.verdict == "ok"
    assert "TTT_MODE=phased, TTT_PHASES=3, TTT_EPOCHS=3 at stride 64: 368 s incl. roundtrip" in row.value
    assert "plan: stride 64, 3 epochs, 3 phases, 368 s" in row.value
    tight = Hyperparameters(run_id="x", ttt_enabled=True, ttt_mode="phased", eval_auto_stride=False, eval_max_seconds=420)
    cut = gc.ttt_projection_row(0.49e-3, 4 * step, n, tight)
    assert cut.verdict == "WARN" and "TTT_PHASES=3 -> 2" in cut.warn and ", 2 phases, " in cut.value


def test_ttt_projection_row_of_lora_ttt_is_the_trainers_plan():
    """TTT_MODE=lora on the full val split at stride 64 (EVAL_AUTO_STRIDE=0), 50,000 documents assumed (no data):
    ceil(40,540,159 / 256) + 50,000 = 208,360 chunks, 3,256 rounds of 64 slots, each 64 x 5 windows = 5 forwards of
    64 (16,280 forwards). At 20 ms per forward and 100 ms per batched step: 325.6 s + 3 x 3,256 x 0.1 s (976.8 s)
    + roundtrip 19,795 windows x 0.49 ms (9.7 s) = 1,312 s; 1 epoch 661 s > 540 s, so the plan scores with the
    sliding pass and the row warns why; at 15 ms and 60 ms 1 epoch of 3 fits (449 s)."""
    from primitives.settings import Hyperparameters
    from eval.ttt_plan import lora_work_at

    gc = gpu_check_module()
    hp = Hyperparameters(run_id="x", ttt_enabled=True, ttt_mode="lora", eval_auto_stride=False)
    work = lora_work_at(hp, 40_540_160, 1, None, 50_000)
    row = gc.ttt_projection_row(0.49e-3, 0.0, 40_540_160, hp, lora_timings=(20e-3, 100e-3), lora_work=work)
    assert ("TTT_MODE=lora, 50,000 documents assumed (no DATA_PATH: the challenge's val split), 3,256 rounds of "
            "TTT_LORA_BATCH_DOCS=64 (16,280 forwards), TTT_EPOCHS=3 at stride 64: 1312 s incl. roundtrip; plan: stride "
            "64, 0 epochs, the sliding pass") in row.value
    assert row.verdict == "WARN" and row.warn.startswith("TTT skipped: 1 epoch of LoRA TTT projects 661s > 0.9 x")
    fast = gc.ttt_projection_row(0.49e-3, 0.0, 40_540_160, hp, lora_timings=(15e-3, 60e-3), lora_work=work)
    assert fast.verdict == "WARN" and fast.warn == "TTT_EPOCHS=3 -> 1" and "plan: stride 64, 1 epochs, 449 s" in fast.value
    off = gc.ttt_projection_row(0.49e-3, 0.0, 40_540_160, Hyperparameters(run_id="x", ttt_mode="lora"),
                                lora_timings=(20e-3, 100e-3), lora_work=work)
    assert off.verdict == "ok" and off.value.endswith("(TTT_ENABLED=0: information)")


def test_lora_row_shows_the_stride_the_auto_stride_plan_chooses():
    """EVAL_AUTO_STRIDE (the default) as the chunked plan: a coarser stride before fewer epochs. At 20 ms and 100 ms
    (above: skipped at stride 64) no 2 epochs fit at any stride (2 x 325.6 s of steps); 1 epoch fits first at
    stride 128: chunks of 256 span 3 windows, 64 x 3 = 3 forwards a round, 9,768 x 20 ms + 325.6 s + 9.7 s = 531 s
    (stride 127: 4 forwards a round, 596 s). At 15 ms and 60 ms 2 epochs fit from stride 256 (2 forwards a round:
    97.7 + 390.7 + 9.7 = 498 s) rather than 1 epoch at stride 64. Steps of 200 ms fit no epoch: the sliding pass at
    stride 64 (its 320 s fit)."""
    from primitives.settings import Hyperparameters
    from eval.ttt_plan import lora_work_at

    gc = gpu_check_module()
    hp = Hyperparameters(run_id="x", ttt_enabled=True, ttt_mode="lora")
    assert hp.eval_auto_stride and hp.eval_stride == 64
    work = lora_work_at(hp, 40_540_160, 1, None, 50_000)
    row = gc.ttt_projection_row(0.49e-3, 0.0, 40_540_160, hp, lora_timings=(20e-3, 100e-3), lora_work=work)
    assert "TTT_EPOCHS=3 at stride 64: 1312 s incl. roundtrip; plan: stride 128, 1 epochs, 531 s " in row.value
    assert row.verdict == "WARN" and row.warn == "TTT_EPOCHS=3 -> 1"
    fast = gc.ttt_projection_row(0.49e-3, 0.0, 40_540_160, hp, lora_timings=(15e-3, 60e-3), lora_work=work)
    assert "plan: stride 256, 2 epochs, 498 s " in fast.value and fast.warn == "TTT_EPOCHS=3 -> 2"
    slow = gc.ttt_projection_row(0.49e-3, 0.0, 40_540_160, hp, lora_timings=(20e-3, 200e-3), lora_work=work)
    assert "plan: stride 64, 0 epochs, the sliding pass " in slow.value
    assert slow.warn.startswith("TTT skipped: 1 epoch of LoRA TTT at stride 2048 projects ")
    fits = gc.ttt_projection_row(0.49e-3, 0.0, 40_540_160, hp, lora_timings=(2e-3, 10e-3), lora_work=work)
    assert "plan: stride 64, 3 epochs, " in fits.value and fits.verdict == "ok"  # it fits: the stride stays


def test_the_frontier_preset_plans_its_lora_ttt_at_a_coarser_stride():
    """PRESET=1xh100-frontier keeps EVAL_AUTO_STRIDE on (the class default): with the one-H100 projection's
    timings (31 ms per scoring forward: scoring alone about 505 s at stride 64; 80 ms per batched step) its
    LoRA TTT fits 1 epoch at stride 256 (2 forwards a round: 6,512 x 31 ms + 3,256 x 80 ms + 9.7 s = 472 s),
    where at stride 64 alone it falls back to the sliding pass."""
    import dataclasses

    from primitives.settings import Hyperparameters
    from eval.ttt_plan import lora_work_at

    gc = gpu_check_module()
    hp = Hyperparameters.from_env({"PRESET": "1xh100-frontier", "RUN_ID": "x"}, log=lambda *_: None)
    assert hp.eval_auto_stride and hp.eval_stride == 64 and hp.ttt_enabled and hp.ttt_mode == "lora"
    work = lora_work_at(hp, 40_540_160, 1, None, 50_000)
    row = gc.ttt_projection_row(0.49e-3, 0.0, 40_540_160, hp, lora_timings=(31e-3, 80e-3), lora_work=work)
    assert "plan: stride 256, 1 epochs, 472 s " in row.value and row.warn == "TTT_EPOCHS=3 -> 1"
    fixed = dataclasses.replace(hp, eval_auto_stride=False)
    row = gc.ttt_projection_row(0.49e-3, 0.0, 40_540_160, fixed, lora_timings=(31e-3, 80e-3), lora_work=work)
    assert "plan: stride 64, 0 epochs, the sliding pass " in row.value and row.warn.startswith("TTT skipped")


def test_lora_row_says_whether_its_documents_were_counted_or_assumed(sp):
    """With the val tokens the row counts their documents and the schedule's rounds; without, it says it assumed."""
    import torch

    from primitives.settings import Hyperparameters
    from test_eval_support import mixed_stream
    from eval.ttt_plan import lora_work_at

    gc = gpu_check_module()
    hp = Hyperparameters(run_id="x", ttt_enabled=True, ttt_mode="lora", train_seq_len=256, ttt_lora_batch_docs=4)
    tokens = mixed_stream(sp, 1200)
    docs = int((tokens[1:] == 1).sum()) + 1
    counter = lora_work_at(hp, len(tokens), 1, tokens, 50_000)
    counted = counter(hp.eval_stride)
    assert counted["counted"] and counted["documents"] == docs < 50_000 and counted["rounds"] >= -(-docs // 4)
    row = gc.ttt_projection_row(0.49e-3, 0.0, len(tokens), hp, lora_timings=(1e-3, 1e-3), lora_work=counter)
    assert f"TTT_MODE=lora, {docs} documents counted from the val data, {counted['rounds']} rounds of " in row.value
    assumed = lora_work_at(hp, len(tokens), 1, None, 50_000)
    row = gc.ttt_projection_row(0.49e-3, 0.0, len(tokens), hp, lora_timings=(1e-3, 1e-3), lora_work=assumed)
    assert "TTT_MODE=lora, 50,000 documents assumed (no DATA_PATH: the challenge's val split)" in row.value
    assert torch.equal(tokens, mixed_stream(sp, 1200))  # counting left the stream as it was


def test_exit_code_is_0_with_warnings_and_1_with_a_fail(monkeypatch, capsys):
    gc = gpu_check_module()
    rows = [gc.Row("a", "x"), gc.Row("b", "y", warn="slower")]
    gc.print_table(rows)
    out = capsys.readouterr().out
    assert out.splitlines()[0].startswith("ok   a") and out.splitlines()[1].startswith("WARN b")
    assert "-> slower" in out


def test_cpu_twin_with_a_batch_that_does_not_split_into_sequences_is_one_line_exit_2():
    proc = run_check("--cpu-twin", **{**TWIN_ENV, "TRAIN_BATCH_TOKENS": "250"})
    assert proc.returncode == 2 and proc.stdout == "", proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr and len(proc.stderr.strip().splitlines()) == 1
    assert proc.stderr.startswith("error: TRAIN_BATCH_TOKENS=250: expected a multiple of")


# ----------------------------------------------------------------------------------------------- inputs and size


def test_cpu_twin_defaults_to_a_small_shape_that_fits_and_env_settings_win(monkeypatch):
    """`--cpu-twin` ran the default preset's shape (524,288 tokens per step, vocab 8192): OOM-killed at
    ~15-23 GB with no output on a 24 GB machine."""
    from tools.bench import cpu_twin_size as size

    hp = size.cpu_twin_settings(False, environ={})
    assert (hp.num_layers, hp.model_dim, hp.train_seq_len, hp.train_batch_tokens) == (2, 128, 128, 2048)
    assert hp.vocab_size == 1024 and hp.num_threads == 1  # synthetic tokens: a small vocabulary too
    assert size.estimate_cpu_twin_bytes(hp) < 2 * 2**30
    mine = size.cpu_twin_settings(False, environ={"NUM_LAYERS": "3", "VOCAB_SIZE": "2048"})
    assert (mine.num_layers, mine.model_dim, mine.vocab_size) == (3, 128, 2048)
    preset = size.cpu_twin_settings(True, environ={"NUM_LAYERS": "2", "TRAIN_BATCH_TOKENS": "16384",
                                                   "XSA_LAST_N": "1"})
    assert (preset.model_dim, preset.train_seq_len, preset.vocab_size) == (512, 2048, 8192)  # the preset's own
    full = default_settings()
    need = size.estimate_cpu_twin_bytes(full)
    assert need > 24 * 2**30  # the default preset on a CPU: more than the machine the issue was found on
    monkeypatch.setattr(size, "available_memory_bytes", lambda: 24 * 2**30)
    with pytest.raises(ValueError, match=r"^--cpu-twin --preset-size: PRESET=1xh100-sp8192's shape \(NUM_LAYERS=\d+ "
                                         r"MODEL_DIM=512 TRAIN_SEQ_LEN=2048 TRAIN_BATCH_TOKENS=524,288 VOCAB_SIZE=8192\) "
                                         r"needs about \d+\.\d GiB, this machine has 24\.0 GiB available; expected a "
                                         r"shape that fits: `python tools/gpu_check.py --cpu-twin` \(a small shape\)$"):
        size.cpu_twin_settings(True, environ={})
    monkeypatch.undo()
    assert 0 < size.available_memory_bytes() <= os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def default_settings():
    from primitives.settings import Hyperparameters

    return Hyperparameters.from_env({}, log=lambda msg: None)


def test_a_bad_shard_is_refused_before_anything_is_allocated(tmp_path, monkeypatch, capsys, sp1024_model):
    """--cpu-twin on data with a bad shard was OOM-killed with no output; the data is now checked first,
    by the trainer's checks, and nothing is trained or allocated."""
    from shards.format import write_data_shard

    gc = gpu_check_module()
    ids = [1] + [5] * 300
    write_data_shard(tmp_path / "fineweb_val_000000.bin", ids)
    write_data_shard(tmp_path / "fineweb_train_000000.bin", ids[:-1] + [5000])
    for key in [k for k in os.environ if k.startswith(("PRESET", "DATA_PATH", "TOKENIZER_PATH", "VOCAB_SIZE"))]:
        monkeypatch.delenv(key)
    monkeypatch.setenv("PRESET", "smoke")
    monkeypatch.setenv("DATA_PATH", str(tmp_path))
    monkeypatch.setenv("TOKENIZER_PATH", str(sp1024_model))

    def allocated(*args, **kwargs):
        raise AssertionError("a model or a loader was built before the data was checked")

    monkeypatch.setattr(gc, "training_rows", allocated)
    monkeypatch.setattr(gc, "SyntheticLoader", allocated)
    monkeypatch.setattr(gc.trainer_loader, "DistributedTokenLoader", allocated)
    assert gc.main(["--cpu-twin"]) == 2
    captured = capsys.readouterr()
    assert captured.err == (f"error: DATA_PATH={str(tmp_path)!r}: train shard fineweb_train_000000.bin holds token id "
                            "5000; expected ids < VOCAB_SIZE=1024\n")
    assert "ok " not in captured.out  # no table: nothing ran
    monkeypatch.setenv("DATA_PATH", str(tmp_path / "missing"))
    assert gc.main(["--cpu-twin"]) == 2
    assert capsys.readouterr().err.startswith(f"error: DATA_PATH={str(tmp_path / 'missing')!r}: no such file or folder")
