"""Document-packed attention (DOC_PACKED_ATTENTION, PR #1855): no token attends across a BOS. model/attention.py's
`attention` hands a call with documents to `doc_attention`, so a record's train_gpt.py packed without the switch
carries none of this.

Shapes: B batch, T time (sequence), H query heads, Hkv key/value heads (GQA: H % Hkv == 0), D head dim.
"""

from typing import NamedTuple

import torch
import torch.nn.functional as F

# the packed train_gpt.py holds it only for runs with the switch on (kit/bundle_when.py)
PACKED_WHEN = "DOC_PACKED_ATTENTION"


class DocSegments(NamedTuple):
    """Where each document of a batch starts, in the form the chosen kernel reads (document_segments makes it).

    mask: bool [B, 1, T, T], True where query t may read key s (s <= t, same document), for SDPA; or
    cu_seqlens: int32 [B*T + 1] document starts in the flattened batch, padded with B*T (empty documents),
    and max_seqlen: T, for flash-attn's varlen kernel (static shapes: no host sync, compile-friendly).
    """

    mask: torch.Tensor | None
    cu_seqlens: torch.Tensor | None
    max_seqlen: int


def document_segments(input_ids: torch.Tensor, bos_id: int, varlen: bool, /) -> DocSegments:
    """The documents of input_ids int64 [B, T]: each starts at a BOS token or at its row's start, as PR #1855's
    _build_cu_seqlens cuts its packed stream (no token attends across a BOS). varlen: cu_seqlens for flash-attn's
    varlen kernel (model.attention.doc_segments passes whether one was resolved and the ids are on CUDA); else the
    dense mask (the CPU path and SDPA's)."""
    b, t = input_ids.shape
    starts = input_ids == bos_id
    if varlen:
        starts = starts.clone()
        starts[:, 0] = True
        pos = torch.arange(b * t, device=input_ids.device, dtype=torch.int32)
        cu = torch.where(starts.flatten(), pos, b * t).sort().values
        return DocSegments(None, torch.cat((cu, cu.new_full((1,), b * t))), t)
    doc = starts.cumsum(1)  # tokens before a row's first BOS form its document 0
    causal = torch.ones(t, t, dtype=torch.bool, device=input_ids.device).tril()
    return DocSegments(((doc[:, :, None] == doc[:, None, :]) & causal)[:, None], None, t)


def doc_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, docs: DocSegments, varlen, /) -> torch.Tensor:
    """model.attention.attention with documents: q [B, T, H, D]; k, v [B, T, Hkv, D] -> [B, T, H, D] in v's dtype.
    With docs.cu_seqlens and a varlen kernel (flash-attn's flash_attn_varlen_func, else falsy), run on the
    flattened batch in the autocast dtype or bf16 (PR #1855's form), else SDPA with the dense mask."""
    if varlen and docs.cu_seqlens is not None:
        dev, (b, t) = q.device.type, q.shape[:2]
        dt = torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else torch.bfloat16
        out = varlen(q.to(dt).flatten(0, 1), k.to(dt).flatten(0, 1), v.to(dt).flatten(0, 1),
                            cu_seqlens_q=docs.cu_seqlens, cu_seqlens_k=docs.cu_seqlens,
                            max_seqlen_q=docs.max_seqlen, max_seqlen_k=docs.max_seqlen, causal=True)
        return (out[0] if isinstance(out, tuple) else out).unflatten(0, (b, t)).to(v.dtype)
    y = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=docs.mask,
                                       is_causal=docs.mask is None, enable_gqa=k.size(2) != q.size(2))
    return y.transpose(1, 2)
