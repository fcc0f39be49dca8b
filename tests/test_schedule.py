"""Schedules relative to the run (issue 13): fractions of the run, the records' step forms, and the
presets resolving to the records' values at the run length each was set for."""

import dataclasses

import pytest
import torch

from trainer.schedule import (

    EMA,

    describe_schedule,

    ema_decay_at,

    lr_multiplier,

    muon_momentum_at,

    qat_active,

    run_progress,

    run_steps_estimate,

    schedule_warning,

    warmdown_frac_at,

    warmup_graph_states,

)

from primitives.settings import Hyperparameters


def env_hp(**env):
    return Hyperparameters.from_env({k: str(v) for k, v in env.items()}, log=lambda *_: None)


def old_momentum(step, warmup_steps=1500, start=0.92, end=0.99):
    """The schedule before issue 13 (and of the records): linear over a fixed step count."""
    frac = min(1.0, step / warmup_steps)
    return (1 - frac) * start + frac * end


@pytest.mark.parametrize("preset,expected_steps", [("1xh100", 2000), ("8xh100", 7000)])
def test_gpu_presets_resolve_to_the_records_schedule_at_their_expected_length(preset, expected_steps):
    hp = env_hp(PRESET=preset)
    assert hp.expected_steps == expected_steps
    # a 600 s run that takes exactly the expected number of steps: progress = step / expected
    for step in range(0, expected_steps + 1, 25):
        progress = step / expected_steps
        assert muon_momentum_at(step, hp, progress) == pytest.approx(old_momentum(step), abs=1e-12), step
        assert ema_decay_at(step, progress, hp) == pytest.approx(0.997, abs=1e-12)
        assert lr_multiplier(progress, warmdown_frac_at(step, progress, hp)) == pytest.approx(
            min(1.0, (1 - progress) / 0.5))
    assert describe_schedule(hp, expected_steps) == (
        f"schedule: run_steps:{expected_steps} expected_steps:{expected_steps} muon_momentum_warmup_steps:1500 "
        f"warmdown_steps:{expected_steps // 2} qat_steps:{expected_steps // 10} ema_start_step:0 "
        "muon_momentum:0.9200->0.9900 ema_decay:0.99700")


def test_fractions_scale_with_the_run_length():
    hp = env_hp(PRESET="1xh100", MAX_WALLCLOCK_SECONDS=0, ITERATIONS=200)
    # the same shape at a tenth of the length: momentum warmup over 150 steps, EMA horizon 33.3 steps
    assert muon_momentum_at(75, hp, 75 / 200) == pytest.approx(0.955)
    assert muon_momentum_at(150, hp, 150 / 200) == pytest.approx(0.99)
    assert ema_decay_at(10, 10 / 200, hp) == pytest.approx(1 - 1 / (200 / 6))
    line = describe_schedule(hp, run_steps_estimate(0, 0.0, hp))
    assert line == ("schedule: run_steps:200 expected_steps:2000 muon_momentum_warmup_steps:150 warmdown_steps:100 "
                    "qat_steps:20 ema_start_step:0 muon_momentum:0.9200->0.9900 ema_decay:0.97000")


def test_wallclock_runs_estimate_their_length_from_the_clock():
    hp = env_hp(PRESET="smoke")  # 240 s cap, set for 150 steps
    assert run_steps_estimate(0, 0.0, hp) == 150.0
    assert run_steps_estimate(30, 0.25, hp) == pytest.approx(120.0)  # 30 steps took a quarter of the time
    assert run_steps_estimate(0, 0.0, env_hp(PRESET="smoke", ITERATIONS=40)) == 40.0


def test_warmdown_iters_matches_the_official_wallclock_formula():
    """Official train_gpt.py: lr scale = remaining_ms / (WARMDOWN_ITERS * step_ms) once remaining_ms is
    below the warmdown's time; WARMDOWN_ITERS is the records' step form of WARMDOWN_FRAC."""
    hp = env_hp(PRESET="smoke", WARMDOWN_ITERS=1200)
    assert hp.warmdown_frac == 0 and hp.warmdown_iters == 1200
    cap_ms, step_ms = 240_000.0, 1600.0  # 150 steps in the budget: the whole run is in warmdown
    for step in (1, 10, 75, 149):
        elapsed = step * step_ms
        remaining = max(cap_ms - elapsed, 0.0)
        official = remaining / (1200 * step_ms) if remaining <= 1200 * step_ms else 1.0
        progress = elapsed / cap_ms
        assert lr_multiplier(progress, warmdown_frac_at(step, progress, hp)) == pytest.approx(official)
    iters = env_hp(PRESET="smoke", WARMDOWN_ITERS=50, MAX_WALLCLOCK_SECONDS=0, ITERATIONS=200)
    assert [lr_multiplier(s / 200, warmdown_frac_at(s, s / 200, iters)) for s in (100, 150, 175, 200)] == \
        pytest.approx([1.0, 1.0, 0.5, 0.0])  # official: (iterations - step) / warmdown_iters


