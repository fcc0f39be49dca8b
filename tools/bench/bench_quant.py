"""Benchmark the quant export on a trained checkpoint: the bytes vs val_bpb frontier of round-to-nearest,
GPTQ-lite and full GPTQ at int8/6/5/4, and the table of entropy coders.

  python tools/bench_quant.py runs/<RUN_ID>/prequant.safetensors --data-path DATA --tokenizer M.model \\
      [--val-tokens 65536] [--seq-len 256] [--calib-batches 64] [--calib-tokens 8192] [--bits 8,6,5,4] \\
      [--compressor auto] [--out bench.md]
  python tools/bench_quant.py --calibrate      # Gaussian bits/value table behind quant/estimate.py

Checkpoint: a .safetensors state dict whose metadata "model_config" holds the GPT config JSON (the
trainer writes runs/<RUN_ID>/prequant.safetensors when SAVE_PREQUANT=1). The reference checkpoints
(docs/quantization.md): tools/sweeps/proxy_quant.yaml (the CPU proxy: 4 layers, d 256, MLP 3x, sp1024,
2.6 M params, the default preset's weight-shaping ingredients, no QAT so that no bit width is favoured),
seeds 1337 and 42, 1,200 Muon steps of 8,192 tokens of local web text, scored on the first 65,536
tokens of the proxy's tune split:

  python tools/sweeps/proxy_data.py
  python tools/sweep.py --file tools/sweeps/proxy_quant.yaml   # SAVE_PREQUANT=1; ~50 min, two runs side by side
  python tools/bench_quant.py runs/proxy_quant/q/seed1337/prequant.safetensors \
      --data-path data/datasets/proxy_tune_sp1024 --tokenizer data/tokenizers/fineweb_1024_bpe.model \
      --compressor brotli

(the frontier: about 10 minutes on 2 shared cores, 5 of them the 64 x 8,192-token Hessian collection;
rows print to stderr as they finish).

Frontier: the block matrices (attention + MLP) at each --bits, the embedding at int8, float16
control tensors, QUANT_FIT off; per method the artifact is exported with every encoding candidate
(or --compressor) and the smallest kept, then decoded and scored. val_bpb: eval.roundtrip on the
first --val-tokens of the val split, GPT(**config) from train_gpt, float32 on CPU. Full GPTQ uses
Hessians collected by quant.gptq.collect_gptq_hessians from --calib-batches batches of
--calib-tokens TRAIN tokens (read through train_gpt.DistributedTokenLoader, as the trainer does).
The int5 line checks the target: full GPTQ's val_bpb cost <= 70% of GPTQ-lite's.

Techniques (--techniques 5/6,6/8: block/embedding bit pairs): only this table, one row per
technique and combination of tools/bench_quant.TECHNIQUES (SDClip with the records' k per group,
LQER rank 4 on the top 3 tensors, the grouped container) at each pair, QUANT_FIT and full GPTQ off:
bytes of the smallest encoding, bytes/param, d val_bpb (exact, decoded file through eval.roundtrip)
and both against the first row of the same bits. With --gptq the rows are GPTQ_TECHNIQUES on full GPTQ
(Hessians collected as below, as the trainer's export): GPTQ on the tied embedding, SDClip on every
group or on the blocks only, LQER, the grouped container.
Equal bytes (--budget 0.4,0.5: bytes per parameter): each FIT_TECHNIQUES set exported with QUANT_FIT=1
from int8 to budget x params bytes (the export fit, measured errors, full GPTQ): bytes, d val_bpb, the
fitted bits and the real / estimated bytes (the QUANT_ESTIMATE_SCALE the export implies).
The tables in docs/quantization.md: the checkpoints of tools/sweeps/proxy_quant.yaml (2 seeds),
  python tools/bench_quant.py runs/proxy_quant/q/seed1337/prequant.safetensors \
      --data-path data/datasets/proxy_tune_sp1024 --tokenizer data/tokenizers/fineweb_1024_bpe.model \
      --compressor brotli --gptq --techniques 6/8,5/8,4/8,5/6 --budget 0.40,0.50
(about 30 minutes per checkpoint on one loaded core).

Compressors: one payload (the int6-blocks / int8-embedding policy of the records, GPTQ-lite) under
every packing x byte-shuffle x compressor, with compression seconds (on whatever the machine is
doing: label timings as such), and the official baseline's torch.save + zlib-9 export of the same
weights ("official", reproduced: int8 per-row for 2-D float tensors with > 65,536 elements, row
clip at quantile 0.9999984, scale clamped to >= 1/127, fp16 scales, fp16/fp32 passthrough).
"""

