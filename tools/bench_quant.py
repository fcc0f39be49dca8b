"""Benchmark the quant export: bytes and roundtrip val_bpb cost per policy x packing x compressor.

  python tools/bench_quant.py runs/<RUN_ID>/prequant.safetensors --data-path DATA --tokenizer M.model \
      [--val-tokens 131072] [--seq-len 256] [--out bench.md]
  python tools/bench_quant.py --calibrate      # Gaussian bits/value table behind quant/estimate.py

Checkpoint: a .safetensors state dict whose metadata "model_config" holds the GPT config JSON (the
trainer writes runs/<RUN_ID>/prequant.safetensors when SAVE_PREQUANT=1). val_bpb comes from
eval.roundtrip.eval_roundtrip on GPT(**config) from train_gpt, on the first --val-tokens of the
val split (CPU). Packing and compressor are lossless, so val_bpb is measured once per policy.

Baseline "official": the openai/parameter-golf train_gpt.py export, reproduced here: int8 per-row
for 2-D float tensors with > 65,536 elements (row clip at quantile 0.9999984, scale clamped to
>= 1/127, fp16 scales), fp16 passthrough of smaller tensors (fp32 for control tensors),
torch.save + zlib level 9. Target: the default policy >= 40% smaller at <= 0.005 bpb extra cost.
"""

import argparse
import io
import json
import sys
import time
import zlib
from pathlib import Path

import torch

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

from quant.artifact import decode_artifact, quant_build_payload, quant_wrap_container, quantize_state_dict  # noqa: E402
from quant.core import gptq_lite_quantize  # noqa: E402
from quant.estimate import estimate_artifact_bytes  # noqa: E402
from quant.offline import QUANT_PACKINGS, quant_compress  # noqa: E402
from quant.policy import QUANT_COMPRESSORS, QuantPolicy  # noqa: E402

POLICIES = {
    "default (attn6 mlp6 emb8)": QuantPolicy(),
    "int8 everywhere": QuantPolicy(attn_bits=8, mlp_bits=8),
    "mlp5": QuantPolicy(mlp_bits=5),
    "attn5 mlp5": QuantPolicy(attn_bits=5, mlp_bits=5),
    "emb7": QuantPolicy(embed_bits=7),
    "emb6": QuantPolicy(embed_bits=6),
    "no GPTQ-lite": QuantPolicy(gptq_lite=False),
    "float32 passthrough": QuantPolicy(float_dtype="float32"),
}
_OFFICIAL_CONTROL = ("attn_scale", "attn_scales", "mlp_scale", "mlp_scales", "resid_mix", "resid_mixes", "q_gain",
                     "skip_weight", "skip_weights")


def official_int8_zlib(state_dict: dict) -> tuple[int, dict]:
    """Official baseline export -> (compressed bytes, dequantized float32 state dict)."""
    obj, out = {"quantized": {}, "scales": {}, "passthrough": {}}, {}
    for name, t in state_dict.items():
        t = t.detach().float()
        if t.numel() <= 65_536:
            kept = t if any(p in name for p in _OFFICIAL_CONTROL) else t.half()
            obj["passthrough"][name], out[name] = kept, kept.float()
            continue
        clip = torch.quantile(t.abs(), 0.9999984, dim=1)
        scale = (clip / 127.0).clamp_min(1.0 / 127.0)
        q = torch.clamp(torch.round(torch.clamp(t, -clip[:, None], clip[:, None]) / scale[:, None]), -127, 127).to(torch.int8)
        obj["quantized"][name], obj["scales"][name] = q, scale.half()
        out[name] = q.float() * scale.half().float()[:, None]
    buf = io.BytesIO()
    torch.save(obj, buf)
    return len(zlib.compress(buf.getvalue(), 9)), out


def _load_checkpoint(path: Path) -> tuple[dict, dict]:
    from safetensors import safe_open
    from safetensors.torch import load_file

    with safe_open(str(path), framework="pt") as f:
        meta = f.metadata() or {}
    if "model_config" not in meta:
        raise ValueError(f"{path}: safetensors metadata has no 'model_config' (expected the trainer's prequant file)")
    return load_file(str(path)), json.loads(meta["model_config"])


def _val_bpb(config: dict, state_dict: dict, val_tokens, luts, seq_len: int) -> float:
    from eval.roundtrip import eval_roundtrip
    from train_gpt import GPT

    model = GPT(**config)
    model.load_state_dict(state_dict, strict=True)
    model.eval()
    return eval_roundtrip(model, val_tokens, luts, seq_len=seq_len, batch_seqs=16, device=torch.device("cpu"))[1]