def test_an_explicit_step_form_replaces_the_presets_fraction():
    hp = env_hp(PRESET="1xh100", MUON_MOMENTUM_WARMUP_STEPS=500, EMA_DECAY=0.99)
    assert (hp.muon_momentum_warmup_frac, hp.ema_horizon_frac) == (0, 0)
    assert muon_momentum_at(250, hp, 0.9) == pytest.approx(0.955)  # steps, not progress
    assert ema_decay_at(5, 0.1, hp) == 0.99
    assert env_hp(PRESET="1xh100", MUON_MOMENTUM_WARMUP_STEPS=0).muon_momentum_warmup_frac == 0
    assert muon_momentum_at(0, env_hp(PRESET="1xh100", MUON_MOMENTUM_WARMUP_STEPS=0)) == 0.99  # no warmup
    off = env_hp(PRESET="smoke", EMA_DECAY=0)
    assert (off.ema_decay, off.ema_horizon_frac) == (0, 0) and describe_schedule(off, 150).endswith("ema_decay:0.00000")
    frac = env_hp(PRESET="1xh100", MUON_MOMENTUM_WARMUP_FRAC=0.1)
    assert frac.muon_momentum_warmup_steps == 0 and frac.muon_momentum_warmup_frac == 0.1


@pytest.mark.parametrize("env,message", [
    ({"MUON_MOMENTUM_WARMUP_STEPS": "500", "MUON_MOMENTUM_WARMUP_FRAC": "0.2"},
     "MUON_MOMENTUM_WARMUP_STEPS=500: expected 0 when MUON_MOMENTUM_WARMUP_FRAC is set"),
    ({"EMA_DECAY": "0.99", "EMA_HORIZON_FRAC": "0.1"}, "EMA_DECAY=0.99: expected 0 when EMA_HORIZON_FRAC is set"),
    ({"WARMDOWN_ITERS": "100", "WARMDOWN_FRAC": "0.5"}, "WARMDOWN_ITERS=100: expected 0 when WARMDOWN_FRAC is set"),
    ({"MUON_MOMENTUM": "0.95", "MUON_MOMENTUM_HORIZON_FRAC": "0.1"},
     "MUON_MOMENTUM=0.95: expected 0 when MUON_MOMENTUM_HORIZON_FRAC is set"),
    ({"EMA_DECAY": "1"}, r"EMA_DECAY=1.0: expected a finite number in \[0, 1\)"),
    ({"EMA_START_FRAC": "1.5"}, r"EMA_START_FRAC=1.5: expected a finite number in \[0, 1\]"),
    ({"EXPECTED_STEPS": "0"}, "EXPECTED_STEPS=0: expected a whole number >= 1"),
])
def test_both_forms_of_one_knob_are_refused(env, message):
    with pytest.raises(ValueError, match=message):
        env_hp(**env)


def test_ema_starts_late_and_follows_the_weights_before():
    hp = env_hp(PRESET="smoke", MAX_WALLCLOCK_SECONDS=0, ITERATIONS=100, EMA_START_FRAC=0.5, EMA_HORIZON_FRAC=0.1)
    assert [ema_decay_at(s, s / 100, hp) for s in (0, 49)] == [0.0, 0.0]
    assert ema_decay_at(50, 0.5, hp) == pytest.approx(0.9)  # horizon 10 steps
    lin = torch.nn.Linear(2, 2, bias=False)
    ema = EMA(lin)
    for value, decay in ((3.0, 0.0), (5.0, 0.0), (7.0, 0.9), (9.0, 0.9)):
        with torch.no_grad():
            lin.weight.fill_(value)
        ema.update(decay)
    # before the start the shadow is the weights (5); then the warmup: d = 1/10, then 2/11
    expected = (2 / 11) * (0.1 * 5.0 + 0.9 * 7.0) + (9 / 11) * 9.0
    assert torch.allclose(ema.shadow[0], torch.full((2, 2), expected))
    line = describe_schedule(hp, 100)
    assert "ema_start_step:50 " in line and line.endswith(" ema_decay:0.90000")


