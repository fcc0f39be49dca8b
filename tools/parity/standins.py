"""CPU stand-ins for a record script's GPU-only parts, so that its own code runs on a CPU (parity, audit probes).

A record's train_gpt.py (PR #1855's, PR #1617's) imports FlashAttention-3 (`flash_attn_interface`), Triton
(`triton`, `triton.language`, `triton.tools.tensor_descriptor`), asks `torch.cuda.get_device_properties` for
the SM count, and wraps functions in `torch.compile` at import. Inside `cpu_standins()`:

- `flash_attn_interface` (and `flash_attn`): `flash_attn_func` and `flash_attn_varlen_func` as their reference
  math in float32 (float64 inputs: float64) (softmax(q k^T / sqrt(D)) v, causal, GQA, documents cut at cu_seqlens), in q's dtype;
- `triton`: `triton.jit` returns a `StandinKernel` that, launched as `kernel[grid](*args, **meta)`, runs the
  reference math of the same function (REFERENCE_KERNELS, by the kernel's name) on the tensors it was given;
  a kernel without one raises NotImplementedError naming it when launched (importing still works);
  `TensorDescriptor.from_tensor` keeps the tensor; `triton.language` answers any name with a placeholder;
- `torch.cuda.get_device_properties(non-CUDA device)`: an H100's SM count (132), CUDA devices unchanged;
- without CUDA, `torch.cuda.Stream`, `torch.cuda.stream` and `torch.cuda.current_stream`: one in-order "stream"
  (a record's optimizer steps its Adam groups on a side stream; on a CPU everything runs in order);
- `torch.compile`: off (returns the function), so a script's `@torch.compile` runs eagerly.

Everything is restored on exit (sys.modules entries and the torch attributes). Functions a script
imported inside the context keep working after it: they are plain Python. Usage:

    with cpu_standins():
        module = import_script(path_of_the_records_train_gpt_py)
        ...  # run its code while the context is open (the SM-count patch only lives inside it)
"""

import contextlib
import importlib.util
import math
import sys
import types
from pathlib import Path

import torch
import torch.nn.functional as F

H100_SM_COUNT = 132


# ----------------------------------------------------------------------------------------------------------------
# FlashAttention's interface, as reference math
# ----------------------------------------------------------------------------------------------------------------

def _math(t: torch.Tensor) -> torch.Tensor:
    """t in the stand-ins' math dtype: float32, float64 kept (parity_train's float64 runs)."""
    return t if t.dtype == torch.float64 else t.float()


def _attend(q, k, v, allowed, softmax_scale):
    """q [N, H, D], k, v [M, Hkv, D], allowed bool [N, M] -> [N, H, D] in q's dtype (float32 math, float64 kept;
    GQA)."""
    rep = q.size(1) // k.size(1)
    kf, vf = (_math(t).repeat_interleave(rep, dim=1) for t in (k, v))
    scale = softmax_scale if softmax_scale is not None else 1 / math.sqrt(q.size(-1))
    scores = torch.einsum("nhd,mhd->hnm", _math(q), kf) * scale
    scores = scores.masked_fill(~allowed, float("-inf"))
    probs = torch.softmax(scores, dim=-1).nan_to_num(0.0)  # a query with no key (empty segment) reads nothing
    return torch.einsum("hnm,mhd->nhd", probs, vf).to(q.dtype)


def _check_window(window_size):
    if tuple(window_size) != (-1, -1):
        raise NotImplementedError(f"flash-attn stand-in: window_size={tuple(window_size)}; only (-1, -1) (no window)")


def flash_attn_func(q, k, v, softmax_scale=None, causal=False, window_size=(-1, -1), **_ignored):
    """FlashAttention's flash_attn_func: q [B, T, H, D], k, v [B, S, Hkv, D] -> [B, T, H, D] (FA3's return: the
    output alone). causal aligns the last query with the last key, as flash-attn does."""
    _check_window(window_size)
    t, s = q.size(1), k.size(1)
    allowed = torch.ones(t, s, dtype=torch.bool, device=q.device)
    if causal:
        allowed = allowed.tril(s - t)
    return torch.stack([_attend(q[b], k[b], v[b], allowed, softmax_scale) for b in range(q.size(0))])


def _segments(cu, n):
    """Segment index and position inside it of each of n packed tokens, and each segment's length."""
    pos = torch.arange(n, device=cu.device)
    seg = torch.searchsorted(cu.to(torch.int64), pos, right=True) - 1
    lengths = cu[1:].to(torch.int64) - cu[:-1].to(torch.int64)
    return seg, pos - cu.to(torch.int64)[seg], lengths[seg]


