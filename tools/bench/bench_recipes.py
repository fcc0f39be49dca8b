"""Per-step CPU time of recipes side by side: training steps of each configuration interleaved step
by step in one process, so that on a shared machine every configuration sees the same load.

    python tools/bench_recipes.py --steps 8 --set PRESET=smoke NUM_THREADS=1 \\
        --config B MLP_MULT=2 XSA_LAST_N=0 ROPE_DIMS=64 EMA_DECAY=0 QAT_START_FRAC=0 GRAD_CLIP_NORM=0 \\
        --config smoke

A step is the trainer's: forward and backward on random tokens of the config's shape, grad clip
(GRAD_CLIP_NORM), Muon + AdamW, the EMA update (when EMA is on), with late QAT's fake quantization
on for the last QAT_START_FRAC of the timed steps, as in a run. One untimed step first. Prints one
table: median and min ms per step, tokens/s, and each config's median relative to the first.
Timings on a machine shared with other jobs say how two recipes compare at that moment, not what a
quiet machine does.
"""

import argparse
import statistics
import sys
import time
from pathlib import Path


def build_parser() -> argparse.ArgumentParser:
    """The command line, built without torch: `--help` and usage errors answer at once."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=8, help="timed steps per config (default 8)")
    p.add_argument("--set", nargs="+", default=[], metavar="NAME=VALUE", help="env vars of every config")
    p.add_argument("--config", nargs="+", action="append", required=True, metavar=("NAME", "NAME=VALUE"),
                   help="a configuration: its name, then its env vars (repeat for each)")
    return p


if __name__ == "__main__":  # --help and usage errors answer before torch is imported
    build_parser().parse_args()

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from quant.policy import QuantPolicy  # noqa: E402
from tools.sweeps.sweep_spec import parse_assignments  # noqa: E402
from primitives.settings import warn_unknown_settings  # noqa: E402
from model.gpt import GPT, build_model_config  # noqa: E402
from trainer.optim import build_optimizers  # noqa: E402
from trainer.schedule import EMA  # noqa: E402
from primitives.settings import Hyperparameters  # noqa: E402


class Recipe:
    """One configuration's model, optimizers and EMA, stepped on random tokens."""

    def __init__(self, name: str, env: dict):
        self.name = name
        unknown = warn_unknown_settings(env, log=lambda *_: None)
        if unknown:  # a typo would time the default instead of the recipe
            raise ValueError(f"--config {name}: {unknown} are not settings of train_gpt.py")
        self.hp = Hyperparameters.from_env(env, log=lambda *_: None)
        torch.manual_seed(self.hp.seed)
        self.model = GPT(**build_model_config(self.hp))
        self.model.init_weights()
        self.model.configure_qat(QuantPolicy.from_env(env))
        self.optimizers = build_optimizers(self.model, self.hp, is_cuda=False)
        self.ema = EMA(self.model, self.hp.ema_warmup) if self.hp.ema_decay or self.hp.ema_horizon_frac else None
        batch = self.hp.train_batch_tokens // self.hp.train_seq_len
        self.x = torch.randint(0, self.hp.vocab_size, (batch, self.hp.train_seq_len + 1))
        self.seconds = []

    def step(self, qat: bool) -> float:
        self.model.set_qat(qat and self.hp.qat_start_frac > 0)
        start = time.perf_counter()
        self.model(self.x[:, :-1], self.x[:, 1:]).backward()
        if self.hp.grad_clip_norm > 0:
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.hp.grad_clip_norm)
        for opt in self.optimizers.all:
            opt.step()
        self.model.zero_grad(set_to_none=True)
        if self.ema:
            self.ema.update(0.99)
        return time.perf_counter() - start


def main(argv=None) -> int:
    p = build_parser()
    args = p.parse_args(argv)
    try:
        if args.steps < 1:
            raise ValueError(f"--steps {args.steps}: expected >= 1")
        shared = parse_assignments(args.set, "--set")
        recipes = [Recipe(name, {**shared, **parse_assignments(items, f"--config {name}")})
                   for name, *items in args.config]
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    threads = recipes[0].hp.num_threads or torch.get_num_threads()
    torch.set_num_threads(threads)
    for r in recipes:
        r.step(qat=False)  # untimed: allocations, first-call overheads
    for i in range(args.steps):
        for r in recipes:
            r.seconds.append(r.step(qat=i >= args.steps * (1 - r.hp.qat_start_frac)))
    base = statistics.median(recipes[0].seconds)
    print(f"{args.steps} steps per config, interleaved, {threads} thread(s)")
    print(f"{'config':12} {'ms/step med':>12} {'min':>9} {'tok/s':>8} {'vs ' + recipes[0].name:>10}")
    for r in recipes:
        med = statistics.median(r.seconds)
        print(f"{r.name:12} {1000 * med:>12.0f} {1000 * min(r.seconds):>9.0f} "
              f"{r.hp.train_batch_tokens / med:>8.0f} {med / base:>10.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