def test_progress_ends_with_whichever_limit_comes_first():
    """ITERATIONS below what the cap allows still ends the warmdown at 0 (progress = step / ITERATIONS)."""
    hp = env_hp(PRESET="smoke", ITERATIONS=100)
    progress = run_progress(1000.0, 1000 * hp.max_wallclock_seconds, 100, hp.iterations)
    assert progress == 1.0 and run_progress(1000.0, 240_000.0, 10, 100) == 0.1  # steps ahead of the clock
    assert run_progress(120_000.0, 240_000.0, 10, 100) == 0.5 and run_progress(5.0, 0.0, 3, 12) == 0.25  # no cap
    assert run_progress(300_000.0, 240_000.0, 10, 100) == 1.0
    assert lr_multiplier(progress, warmdown_frac_at(100, progress, hp)) == 0.0
    assert qat_active(progress, hp.qat_start_frac)


def baseline_momentum(step):
    """The official baseline's Muon momentum: 0.85 -> 0.95 over 500 steps (a 150-step run ends at 0.88)."""
    return 0.85 + 0.10 * min(1.0, step / 500)


def test_smoke_momentum_is_a_fraction_of_the_run_and_matches_the_baseline_at_150_steps():
    """Issue 13's ablation: at 150 steps the records' 0.92 -> 0.99 (a 100-step memory) cost most of the
    gap to the official baseline; smoke sets the momentum's time constant as a fraction of the run."""
    hp = env_hp(PRESET="smoke", MAX_WALLCLOCK_SECONDS=0, ITERATIONS=150)
    for step in range(151):
        assert muon_momentum_at(step, hp, step / 150) == pytest.approx(baseline_momentum(step), abs=1e-12), step
    assert "muon_momentum_warmup_steps:150 warmdown_steps:150 " in describe_schedule(hp, 150)
    # EMA is off in smoke: at 150 steps EMA 0.997 cost +0.005 (docs/presets.md)
    assert describe_schedule(hp, 150).endswith("muon_momentum:0.8500->0.8800 ema_decay:0.00000")
    # twice the run: the memory doubles, 1/(1-m) = 16.7 steps; a wallclock run uses its measured length
    assert muon_momentum_at(300, env_hp(PRESET="smoke", MAX_WALLCLOCK_SECONDS=0, ITERATIONS=300), 1.0) == \
        pytest.approx(1 - 0.12 / 2)
    wall = env_hp(PRESET="smoke")  # 240 s: 60 steps in half the time -> a 120-step run
    assert muon_momentum_at(60, wall, 0.5) == pytest.approx(0.85 + 0.5 * (1 - 0.12 * 150 / 120 - 0.85))
    # a target below the warmup's start is used from the first step; a one-step memory is no momentum
    short = env_hp(PRESET="smoke", MAX_WALLCLOCK_SECONDS=0, ITERATIONS=30)
    assert muon_momentum_at(0, short) == muon_momentum_at(30, short, 1.0) == pytest.approx(1 - 0.12 * 5)
    assert muon_momentum_at(0, env_hp(PRESET="smoke", MAX_WALLCLOCK_SECONDS=0, ITERATIONS=10)) == 0.0
    # the records' form replaces the fraction; the GPU presets keep it (0.99 at any length)
    fixed = env_hp(PRESET="smoke", MUON_MOMENTUM=0.95)
    assert (fixed.muon_momentum, fixed.muon_momentum_horizon_frac) == (0.95, 0)
    assert muon_momentum_at(150, fixed, 1.0) == 0.95
    assert env_hp(PRESET="1xh100").muon_momentum_horizon_frac == 0
    frac = env_hp(PRESET="1xh100", MUON_MOMENTUM_HORIZON_FRAC=0.05, MAX_WALLCLOCK_SECONDS=0, ITERATIONS=2000)
    assert frac.muon_momentum == 0 and muon_momentum_at(2000, frac, 1.0) == pytest.approx(0.99)


