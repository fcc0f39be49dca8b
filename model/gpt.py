"""The challenge GPT: GQA, partial RoPE, XSA, U-Net skips, tied embeddings, late-QAT linears; PR #1855's
document-packed attention, LN scale, skip gates and 2-lane parallel decoder as switches (model/stack.py).

Shape legend (every docstring and local name below):
    B batch, T time (sequence length), D model dim (residual stream), H query heads,
    Hkv key/value heads (GQA), Dh head dim = D / H, R rotated dims per head (ROPE_DIMS),
    F MLP hidden dim = MLP_MULT * D, V vocabulary size.
"""

import inspect
import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from primitives.env import BUNDLE_KIND
from primitives.rowquant import fake_quantize_per_row
from model.attention import attention, doc_segments
from model.attn_ops import apply_partial_rope, autocast_dtype, qk_norm_rope  # noqa: F401 (apply_partial_rope: API)
from model.fused_loss import fused_loss, fused_softcap_op, linear_softcap_nll
from model.softcap_loss import fused_loss_active, head_softcap_cross_entropy
from model.gates import smear_previous_token, sparse_head_gate
from model.stack import PARALLEL_FINAL_LANES, run_stack, stack_init
from primitives.settings import Hyperparameters


def residual_dtype(x: torch.Tensor) -> torch.dtype:
    """The residual stream's dtype: the autocast dtype of x's device while autocast is on, else x's own.

    The official script keeps its embedding table, hence its residual stream, in bf16 on CUDA; ours is
    float32, so without this cast every block's residual math and the fused RMSNorm-backward reductions
    ran float32 under autocast (~65 ms of a 426 ms H100 step on torch 2.11). fp32 runs
    (no autocast) are unchanged, bit for bit.
    """
    return autocast_dtype(x)


