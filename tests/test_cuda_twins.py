"""CPU twins of the CUDA path (issue 9): each test fails the way an H100 run would.

- The flash stand-in (tools/bench/flash_twin.py) enforces flash-attn's contract; `attention()` must hand it
  one fp16/bf16 dtype under autocast even when rms_norm returned float32 q/k (CUDA autocast from
  torch 2.12, reproduced on CPU by `cuda_autocast_rms_norm`).
- FLOP counting on the meta device must never reach the flash kernel (FA3's fake backward queries
  the CUDA device and raises on meta).
- The batched Muon equals torch.optim.Muon.
- The training step compiles with Inductor, fullgraph, with no graph break, exactly one recompile when
  QAT starts (the QAT-off graph has no fake-quant op) and none across eval batches.
"""

import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import train_gpt

import model.attention as trainer_attention
import trainer.context as trainer_context
import shards.loader as trainer_loader
import trainer.loop as trainer_loop
from quant.policy import QuantPolicy
from tools.bench.flash_twin import cuda_autocast_rms_norm, flash_attn_standin, plugged_flash_standin
from model.attention import attention
from model.gpt import GPT, build_model_config, count_train_flops_per_token
from trainer.optim import Muon, newton_schulz
from primitives.settings import Hyperparameters

TINY = dict(vocab_size=64, num_layers=2, model_dim=64, num_heads=4, num_kv_heads=2, mlp_mult=2.0, rope_dims=8,
            xsa_last_n=1)


def tiny_model(seed=0, qat=False):
    torch.manual_seed(seed)
    model = GPT(**TINY)
    model.init_weights()
    if qat:
        model.configure_qat(QuantPolicy())
    return model


def sdpa_reference(q, k, v):
    return F.scaled_dot_product_attention(q.float().transpose(1, 2), k.float().transpose(1, 2),
                                          v.float().transpose(1, 2), is_causal=True, enable_gqa=True).transpose(1, 2)


# ----------------------------------------------------------------------------------------------- stand-in


@pytest.mark.parametrize("how, message", [
    ("fp32", "only support fp16 and bf16"),
    ("mixed", "must have the same dtype"),
    ("heads", "must divide number of heads"),
    ("headdim", "multiple of 8"),
    ("noncausal", "causal"),
    ("3d", r"\[B, T, H, D\]"),
])
def test_standin_refuses_what_flash_attn_refuses(how, message):
    q, k, v = (torch.randn(2, 16, h, 16, dtype=torch.bfloat16) for h in (4, 2, 2))
    kwargs = {"causal": True}
    if how == "fp32":
        q, k, v = q.float(), k.float(), v.float()
    elif how == "mixed":
        q = q.half()
    elif how == "heads":
        k, v = (torch.randn(2, 16, 3, 16, dtype=torch.bfloat16) for _ in range(2))
    elif how == "headdim":
        q, k, v = (x[..., :12].contiguous() for x in (q, k, v))
    elif how == "noncausal":
        kwargs = {"causal": False}
    elif how == "3d":
        q, k, v = q[0], k[0], v[0]
    with pytest.raises(RuntimeError, match=message):
        flash_attn_standin(q, k, v, **kwargs)


def test_standin_matches_sdpa_forward_and_backward_with_gqa():
    q, k, v = (torch.randn(2, 16, h, 16, dtype=torch.bfloat16, requires_grad=True) for h in (4, 2, 2))
    out = flash_attn_standin(q, k, v, causal=True)
    assert out.dtype == torch.bfloat16 and out.shape == q.shape
    torch.testing.assert_close(out.float(), sdpa_reference(q, k, v), atol=2e-2, rtol=2e-2)
    out.float().square().sum().backward()
    leaves = [x.detach().float().requires_grad_() for x in (q, k, v)]
    sdpa_reference(*leaves).square().sum().backward()
    for x, ref in zip((q, k, v), leaves):
        torch.testing.assert_close(x.grad.float(), ref.grad, atol=5e-2, rtol=5e-2)


# ----------------------------------------------------------------------------------------------- defect 1