def test_smoke_is_the_baseline_knobs_plus_the_measured_ingredients_at_150_steps():
    """Issue 13's result: tools/sweeps/proxy_ablation.yaml's B (the official baseline's knobs, in the
    records' step forms) plus the ingredients that paid one at a time there (B_clip, B_wd) and late QAT
    (neutral) is what the smoke preset (its `smoke: {}` config) resolves to at 150 steps: same
    settings, same schedule at every step."""
    import dataclasses
    from pathlib import Path

    import yaml

    spec = yaml.safe_load((Path(__file__).resolve().parents[1] / "tools/sweeps/proxy_ablation.yaml").read_text())
    assert spec["configs"]["smoke"] == {}
    run = {k: str(v) for k, v in {**spec["env"], "ITERATIONS": 150}.items()}
    paid = {**spec["configs"]["B"]}
    for name in ("B_clip", "B_wd"):
        paid.update({k: v for k, v in spec["configs"][name].items() if v != spec["configs"]["B"].get(k)})
    paid["QAT_START_FRAC"] = 0.1
    n = env_hp(**run, **{k: str(v) for k, v in paid.items()})
    smoke = env_hp(**run)
    assert (smoke.grad_clip_norm, smoke.muon_wd, smoke.adam_wd, smoke.mlp_activation) == (0.3, 0.02, 0.04, "relu2")
    assert (smoke.rope_dims, smoke.xsa_last_n, smoke.qk_gain_init) == (64, 0, 1.5)
    own_form = ("run_id", "muon_momentum", "muon_momentum_horizon_frac", "muon_momentum_warmup_start",
                "muon_momentum_warmup_steps", "muon_momentum_warmup_frac", "ema_decay", "ema_horizon_frac")
    for f in dataclasses.fields(Hyperparameters):
        if f.name not in own_form:  # run_id is random; the rest are the two forms of one schedule
            assert getattr(n, f.name) == getattr(smoke, f.name), f.name
    for step in range(151):
        progress = step / 150
        assert muon_momentum_at(step, smoke, progress) == pytest.approx(muon_momentum_at(step, n, progress), abs=1e-12)
        assert ema_decay_at(step, progress, smoke) == ema_decay_at(step, progress, n) == 0.0
        assert warmdown_frac_at(step, progress, smoke) == warmdown_frac_at(step, progress, n) == 1.0


def test_a_schedule_that_degenerates_at_the_run_length_is_one_warning_line():
    """The smoke preset's momentum horizon (1/18 of the run) is a time constant of <= 1 step at 18 steps
    or fewer: momentum 0.0 throughout (the horizon rule, used from step 0 when below the warmup start);
    it was silent. Every degenerate knob goes in ONE line; a healthy schedule gives none."""
    smoke = lambda **env: Hyperparameters.from_env({"PRESET": "smoke", **env}, log=lambda *a: None)
    hp = smoke(ITERATIONS="18")
    assert [muon_momentum_at(s, hp, s / 18) for s in (0, 9, 17)] == [0.0, 0.0, 0.0]
    assert schedule_warning(hp, 18) == (
        "WARNING: schedule at 18 steps (ITERATIONS): MUON_MOMENTUM_HORIZON_FRAC=0.05556 is a time constant of 1.00 "
        "steps (<= 1): Muon momentum is 0.0 for the whole run, not MUON_MOMENTUM_WARMUP_START=0.85 rising (set "
        "MUON_MOMENTUM for a fixed target)")
    assert schedule_warning(smoke(ITERATIONS="19"), 19) is None and schedule_warning(smoke(), 150) is None
    assert schedule_warning(Hyperparameters.from_env({}, log=lambda *a: None), 1843) is None
    # 3 steps of the default preset: warmup < 1 step, QAT of 0 steps, warmdown < 1 step, in one line
    hp = Hyperparameters.from_env({"ITERATIONS": "3", "MAX_WALLCLOCK_SECONDS": "0"}, log=lambda *a: None)
    line = schedule_warning(hp, 3)
    assert line.count("WARNING") == 1 and "\n" not in line and line.startswith("WARNING: schedule at 3 steps (ITERATIONS): ")
    assert ("MUON_MOMENTUM_WARMUP_FRAC: a momentum warmup of 0.81 steps: Muon momentum jumps from 0.85 to 0.9500 after "
            "step 0; QAT_START_FRAC=0.15: late QAT of 0 steps (never on; the export is not trained for); WARMDOWN_FRAC: "
            "a warmdown of 0.60 steps (< 1): the learning rate never decays") in line
    assert not any(qat_active(s / 3, hp.qat_start_frac) for s in range(3))  # what the loop would do
    assert lr_multiplier(2 / 3, warmdown_frac_at(2, 2 / 3, hp)) == 1.0
    # a step-form warmup longer than the run never reaches its target
    hp = Hyperparameters.from_env({"ITERATIONS": "100", "MAX_WALLCLOCK_SECONDS": "0", "MUON_MOMENTUM_WARMUP_STEPS": "400"},
                                  log=lambda *a: None)
    assert schedule_warning(hp, 100).endswith("MUON_MOMENTUM_WARMUP_STEPS: a momentum warmup of 400 steps, longer than "
                                              "the run: Muon momentum reaches 0.8750, never 0.9500")
    # a wallclock run is judged at EXPECTED_STEPS, and says so
    assert schedule_warning(smoke(EXPECTED_STEPS="10"), 10).startswith("WARNING: schedule at 10 steps (EXPECTED_STEPS): ")


