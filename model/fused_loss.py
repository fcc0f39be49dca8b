"""The training loss without its [N, V] logits: linear -> softcap -> cross entropy in one fused op (LOSS_KERNEL).

LOSS_KERNEL=liger runs Liger-Kernel's fused linear cross entropy (PyPI liger-kernel==0.8.5, Triton, CUDA only):
logits are made, softcapped, reduced and turned into gradients one chunk of tokens at a time, so the bf16
logits and their float32 softcap/cross-entropy copies of the plain loss (tens of GB of traffic per step at
524,288 tokens and V=8192) are never materialized. LOSS_KERNEL=torch is model/softcap_loss.py's loss (whole
bf16 logits, their gradient made in the forward), compiled with the step. auto = torch: on one H100 (torch 2.11,
2026-11-27) the step at the default preset (32 sequences per micro-batch) took 307.2 ms with it and 344.5 ms with
Liger (SDPA both; Liger's peak memory 1.8 GiB lower): take liger where memory binds.

Liger computes the gradients inside the forward; its autograd.Function and Python chunk loop cannot be traced
by torch.compile(fullgraph=True), so one custom op wraps it: `pgkit::linear_softcap_ce` (x, W, target,
softcap) -> (loss, dx, dW) for grad_output = 1; its autograd scales dx and dW by the incoming gradient.
`pgkit::linear_softcap_nll` is the scoring form (per-token NLL, Liger's reduction="none", no gradients) behind
GPT.forward_nll. The ops' CPU kernel is the twin (softcap_ce_twin): the same contract and chunking in torch math.
The package checks the ops' input contract (_check_contract); a record's train_gpt.py, whose only caller is
fused_softcap_op, does not carry it.
"""

import math

import torch

from primitives.env import BUNDLE_KIND
from model.attn_ops import autocast_dtype
from model.softcap_loss import _FUSED_LOSS, fused_loss_active  # noqa: F401 (fused_loss_active: this module's API too)

# the packed train_gpt.py holds the fused loss only for runs that ask for it (kit/bundle_when.py): auto is torch
PACKED_WHEN = "LOSS_KERNEL == 'liger'"
LOSS_KERNELS = ("auto", "liger", "torch")


def choose_loss_kernel(requested: str, device: torch.device, log=None, /) -> str:
    """"liger" or "torch" for LOSS_KERNEL=`requested` on `device`; nothing is set. auto is torch (the measured
    faster kernel, module docstring). Liger is taken only when it imports and passes liger_self_check. Raises
    ValueError naming LOSS_KERNEL for an unknown value, or for liger without CUDA, without an importable
    liger_kernel or failing its check."""
    if BUNDLE_KIND == "package":  # a record's file: LOSS_KERNEL's choices are the settings' preflight
        if requested not in LOSS_KERNELS:
            raise ValueError(f"LOSS_KERNEL={requested!r}: expected one of {', '.join(LOSS_KERNELS)}")
    if requested != "liger":
        return "torch"
    if device.type != "cuda":
        raise ValueError(f"LOSS_KERNEL={requested!r}: Liger-Kernel needs CUDA, this run is on {device.type}; expected "
                         "LOSS_KERNEL=auto or torch")
    try:
        import liger_kernel.ops.fused_linear_cross_entropy  # noqa: F401
    except Exception as err:  # missing, or a Triton that does not match this torch
        raise ValueError(f"LOSS_KERNEL='liger': cannot import liger_kernel.ops.fused_linear_cross_entropy: {err}"
                         ) from None
    why = liger_self_check(device)
    if why:
        raise ValueError(f"LOSS_KERNEL='liger': Liger-Kernel fails its check on {device}: {why}; expected LOSS_KERNEL="
                         "auto or torch")
    return "liger"


def liger_self_check(device: torch.device, /) -> str:
    """"" when Liger's kernel (as the op calls it) gives the twin's loss and gradients on a small bf16 problem with
    strongly capped logits on `device`, else why not (its error, or the mismatch). Own generator: the run's RNG
    stream is untouched."""
    try:
        g = torch.Generator(device).manual_seed(0)
        x, w = (torch.randn(n, 64, device=device, generator=g).bfloat16() for n in (64, 256))
        target = torch.randint(0, 256, (64,), device=device, generator=g)
        got = _linear_softcap_ce_liger(x, w, target, 8.0)
    except Exception as err:  # e.g. a Triton that cannot compile for this GPU
        return f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"
    nll, dx, dw = softcap_ce_twin(x, w, target, 8.0)
    for name, a, b in zip(("loss", "dx", "dweight"), got, (nll.mean(), dx, dw)):
        if not torch.allclose(a.float(), b.float(), rtol=0.02, atol=0.02 * b.abs().max().item()):
            return f"its {name} differs from the plain loss's by {(a.float() - b.float()).abs().max().item():.3g}"
    return ""