import argparse
import collections
import io
import json
import sys
import tempfile
import time
import zlib
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))


def build_parser() -> argparse.ArgumentParser:
    """The command line, built without torch: `--help` and usage errors answer at once."""
    from quant.policy import QUANT_COMPRESSORS  # no torch

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("checkpoint", nargs="?")
    parser.add_argument("--data-path")
    parser.add_argument("--tokenizer")
    parser.add_argument("--val-tokens", type=int, default=65_536)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--calib-batches", type=int, default=64)
    parser.add_argument("--calib-tokens", type=int, default=8192, help="train tokens per calibration batch")
    parser.add_argument("--bits", default="8,6,5,4", help="comma-separated block-matrix bit widths")
    parser.add_argument("--compressor", default="auto", choices=("auto",) + QUANT_COMPRESSORS)
    parser.add_argument("--techniques", help="only the technique table (SDClip, LQER, grouped and combinations) at "
                        "these BLOCK/EMBED bit pairs, e.g. 5/6,6/8")
    parser.add_argument("--gptq", action="store_true", help="the technique table on full GPTQ (calibration Hessians, "
                        "as the trainer's export) instead of GPTQ-lite")
    parser.add_argument("--budget", help="comma-separated bytes/param: each technique set fitted by QUANT_FIT to "
                        "that many bytes (equal bytes), full GPTQ")
    parser.add_argument("--out", help="also write the table to this file")
    parser.add_argument("--calibrate", action="store_true")
    return parser


if __name__ == "__main__":  # --help and usage errors answer before torch is imported
    build_parser().parse_args()

import torch  # noqa: E402

from quant.artifact import (  # noqa: E402
    decode_artifact, export_artifact, load_artifact, quant_build_payload, quant_wrap_container, quantize_state_dict)
from primitives.rowquant import gptq_lite_quantize  # noqa: E402
from quant.offline import QUANT_PACKINGS, quant_compress  # noqa: E402
from quant.policy import QUANT_COMPRESSORS, QuantPolicy  # noqa: E402

METHODS = {  # label -> policy fields (bits set per row of the frontier)
    "RTN": dict(gptq_lite=False, gptq=False),
    "GPTQ-lite": dict(gptq_lite=True, gptq=False),
    "full GPTQ": dict(gptq_lite=True, gptq=True),
}
COMPRESSOR_POLICY = QuantPolicy(attn_bits=6, mlp_bits=6, embed_bits=8, gptq=False, fit=False)
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


def _model(config: dict, state_dict: dict):
    from model.gpt import GPT

    model = GPT(**config)
    model.load_state_dict(state_dict, strict=True)
    return model.eval()


def _val_bpb(config: dict, state_dict: dict, val_tokens, luts, seq_len: int) -> float:
    from eval.roundtrip import eval_roundtrip

    return eval_roundtrip(_model(config, state_dict), val_tokens, luts, seq_len=seq_len, batch_seqs=16,
                          device=torch.device("cpu"))[1]


def collect_hessians(config: dict, state_dict: dict, data_path: str, num_batches: int, batch_tokens: int,
                     seq_len: int) -> tuple[dict, float]:
    """Calibration Hessians of the checkpoint's linears from the TRAIN shards -> ({name: H}, seconds)."""
    from quant.gptq import collect_gptq_hessians
    from shards.loader import DistributedTokenLoader

    loader = DistributedTokenLoader(data_path, config["vocab_size"])
    t0 = time.perf_counter()
    hessians, _ = collect_gptq_hessians(_model(config, state_dict), lambda: loader.next_batch(batch_tokens, seq_len),
                                        num_batches)
    return hessians, time.perf_counter() - t0