def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q=None, max_seqlen_k=None,
                           softmax_scale=None, causal=False, window_size=(-1, -1), **_ignored):
    """FlashAttention's varlen interface: q [N, H, D], k, v [M, Hkv, D] packed sequences, sequence i being
    cu_seqlens[i]:cu_seqlens[i + 1] (entries past the last start repeat the total: empty sequences) ->
    [N, H, D]. A query reads keys of its own sequence only (causal: up to its position, bottom-right aligned)."""
    _check_window(window_size)
    seg_q, pos_q, len_q = _segments(cu_seqlens_q, q.size(0))
    seg_k, pos_k, _ = _segments(cu_seqlens_k, k.size(0))
    allowed = seg_q[:, None] == seg_k[None, :]
    if causal:  # query i of a sequence of Lq queries and Lk keys reads keys j <= i + Lk - Lq
        cu_k = cu_seqlens_k.to(torch.int64)
        len_k_of_q = cu_k[seg_q + 1] - cu_k[seg_q]
        allowed &= pos_k[None, :] <= (pos_q + len_k_of_q - len_q)[:, None]
    return _attend(q, k, v, allowed, softmax_scale)


# ----------------------------------------------------------------------------------------------------------------
# Triton: kernels as the reference math of the same functions
# ----------------------------------------------------------------------------------------------------------------

def _softcapped_ce_fwd(logits, losses, lse, targets, _s_n, _s_v, _n_rows, _n_cols, softcap, block_size=None):
    """PR #1855's fused softcapped CE forward: z = 2c sigmoid(2x / c) (= c tanh(x / c) + c), per row
    lse = logsumexp(z), loss = lse - z[target]; written into losses and lse (float32 [N])."""
    z = 2 * softcap * torch.sigmoid(_math(logits) * (2 / softcap))
    row_lse = torch.logsumexp(z, dim=-1)
    lse.copy_(row_lse)
    losses.copy_(row_lse - z.gather(1, targets.view(-1, 1).long()).squeeze(1))


def _softcapped_ce_bwd(grad_logits, grad_losses, lse, logits, targets, *_strides_rows_cols, softcap=None,
                       block_size=None):
    """Its backward: d loss / d x = g (softmax(z) - onehot(target)) * 4 s (1 - s), s = sigmoid(2x / c)."""
    softcap = _strides_rows_cols[-1] if softcap is None else softcap
    s = torch.sigmoid(_math(logits) * (2 / softcap))
    probs = torch.exp(2 * softcap * s - _math(lse)[:, None])
    onehot = F.one_hot(targets.long(), logits.size(1)).to(s.dtype)
    grad = _math(grad_losses)[:, None] * (probs - onehot) * (4 * s * (1 - s))
    grad_logits.copy_(grad.to(grad_logits.dtype))


def _linear_leaky_relu_square(a_desc, b_desc, c_desc, aux_desc, *_mnk, FORWARD=True, **_blocks):
    """PR #1855's fused MLP GEMM: c = a b^T (float32 accumulate, stored in c's dtype); FORWARD: aux =
    leaky_relu(c, 0.5)^2; else c *= where(aux > 0, 2 aux, 0.5 aux), aux being the forward's pre-activation."""
    c = (_math(a_desc.tensor) @ _math(b_desc.tensor).T).to(c_desc.tensor.dtype)
    if FORWARD:
        c_desc.tensor.copy_(c)
        aux_desc.tensor.copy_(F.leaky_relu(c, 0.5).square())
    else:
        pre = aux_desc.tensor
        c_desc.tensor.copy_(c * torch.where(pre > 0, 2.0 * pre, 0.5 * pre))


# the reference of each stand-in kernel, by the decorated function's name
REFERENCE_KERNELS = {
    "_softcapped_ce_fwd_kernel": _softcapped_ce_fwd,
    "_softcapped_ce_bwd_kernel": _softcapped_ce_bwd,
    "linear_leaky_relu_square_kernel": _linear_leaky_relu_square,
}
_LAUNCH_OPTIONS = ("num_warps", "num_stages", "num_ctas", "maxnreg")


class StandinKernel:
    """What `triton.jit` returns inside cpu_standins(): `kernel[grid](*args, **meta)` runs
    REFERENCE_KERNELS[name] on the same arguments (launch options dropped, the grid unused)."""

    def __init__(self, fn):
        self.fn, self.__name__ = fn, fn.__name__

    def __getitem__(self, grid):
        return self._launch

    def _launch(self, *args, **meta):
        ref = REFERENCE_KERNELS.get(self.__name__)
        if ref is None:
            raise NotImplementedError(f"no CPU stand-in for the Triton kernel {self.__name__!r} "
                                      "(tools/parity/standins.py REFERENCE_KERNELS)")
        return ref(*args, **{k: v for k, v in meta.items() if k not in _LAUNCH_OPTIONS})


class TensorDescriptor:
    """triton.tools.tensor_descriptor.TensorDescriptor: keeps the tensor the reference kernels read and write."""

    def __init__(self, tensor, block_shape=None):
        self.tensor, self.block_shape = tensor, block_shape

    @classmethod
    def from_tensor(cls, tensor, block_shape=None):
        return cls(tensor, block_shape)


