"""Optimizers: Muon (batched Newton-Schulz, sharded over ranks) for block matrices, AdamW for the rest.

`build_optimizers` returns them by name (`Optimizers.muon`, `Optimizers.adamw`), never by position.
"""

import dataclasses

import torch
import torch.distributed as dist
from model.gpt import GPT
from primitives.settings import Hyperparameters
from trainer.muon_forms import form_orthogonalize, form_update, newton_schulz_ordered
from trainer.muon_switches import POLAR_EXPRESS_COEFFS, normalize_rows


# 2-D block parameters that are not weight matrices: AdamW with the scalars (the records' control tensors)
SCALAR_MATRICES = ("resid_mix", "attn_gate_w")
# Keller Jordan's Newton-Schulz quintic coefficients (a, b, c) (torch.optim.Muon); MUON_NS_COEFFS=polar_express:
# trainer/muon_switches.py's table
JORDAN_COEFFS = ((3.4445, -4.7750, 2.0315),)


def split_params(model: GPT, /) -> dict:
    """Muon gets the 2-D matrices inside blocks; AdamW gets embeddings/head and every scalar/vector
    (and the 2-D control tensors of SCALAR_MATRICES: residual mixes, attention output gates)."""
    groups = {"muon": [], "scalar": [], "embed": [], "head": []}
    for name, p in model.named_parameters():
        groups["embed" if name == "tok_emb.weight" else "head" if name.startswith("lm_head.") else
               "muon" if name.startswith("blocks.") and p.ndim == 2 and not any(k in name for k in SCALAR_MATRICES)
               else "scalar"].append(name)
    return groups