def frontier_rows(state, config, hessians, score, bits_list, compressor="auto") -> list[dict]:
    """One row per (bits, method): bytes of the smallest encoding, val_bpb, rel_mse, seconds."""
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for bits in bits_list:
            for label, fields in METHODS.items():
                policy = QuantPolicy(attn_bits=bits, mlp_bits=bits, embed_bits=8, fit=False, compressor=compressor, **fields)
                t0 = time.perf_counter()
                report = export_artifact(state, config, Path(tmp) / "m.ptz", code_bytes=0, byte_budget=10**12,
                                         policy=policy, hessians=hessians, log=lambda msg: None)
                seconds = time.perf_counter() - t0
                loaded = load_artifact(Path(tmp) / "m.ptz")[0]
                rows.append(dict(bits=bits, method=label, bytes=report["bytes_model"], val_bpb=score(loaded),
                                 rel_mse=report["rel_mse"], seconds=seconds,
                                 encoding=f"{report['packing']}{'+shuffle' * report['shuffle']}+{report['compressor']}"))
                print(f"done: {rows[-1]}", file=sys.stderr, flush=True)  # progress: a CPU run takes many minutes
    return rows


TECHNIQUES = {  # label -> policy fields on top of the technique table's bits (SDClip k: the records' per group)
    "GPTQ-lite (today)": {},
    "SDClip": dict(sdclip=True),
    "GPTQ-lite + LQER": dict(lqer=True),
    "SDClip + LQER": dict(sdclip=True, lqer=True),
    "GPTQ-lite + grouped": dict(grouped=True),
    "SDClip + grouped": dict(sdclip=True, grouped=True),
    "SDClip + LQER + grouped": dict(sdclip=True, lqer=True, grouped=True),
}


GPTQ_TECHNIQUES = {  # the same on full GPTQ (QUANT_GPTQ=1, the trainer's export); the first row without QUANT_GPTQ_EMBED
    "full GPTQ, embedding by clip search": dict(gptq_embed=False),
    "+ GPTQ embed (default)": {},
    "SDClip (records' k, every group)": dict(sdclip=True, gptq_embed=False),
    "SDClip blocks (embed: clip search)": dict(sdclip=True, sdclip_k_embed=0.0, gptq_embed=False),
    "+ LQER": dict(lqer=True, gptq_embed=False),
    "SDClip blocks + LQER": dict(sdclip=True, sdclip_k_embed=0.0, lqer=True, gptq_embed=False),
    "+ grouped": dict(grouped=True, gptq_embed=False),
}


def technique_rows(state, config, score, policies: dict, compressor="auto", hessians=None) -> list[dict]:
    """One row per (bits label, technique): the export's bytes (every encoding candidate, or
    --compressor, plus the grouped container where on), val_bpb of the decoded file, seconds.
    policies: bits label -> QuantPolicy fields (bits, fit off); hessians None: TECHNIQUES with full GPTQ
    off, else GPTQ_TECHNIQUES with full GPTQ on these Hessians."""
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for bits_label, base in policies.items():
            for label, fields in (TECHNIQUES if hessians is None else GPTQ_TECHNIQUES).items():
                policy = QuantPolicy(**{**base, **fields, "fit": False, "gptq": hessians is not None, "compressor": compressor})
                t0 = time.perf_counter()
                report = export_artifact(state, config, Path(tmp) / "m.ptz", code_bytes=0, byte_budget=10**12,
                                         policy=policy, hessians=hessians, log=lambda msg: None)
                seconds = time.perf_counter() - t0
                loaded = load_artifact(Path(tmp) / "m.ptz")[0]
                rows.append(dict(bits=bits_label, technique=label, bytes=report["bytes_model"], val_bpb=score(loaded),
                                 seconds=seconds, encoding=f"{report['packing']}{'+shuffle' * report['shuffle']}"
                                                           f"+{report['compressor']}"))
                print(f"done: {rows[-1]}", file=sys.stderr, flush=True)
    return rows


