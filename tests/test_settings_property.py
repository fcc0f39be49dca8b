"""Property tests of the whole settings surface (hypothesis): every combination of environment variables
ends in a run (exit 0, finite numbers) or one `error:` line with exit 2; never a traceback, never status ok
with a non-finite number. In process: every field, any text, hundreds of examples (seconds); end to end:
the trainer at a toy size on the knobs that change a run, a few examples (marked slow, < 3 min in CI)."""

import dataclasses
import json
import math
import re
import subprocess
import sys

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from model.gpt import GPT, build_model_config
from primitives.domains import field_domain
from primitives.settings import Hyperparameters
from tests.test_train import REPO, TINY_ENV, trainer_env

FIELDS = {f.name.upper(): f for f in dataclasses.fields(Hyperparameters) if f.name != "preset"}
JUNK = ["", " ", "abc", "nan", "inf", "-inf", "1e400", "1e308", "-1", "0", "1", "2.5", str(2**64), "0x10", "1_000"]


def raw_values(field) -> st.SearchStrategy:
    """Text an environment variable of this field's type might hold: in its domain, at its edges, or junk."""
    domain = field_domain(field)
    junk = st.sampled_from(JUNK)
    if field.type is bool:
        return st.one_of(st.sampled_from(["0", "1", "true", "False", "yes", "2"]), junk)
    if field.type is str:
        return st.one_of(st.sampled_from(list(domain.choices) or ["all", "scalars", "x", "[", "blocks\\.0"]), junk)
    edges = [e for e in (domain.low, domain.high) if e is not None]
    near = [str(type_(e + d)) for e in edges for d in (-1, 0, 1) for type_ in (field.type,)]
    numbers = st.integers(-5, 80).map(str) if field.type is int else st.floats(-3, 3, allow_nan=False).map(repr)
    return st.one_of(numbers, st.sampled_from(near or ["0"]), junk)


def environments(names=tuple(FIELDS), max_size=6) -> st.SearchStrategy:
    picked = st.lists(st.sampled_from(sorted(names)), unique=True, max_size=max_size)
    return picked.flatmap(lambda keys: st.fixed_dictionaries({k: raw_values(FIELDS[k]) for k in keys}))


def small(hp: Hyperparameters) -> bool:
    return hp.num_layers <= 16 and hp.model_dim <= 1024 and hp.vocab_size <= 65536 and hp.mlp_mult <= 16


def tiny(hp: Hyperparameters) -> bool:
    return hp.num_layers * (1 + hp.num_loops) <= 8 and hp.model_dim <= 128 and hp.vocab_size <= 2048 and hp.mlp_mult <= 8


