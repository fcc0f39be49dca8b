"""Training throughput benchmark: measured CPU tokens/s for the smoke config, and per preset the
FLOPs per token (torch.utils.flop_counter) with the projected H100 step time and tokens in 600 s.

    python tools/bench_train.py [--steps 5] [--mfu 0.4]

The projection is arithmetic, not a measurement: step_ms = tokens_per_step * flops_per_token /
(989 TFLOP/s * MFU * num_gpus). Prints one table.
"""

import argparse
import sys
import time
from pathlib import Path


def build_parser() -> argparse.ArgumentParser:
    """The command line, built without torch: `--help` and usage errors answer at once."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=5, help="timed CPU steps for the smoke config")
    parser.add_argument("--mfu", type=float, default=0.4, help="assumed model FLOPs utilization on H100")
    return parser


if __name__ == "__main__":  # --help and usage errors answer before torch is imported
    build_parser().parse_args()

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from trainer.loop import H100_BF16_PEAK_FLOPS  # noqa: E402

from model.gpt import GPT, build_model_config, count_train_flops_per_token  # noqa: E402

from trainer.optim import build_optimizers  # noqa: E402

from primitives.presets import PRESETS  # noqa: E402

from primitives.settings import Hyperparameters  # noqa: E402


def measure_cpu_tokens_per_second(hp: Hyperparameters, steps: int) -> float:
    """Full optimizer steps (forward, backward, Muon + AdamW) on random tokens, after one warm step."""
    torch.manual_seed(0)
    model = GPT(**build_model_config(hp))
    model.init_weights()
    optimizers = build_optimizers(model, hp, is_cuda=False)
    batch = hp.train_batch_tokens // hp.train_seq_len
    x = torch.randint(0, hp.vocab_size, (batch, hp.train_seq_len))
    for i in range(steps + 1):
        if i == 1:
            start = time.perf_counter()
        model(x, x).backward()
        for opt in optimizers.all:
            opt.step()
        model.zero_grad(set_to_none=True)
    return steps * hp.train_batch_tokens / (time.perf_counter() - start)


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)

    rows = []
    for preset in PRESETS:
        hp = Hyperparameters.from_env({"PRESET": preset}, log=lambda *_: None)
        gpus = 8 if preset == "8xh100" else 1
        flops = count_train_flops_per_token(build_model_config(hp), hp.train_seq_len)
        step_ms = 1000 * hp.train_batch_tokens * flops / (H100_BF16_PEAK_FLOPS * args.mfu * gpus)
        params = sum(p.numel() for p in GPT(**build_model_config(hp)).parameters())
        rows.append((preset, params, flops, hp.train_batch_tokens, gpus, step_ms, 600_000 / step_ms,
                     600_000 / step_ms * hp.train_batch_tokens))
    print(f"{'preset':14} {'params':>11} {'GFLOP/tok':>10} {'tok/step':>9} {'GPUs':>4} "
          f"{'step_ms@' + format(args.mfu, '.0%'):>11} {'steps/600s':>10} {'tokens/600s':>12}")
    for preset, params, flops, tps, gpus, step_ms, steps, tokens in rows:
        print(f"{preset:14} {params:>11,} {flops / 1e9:>10.3f} {tps:>9,} {gpus:>4} {step_ms:>11.1f} "
              f"{steps:>10.0f} {tokens / 1e9:>11.2f}B")
    smoke = Hyperparameters.from_env({"PRESET": "smoke"}, log=lambda *_: None)
    tok_s = measure_cpu_tokens_per_second(smoke, args.steps)
    print(f"\nsmoke on this CPU ({torch.get_num_threads()} threads): {tok_s:,.0f} tok/s measured, "
          f"{tok_s * count_train_flops_per_token(build_model_config(smoke), smoke.train_seq_len) / 1e9:.1f} "
          f"GFLOP/s achieved, {smoke.train_batch_tokens / tok_s * 1000:.0f} ms/step")
    return 0


if __name__ == "__main__":
    sys.exit(main())