FIT_TECHNIQUES = {  # the technique sets the equal-bytes table fits to each budget (full GPTQ, QUANT_FIT=1)
    "full GPTQ, embedding by clip search": dict(gptq_embed=False),
    "+ GPTQ embed (default)": {},
    "+ LQER": dict(lqer=True, gptq_embed=False),
    "SDClip blocks": dict(sdclip=True, sdclip_k_embed=0.0, gptq_embed=False),
    "SDClip blocks + LQER": dict(sdclip=True, sdclip_k_embed=0.0, lqer=True, gptq_embed=False),
}


def budget_rows(state, config, score, hessians, budgets: list, compressor="auto") -> list[dict]:
    """One row per (bytes/param budget, FIT_TECHNIQUES set): the export fit (QUANT_FIT=1 from int8, full GPTQ)
    to budget * params bytes (code 0); bytes, val_bpb of the decoded file, the fitted bits, seconds. A set
    that cannot fit gets bytes None and the fit's message."""
    rows, num_params = [], sum(t.numel() for t in state.values())
    with tempfile.TemporaryDirectory() as tmp:
        for budget in budgets:
            for label, fields in FIT_TECHNIQUES.items():
                policy = QuantPolicy(**fields, compressor=compressor)
                t0 = time.perf_counter()
                try:
                    report = export_artifact(state, config, Path(tmp) / "m.ptz", code_bytes=0,
                                             byte_budget=int(budget * num_params), policy=policy,
                                             hessians=hessians, log=lambda msg: None)
                except ValueError as err:
                    rows.append(dict(budget=budget, technique=label, bytes=None, error=str(err)))
                    continue
                bits = collections.Counter(report["policy"].get("fitted") and dict(report["policy"]["fitted"]).values())
                rows.append(dict(budget=budget, technique=label, bytes=report["bytes_model"],
                                 est_ratio=report["quant_estimate_scale_measured"],
                                 val_bpb=score(load_artifact(Path(tmp) / "m.ptz")[0]), seconds=time.perf_counter() - t0,
                                 bits=" ".join(f"int{b}:{c}" for b, c in sorted(bits.items(), reverse=True)) or "none"))
                print(f"done: {rows[-1]}", file=sys.stderr, flush=True)
    return rows


def budget_table(rows: list, num_params: int, base_bpb: float) -> list[str]:
    """Markdown lines of budget_rows: bytes, bytes/param, d val_bpb, and d val_bpb vs the first set of its budget."""
    lines = ["| budget B/param | technique | bytes | bytes/param | d val_bpb | vs first set | fitted tensors (others int8) "
             "| real / estimate | seconds |",
             "|---:|---|---:|---:|---:|---:|---|---:|---:|"]
    first = {}
    for r in rows:
        if r["bytes"] is None:
            lines.append(f"| {r['budget']} | {r['technique']} | does not fit: {r['error']} | | | | | | |")
            continue
        f = first.setdefault(r["budget"], r)
        lines.append(f"| {r['budget']} | {r['technique']} | {r['bytes']:,} | {r['bytes'] / num_params:.4f} | "
                     f"{r['val_bpb'] - base_bpb:+.5f} | {r['val_bpb'] - f['val_bpb']:+.5f} | {r['bits']} | "
                     f"{r['est_ratio']:.3f} | {r['seconds']:.1f} |")
    return lines


def technique_table(rows: list, num_params: int, base_bpb: float) -> list[str]:
    """Markdown lines of technique_rows: bytes, bytes/param, d val_bpb, bytes and d val_bpb vs the first row of its bits."""
    lines = ["| bits | technique | bytes | bytes/param | d val_bpb | vs first row: bytes | vs first row: d val_bpb | encoding "
             "| seconds |", "|---|---|---:|---:|---:|---:|---:|---|---:|"]
    first = {}
    for r in rows:
        f = first.setdefault(r["bits"], r)
        lines.append(f"| {r['bits']} | {r['technique']} | {r['bytes']:,} | {r['bytes'] / num_params:.4f} | "
                     f"{r['val_bpb'] - base_bpb:+.5f} | {r['bytes'] - f['bytes']:+,} | {r['val_bpb'] - f['val_bpb']:+.5f} | "
                     f"{r['encoding']} | {r['seconds']:.1f} |")
    return lines