def test_the_trainer_logs_the_schedule_warning_once_before_the_clock(tiny_dataset, tmp_path):
    import trainer.context as trainer_context
    import shards.loader as trainer_loader
    import trainer.loop as trainer_loop
    import model.gpt as trainer_model

    hp = Hyperparameters.from_env({"PRESET": "smoke", "NUM_LAYERS": "1", "MODEL_DIM": "32", "NUM_HEADS": "2",
                                   "NUM_KV_HEADS": "1", "ROPE_DIMS": "8", "XSA_LAST_N": "0", "TRAIN_SEQ_LEN": "32",
                                   "EVAL_STRIDE": "16", "TRAIN_BATCH_TOKENS": "256", "ITERATIONS": "4",
                                   "QUANT_GPTQ": "0", "DATA_PATH": str(tiny_dataset)}, log=lambda *a: None)
    logs = []
    ctx = trainer_context.RunContext(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"), run_dir=tmp_path)
    ctx.log = lambda msg="", console=True: logs.append(msg)
    model = trainer_model.GPT(**trainer_model.build_model_config(hp))
    trainer_loop.train(ctx, hp, model, trainer_loader.DistributedTokenLoader(hp.data_path, hp.vocab_size),
                       flops_per_token=0.0)
    warnings = [i for i, m in enumerate(logs) if m.startswith("WARNING: schedule")]
    first_step = next(i for i, m in enumerate(logs) if m.startswith("step:1/"))
    assert len(warnings) == 1 and warnings[0] < first_step
    assert "Muon momentum is 0.0 for the whole run" in logs[warnings[0]] and "QAT_START_FRAC=0.1: late QAT" in logs[warnings[0]]


def test_warmup_primes_each_graph_state_of_the_run_in_its_order():
    """Each graph the run will compile (QAT on, looped) gets an equal share of the warmup steps, in the
    order the run reaches them, so none compiles on the clock."""
    hp = Hyperparameters(warmup_steps=6, qat_start_frac=0.15, num_loops=0)
    assert warmup_graph_states(hp, has_qat=True) == [(False, False)] * 3 + [(False, True)] * 3
    assert warmup_graph_states(hp, has_qat=False) == [(False, False)] * 6  # nothing for QAT to switch
    assert warmup_graph_states(dataclasses.replace(hp, qat_start_frac=0.0), has_qat=True) == [(False, False)] * 6
    looped = dataclasses.replace(hp, num_loops=2, enable_looping_at=0.35)  # looping at 0.35, QAT at 0.85
    assert warmup_graph_states(looped, has_qat=True) == [(False, False)] * 2 + [(True, False)] * 2 + [(True, True)] * 2
    late_loop = dataclasses.replace(looped, enable_looping_at=0.9)
    assert warmup_graph_states(late_loop, has_qat=True) == [(False, False)] * 2 + [(False, True)] * 2 + [(True, True)] * 2
    assert warmup_graph_states(dataclasses.replace(hp, warmup_steps=1), has_qat=True) == [(False, False)]
    assert warmup_graph_states(dataclasses.replace(hp, warmup_steps=0), has_qat=True) == []
