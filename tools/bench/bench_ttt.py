"""Score-first TTT on the CPU proxy: val_bpb with and without TTT per setting and seed, and the
projected time of each setting on one H100 for the full sp8192 val split.

  python tools/bench_ttt.py --runs runs/A runs/B --data-path data/datasets/proxy_tune_sp1024 \
      --tokenizer data/tokenizers/fineweb_1024_bpe.model [--val-max-tokens 65536] \
      [--setting NAME:params=all,lr=0.002,epochs=3,chunk=8192 ...] [--out ttt_bench.jsonl]

1. For each run folder (a trainer run: runs/<RUN_ID>/final_model.ptz), the artifact is rebuilt
   from disk as the trainer's final eval does; the sliding eval at the artifact's stride gives the
   no-TTT score; each setting then runs the chunked TTT mode (eval.ttt_modes.run_mode) on a fresh copy of the dequantized
   weights. One JSON line per (run, setting) is appended to --out as soon as it is measured
   (bpb, delta to the sliding score, CPU wall seconds, updates, per-chunk bpb).
2. H100 projection (`--project`, printed after the table): the `1xh100-sp8192` preset's model
   over 40.5 M val tokens, from the kit's measurements on one H100 (2026-11-25): the
   sliding eval at stride 64 projects to 320 s (gpu_check), training runs at 1.27 M tokens/s
   fwd+bwd. eval.ttt.project_ttt_seconds turns them into scoring batches and update steps; an
   update that adapts only some parameters costs the fwd+bwd FLOPs with only those requiring grad
   (torch.utils.flop_counter on the meta device) over the full fwd+bwd FLOPs
   (train_gpt.count_train_flops_per_token's method) times the all-parameter step.
"""

import argparse
import json
import sys
import time
from pathlib import Path

DEFAULT_SETTINGS = (
    "all_lr002_e3:params=all,lr=0.002,epochs=3,chunk=8192",
    "all_lr01_e3:params=all,lr=0.01,epochs=3,chunk=8192",
    "all_lr01_e1:params=all,lr=0.01,epochs=1,chunk=8192",
    "scalars_lr01_e3:params=scalars,lr=0.01,epochs=3,chunk=8192",
)