def test_attention_hands_flash_one_half_dtype_when_rms_norm_returned_fp32():
    """Defect 1: under bf16 autocast, fp32 q/k (CUDA rms_norm from torch 2.12) beside a bf16 v."""
    torch.manual_seed(0)
    q, k = torch.randn(2, 16, 4, 16), torch.randn(2, 16, 2, 16)
    v = torch.randn(2, 16, 2, 16).bfloat16()
    with plugged_flash_standin(), torch.autocast("cpu", torch.bfloat16):
        y = attention(q, k, v)
    assert y.dtype == torch.bfloat16
    torch.testing.assert_close(y.float(), sdpa_reference(q, k, v.float()), atol=3e-2, rtol=3e-2)


def test_cpu_autocast_twin_reproduces_cuda_fp32_rms_norm():
    x = torch.nn.Linear(8, 8)(torch.randn(3, 8))
    with torch.autocast("cpu", torch.bfloat16):
        plain = F.rms_norm(torch.nn.Linear(8, 8)(torch.randn(3, 8)), (8,))
        with cuda_autocast_rms_norm():
            twin = F.rms_norm(torch.nn.Linear(8, 8)(torch.randn(3, 8)), (8,))
    assert plain.dtype == torch.bfloat16 and twin.dtype == torch.float32 and x.dtype == torch.float32


def test_model_trains_through_flash_standin_under_cuda_like_autocast():
    """The whole forward/backward as an H100 with torch >= 2.12 runs it: bf16 autocast, fp32 rms_norm,
    flash kernel; the loss matches the fp32 SDPA loss at bf16 tolerance and every gradient is finite."""
    model = tiny_model()
    x = torch.randint(0, 64, (2, 32), generator=torch.Generator().manual_seed(1))
    reference = model(x, x).item()
    with plugged_flash_standin(), cuda_autocast_rms_norm(), torch.autocast("cpu", torch.bfloat16):
        loss = model(x, x)
    loss.backward()
    assert loss.item() == pytest.approx(reference, rel=2e-2)
    assert all(torch.isfinite(p.grad).all() for p in model.parameters())


# ----------------------------------------------------------------------------------------------- defect 2


def test_flop_count_runs_sdpa_on_meta_whatever_backend_is_plugged():
    """Defect 2: with the flash stand-in selected (its fake backward raises on meta, like FA3's), the
    FLOP count still runs and counts attention as SDPA does (the same number as without flash)."""
    config = build_model_config(Hyperparameters(num_layers=2, model_dim=128, num_heads=2, num_kv_heads=1,
                                                rope_dims=16, xsa_last_n=1))
    plain = count_train_flops_per_token(config, 256)
    with plugged_flash_standin():
        counted = count_train_flops_per_token(config, 256)
    assert counted == plain
    attention_flops = 2 * 3 * 2 * 2 * 256 * 128  # layers x (fwd + 2 bwd) x (QK^T, AV) x 2 flops x T x d
    assert counted > attention_flops


# ----------------------------------------------------------------------------------------------- Muon


def test_batched_muon_equals_torch_muon_on_a_layer_of_1xh100_shapes():
    """One 1xh100 layer's block matrices (c_q, c_k, c_v, proj, fc, mlp.proj), scaled down 8x (bf16
    matmuls are slow on a CPU; tools/bench_muon.py runs the real shapes): square, wide and tall
    matrices, with two same-shape pairs that go through one batched Newton-Schulz."""
    torch.manual_seed(0)
    shapes = [(64, 64), (32, 64), (32, 64), (64, 64), (192, 64), (64, 192)]
    ref_params = [torch.nn.Parameter(torch.randn(*s) * 0.02) for s in shapes]
    our_params = [torch.nn.Parameter(p.detach().clone()) for p in ref_params]
    ref = torch.optim.Muon(ref_params, lr=0.032, momentum=0.95, weight_decay=0.02, ns_steps=5, adjust_lr_fn="original")
    ours = Muon(our_params, lr=0.032, momentum=0.95, weight_decay=0.02, ns_steps=5)
    for step, momentum in enumerate((0.92, 0.95, 0.99)):
        for group in ref.param_groups + ours.param_groups:
            group["momentum"], group["lr"] = momentum, 0.032 * (1 - step / 4)
        for a, b in zip(ref_params, our_params):
            a.grad = torch.randn_like(a)
            b.grad = a.grad.clone()
        ref.step()
        ours.step()
        for a, b in zip(ref_params, our_params):
            torch.testing.assert_close(b, a, atol=1e-7, rtol=0)
    for a, b in zip(ref_params, our_params):
        torch.testing.assert_close(ours.state[b]["momentum_buffer"], ref.state[a]["momentum_buffer"], atol=0, rtol=0)