def newton_schulz(g: torch.Tensor, steps: int, /, coeffs: tuple = JORDAN_COEFFS) -> torch.Tensor:
    """Batched quintic Newton-Schulz orthogonalization: g [N, R, C] (any float) -> bfloat16 [N, R, C].

    torch.optim.Muon's iteration (bf16, each matrix scaled to unit Frobenius norm, tall matrices
    transposed; step i runs x <- a x + (b G + c G^2) x, G = x x^T, with coeffs[i], the last triple
    repeating: Keller Jordan's 3.4445, -4.7750, 2.0315 by default), run on a stack of same-shape
    matrices with batched matmuls: one launch per matmul for the whole stack instead of one per
    matrix (the 8xH100 records' batched Muon). MUON_FORM records / classic: trainer/muon_forms.py's op order.
    """
    x = g.bfloat16()
    tall = x.size(-2) > x.size(-1)
    if tall:
        x = x.mT
    x = x / x.norm(dim=(-2, -1), keepdim=True).clamp(min=1e-7)
    for i in range(steps):
        a, b, c = coeffs[min(i, len(coeffs) - 1)]
        gram = x @ x.mT
        x = torch.baddbmm(x, torch.baddbmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    return x.mT if tall else x


class Muon(torch.optim.Optimizer):
    """torch.optim.Muon (nesterov, adjust_lr_fn="original") batched per shape and sharded over ranks.

    Per parameter p with gradient g, same update as torch.optim.Muon: buf <- lerp(buf, g, 1 - momentum);
    u = newton_schulz(lerp(g, buf, momentum)); p <- p * (1 - lr * weight_decay) - lr * sqrt(max(1, R/C)) * u.
    Matrices of one shape go through one batched (optionally torch.compile'd) Newton-Schulz; with
    world_size > 1 each rank orthogonalizes a contiguous share of every shape group and the updates
    are all-gathered (gradients are already all-reduced by DDP), so no rank repeats another's work
    (as the 8xH100 records do). Param groups take lr, momentum, weight_decay (changeable per step).
    ns_coeffs: jordan or polar_express (trainer/muon_switches.py). row_normalize: MuonEq-R (PR #1285), each row of
    the momentum update divided by its L2 norm (trainer/muon_switches.py) before Newton-Schulz; the rest unchanged.
    form (MUON_FORM): torch, or the records' arithmetic, "records" (PR #1855's) or "classic" (PR #1617's):
    trainer/muon_forms.py.
    """

    def __init__(self, params, lr: float, momentum: float, weight_decay: float, ns_steps: int = 5, rank: int = 0,
                 world_size: int = 1, compile: bool = False, ns_coeffs: str = "jordan", row_normalize: bool = False,
                 form: str = "torch"):
        super().__init__(params, dict(lr=lr, momentum=momentum, weight_decay=weight_decay))
        self.ns_steps, self.rank, self.world_size, self.form = ns_steps, rank, world_size, form
        self.ns_coeffs = JORDAN_COEFFS if ns_coeffs == "jordan" else POLAR_EXPRESS_COEFFS
        self.row_normalize = row_normalize
        ns = newton_schulz if form == "torch" else newton_schulz_ordered
        self.ns = torch.compile(ns, fullgraph=True, dynamic=False) if compile else ns

    def buffers(self, ps: list, grads: list) -> list:
        """The momentum buffers of ps, made once as zeros like their gradients (setdefault(..., zeros_like) would
        zero-fill one every step)."""
        for p, g in zip(ps, grads):
            if "momentum_buffer" not in self.state[p]:
                self.state[p]["momentum_buffer"] = torch.zeros_like(g)
        return [self.state[p]["momentum_buffer"] for p in ps]

    @torch.no_grad()
    def step(self):
        for group in self.param_groups:
            lr, momentum, shapes = group["lr"], group["momentum"], {}
            for p in group["params"]:
                if p.grad is not None:
                    shapes.setdefault(p.shape, []).append(p)
            for (rows, cols), ps in shapes.items():
                if self.form != "torch":
                    u = form_update(self, ps, momentum)
                else:
                    grads = [p.grad for p in ps]
                    bufs = self.buffers(ps, grads)
                    torch._foreach_lerp_(bufs, grads, 1 - momentum)
                    u = torch.stack(grads).lerp_(torch.stack(bufs), momentum)
                if self.row_normalize:
                    u = normalize_rows(u)
                n, w, scale = len(ps), self.world_size, max(1, rows / cols) ** 0.5
                if w > 1:  # pad to w equal shares, orthogonalize ours, gather everyone's
                    share = -(-n // w)
                    u = torch.cat([u, u.new_zeros(share * w - n, rows, cols)])
                    parts = [u.new_empty(share, rows, cols) for _ in range(w)]
                    u = u[self.rank * share:(self.rank + 1) * share]
                # newton_schulz(u) as float32 (trainer/muon_forms.py: the records' forms)
                u = (self.ns(u, self.ns_steps, coeffs=self.ns_coeffs).float() if self.form == "torch"
                     else form_orthogonalize(self, u, scale))
                if w > 1:
                    dist.all_gather(parts, u)
                    u = torch.cat(parts)[:n]
                torch._foreach_mul_(ps, 1 - lr * group["weight_decay"])
                torch._foreach_add_(ps, list(u.unbind(0)), alpha=-lr * (1 if self.form == "classic" else scale))


@dataclasses.dataclass
class Optimizers:
    """The run's optimizers by name: `muon` (block matrices), `adamw` (embeddings, head, scalars).
    `all` lists them in stepping order (Muon first, as the checkpoint stores them)."""

    muon: Muon
    adamw: torch.optim.AdamW

    @property
    def all(self) -> list:
        return [self.muon, self.adamw]


def build_optimizers(model: GPT, hp: Hyperparameters, /, *, is_cuda: bool, rank: int = 0, world_size: int = 1,
                     compile: bool = False) -> Optimizers:
    """Muon (batched torch.optim.Muon semantics, sharded over ranks) and AdamW (fused on CUDA).

    Each param group keeps its `base_lr`; the schedule multiplies it every step. compile: torch.compile
    Muon's Newton-Schulz (fullgraph, one graph per matrix shape).
    """
    g = {k: [model.get_parameter(n) for n in names] for k, names in split_params(model).items()}
    embed_wd = hp.adam_wd if hp.embed_wd < 0 else hp.embed_wd  # EMBED_WD (PR #1855's 0.085); -1: ADAM_WD
    adam_groups = [{"params": g["embed"], "lr": hp.tied_embed_lr if hp.tie_embeddings else hp.embed_lr,
                    "weight_decay": embed_wd},
                   {"params": g["scalar"], "lr": hp.scalar_lr}] + [{"params": g["head"], "lr": hp.head_lr}] * bool(g["head"])
    optimizers = Optimizers(  # Muon's arguments in its signature's order (lr, momentum, weight_decay, ns_steps, ...)
        Muon(g["muon"], hp.matrix_lr, hp.muon_momentum, hp.muon_wd, hp.muon_backend_steps, rank, world_size, compile,
             hp.muon_ns_coeffs, hp.muon_row_normalize, hp.muon_form),
        torch.optim.AdamW(adam_groups, betas=(hp.beta1, hp.beta2), eps=hp.adam_eps, weight_decay=hp.adam_wd,
                          fused=is_cuda))
    for opt in optimizers.all:
        for group in opt.param_groups:
            group["base_lr"] = group["lr"]
    return optimizers


def step_optimizers(model: torch.nn.Module, optimizers: Optimizers, hp: Hyperparameters, ema=None,
                    ema_decay: float = 0.0, /) -> None:
    """The step once the gradients are made: clip their total norm at GRAD_CLIP_NORM (0: off), step every optimizer,
    drop the gradients, then ema.update(ema_decay) (trainer.schedule.EMA) when an EMA is given."""
    if hp.grad_clip_norm > 0:
        torch.nn.utils.clip_grad_norm_(model.parameters(), hp.grad_clip_norm)
    for opt in optimizers.all:
        opt.step()
    model.zero_grad(set_to_none=True)
    if ema:
        ema.update(ema_decay)
