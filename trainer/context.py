"""The run context: devices and ranks, logging, signals, the run header, the shipped code's bytes."""

import contextlib
import dataclasses
import os
import platform
import subprocess
import sys
from pathlib import Path

import brotli
import numpy as np
import torch
import torch.distributed as dist
import zstandard
from primitives.env import BUNDLE_KIND  # the trainer's modules import it from here
from primitives.settings import Hyperparameters, setting_warnings
from quant.policy import QuantPolicy


# (settings, left-out modules, probe(hp, quant policy) -> (needed, each setting's value)) per condition
# (kit/bundle_when.py): the bundler writes them into a packed file packed without some modules
BUNDLE_REFUSALS = ()


@dataclasses.dataclass
class RunContext:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    run_dir: Path
    autocast_dtype: object = None  # torch.bfloat16 or None
    compile: bool = False  # torch.compile the model, Muon's Newton-Schulz and the eval forward
    log_file: object = None
    pending: list = dataclasses.field(default_factory=list)  # lines logged before train.log is opened
    if BUNDLE_KIND == "package":  # the kit's run folder lock and train.log recovery (fields all the same)
        lock: object = None  # the run folder's lock file, held open by rank 0 (trainer/runfolder.py)
        log_error: object = None  # the OSError that stopped train.log (a full disk, a file-size limit)
        log_opened: bool = False  # train.log's header is written: a later write error only warns

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def log(self, msg: str = "", console: bool = True) -> None:
        if not self.is_main:
            return
        if console:
            print(msg, flush=True)
        if self.log_file is None:
            if BUNDLE_KIND == "package":
                if self.log_error is not None:  # train.log failed: the console only from then on
                    return
            self.pending.append(msg)
            return
        if BUNDLE_KIND == "package":  # the kit's: a train.log that cannot be written is not the end of the run
            try:
                self.log_file.write(msg + "\n")
                self.log_file.flush()
            except OSError as err:  # the run goes on, logging to the console: its numbers still reach result.json
                with contextlib.suppress(OSError):  # closed now: its unwritten buffer is not flushed again at exit
                    self.log_file.close()
                self.log_file, self.log_error = None, err
                if self.log_opened:
                    print(f"WARNING: train.log: cannot write ({err.strerror or err}): the rest of the log is on the "
                          "console only", file=sys.stderr, flush=True)
        else:
            self.log_file.write(msg + "\n")
            self.log_file.flush()

    def autocast(self):
        return torch.autocast(self.device.type, self.autocast_dtype, enabled=self.autocast_dtype is not None)

    def sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize()

    def mean_over_ranks(self, t: torch.Tensor) -> torch.Tensor:
        if self.world_size == 1:
            return t
        t = t.detach().clone()
        dist.all_reduce(t)
        return t / self.world_size


def eval_device_args(ctx: RunContext, /) -> dict:
    """The keyword arguments every eval/ pass (the sliding pass, the roundtrip, the TTT modes) takes from the run
    context."""
    return dict(device=ctx.device, rank=ctx.rank, world_size=ctx.world_size, compile_model=ctx.compile,
                autocast_dtype=ctx.autocast_dtype)


