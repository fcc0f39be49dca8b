"""The TTT engine (eval/walk.py) and its registry (eval/ttt_modes.py): a mode added through the registry
alone runs end to end (the trainer's evaluate_ttt and run_mode, legal ledger, learns, its epochs=0 run is the
sliding score), an illegal toy scope is refused, and every row names only real settings."""

import dataclasses
import re
import time
import types

import pytest
import torch

from eval.plan import EvalPlan
from eval.sliding import eval_sliding
from eval.ttt import split_ttt_chunks
from eval.sliding import Scorer
from eval.sgd_modes import prefix_scope
from eval.ttt import TTTMode
from eval.ttt_modes import TTT_MODES, mode_settings, run_mode
from eval.walk import Schedule, check_ttt_legality
from primitives.settings import Hyperparameters
from test_eval_support import mixed_stream
from test_eval_ttt import QUIET, TTTLM
from trainer.ttt_eval import evaluate_ttt


class HeadStep(Scorer):
    """The toy updater: one plain gradient step (lr from the mode's settings) on the output head only (trainable()),
    per scope and epoch, on the scope's last seq_len targets."""

    def trainable(self) -> list:
        return [self.model.head]

    def count_steps(self, sched, spans) -> int:
        return self.run.epochs * len(spans)

    def steps(self, sched, spans):
        r = self.run
        for _, _, (lo, hi) in spans:
            for _ in range(r.epochs):
                a = max(lo, hi - r.seq_len)
                self.model(r.tokens[None, a:hi], r.tokens[None, a + 1:hi + 1]).backward()
                with torch.no_grad():
                    for p in self.trainable():
                        p -= r.cfg["lr"] * p.grad
                        p.grad = None
                yield [(a, hi)]


def documents(run) -> Schedule:
    bounds = split_ttt_chunks(run.tokens, 1, run.bos_id)  # one unit per document
    n = len(bounds) - 1
    return Schedule(bounds, [[(0, c, c == n - 1)] for c in range(n)], [bounds[c + 1] - bounds[c] for c in range(n)],
                    result=dict(num_documents=n))


TOY = TTTMode(label="toy ttt", unit="document", count_from=0, fields=("lr",), valid=lambda run: run.cfg["lr"] >= 0,
              expected="lr >= 0",
              schedule=documents, scope=prefix_scope, updater=HeadStep)


@pytest.fixture(scope="module")
def stream(sp):
    return mixed_stream(sp, 1200)


def test_a_toy_mode_added_to_the_registry_runs_end_to_end(stream, luts, monkeypatch):
    monkeypatch.setitem(TTT_MODES, "toy", TOY)
    sliding = eval_sliding(TTTLM(seed=1), stream, luts, seq_len=32, stride=16, batch_seqs=8, **QUIET)
    still = run_mode("toy", TTTLM(seed=1), stream, luts, seq_len=32, stride=16, epochs=0, eval_batch_seqs=8, **QUIET)
    assert still["num_updates"] == 0 and still["val_loss"] == pytest.approx(sliding["val_loss"], rel=1e-12)
    # through the trainer's entry: the settings come from the row's fields, the mode from TTT_MODE
    hp = types.SimpleNamespace(ttt_mode="toy", ttt_lr=0.5, train_seq_len=32, eval_batch_seqs=8, eval_max_seconds=600.0)
    ctx = types.SimpleNamespace(device="cpu", rank=0, world_size=1, compile=False, autocast_dtype=None, log=print)
    model = TTTLM(seed=1)
    head = model.head.detach().clone()
    res = evaluate_ttt(ctx, hp, model, stream, luts, plan=EvalPlan(stride=16, epochs=2, mode="toy"), started=time.perf_counter())
    check_ttt_legality(res["chunks"])
    assert res["num_chunks"] == res["num_documents"] > 2 and res["num_updates"] == 2 * (res["num_chunks"] - 1)
    assert res["chunks"][-1]["first_update_step"] is None  # the last document is never trained on
    assert res["num_scored_tokens"] == len(stream) - 1 and res["num_bytes"] == sliding["num_bytes"]
    assert res["val_loss"] < sliding["val_loss"] and not torch.equal(model.head, head)  # it learned, in place
    assert all(p.requires_grad for p in model.parameters())  # the freeze was restored
    assert mode_settings("toy", hp) == {"lr": 0.5}


class AllStep(HeadStep):
    """The toy updater on any model (the trainer's GPT): the same plain step on every parameter."""

    def trainable(self) -> list:
        return list(self.model.parameters())


