"""Benchmark of the sliding-window eval: measured on this CPU, projected for one H100.

  python tools/bench_eval.py [--num-tokens 4096] [--batch-seqs 32] [--stride 64] [--mfu 0.4]

1. CPU: scored tokens per second of `eval.sliding.eval_sliding` (batched windows) against a
   one-window-at-a-time loop, on the smoke-sized model (4 layers, d 256, 4 heads, seq 256,
   vocab 1024; `trainer_model.GPT` when importable, else a plain stand-in GPT) over a random stream.
2. H100 projection: FLOPs of one forward of a seq-2048 window of the 1xh100 model (8 layers,
   d 512, 8 heads, 4 kv heads, MLP 3x, vocab 1024) from torch.utils.flop_counter.FlopCounterMode
   on the meta device, times the number of windows of the exact sliding set over the official
   sp1024 val split (62,021,846 tokens), at `--mfu` of the 989 TFLOP/s bf16 dense peak.
   FlopCounterMode counts attention as a full T x T product; a causal flash kernel skips the
   masked half of the tiles, so the table shows both the dense count and the causal one
   (attention FLOPs halved). Target: <= 300 s for stride 64.
"""

import argparse
import math
import sys
import time
from pathlib import Path


def build_parser() -> argparse.ArgumentParser:
    """The command line, built without torch: `--help` and usage errors answer at once."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num-tokens", type=int, default=4096)
    parser.add_argument("--batch-seqs", type=int, default=32)
    parser.add_argument("--stride", type=int, default=64)
    parser.add_argument("--mfu", type=float, default=0.4)
    parser.add_argument("--skip-cpu", action="store_true")
    return parser


if __name__ == "__main__":  # --help and usage errors answer before torch is imported
    build_parser().parse_args()

import torch  # noqa: E402
import torch.nn as nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch.utils.flop_counter import FlopCounterMode  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from eval.sliding import count_sliding_windows, eval_sliding, plan_sliding_windows  # noqa: E402

H100_BF16_PEAK_FLOPS = 989e12
OFFICIAL_VAL_TOKENS = 62_021_846
SMOKE_CONFIG = dict(vocab_size=1024, num_layers=4, model_dim=256, num_heads=4, num_kv_heads=2, mlp_mult=3,
                    rope_dims=32, xsa_last_n=1)
H100_CONFIG = dict(vocab_size=1024, num_layers=8, model_dim=512, num_heads=8, num_kv_heads=4, mlp_mult=3,
                   rope_dims=32, xsa_last_n=2)


class StandInGPT(nn.Module):
    """Plain pre-norm GQA transformer with relu^2 MLP and tied head (used when train_gpt is absent)."""

    def __init__(self, *, vocab_size, num_layers, model_dim, num_heads, num_kv_heads, mlp_mult, **_):
        super().__init__()
        self.h, self.kv, self.d = num_heads, num_kv_heads, model_dim // num_heads
        self.emb = nn.Embedding(vocab_size, model_dim)
        hidden = int(mlp_mult * model_dim)
        self.layers = nn.ModuleList(
            nn.ModuleDict(dict(q=nn.Linear(model_dim, model_dim, bias=False),
                               kv=nn.Linear(model_dim, 2 * num_kv_heads * self.d, bias=False),
                               o=nn.Linear(model_dim, model_dim, bias=False),
                               fc=nn.Linear(model_dim, hidden, bias=False), proj=nn.Linear(hidden, model_dim, bias=False)))
            for _ in range(num_layers))

    def forward_logits(self, input_ids):
        b, t = input_ids.shape
        x = self.emb(input_ids)
        for layer in self.layers:
            h = F.rms_norm(x, (x.size(-1),))
            q = layer["q"](h).view(b, t, self.h, self.d).transpose(1, 2)
            k, v = layer["kv"](h).view(b, t, 2, self.kv, self.d).permute(2, 0, 3, 1, 4)
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
            x = x + layer["o"](y.transpose(1, 2).reshape(b, t, -1))
            x = x + layer["proj"](F.relu(layer["fc"](F.rms_norm(x, (x.size(-1),)))).square())
        return F.linear(F.rms_norm(x, (x.size(-1),)), self.emb.weight)


def build_model(config, device=None):
    try:
        from model.gpt import GPT

        name, cls = "trainer_model.GPT", GPT
    except ImportError:
        name, cls = "stand-in GPT", StandInGPT
    with torch.device(device or "cpu"):
        return name, cls(**config)


def one_window_at_a_time(model, tokens, seq_len, stride):
    """The naive loop the batched eval replaces: one forward per window, CE on its scored part."""
    num_targets = tokens.numel() - 1
    windows = torch.arange(count_sliding_windows(num_targets, seq_len, stride))
    index, score = plan_sliding_windows(num_targets, seq_len, stride, windows)
    nll = 0.0
    with torch.inference_mode():
        for row, mask in zip(index, score):
            row = row[row < num_targets]  # the real positions of this window
            logits = model.forward_logits(tokens[None, row])[0][mask[: row.numel()]]
            nll += F.cross_entropy(logits.float(), tokens[row + 1][mask[: row.numel()]], reduction="sum").item()
    return nll / (tokens.numel() - 1)


def bench_cpu(args, luts):
    torch.manual_seed(0)
    name, model = build_model(SMOKE_CONFIG)
    if hasattr(model, "init_weights"):
        model.init_weights()
    model.eval()
    tokens = torch.randint(0, 1024, (args.num_tokens + 1,), generator=torch.Generator().manual_seed(0))
    seq_len, num_windows = 256, count_sliding_windows(args.num_tokens, 256, args.stride)
    rows = []
    for label, fn in (
        (f"batched eval_sliding (B={args.batch_seqs})",
         lambda: eval_sliding(model, tokens, luts, seq_len=seq_len, stride=args.stride, batch_seqs=args.batch_seqs,
                              device="cpu", log=lambda m: None)["val_loss"]),
        ("one window at a time", lambda: one_window_at_a_time(model, tokens, seq_len, args.stride)),
    ):
        fn()  # warm-up
        t0 = time.perf_counter()
        loss = fn()
        seconds = time.perf_counter() - t0
        rows.append((label, seconds, args.num_tokens / seconds, num_windows * seq_len / seconds, loss))
    print(f"\nCPU sliding eval, {name} {SMOKE_CONFIG['num_layers']}L d{SMOKE_CONFIG['model_dim']} seq {seq_len} "
          f"stride {args.stride}, {args.num_tokens} targets, {num_windows} windows, {torch.get_num_threads()} threads")
    print(f"| {'method':<32} | {'seconds':>8} | {'scored tok/s':>12} | {'forward tok/s':>13} | {'val_loss':>9} |")
    print(f"|{'-' * 34}|{'-' * 10}|{'-' * 14}|{'-' * 15}|{'-' * 11}|")
    for label, seconds, scored, forward, loss in rows:
        print(f"| {label:<32} | {seconds:8.3f} | {scored:12.0f} | {forward:13.0f} | {loss:9.5f} |")
    print(f"speed-up of batching: {rows[1][1] / rows[0][1]:.2f}x (same loss: {abs(rows[0][4] - rows[1][4]) < 1e-4})")


def forward_flops(config, seq_len):
    """(name, total, attention, head) FLOPs of one forward_logits of a [1, seq_len] window (FlopCounterMode);
    head: the head's FLOPs per position (0 for a model without head_logits). The eval runs the head only on
    the positions it scores (eval.sliding.scoring_forward): window_flops."""
    name, model = build_model(config, "meta")
    x = torch.zeros((1, seq_len), dtype=torch.int64, device="meta")
    with FlopCounterMode(display=False) as counter:
        model.forward_logits(x)
    by_op = {str(k): v for k, v in counter.get_flop_counts()["Global"].items()}
    # Attention is the only batched matmul (q k^T and p v) in these models; sdpa kernels count as attention too.
    attention = sum(v for k, v in by_op.items() if "bmm" in k or "attention" in k)
    head = 0
    if hasattr(model, "head_logits"):
        with FlopCounterMode(display=False) as head_counter:
            model.head_logits(torch.zeros((1, 1, config["model_dim"]), device="meta"))
        head = head_counter.get_total_flops()
    return name, counter.get_total_flops(), attention, head


def window_flops(total, attention, head, seq_len, stride) -> float:
    """FLOPs of one scoring window, causal count (attention halved), the head on its `stride` scored positions."""
    return total - attention / 2 - head * (seq_len - min(stride, seq_len))


def bench_projection(args):
    seq_len, num_targets = 2048, OFFICIAL_VAL_TOKENS - 1
    name, total, attention, head = forward_flops(H100_CONFIG, seq_len)
    rate = H100_BF16_PEAK_FLOPS * args.mfu
    print(f"\nH100 projection, {name} 8L d512 8h/4kv MLP3x vocab 1024, seq {seq_len}, {OFFICIAL_VAL_TOKENS:,} val tokens, "
          f"{args.mfu:.0%} MFU of {H100_BF16_PEAK_FLOPS / 1e12:.0f} TFLOP/s")
    print(f"forward FLOPs/token: {total / seq_len / 1e6:.2f}M dense count ({attention / seq_len / 1e6:.2f}M attention), "
          f"{(total - attention / 2) / seq_len / 1e6:.2f}M causal")
    print(f"| {'stride':>6} | {'windows':>9} | {'forward tokens':>14} | {'dense s':>8} | {'causal s':>8} | {'<= 300 s':>8} |")
    print(f"|{'-' * 8}|{'-' * 11}|{'-' * 16}|{'-' * 10}|{'-' * 10}|{'-' * 10}|")
    for stride in (32, 64, 128, 256, 512, 2048):
        windows = count_sliding_windows(num_targets, seq_len, stride)
        causal = window_flops(total, attention, head, seq_len, stride)
        dense_s, causal_s = windows * (causal + attention / 2) / rate, windows * causal / rate
        print(f"| {stride:>6} | {windows:>9,} | {windows * seq_len:>14,} | {dense_s:8.1f} | {causal_s:8.1f} | "
              f"{'yes' if causal_s <= 300 else 'no':>8} |")


# Val split tokens per vocabulary: sp1024 the official export; sp4096 and sp8192 the
# kevclark/parameter-golf exports of the same 50,000 documents (PR #1617's logs, val_loader tokens).
VAL_TOKENS_BY_VOCAB = {1024: OFFICIAL_VAL_TOKENS, 4096: 45_508_608, 8192: 40_540_160}
PRESET_EVAL_MFU = 0.3  # each GPU preset's default stride must fit at this MFU


def preset_eval_projection(preset, mfu=PRESET_EVAL_MFU, strides=(64, 96, 128)):
    """Projected eval seconds of a GPU preset's model on its full val split at `mfu` of one H100 per GPU
    (causal count): {"roundtrip": s, stride: sliding s, ...}; the 8xh100 preset splits windows over 8 GPUs."""
    import model.gpt as trainer_model
    import primitives.settings as trainer_settings

    hp = trainer_settings.Hyperparameters.from_env({"PRESET": preset}, log=lambda *_: None)
    config, seq_len = trainer_model.build_model_config(hp), hp.train_seq_len
    _, total, attention, head = forward_flops(config, seq_len)
    rate = H100_BF16_PEAK_FLOPS * mfu * (8 if preset == "8xh100" else 1)
    num_targets = VAL_TOKENS_BY_VOCAB[hp.vocab_size] - 1
    out = {"roundtrip": math.ceil(num_targets / seq_len) * window_flops(total, attention, head, seq_len, seq_len) / rate}
    for stride in strides:
        out[stride] = (count_sliding_windows(num_targets, seq_len, stride)
                       * window_flops(total, attention, head, seq_len, stride) / rate)
    return hp, out


def bench_presets(mfu=PRESET_EVAL_MFU, budget_s=600.0):
    """One row per GPU preset: projected roundtrip + sliding eval seconds at strides 64/96/128, and the
    smallest of them whose roundtrip + sliding fits `budget_s` (what the preset's EVAL_STRIDE should be)."""
    import primitives.presets as trainer_presets

    print(f"\nPer preset, full val split, {mfu:.0%} MFU (causal count), roundtrip + sliding must fit {budget_s:.0f} s")
    print(f"| {'preset':<14} | {'val tokens':>10} | {'roundtrip s':>11} | {'s64 s':>6} | {'s96 s':>6} | {'s128 s':>6} | "
          f"{'fits at':>7} | {'EVAL_STRIDE':>11} |")
    print(f"|{'-' * 16}|{'-' * 12}|{'-' * 13}|{'-' * 8}|{'-' * 8}|{'-' * 8}|{'-' * 9}|{'-' * 13}|")
    for preset in trainer_presets.PRESETS:
        if preset == "smoke":
            continue
        hp, proj = preset_eval_projection(preset, mfu)
        fits = next((s for s in (64, 96, 128) if proj["roundtrip"] + proj[s] <= budget_s), None)
        print(f"| {preset:<14} | {VAL_TOKENS_BY_VOCAB[hp.vocab_size]:>10,} | {proj['roundtrip']:>11.1f} | {proj[64]:>6.0f} | "
              f"{proj[96]:>6.0f} | {proj[128]:>6.0f} | {fits or 'none':>7} | {hp.eval_stride:>11} |")


def main():
    parser = build_parser()
    args = parser.parse_args()
    # Byte LUT of a 1-byte-per-token vocabulary: the benchmark measures speed, not bytes.
    luts = (torch.ones(1024, dtype=torch.int16), torch.zeros(1024, dtype=torch.bool), torch.zeros(1024, dtype=torch.bool))
    if not args.skip_cpu:
        bench_cpu(args, luts)
    bench_projection(args)
    bench_presets()


if __name__ == "__main__":
    main()