def test_newton_schulz_batches_equal_one_matrix_at_a_time():
    torch.manual_seed(0)
    g = torch.randn(5, 96, 64)
    batched = newton_schulz(g, 5)
    single = torch.stack([newton_schulz(m[None], 5)[0] for m in g])
    assert batched.dtype == torch.bfloat16 and batched.shape == g.shape
    torch.testing.assert_close(batched, single, atol=0, rtol=0)
    # orthogonalized: singular values in Muon's band around 1 (Keller Jordan: roughly 0.5 .. 1.5)
    s = torch.linalg.svdvals(batched.float())
    assert s.min() > 0.3 and s.max() < 1.6


# ----------------------------------------------------------------------------------------------- autocast run


def test_bf16_autocast_switch_resolves_per_device():
    hp = Hyperparameters(autocast="bf16")
    with pytest.raises(ValueError, match="AUTOCAST='fp8': expected one of auto, bf16, none"):
        Hyperparameters(autocast="fp8", run_id="x").validate()
    assert hp.autocast == "bf16"


# ----------------------------------------------------------------------------------------------- compiled step

STEP_TINY = dict(num_layers=2, model_dim=64, num_heads=4, num_kv_heads=4, mlp_mult=1.0, rope_dims=8, xsa_last_n=1,
                 vocab_size=1024, train_seq_len=32, train_batch_tokens=128, iterations=6, max_wallclock_seconds=0.0,
                 warmup_steps=0, qat_start_frac=0.5, muon_momentum_warmup_steps=4, train_log_every=100, seed=3)


def run_train_in_process(tiny_dataset, tmp_path, *, compile, autocast_dtype, **overrides):
    """trainer_loop.train() with the trainer's own compiled objects; returns (losses, the log lines)."""
    hp = Hyperparameters(**{**STEP_TINY, **overrides}, data_path=str(tiny_dataset))
    lines = []
    ctx = trainer_context.RunContext(0, 1, 0, torch.device("cpu"), tmp_path, autocast_dtype, compile)
    ctx.log = lambda msg="", console=True: lines.append(msg)
    torch.manual_seed(hp.seed)
    model = GPT(**build_model_config(hp))
    model.init_weights()
    model.configure_qat(QuantPolicy())
    loader = trainer_loader.DistributedTokenLoader(hp.data_path, hp.vocab_size)
    result = trainer_loop.train(ctx, hp, model, loader, flops_per_token=1.0)
    steps, losses, signum = result.steps, result.train_losses, result.stop_signal
    assert steps == hp.iterations and signum == 0
    return model, losses, lines