def setup_distributed(hp: Hyperparameters) -> RunContext:
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    rank, local_rank = int(os.environ.get("RANK", "0")), int(os.environ.get("LOCAL_RANK", "0"))
    if torch.cuda.is_available():
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
        local_world = int(os.environ.get("LOCAL_WORLD_SIZE", str(world_size)))
        torch.set_num_threads(hp.num_threads or max(1, (os.cpu_count() or 1) // local_world))
    if world_size > 1:
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    run_dir = Path(hp.out_dir) / hp.run_id
    bf16 = hp.autocast == "bf16" or hp.autocast == "auto" and device.type == "cuda"
    ctx = RunContext(rank, world_size, local_rank, device, run_dir, torch.bfloat16 if bf16 else None,
                     hp.compile == 1 or hp.compile == -1 and device.type == "cuda")
    if BUNDLE_KIND == "package":  # from_env printed them; train.log keeps them (the kit's warnings)
        ctx.pending.extend(setting_warnings(hp) if ctx.is_main else ())
    return ctx


def check_packed_for(hp: Hyperparameters) -> None:
    """A packed file refuses, before anything runs, settings that need a module it was packed without:
    ValueError naming the settings, their values and the modules (no-op in the package). Each refusal is a
    left-out module's PACKED_WHEN condition as a probe over the run's settings (kit/bundle_when.py)."""
    quant = QuantPolicy.from_env() if BUNDLE_REFUSALS else None  # (its warnings are the package's, which has no refusals)
    for modules, probe in BUNDLE_REFUSALS:
        if probe(hp, quant):  # the settings it reads are its attribute names (no QuantPolicy field is also a setting's)
            given = " ".join(f"{n.upper()}={getattr(hp, n)}" if hasattr(hp, n) else f"QUANT_{n.upper()}={getattr(quant, n)}"
                             for n in probe.__code__.co_names)
            raise ValueError(f"{given}: this train_gpt.py was packed without {modules}; pack one for these settings")


def measure_code_bytes(hp: Hyperparameters) -> int:
    """Bytes of the train_gpt.py that would be shipped for these settings: measured, never estimated."""
    if BUNDLE_KIND == "package":  # the bundler measures what it would ship (folded away in the bundle)
        from kit.bundle import packed_size

        return packed_size(built=package_source(hp))  # == len(build_packed_bytes(settings=...)), cached
    return os.path.getsize(__file__ if BUNDLE_KIND == "packed" else Path(__file__).with_name("train_gpt.py"))


def package_source(hp: Hyperparameters, _built={}) -> tuple[str, str]:  # noqa: B006 (the memo)
    """(human source, packed header) of the package for these settings (kit.bundle.human_and_header): built
    once per process and settings, for measure_code_bytes and log_run_header both, and remembered on disk
    between runs (kit/bundle_cache.py; ~1.5 s a build on one core)."""
    settings = pack_settings_of(hp)
    if _built.get("settings") != settings:
        from kit.bundle import cached_human_and_header  # package only

        _built.clear()
        _built.update(settings=settings, source=cached_human_and_header(settings))
    return _built["source"]


def pack_settings_of(hp: Hyperparameters):
    """The package's run settings as the bundler reads them (the modules its train_gpt.py would hold)."""
    from kit.bundle import settings_from  # package only

    return settings_from(dataclasses.asdict(hp), dataclasses.asdict(QuantPolicy.from_env(log=lambda *_: None)))


def describe_device(device: torch.device) -> str:
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        return f"{props.name} ({props.total_memory / 2**30:.0f} GiB)"
    return f"cpu ({platform.machine()}, {os.cpu_count()} cores)"


def log_run_header(ctx: RunContext, hp: Hyperparameters) -> None:
    """The log opens with the code, versions, device (nvidia-smi on CUDA) and every hyperparameter."""
    import safetensors
    import sentencepiece

    if BUNDLE_KIND == "package":  # folded away in the bundle (kit/bundle_fold.py)
        code = package_source(hp)[0]
    else:
        code = BUNDLE_SOURCE if BUNDLE_KIND == "packed" else Path(__file__).read_text("utf-8")  # noqa: F821 (the wrapper's)
    ctx.log(code, False)
    ctx.log("=" * 100, False)
    ctx.log(f"python:{platform.python_version()} "
            + " ".join(f"{m.__name__}:{m.__version__}" for m in (torch, np, sentencepiece, zstandard, brotli, safetensors)))
    ctx.log(f"device:{describe_device(ctx.device)} world_size:{ctx.world_size}")
    if ctx.device.type == "cuda":
        with contextlib.suppress(OSError, subprocess.SubprocessError):
            ctx.log(subprocess.run(["nvidia-smi"], capture_output=True, text=True, timeout=20).stdout, False)
    for f in dataclasses.fields(hp):
        ctx.log(f"{f.name.upper()}:{getattr(hp, f.name)}")
