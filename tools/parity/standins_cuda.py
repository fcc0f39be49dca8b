"""The rest of a record script's GPU world on a CPU, on top of tools/parity/standins.py's kernels: what
a whole `python train_gpt.py` run needs (the auditor's run probe, tools/auditor/audit_probe.py).

    with record_standins():
        runpy.run_path("records/.../train_gpt.py", run_name="__main__")

Inside record_standins(), besides cpu_standins() (FlashAttention and Triton as reference math,
torch.compile off):
- every tensor and module placed on "cuda" lands on the CPU (a TorchFunctionMode rewrites device
  arguments and drops pin_memory=True; .cuda() and .pin_memory() return the tensor;);
- torch.cuda's is_available (True), set_device, synchronize, memory counters, manual_seed, Event and
  get_device_properties (an H100's figures) are CPU stand-ins (Event times with time.perf_counter);
- torch.Generator(device="cuda") is a CPU generator (the self-generated GPTQ calibration of PR #1019's line);
- autocast on "cuda" is the CPU's autocast in the same dtype (bfloat16 by default);
- torch.inference_mode is torch.no_grad (no inference tensors for a TTT to trip over on the CPU);
- torch's SDPA backend switches (enable_flash_sdp, ...) are no-ops (they would leave the CPU no kernel);
- the fake Triton is handed to every importer but torch itself (an import hook; torch's own
  `import triton` still fails, so torch.compile/dynamo never take the fake for a real Triton);
- `nvidia-smi` on PATH prints one line;
- torch.distributed on gloo: init_process_group's "nccl" is "gloo" (device_id dropped), DDP's device_ids
  dropped, all_reduce's ReduceOp.AVG a SUM divided by the world size (gloo has no AVG), barrier's device_ids
  dropped: a script started as torchrun ranks (RANK, WORLD_SIZE, MASTER_ADDR/PORT) runs as CPU processes.
Everything is restored on exit. The device mode is per thread: threads started inside the block
enter it too (threading.Thread.run is wrapped).
"""

from __future__ import annotations

import builtins
import contextlib
import os
import sys
import tempfile
import threading
import time
import types
from pathlib import Path

import torch
from torch.overrides import TorchFunctionMode

from tools.parity.standins import H100_SM_COUNT, cpu_standins


def _cpu(device):
    if isinstance(device, int) and not isinstance(device, bool):
        return torch.device("cpu")
    if isinstance(device, (str, torch.device)) and str(device).startswith("cuda"):
        return torch.device("cpu")
    return device


