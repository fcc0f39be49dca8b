"""CPU twins of the training step's memory traffic on an H100.

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

Method: how the kit's float32 residual stream was found to cost ~65 ms/step on torch 2.11 (an
H100 profile, then the step's generated code on a CPU); this module is the project's implementation of it.
"""

import contextlib
import dataclasses
import re
import sys
import types

import torch

from model.gpt import GPT


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

# The H100 SXM5 fields Inductor reads (torch._inductor.runtime.hints.DeviceProperties.create and the
# Triton heuristics); values from NVIDIA's H100 datasheet / CUDA occupancy tables for sm_90.
H100_PROPERTIES = types.SimpleNamespace(
    name="NVIDIA H100 80GB HBM3 (pretended)", major=9, minor=0, multi_processor_count=132, total_memory=80 * 2**30,
    warp_size=32, max_threads_per_multi_processor=2048, regs_per_multiprocessor=65536, max_threads_per_block=1024,
    L2_cache_size=50 * 2**20, shared_memory_per_block_optin=232448, shared_memory_per_multiprocessor=233472,
    clock_rate=1980000, is_integrated=False, gcnArchName="", uuid="pretended")


class _CodeWritten(Exception):
    """Raised in place of loading a generated module: the code is written, nothing may run it."""


@contextlib.contextmanager
def pretend_h100(written: list):
    """Make torch.cuda and dynamo's CUDA interface report one H100 (cc 9.0) so Inductor generates CUDA code,
    and stop every generated module before it loads (appending its path to `written`): loading would
    compile and launch kernels, which needs a GPU."""
    from unittest import mock

    import torch._dynamo.device_interface as device_interface
    import torch._inductor.codecache as codecache

    fns = dict(is_available=lambda: True, device_count=lambda: 1, current_device=lambda: 0,
               get_device_properties=lambda device=None: H100_PROPERTIES, get_device_capability=lambda device=None: (9, 0),
               get_device_name=lambda device=None: H100_PROPERTIES.name, set_device=lambda device: None,
               synchronize=lambda device=None: None, is_bf16_supported=lambda *a, **k: True, _lazy_init=lambda: None,
               is_current_stream_capturing=lambda: False, exchange_device=lambda device: 0,
               maybe_exchange_device=lambda device: 0, _exchange_device=lambda device: 0,
               _maybe_exchange_device=lambda device: 0, get_rng_state=lambda *a, **k: torch.zeros(16, dtype=torch.uint8),
               set_rng_state=lambda *a, **k: None)
    iface = device_interface.CudaInterface

    def load(key, path, *args, **kwargs):
        written.append(path)
        raise _CodeWritten(path)

    with contextlib.ExitStack() as stack:
        for name, fn in fns.items():
            stack.enter_context(mock.patch.object(torch.cuda, name, fn, create=True))
            if hasattr(iface, name):
                stack.enter_context(mock.patch.object(iface, name, staticmethod(fn)))
        stack.enter_context(mock.patch.object(iface, "get_compute_capability", staticmethod(lambda device=None: 90)))
        stack.enter_context(mock.patch.object(iface.Worker, "get_device_properties",
                                              staticmethod(lambda device=None: H100_PROPERTIES)))
        stack.enter_context(mock.patch.object(iface.Worker, "current_device", staticmethod(lambda: 0)))
        stack.enter_context(mock.patch.object(codecache.PyCodeCache, "load_by_key_path", staticmethod(load)))
        import torch._inductor.scheduler as scheduler
        import torch.utils._triton as triton_utils

        for module in (scheduler, triton_utils):  # has_triton() is cached from before the patch: answer again
            stack.enter_context(mock.patch.object(module, "has_triton", lambda: True))
        import torch._inductor.fx_passes.reinplace as reinplace

        stack.enter_context(mock.patch.object(reinplace, "_inplace_generalized_scatter", _scatter_shape_check))
        # a cache key from Triton's active driver, which needs libcuda: any fixed key will do (nothing is cached)
        stack.enter_context(mock.patch.object(triton_utils, "triton_hash_with_backend", lambda: "0" * 64))
        yield


def _scatter_shape_check(inp, src, view_ops):
    """Inductor's reinplace pass checks a scatter by copy_ on fake tensors, which on `cuda` fakes needs a CUDA
    build: the same check by shapes (the views are applied as Inductor does, then broadcast)."""
    from torch._guards import detect_fake_mode
    from torch.utils import _pytree as pytree

    tmp = inp
    for view in view_ops:
        args, kwargs = pytree.tree_map(lambda n: n.meta["val"] if isinstance(n, torch.fx.Node) else n,
                                       (view.args, view.kwargs))
        mode = detect_fake_mode(args)
        with mode.shape_env.ignore_fresh_unbacked_symbols() if mode and mode.shape_env else contextlib.nullcontext():
            tmp = view.target(tmp, *args, **kwargs)
    if torch.broadcast_shapes(src.shape, tmp.shape) != tmp.shape:
        raise RuntimeError(f"shape error in scatter op, can not broadcast {src.shape} to {tmp.shape}")
    return inp