@pytest.mark.slow
def test_a_toy_mode_runs_through_the_trainer_and_the_score_command(monkeypatch, tiny_dataset, sp1024_model, tmp_path,
                                                                    capsys):
    """The toy mode, added as a new mode is (its row, and its name among TTT_MODE's choices: both monkeypatched, no
    file edited), through train_gpt.main() (plan, finish_run, result.json, score command) and then `python -m eval
    score` (main(), in process) on the artifact with that command: the trainer's score, updates and all."""
    import eval.__main__ as eval_cli
    from primitives.domains import field_domain
    from quant.artifact import load_artifact
    from tests.test_after_training import run_main_in_process
    from tests.test_train import read_result
    from trainer.finish import score_command

    monkeypatch.setitem(TTT_MODES, "toy", dataclasses.replace(TOY, updater=AllStep))
    field = next(f for f in dataclasses.fields(Hyperparameters) if f.name == "ttt_mode")
    names = field_domain(field).choices + ("toy",)
    monkeypatch.setattr(field, "metadata", types.MappingProxyType(
        {**field.metadata, "domain": dataclasses.replace(field_domain(field), choices=names)}))
    monkeypatch.setattr(eval_cli, "TTT_MODES", names)
    toy_env = dict(TTT_ENABLED="1", TTT_MODE="toy", TTT_EPOCHS="1", TTT_LR="0.001")
    assert run_main_in_process(monkeypatch, tiny_dataset, sp1024_model, tmp_path, "toy", **toy_env) == 0
    out = capsys.readouterr().out
    result = read_result(tmp_path, "toy")
    assert result["ttt_mode"] == "toy" and result["ttt_epochs"] == 1 and result["ttt_updates"] > 0, out[-2000:]
    assert result["eval_plan"]["mode"] == "toy" and "TTT_MODE=toy has no plan" in result["eval_plan"]["reason"]
    assert load_artifact(tmp_path / "toy" / "final_model.ptz")[2]["run"]["ttt"]["mode"] == "toy"  # its fields: shared
    hp = Hyperparameters.from_env(log=lambda *_: None)  # the environment run_main_in_process set
    command = score_command(hp, tmp_path / "toy" / "final_model.ptz", EvalPlan(**result["eval_plan"]))
    assert " --ttt 1 --ttt-epochs 1 " in command and " --ttt-mode toy" in command
    for key in toy_env:
        monkeypatch.delenv(key)
    assert eval_cli.main(command[:command.index(" --ttt 1 ")].split()[3:] + ["--ttt", "1"]) == 0  # the rest: the artifact's
    cli = re.search(r"^final_ttt_exact val_loss:(\S+) val_bpb:(\S+) .* updates:(\d+)$", capsys.readouterr().out, re.M)
    assert cli and int(cli.group(3)) == result["ttt_updates"]
    assert float(cli.group(2)) == pytest.approx(result["val_bpb_ttt"], abs=1e-7)
    assert float(cli.group(1)) == pytest.approx(result["val_loss_ttt"], abs=1e-7)


def test_a_toy_scope_that_reaches_ahead_is_refused(stream, luts, monkeypatch):
    ahead = lambda sched, c: (0, sched.bounds[min(c + 2, len(sched.bounds) - 1)])  # the next document too
    monkeypatch.setitem(TTT_MODES, "toy", dataclasses.replace(TOY, scope=ahead))
    with pytest.raises(ValueError, match=r"TTT illegal: chunk 1 \(targets \d+\.\.\d+\) was scored after 1 updates, "
                                         r"but update 1 had already trained on it"):
        run_mode("toy", TTTLM(seed=1), stream, luts, seq_len=32, stride=16, epochs=1, lr=0.5, eval_batch_seqs=8, **QUIET)


def test_bad_mode_and_settings_are_refused_before_anything_runs(stream, luts, monkeypatch):
    monkeypatch.setitem(TTT_MODES, "toy", TOY)
    model = TTTLM(seed=1)
    with pytest.raises(ValueError, match=r"TTT_MODE='nope': expected one of chunked, phased, lora, phased_lora, toy"):
        run_mode("nope", model, stream, luts, seq_len=32, stride=16, **QUIET)
    with pytest.raises(ValueError, match=r"^run_toy_ttt: .*TTT_LR=-1.*expected .*lr >= 0$"):
        run_mode("toy", model, stream, luts, seq_len=32, stride=16, lr=-1, **QUIET)
    assert model.num_calls == 0


def test_every_row_reads_real_settings():
    hp = Hyperparameters()
    for name, row in TTT_MODES.items():
        settings = mode_settings(name, hp)  # every field is a Hyperparameters ttt_* setting
        assert len(settings) == len(row.fields) and row.entry.startswith("run_"), name