@pytest.mark.slow
def test_compiled_training_step_has_no_graph_break_and_one_recompile_at_the_qat_flip(tiny_dataset, tmp_path):
    """Inductor on CPU, fullgraph: the model's forward+backward (QAT off, then on; the flash stand-in
    under bf16 autocast with fp32 rms_norm, as on an H100) and Muon's batched Newton-Schulz compile once
    each; the QAT flip at step 3 (no warmup steps to compile it before) compiles exactly one more graph,
    the changing lr/momentum nothing; eval batches share one graph. AdamW (fused on CUDA) and the EMA
    (one foreach lerp) stay eager."""
    from torch._dynamo.utils import counters

    model = tiny_model(qat=True)
    x = torch.randint(0, 64, (2, 32), generator=torch.Generator().manual_seed(0))
    for gate in (False, True):  # explain: eager backend, both QAT states
        model.set_qat(gate)
        assert torch._dynamo.explain(model)(x, x).graph_break_count == 0
    torch._dynamo.reset()
    counters.clear()
    with plugged_flash_standin(), cuda_autocast_rms_norm():
        model, losses, lines = run_train_in_process(tiny_dataset, tmp_path, compile=True,
                                                    autocast_dtype=torch.bfloat16)
    assert any(line.startswith("late_qat:on step:3") for line in lines)
    assert all(math.isfinite(v) for v in losses) and len(losses) == 6
    assert sum(counters["graph_break"].values()) == 0
    # one graph for the training forward (its backward is compiled with it by AOTAutograd), one for
    # Newton-Schulz (every block matrix is 64 x 64) and the QAT-on forward at the flip: one recompile
    assert counters["stats"]["unique_graphs"] == 3, dict(counters["stats"])
    from eval.sliding import eval_sliding

    model.eval()
    tokens = torch.randint(0, 1024, (32 * 12 + 1,), generator=torch.Generator().manual_seed(1))
    luts = (torch.ones(1024, dtype=torch.int16), torch.zeros(1024, dtype=torch.bool), torch.zeros(1024, dtype=torch.bool))
    with plugged_flash_standin():
        result = eval_sliding(model, tokens, luts, seq_len=32, stride=16, batch_seqs=4, device="cpu",
                              autocast_dtype=torch.bfloat16, compile_model=True, log=lambda msg: None)
    assert result["num_scored_tokens"] == 32 * 12 and math.isfinite(result["val_loss"])
    assert counters["stats"]["unique_graphs"] == 4, dict(counters["stats"])  # 6 eval batches, one graph
    assert sum(counters["graph_break"].values()) == 0


@pytest.mark.slow
def test_training_steps_under_cpu_bf16_autocast_end_finite_and_near_fp32(tiny_dataset, tmp_path):
    """AUTOCAST=bf16 on CPU with the H100's attention path (flash stand-in, fp32 rms_norm): a few
    steps end with finite losses that track the fp32 run's."""
    _, fp32_losses, _ = run_train_in_process(tiny_dataset, tmp_path, compile=False, autocast_dtype=None)
    with plugged_flash_standin(), cuda_autocast_rms_norm():
        _, bf16_losses, _ = run_train_in_process(tiny_dataset, tmp_path, compile=False, autocast_dtype=torch.bfloat16)
    assert all(math.isfinite(v) for v in bf16_losses)
    assert bf16_losses == pytest.approx(fp32_losses, rel=0.03)


# ----------------------------------------------------------------------------------------------- backend choice


def test_cuda_without_flash_attn_falls_back_to_sdpa_with_a_warning(monkeypatch):
    """On a CUDA device whose flash-attn does not import (missing, or built for another torch), the run
    says so in a WARNING line instead of silently running slower."""
    import importlib

    def broken_import(name):
        raise ImportError(f"{name}: undefined symbol: _ZN3c104cuda9SetDeviceEi (built for another torch)")

    monkeypatch.setattr(importlib, "import_module", broken_import)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    lines = []
    saved = trainer_attention._FLASH_ATTN[:]
    try:
        assert trainer_attention.resolve_attention_backend("auto", torch.device("cuda"), lines.append) == "sdpa"
    finally:
        trainer_attention._SDPA_PRIORITY.close()
    assert trainer_attention._FLASH_ATTN == saved
    assert len(lines) == 2 and lines[0].startswith("WARNING: attention falls back to PyTorch SDPA")
    assert lines[1].startswith("attention:sdpa priority cudnn_attention > flash_attention")
    assert "flash_attn_interface: flash_attn_interface: undefined symbol" in lines[0] and "flash_attn: " in lines[0]
    with pytest.raises(ValueError, match="ATTN_BACKEND='fa3': cannot use flash_attn_interface"):
        trainer_attention.resolve_attention_backend("fa3", torch.device("cuda"), lines.append)


