"""tools/bench_recipes.py: per-step time of configurations, interleaved in one process."""

import re

from tools.bench import bench_recipes

TINY = ["PRESET=smoke", "NUM_LAYERS=1", "MODEL_DIM=32", "NUM_HEADS=2", "NUM_KV_HEADS=1", "ROPE_DIMS=16",
        "TRAIN_SEQ_LEN=32", "TRAIN_BATCH_TOKENS=128", "EVAL_STRIDE=16", "NUM_THREADS=1"]


def test_prints_one_row_per_config_relative_to_the_first(capsys):
    assert bench_recipes.main(["--steps", "2", "--set", *TINY, "--config", "base", "EMA_DECAY=0",
                               "QAT_START_FRAC=0", "--config", "wide", "MLP_MULT=4"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("2 steps per config, interleaved, 1 thread(s)\n")
    rows = {m.group(1): m.groups()[1:] for m in re.finditer(r"^(base|wide) +(\d+) +(\d+) +(\d+) +([\d.]+)$", out, re.M)}
    assert set(rows) == {"base", "wide"} and rows["base"][3] == "1.000"
    ms_base, ms_wide = int(rows["base"][0]), int(rows["wide"][0])
    assert abs(int(rows["wide"][2]) * ms_wide / 1000 - 128) <= 128 * (0.5 / ms_wide + 0.01)  # tokens/s = 128 / median
    # the ratio comes from the unrounded medians; the printed ms are rounded to the nearest ms
    assert (ms_wide - 0.5) / (ms_base + 0.5) - 0.001 <= float(rows["wide"][3]) <= (ms_wide + 0.5) / (ms_base - 0.5) + 0.001


def test_bad_input_exits_2_with_one_line(capsys):
    assert bench_recipes.main(["--set", *TINY, "--config", "a", "MLP_MULT"]) == 2
    assert capsys.readouterr().err == "error: --config a: 'MLP_MULT': expected NAME=VALUE with an upper-case env var name\n"
    assert bench_recipes.main(["--steps", "0", "--config", "a"]) == 2
    assert capsys.readouterr().err == "error: --steps 0: expected >= 1\n"
    assert bench_recipes.main(["--set", *TINY, "--config", "a", "NUM_LAYERS=x"]) == 2
    assert capsys.readouterr().err == "error: NUM_LAYERS='x': expected a whole number\n"
    # a typo would time the default instead of the recipe: refused like the sweep refuses it
    assert bench_recipes.main(["--set", *TINY, "--config", "a", "MLP_MULTT=4"]) == 2
    assert capsys.readouterr().err == "error: --config a: ['MLP_MULTT'] are not settings of train_gpt.py\n"
