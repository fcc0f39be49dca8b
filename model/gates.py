"""SmearGate and the sparse attention head-output gate (SMEAR_GATE_ENABLED, SPARSE_ATTN_GATE_ENABLED): the gates'
math. Their parameters (smear_gate_w, smear_lambda, attn_gate_w) are made by model/gpt.py, which calls these only
when the gates are on, so a record's train_gpt.py packed without them carries none of this.

Shape legend: B batch, T time, D model dim, H query heads, Dh head dim, W gate window (GATE_WINDOW).
"""

import torch
import torch.nn.functional as F

# the packed train_gpt.py holds the gates only for runs that turn one on (kit/bundle_when.py)
PACKED_WHEN = "SMEAR_GATE_ENABLED or SPARSE_ATTN_GATE_ENABLED"


def smear_previous_token(x: torch.Tensor, input_ids: torch.Tensor, gate_w: torch.Tensor, lam: torch.Tensor,
                         bos_id: int = 1, /) -> torch.Tensor:
    """SmearGate with the BOS fix (PR #1667's gate, PR #1855's fix): x_t + lam * sigmoid(gate_w . x_t[:W]) * x_{t-1}
    for t >= 1, where the previous-token term is dropped at BOS positions (bos_id, the shard format's BOS), so no
    document reads the last token of the one before it. x [B, T, D] token embeddings; input_ids [B, T]; gate_w
    [1, W]; lam [1].
    """
    g = lam.to(x.dtype) * torch.sigmoid(F.linear(x[:, 1:, :gate_w.size(1)], gate_w.to(x.dtype)))
    keep = (input_ids[:, 1:] != bos_id).unsqueeze(-1).to(x.dtype)
    return torch.cat((x[:, :1], x[:, 1:] + g * x[:, :-1] * keep), dim=1)


def sparse_head_gate(y: torch.Tensor, x: torch.Tensor, gate_w: torch.Tensor, scale: float, /) -> torch.Tensor:
    """The sparse attention head-output gate (PR #1787): y[b, t, h] * sigmoid(scale * gate_w[h] . x[b, t, :W]).

    y [B, T, H, Dh] attention output (after XSA); x [B, T, D] the attention's normalized input; gate_w [H, W].
    """
    g = torch.sigmoid(scale * F.linear(x[..., :gate_w.size(1)], gate_w.to(x.dtype)))
    return y * g.unsqueeze(-1).to(y.dtype)
