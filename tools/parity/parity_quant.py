"""PR #1855's quantizer (its own functions, imported from its train_gpt.py) against the kit's, on the same inputs.

Each comparison feeds both sides the same weights and, for GPTQ, the same Hessian, so the solve is compared apart
from the Hessian collection (compared on its own, `compare_hessians`). Differences are max |a - b| of the
dequantized float32 tensors (the weights a decoder would load), plus the count of differing integer codes.
The record's functions: gptq_quantize_weight (SDClip scales k * std(row) / qmax, act-order, blocks of 128,
1% damping), _quantize_gate_int8_row, _lqer_pack_asym, collect_hessians; the kit's: quant/sdclip.py +
quant/gptq.py, primitives/rowquant.py, quant/lqer.py, quant/gptq.collect_gptq_hessians.
"""

import ast
import types

import torch

from primitives.rowquant import dequantize_per_row, quantize_per_row
from quant.artifact import quantize_state_dict
from quant.gptq import collect_gptq_hessians, gptq_quantize
from quant.lqer import lqer_correction, lqer_factors, lqer_int4
from quant.policy import QuantPolicy
from quant.sdclip import sdclip_scale
from tools.parity.parity_config import read_log_hyperparameters
from tools.parity.standins import cpu_standins

# (rows, cols, bits, k): int6 attention / MLP shapes (one over the 128-column block) and the int7 embedding, the
# record's k per group (attn 13.0, mlp 11.5, embed 14.0; train_seed42.log)
GPTQ_CASES = ((64, 48, 6, 13.0), (96, 160, 6, 11.5), (64, 200, 7, 14.0))


def toy_hessian(cols: int, gen: torch.Generator, dead: int = 0) -> torch.Tensor:
    """float32 [cols, cols] X^T X / n of 512 correlated samples; the last `dead` inputs never fire (zero)."""
    x = torch.randn(512, cols, generator=gen) @ (torch.randn(cols, cols, generator=gen) * 0.3 + torch.eye(cols))
    x[:, cols - dead:] = 0
    return x.T @ x / 512


def _diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.float() - b.float()).abs().max().item()


def compare_gptq(module, cases: tuple = GPTQ_CASES, seed: int = 0, dead: int = 0, records: bool = False) -> list:
    """[{"shape", "bits", "k", "scale", "codes", "max_abs"}] per case: the record's gptq_quantize_weight against the
    kit's sdclip_scale + gptq_quantize with those scales fixed (`records`: its QUANT_GPTQ_RECORDS arithmetic), on the
    same w [R, C] (N(0, 0.05^2)) and H (the last `dead` inputs never firing).
    scale: max |diff| of the float16 row scales; codes: differing integer codes; max_abs: dequantized."""
    gen, out = torch.Generator().manual_seed(seed), []
    for rows, cols, bits, k in cases:
        w = torch.randn(rows, cols, generator=gen) * 0.05
        h = toy_hessian(cols, gen, dead)
        q_rec, s_rec = module.gptq_quantize_weight(w, h, clip_sigmas=k, clip_range=(1 << bits - 1) - 1)
        s = sdclip_scale(w, bits, k)
        q_kit, s_kit, _ = gptq_quantize(w, h, bits, (k,), s, records)
        out.append({"shape": (rows, cols), "bits": bits, "k": k, "scale": _diff(s_rec, s_kit),
                    "codes": int((q_rec != q_kit).sum()),
                    "max_abs": _diff(q_rec.float() * s_rec.float()[:, None], dequantize_per_row(q_kit, s_kit))})
    return out


def compare_gate_rows(module, seed: int = 0) -> dict:
    """The record's int8 gate rows (_quantize_gate_int8_row: scale fp16(max|row| / 127)) against the kit's
    quantize_per_row(w, 8) (clip quantile 1.0) on the sparse gate's shape [heads 8, window 12] and a dense one."""
    gen, out = torch.Generator().manual_seed(seed), {}
    for shape in ((8, 12), (8, 512)):
        w = torch.randn(*shape, generator=gen) * 0.3
        q_rec, s_rec = module._quantize_gate_int8_row(w)
        q_kit, s_kit = quantize_per_row(w, 8)
        out[shape] = {"codes": int((q_rec != q_kit).sum()),
                      "max_abs": _diff(q_rec.float() * s_rec.float()[:, None], dequantize_per_row(q_kit, s_kit))}
    return out


def compare_lqer(module, rows: int = 96, cols: int = 256, rank: int = 4, group: int = 64, seed: int = 0) -> dict:
    """The record's LQER asym (A = U S int2 per matrix, B = V^T int4 signed per group of 64) against the kit's
    quant/lqer.py (sqrt(S) on both factors, asymmetric int4 min/scale per group of 64), on the same error E of one
    GPTQ int6 matrix. Returns {"max_abs": max |diff| of the two corrections, "rel_err_record" / "rel_err_kit" /
    "rel_err_none": ||E - correction|| / ||E|| (0 correction for none)}."""
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(rows, cols, generator=gen) * 0.05
    h = toy_hessian(cols, gen)
    q, s = module.gptq_quantize_weight(w, h, clip_sigmas=11.5, clip_range=31)
    e = w - q.float() * s.float()[:, None]
    u, sv, vh = torch.linalg.svd(e, full_matrices=False)
    qa, sa, qb, sb = module._lqer_pack_asym((u[:, :rank] * sv[:rank]).contiguous(), vh[:rank].contiguous(), group)
    rec = (qa.float() * float(sa)) @ (qb.reshape(-1, group).float() * sb.float()[:, None]).reshape(qb.shape)
    ed = e.double()
    u, sv, vh = torch.linalg.svd(ed, full_matrices=False)
    root = sv[:rank].sqrt()
    kit = lqer_correction((lqer_int4(root[:, None] * u[:, :rank].T), lqer_int4(root[:, None] * vh[:rank])), rank,
                          rows, cols)
    norm = e.norm().item()
    return {"max_abs": _diff(rec, kit), "rel_err_record": (e - rec).norm().item() / norm,
            "rel_err_kit": (e - kit).norm().item() / norm, "rel_err_none": 1.0}