class CudaOnCpu(TorchFunctionMode):
    """Rewrites every device argument naming CUDA to the CPU; .cuda() and .pin_memory() return the tensor."""

    def __torch_function__(self, func, types_, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if func in (torch.Tensor.cuda, torch.Tensor.pin_memory):
            return args[0]
        if "device" in kwargs:
            kwargs["device"] = _cpu(kwargs["device"])
        if kwargs.get("pin_memory"):
            kwargs["pin_memory"] = False
        if func is torch.Tensor.to:
            args = tuple(_cpu(a) for a in args)
        return func(*args, **kwargs)


class _Event:
    def __init__(self, *args, **kwargs):
        self.t = None

    def record(self, *args):
        self.t = time.perf_counter()

    def synchronize(self):
        pass

    def elapsed_time(self, end) -> float:
        return 1000.0 * ((end.t or 0.0) - (self.t or 0.0))


_REAL_GENERATOR = torch.Generator


class _CpuGenerator(_REAL_GENERATOR):
    """torch.Generator whose CUDA device is the CPU (isinstance checks against torch.Generator still hold)."""

    def __new__(cls, device="cpu"):
        return _REAL_GENERATOR.__new__(cls, device=_cpu(device))

    def __init__(self, device="cpu"):
        pass


_REAL_AUTOCAST = torch.autocast


class _CpuAutocast(contextlib.ContextDecorator):
    """torch.autocast: device_type "cuda" is the CPU's autocast with the same dtype (bfloat16 when none
    is given), so a script that mixes bf16 weights with fp32 activations under autocast still runs."""

    def __init__(self, device_type="cuda", dtype=None, enabled=True, cache_enabled=None):
        if str(device_type).startswith("cuda"):
            device_type, dtype = "cpu", dtype if dtype in (torch.bfloat16, torch.float16) else torch.bfloat16
        self.inner = _REAL_AUTOCAST(device_type, dtype=dtype, enabled=enabled, cache_enabled=cache_enabled)

    def __enter__(self):
        return self.inner.__enter__()

    def __exit__(self, *exc):
        return self.inner.__exit__(*exc)


class _NoGradInference(contextlib.ContextDecorator):
    """torch.inference_mode as torch.no_grad: the same results without inference tensors, which a script's
    TTT may reuse in autograd (a cache filled during scoring) where its compiled CUDA run did not."""

    def __init__(self, mode=True):
        self.mode, self.entered = mode, []

    def __enter__(self):  # a fresh no_grad per entry: a decorated function may call itself
        self.entered.append(torch.no_grad() if self.mode else contextlib.nullcontext())
        return self.entered[-1].__enter__()

    def __exit__(self, *exc):
        return self.entered.pop().__exit__(*exc)


def _inference_mode(mode=True):
    """torch.inference_mode(mode) / @torch.inference_mode() / bare @torch.inference_mode, as _NoGradInference."""
    return _NoGradInference()(mode) if callable(mode) else _NoGradInference(mode)


def _run_in_mode(real_run):
    def run(self):  # a thread started inside record_standins() redirects CUDA too (modes are per thread)
        with CudaOnCpu():
            return real_run(self)
    return run


def _device_properties(device=None):
    """torch.cuda.get_device_properties on the CPU: an H100's figures (the kit's describe_device logs name and memory)."""
    return types.SimpleNamespace(name="CPU stand-in (an H100's figures)", total_memory=80 * 2**30, major=9, minor=0,
                                 multi_processor_count=H100_SM_COUNT)


_CUDA = {
    "is_available": lambda: True, "device_count": lambda: 1, "set_device": lambda *a: None,
    "synchronize": lambda *a: None, "empty_cache": lambda: None, "current_device": lambda: 0,
    "max_memory_allocated": lambda *a, **k: 0, "max_memory_reserved": lambda *a, **k: 0,
    "memory_allocated": lambda *a, **k: 0, "memory_reserved": lambda *a, **k: 0,
    "reset_peak_memory_stats": lambda *a: None, "is_bf16_supported": lambda *a: True,
    "get_device_name": lambda *a: "CPU stand-in", "get_device_capability": lambda *a: (9, 0),
    "manual_seed": lambda *a: None, "manual_seed_all": lambda *a: None, "Event": _Event,
    "get_device_properties": _device_properties,
}
_DIST = torch.distributed
_REAL_DDP = torch.nn.parallel.DistributedDataParallel


class _CpuDDP(_REAL_DDP):
    """DistributedDataParallel of a CPU module: the CUDA device_ids/output_device a script names are dropped."""

    def __init__(self, module, device_ids=None, output_device=None, *args, **kwargs):
        super().__init__(module, None, None, *args, **kwargs)


def _dist_patches() -> list:
    """(object, attribute, value) patches that run a torchrun-started script's collectives on gloo."""
    init, all_reduce, barrier = _DIST.init_process_group, _DIST.all_reduce, _DIST.barrier

    def gloo_init(backend=None, *args, **kwargs):
        kwargs.pop("device_id", None)
        return init("gloo", *args, **kwargs)

    def all_reduce_gloo(tensor, op=_DIST.ReduceOp.SUM, group=None, async_op=False):
        if op != _DIST.ReduceOp.AVG:
            return all_reduce(tensor, op=op, group=group, async_op=async_op)
        work = all_reduce(tensor, op=_DIST.ReduceOp.SUM, group=group)
        tensor.div_(_DIST.get_world_size(group))
        return work

    def barrier_gloo(group=None, async_op=False, device_ids=None):
        return barrier(group=group, async_op=async_op)

    return [(_DIST, "init_process_group", gloo_init), (_DIST, "all_reduce", all_reduce_gloo),
            (_DIST, "barrier", barrier_gloo), (torch.nn.parallel, "DistributedDataParallel", _CpuDDP)]


_SDP_SWITCHES = ("enable_cudnn_sdp", "enable_flash_sdp", "enable_math_sdp", "enable_mem_efficient_sdp")
_FAKE_ONLY_FOR_SCRIPTS = ("triton",)


def _import_hook(fakes: dict, real_import):
    """builtins.__import__ that serves the fake Triton to every importer but torch."""

    def standin_import(name, globals=None, locals=None, fromlist=(), level=0):
        importer = (globals or {}).get("__name__", "") or ""
        top = name.split(".")[0]
        if level == 0 and top in _FAKE_ONLY_FOR_SCRIPTS and not importer.startswith("torch"):
            return fakes[name] if fromlist else fakes[top]
        return real_import(name, globals, locals, fromlist, level)

    return standin_import


@contextlib.contextmanager
def _patched(patches):
    """patches: [(object, attribute, value)], restored in reverse order."""
    saved = [(obj, name, getattr(obj, name)) for obj, name, _ in patches]
    try:
        for obj, name, value in patches:
            setattr(obj, name, value)
        yield
    finally:
        for obj, name, old in reversed(saved):
            setattr(obj, name, old)


@contextlib.contextmanager
def record_standins():
    """cpu_standins() plus the CUDA-on-CPU world of the module docstring, for the duration of the block."""
    with cpu_standins() as fakes, tempfile.TemporaryDirectory(prefix="standins_") as bin_dir:
        hidden = {n: sys.modules.pop(n) for n in list(fakes) if n.split(".")[0] in _FAKE_ONLY_FOR_SCRIPTS
                  and n in sys.modules}
        smi = Path(bin_dir) / "nvidia-smi"
        smi.write_text("#!/bin/sh\necho 'nvidia-smi: CPU stand-in (no GPU)'\n")
        smi.chmod(0o755)
        old_path = os.environ.get("PATH", "")
        os.environ["PATH"] = bin_dir + os.pathsep + old_path
        patches = [(torch.cuda, name, value) for name, value in _CUDA.items()]
        patches += [(torch.backends.cuda, name, lambda *a: None) for name in _SDP_SWITCHES]
        patches += [(torch, "autocast", _CpuAutocast), (torch.amp, "autocast", _CpuAutocast),
                    (torch, "inference_mode", _inference_mode),
                    (torch, "Generator", _CpuGenerator),
                    (builtins, "__import__", _import_hook(fakes, builtins.__import__)),
                    (threading.Thread, "run", _run_in_mode(threading.Thread.run))] + _dist_patches()
        try:
            with _patched(patches), CudaOnCpu():
                yield fakes
        finally:
            os.environ["PATH"] = old_path
            sys.modules.update(hidden)  # cpu_standins() restores its own entries on its exit
