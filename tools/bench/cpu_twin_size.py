"""The shape and memory of `tools/gpu_check.py --cpu-twin`: a small shape by default, and a memory
estimate checked against the machine's available memory before anything is allocated (the preset's
own shape needs ~20 GB on a CPU, where the OOM killer ended the check with no output)."""

import contextlib
import os
from pathlib import Path

import torch

import model.gpt as trainer_model
import primitives.settings as trainer_settings

# --cpu-twin's default shape (env variables of the trainer; any of them set in the environment wins):
# every code path of the preset (GQA, partial RoPE, XSA, QAT, eval, TTT step) at a size a laptop runs
# in about a minute; --preset-size keeps the preset's own shape.
# One thread: at this size more only wait on each other, badly so on a busy machine.
CPU_TWIN_SHAPE = {"NUM_LAYERS": "2", "MODEL_DIM": "128", "NUM_HEADS": "4", "NUM_KV_HEADS": "2", "ROPE_DIMS": "16",
                  "XSA_LAST_N": "1", "TRAIN_SEQ_LEN": "128", "TRAIN_BATCH_TOKENS": "2048", "EVAL_BATCH_SEQS": "8",
                  "EVAL_STRIDE": "64", "TTT_BATCH_SEQS": "4", "TTT_CHUNK_TOKENS": "1024", "WARMUP_STEPS": "1",
                  "NUM_THREADS": "1"}
# on synthetic tokens (no dataset) the vocabulary is small too: the output layer dominates a CPU step in bf16
CPU_TWIN_SYNTHETIC_VOCAB = {"VOCAB_SIZE": "1024"}
CPU_TWIN_STEPS = 3  # timed steps with QAT off, then on (the GPU default is 20): the twin's timings say nothing
CPU_TWIN_MEMORY_FRACTION = 0.8  # of MemAvailable: the estimate may be off, and the machine is shared


def available_memory_bytes() -> int:
    """MemAvailable of /proc/meminfo (what can be allocated without swapping), else free pages x page size."""
    with contextlib.suppress(OSError, ValueError, StopIteration):
        with open("/proc/meminfo", encoding="ascii") as f:
            return 1024 * int(next(line.split()[1] for line in f if line.startswith("MemAvailable:")))
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def estimate_cpu_twin_bytes(hp) -> int:
    """Peak memory of --cpu-twin at this shape, an upper estimate (bytes): the process and torch (1.5 GiB),
    12 float32 copies of the parameters (weights, grads, optimizer states, EMA, the warmup's saved state,
    the CPU reference model), and per micro-batch of T tokens the activations kept for backward (per
    layer 4 bytes x T x MODEL_DIM x (24 + 8 x MLP_MULT), plus the attention scores T x NUM_HEADS x
    TRAIN_SEQ_LEN in float32 for SDPA's CPU math path) and the logits (T x VOCAB_SIZE x 4 bytes x 4: logits,
    soft-capped, log-softmax, their gradient). Parameters counted on the meta device (nothing allocated)."""
    config = trainer_model.build_model_config(hp)
    with torch.device("meta"):
        params = sum(p.numel() for p in trainer_model.GPT(**config).parameters())
    tokens = hp.train_batch_tokens // hp.resolve_grad_accum(1, False)
    per_layer = 4 * tokens * (hp.model_dim * (24 + 8 * hp.mlp_mult) + hp.num_heads * hp.train_seq_len)
    return int(1.5 * 2**30 + 12 * 4 * params + hp.num_layers * per_layer + 16 * tokens * hp.vocab_size)


def data_given(hp, environ=None) -> bool:
    """Whether the check reads real data: DATA_PATH set, or the preset's dataset folder present."""
    return "DATA_PATH" in (os.environ if environ is None else environ) or Path(hp.data_path).is_dir()


def cpu_twin_settings(preset_size: bool, environ=None):
    """The Hyperparameters of --cpu-twin: CPU_TWIN_SHAPE (+ CPU_TWIN_SYNTHETIC_VOCAB without data) under
    the environment's own settings, or the preset's shape with preset_size. Raises ValueError naming the
    shape when its estimated memory is more than CPU_TWIN_MEMORY_FRACTION of the memory available."""
    environ = dict(os.environ if environ is None else environ)

    def log(line: str) -> None:  # the twin's own shape variables (e.g. the TTT step's) are no user's setting
        if not any(line.startswith(f"WARNING: {name}=") for name in CPU_TWIN_SHAPE if name not in environ):
            print(line)

    hp = trainer_settings.Hyperparameters.from_env(environ if preset_size else {**CPU_TWIN_SHAPE, **environ}, log=log)
    if not preset_size and not data_given(hp, environ):
        hp = trainer_settings.Hyperparameters.from_env({**CPU_TWIN_SHAPE, **CPU_TWIN_SYNTHETIC_VOCAB, **environ},
                                                       log=lambda line: None)  # said by the call above
    need, have = estimate_cpu_twin_bytes(hp), available_memory_bytes()
    if need > CPU_TWIN_MEMORY_FRACTION * have:
        shape = (f"PRESET={hp.preset}'s shape" if preset_size else "the shape asked for") + (
            f" (NUM_LAYERS={hp.num_layers} MODEL_DIM={hp.model_dim} TRAIN_SEQ_LEN={hp.train_seq_len} "
            f"TRAIN_BATCH_TOKENS={hp.train_batch_tokens:,} VOCAB_SIZE={hp.vocab_size})")
        raise ValueError(f"--cpu-twin{' --preset-size' if preset_size else ''}: {shape} needs about "
                         f"{need / 2**30:.1f} GiB, this machine has {have / 2**30:.1f} GiB available; expected a "
                         f"shape that fits: `python tools/gpu_check.py --cpu-twin` (a small shape)")
    return hp
