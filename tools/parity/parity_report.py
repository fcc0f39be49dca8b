"""The measured differences of every parity stage against PR #1855's script (docs/parity.md's table):

    python -m tools.parity.parity_report

CPU, float32, PRESET=8xh100-pr1855 at parity_models.TOY_ENV's widths. Exits 2 with one line when the
record's folder is missing.
"""

import sys

from primitives.cli_errors import USER_ERRORS, check_file, report_user_error
from tools.parity.parity_config import log_mismatches, read_log_hyperparameters
from tools.parity.parity_models import (PR1855_SCRIPT, compare_forward, kit_model, packed_batch, record_model,
                                        toy_settings)
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
    return 0


if __name__ == "__main__":
    sys.exit(main())
