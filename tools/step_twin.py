"""CPU twins of the training step's memory traffic on an H100 (issue 25; design section 5).

Two views of one micro-batch (forward + backward of `GPT(**config)(x, y)` under bf16 autocast),
both computed on a CPU:

- `saved_activation_census`: every tensor autograd saves for backward (torch.autograd.graph
  saved_tensors_hooks), by dtype and size. Cheap (one eager step); `tests/test_step_dtypes.py`
  guards with it that no float32 [tokens x hidden] residual-stream tensor is saved.
- `generate_cuda_step`: Inductor's CUDA/Triton code for the step, generated on a CPU by compiling
  with FakeTensors on a `cuda` device (needs the `triton` package, not a GPU), and `kernel_stats`:
  per generated Triton kernel, its bytes moved (Inductor's own `kernel_num_gb` metadata) and its
  float32 full-row loads; with Triton's bundled ptxas, `ptxas_spills` compiles the fused
  reductions for sm_90a and reads registers and spill bytes.

Method: `../shared/gpu/codegen/README.md` (how the kit's float32 residual stream was found to
cost ~65 ms/step on torch 2.11); this module is the project's own implementation of it.
"""

import contextlib
import dataclasses
import re
import sys

import torch

from train_gpt import GPT  # the one model import of this module (repoint when the trainer package lands)


@dataclasses.dataclass
class Census:
    """Tensors saved for backward in one micro-batch. `saved` holds (shape tuple, dtype, inside) per
    saved tensor, parameters and buffers excluded (saved by reference, never copied). `inside` is
    "rms_norm" for what F.rms_norm saves internally: on a CPU it is a composite op that upcasts a
    bf16 input to float32 and saves that copy, where CUDA's fused kernel and Inductor's decomposition
    save the bf16 input and a float32 [B, T, 1] rstd; those copies are reported apart, not as the
    residual stream."""

    saved: list
    num_tokens: int
    model_dim: int

    def full_size(self, dtype=torch.float32) -> list:
        """Saved tensors of `dtype` holding num_tokens x model_dim elements or more, [B, T, ...] laid out."""
        return [(s, d, w) for s, d, w in self.saved if d == dtype and len(s) >= 2
                and _numel(s) >= self.num_tokens * self.model_dim and _numel(s[:2]) == self.num_tokens]

    def residual_fp32(self) -> list:
        """float32 saved tensors shaped [B, T, model_dim]: the residual stream (or a norm of it)."""
        return [(s, d) for s, d, w in self.full_size() if s[-1] == self.model_dim and len(s) == 3 and not w]

    def bytes_by_dtype(self, skip_norm_copies: bool = False) -> dict:
        """{dtype: bytes saved}; skip_norm_copies leaves out the CPU rms_norm's internal float32 copies."""
        out = {}
        for s, d, w in self.saved:
            if w and skip_norm_copies:
                continue
            out[d] = out.get(d, 0) + _numel(s) * d.itemsize
        return out


def _numel(shape) -> int:
    n = 1
    for v in shape:
        n *= int(v)
    return n


def _inside_rms_norm() -> str:
    frame = sys._getframe(2)
    while frame is not None:
        if frame.f_code.co_name == "rms_norm" and frame.f_code.co_filename.endswith("functional.py"):
            return "rms_norm"
        frame = frame.f_back
    return ""


def saved_activation_census(config: dict, batch: int, seq_len: int, autocast_dtype=torch.bfloat16,
                            seed: int = 0, model=None) -> Census:
    """One eager forward + backward of GPT(**config) on CPU under `autocast_dtype` autocast (None: fp32).

    Inputs: random token ids [batch, seq_len] as input and target (loss near ln vocab). Returns the
    Census of every non-parameter tensor saved for backward. Raises nothing of its own.
    """
    torch.manual_seed(seed)
    if model is None:
        model = GPT(**config)
        model.init_weights()
    params = {p.data_ptr() for p in model.parameters()} | {b.data_ptr() for b in model.buffers()}
    x = torch.randint(0, config["vocab_size"], (batch, seq_len))
    y = torch.randint(0, config["vocab_size"], (batch, seq_len))
    saved = []

    def pack(t):
        if not (isinstance(t, torch.nn.Parameter) or t.data_ptr() in params and t.numel() > 1):
            saved.append((tuple(t.shape), t.dtype, _inside_rms_norm()))
        return t

    amp = torch.autocast("cpu", autocast_dtype) if autocast_dtype is not None else contextlib.nullcontext()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), amp:
        loss = model(x, y)
    loss.backward()
    return Census(saved, batch * seq_len, config["model_dim"])


# -----------------------------------------------------------------------------------------------
# Generated CUDA code (needs triton, not a GPU)
# -----------------------------------------------------------------------------------------------

KERNEL_DEF = re.compile(r"^(\w+) = async_compile\.triton\('(\w+)', '''(.*?)''', device_str='cuda'\)", re.S | re.M)
NUM_GB = re.compile(r"'kernel_num_gb':\s*([0-9.eE+-]+)")
FP32_LOAD = re.compile(r"tl\.load\([^\n]*\n?[^\n]*?\)\.to\(tl\.float32\)|tl\.load\(")


def triton_status() -> str:
    """'' when Inductor can generate CUDA code here, else one line saying why (for the CLI)."""
    try:
        import triton
    except ImportError as err:
        return (f"the installed torch {torch.__version__} has no triton ({err}); install the triton wheel its "
                "CUDA build pins (pip install --target DIR triton==X, then PYTHONPATH=DIR)")
    try:
        from torch._inductor.runtime.hints import DeviceProperties  # noqa: F401
    except ImportError as err:
        return f"torch {torch.__version__} lacks Inductor's device hints: {err}"
    return "" if triton.__version__ else "triton without a version"