def exclusive_self_attention(y: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """XSA: remove from each head's output its component along the token's own unit value vector.

    y [B, T, H, D] attention output; v [B, T, Hkv, D] -> y's shape and dtype. With GQA, query heads are
    grouped as [B, T, Hkv, H/Hkv, D] and share their KV head's v. y - (y.v / |v|^2) v is F.normalize's
    y - (y.v^) v^ (|v| clamped at 1e-12 as there), in float32 math rounded once (y is promoted inside
    each op, so autograd saves y in its own dtype). Under Inductor no normalized v is stored or re-read
    (0.5 GiB less per micro-batch at the default preset than the F.normalize form, bf16 autocast).
    """
    b, t, h, d = y.shape
    yg = y.reshape(b, t, v.size(2), h // v.size(2), d)
    vf = v.unsqueeze(3).to(torch.promote_types(y.dtype, torch.float32))  # y stays in its dtype: saved as it is
    n = (vf * vf).sum(-1, keepdim=True).clamp_min(1e-24)  # |v|^2, F.normalize's max(|v|, 1e-12) squared
    return (yg - ((yg * vf).sum(-1, keepdim=True) / n) * vf).to(y.dtype).reshape(b, t, h, d)


class _EmbedAs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, ids, weight, dtype, /):
        ctx.save_for_backward(ids)
        ctx.num_rows = weight.size(0)
        return F.embedding(ids, weight.to(dtype))

    @staticmethod
    def backward(ctx, grad, /):
        (ids,) = ctx.saved_tensors  # the float32 gather's own backward, on the gradient cast as its cast's would be
        return None, torch.ops.aten.embedding_backward(grad.float(), ids, ctx.num_rows, -1, False, False), None


# embed_as(ids, weight, dtype) (the Function's apply: positional arguments): weight[ids].to(dtype), gathered from the
# table cast to `dtype`: ids [B, T] int64, weight [V, D] -> [B, T, D]. The same values as the gather cast after it,
# and the same gradient: weight's, summed in float32 over the tokens (a bf16 table's own embedding backward sums in
# bf16 on a CPU; a float32 table's is the gather's own backward, the same call). Under bf16 autocast the compiled
# step then keeps no float32 [B, T, D] gather, which Inductor saved and re-read in every block to rebuild x0
# (+0.5 GiB forward, +0.25 GiB backward per micro-batch at the default preset).
embed_as = _EmbedAs.apply


BOS_TOKEN_ID = 1  # every document starts with it (the shard format)


class CastedLinear(nn.Linear):
    """Bias-free linear with optional late-QAT fake quantization of its weight.

    `qat_bits` is fixed before compile (0 = never); `qat_on` (set by GPT.set_qat) switches the
    fake-quant on. An instance attribute that dynamo guards: while it is False the compiled step has
    no fake-quant op at all, and the first call after it flips compiles the QAT graph once (the
    trainer's warmup compiles both before the clock). A class attribute or a global read inside the
    compiled model could be constant-folded instead, the bug that silently disabled QAT in PRs #315,
    #1559, #1617: tests/test_model.py runs the compiled model on both sides of the flip.
    """

    def __init__(self, in_features: int, out_features: int, /):
        super().__init__(in_features, out_features, bias=False)
        self.qat_bits, self.qat_on, self.qat_clip = 0, False, 0.0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight_as(x.dtype))

    def weight_as(self, dtype: torch.dtype, row_scale: torch.Tensor | None = None, /) -> torch.Tensor:
        """The weight the forward multiplies by, [out, in] in `dtype`: fake-quantized while QAT is on, then times
        row_scale [out] (float32 math) when given."""
        w = self.weight
        if self.qat_bits and self.qat_on:
            w = fake_quantize_per_row(w, self.qat_bits, self.qat_clip)
        if row_scale is not None:
            w = w * row_scale.to(w.dtype)[:, None]
        return w.to(dtype)

    def scaled(self, x: torch.Tensor, scale: torch.Tensor, /) -> torch.Tensor:
        """self(x) * scale, scale [out] (a block's attn_scale / mlp_scale), with the scale folded into the weight's
        rows: the backward multiplies the output gradient by the folded weight instead of writing a scaled
        [B, T, out] copy of it for the matmul, and scale's gradient comes from the [out, in] weight gradient
        (sum over in of dW' * W) instead of a reduction over every token of a saved output (the step's bytes:
        tools/bench_step.py --cpu-twin, docs/benchmarks.md). The same function; rounding differs only in where the
        scale is applied. With a forward hook on this module (LoRA TTT, GPTQ's Hessians) it stays self(x) * scale,
        so the hook sees the unscaled output as before."""
        if self._forward_hooks or self._forward_pre_hooks:
            return self(x) * scale.to(x.dtype)
        return F.linear(x, self.weight_as(x.dtype, scale))


class CausalSelfAttention(nn.Module):
    def __init__(self, dim: int, num_heads: int, num_kv_heads: int, qk_gain_init: float, use_xsa: bool, gate_window: int,
                 gate_scale: float, /):
        super().__init__()
        self.head_dim, self.use_xsa, self.gate_scale = dim // num_heads, use_xsa, gate_scale
        if gate_window:  # sparse head-output gate, zero-initialized as in PR #1787 (sigmoid(0) = 0.5)
            self.attn_gate_w = nn.Parameter(torch.zeros(num_heads, gate_window))
        kv_dim = num_kv_heads * self.head_dim
        self.c_q, self.c_k, self.c_v = CastedLinear(dim, dim), CastedLinear(dim, kv_dim), CastedLinear(dim, kv_dim)
        self.proj = CastedLinear(dim, dim)
        self.q_gain = nn.Parameter(torch.full((num_heads,), float(qk_gain_init)))

    def forward(self, x, cos, sin, out_scale: torch.Tensor, docs=None, /):
        """x [B, T, D] -> [B, T, D]; out_scale [D]: the output times it (folded into proj, CastedLinear.scaled);
        docs: attention within documents only (model.attention.doc_segments)."""
        b, t, d = x.shape
        q, k, v = (f(x).view(b, t, -1, self.head_dim) for f in (self.c_q, self.c_k, self.c_v))  # H, Hkv, Hkv heads
        q, k = qk_norm_rope(q, cos, sin, self.q_gain), qk_norm_rope(k, cos, sin, None)
        y = attention(q, k, v, docs)
        if self.use_xsa:
            y = exclusive_self_attention(y, v)
        if hasattr(self, "attn_gate_w"):  # model/gates.py
            y = sparse_head_gate(y, x, self.attn_gate_w, self.gate_scale)
        return self.proj.scaled(y.reshape(b, t, d), out_scale)