def resolve_loss_kernel(requested: str, device: torch.device, log=print, /) -> str:
    """choose_loss_kernel, then make GPT.forward use it process-wide; logs "loss:liger" or "loss:torch"."""
    name = choose_loss_kernel(requested, device, log)
    _FUSED_LOSS[:] = [True] * (name == "liger")
    log(f"loss:{name}")
    return name


def _check_contract(x: torch.Tensor, weight: torch.Tensor, target: torch.Tensor, softcap: float) -> None:
    """What Liger's fused_linear_cross_entropy_forward needs (x [N, D] and weight [V, D] of one float dtype for its
    matmuls, int64 targets [N]) and what the op promises (softcap > 0, N >= 1); RuntimeError otherwise."""
    if not (x.dim() == weight.dim() == 2 and x.size(1) == weight.size(1) and x.dtype == weight.dtype
            and x.is_floating_point() and target.dtype == torch.int64 and target.shape == x.shape[:1] and len(x)
            and softcap > 0):
        raise RuntimeError(f"linear_softcap_ce: expected x [N, D] and weight [V, D] of one float dtype, int64 target "
                           f"[N], softcap > 0; got {x.dtype}{list(x.shape)}, {weight.dtype}{list(weight.shape)}, "
                           f"{target.dtype}{list(target.shape)}, {softcap}")


def chunk_tokens(num_tokens: int, vocab_size: int, model_dim: int, /) -> int:
    """Liger's chunk: about num_tokens x model_dim logits at once (a power of two, at most num_tokens)."""
    return min(num_tokens, 1 << (math.ceil(num_tokens / math.ceil(vocab_size / model_dim)) - 1).bit_length())


def softcap_ce_twin(x: torch.Tensor, weight: torch.Tensor, target: torch.Tensor, softcap: float, /,
                    grads: bool = True) -> tuple:
    """The fused ops' CPU kernel (and their reference on any device), in chunked torch math: (per-token NLL float32
    [N], dloss/dx, dloss/dweight of the mean loss) with `grads`, else (NLL, None, None). Liger's chunks (logits in
    x's dtype, softcap/softmax/loss in float32, the logits' gradient rounded to x's dtype before the two matmuls,
    dweight summed in float32: Liger with accum_dtype=float32)."""
    if BUNDLE_KIND == "package":  # a record's file: its own ops' inputs (fused_softcap_op casts them)
        _check_contract(x, weight, target, softcap)
    n = x.size(0)
    chunk = chunk_tokens(n, weight.size(0), x.size(1))
    nll = torch.empty(n, dtype=torch.float32, device=x.device)
    dx, dw = (torch.empty_like(x), torch.zeros(weight.shape, dtype=torch.float32, device=x.device)) if grads else (None,) * 2
    with torch.autocast(x.device.type, enabled=False):
        for s in range(0, n, chunk):
            xc, tc = x[s:s + chunk], target[s:s + chunk]
            t = torch.tanh((xc @ weight.t()).float() / softcap)
            z = softcap * t
            lse = torch.logsumexp(z, dim=1)
            nll[s:s + chunk] = lse - z.gather(1, tc[:, None])[:, 0]
            if grads:
                g = torch.exp(z - lse[:, None])
                g[torch.arange(tc.numel(), device=x.device), tc] -= 1.0
                g = (g * (1.0 - t * t) / n).to(x.dtype)
                dx[s:s + chunk] = g @ weight
                dw += g.t().float() @ xc.float()  # exact products, float32 sums
    return nll, dx, dw if dw is None else dw.to(weight.dtype)


# the schema spelled out: the packed train_gpt.py drops annotations, from which custom_op would infer it
@torch.library.custom_op("pgkit::linear_softcap_ce", mutates_args=(),
                         schema="(Tensor x, Tensor weight, Tensor target, float softcap) -> (Tensor, Tensor, Tensor)")