def compare_hessians(module, kit, record, x: torch.Tensor, y: torch.Tensor, cross_docs: bool = False) -> dict:
    """Hessian collection on the same weights and calibration rows x [B, T]: the record's collect_hessians (one
    batch, forward_logits without cu_seqlens, as its calibration loader runs it) against the kit's
    collect_gptq_hessians (model(x, y)). The two normalize differently (the record divides the sum of X^T X by the
    batch count, the kit by the rows it summed: looped layers count twice), so each H is divided by its trace first.
    cross_docs: the kit's GPTQ_CALIB_CROSS_DOCS (calibration across documents, as the record's).
    Returns {name: max |diff| / max |H|} for the names both have, plus "only_kit" / "only_record" name lists."""
    loader = types.SimpleNamespace(next_batch=lambda *_: (x, y))
    with cpu_standins(), torch.no_grad():
        rec = module.collect_hessians(record, loader, record.parity_h, torch.device("cpu"), n_calibration_batches=1)
        kit.eval()
        mine, _ = collect_gptq_hessians(kit, lambda: (x, y), 1, cross_docs=cross_docs)
    out = {"only_kit": sorted(set(mine) - set(rec)), "only_record": sorted(set(rec) - set(mine))}
    for name in sorted(set(rec) & set(mine)):
        a, b = rec[name] / rec[name].trace(), mine[name] / mine[name].trace()
        out[name] = ((a - b).abs().max() / a.abs().max()).item()
    return out


# the record's quantizer settings (its train_seed42.log) and the kit's policy with the same meaning
RECORD_QUANT_KEYS = ("gated_attn_quant_gate", "lqer_enabled", "embed_clip_sigmas", "mlp_clip_sigmas", "attn_clip_sigmas",
                     "matrix_clip_sigmas", "embed_bits", "matrix_bits", "lqer_top_k", "lqer_rank", "lqer_asym_enabled",
                     "lqer_asym_group", "lqer_factor_bits")
KIT_POLICY = dict(attn_bits=6, mlp_bits=6, embed_bits=7, sdclip=True, sdclip_k_embed=14.0, fit=False, lqer_rank=4,
                  lqer_top_n=3)
# record-named tensors of one toy block: quantized by the record only above 65,536 values (c_k is not)
TOY_STATE_SHAPES = {"tok_emb.weight": (320, 256), "blocks.0.attn.c_q.weight": (272, 256),
                    "blocks.0.attn.c_k.weight": (128, 256), "blocks.0.mlp.fc.weight": (288, 256),
                    "blocks.0.attn.attn_gate_w": (8, 12), "blocks.0.attn_scale": (256,)}


def record_quant_hparams(log_path) -> types.SimpleNamespace:
    """The record's quantizer settings as its `h` (RECORD_QUANT_KEYS read from a train log's Hyperparameters block)."""
    values = read_log_hyperparameters(log_path)
    return types.SimpleNamespace(**{k: ast.literal_eval(values[k]) for k in RECORD_QUANT_KEYS})


def compare_state_dict(module, h, lqer: bool, seed: int = 0, records: bool = False, shapes: dict = TOY_STATE_SHAPES) -> dict:
    """The record's gptq_mixed_quantize + dequantize_mixed against the kit's quantize_state_dict (KIT_POLICY, with
    quant/lqer.py when `lqer`; `records`: QUANT_GPTQ_RECORDS=1 QUANT_LQER_ASYM=1 QUANT_GATE_INT8=1, the record's
    arithmetic, LQER form and gate rows) on `shapes` (N(0, 0.05^2)) with the same Hessians (toy_hessian).
    Returns {name: (the record's kind, "int<bits>" or "float" for the kit, max |diff| of the dequantized tensors)}."""
    gen = torch.Generator().manual_seed(seed)
    sd = {n: torch.randn(*shape, generator=gen) * 0.05 for n, shape in shapes.items()}
    hessians = {n: toy_hessian(t.shape[1], gen) for n, t in sd.items() if t.ndim == 2}
    saved, module.log = module.log, lambda *_a, **_k: None  # its "Quantized weights:" lines
    try:
        result, meta = module.gptq_mixed_quantize(sd, hessians, types.SimpleNamespace(**{**vars(h), "lqer_enabled": lqer}))
        rec = module.dequantize_mixed(result, meta, sd)
    finally:
        module.log = saved
    policy = QuantPolicy(**KIT_POLICY, lqer=lqer, lqer_asym=records, gptq_records=records, gate_int8=records)
    entries, _ = quantize_state_dict(sd, policy, hessians)
    factors = lqer_factors(entries, sd, 4, 3, records) if lqer else {}
    out = {}
    for name, (shape, bits, q, s, _) in entries.items():
        w = dequantize_per_row(q, s).view(shape) if bits else q.float()
        if name in factors:
            w = w + lqer_correction(factors[name][1], factors[name][0], *w.shape)
        out[name] = meta[name], f"int{bits}" if bits else "float", _diff(rec[name], w)
    return out
