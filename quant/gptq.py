"""Full GPTQ: per-row intN quantization with error feedback through the inverse input Hessian.

Source: Frantar et al. 2022, "GPTQ: Accurate Post-Training Quantization for Generative Pre-trained
Transformers" (arXiv:2210.17323): quantize the columns of W [R, C] one at a time; the rounding
error of column j, divided by the j-th diagonal of the upper Cholesky factor U of H^-1, is pushed
onto the not yet quantized columns through row j of U, which minimizes the layer-output error
||(W - Q) X||^2 for the calibration inputs X (H = X^T X). Lazy batch updates over blocks of 128
columns, damping 1% of the mean diagonal, columns in descending diag(H) order (act-order).
In parameter golf: PR #535 (-0.0026 bpb over percentile clip search at int6), PR #1422 (about
-0.007 on one GPU over round-to-nearest), Hessians from training batches inside the 600 s with
the solve after the clock (GPTQ_RESERVE_SECONDS; about 7 s for 64 batches on one H100, PR #1763).

Scales are per row and fixed before the solve, exactly as primitives.rowquant computes them for a clip
quantile, so the artifact format does not change. The clip is chosen per row among the GPTQ-lite
quantiles by the Hessian-weighted error (every candidate is solved at once: the rows are
independent given H). With H = I there is no feedback and the result is round-to-nearest.
GPTQ runs where the weights are (the export's CPU copy: deterministic).

Size note: bundled into the counted train_gpt.py.
"""

import contextlib
import math
import time
from collections.abc import Callable

import torch

from primitives.env import BUNDLE_KIND
from primitives.progress import Progress
from primitives.rowquant import QUANT_CLIP_QUANTILES, quantize_per_row
from quant.gptq_records import gptq_records_order


def gptq_quantize(weight: torch.Tensor, h: torch.Tensor, nbits: int, clips: tuple = QUANT_CLIP_QUANTILES,
                  scale: torch.Tensor | None = None, records: bool = False) -> tuple:
    """Full GPTQ at nbits of weight w [R, C] (float, CPU or CUDA) with input Hessian h [C, C] (X^T X, any positive
    scale).

    Returns (q int8 [R, C] in [-qmax, qmax], scale float16 [R], clip float): each row keeps the
    clip quantile of `clips` (ties to the earlier) whose GPTQ result has the lowest
    (w - w') h (w - w')^T; clip is the mean chosen quantile (informational). Blocks of 128 columns,
    damping 1% of the mean diagonal (the factorization runs in float64: h + damping is positive
    definite even for inputs that never fire or fewer samples than columns). ValueError for nbits
    outside 2..8. scale: fixed float16 [R] row scales (quant/sdclip.py) instead of the clip
    candidates; `clips` is then a 1-tuple whose value is returned as the clip. records (QUANT_GPTQ_RECORDS):
    PR #1855's arithmetic: inputs that never fire (diag(h) = 0) get diagonal 1 and zero weights, the damping
    is added before the act-order sort, the factorization runs in float32 (its codes, tools/parity/parity_quant.py).
    """
    m, (r, c), k = (1 << nbits - 1) - 1, weight.shape, len(clips)
    w = weight.detach().float()
    s = (torch.cat([quantize_per_row(w, nbits, p)[1].float() for p in clips]) if scale is None  # [K*R]: the candidates
         else scale.to(w.device).float())  # fixed scales [R] (SDClip; clips then holds its one k)
    h = h.to(w)
    if records:  # PR #1855's order of operations, in float32 (quant/gptq_records.py)
        g, o, h, w = gptq_records_order(h, w)
    else:
        o = torch.argsort(h.diagonal(), descending=True, stable=True)  # act-order
        g = h[o][:, o].double()
        g = g + 0.01 * g.diagonal().mean() * torch.eye(c, dtype=g.dtype, device=g.device)
    u = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(g)), upper=True).to(w)  # upper factor of H^-1
    x, q = w[:, o].repeat(k, 1), w.new_empty(k * r, c)
    for i in range(0, c, 128):
        j = min(i + 128, c)
        b, e = x[:, i:j], w.new_empty(k * r, j - i)  # b: a view, updated in place
        for t in range(j - i):
            q[:, i + t] = z = torch.round(b[:, t] / s).clamp(-m, m)
            e[:, t] = (b[:, t] - z * s) / u[i + t, i + t]
            b[:, t + 1:] -= e[:, t:t + 1] * u[i + t, i + t + 1:j]
        x[:, j:] -= e @ u[i:j, j:]  # the block's error, pushed onto the later columns at once
    q = q[:, o.argsort()]
    d = q * s[:, None] - w.repeat(k, 1)
    a, n = ((d @ h) * d).sum(1).view(k, r).argmin(0), torch.arange(r, device=w.device)  # argmin: the first minimum
    return q.view(k, r, c)[a, n].to(torch.int8), s.view(k, r)[a, n].half(), sum(clips[i] for i in a.tolist()) / r