class MLP(nn.Module):
    def __init__(self, dim, mlp_mult, activation, /):
        super().__init__()
        hidden = int(mlp_mult * dim)
        self.fc, self.proj = CastedLinear(dim, hidden), CastedLinear(hidden, dim)
        self.leaky = activation == "leaky_relu2"

    def forward(self, x, out_scale: torch.Tensor, /):
        """x [B, T, D] -> [B, T, D]; out_scale [D]: the output times it (folded into proj, CastedLinear.scaled)."""
        h = self.fc(x)
        return self.proj.scaled((F.leaky_relu(h, 0.5) if self.leaky else F.relu(h)).square(), out_scale)


class Block(nn.Module):
    """Pre-norm block: x + attn(norm(x)), then + mlp(norm(x)). With `parallel` (GPT-J, Wang & Komatsuzaki
    2021; PR #1204 on 8 GPUs, PR #1608 on one), attention and MLP read the same normalized input and
    both add to the residual: x + attn(norm(x)) + mlp(norm(x)), one norm and no serial dependency.
    ln_scale: every norm's output times it (PR #1855's LN_SCALE: 1/sqrt(layer + 1)). attn_args: CausalSelfAttention's
    after dim (num_heads, num_kv_heads, qk_gain_init, use_xsa, gate_window, gate_scale), positional (the packed file
    keeps keyword names)."""

    def __init__(self, dim: int, mlp_mult: float, activation: str, parallel: bool, ln_scale: float, /, *attn_args):
        super().__init__()
        self.parallel, self.ln_scale = parallel, ln_scale
        self.attn = CausalSelfAttention(dim, *attn_args)
        self.mlp = MLP(dim, mlp_mult, activation)
        self.attn_scale = nn.Parameter(torch.ones(dim))
        self.mlp_scale = nn.Parameter(torch.ones(dim))
        self.resid_mix = nn.Parameter(torch.stack((torch.ones(dim), torch.zeros(dim))))

    def normed(self, x: torch.Tensor) -> torch.Tensor:
        """rms_norm(x) over the last dim, times the block's LN scale: the input of its attention and MLP (1.0
        multiplies nothing)."""
        n = F.rms_norm(x, (x.size(-1),))
        return n if self.ln_scale == 1.0 else n * self.ln_scale

    def forward(self, x, x0, cos, sin, docs=None, /):
        mix = self.resid_mix.to(x.dtype)
        x = mix[0] * x + mix[1] * x0
        if self.parallel:
            h = self.normed(x)
            return x + self.attn(h, cos, sin, self.attn_scale, docs) + self.mlp(h, self.mlp_scale)
        x = x + self.attn(self.normed(x), cos, sin, self.attn_scale, docs)
        return x + self.mlp(self.normed(x), self.mlp_scale)


