"""The measured differences of every parity stage against PR #1855's script (docs/parity.md's table):

    python -m tools.parity.parity_report

CPU, float32, PRESET=8xh100-pr1855 at parity_models.TOY_ENV's widths. Exits 2 with one line when the
record's folder is missing.
"""

import contextlib
import sys

import torch

from primitives.cli_errors import USER_ERRORS, check_file, report_user_error
from tools.parity.parity_config import log_mismatches, read_log_hyperparameters
from tools.parity.parity_models import (PR1855_SCRIPT, compare_forward, kit_model, packed_batch, record_model,
                                        toy_settings)
from tools.parity.parity_train import batch_backwards, bf16_lifted, compare_steps, gradient_backwards
from tools.parity.standins import import_script

DOC_STARTS = ([0, 10, 30, 31, 50], [5, 40])


def main() -> int:
    try:
        check_file("record script", PR1855_SCRIPT, "PR #1855's train_gpt.py (the shared reference/pr1855 folder)")
    except USER_ERRORS as err:
        return report_user_error(err)
    module = import_script(PR1855_SCRIPT)
    from primitives.settings import Hyperparameters

    full = Hyperparameters.from_env({"PRESET": "8xh100-pr1855"}, log=lambda *_: None)
    bad = log_mismatches(read_log_hyperparameters(PR1855_SCRIPT.parent / "train_seed42.log"), full)
    print(f"config: {len(bad)} mismatches against train_seed42.log" + "".join(f"\n  {b}" for b in bad))
    hp = toy_settings()
    kit = kit_model(hp)
    record = record_model(module, kit, hp)
    x, y = packed_batch(2, hp.train_seq_len, hp.vocab_size, DOC_STARTS)
    for looping in (False, True):
        d = compare_forward(module, kit, record, x, y, looping)
        print(f"forward looping={'on' if looping else 'off'}: logits max|diff| {d['logits']:.2e}, "
              f"loss |diff| {d['loss']:.2e}, gradients max rel {d['grad']:.2e}")
    six = {"ITERATIONS": "6", "MAX_WALLCLOCK_SECONDS": "0"}
    for label, env, from_batches, lift in (("same gradients, no clipping", {"GRAD_CLIP_NORM": "0"}, False, False),
                                           ("model gradients, float32, bf16 lifted", {}, True, True),
                                           ("model gradients, bf16 (a measurement)", {}, True, False)):
        hp = toy_settings(**six, **env)
        kit = kit_model(hp, noise=0.05)
        record = record_model(module, kit, hp)
        if from_batches:
            batches = [packed_batch(2, hp.train_seq_len, hp.vocab_size, DOC_STARTS, seed=s) for s in range(6)]
            backwards = batch_backwards(module, kit, record, batches)
        else:
            gen = torch.Generator().manual_seed(1)
            grads = [{n: torch.randn(p.shape, generator=gen) * 0.05 for n, p in kit.named_parameters()} for _ in range(6)]
            backwards = gradient_backwards(kit, record, grads)
        with bf16_lifted() if lift else contextlib.nullcontext():
            rows = compare_steps(module, kit, record, hp, backwards)
        print(f"6 steps, {label}: params max rel per step " + " ".join(f"{r['params']:.1e}" for r in rows)
              + f"; EMA {max(r['ema'] for r in rows):.1e}; loop on from step "
              + str(next(r['step'] for r in rows if r['looping'])))
    quant_report(module)
    return 0


def quant_report(module) -> None:
    """The quantization rows of docs/parity.md (tools/parity/parity_quant.py)."""
    from tools.parity.parity_quant import (TOY_STATE_SHAPES, compare_gate_rows, compare_gptq, compare_hessians,
                                           compare_lqer, compare_state_dict, record_quant_hparams)

    for dead, records in ((0, False), (3, False), (3, True)):
        rows = compare_gptq(module, dead=dead, records=records)
        print(f"GPTQ on a given H, {dead} dead inputs{', QUANT_GPTQ_RECORDS=1' * records}: "
              + ", ".join(f"{r['shape']} int{r['bits']} {r['codes']} codes, max|diff| {r['max_abs']:.1e}" for r in rows))
    print("gate rows int8: " + ", ".join(f"{s} max|diff| {d['max_abs']:.1e}" for s, d in compare_gate_rows(module).items()))
    print("LQER on one error: " + ", ".join(f"{k} {v:.3g}" for k, v in compare_lqer(module).items()))
    h = record_quant_hparams(PR1855_SCRIPT.parent / "train_seed42.log")
    shapes = {n: s for n, s in TOY_STATE_SHAPES.items() if ".c_k." not in n}
    for records, lqer, sh in ((False, False, TOY_STATE_SHAPES), (False, True, TOY_STATE_SHAPES), (True, True, shapes)):
        for seed in range(4):
            d = compare_state_dict(module, h, lqer, seed, records, sh)
            print(f"state dict, LQER {'on' if lqer else 'off'}{', record settings' * records}, draw {seed}: "
                  + ", ".join(f"{n} {v[0]} / {v[1]} {v[2]:.1e}" for n, v in d.items()))
    hp = toy_settings()
    kit = kit_model(hp)
    record = record_model(module, kit, hp)
    for looping in (False, True):
        kit.looping_active = record.looping_active = looping
        for starts in (([0], [0]), DOC_STARTS):
            d = compare_hessians(module, kit, record, *packed_batch(2, hp.train_seq_len, hp.vocab_size, starts))
            print(f"Hessians, looping {'on' if looping else 'off'}, documents at {starts}: max rel "
                  f"{max(v for k, v in d.items() if not k.startswith('only')):.1e} over {len(d) - 2} names")


if __name__ == "__main__":
    sys.exit(main())
