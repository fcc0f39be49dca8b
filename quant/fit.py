"""The budget fit: the most precise per-tensor bit widths whose artifact fits BYTE_BUDGET.

Every matrix the fit may change (QuantPolicy.fittable: its group's bits not set, no override)
starts at int8. While the artifact is over budget, the fit takes the one-bit step (one tensor,
int8 -> 7 -> 6 -> 5) with the smallest error increase per byte saved, in stages:
  0. block matrices (attention, MLP, other) down to int5;
  1. then block matrices down to int4;
  2. then the embedding down to int5 (the tied embedding is also the output head: last); beyond that
     the export fails with the numbers.
Why the embedding comes after int4 blocks: measured on the CPU proxy (docs/quantization.md, 2 seeds),
int4 blocks cost +0.0055 / +0.0061 bpb over int8 everywhere at 0.45 bytes/param, the embedding at
int6 with int5 blocks +0.0091 / +0.0067 at 0.54 (+0.0136 / +0.0155 without QUANT_GPTQ_EMBED): per
byte saved an embedding step costs about 10x a block step; the per-tensor relative errors the steps
are ranked by do not see that, so the order is fixed.
The same greedy runs twice (quant.artifact.export_artifact for the second):
  - before training (`fit_policy`), on the size estimate (quant/estimate.py) with a prior error
    model, so that late QAT trains for the bits that will be stored: a one-bit step multiplies a
    tensor's error by about 4 (error ~ 4**-bits), scaled by QUANT_FIT_PRIOR per group (MLP
    least sensitive: the records stored MLP at int5 with attention at int6, e.g. PR #1773);
  - at export, only if the real compressed artifact is still over budget, with measured errors:
    the relative layer-output error tr(dW H dW^T) / tr(W H W^T) under the calibration Hessian H
    (relative Frobenius error without one), and steps until the estimated saving, scaled by the
    real / estimated size ratio, covers the overshoot; then it compresses again.
One-bit steps of large tensors overshoot: once the export's real artifact fits, the tensors it stepped go
back up (quant_fit_step with `start`: the reverse order) while the estimated bytes added, scaled to real bytes, fit
the slack; one more compression confirms, else the fitting round is kept.
Each step is logged; the chosen bits live in QuantPolicy.fitted (stored in the artifact header).

Size note: bundled into the counted train_gpt.py.
"""

import collections
from collections.abc import Callable

from primitives.env import BUNDLE_KIND
from quant.estimate import estimate_artifact_bytes, policy_tensor_bytes
from quant.policy import QuantPolicy

QUANT_FIT_PRIOR = {"mlp": 1.0, "attn": 2.0, "other": 2.0, "embed": 4.0}


def quant_fit_step(qp: QuantPolicy, shapes: dict, score: Callable, start: QuantPolicy | None = None,
                   room: float = 0.0) -> tuple | None:
    """The fit's next one-bit step from the policy qp: (name, new bits, estimated bytes of the step) or None.

    shapes: name -> shape of the state dict's float tensors; score(name, low_bits) -> the error difference
    between that tensor at low_bits and at low_bits + 1 (any consistent unit). Down (start None): a tensor above
    its floor (int4; the embedding int5) goes one bit down; the lowest (stage, score per estimated byte saved)
    wins. Up (the export's step back): a tensor the fit stepped below its bits in `start` goes one bit up if the
    estimated bytes added fit `room`; the reverse order wins (the highest stage, then the largest score per byte
    added). Ties to the earlier name.
    """
    best, up = None, 1 if start else -1
    for name, shape in shapes.items():
        b, embed = qp.fittable(name, shape) and qp.bits_for(name, shape), qp.group_of(name, shape) == "embed"
        if b and (b < start.bits_for(name, shape) if start else b > 4 + embed):
            hi = max(b, b + up)  # the step's higher bits
            size = policy_tensor_bytes(name, shape, qp, hi) - policy_tensor_bytes(name, shape, qp, hi - 1)
            key = (-up * (2 if embed else 0 if hi > 5 else 1), -up * score(name, hi - 1) / max(1e-9, size))
            if (not start or size <= room) and (best is None or key < best[0]):
                best = key, name, b + up, size
    return best and best[1:]


def fit_policy(qp: QuantPolicy, shapes: dict, model_budget_bytes: int, *, log: Callable = print,
               estimate_scale: float = 1.0) -> QuantPolicy:
    """Before training: the policy, from qp (QuantPolicy) on, whose estimated artifact fits model_budget_bytes
    (budget minus code).

    The estimate is estimate_artifact_bytes(shapes, policy, estimate_scale) (QUANT_ESTIMATE_SCALE).
    shapes: name -> shape tuple of the model's parameters. Returns the policy with the chosen bits
    in `fitted` (qp unchanged when QUANT_FIT=0 or nothing is fittable); logs every step and the
    result. If even the last step does not fit, returns the smallest policy (the export then fails
    with the real numbers).
    """
    num_steps = 0
    while (est := estimate_artifact_bytes(shapes, qp, estimate_scale)) > model_budget_bytes:
        step = quant_fit_step(qp, shapes, lambda n, b, p=qp: QUANT_FIT_PRIOR[p.group_of(n, shapes[n])] * 4.0 ** -b)
        if not step:
            break
        qp, num_steps = qp.with_bits(*step[:2]), num_steps + 1
        if BUNDLE_KIND == "package":  # the steps (the artifact's header stores the bits; the line below counts them)
            log(f"quant_fit step:{num_steps} {step[0]} -> int{step[1]}")
    bits = collections.Counter(qp.bits_for(n, s) for n, s in shapes.items())
    log(f"quant_fit: {num_steps} steps, estimated model bytes {est} (budget {model_budget_bytes}), tensors per bits "
        + " ".join(f"int{b}:{c}" for b, c in sorted(((b, c) for b, c in bits.items() if b), reverse=True)))
    return qp
