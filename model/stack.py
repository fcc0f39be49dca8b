"""The block stack of model.gpt.GPT with PR #1855's switches: encoder/decoder order with depth recurrence
(NUM_LOOPS), gated U-Net skips (SKIP_GATES_ENABLED) and the 2-lane parallel decoder (PARALLEL_START_LAYER). A
model without them runs GPT.run_blocks (the plain U-Net, the same ops as run_stack there), so a record's
train_gpt.py packed without these switches carries none of this.

Shape legend: B batch, T time, D model dim; L layers. `model` is a model.gpt.GPT; its blocks are
model.gpt.Block (pre-norm, attention then MLP, both outputs scaled per channel).
"""

import torch

# the packed train_gpt.py holds it only for runs with one of these switches on (kit/bundle_when.py)
PACKED_WHEN = "NUM_LOOPS > 0 or SKIP_GATES_ENABLED or PARALLEL_START_LAYER > 0"
PARALLEL_FINAL_LANES = ("mean", "mlp", "attn")


def looped_layer_order(num_layers: int, num_loops: int, loop_start: int, loop_end: int, /) -> list:
    """Depth recurrence (PR #1204, #1285, #1493): the blocks run in order with blocks loop_start..loop_end
    (inclusive) run 1 + num_loops times in a row, e.g. 11 layers, 3..5, 2 loops -> 0 1 2 3 4 5 3 4 5 3 4 5 6 .. 10.
    The first half of the sequence is the U-Net's encoder (its outputs feed the skips), the rest its decoder."""
    if not num_loops:
        return list(range(num_layers))
    return [*range(loop_start), *list(range(loop_start, loop_end + 1)) * (num_loops + 1), *range(loop_end + 1, num_layers)]


def stack_init(model, num_layers: int, num_skips: int, num_loops: int, loop_start: int, loop_end: int,
               parallel_start_layer: int, parallel_final_lane: str, /) -> int:
    """GPT.__init__'s part for these switches (the parameters in GPT's order: before SmearGate's): the 2-lane
    decoder's settings and its routing weights (PR #1855: resid init 1.1, post init 1), the depth recurrence's
    loop_order. Returns the number of U-Net skips (num_skips, or the looped order's when larger)."""
    model.parallel_start_layer, model.parallel_final_lane = parallel_start_layer, parallel_final_lane
    if parallel_start_layer > 0:
        model.parallel_post_lambdas = torch.nn.Parameter(torch.ones(num_layers, 2, 2))
        model.parallel_resid_lambdas = torch.nn.Parameter(torch.full((num_layers, 2), 1.1))
    if num_loops:
        model.loop_order = looped_layer_order(num_layers, num_loops, loop_start, loop_end)
        n = len(model.loop_order)
        num_skips = max(num_skips, n // 2)
    return num_skips


def merge_skip(x: torch.Tensor, skip: torch.Tensor, weight: torch.Tensor, gate: torch.Tensor | None, /) -> torch.Tensor:
    """A U-Net skip into the decoder: x + weight * skip; with a gate (PR #1855's SKIP_GATES_ENABLED),
    torch.lerp(weight * skip, x, sigmoid(gate)), i.e. the gate mixes the stream and the scaled skip.
    x, skip [B, T, D]; weight, gate [D] (float32, cast to x's dtype)."""
    scaled = weight.to(x.dtype) * skip
    if gate is None:
        return x + scaled
    return torch.lerp(scaled, x, torch.sigmoid(gate.to(x.dtype)))


def two_lane_step(model, i: int, lane0: torch.Tensor, lane1: torch.Tensor, x0: torch.Tensor, cos, sin, docs, /):
    """Block i of PR #1855's 2-lane parallel decoder: attention reads the residual mix of lane 0 and x0, the MLP
    reads lane 1 (no mix), and each lane takes both outputs through learned routing weights:
    lane_j <- resid[i, j] * lane_j + post[i, 0, j] * attn + post[i, 1, j] * mlp,
    resid = model.parallel_resid_lambdas [L, 2] (init 1.1), post = model.parallel_post_lambdas [L, 2, 2] (init 1).
    lane0, lane1, x0 [B, T, D] -> (lane0, lane1)."""
    block = model.blocks[i]
    mix = block.resid_mix.to(lane0.dtype)
    attn_out = block.attn(block.normed(mix[0] * lane0 + mix[1] * x0), cos, sin, block.attn_scale, docs)
    mlp_out = block.mlp(block.normed(lane1), block.mlp_scale)
    resid = model.parallel_resid_lambdas[i].to(lane0.dtype)
    post = model.parallel_post_lambdas[i].to(lane0.dtype)
    lane0 = resid[0] * lane0 + post[0, 0] * attn_out + post[1, 0] * mlp_out
    lane1 = resid[1] * lane1 + post[0, 1] * attn_out + post[1, 1] * mlp_out
    return lane0, lane1


def final_lane(lane0: torch.Tensor, lane1: torch.Tensor, rule: str, /) -> torch.Tensor:
    """The decoder's output from its two lanes (PARALLEL_FINAL_LANE): mean (0.5 (lane0 + lane1)), mlp (lane 1)
    or attn (lane 0), as PR #1855's _final_parallel_hidden."""
    if rule == "mlp":
        return lane1
    if rule == "attn":
        return lane0
    return 0.5 * (lane0 + lane1)


def run_stack(model, x: torch.Tensor, x0: torch.Tensor, cos, sin, docs=None, /) -> torch.Tensor:
    """The blocks on x [B, T, D] (x0: the normalized embeddings) -> the last residual stream [B, T, D] (before
    the final norm).

    Order: blocks 0..L-1, or model.loop_order while model.looping_active (its first half is the encoder).
    Each encoder output is kept; decoder step j (j = 0, 1, ...) first merges the last kept output (merge_skip
    with skip_weights[j] and, if any, skip_gates[j]). From the first decoder block whose index is
    >= model.parallel_start_layer (> 0: on) the stream splits into two lanes (two_lane_step) that
    final_lane joins at the end; the skips then merge into lane 0. docs: model.attention.doc_segments or None.
    """
    order = model.loop_order if model.looping_active else range(len(model.blocks))
    num_encoder = len(order) // 2 if model.looping_active else model.num_encoder_layers
    gates, start = model.skip_gates, model.parallel_start_layer
    skips, lanes = [], None
    for k, i in enumerate(order):
        j = k - num_encoder
        if lanes is None and 0 < start <= i and j >= 0:
            lanes = (x, x)
        if 0 <= j < model.skip_weights.size(0) and skips:
            gate = None if gates is None else gates[j]
            if lanes is None:
                x = merge_skip(x, skips.pop(), model.skip_weights[j], gate)
            else:
                lanes = (merge_skip(lanes[0], skips.pop(), model.skip_weights[j], gate), lanes[1])
        if lanes is None:
            x = model.blocks[i](x, x0, cos, sin, docs)
        else:
            lanes = two_lane_step(model, i, *lanes, x0, cos, sin, docs)
        if k < num_encoder:
            skips.append(x)
    return x if lanes is None else final_lane(*lanes, model.parallel_final_lane)