@torch.no_grad()
def collect_gptq_hessians(model: torch.nn.Module, next_batch: Callable, num_batches: int, *, deadline: float = math.inf,
                          autocast: Callable = contextlib.nullcontext, batch_seconds: float = 0.0,
                          clock: Callable = time.perf_counter, cross_docs: bool = False) -> tuple:
    """Mean input second moment H = E[x x^T] of every nn.Linear in `model`, and of the output head's input,
    over training batches.

    model: a model.gpt.GPT (its `forward_hidden`, `head_weight()` and `doc_packed_attention` are read).
    next_batch() -> (x, y) int64 [B, T] token batches (the trainer's train loader: calibration never
    touches val tokens); model(x, y) runs the forward (its output is ignored). The head (the tied embedding is
    not a module call) gets the H of forward_hidden's output (the final norm's, [D, D]) under the head parameter's name
    ("tok_emb.weight" when tied): GPTQ on the tied embedding, PR #1394 / #1586. Reads up to
    num_batches batches (at least one, so that every rank has every H to average); after the first,
    a batch starts only if it is projected to end by `deadline` (clock() seconds), at the larger of
    batch_seconds (e.g. timed before the training clock) and the mean measured so far. Returns
    ({"<module>.weight": H float32 [C, C] on the model's device, summed in float32 even under
    `autocast`}, number of batches read). cross_docs (GPTQ_CALIB_CROSS_DOCS): the model's doc_packed_attention off
    while collecting, so calibration attends across documents as PR #1855's does (its forward without cu_seqlens).
    """
    sums, last, n = {}, [None], 0

    def hook(mod: torch.nn.Module, args: tuple, out: torch.Tensor) -> None:
        if args[0] is not last[0]:  # c_q, c_k, c_v share one input: one product
            a = args[0].flatten(0, -2).float()
            with torch.autocast(a.device.type, enabled=False):  # autocast would sum X^T X in bf16
                last[:] = args[0], a.T @ a, len(a)
        h, c = sums.get(mod, (0, 0))
        sums[mod] = last[1] + h, c + last[2]

    hooks = [m.register_forward_hook(hook) for m in model.modules() if isinstance(m, torch.nn.Linear)]
    names = {m: k + ".weight" for k, m in model.named_modules()}
    hidden = model.forward_hidden  # the head's input, the final norm's output; also the key of the head's H
    names[hidden] = next(k for k, p in model.named_parameters() if p is model.head_weight())

    def forward_hidden(*args, **kwargs):
        out = hidden(*args, **kwargs)
        hook(hidden, (out,), None)
        return out
    model.forward_hidden = forward_hidden  # an instance attribute: the class is unchanged
    start = clock()
    if BUNDLE_KIND == "package":  # the kit's progress line
        bar = Progress("gptq calibration", num_batches, "batches")
    cross_docs = cross_docs and model.doc_packed_attention
    if cross_docs:
        model.doc_packed_attention = False
    try:
        while n < num_batches and (n == 0 or clock() + max(batch_seconds, (clock() - start) / n) <= deadline):
            with autocast():
                model(*next_batch())
            n += 1
            if BUNDLE_KIND == "package":
                bar.update()
    finally:
        if BUNDLE_KIND == "package":
            bar.close()
        for x in hooks:
            x.remove()
        del model.forward_hidden  # the class's method again
        if cross_docs:
            model.doc_packed_attention = True
    return {names[m]: h / c for m, (h, c) in sums.items()}, n
