"""Optimizers: Muon (batched Newton-Schulz, sharded over ranks) for block matrices, AdamW for the rest.

`build_optimizers` returns them by name (`Optimizers.muon`, `Optimizers.adamw`), never by position.
"""

import dataclasses

import torch
import torch.distributed as dist
from trainer.model import GPT
from trainer.settings import Hyperparameters


def split_params(model: GPT) -> dict:
    """Muon gets the 2-D matrices inside blocks; AdamW gets embeddings/head and every scalar/vector."""
    groups = {"muon": [], "scalar": [], "embed": [], "head": []}
    for name, p in model.named_parameters():
        groups["embed" if name == "tok_emb.weight" else "head" if name.startswith("lm_head.") else
               "muon" if name.startswith("blocks.") and p.ndim == 2 and "resid_mix" not in name else "scalar"].append(name)
    return groups


def newton_schulz(g: torch.Tensor, steps: int, eps: float = 1e-7) -> torch.Tensor:
    """Batched quintic Newton-Schulz orthogonalization: g [N, R, C] (any float) -> bfloat16 [N, R, C].

    torch.optim.Muon's iteration (Keller Jordan's coefficients 3.4445, -4.7750, 2.0315, bf16, each
    matrix scaled to unit Frobenius norm, tall matrices transposed), run on a stack of same-shape
    matrices with batched matmuls: one launch per matmul for the whole stack instead of one per
    matrix (the 8xH100 records' batched Muon).
    """
    x = g.bfloat16()
    tall = x.size(-2) > x.size(-1)
    if tall:
        x = x.mT
    x = x / x.norm(dim=(-2, -1), keepdim=True).clamp(min=eps)
    for _ in range(steps):
        gram = x @ x.mT
        x = torch.baddbmm(x, torch.baddbmm(gram, gram, gram, beta=-4.7750, alpha=2.0315), x, beta=3.4445)
    return x.mT if tall else x


class Muon(torch.optim.Optimizer):
    """torch.optim.Muon (nesterov, adjust_lr_fn="original") batched per shape and sharded over ranks.

    Per parameter p with gradient g, same update as torch.optim.Muon: buf <- lerp(buf, g, 1 - momentum);
    u = newton_schulz(lerp(g, buf, momentum)); p <- p * (1 - lr * weight_decay) - lr * sqrt(max(1, R/C)) * u.
    Matrices of one shape go through one batched (optionally torch.compile'd) Newton-Schulz; with
    world_size > 1 each rank orthogonalizes a contiguous share of every shape group and the updates
    are all-gathered (gradients are already all-reduced by DDP), so no rank repeats another's work
    (as the 8xH100 records do). Param groups take lr, momentum, weight_decay (changeable per step).
    """

    def __init__(self, params, *, lr: float, momentum: float, weight_decay: float, ns_steps: int = 5, rank: int = 0,
                 world_size: int = 1, compile: bool = False):
        super().__init__(params, dict(lr=lr, momentum=momentum, weight_decay=weight_decay))
        self.ns_steps, self.rank, self.world_size = ns_steps, rank, world_size
        self.ns = torch.compile(newton_schulz, fullgraph=True, dynamic=False) if compile else newton_schulz

    @torch.no_grad()
    def step(self):
        for group in self.param_groups:
            lr, momentum, shapes = group["lr"], group["momentum"], {}
            for p in group["params"]:
                if p.grad is not None:
                    shapes.setdefault(p.shape, []).append(p)
            for (rows, cols), ps in shapes.items():
                grads = [p.grad for p in ps]
                for p in ps:  # created once: setdefault(..., zeros_like(p)) allocated and zero-filled every step
                    if "momentum_buffer" not in self.state[p]:
                        self.state[p]["momentum_buffer"] = torch.zeros_like(p)
                bufs = [self.state[p]["momentum_buffer"] for p in ps]
                torch._foreach_lerp_(bufs, grads, 1 - momentum)
                u = torch.stack(grads).lerp_(torch.stack(bufs), momentum)
                n, w = len(ps), self.world_size
                share = -(-n // w)
                if w > 1:  # pad to w equal shares, orthogonalize ours, gather everyone's
                    u = torch.cat([u, u.new_zeros(share * w - n, rows, cols)])
                    parts = [u.new_empty(share, rows, cols) for _ in range(w)]
                    dist.all_gather(parts, self.ns(u[self.rank * share:(self.rank + 1) * share], self.ns_steps).float())
                    u = torch.cat(parts)[:n]
                else:
                    u = self.ns(u, self.ns_steps).float()
                torch._foreach_mul_(ps, 1 - lr * group["weight_decay"])
                torch._foreach_add_(ps, list(u.unbind(0)), alpha=-lr * max(1, rows / cols) ** 0.5)


@dataclasses.dataclass
class Optimizers:
    """The run's optimizers by name: `muon` (block matrices), `adamw` (embeddings, head, scalars).
    `all` lists them in stepping order (Muon first, as the checkpoint stores them)."""

    muon: Muon
    adamw: torch.optim.AdamW

    @property
    def all(self) -> list:
        return [self.muon, self.adamw]


def build_optimizers(model: GPT, hp: Hyperparameters, *, is_cuda: bool, rank: int = 0, world_size: int = 1,
                     compile: bool = False) -> Optimizers:
    """Muon (batched torch.optim.Muon semantics, sharded over ranks) and AdamW (fused on CUDA).

    Each param group keeps its `base_lr`; the schedule multiplies it every step. compile: torch.compile
    Muon's Newton-Schulz (fullgraph, one graph per matrix shape).
    """
    params = dict(model.named_parameters())
    g = {k: [params[n] for n in names] for k, names in split_params(model).items()}
    adam_groups = [{"params": g["embed"], "lr": hp.tied_embed_lr if hp.tie_embeddings else hp.embed_lr},
                   {"params": g["scalar"], "lr": hp.scalar_lr}] + [{"params": g["head"], "lr": hp.head_lr}] * bool(g["head"])
    optimizers = Optimizers(
        muon=Muon(g["muon"], lr=hp.matrix_lr, momentum=hp.muon_momentum, weight_decay=hp.muon_wd,
                  ns_steps=hp.muon_backend_steps, rank=rank, world_size=world_size, compile=compile),
        adamw=torch.optim.AdamW(adam_groups, betas=(hp.beta1, hp.beta2), eps=hp.adam_eps, weight_decay=hp.adam_wd,
                                fused=is_cuda))
    for opt in optimizers.all:
        for group in opt.param_groups:
            group["base_lr"] = group["lr"]
    return optimizers