class GPT(nn.Module):
    """The challenge GPT: GQA, partial RoPE, XSA on the last layers, U-Net skips, tied embeddings,
    parallel residuals from layer `parallel_residual_start` on (-1 = none); optional SmearGate on the
    embeddings and sparse head-output gates in every attention (GATE_WINDOW dims feed both). PR #1855's
    switches: doc_packed_attention (no token attends across a BOS), ln_scale (norms times 1/sqrt(layer + 1)),
    skip_gates_enabled (gated U-Net skips), parallel_start_layer (> 0: its 2-lane decoder from that layer,
    joined by parallel_final_lane); model/stack.py runs the blocks with these, run_blocks without.

    `GPT(**config)` with `config` a JSON dict (stored in the artifact). `forward(x, y)` -> mean
    cross-entropy in nats (the fused loss of model/fused_loss.py when LOSS_KERNEL chose it; with gradients on,
    model/softcap_loss.py's, whose forward makes the logits' gradient);
    `forward_logits(x)` -> softcapped logits [B, T, vocab_size].
    """

    def __init__(self, *, vocab_size, num_layers, model_dim, num_heads, num_kv_heads, mlp_mult,
                 mlp_activation="relu2", tie_embeddings=True, rope_base=10_000.0, rope_dims=32,
                 logit_softcap=30.0, qk_gain_init=1.5, xsa_last_n=0, parallel_residual_start=-1,
                 smear_gate_enabled=False, sparse_attn_gate_enabled=False, sparse_attn_gate_scale=1.0, gate_window=12,
                 num_loops=0, loop_start=3, loop_end=5, doc_packed_attention=False, ln_scale=False,
                 skip_gates_enabled=False, parallel_start_layer=0, parallel_final_lane="mean"):
        super().__init__()
        if BUNDLE_KIND == "package":  # a record's file: PARALLEL_FINAL_LANE's choices refuse it with the settings
            if parallel_final_lane not in PARALLEL_FINAL_LANES:
                raise ValueError(f"parallel_final_lane={parallel_final_lane!r}: expected one of {PARALLEL_FINAL_LANES}")
        self.logit_softcap, self.gptq_hessians = logit_softcap, None
        self.tok_emb = nn.Embedding(vocab_size, model_dim)
        self.blocks = nn.ModuleList(
            Block(model_dim, mlp_mult, mlp_activation, 0 <= parallel_residual_start <= i,
                  1 / math.sqrt(i + 1) if ln_scale else 1.0, num_heads, num_kv_heads, qk_gain_init,
                  i >= num_layers - xsa_last_n, gate_window * sparse_attn_gate_enabled, sparse_attn_gate_scale)
            for i in range(num_layers))
        self.doc_packed_attention = doc_packed_attention
        num_skips = self.num_encoder_layers = num_layers // 2  # the decoder has as many blocks, or one more
        # depth recurrence: `looping_active` runs `loop_order` (built from these layers' blocks, no new matrices);
        # on from the start in a model built for evaluation, the trainer switches it on at ENABLE_LOOPING_AT
        self.looping_active = num_loops > 0
        self.stacked = bool(num_loops or skip_gates_enabled or parallel_start_layer > 0)  # model/stack.py's switches
        if self.stacked:  # the lanes' parameters, the loop order and its skips (here: the parameters' order)
            num_skips = stack_init(self, num_layers, num_skips, num_loops, loop_start, loop_end, parallel_start_layer,
                                   parallel_final_lane)
        if smear_gate_enabled:  # zero-initialized: the identity at init (PR #1667)
            self.smear_gate_w = nn.Parameter(torch.zeros(1, gate_window))
            self.smear_lambda = nn.Parameter(torch.zeros(1))
        self.skip_weights = nn.Parameter(torch.ones(num_skips, model_dim))
        self.skip_gates = nn.Parameter(torch.zeros(num_skips, model_dim)) if skip_gates_enabled else None
        self.lm_head = None if tie_embeddings else CastedLinear(model_dim, vocab_size)
        self.register_buffer("rope_inv_freq", 1.0 / rope_base ** (torch.arange(0, rope_dims, 2) / rope_dims),
                             persistent=False)

    @torch.no_grad()
    def init_weights(self, tied_embed_init_std: float = 0.005, /) -> None:
        """Orthogonal block matrices, output projections scaled by 1/sqrt(2 * num_layers)."""
        nn.init.normal_(self.tok_emb.weight, std=tied_embed_init_std)
        for name, lin in self.blocks.named_modules():
            if isinstance(lin, CastedLinear):
                nn.init.orthogonal_(lin.weight)
                if name.endswith("proj"):  # attn.proj and mlp.proj write into the residual stream
                    lin.weight.mul_(1 / math.sqrt(2 * len(self.blocks)))
        if self.lm_head is not None:
            nn.init.zeros_(self.lm_head.weight)

    def configure_qat(self, policy, /) -> None:
        """Set each block linear's QAT bit width (`qat_bits`, 0: none) from the export policy.

        QAT rounds per row at max-abs, the rule of the export without GPTQ (bit for bit). With
        QUANT_GPTQ=1 the export rounds with error feedback instead: QAT then trains the weights for
        the grid and scale the artifact uses, not for its exact rounding. QUANT_BASELINE_CLIP: QAT and export both
        round with PR #1617's baseline rule (primitives/rowquant.py quantize_per_row_baseline). With QUANT_GPTQ=1,
        `gptq_hessians` becomes {} and train() fills it with calibration Hessians for the export.
        """
        self.gptq_hessians = {} if policy.gptq else None
        for name, module in self.named_modules():
            if isinstance(module, CastedLinear) and name.startswith("blocks."):
                bits = policy.bits_for(name + ".weight", tuple(module.weight.shape))
                module.qat_bits, module.qat_clip = int(bits or 0), policy.baseline_clip

    @property
    def has_qat(self) -> bool:
        """Whether set_qat(True) changes anything: some linear has QAT bits (configure_qat)."""
        return any(isinstance(m, CastedLinear) and m.qat_bits for m in self.modules())

    def set_qat(self, enabled: bool, /) -> None:
        """Fake-quant on or off in every linear with QAT bits (the others keep one graph: no recompile)."""
        for module in self.modules():
            if isinstance(module, CastedLinear):
                module.qat_on = bool(enabled and module.qat_bits)

    def forward_hidden(self, input_ids: torch.Tensor, /) -> torch.Tensor:
        """The final normalized residual stream [B, T, D] (the head's input) of input_ids int64 [B, T]."""
        t = input_ids.size(1)
        freqs = torch.outer(torch.arange(t, device=input_ids.device, dtype=torch.float32), self.rope_inv_freq)
        cos, sin = freqs.cos(), freqs.sin()
        dt = residual_dtype(self.tok_emb.weight)
        x = embed_as(input_ids, self.tok_emb.weight, dt)
        if hasattr(self, "smear_gate_w"):  # model/gates.py
            x = smear_previous_token(x, input_ids, self.smear_gate_w, self.smear_lambda, BOS_TOKEN_ID)
        x = x0 = F.rms_norm(x, (x.size(-1),)).to(dt)  # rms_norm may return float32 under CUDA autocast (torch >= 2.12)
        docs = doc_segments(input_ids, BOS_TOKEN_ID) if self.doc_packed_attention else None
        x = run_stack(self, x, x0, cos, sin, docs) if self.stacked else self.run_blocks(x, x0, cos, sin, docs)
        return F.rms_norm(x, (x.size(-1),))

    def run_blocks(self, x: torch.Tensor, x0: torch.Tensor, cos, sin, docs=None, /) -> torch.Tensor:
        """The plain U-Net over the blocks (no loops, skip gates or lanes: model/stack.py runs those): x [B, T, D]
        (x0: the normalized embeddings) -> the last residual stream [B, T, D]. The encoder's outputs (the first
        num_encoder_layers blocks) are kept; decoder block j first adds the last kept one times skip_weights[j] (j < n:
        while one is left)."""
        skips, n = [], self.num_encoder_layers
        for i, block in enumerate(self.blocks):
            if skips and i >= n:
                x = x + self.skip_weights[i - n].to(x.dtype) * skips.pop()
            x = block(x, x0, cos, sin, docs)
            if i < n:
                skips.append(x)
        return x

    def head_weight(self) -> torch.Tensor:
        """The output head [V, D]: the tied token embedding, or lm_head's weight."""
        return self.tok_emb.weight if self.lm_head is None else self.lm_head.weight

    def head_logits(self, x: torch.Tensor) -> torch.Tensor:
        """Softcapped logits float32 [..., V] of forward_hidden's output [..., D] (the sliding eval runs it only on
        the positions it scores)."""
        logits = F.linear(x, self.head_weight().to(x.dtype)).float()
        return self.logit_softcap * torch.tanh(logits / self.logit_softcap)

    def forward_logits(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Softcapped logits float32 [B, T, V] of input_ids int64 [B, T]."""
        return self.head_logits(self.forward_hidden(input_ids))

    def forward(self, input_ids: torch.Tensor, target_ids: torch.Tensor, /) -> torch.Tensor:
        # LOSS_KERNEL=liger: the [B*T, V] logits are never materialized (model/fused_loss.py); else, training: the
        # logits' gradient made in the forward (read once less), from x in the autocast dtype (float32 from CUDA's
        # rms_norm, torch >= 2.12)
        if fused_loss_active(input_ids.device):
            return fused_loss(self, input_ids, target_ids)
        if torch.is_grad_enabled():
            x = self.forward_hidden(input_ids)
            x = x.to(residual_dtype(x))
            return head_softcap_cross_entropy(x.flatten(0, 1), self.head_weight(), target_ids.flatten(), self.logit_softcap)
        return F.cross_entropy(self.forward_logits(input_ids).flatten(0, 1), target_ids.flatten())

    def forward_nll(self, input_ids: torch.Tensor, target_ids: torch.Tensor) -> torch.Tensor:
        """Per-token NLL float32 [B, T] (nats) of target_ids int64 [B, T]: forward_logits' cross entropy, through
        the fused kernel when LOSS_KERNEL chose it (no [B*T, V] logits; no gradient)."""
        if fused_loss_active(input_ids.device):
            x = self.forward_hidden(input_ids)
            return fused_softcap_op(linear_softcap_nll, x.flatten(0, 1), self.head_weight(), target_ids.flatten(),
                                    self.logit_softcap).view(target_ids.shape)
        logits = self.forward_logits(input_ids)
        return F.cross_entropy(logits.flatten(0, 1), target_ids.flatten(), reduction="none").view(target_ids.shape)


# GPT arguments of the switches (its last ones, from smear_gate_enabled on), written to the config only when they
# differ from GPT's default: an artifact without a switch on is byte-identical to one made before the switches existed
_GPT_ARGS = inspect.signature(GPT).parameters
SWITCH_CONFIG = tuple(_GPT_ARGS)[tuple(_GPT_ARGS).index("smear_gate_enabled"):]


def build_model_config(hp: Hyperparameters) -> dict:
    """The JSON model config (`GPT(**config)`) from the hyperparameters of the same names (SWITCH_CONFIG's
    only where they differ from GPT's defaults)."""
    return {k: getattr(hp, k) for k, p in _GPT_ARGS.items() if k not in SWITCH_CONFIG or getattr(hp, k) != p.default}


def count_train_flops_per_token(config: dict, seq_len: int, looping_from: float = None, by_time: bool = False) -> float:
    """Forward + backward FLOPs per token from torch.utils.flop_counter on the meta device.

    Attention is counted as a full T x T matmul (no causal halving), the usual MFU convention. With depth
    recurrence (config num_loops > 0) the looped graph is counted, or, given looping_from (ENABLE_LOOPING_AT),
    the run's mean: the plain graph for that fraction of the run, the looped one after. by_time: the
    fraction is of the wallclock (MAX_WALLCLOCK_SECONDS), in which the slower looped steps train fewer
    tokens, so the mean weighs each graph by its tokens (a harmonic mean); else of the steps.
    """
    from torch.utils.flop_counter import FlopCounterMode

    def count(looping: bool) -> float:
        with torch.device("meta"):
            model = GPT(**config)
            model.looping_active = looping
            x = torch.zeros((1, seq_len), dtype=torch.int64)
        with FlopCounterMode(display=False) as counter:
            model(x, x).backward()
        return counter.get_total_flops() / seq_len

    looped = count(bool(config.get("num_loops")))
    if not config.get("num_loops") or looping_from is None:
        return looped
    plain, f = count(False), looping_from
    return 1 / (f / plain + (1 - f) / looped) if by_time else f * plain + (1 - f) * looped