@pytest.mark.parametrize("capability, first", [((9, 0), "CUDNN_ATTENTION"), ((10, 0), "CUDNN_ATTENTION"),
                                               ((8, 0), "FLASH_ATTENTION"), ((8, 9), "FLASH_ATTENTION")])
def test_sdpa_priority_puts_cudnn_first_on_hopper_and_sets_the_process_order(capability, first):
    """The CUDA-only SDPA order, on a CPU: capability mocked, the order read back from torch's global state."""
    from torch.nn.attention import SDPBackend

    before = torch._C._get_sdp_priority_order()
    lines = []
    try:
        text = trainer_attention.set_sdpa_priority(capability, lines.append)
        order = torch._C._get_sdp_priority_order()[:4]
        assert order[0] == int(getattr(SDPBackend, first)) and order[-1] == int(SDPBackend.MATH) and len(set(order)) == 4
        assert text == " > ".join(b.name.lower() for i in order for b in SDPBackend.__members__.values() if int(b) == i)
        major, minor = capability
        assert text.startswith(first.lower()) and lines == [f"attention:sdpa priority {text} (sm_{major}{minor})"]
        q, k = torch.randn(1, 16, 4, 8), torch.randn(1, 16, 2, 8)  # the CPU still runs SDPA under the order
        assert trainer_attention.attention(q, k, k).shape == q.shape
        assert trainer_attention.sdpa_choice(q, k, k) in ("flash_attention", "math")
    finally:
        trainer_attention._SDPA_PRIORITY.close()
    assert torch._C._get_sdp_priority_order() == before


def test_flash_attn_stays_first_when_importable(monkeypatch):
    import importlib
    import types

    monkeypatch.setattr(importlib, "import_module", lambda name: types.SimpleNamespace(flash_attn_func=lambda *a, **k: None))
    saved = trainer_attention._FLASH_ATTN[:]
    lines = []
    try:
        assert trainer_attention.resolve_attention_backend("auto", torch.device("cuda"), lines.append) == "fa3"
    finally:
        trainer_attention._FLASH_ATTN[:] = saved
    assert lines == []


# ----------------------------------------------------------------------------------------------- DDP Muon

DDP_MUON_SCRIPT = r"""
import sys, torch, torch.distributed as dist
sys.path.insert(0, sys.argv[1])
from trainer.optim import Muon
dist.init_process_group("gloo")
torch.manual_seed(0)
shapes = [(32, 32), (16, 32), (16, 32), (32, 32), (96, 32), (32, 96), (32, 32)]
params = [torch.nn.Parameter(torch.randn(*s) * 0.02) for s in shapes]
single = [torch.nn.Parameter(p.detach().clone()) for p in params]
sharded = Muon(params, lr=0.03, momentum=0.95, weight_decay=0.02, rank=dist.get_rank(), world_size=dist.get_world_size())
alone = Muon(single, lr=0.03, momentum=0.95, weight_decay=0.02)
for _ in range(3):
    for a, b in zip(params, single):
        a.grad = torch.randn_like(a)
        b.grad = a.grad.clone()
    sharded.step()
    alone.step()
assert all(torch.equal(a, b) for a, b in zip(params, single)), "sharded Muon differs from one process"
print("rank", dist.get_rank(), "equal", flush=True)
dist.destroy_process_group()
import os
os._exit(0)  # as train_gpt.py: a finished gloo rank can abort in the interpreter's teardown (torch 2.13)
"""


