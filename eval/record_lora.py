"""PR #1855's per-document LoRA adapters for the `phased_lora` TTT mode (eval/phased_lora.py): one adapter per
batch slot (a document) and per layer application (a looped block gets one per pass), on the query, key and
value projections, on the attention output and on the MLP (both read from the block's normalized input), and
on the head, applied to the kit's model through forward hooks (the model class is unchanged; remove() takes
the hooks away).

Sources (facts only; the code is the kit's): openai/parameter-golf PR #1855 (its BatchedTTTLoRA and
forward_ttt: rank 80, alpha 144, K/MLP/O adapters on, A warm across the documents of a phase), PR #1767 (the
alpha / rank output scale and the warm A), PR #1530 (per-document batched adapters).

Adapter on an input x [S, T, in] of S slots: scale * (x @ A^T) @ B^T, A [S, rank, in] drawn uniform(+-1/sqrt(in)),
B [S, out, rank] zero, scale = alpha / rank. Where each one adds (n: the block's normalized attention input,
m: its normalized MLP input, h: the final normalized stream):
    q, k, v   attn.c_q(n), c_k(n), c_v(n) gain adapter(n)       (hooks on those linears)
    o         attn.proj's output gains adapter(n)               (before the block's attn_scale)
    mlp       mlp.proj's output gains adapter(m)                (a bypass of the MLP, before mlp_scale)
    head      the logits gain adapter(h) before the softcap     (record_lora_nll)
A layer application is counted at each attention call (the blocks run attention then MLP), so with depth
recurrence the k-th block run of a forward uses adapter k, as the record's slots do.

Draws: every A comes from one torch.Generator seeded with RECORD_LORA_SEED, in the record's module order (head, then
q, v, k, mlp, o, each for every layer application), as the record draws them from torch's global generator:
with the same seed both hold the same adapters (the parity harness seeds the record with it).
"""

import math

import torch
import torch.nn.functional as F

# the packed train_gpt.py holds this module only for runs with the record's phased LoRA TTT (kit/bundle_when.py)
PACKED_WHEN = "TTT_ENABLED and TTT_MODE == 'phased_lora'"

RECORD_LORA_SEED = 1234
RECORD_LORA_KINDS = ("q", "v", "k", "mlp", "o")  # the record's draw order after the head


def layer_applications(model, /) -> int:
    """Block runs per forward: len(model.loop_order) while looping is active, else the number of blocks."""
    return len(model.loop_order) if model.looping_active else len(model.blocks)


class RecordLoRA:
    """Adapters for `slots` documents of `model` (a model.gpt.GPT): rank, alpha (scale alpha / rank), kinds (a
    subset of RECORD_LORA_KINDS; q and v always, as the record), generator (the A draws). attach(model): the adapters of the
    slots in `rows` (set_rows) join every forward of model until remove(). params(): the trainable A and B
    tensors. reset(): B to 0 (A kept warm, the record's TTT_WARM_START_A)."""

    def __init__(self, model, slots: int, rank: int, alpha: float, kinds: tuple, generator: torch.Generator, /):
        dim, device = model.tok_emb.embedding_dim, model.tok_emb.weight.device
        attn = model.blocks[0].attn
        kv_dim = attn.c_k.weight.size(0)  # num_kv_heads * head_dim
        out = {"q": dim, "v": kv_dim, "k": kv_dim, "mlp": dim, "o": dim}
        count = layer_applications(model)
        self.scale, self.slots, self.kinds = alpha / rank, slots, kinds

        def adapter(in_features, out_features, /):
            bound = 1 / math.sqrt(in_features)
            a = torch.empty(slots, rank, in_features).uniform_(-bound, bound, generator=generator)
            return [a.to(device).requires_grad_(True),
                    torch.zeros(slots, out_features, rank, device=device, requires_grad=True)]

        self.head = adapter(dim, model.tok_emb.num_embeddings)
        self.layers = {kind: [adapter(dim, out[kind]) for _ in range(count)] for kind in RECORD_LORA_KINDS if kind in kinds}
        self.rows, self.k, self.saved, self.hooks = None, -1, {}, []

    def attach(self, model, /) -> None:
        """Register the hooks on model's blocks (remove() takes them off)."""
        for block in model.blocks:
            attn, mlp = block.attn, block.mlp
            self.hooks += [attn.register_forward_pre_hook(self._enter_attention),
                           mlp.register_forward_pre_hook(self._save("m")),
                           attn.c_q.register_forward_hook(self._add("q")), attn.c_v.register_forward_hook(self._add("v"))]
            if "k" in self.kinds:
                self.hooks.append(attn.c_k.register_forward_hook(self._add("k")))
            if "o" in self.kinds:
                self.hooks.append(attn.proj.register_forward_hook(self._add("o", "n")))
            if "mlp" in self.kinds:
                self.hooks.append(mlp.proj.register_forward_hook(self._add("mlp", "m")))

    def params(self, /) -> list:
        return self.head + [t for ab in self.layers.values() for pair in ab for t in pair]

    def set_rows(self, rows: list, /) -> None:
        """The slot of each row of the next forwards' batch; the layer count restarts."""
        self.rows = torch.tensor(rows, dtype=torch.int64, device=self.head[0].device)

    def apply(self, pair: list, x: torch.Tensor, /) -> torch.Tensor:
        a, b = (t[self.rows].to(x.dtype) for t in pair)
        return torch.matmul(torch.matmul(x, a.transpose(1, 2)), b.transpose(1, 2)) * self.scale

    def _enter_attention(self, module, args, /):
        self.k += 1
        self.saved["n"] = args[0]

    def _save(self, key, /):
        def hook(module, args, /):
            self.saved[key] = args[0]
        return hook

    def _add(self, kind, source=None, /):
        def hook(module, args, output, /):
            x = args[0] if source is None else self.saved[source]
            return output + self.apply(self.layers[kind][self.k], x).to(output.dtype)
        return hook

    @torch.no_grad()
    def reset(self, /) -> None:
        for t in self.params()[1::2]:
            t.zero_()

    def remove(self, /) -> None:
        for h in self.hooks:
            h.remove()
        self.hooks = []


def record_lora_nll(model, lora: RecordLoRA, x: torch.Tensor, y: torch.Tensor, /) -> torch.Tensor:
    """Per-token cross-entropy float32 [R, T] of x, y int64 [R, T] (row r adapted by slot lora.rows[r]): the
    model's trunk with the hooks' adapters, then logits = h @ head^T + head adapter(h), softcapped (the record's
    forward_ttt)."""
    lora.k = -1
    h = model.forward_hidden(x)
    logits = F.linear(h, model.head_weight().to(h.dtype)) + lora.apply(lora.head, h)
    logits = model.logit_softcap * torch.tanh(logits.float() / model.logit_softcap)
    return F.cross_entropy(logits.flatten(0, 1), y.flatten(), reduction="none").view_as(y)
