"""Muon benchmark: torch.optim.Muon (eager, one matrix at a time) vs the kit's batched Muon, on the
block matrices of a preset (default 1xh100: 8 layers x c_q, c_k, c_v, proj 512-wide, MLP 3x = 48
matrices in 4 shapes), on this machine's CPU.

    python tools/bench_muon.py [--preset 1xh100] [--layers N] [--steps 2] [--compile] [--scale K]

Prints one table: ms per optimizer step (after one warm step) and the ops each step launches,
counted with torch.profiler as leaf aten ops that compute (views and allocations excluded) and
foreach ops counted once each: on a GPU each is about one kernel launch. --compile adds the batched Muon with its Newton-Schulz
compiled by Inductor (CPU compile takes minutes; on CUDA the trainer compiles it). The parameter
values of both optimizers stay equal (checked at the end), so the rows time the same update.
Timings need a quiet machine: never run it beside other work. bf16 matmuls are slow on most CPUs
(minutes per step at the real shapes): --scale K divides every matrix dimension by K, which keeps
the number of matrices and shape groups, hence the op counts, and makes the run quick.
"""

import argparse
import sys
import time
from pathlib import Path


def build_parser() -> argparse.ArgumentParser:
    """The command line, built without torch: `--help` and usage errors answer at once."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="1xh100")
    parser.add_argument("--layers", type=int, default=0, help="override NUM_LAYERS (0: the preset's)")
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--compile", action="store_true")
    parser.add_argument("--scale", type=int, default=1, help="divide every matrix dimension by this")
    return parser


if __name__ == "__main__":  # --help and usage errors answer before torch is imported
    build_parser().parse_args()

import torch  # noqa: E402
from torch.profiler import ProfilerActivity, profile  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from model.gpt import GPT, build_model_config  # noqa: E402

from trainer.optim import Muon, split_params  # noqa: E402

from primitives.settings import Hyperparameters  # noqa: E402

NON_COMPUTE_OPS = {"aten::view", "aten::t", "aten::transpose", "aten::as_strided", "aten::empty", "aten::unbind",
                   "aten::select", "aten::expand", "aten::reshape", "aten::alias", "aten::detach", "aten::empty_strided",
                   "aten::_reshape_alias", "aten::lift_fresh", "aten::numpy_T", "aten::permute", "aten::slice",
                   "aten::resolve_conj", "aten::resolve_neg", "aten::result_type", "aten::_to_copy"}


def block_matrices(preset: str, num_layers: int) -> list:
    """Shapes of the Muon-optimized matrices of `preset` with `num_layers` layers."""
    layers = {"NUM_LAYERS": str(num_layers), "XSA_LAST_N": "0"} if num_layers else {}
    hp = Hyperparameters.from_env({"PRESET": preset, **layers},
                                  log=lambda *_: None)
    with torch.device("meta"):
        model = GPT(**build_model_config(hp))
    params = dict(model.named_parameters())
    return [tuple(params[n].shape) for n in split_params(model)["muon"]]


def count_compute_ops(step) -> int:
    """Leaf aten ops that compute, with each aten::_foreach_* op counted once: on CUDA a foreach op is a
    multi-tensor kernel (one launch per chunk of tensors), on the CPU it loops over per-tensor ops."""
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        step()

    def in_foreach(e):
        while (e := e.cpu_parent) is not None:
            if e.name.startswith("aten::_foreach_"):
                return True
        return False

    return sum(1 for e in prof.events() if e.name.startswith("aten::") and not in_foreach(e) and (
        e.name.startswith("aten::_foreach_") or not e.cpu_children and e.name not in NON_COMPUTE_OPS))


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    shapes = [(r // args.scale, c // args.scale) for r, c in block_matrices(args.preset, args.layers)]
    torch.manual_seed(0)
    init = [torch.randn(*s) * 0.02 for s in shapes]
    grads = [torch.randn(*s) for s in shapes]
    variants = [("torch.optim.Muon", lambda ps: torch.optim.Muon(ps, lr=0.032, momentum=0.95, weight_decay=0.02,
                                                                  adjust_lr_fn="original")),
                ("batched Muon (eager)", lambda ps: Muon(ps, lr=0.032, momentum=0.95, weight_decay=0.02))]
    if args.compile:
        variants.append(("batched Muon (compiled NS)", lambda ps: Muon(ps, lr=0.032, momentum=0.95, weight_decay=0.02,
                                                                        compile=True)))
    rows, finals = [], []
    for name, make in variants:
        params = [torch.nn.Parameter(w.clone()) for w in init]
        for p, g in zip(params, grads):
            p.grad = g
        opt = make(params)
        opt.step()  # warm (and compile)
        ops = count_compute_ops(opt.step)
        start = time.perf_counter()
        for _ in range(args.steps):
            opt.step()
        rows.append((name, 1000 * (time.perf_counter() - start) / args.steps, ops))
        finals.append(params)
    print(f"{args.preset}: {len(shapes)} matrices in {len(set(shapes))} shapes (dims / {args.scale}), "
          f"{torch.get_num_threads()} CPU threads")
    print(f"{'optimizer':28} {'ms/step':>10} {'ops/step':>9}")
    for name, ms, ops in rows:
        print(f"{name:28} {ms:>10.1f} {ops:>9}")
    worst = max((a - b).abs().max().item() for ps in finals[1:] for a, b in zip(finals[0], ps))
    print(f"max |param difference| vs torch.optim.Muon after {args.steps + 2} steps: {worst:.2e}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