@torch.library.custom_op("step_twin::attention", mutates_args=())
def opaque_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Stands in for cuDNN/flash attention (not Inductor's code): q [B, T, H, D], k, v [B, T, Hkv, D] -> q's shape."""
    return torch.empty_like(q)


@opaque_attention.register_fake
def _(q, k, v):
    return torch.empty_like(q)


@torch.library.custom_op("step_twin::attention_backward", mutates_args=())
def opaque_attention_backward(grad: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                              v: torch.Tensor) -> list[torch.Tensor]:
    return [torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)]


@opaque_attention_backward.register_fake
def _(grad, q, k, v):
    return [torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)]


def _attention_setup(ctx, inputs, output):
    ctx.save_for_backward(*inputs)


def _attention_backward(ctx, grad):
    return tuple(opaque_attention_backward(grad, *ctx.saved_tensors))


opaque_attention.register_autograd(_attention_backward, setup_context=_attention_setup)


def _twin_attention(q, k, v):
    dt = torch.bfloat16  # what SDPA and flash-attn run under bf16 autocast, output in v's dtype as kit.attention
    return opaque_attention(q.to(dt), k.to(dt), v.to(dt)).to(v.dtype)


def _to_cuda(arg):
    if isinstance(arg, torch.device) and arg.type == "cpu":
        return torch.device("cuda", 0)
    if isinstance(arg, (list, tuple)):
        return type(arg)(_to_cuda(a) for a in arg)
    if isinstance(arg, dict):
        return {k: _to_cuda(v) for k, v in arg.items()}
    return arg


def _expand_masked_index_put(graph) -> None:
    """Rewrite aten._unsafe_masked_index_put_accumulate (the embedding backward) into the aten ops of its
    decomposition: its own fake kernel asks for a CUDA device guard that a CPU build lacks (torch 2.13)."""
    aten = torch.ops.aten
    for node in list(graph.nodes):
        if node.target is not aten._unsafe_masked_index_put_accumulate.default:
            continue
        x, mask, indices, values = node.args
        size = node.meta["val"].shape
        with graph.inserting_before(node):
            clamped = [None if index is None else graph.call_function(
                aten.clamp_max.default, (graph.call_function(aten.clamp_min.default, (index, -size[i])), size[i] - 1))
                for i, index in enumerate(indices)]
            kept = graph.call_function(aten.mul.Tensor, (values, mask))  # masked-off rows: 0 (as masked_fill)
            put = graph.call_function(aten._unsafe_index_put.default, (x, clamped, kept, True))
        put.meta = dict(node.meta)
        node.replace_all_uses_with(put)
        graph.erase_node(node)


def _fake_on_cuda(value):
    """A fake tensor's twin on `cuda` (same shape, strides, dtype), through lists/tuples; others unchanged."""
    if isinstance(value, torch.Tensor):
        if value.device.type != "cpu":
            return value
        return torch.empty_strided(value.shape, value.stride(), dtype=value.dtype, device="cuda")
    if isinstance(value, (list, tuple)):
        return type(value)(_fake_on_cuda(v) for v in value)
    return value


def _twin_rms_norm(fp32_rule: bool):
    """F.rms_norm as CUDA runs it: aten._fused_rms_norm (CUDA's kernel, decomposed by Inductor), with CUDA
    autocast's float32 policy for rms_norm from torch 2.12 when fp32_rule (pytorch/pytorch#188955)."""
    def rms_norm(x, normalized_shape, weight=None, eps=None):
        if fp32_rule and torch.is_autocast_enabled("cpu"):
            x, weight = x.float(), None if weight is None else weight.float()
        with torch.autocast("cpu", enabled=False):
            return torch.ops.aten._fused_rms_norm(x, list(normalized_shape), weight, eps)[0]
    return rms_norm


def generate_cuda_step(config: dict, batch: int, seq_len: int, out_dir, inductor_overrides: dict | None = None,
                       qat_policy=None, log=print) -> dict:
    """Write Inductor's CUDA code for one micro-batch (forward + backward of GPT(**config)(x, y), x and y
    [batch, seq_len] int64) under bf16 autocast, for a pretended H100, without a GPU (nothing runs).

    Method: dynamo captures the step on the CPU; AOTAutograd traces it on
    fake CPU tensors under CPU bf16 autocast, with F.rms_norm routed to CUDA's fused kernel and, on torch >=
    2.12, CUDA autocast's float32 rms_norm rule; each forward/backward graph is then moved to fake `cuda`
    tensors and handed to Inductor's CUDA codegen. Attention is an opaque op (cuDNN/flash are not
    Inductor's). qat_policy: configure_qat's policy (None: QAT off, as with QAT_START_FRAC=0).
    inductor_overrides: torch._inductor.config values, e.g. {"triton.mix_order_reduction": False}.
    Returns {"forward": path, "backward": path}. Raises RuntimeError (one line) when this torch cannot.
    """
    import copy
    import os
    from unittest import mock

    if (why := triton_status()):
        raise RuntimeError(why)
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(out_dir)
    import torch._dynamo
    import torch._inductor.config as inductor_config
    import torch.nn.functional as F
    from torch._functorch._aot_autograd.utils import make_boxed_func
    from torch._guards import detect_fake_mode
    from torch._inductor.compile_fx import compile_fx, compile_fx_inner
    from torch._subclasses.fake_tensor import FakeTensorMode

    import model.gpt as kit_model  # the model module's own name for attention (patched below)
    from trainer.loop import step_compile_options

    written, steps, fake_mode = [], [], FakeTensorMode(allow_non_fake_inputs=True)

    def inner(graph, example_inputs, **kwargs):
        runnable = copy.deepcopy(graph)  # keeps running on CPU fakes so the backward can be traced
        for node in graph.graph.nodes:
            node.args, node.kwargs = _to_cuda(node.args), _to_cuda(node.kwargs)
        _expand_masked_index_put(graph.graph)
        graph.recompile()
        mode = detect_fake_mode(example_inputs) or fake_mode  # AOTAutograd's own fake mode
        with mode:
            cuda_inputs = _fake_on_cuda(list(example_inputs))
            for node in graph.graph.nodes:  # the same fake values, on the GPU (running the graph is not needed)
                if "val" in node.meta:
                    node.meta["val"] = _fake_on_cuda(node.meta["val"])
        with pretend_h100(written):
            before = len(written)
            try:
                compile_fx_inner(graph, cuda_inputs, **kwargs)
            except Exception:  # Inductor wraps _CodeWritten in its InductorError: fine once the code is out
                if len(written) == before:
                    raise
        return make_boxed_func(runnable)

    def backend(gm, example_inputs):
        with fake_mode:
            fakes = [torch.empty_strided(t.shape, t.stride(), dtype=t.dtype).requires_grad_(t.requires_grad)
                     for t in example_inputs]
        steps.append((compile_fx(gm, fakes, inner_compile=inner), fakes))
        return lambda *args: (torch.zeros(()),)

    torch.manual_seed(0)
    with torch.device("meta"):
        model = GPT(**config)
    model = model.to_empty(device="cpu")
    if qat_policy is not None:
        model.configure_qat(qat_policy)
    x = torch.zeros(batch, seq_len, dtype=torch.int64)
    overrides = {"fx_graph_cache": False, "compile_threads": 1, "benchmark_kernel": True,
                 **step_compile_options(), **(inductor_overrides or {})}  # the trainer's step options first
    fp32_rule = tuple(int(v) for v in torch.__version__.split("+")[0].split(".")[:2]) >= (2, 12)
    torch._dynamo.reset()
    with (mock.patch.object(kit_model, "attention", _twin_attention),
          mock.patch.object(F, "rms_norm", _twin_rms_norm(fp32_rule)),
          inductor_config.patch(overrides), torch.autocast("cpu", torch.bfloat16)):
        torch.compile(model, backend=backend, fullgraph=True, dynamic=False)(x, x)
        compiled, fakes = steps[0]
        with fake_mode:  # the backward graph is compiled when first run (outside dynamo's compile context)
            out = compiled(*fakes)
            (out[0] if isinstance(out, (list, tuple)) else out).backward()
    torch._dynamo.reset()
    forward, backward = _forward_and_backward(written)
    log(f"step_twin: {len(written)} modules generated under {out_dir} (torch {torch.__version__}, CUDA rms_norm "
        f"{'float32' if fp32_rule else 'input dtype'} under autocast)")
    return {"forward": forward, "backward": backward}


def _forward_and_backward(paths) -> tuple:
    """(forward, backward) among generated modules: the backward's call() takes tangents."""
    from pathlib import Path

    texts = {p: Path(p).read_text() for p in paths}
    bwd = [p for p, t in texts.items() if "tangents_" in t]
    fwd = [p for p, t in texts.items() if "tangents_" not in t]
    pick = lambda ps: max(ps, key=lambda p: len(texts[p])) if ps else None  # noqa: E731
    return pick(fwd), pick(bwd)


KERNEL_DEF = re.compile(r"^(\w+) = async_compile\.triton\('\w+', '''(.*?)''', device_str='cuda'\)", re.S | re.M)
NUM_GB = re.compile(r"'kernel_num_gb':\s*([0-9.eE+-]+)")
ALLOC = re.compile(r"empty_strided_cuda\(\(([\d, ]*)\), \([\d, ]*\), torch\.(\w+)\)")


@dataclasses.dataclass
class Kernel:
    """One generated Triton kernel: `bytes` per launch (Inductor's estimate of bytes read + written),
    `launches` per micro-batch, `kind` pointwise / reduction / persistent_reduction. `unread_inplace_bytes`
    (all launches): what that estimate charges as read for an in-place (in_out_ptr) buffer the kernel only
    writes (Inductor counts every in_out_ptr twice)."""

    name: str
    source: str
    bytes: float
    launches: int
    kind: str
    unread_inplace_bytes: float = 0.0
    estimated: bool = True  # False: no kernel_num_gb in its metadata (combo kernels): its bytes count as 0


@dataclasses.dataclass
class ModuleStats:
    """A generated forward or backward module: its kernels and its float32 buffer allocations (shapes)."""

    kernels: list
    fp32_buffers: list
    num_extern_calls: int  # matmuls and the attention op (not Inductor's code): not in bytes_moved

    @property
    def bytes_moved(self) -> float:
        return sum(k.bytes * k.launches for k in self.kernels)

    @property
    def unestimated(self) -> list:
        """Names of the launched kernels without a byte estimate: bytes_moved is then a lower bound."""
        return [k.name for k in self.kernels if k.launches and not k.estimated]

    @property
    def unread_inplace_bytes(self) -> float:
        """The part of bytes_moved charged as reads of in-place outputs no kernel loads (Kernel's docstring)."""
        return sum(k.unread_inplace_bytes for k in self.kernels)

    def full_size_fp32(self, num_tokens: int, model_dim: int) -> list:
        """float32 buffers of num_tokens x model_dim elements or more whose leading dims hold the tokens."""
        return [shape for shape in self.fp32_buffers if shape and _numel(shape) >= num_tokens * model_dim
                and (shape[0] == num_tokens or len(shape) > 1 and shape[0] * shape[1] == num_tokens)]


def kernel_stats(path) -> ModuleStats:
    """Parse one Inductor output module (generate_cuda_step's) into ModuleStats. Needs benchmark_kernel=True
    codegen (kernel_num_gb in each kernel's metadata); launches are counted in the module's call()."""
    from pathlib import Path

    text = Path(path).read_text()
    head, _, tail = text.partition("async_compile.wait(globals())")
    body = tail.split("def benchmark_compiled_module")[0]
    kernels = []
    numels = _buffer_numels(body)
    for match in KERNEL_DEF.finditer(head):
        name, source = match.group(1), match.group(2)
        gb = NUM_GB.search(source)
        kind = re.search(r"@triton_heuristics\.(\w+)\(", source)
        kernels.append(Kernel(name, source, float(gb.group(1)) * 1e9 if gb else 0.0,
                              len(re.findall(rf"\b{name}\.run\(", body)), kind.group(1) if kind else "?",
                              _unread_inplace_bytes(name, source, body, numels), estimated=gb is not None))
    fp32 = [tuple(int(v) for v in dims.split(",") if v.strip()) for dims, dtype in ALLOC.findall(body)
            if dtype == "float32"]
    return ModuleStats(kernels, fp32, len(re.findall(r"extern_kernels\.\w+\(|torch\.ops\.step_twin\.", body)))


SIGNATURE = re.compile(r"'signature': \{([^}]*)\}")
POINTER_BYTES = {"*bf16": 2, "*fp16": 2, "*fp32": 4, "*fp64": 8, "*i64": 8, "*i32": 4, "*i8": 1, "*i1": 1, "*u8": 1}


def _split_args(text: str) -> list:
    """A call's argument list split at its top-level commas."""
    out, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        depth += ch in "([" and 1 or -(ch in ")]")
        if ch == "," and depth == 0:
            out.append(text[start:i].strip())
            start = i + 1
    return out + [text[start:].strip()]


def _dims_numel(dims: str) -> int:
    n = 1
    for v in dims.split(","):
        n *= int(v) if v.strip() else 1
    return n


def _buffer_numels(body: str) -> dict:
    """{buffer name: element count} of a generated call(): allocations, views, inputs' size asserts, reuses."""
    numels = {}
    for line in body.splitlines():
        line = line.strip()
        if m := re.match(r"(\w+) = (?:empty_strided_cuda|reinterpret_tensor\(\w+,)\s*\(\(?([\d, ]*)\)", line):
            numels[m.group(1)] = _dims_numel(m.group(2))
        elif m := re.match(r"assert_size_stride\((\w+), \(([\d, ]*)\)", line):
            numels.setdefault(m.group(1), _dims_numel(m.group(2)))
        elif (m := re.match(r"(\w+) = (\w+)(?:;|\s*#|$)", line)) and m.group(2) in numels:
            numels[m.group(1)] = numels[m.group(2)]
    return numels


def _unread_inplace_bytes(name: str, source: str, body: str, numels: dict) -> float:
    """Bytes over all of `name`'s launches of its in_out_ptr arguments that the kernel never loads."""
    sig = SIGNATURE.search(source)
    if not sig:
        return 0.0
    params = [(k.strip().strip("'"), v.strip().strip("'")) for k, v in
              (item.split(":") for item in sig.group(1).split(",") if ":" in item)]
    unread = [(i, POINTER_BYTES.get(kind, 0)) for i, (arg, kind) in enumerate(params)
              if arg.startswith("in_out_ptr") and not re.search(rf"tl\.load\({arg}\b", source)]
    total = 0.0
    for call in re.finditer(rf"\b{name}\.run\((.*)\)", body):
        args = _split_args(call.group(1))
        for i, size in unread:
            arg = args[i] if i < len(args) else ""
            view = re.match(r"reinterpret_tensor\(\w+, \(([\d, ]*)\)", arg)
            total += size * (_dims_numel(view.group(1)) if view else numels.get(arg, 0))
    return total


PTXAS_INFO = re.compile(r"(\d+) bytes spill stores, (\d+) bytes spill loads.*?Used (\d+) registers", re.S)


def ptxas_spills(kernel: Kernel, work_dir) -> list:
    """Compile one generated kernel for sm_90a with each launch config Inductor's heuristic gives it, and
    read ptxas's report: [{"config", "num_warps", "registers", "spill_stores_bytes", "spill_loads_bytes"}]
    (bytes per thread). Uses Triton's bundled ptxas; no GPU. Raises RuntimeError if ptxas is missing."""
    import importlib.util
    import os
    import subprocess
    from pathlib import Path

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    ptxas = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"
    if not ptxas.exists():
        raise RuntimeError(f"no ptxas in triton {triton.__version__} ({ptxas})")
    work_dir = Path(work_dir)
    work_dir.mkdir(parents=True, exist_ok=True)
    # the kernel module asks for an active GPU driver and CUDA's stream at import: not needed to compile
    source = kernel.source.replace("triton_helpers.set_driver_to_gpu()", "").replace(
        "from torch._C import _cuda_getCurrentRawStream as get_raw_stream", "")
    path = work_dir / f"{kernel.name}.py"  # @triton.jit needs its function in a file
    path.write_text(source)
    spec = importlib.util.spec_from_file_location(kernel.name, path)
    module = importlib.util.module_from_spec(spec)
    with pretend_h100([]):
        spec.loader.exec_module(module)
    tuner = getattr(module, kernel.name)
    meta, rows = tuner.triton_meta, []
    for i, config in enumerate(tuner.configs):
        constants = {**meta.get("constants", {}), **config.kwargs}
        signature = {**meta["signature"], **{name: "constexpr" for name in constants}}
        attrs = (meta.get("configs") or [{}])[0]
        compiled = triton.compile(ASTSource(fn=tuner.fn, signature=signature, constexprs=constants, attrs=attrs),
                                  target=GPUTarget("cuda", 90, 32),
                                  options={"num_warps": config.num_warps, "num_stages": config.num_stages})
        ptx = work_dir / f"{kernel.name}_{i}.ptx"
        ptx.write_text(compiled.asm["ptx"])
        out = subprocess.run([str(ptxas), "-arch=sm_90a", "-v", str(ptx), "-o", os.devnull], capture_output=True,
                             text=True, timeout=300)
        info = PTXAS_INFO.search(out.stderr)
        if out.returncode or not info:
            raise RuntimeError(f"ptxas failed on {kernel.name}: {out.stderr[-300:]}")
        rows.append({"config": dict(config.kwargs), "num_warps": config.num_warps, "registers": int(info.group(3)),
                     "spill_stores_bytes": int(info.group(1)), "spill_loads_bytes": int(info.group(2))})
    return rows


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
