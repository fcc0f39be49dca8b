"""Package-only trainer features: SAVE_PREQUANT, and checkpoint/resume for long non-record runs
(`MAX_WALLCLOCK_SECONDS=0`, `CHECKPOINT_EVERY`, `RESUME=1`).

A kit feature of the package, loaded by train_gpt.py on demand: the packed record script does not
carry it (a timed record run cannot be resumed). The checkpoint holds model, optimizers, EMA, the
data position, the loss history and the RNG state, so that on CPU a resumed run continues bit for
bit; it is written atomically and loaded with `torch.load(weights_only=True)` (no pickle code).
"""

import io
import json
from pathlib import Path

import safetensors.torch
import torch

from primitives.files import atomic_write_bytes


def save_prequant(path: Path, state: dict, config: dict) -> None:
    """SAVE_PREQUANT=1: the float32 weights before quantization, with the model config in the
    safetensors metadata ("model_config"), the input of tools/bench_quant.py."""
    atomic_write_bytes(path, safetensors.torch.save(state, metadata={"model_config": json.dumps(config)}))


def save_checkpoint(path: Path, model, optimizers, ema, step: int, loader, train_seconds: float, losses) -> None:
    """Everything a resumed run needs to continue bit for bit on CPU; written atomically."""
    state = {"model": model.state_dict(), "optimizers": [o.state_dict() for o in optimizers],
             "ema": ema.shadow if ema else None, "ema_updates": ema.num_updates if ema else 0, "step": step,
             "train_seconds": train_seconds,
             "losses": losses.cpu(),
             "stream": [loader.shard_index, loader.offset],
             "rng": torch.get_rng_state()}
    buffer = io.BytesIO()
    torch.save(state, buffer)
    atomic_write_bytes(path, buffer.getvalue())


def load_checkpoint(path: Path, model, optimizers, ema, loader) -> tuple:
    if not path.is_file():
        raise ValueError(f"RESUME=1: no checkpoint at {path} (set CHECKPOINT_EVERY on the first run)")
    state = torch.load(path, map_location="cpu", weights_only=True)
    model.load_state_dict(state["model"])
    for opt, sd in zip(optimizers, state["optimizers"]):
        opt.load_state_dict(sd)
    if ema and state["ema"] is not None:
        for s, v in zip(ema.shadow, state["ema"]):
            s.copy_(v)
        ema.num_updates = state["ema_updates"]
    loader.seek(*state["stream"])
    torch.set_rng_state(state["rng"])
    return state["step"], state["train_seconds"], list(state["losses"].to(loader.device).unbind())