@settings(max_examples=400, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(env=environments())
def test_any_settings_are_accepted_whole_or_refused_in_one_line(env):
    lines = []
    try:
        hp = Hyperparameters.from_env({**TINY_ENV, **env}, log=lines.append)
    except ValueError as err:
        message = str(err)
        assert "\n" not in message and re.match(r"^[A-Z][A-Z0-9_]*=", message), message
        for part in message.split("; "):  # every violation names a variable of ours and what was expected
            assert re.match(r"^([A-Z][A-Z0-9_]*)=.*expected", part) and part.split("=")[0] in {*FIELDS, "PRESET"}, part
        return
    assert hp.violations() == {}
    assert all(line.startswith("WARNING: ") and "\n" not in line for line in lines), lines
    if small(hp):  # an accepted setting builds its model (meta device: nothing allocated)
        with torch.device("meta"):
            GPT(**build_model_config(hp))


def one_step(hp: Hyperparameters) -> torch.Tensor:
    """A forward and backward of the GPT of `hp` (a toy size) on 16 random tokens: its loss."""
    torch.manual_seed(0)
    model = GPT(**build_model_config(hp))
    model.init_weights(hp.tied_embed_init_std)
    ids = torch.randint(0, hp.vocab_size, (1, min(hp.train_seq_len, 16) + 1))
    loss = model(ids[:, :-1], ids[:, 1:])
    loss.backward()
    return loss


def test_every_field_at_the_edges_of_its_domain_is_refused_in_one_line_or_trains_a_step():
    """Each field alone at its domain's edges (and one past them) over the toy settings: refused in one line,
    or accepted, and then a model field's GPT takes a finite step (this found ROPE_DIMS=0: a division by zero
    in the first training step, after the run had started)."""
    model_fields = set(build_model_config(Hyperparameters.from_env(TINY_ENV, log=lambda *_: None)))
    for name, field in FIELDS.items():
        domain = field_domain(field)
        values = [*domain.choices, *(v + d for v in (domain.low, domain.high) if v is not None for d in (-1, 0, 1))]
        for value in values or ["0", "1"]:
            env = {**TINY_ENV, name: str(field.type(value)) if field.type in (int, float) else str(value)}
            try:
                hp = Hyperparameters.from_env(env, log=lambda *_: None)
            except ValueError as err:
                assert "\n" not in str(err) and str(err).split("=")[0] in FIELDS, (name, value, err)  # it, or a relation
                continue
            if field.name in model_fields and tiny(hp):
                assert torch.isfinite(one_step(hp)), (name, value)


# the knobs that change what a run does, at toy size (ranges keep a run to seconds)
RUN_KNOBS = ("LOGIT_SOFTCAP", "MATRIX_LR", "SCALAR_LR", "TIED_EMBED_LR", "BETA1", "BETA2", "MUON_MOMENTUM", "WARMDOWN_FRAC",
             "QAT_START_FRAC", "EMA_DECAY", "EMA_HORIZON_FRAC", "NUM_LOOPS", "LOOP_START", "LOOP_END", "ENABLE_LOOPING_AT",
             "ROPE_DIMS", "MLP_MULT", "XSA_LAST_N", "GRAD_CLIP_NORM", "MIN_LR", "WD_TAPER_START_FRAC", "WD_TAPER_FINAL_MULT",
             "SMEAR_GATE_ENABLED", "SPARSE_ATTN_GATE_ENABLED", "EVAL_STRIDE", "TTT_ENABLED", "TTT_MODE", "TTT_LR",
             "QK_GAIN_INIT", "TIE_EMBEDDINGS", "MLP_ACTIVATION", "MUON_BACKEND_STEPS", "PARALLEL_RESIDUAL_START",
             "ITERATIONS", "MUON_WD", "ADAM_WD", "ROPE_BASE", "TTT_EPOCHS", "GATE_WINDOW")
RUN_VALUES = {"ITERATIONS": ["1", "2", "3", "0"], "TTT_EPOCHS": ["0", "1"], "EVAL_STRIDE": ["16", "32", "64", "0", "65"],
              "NUM_LOOPS": ["0", "1", "2"], "LOOP_START": ["0", "1"], "LOOP_END": ["0", "1", "2"], "ROPE_DIMS": ["0", "8", "16", "32"],
              "MUON_BACKEND_STEPS": ["0", "1", "5"], "GATE_WINDOW": ["1", "12", "64", "65"], "MLP_MULT": ["0.5", "1", "2", "0"]}


def run_values(name: str) -> st.SearchStrategy:
    return st.sampled_from(RUN_VALUES[name]) if name in RUN_VALUES else raw_values(FIELDS[name])


def finite_everywhere(value) -> bool:
    if isinstance(value, float):
        return math.isfinite(value)
    if isinstance(value, dict):
        return all(finite_everywhere(v) for v in value.values())
    if isinstance(value, list):
        return all(finite_everywhere(v) for v in value)
    return True


@pytest.mark.slow
@settings(max_examples=5, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
@given(env=st.lists(st.sampled_from(RUN_KNOBS), unique=True, min_size=1, max_size=5).flatmap(
    lambda keys: st.fixed_dictionaries({k: run_values(k) for k in keys})))
def test_any_settings_end_in_a_finite_run_or_one_line_never_a_traceback(env, tiny_dataset, sp1024_model, tmp_path_factory):
    out = tmp_path_factory.mktemp("prop")
    full = trainer_env(tiny_dataset, sp1024_model, out, RUN_ID="p", ITERATIONS=3, VAL_MAX_TOKENS=2048, **env)
    proc = subprocess.run([sys.executable, str(REPO / "train_gpt.py")], env=full, cwd=REPO, capture_output=True, text=True,
                          timeout=170)
    where = f"{env}\nexit {proc.returncode}\n{proc.stderr[-3000:]}"
    assert "Traceback" not in proc.stderr, where
    result_path = out / "p" / "result.json"
    if proc.returncode == 2:
        lines = proc.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("error: "), where
        assert not result_path.exists(), where  # refused before anything was written
        return
    result = json.loads(result_path.read_text())
    if proc.returncode == 0:
        assert result["status"] == "ok" and finite_everywhere(result), where
    else:  # a divergence is a measured result, never status ok
        assert proc.returncode == 1 and result["status"].startswith("nonfinite"), where
