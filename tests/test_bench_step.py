"""tools/bench_step.py and tools/bench/step_twin.py on a CPU: the one-line exits, the reference's settings and log
parsing, the table; the CUDA codegen twin when the `triton` package is installed (skipped otherwise)."""

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from tools.bench import bench_step  # noqa: E402
from primitives.settings import Hyperparameters  # noqa: E402

HAS_TRITON = importlib.util.find_spec("triton") is not None
OFFICIAL_LOG = """step:1/60 train_loss:16.77 train_time:390ms step_avg:390.00ms
step:10/60 train_loss:7.0674 train_time:3719ms step_avg:371.91ms
step:60/60 train_loss:5.3902 train_time:22319ms step_avg:371.98ms
peak memory allocated: 10240 MiB reserved: 10500 MiB
"""


def run_tool(*args, **env):
    full = {k: v for k, v in os.environ.items() if not k.startswith(("PRESET", "DATA_PATH"))}
    full.update(env, PYTHONPATH=str(REPO))
    return subprocess.run([sys.executable, str(REPO / "tools/bench_step.py"), *args], cwd=REPO, env=full,
                          capture_output=True, text=True, timeout=300)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only message")
def test_without_cuda_one_line_and_exit_2():
    proc = run_tool("--reference", "x.py", "--profile")
    assert proc.returncode == 2 and proc.stdout == ""
    assert re.fullmatch(r"bench_step: needs a CUDA GPU \(torch \S+ sees none\); .*--cpu-twin`\n", proc.stderr)


def test_a_batch_that_does_not_split_is_one_line_exit_2():
    proc = run_tool("--cpu-twin", PRESET="smoke", TRAIN_BATCH_TOKENS="250", TRAIN_SEQ_LEN="64")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr and len(proc.stderr.strip().splitlines()) == 1
    assert proc.stderr.startswith("error: TRAIN_BATCH_TOKENS=250: expected a multiple of")


@pytest.mark.skipif(HAS_TRITON, reason="checks the message of a torch without triton")
def test_cpu_twin_without_triton_says_so_in_one_line():
    proc = run_tool("--cpu-twin", PRESET="smoke")
    assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1
    assert "has no triton" in proc.stderr and "pip install --target" in proc.stderr


def test_reference_env_uses_the_challenge_names_and_our_shape():
    hp = Hyperparameters.from_env({"NUM_LAYERS": "9", "MLP_MULT": "2", "TRAIN_SEQ_LEN": "1024"}, log=lambda m: None)
    env = bench_step.reference_env(hp, 60)
    assert env["NUM_LAYERS"] == "9" and env["MLP_MULT"] == "2" and env["TRAIN_SEQ_LEN"] == "1024"
    assert env["MODEL_DIM"] == str(hp.model_dim) and env["VOCAB_SIZE"] == str(hp.vocab_size)
    assert env["TRAIN_BATCH_TOKENS"] == str(hp.train_batch_tokens) and env["ITERATIONS"] == "60"
    assert env["MAX_WALLCLOCK_SECONDS"] == "0" and env["VAL_LOSS_EVERY"] == "0"


def test_parse_reference_log_times_steps_10_to_n():
    side = bench_step.parse_reference_log(OFFICIAL_LOG, 524_288)
    assert side.ms_per_step == pytest.approx((22319 - 3719) / 50) and side.peak_gib == 10.0
    assert side.tokens_per_second == pytest.approx(524_288 / 0.372)
    with pytest.raises(ValueError, match="need step lines"):
        bench_step.parse_reference_log("step:10/60 train_loss:1 train_time:5ms", 1)


def test_table_has_both_sides_one_flop_count_and_the_ratio(capsys):
    sides = [bench_step.Side("kit", 414.0, 524_288, 11.8), bench_step.Side("reference", 372.0, 524_288, None)]
    bench_step.print_table(sides, 3.0e9, 989e12)
    out = capsys.readouterr().out.splitlines()
    assert out[1].split()[:2] == ["kit", "414.0"] and out[1].endswith("1.11x")
    assert out[2].split()[:2] == ["reference", "372.0"] and "n/a" in out[2] and out[2].endswith("1.00x")
    assert "3.000 GFLOP per token" in out[3]


@pytest.mark.slow
@pytest.mark.skipif(not HAS_TRITON, reason="needs the triton package (no GPU): pip install --target DIR triton")
def test_cpu_twin_generates_cuda_code_and_sees_a_float32_residual(tmp_path, monkeypatch):
    """The codegen twin at a toy shape: with the kit's bf16 residual stream the forward allocates no float32
    [tokens x hidden] buffer; with a float32 one (the old code) it does, and forward + backward move more bytes."""
    import model.gpt as trainer_model
    from tools.bench.step_twin import generate_cuda_step, kernel_stats

    config = dict(vocab_size=512, num_layers=2, model_dim=128, num_heads=4, num_kv_heads=2, mlp_mult=2.0, rope_dims=16)
    now = {k: kernel_stats(p) for k, p in generate_cuda_step(config, 4, 128, tmp_path / "now").items()}
    monkeypatch.setattr(trainer_model, "residual_dtype", lambda x: torch.float32)
    old = {k: kernel_stats(p) for k, p in generate_cuda_step(config, 4, 128, tmp_path / "old").items()}
    assert sum(m.bytes_moved for m in old.values()) > sum(m.bytes_moved for m in now.values())
    assert now["forward"].full_size_fp32(512, 128) == [] and len(old["forward"].full_size_fp32(512, 128)) >= 2