def compressor_rows(state, config) -> list[dict]:
    """Every packing x shuffle x compressor on one payload (COMPRESSOR_POLICY)."""
    entries, _ = quantize_state_dict(state, COMPRESSOR_POLICY)
    rows = []
    for packing in QUANT_PACKINGS:
        for shuffle in (False, True):
            raw = quant_build_payload(entries, config, COMPRESSOR_POLICY.to_dict(), packing, shuffle)
            for comp in QUANT_COMPRESSORS:
                t0 = time.perf_counter()
                blob = quant_wrap_container(raw, comp)
                seconds = time.perf_counter() - t0
                decode_artifact(blob)  # every candidate must load
                rows.append(dict(packing=packing, shuffle=shuffle, compressor=comp, bytes=len(blob), seconds=seconds,
                                 raw_bytes=len(raw)))
    return rows


def run_bench(args) -> str:
    import sentencepiece as spm

    from eval.bpb import build_sentencepiece_luts
    from shards.format import load_validation_tokens

    state, config = _load_checkpoint(Path(args.checkpoint))
    num_params = sum(t.numel() for t in state.values())
    if not Path(args.tokenizer).is_file():
        raise FileNotFoundError(f"--tokenizer {args.tokenizer} does not exist")
    luts = build_sentencepiece_luts(spm.SentencePieceProcessor(model_file=str(args.tokenizer)), config["vocab_size"])
    val_tokens = load_validation_tokens(args.data_path, vocab_size=config["vocab_size"])[: args.val_tokens + 1]

    def score(sd):
        return _val_bpb(config, sd, val_tokens, luts, args.seq_len)

    base_bpb = score(state)
    print(f"prequant val_bpb {base_bpb:.5f}", file=sys.stderr, flush=True)
    head = [f"checkpoint {args.checkpoint}: {num_params:,} params, config {json.dumps(config)}",
            f"val: {val_tokens.numel() - 1:,} tokens, seq_len {args.seq_len}; prequant val_bpb {base_bpb:.5f}"]
    hessians, gptq, budget = None, getattr(args, "gptq", False), getattr(args, "budget", [])
    if not getattr(args, "techniques", None) or gptq or budget:
        hessians, calib_seconds = collect_hessians(config, state, args.data_path, args.calib_batches, args.calib_tokens,
                                                   args.seq_len)
        head.append(f"GPTQ calibration: {args.calib_batches} train batches x {args.calib_tokens} tokens, {len(hessians)} "
                    f"Hessians, {calib_seconds:.1f} s (CPU)")
    if getattr(args, "techniques", None) or budget:  # the technique / equal-bytes tables alone
        lines = head
        if getattr(args, "techniques", None):
            policies = {f"blocks int{b}, embed int{e}": dict(attn_bits=int(b), mlp_bits=int(b), embed_bits=int(e))
                        for b, e in (p.split("/") for p in args.techniques.split(","))}
            rows = technique_rows(state, config, score, policies, args.compressor, hessians if gptq else None)
            lines += ["", f"Techniques (QUANT_FIT off, full GPTQ {'on' if gptq else 'off'}; d val_bpb = roundtrip - "
                          "prequant):", ""] + technique_table(rows, num_params, base_bpb)
        if budget:
            rows = budget_rows(state, config, score, hessians, budget, args.compressor)
            lines += ["", "Equal bytes (QUANT_FIT=1 from int8 to budget x params bytes, full GPTQ; d val_bpb = roundtrip - "
                          "prequant):", ""] + budget_table(rows, num_params, base_bpb)
        return "\n".join(lines)
    lines = head + [
        "",
        "Frontier (block matrices at `bits`, embedding int8; bytes = smallest encoding):",
        "",
        "| bits | method | bytes | bits/param | d val_bpb | rel_mse | encoding | seconds |",
        "|---:|---|---:|---:|---:|---:|---|---:|",
    ]
    rows = frontier_rows(state, config, hessians, score, args.bits, args.compressor)
    for r in rows:
        lines.append(f"| {r['bits']} | {r['method']} | {r['bytes']:,} | {8 * r['bytes'] / num_params:.3f} | "
                     f"{r['val_bpb'] - base_bpb:+.5f} | {r['rel_mse']:.2e} | {r['encoding']} | {r['seconds']:.1f} |")
    by = {(r["bits"], r["method"]): r["val_bpb"] - base_bpb for r in rows}
    if (5, "full GPTQ") in by:
        lite, full = by[5, "GPTQ-lite"], by[5, "full GPTQ"]
        ratio = full / lite if lite > 0 else float("nan")
        lines += ["", f"int5 check: full GPTQ d val_bpb {full:+.5f} / GPTQ-lite {lite:+.5f} = {ratio:.2f} "
                      f"({'PASS' if ratio <= 0.7 else 'FAIL'}: target <= 0.70)"]
    off_bytes, off_state = official_int8_zlib(state)
    comp = compressor_rows(state, config)
    lzma9 = min(r["bytes"] for r in comp if r["compressor"] == "lzma")
    lines += ["", "Compressors (attn/mlp int6, embedding int8, GPTQ-lite; seconds on a shared, loaded CPU):", "",
              "| packing | shuffle | compressor | bytes | vs best lzma | seconds |", "|---|---|---|---:|---:|---:|",
              f"| official torch.save int8 | - | zlib-9 | {off_bytes:,} | {off_bytes - lzma9:+,} | |"]
    best = min(r["bytes"] for r in comp)
    for r in comp:
        lines.append(f"| {r['packing']} | {'on' if r['shuffle'] else 'off'} | {r['compressor']}"
                     f"{' **(auto)**' if r['bytes'] == best else ''} | {r['bytes']:,} | {r['bytes'] - lzma9:+,} | "
                     f"{r['seconds']:.1f} |")
    lines.append(f"(official baseline d val_bpb {score(off_state) - base_bpb:+.5f})")
    return "\n".join(lines)