def build_parser() -> argparse.ArgumentParser:
    """The command line, built without torch: `--help` and usage errors answer at once."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--runs", nargs="*", default=[])
    p.add_argument("--data-path")
    p.add_argument("--tokenizer")
    p.add_argument("--val-max-tokens", type=int, default=65536)
    p.add_argument("--stride", type=int, default=0, help="default: the artifact's")
    p.add_argument("--setting", action="append",
                   help=f"NAME:params=...,lr=...,epochs=...,chunk=...,batch=... (default {DEFAULT_SETTINGS})")
    p.add_argument("--out", default="ttt_bench.jsonl")
    p.add_argument("--project", action="store_true", help="print the H100 projection of each setting")
    return p


if __name__ == "__main__":  # --help and usage errors answer before torch is imported
    build_parser().parse_args()

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from eval.offline import load_sentencepiece_luts  # noqa: E402
from shards.format import load_validation_tokens  # noqa: E402
from eval.sliding import count_sliding_windows, eval_sliding  # noqa: E402
from eval.ttt import project_ttt_seconds, select_ttt_params  # noqa: E402
from eval.ttt_modes import run_mode  # noqa: E402

H100_SLIDING_SECONDS = 320.0  # stride 64, 40.5 M sp8192 val tokens, 1xh100-sp8192 (one H100, gpu_check)
H100_TRAIN_TOKENS_PER_SECOND = 1.27e6
H100_VAL_TOKENS = 40_500_000
H100_CHUNK_TOKENS = 32768  # the records' chunk (PR #549, #1493)


def parse_setting(text: str) -> tuple:
    """'NAME:params=all,lr=0.002,epochs=3,chunk=8192' -> (NAME, settings of the chunked TTT mode, epochs included)."""
    name, _, body = text.partition(":")
    kv = dict(item.split("=", 1) for item in body.split(",") if item)
    return name, dict(params=kv.get("params", "all"), lr=float(kv.get("lr", 0.002)), epochs=int(kv.get("epochs", 3)),
                      chunk_tokens=int(kv.get("chunk", 32768)), batch_seqs=int(kv.get("batch", 8)))


def load_model(artifact_path: Path):
    from quant.artifact import load_artifact
    from model.gpt import GPT

    state, config, meta = load_artifact(artifact_path)
    model = GPT(**config)
    model.load_state_dict(state, strict=False)
    return model.eval(), config, meta


def update_flops_ratio(config: dict, seq_len: int, params: str) -> float:
    """fwd+bwd FLOPs with only `params` (select_ttt_params) requiring grad / with all of them."""
    from torch.utils.flop_counter import FlopCounterMode

    from model.gpt import GPT

    flops = []
    for which in ("all", params):
        with torch.device("meta"):
            model = GPT(**config)
            x = torch.zeros((1, seq_len), dtype=torch.int64)
        chosen = {id(p) for p in select_ttt_params(model, which)}
        for p in model.parameters():
            p.requires_grad_(id(p) in chosen)
        with FlopCounterMode(display=False) as counter:
            model(x, x).backward()
        flops.append(counter.get_total_flops())
    return flops[1] / flops[0]


def project_h100(settings: list, log=print) -> list:
    """Projected seconds on one H100 per setting (see the module docstring); rows of dicts."""
    from model.gpt import build_model_config
    from primitives.settings import Hyperparameters

    hp = Hyperparameters.from_env({"PRESET": "1xh100-sp8192"}, log=lambda m: None)
    config, seq_len, b = build_model_config(hp), hp.train_seq_len, hp.eval_batch_seqs
    forward_seconds = H100_SLIDING_SECONDS / -(-count_sliding_windows(H100_VAL_TOKENS - 1, seq_len, 64) // b)
    roundtrip_seconds = forward_seconds * -(-count_sliding_windows(H100_VAL_TOKENS - 1, seq_len, seq_len) // b)
    rows = []
    for name, s in settings:
        batch_seqs = min(32, H100_CHUNK_TOKENS // seq_len)  # as the chunked mode: one step per chunk and epoch at 32K / 2048
        ratio = update_flops_ratio(config, seq_len, s["params"])
        train_seconds = ratio * batch_seqs * seq_len / H100_TRAIN_TOKENS_PER_SECOND
        common = dict(forward_seconds=forward_seconds, train_seconds=train_seconds, num_val_tokens=H100_VAL_TOKENS,
                      seq_len=seq_len, stride=64, chunk_tokens=H100_CHUNK_TOKENS, eval_batch_seqs=b, batch_seqs=batch_seqs)
        score = project_ttt_seconds(epochs=0, **common)
        total = project_ttt_seconds(epochs=s["epochs"], **common)
        rows.append(dict(setting=name, update_flops_ratio=ratio, roundtrip_seconds=roundtrip_seconds,
                         score_seconds=score, update_seconds=total - score, total_seconds=roundtrip_seconds + total))
        log(f"h100 {name}: params={s['params']} epochs={s['epochs']} update/fwd+bwd FLOPs {ratio:.2f}: roundtrip "
            f"{roundtrip_seconds:.0f}s + TTT scoring {score:.0f}s + updates {total - score:.0f}s = "
            f"{roundtrip_seconds + total:.0f}s of 600s")
    return rows


def main(argv=None) -> int:
    p = build_parser()
    args = p.parse_args(argv)
    settings = [parse_setting(s) for s in args.setting or DEFAULT_SETTINGS]
    quiet = lambda m: None

    def emit(row: dict) -> None:
        print(json.dumps(row), flush=True)
        with open(args.out, "a", encoding="utf-8") as f:
            f.write(json.dumps(row) + "\n")

    for run in map(Path, args.runs):
        model, config, meta = load_model(run / "final_model.ptz")
        seq_len, stride = meta["run"]["train_seq_len"], args.stride or meta["run"]["eval_stride"]
        luts = load_sentencepiece_luts(args.tokenizer, config["vocab_size"])
        tokens = load_validation_tokens(args.data_path, config["vocab_size"])[: args.val_max_tokens + 1]
        t0 = time.perf_counter()
        ref = eval_sliding(model, tokens, luts, seq_len=seq_len, stride=stride, batch_seqs=32, device="cpu", log=quiet,
                           max_seconds=1e9)
        base = dict(run=str(run), setting="sliding", val_bpb=ref["val_bpb"], val_loss=ref["val_loss"], delta_bpb=0.0,
                    seconds=time.perf_counter() - t0, stride=stride, num_tokens=len(tokens))
        emit(base)
        for name, s in settings:
            model, _, _ = load_model(run / "final_model.ptz")  # fresh dequantized weights per setting
            t0 = time.perf_counter()
            res = run_mode("chunked", model, tokens, luts, seq_len=seq_len, stride=stride, eval_batch_seqs=32,
                           max_seconds=1e9, log=quiet, **s)
            row = dict(run=str(run), setting=name, **s, val_bpb=res["val_bpb"], val_loss=res["val_loss"],
                       delta_bpb=res["val_bpb"] - ref["val_bpb"], seconds=time.perf_counter() - t0, stride=stride,
                       num_tokens=len(tokens), num_chunks=res["num_chunks"], num_updates=res["num_updates"],
                       chunk_bpb=[round(c["val_bpb"], 4) for c in res["chunks"]])
            emit(row)
    if args.project:
        project_h100(settings)
    return 0


if __name__ == "__main__":
    sys.exit(main())