@pytest.mark.slow
@pytest.mark.skipif(not HAS_TRITON, reason="needs the triton package (no GPU): pip install --target DIR triton")
def test_cpu_twin_the_embedding_gather_keeps_no_float32_copy_of_the_tokens(tmp_path, monkeypatch):
    """Gathering from the float32 table and casting after (the old path) made Inductor keep the float32 gather
    [B, T, D] and re-read it in every block to rebuild x0; embed_as gathers bf16 (same values, same gradient)."""
    import torch.nn.functional as F

    import model.gpt as trainer_model
    from tools.bench.step_twin import generate_cuda_step, kernel_stats

    config = dict(vocab_size=512, num_layers=2, model_dim=128, num_heads=4, num_kv_heads=2, mlp_mult=2.0, rope_dims=16)
    now = {k: kernel_stats(p) for k, p in generate_cuda_step(config, 4, 128, tmp_path / "now").items()}
    monkeypatch.setattr(trainer_model, "embed_as", lambda ids, weight, dtype: F.embedding(ids, weight).to(dtype))
    old = {k: kernel_stats(p) for k, p in generate_cuda_step(config, 4, 128, tmp_path / "old").items()}
    assert old["forward"].full_size_fp32(512, 128) == [(4, 128, 128)] and now["forward"].full_size_fp32(512, 128) == []
    for part in ("forward", "backward"):
        assert now[part].bytes_moved < old[part].bytes_moved, part


@pytest.mark.slow
@pytest.mark.skipif(not HAS_TRITON, reason="needs the triton package (no GPU): pip install --target DIR triton")
def test_cpu_twin_the_hand_written_backwards_move_fewer_bytes_than_autograds(tmp_path, monkeypatch):
    """The loss's logits gradient made in the forward saves one read of the [N, V] logits (Inductor cannot move
    work from the backward into the forward), and the q gain's gradient from the QK-norm backward's own row sum
    saves writing the rotated queries and a separate reduction over them."""
    import model.gpt as trainer_model
    from tests.test_attn_ops import plain_loss, plain_qk
    from tools.bench.step_twin import generate_cuda_step, kernel_stats

    config = dict(vocab_size=2048, num_layers=2, model_dim=128, num_heads=4, num_kv_heads=2, mlp_mult=2.0,
                  rope_dims=16)

    def total(name):
        return sum(kernel_stats(p).bytes_moved for p in generate_cuda_step(config, 4, 128, tmp_path / name).values())

    now = total("now")
    monkeypatch.setattr(trainer_model, "head_softcap_cross_entropy", plain_loss)
    plain_head = total("loss")
    monkeypatch.setattr(trainer_model, "qk_norm_rope", plain_qk)
    plain_both = total("both")
    logits_bytes = 4 * 128 * 2048 * 2  # bf16 [N, V]
    assert plain_head - now >= 0.9 * logits_bytes, (plain_head, now)
    assert plain_both > plain_head, (plain_both, plain_head)