def run_bench(args) -> str:
    import sentencepiece as spm

    from eval.bpb import build_sentencepiece_luts
    from eval.shards import load_validation_tokens

    state, config = _load_checkpoint(Path(args.checkpoint))
    num_params = sum(t.numel() for t in state.values())
    if not Path(args.tokenizer).is_file():
        raise FileNotFoundError(f"--tokenizer {args.tokenizer} does not exist")
    luts = build_sentencepiece_luts(spm.SentencePieceProcessor(model_file=str(args.tokenizer)), config["vocab_size"])
    val_tokens = load_validation_tokens(args.data_path, vocab_size=config["vocab_size"])[: args.val_tokens + 1]
    base_bpb = _val_bpb(config, state, val_tokens, luts, args.seq_len)
    off_bytes, off_state = official_int8_zlib(state)
    off_bpb = _val_bpb(config, off_state, val_tokens, luts, args.seq_len)
    lines = [
        f"checkpoint {args.checkpoint}: {num_params:,} params, config {json.dumps(config)}",
        f"val: {val_tokens.numel() - 1:,} tokens, seq_len {args.seq_len}; prequant val_bpb {base_bpb:.5f}",
        "",
        "| policy | packing | compressor | bytes | bytes/param | vs official | estimate | d val_bpb | rel_mse | seconds |",
        "|---|---|---|---:|---:|---:|---:|---:|---:|---:|",
        f"| official int8 (torch.save) | int8 | zlib-9 | {off_bytes:,} | {off_bytes / num_params:.4f} | +0.0% | "
        f"| {off_bpb - base_bpb:+.5f} | | |",
    ]
    shapes = {k: tuple(v.shape) for k, v in state.items()}
    for label, policy in POLICIES.items():
        t0 = time.perf_counter()
        entries, rel_mse = quantize_state_dict(state, policy)
        q_seconds = time.perf_counter() - t0
        estimate = estimate_artifact_bytes(shapes, policy)
        blob_for_eval, rows = None, []
        for packing in QUANT_PACKINGS:
            raw = quant_build_payload(entries, config, policy.to_dict(), packing)
            for comp in QUANT_COMPRESSORS:
                t1 = time.perf_counter()
                blob = quant_wrap_container(raw, comp)
                rows.append((packing, comp, len(blob), q_seconds + time.perf_counter() - t1))
                blob_for_eval = blob_for_eval or blob
        sd, _, _ = decode_artifact(blob_for_eval)
        d_bpb = _val_bpb(config, sd, val_tokens, luts, args.seq_len) - base_bpb
        best = min(r[2] for r in rows)
        for packing, comp, nbytes, seconds in rows:
            mark = " **(auto)**" if nbytes == best else ""
            lines.append(f"| {label} | {packing} | {comp}{mark} | {nbytes:,} | {nbytes / num_params:.4f} | "
                         f"{100 * (nbytes / off_bytes - 1):+.1f}% | {estimate:,} | {d_bpb:+.5f} | {rel_mse:.2e} | {seconds:.1f} |")
    return "\n".join(lines)


def run_calibration() -> str:
    """Compressed bits per value of Gaussian rows (GPTQ-lite, int8 containers, best compressor)."""
    torch.manual_seed(0)
    lines = ["| bits | row length | zlib | zstd | lzma |", "|---:|---:|---:|---:|---:|"]
    for bits in range(2, 9):
        for row_len in (512, 2048):
            w = torch.randn(2_000_000 // row_len, row_len)
            q = gptq_lite_quantize(w, bits)[0].numpy().tobytes()
            bpv = [8 * len(quant_compress(q, c)) / len(q) for c in QUANT_COMPRESSORS]
            lines.append(f"| {bits} | {row_len} | " + " | ".join(f"{b:.3f}" for b in bpv) + " |")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("checkpoint", nargs="?")
    parser.add_argument("--data-path")
    parser.add_argument("--tokenizer")
    parser.add_argument("--val-tokens", type=int, default=131_072)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--out", help="also write the table to this file")
    parser.add_argument("--calibrate", action="store_true")
    args = parser.parse_args(argv)
    if args.calibrate:
        text = run_calibration()
    else:
        if not (args.checkpoint and args.data_path and args.tokenizer):
            parser.error("checkpoint, --data-path and --tokenizer are required (or --calibrate)")
        text = run_bench(args)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