@pytest.mark.slow
def test_muon_sharded_over_two_ranks_equals_one_process(tmp_path):
    """Each rank orthogonalizes its share of every shape group (3 matrices of 32x32 over 2 ranks: one
    padded share) and all-gathers: the parameters equal a single process's bit for bit."""
    import subprocess
    import sys

    script = tmp_path / "ddp_muon.py"
    script.write_text(DDP_MUON_SCRIPT)
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                           str(script), str(Path(train_gpt.__file__).parent)],
                          capture_output=True, text=True, timeout=300, env={**__import__("os").environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert proc.stdout.count("equal") == 2


def test_gpu_forward_comparison_is_sound_on_the_cpu_twin():
    """tests/test_gpu.py's CUDA-vs-CPU comparison, run as CPU bf16 autocast vs CPU fp32: the inputs give a
    realistic loss, bf16 passes the tolerance, and a real defect (a dropped block) does not."""
    from test_gpu import assert_bf16_agreement, forward_on, realistic_forward_inputs

    model, x, y = realistic_forward_inputs()
    ref_logits, ref_loss = forward_on(model, x, y, "cpu", autocast=False)
    logits, loss = forward_on(model, x, y, "cpu", autocast=True)
    assert not torch.equal(logits, ref_logits)  # bf16 really ran
    assert_bf16_agreement(logits, loss, ref_logits, ref_loss)
    model.blocks[1].attn.proj.weight.data.mul_(0)  # a defect the comparison must see (in the logits)
    broken, broken_loss = forward_on(model, x, y, "cpu", autocast=True)
    with pytest.raises(AssertionError):
        assert_bf16_agreement(broken, broken_loss, ref_logits, ref_loss)


# ----------------------------------------------------------------------------------------------- non-finite loss


def test_non_finite_watch_reads_a_snapshot_every_ten_steps_without_a_sync_and_names_the_first_bad_step():
    """The GPU form of the loss check, on a CPU: the flag stays on the device, a poll at step 10k reads the
    snapshot copied at step 10(k-1) (no sync), and the error names the first bad step, however late it is seen."""
    watch = trainer_loop.NonFiniteWatch(torch.device("cpu"), every=10, asynchronous=True)
    seen = None
    for step in range(40):
        watch.record(torch.tensor(float("nan") if step in (12, 15) else 1.0), step)
        try:
            watch.poll(step + 1)
        except trainer_loop.NonFiniteLossError as err:
            seen = (step + 1, str(err))
            break
    assert seen == (30, "non-finite train loss at step 13")  # copied after step 20, read at step 30
    with pytest.raises(trainer_loop.NonFiniteLossError, match="at step 13$"):
        watch.check()  # the live flag: what log steps and the end of training read
    watch.reset()
    watch.check()
    cpu = trainer_loop.NonFiniteWatch(torch.device("cpu"))  # on a CPU every poll reads the flag
    cpu.record(torch.tensor(float("inf")), 4)
    with pytest.raises(trainer_loop.NonFiniteLossError, match="at step 5$"):
        cpu.poll(5)


@pytest.mark.slow
def test_a_loss_gone_non_finite_after_the_last_snapshot_still_stops_training(tiny_dataset, tmp_path, monkeypatch):
    """With the GPU's snapshot check (every 10 steps, a snapshot read 10 steps after it is copied), no snapshot
    is read in a 14-step run: a loss gone NaN (after step 1's log, which reads the flag) is caught by the check
    at the end of training, before the EMA swap or anything is exported."""
    real = trainer_loop.NonFiniteWatch
    watches = []

    def asynchronous_watch(device):
        watches.append(real(device, asynchronous=True))
        return watches[-1]

    monkeypatch.setattr(trainer_loop, "NonFiniteWatch", asynchronous_watch)
    hp = Hyperparameters(**{**STEP_TINY, "iterations": 14, "scalar_lr": 1e30, "qat_start_frac": 0.0},
                         data_path=str(tiny_dataset))
    ctx = trainer_context.RunContext(0, 1, 0, torch.device("cpu"), tmp_path, None, False)
    ctx.log = lambda msg="", console=True: None
    torch.manual_seed(hp.seed)
    model = GPT(**build_model_config(hp))
    model.init_weights()
    loader = trainer_loader.DistributedTokenLoader(hp.data_path, hp.vocab_size)
    with pytest.raises(trainer_loop.NonFiniteLossError, match=r"non-finite train loss at step (\d+)") as err:
        trainer_loop.train(ctx, hp, model, loader, flops_per_token=1.0)
    first = int(str(err.value).rsplit(" ", 1)[1])
    assert 2 <= first <= 14 and watches[0].asynchronous