def test_kernel_stats_finds_the_in_place_outputs_inductors_estimate_charges_as_read(tmp_path):
    """Inductor's kernel_num_gb counts an in_out_ptr twice; where the kernel never loads it, that read is
    reported apart (bytes from the call's buffer: an allocation, a view, a reuse, an input's size assert)."""
    from tools.bench.step_twin import kernel_stats

    def kernel(name, loads_in_out, gb):
        load = "    tmp1 = tl.load(in_out_ptr0 + (x0), None)\n" if loads_in_out else ""
        return (f"{name} = async_compile.triton('{name}', '''\n@triton_heuristics.pointwise(\n"
                f"    triton_meta={{'signature': {{'in_out_ptr0': '*bf16', 'in_ptr0': '*fp32', 'xnumel': 'i32'}}, "
                f"'device': 0}},\n    inductor_meta={{'kernel_num_gb': {gb}}},\n)\n@triton.jit\n"
                f"def {name}(in_out_ptr0, in_ptr0, xnumel, XBLOCK : tl.constexpr):\n"
                f"    tmp0 = tl.load(in_ptr0 + (x0), None)\n{load}    tl.store(in_out_ptr0 + (x0), tmp0, None)\n"
                "''', device_str='cuda')\n")

    body = """
def call(args):
    primals_1, primals_2 = args
    assert_size_stride(primals_1, (8, 16), (16, 1))
    assert_size_stride(primals_2, (4, 4), (4, 1))
    buf0 = empty_strided_cuda((8, 16), (16, 1), torch.bfloat16)
    buf1 = buf0; del buf0  # reuse
    triton_poi_write_only.run(buf1, primals_1, 128, stream=stream0)
    triton_poi_write_only.run(reinterpret_tensor(primals_1, (2, 16), (16, 1), 0), primals_1, 32, stream=stream0)
    triton_poi_reads.run(primals_2, primals_2, 16, stream=stream0)
"""
    path = tmp_path / "module.py"
    path.write_text(kernel("triton_poi_write_only", False, 1e-6) + kernel("triton_poi_reads", True, 1e-7)
                    + "async_compile.wait(globals())\n" + body + "def benchmark_compiled_module():\n    pass\n")
    stats = kernel_stats(path)
    by_name = {k.name: k for k in stats.kernels}
    assert by_name["triton_poi_write_only"].launches == 2 and by_name["triton_poi_reads"].launches == 1
    assert by_name["triton_poi_write_only"].unread_inplace_bytes == 2 * (8 * 16 + 2 * 16)
    assert by_name["triton_poi_reads"].unread_inplace_bytes == 0
    assert stats.unread_inplace_bytes == 320 and stats.bytes_moved == 2 * 1e3 + 1e2


def test_kernel_stats_names_launched_kernels_without_a_byte_estimate(tmp_path):
    """A combo kernel (combo_kernels=True) has no kernel_num_gb: its bytes count 0, so it is named, not hidden."""
    from tools.bench.step_twin import kernel_stats

    def kernel(name, meta):
        return (f"{name} = async_compile.triton('{name}', '''\n@triton_heuristics.pointwise(\n"
                f"    triton_meta={{'signature': {{'in_ptr0': '*fp32', 'out_ptr0': '*fp32', 'xnumel': 'i32'}}, "
                f"'device': 0}},\n    inductor_meta={meta},\n)\n@triton.jit\n"
                f"def {name}(in_ptr0, out_ptr0, xnumel, XBLOCK : tl.constexpr):\n    pass\n''', device_str='cuda')\n")

    body = ("\ndef call(args):\n    triton_poi_fused_0.run(a, b, 16, stream=stream0)\n"
            "    triton_poi_fused_add_1.run(a, b, 16, stream=stream0)\n")
    path = tmp_path / "module.py"
    path.write_text(kernel("triton_poi_fused_0", "{}") + kernel("triton_poi_fused_add_1", "{'kernel_num_gb': 1e-6}")
                    + kernel("triton_poi_unused_2", "{}") + "async_compile.wait(globals())\n" + body
                    + "def benchmark_compiled_module():\n    pass\n")
    stats = kernel_stats(path)
    assert stats.unestimated == ["triton_poi_fused_0"] and stats.bytes_moved == 1e3


def test_top_kernels_ranks_by_the_bytes_of_all_launches():
    from tools.bench.bench_twin import top_kernels
    from tools.bench.step_twin import Kernel, ModuleStats

    kernels = [Kernel("a", "", 100 * 2**20, 1, "pointwise"), Kernel("b", "", 30 * 2**20, 7, "persistent_reduction"),
               Kernel("c", "", 2**30, 0, "pointwise")]  # c: never launched
    lines = top_kernels(ModuleStats(kernels, [], 0), 2)
    assert [line.split()[-1] for line in lines] == ["b", "a"]
    assert lines[0].split()[:5] == ["0.205", "GiB", "7", "x", "30.0"]


def test_beside_a_reference_the_kit_runs_the_official_micro_batch_unless_one_is_set():
    from primitives.settings import Hyperparameters
    from tools.bench.bench_step import official_micro_batch

    hp = Hyperparameters.from_env({}, log=lambda *_: None)
    assert hp.resolve_grad_accum(1, True) == 4 and official_micro_batch(hp).resolve_grad_accum(1, True) == 8
    mine = Hyperparameters.from_env({"GRAD_ACCUM_STEPS": "2"}, log=lambda *_: None)
    assert official_micro_batch(mine).grad_accum_steps == 2


def test_parse_reference_log_reads_pr1855s_step_lines():
    """PR #1855 prints `N/M train_loss: L train_time: T.Tm tok/s: R` for steps 1-5 and the last, R the running
    N x tokens / seconds: ms/step from step 5 to the last."""
    log = "".join(f"{n}/12 train_loss: 9.0 train_time: 0.0m tok/s: {round(n * 786_432 / (0.5 + 0.12 * n))}\n"
                  for n in (1, 2, 3, 4, 5, 12)) + "peak memory allocated: 40960 MiB reserved: 41000 MiB\n"
    side = bench_step.parse_reference_log(log, 786_432)
    assert side.ms_per_step == pytest.approx(120.0, rel=1e-5) and side.peak_gib == 40.0