def run_calibration() -> str:
    """Compressed bits per value of Gaussian rows (GPTQ-lite, int8 containers, each compressor)."""
    torch.manual_seed(0)
    lines = ["| bits | row length | " + " | ".join(QUANT_COMPRESSORS) + " |", "|---:|---:|" + "---:|" * len(QUANT_COMPRESSORS)]
    for bits in range(2, 9):
        for row_len in (512, 2048):
            w = torch.randn(2_000_000 // row_len, row_len)
            q = gptq_lite_quantize(w, bits)[0].numpy().tobytes()
            bpv = [8 * len(quant_compress(q, c)) / len(q) for c in QUANT_COMPRESSORS]
            lines.append(f"| {bits} | {row_len} | " + " | ".join(f"{b:.3f}" for b in bpv) + " |")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.calibrate:
        text = run_calibration()
    else:
        if not (args.checkpoint and args.data_path and args.tokenizer):
            parser.error("checkpoint, --data-path and --tokenizer are required (or --calibrate)")
        try:
            args.bits = [int(b) for b in args.bits.split(",")]
            args.budget = [float(b) for b in args.budget.split(",")] if args.budget else []
            if not all(0 < b < 8 for b in args.budget):
                raise ValueError
            pairs = [p.split("/") for p in (args.techniques or "8/8").split(",")]
            if any(len(p) != 2 or not all(x.isdigit() and 2 <= int(x) <= 8 for x in p) for p in pairs):
                raise ValueError
            if not all(2 <= b <= 8 for b in args.bits) or min(args.val_tokens, args.calib_batches, args.calib_tokens) < 1 \
                    or args.calib_tokens % args.seq_len:
                raise ValueError
        except ValueError:
            parser.error(f"--bits {args.bits!r} / --techniques {args.techniques!r} / --budget {args.budget!r}: expected "
                         "integers in 2..8 (--techniques: BLOCK/EMBED pairs); --budget bytes/param in (0, 8); counts >= 1; "
                         "--calib-tokens a multiple of --seq-len")
        text = run_bench(args)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