def linear_softcap_ce(x: torch.Tensor, weight: torch.Tensor, target: torch.Tensor,
                      softcap: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(mean loss float32 [], dloss/dx [N, D] x.dtype, dloss/dweight [V, D] weight.dtype) of the mean cross
    entropy of softcap * tanh(x @ weight^T / softcap) against target; CPU: softcap_ce_twin."""
    nll, dx, dw = softcap_ce_twin(x, weight, target, softcap)
    return nll.sum() / nll.numel(), dx, dw


@linear_softcap_ce.register_kernel("cuda")
def _linear_softcap_ce_liger(x, weight, target, softcap):
    # The call LigerFusedLinearCrossEntropyFunction.forward makes for reduction="mean" (liger_kernel.transformers.
    # functional.liger_fused_linear_cross_entropy's path: ce_impl=None, the Triton kernel), gradients forced on since
    # a custom op's inputs carry no requires_grad. accum_dtype=float32: dW summed over the chunks in float32, then
    # rounded once to weight's dtype (with None it would be rounded to bf16 after every chunk).
    if BUNDLE_KIND == "package":  # (as softcap_ce_twin)
        _check_contract(x, weight, target, softcap)
    from liger_kernel.ops.fused_linear_cross_entropy import fused_linear_cross_entropy_forward

    with torch.no_grad(), torch.autocast("cuda", enabled=False):
        loss, _, _, _, dx, dw, _ = fused_linear_cross_entropy_forward(
            _input=x, weight=weight, target=target, reduction="mean", softcap=softcap, accum_dtype=torch.float32,
            compute_gradients=True, weight_requires_grad=True)
    return loss, dx, dw


@linear_softcap_ce.register_fake
def _linear_softcap_ce_fake(x, weight, target, softcap):
    if BUNDLE_KIND == "package":  # (as softcap_ce_twin)
        _check_contract(x, weight, target, softcap)
    return x.new_empty((), dtype=torch.float32), torch.empty_like(x), torch.empty_like(weight)


def _linear_softcap_ce_setup(ctx, inputs, output):
    ctx.save_for_backward(output[1], output[2])
    ctx.mark_non_differentiable(output[1], output[2])


def _linear_softcap_ce_backward(ctx, grad_loss, grad_dx, grad_dw):
    dx, dw = ctx.saved_tensors
    return grad_loss * dx, grad_loss * dw, None, None


linear_softcap_ce.register_autograd(_linear_softcap_ce_backward, setup_context=_linear_softcap_ce_setup)


@torch.library.custom_op("pgkit::linear_softcap_nll", mutates_args=(),
                         schema="(Tensor x, Tensor weight, Tensor target, float softcap) -> Tensor")
def linear_softcap_nll(x: torch.Tensor, weight: torch.Tensor, target: torch.Tensor, softcap: float) -> torch.Tensor:
    """Per-token NLL float32 [N] of the softcapped logits (scoring: no gradient); CPU: softcap_ce_twin."""
    return softcap_ce_twin(x, weight, target, softcap, grads=False)[0]


@linear_softcap_nll.register_kernel("cuda")
def _linear_softcap_nll_liger(x, weight, target, softcap):
    # Liger's reduction="none" forward without gradients: the kernel writes only the per-row losses
    if BUNDLE_KIND == "package":  # (as softcap_ce_twin)
        _check_contract(x, weight, target, softcap)
    from liger_kernel.ops.fused_linear_cross_entropy import fused_linear_cross_entropy_forward

    with torch.no_grad(), torch.autocast("cuda", enabled=False):
        return fused_linear_cross_entropy_forward(_input=x, weight=weight, target=target, reduction="none",
                                                  softcap=softcap, compute_gradients=False)[0]


@linear_softcap_nll.register_fake
def _linear_softcap_nll_fake(x, weight, target, softcap):
    if BUNDLE_KIND == "package":  # (as softcap_ce_twin)
        _check_contract(x, weight, target, softcap)
    return x.new_empty(x.shape[:1], dtype=torch.float32)


def linear_softcap_cross_entropy(x: torch.Tensor, weight: torch.Tensor, target: torch.Tensor,
                                 softcap: float, /) -> torch.Tensor:
    """Mean cross entropy (nats, float32 []) of the softcapped logits softcap * tanh(x @ weight^T / softcap)
    against target, through the fused op: x [N, D], weight [V, D] (the tied embedding or the head), target
    int64 [N]. Under autocast x and weight are cast to its dtype, as F.linear would (Liger multiplies one
    dtype); without it weight is cast to x's. Gradients reach x and weight through the casts."""
    return fused_softcap_op(linear_softcap_ce, x, weight, target, softcap)[0]


def fused_loss(model, input_ids: torch.Tensor, target_ids: torch.Tensor, /) -> torch.Tensor:
    """model.gpt.GPT.forward with LOSS_KERNEL=liger: the mean cross entropy (nats) of target_ids int64 [B, T] through
    linear_softcap_cross_entropy on model's final hidden states, no [B*T, V] logits."""
    x = model.forward_hidden(input_ids)
    return linear_softcap_cross_entropy(x.reshape(-1, x.size(-1)), model.head_weight(), target_ids.reshape(-1),
                                        model.logit_softcap)


def fused_softcap_op(op, x: torch.Tensor, weight: torch.Tensor, target: torch.Tensor, softcap: float, /):
    """op(x, weight, target, softcap) with x and weight cast to the autocast dtype (else weight to x's)."""
    dt = autocast_dtype(x)
    return op(x.to(dt), weight.to(dt), target, float(softcap))