class _Placeholder:
    """Any attribute of the fake triton.language (tl.constexpr, tl.float32, ...): usable in annotations."""

    def __init__(self, name):
        self.name = name

    def __repr__(self):
        return f"tl.{self.name}"

    def __call__(self, *args, **kwargs):
        return self


class _AnyAttrModule(types.ModuleType):
    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return _Placeholder(name)


def _decorator_passthrough(*args, **kwargs):
    """triton.autotune / triton.heuristics: the kernel unchanged."""
    if len(args) == 1 and callable(args[0]) and not kwargs:
        return args[0]
    return lambda fn: fn


def _fake_modules() -> dict:
    fa = types.ModuleType("flash_attn_interface")
    fa.flash_attn_func, fa.flash_attn_varlen_func = flash_attn_func, flash_attn_varlen_func
    fa2 = types.ModuleType("flash_attn")
    fa2.flash_attn_func, fa2.flash_attn_varlen_func = flash_attn_func, flash_attn_varlen_func
    triton = types.ModuleType("triton")
    triton.jit = lambda fn=None, **_: StandinKernel(fn) if fn is not None else StandinKernel
    triton.cdiv = lambda a, b: (a + b - 1) // b
    triton.next_power_of_2 = lambda n: 1 << max(0, int(n) - 1).bit_length()
    triton.autotune = triton.heuristics = _decorator_passthrough
    triton.Config = lambda *args, **kwargs: (args, kwargs)
    tl = _AnyAttrModule("triton.language")
    tools = types.ModuleType("triton.tools")
    desc = types.ModuleType("triton.tools.tensor_descriptor")
    desc.TensorDescriptor = TensorDescriptor
    triton.language, triton.tools, tools.tensor_descriptor = tl, tools, desc
    return {"flash_attn_interface": fa, "flash_attn": fa2, "triton": triton, "triton.language": tl,
            "triton.tools": tools, "triton.tools.tensor_descriptor": desc}


class _InOrderStream:
    """torch.cuda.Stream without CUDA: work runs in order, so waiting is a no-op."""

    def __init__(self, *args, **kwargs):
        pass

    def wait_stream(self, other):
        pass

    def synchronize(self):
        pass


def _compile_off(fn=None, *args, **kwargs):
    """torch.compile stand-in: the function itself (as a decorator with or without arguments)."""
    return fn if fn is not None else (lambda f: f)


@contextlib.contextmanager
def cpu_standins():
    """Install the stand-ins (module docstring) for the duration of the block; yields the fake modules
    {name: module}. Nests: an inner context restores what the outer one installed."""
    import torch._dynamo  # noqa: F401 (imported before the fake triton exists: torch probes for a real one)

    fakes = _fake_modules()
    saved = {name: sys.modules.get(name) for name in fakes}
    real_props, real_compile = torch.cuda.get_device_properties, torch.compile
    streams = ("Stream", "stream", "current_stream")
    real_streams = {n: getattr(torch.cuda, n) for n in streams}

    def device_properties(device=None):
        if device is not None and torch.device(device).type != "cuda":
            return types.SimpleNamespace(multi_processor_count=H100_SM_COUNT, name="CPU stand-in (an H100's SMs)")
        return real_props(device)

    sys.modules.update(fakes)
    torch.cuda.get_device_properties, torch.compile = device_properties, _compile_off
    if not torch.cuda.is_available():
        one = _InOrderStream()
        torch.cuda.Stream, torch.cuda.stream, torch.cuda.current_stream = (
            _InOrderStream, lambda stream=None: contextlib.nullcontext(), lambda device=None: one)
    try:
        yield fakes
    finally:
        torch.cuda.get_device_properties, torch.compile = real_props, real_compile
        for name, fn in real_streams.items():
            setattr(torch.cuda, name, fn)
        for name, module in saved.items():
            if module is None:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = module


_IMPORTED = {}  # resolved path -> module: a script registers torch custom ops at import, which cannot repeat


def import_script(path) -> types.ModuleType:
    """Import a record's train_gpt.py (its `__main__` block does not run) under cpu_standins(), once per path
    and process; returns the module. Raises FileNotFoundError naming the path when it does not exist."""
    path = Path(path).resolve()
    if not path.is_file():
        raise FileNotFoundError(f"record script {path}: no such file")
    if path not in _IMPORTED:
        name = f"record_script_{len(_IMPORTED)}_{path.parent.name}"
        spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(spec)
        with cpu_standins():
            sys.modules[name] = module
            try:
                spec.loader.exec_module(module)
            except BaseException:
                sys.modules.pop(name, None)
                raise
        _IMPORTED[path] = module
    return _IMPORTED[path]