def test_the_settings_name_exactly_the_registry_modes():
    """TTT_MODE's choices (primitives/settings.py, a layer below the registry) are the registry's rows, in order;
    each mode-specific setting applies under the modes whose row reads it (ttt_modes_apply, the settings' one
    comparison of mode names)."""
    from eval.score_settings import choices
    from primitives.domains import field_domain
    from primitives.settings import TTT_MODE_NAMES, UNRECORDED_TTT_MODE

    assert tuple(TTT_MODES) == TTT_MODE_NAMES == choices("ttt_mode")
    # the one mode an artifact does not name (its row's `recorded`, trainer/finish.py) is the one eval score reads it as
    assert [m for m, row in TTT_MODES.items() if not row.recorded] == [UNRECORDED_TTT_MODE]
    for f in dataclasses.fields(Hyperparameters):
        applies = field_domain(f).applies
        if not applies or not f.name.startswith("ttt_") or f.name in ("ttt_enabled", "ttt_mode", "ttt_epochs"):
            continue
        readers = {m for m, row in TTT_MODES.items() if f.name.removeprefix("ttt_") in row.fields}
        on = {m for m in TTT_MODES if applies[1](Hyperparameters(ttt_enabled=True, ttt_mode=m))}
        assert readers and readers <= on and not applies[1](Hyperparameters(ttt_enabled=False, ttt_mode=min(readers))), f.name


@pytest.mark.parametrize("environ", [{}, {"PRESET": "smoke"}, {"PRESET": "smoke", "EVAL_BATCH_SEQS": "8", "TTT_LR": "0.5",
                                                              "TTT_MODE": "lora", "EVAL_AUTO_STRIDE": "1"},
                                     {"PRESET": "8xh100-pr1855", "TTT_PREFIX_DOCS": "7", "TTT_LORA_K": "0"}])
def test_the_eval_cli_and_the_trainer_resolve_the_same_settings(environ):
    """`python -m eval score` with no flag resolves every setting it shares with the trainer as
    Hyperparameters.from_env does (the same environment variables, the same defaults under PRESET)."""
    from eval.__main__ import build_parser
    from eval.score_settings import SHARED_SETTINGS, mode_only_settings, resolve_cli_settings

    args = build_parser().parse_args(["score", "--artifact", "a.ptz", "--data-path", "d", "--tokenizer", "t.model"])
    resolve_cli_settings(args, environ)
    hp = Hyperparameters.from_env(environ, log=lambda msg: None)
    assert len(SHARED_SETTINGS) >= 20
    for attr, (name, _, _) in SHARED_SETTINGS.items():
        trainer = getattr(hp, name)
        assert getattr(args, attr) == (int(trainer) if isinstance(trainer, bool) else trainer), (attr, environ)
    for f in mode_only_settings():  # a mode's own settings (no flag): the same variables and defaults
        assert getattr(args, f.name) == getattr(hp, f.name), (f.name, environ)
    if "TTT_PREFIX_DOCS" in environ:
        assert args.ttt_prefix_docs == 7 and args.ttt_lora_k is False and args.ttt_mode == "phased_lora"
    if "EVAL_BATCH_SEQS" in environ:
        assert args.batch_seqs == 8 and args.ttt_lr == 0.5 and args.ttt_mode == "lora" and args.auto_stride == 1


@pytest.mark.parametrize("flags, environ, named", [
    ([], {"TTT_PREFIX_DOCS": "-1"}, "TTT_PREFIX_DOCS=-1: expected a whole number >= 0"),
    (["--ttt-lora-alpha", "0"], {}, "TTT_LORA_ALPHA=0.0: expected a finite number > 0"),
    (["--ttt-lora-k", "maybe"], {}, "--ttt-lora-k")])
def test_the_eval_cli_checks_a_modes_own_settings_as_the_trainer(flags, environ, named):
    """A mode's own setting (no SHARED_SETTINGS entry: phased_lora's TTT_PREFIX_DOCS, ...) is checked against its
    declared domain, from a flag or the environment, in one line naming it."""
    from eval.__main__ import build_parser
    from eval.score_settings import resolve_cli_settings

    args = build_parser().parse_args(["score", "--artifact", "a.ptz", "--data-path", "d", "--tokenizer", "t.model",
                                      *flags])
    with pytest.raises(ValueError, match=re.escape(named)) as err:
        resolve_cli_settings(args, environ)
    assert "\n" not in str(err.value)
