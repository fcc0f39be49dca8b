"""Artifact bytes of PR #1855's serializer against the kit's container, on the same quantized tensors.

Both sides quantize the same weights with the same Hessians (the record's gptq_mixed_quantize with its log's
settings; the kit's quantize_state_dict at PRESET=8xh100-pr1855's policy: equal codes, tests/test_parity_quant.py),
then each writes its own file: the record's `_serialize_pergroup` (the int8 code tensors of each role in one
stream, rows of c_q, mlp.fc and the embedding similarity-sorted, each stream `lrzip -z -L 9`, the rest
torch.save + brotli) and its `brotli` alternative (torch.save of everything, brotli 11); the kit's
quant_build_payload + quant_wrap_container (the smallest of its packings and compressors, as export_artifact
picks), and the kit's payload through the other coders found on this machine (the `zpaq` package, the system
`lrzip`), detected, never assumed.

The weights are N(0, 0.05^2) (random weights: their codes carry no structure for a long-range coder to find, so
this measures the entropy coders, not a trained model's bytes).
"""

import io
import os
import shutil
import subprocess
import tempfile
import types

import torch

from quant.artifact import quant_build_payload, quant_wrap_container, quantize_state_dict
from quant.lqer import lqer_factors
from quant.policy import QUANT_COMPRESSORS, QuantPolicy
from tools.parity.parity_quant import toy_hessian


def block_shapes(num_layers: int, dim: int = 512, kv_dim: int = 256, hidden: int = 2048, vocab: int = 8192) -> dict:
    """Record-named matrices of num_layers blocks at PR #1855's full widths, the embedding and the attention gates."""
    shapes = {"tok_emb.weight": (vocab, dim)}
    for i in range(num_layers):
        shapes.update({f"blocks.{i}.attn.c_q.weight": (dim, dim), f"blocks.{i}.attn.c_k.weight": (kv_dim, dim),
                       f"blocks.{i}.attn.c_v.weight": (kv_dim, dim), f"blocks.{i}.attn.proj.weight": (dim, dim),
                       f"blocks.{i}.mlp.fc.weight": (hidden, dim), f"blocks.{i}.mlp.proj.weight": (dim, hidden),
                       f"blocks.{i}.attn.attn_gate_w": (8, 12), f"blocks.{i}.attn_scale": (dim,)})
    return shapes


def lrzip_bytes(raw: bytes) -> int | None:
    """len of `lrzip -z -L 9` of raw (the record's stream coder), or None without an lrzip on PATH."""
    if shutil.which("lrzip") is None:
        return None
    with tempfile.TemporaryDirectory() as tmp:
        src = os.path.join(tmp, "payload.bin")
        with open(src, "wb") as f:
            f.write(raw)
        subprocess.run(["lrzip", "-q", "-z", "-L", "9", "-o", src + ".lrz", src], capture_output=True, check=True)
        return os.path.getsize(src + ".lrz")


def zpaq_bytes(raw: bytes) -> int | None:
    """len of the `zpaq` package's compress(raw, level 5, one thread: its best ratio), or None when not installed."""
    try:
        import zpaq
    except ImportError:
        return None
    return len(zpaq.compress(raw, level=5, threads=1))


def compare_artifact_bytes(module, h, shapes: dict, seed: int = 0) -> dict:
    """Bytes of each serializer on the same quantized tensors of `shapes` (record names), h: the record's quantizer
    settings (parity_quant.record_quant_hparams). Returns {"record_pergroup", "record_brotli", "kit", "kit_job",
    "kit_lrzip", "kit_zpaq"} (None: that coder is not on this machine)."""
    gen = torch.Generator().manual_seed(seed)
    sd = {n: torch.randn(*shape, generator=gen) * 0.05 for n, shape in shapes.items()}
    hessians = {n: toy_hessian(t.shape[1], gen) for n, t in sd.items() if t.ndim == 2}
    num_layers = 1 + max((int(n.split(".")[1]) for n in sd if n.startswith("blocks.")), default=-1)
    saved, module.log = module.log, lambda *_a, **_k: None
    try:
        result, meta = module.gptq_mixed_quantize(sd, hessians, h)
    finally:
        module.log = saved
    out = {}
    if shutil.which("lrzip"):
        with tempfile.TemporaryDirectory() as tmp:
            out["record_pergroup"] = len(module._serialize_pergroup(result, meta, num_layers, tmp))
    else:
        out["record_pergroup"] = None
    buf = io.BytesIO()
    torch.save({"w": result, "m": meta}, buf)
    out["record_brotli"] = len(module._compress(buf.getvalue(), "brotli"))
    policy = QuantPolicy.from_env({"PRESET": "8xh100-pr1855"}, log=lambda *_: None)
    entries, _ = quantize_state_dict(sd, policy, hessians)
    lqer = lqer_factors(entries, sd, policy.lqer_rank, policy.lqer_top_n, policy.lqer_asym)
    sizes, raws = {}, {}
    for packing in ("int8", "bits"):
        for shuffle in (False, True):
            raws[packing, shuffle] = quant_build_payload(entries, {}, policy.to_dict(), packing, shuffle, None, lqer)
            for coder in QUANT_COMPRESSORS:
                sizes[(packing, shuffle, coder)] = len(quant_wrap_container(raws[packing, shuffle], coder))
    out["kit_job"] = min(sizes, key=sizes.get)
    out["kit"] = sizes[out["kit_job"]]
    raw = raws[out["kit_job"][:2]]  # the other coders on the payload the kit's best coder was given
    out["kit_lrzip"], out["kit_zpaq"] = lrzip_bytes(raw), zpaq_bytes(raw)
    return out


def main() -> None:
    """Prints compare_artifact_bytes for 1 and 11 blocks at full width (python -m tools.parity.parity_bytes [layers])."""
    import sys

    from tools.parity.parity_models import PR1855_SCRIPT
    from tools.parity.parity_quant import record_quant_hparams
    from tools.parity.standins import import_script

    module = import_script(PR1855_SCRIPT)
    h = record_quant_hparams(PR1855_SCRIPT.parent / "train_seed42.log")
    for layers in [int(a) for a in sys.argv[1:]] or [1]:
        print(layers, "blocks:", compare_artifact_bytes(module, types.SimpleNamespace(**vars(h)), block_shapes(layers)),
              flush=True)


if __name__ == "__main__":
    main()
