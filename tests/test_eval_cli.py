"""`python -m eval bytes` and `python -m eval score` (from the artifact on disk), as a user runs them."""

import argparse
import hashlib
import json
import os
import re
import shutil
import struct
import subprocess
import sys
import zlib
from pathlib import Path

import pytest
import torch

from eval.offline import load_sentencepiece_luts
from eval.roundtrip import eval_roundtrip
from shards.format import load_validation_tokens
from eval.sliding import eval_sliding
from test_eval_bpb import decode_bytes

REPO = Path(__file__).resolve().parents[1]
ROUNDTRIP_RE = re.compile(r"^final_roundtrip_exact val_loss:(\S+) val_bpb:(\S+)$", re.M)
SLIDING_RE = re.compile(r"^final_sliding_window_exact val_loss:(\S+) val_bpb:(\S+) stride:(\d+) eval_time:(\d+)ms$", re.M)


def run_cli(*args, timeout=300, check=True, **env_extra):
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1", **env_extra)
    proc = subprocess.run([sys.executable, "-m", "eval", *map(str, args)], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=timeout)
    if check and proc.returncode != 0:
        raise AssertionError(f"python -m eval failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}")
    return proc


def test_bytes_cli_matches_decoded_documents(tiny_dataset, sp1024_model):
    import sentencepiece as spm

    out = run_cli("bytes", "--data-path", tiny_dataset, "--tokenizer", sp1024_model).stdout
    match = re.fullmatch(r"val_tokens:(\d+) val_bytes:(\d+) tokens_per_byte:(\S+)\n", out)
    assert match, out
    sp = spm.SentencePieceProcessor(model_file=str(sp1024_model))
    ids = load_validation_tokens(tiny_dataset).tolist()
    cuts = [i for i, t in enumerate(ids) if t == sp.bos_id()] + [len(ids)]
    assert cuts[0] == 0 and len(cuts) > 10  # one BOS per document
    num_bytes = sum(decode_bytes(sp, ids[a + 1 : b]) for a, b in zip(cuts, cuts[1:]))
    assert int(match[1]) == len(ids) - 1 and int(match[2]) == num_bytes
    assert float(match[3]) == pytest.approx((len(ids) - 1) / num_bytes, abs=1e-8)


@pytest.fixture(scope="module")
def tiny_artifact(tmp_path_factory):
    import model.gpt as trainer_model
    from quant import artifact
    config = dict(vocab_size=1024, num_layers=2, model_dim=64, num_heads=2, num_kv_heads=1, mlp_mult=2,
                  rope_dims=16, xsa_last_n=1)
    torch.manual_seed(0)
    model = trainer_model.GPT(**config)
    model.init_weights(0.05)
    path = tmp_path_factory.mktemp("artifact") / "final_model.ptz"
    state = {k: v.detach().float() for k, v in model.state_dict().items()}
    artifact.export_artifact(state, config, path, code_bytes=0, log=lambda msg: None)
    return path


def test_score_cli_rebuilds_the_model_from_the_artifact(tiny_artifact, tiny_dataset, sp1024_model):
    from quant.artifact import load_artifact
    from model.gpt import GPT

    proc = run_cli("score", "--artifact", tiny_artifact, "--data-path", tiny_dataset, "--tokenizer", sp1024_model,
                   "--seq-len", 64, "--stride", 32, "--batch-seqs", 16, "--val-max-tokens", 3000)
    rt, sl = ROUNDTRIP_RE.search(proc.stdout), SLIDING_RE.search(proc.stdout)
    assert rt and sl and sl[3] == "32", proc.stdout
    # The same numbers in process, from the weights on disk.
    state, config, _ = load_artifact(tiny_artifact)
    model = GPT(**config)
    model.load_state_dict(state)
    luts = load_sentencepiece_luts(sp1024_model, config["vocab_size"])
    tokens = load_validation_tokens(tiny_dataset)[:3001]
    loss, bpb = eval_roundtrip(model, tokens, luts, seq_len=64, batch_seqs=5, device="cpu")
    res = eval_sliding(model, tokens, luts, seq_len=64, stride=32, batch_seqs=5, device="cpu", log=lambda m: None)
    assert float(rt[1]) == pytest.approx(loss, abs=1e-7) and float(rt[2]) == pytest.approx(bpb, abs=1e-7)
    assert float(sl[1]) == pytest.approx(res["val_loss"], abs=1e-7) and float(sl[2]) == pytest.approx(res["val_bpb"], abs=1e-7)
    assert 5.0 < loss < 8.0  # a near-uniform model over 1024 ids: ~ln(1024) = 6.93


def _as_format_2(data: bytes) -> bytes:
    """The same artifact with the version byte of format 2 (no run metadata) and a valid checksum."""
    data = bytearray(data)
    data[4] = 2
    struct.pack_into("<I", data, 10, zlib.crc32(bytes(data[14:]), zlib.crc32(bytes(data[:10]))))
    return bytes(data)


def test_score_cli_needs_seq_len_for_an_artifact_that_does_not_record_it(tiny_artifact, tiny_dataset, sp1024_model,
                                                                         tmp_path):
    old = tmp_path / "v2.ptz"
    old.write_bytes(_as_format_2(tiny_artifact.read_bytes()))
    common = ("score", "--artifact", old, "--data-path", tiny_dataset, "--tokenizer", sp1024_model)
    proc = run_cli(*common, check=False)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert f"artifact {old} does not record the training sequence length: pass --seq-len" in proc.stderr
    out = run_cli(*common, "--seq-len", 64, "--stride", 0, "--val-max-tokens", 640).stdout
    assert f"artifact {old} is format 2: it records no training sequence length, tokenizer sha256 or eval stride" in out
    assert ROUNDTRIP_RE.search(out) and "seq_len:64 " in out


def _score_args(**kw):
    base = dict(artifact="a.ptz", tokenizer="tok.model", seq_len=0, stride=None, allow_tokenizer_mismatch=False)
    return argparse.Namespace(**{**base, **kw})


def test_score_settings_come_from_the_artifact_flags_override_and_the_tokenizer_is_checked(tmp_path):
    from eval.__main__ import resolve_score_settings

    tok = tmp_path / "tok.model"
    tok.write_bytes(b"tokenizer bytes")
    sha = hashlib.sha256(b"tokenizer bytes").hexdigest()
    run = dict(train_seq_len=256, vocab_size=1024, eval_stride=32, tokenizer_sha256=sha)
    meta, config = dict(format_version=3, run=run), dict(vocab_size=1024)
    lines = []
    args = _score_args(tokenizer=str(tok))
    assert resolve_score_settings(args, config, meta, environ={}, log=lines.append) == (256, 32)
    assert lines == []
    assert resolve_score_settings(_score_args(tokenizer=str(tok), seq_len=128, stride=64), config, meta, environ={},
                                  log=lines.append) == (128, 64)
    # a stray EVAL_STRIDE does not silently change the score: the artifact wins and says so
    assert resolve_score_settings(args, config, meta, environ={"EVAL_STRIDE": "128"}, log=lines.append) == (256, 32)
    assert lines == ["EVAL_STRIDE=128 in the environment ignored: the artifact records stride 32 (pass --stride to override)"]
    other = tmp_path / "other.model"
    other.write_bytes(b"another tokenizer")
    other_sha = hashlib.sha256(b"another tokenizer").hexdigest()
    with pytest.raises(ValueError) as err:
        resolve_score_settings(_score_args(tokenizer=str(other)), config, meta, environ={}, log=lines.append)
    assert str(err.value) == (f"tokenizer {other} has sha256 {other_sha}, but the artifact a.ptz was trained with a "
                              f"tokenizer of sha256 {sha}: wrong tokenizer for this model (pass "
                              f"--allow-tokenizer-mismatch to score anyway)")
    lines.clear()
    allowed = _score_args(tokenizer=str(other), allow_tokenizer_mismatch=True)
    assert resolve_score_settings(allowed, config, meta, environ={}, log=lines.append) == (256, 32)
    assert lines[0].startswith(f"WARNING: tokenizer {other} has sha256 {other_sha}") and "scoring anyway" in lines[0]
    # format 2: nothing recorded; EVAL_STRIDE (else 64) is the stride, --seq-len is required
    v2 = dict(format_version=2)
    assert resolve_score_settings(_score_args(seq_len=100), config, v2, environ={"EVAL_STRIDE": "20"}, log=lines.append) == (100, 20)
    with pytest.raises(ValueError, match="does not record the training sequence length: pass --seq-len"):
        resolve_score_settings(_score_args(), config, v2, environ={}, log=lines.append)
    for bad in (dict(run, train_seq_len="256"), dict(run, tokenizer_sha256="abc"), dict(run, vocab_size=2048)):
        with pytest.raises(ValueError, match="artifact a.ptz: (malformed run metadata|run vocab_size 2048)"):
            resolve_score_settings(args, config, dict(format_version=3, run=bad), environ={}, log=lines.append)


def test_score_cli_time_guard_trips_with_one_line(tiny_artifact, tiny_dataset, sp1024_model):
    """A tiny EVAL_MAX_SECONDS: loading and the roundtrip use it up, and the sliding eval's guard
    says so in one line. Before the fix the negative budget left was refused as a bad input
    ("EVAL_MAX_SECONDS=-0.4 ... expected others > 0")."""
    proc = run_cli("score", "--artifact", tiny_artifact, "--data-path", tiny_dataset, "--tokenizer", sp1024_model,
                   "--seq-len", 64, "--stride", 8, "--batch-seqs", 4, "--val-max-tokens", 3000, check=False,
                   EVAL_MAX_SECONDS="0.05", EVAL_AUTO_STRIDE="0")
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr
    assert re.fullmatch(r"error: eval_sliding: projected [\d.]+s at stride 8 \(368 windows, [\d.]+ms/batch, [\d.]+s "
                        r"elapsed\), 0.0s left of EVAL_MAX_SECONDS: raise EVAL_STRIDE or set EVAL_AUTO_STRIDE=1", lines[0]), lines[0]
    assert ROUNDTRIP_RE.search(proc.stdout) and not SLIDING_RE.search(proc.stdout)


def test_score_cli_auto_stride_recovers_within_what_load_and_roundtrip_left(
        tiny_artifact, tiny_dataset, sp1024_model, monkeypatch, capsys):
    """EVAL_AUTO_STRIDE=1: the guard trips at stride 8 and the eval restarts at the smallest stride
    that fits what is left of EVAL_MAX_SECONDS after loading (+0.3 s injected) and the roundtrip
    (+0.2 s). The sliding eval runs on a per-batch clock (100 s a batch) so the stride is exact."""
    import time

    import eval.__main__ as cli
    from test_eval_support import BatchClock, expected_auto_stride

    clock, budgets = BatchClock(100.0), []
    cli._import_evals()  # the CLI imports the evals (and torch) only once its inputs are checked
    load, roundtrip, sliding = cli._load_model, cli.eval_roundtrip, cli.eval_sliding

    def slow_load(*args, **kwargs):
        time.sleep(0.3)
        model, config, meta = load(*args, **kwargs)
        model.head_logits = clock.wrap(model.head_logits)  # once per scoring batch
        return model, config, meta

    def slow_roundtrip(*args, **kwargs):
        time.sleep(0.2)
        return roundtrip(*args, **kwargs)

    def spy(*args, **kwargs):
        budgets.append(kwargs["max_seconds"])
        return sliding(*args, clock=clock, **kwargs)

    monkeypatch.setattr(cli, "_load_model", slow_load)
    monkeypatch.setattr(cli, "eval_roundtrip", slow_roundtrip)
    monkeypatch.setattr(cli, "eval_sliding", spy)
    monkeypatch.setenv("EVAL_MAX_SECONDS", "1950")
    monkeypatch.setenv("EVAL_AUTO_STRIDE", "1")
    t0 = time.perf_counter()
    assert cli.main(["score", "--artifact", str(tiny_artifact), "--data-path", str(tiny_dataset), "--tokenizer",
                     str(sp1024_model), "--seq-len", "64", "--stride", "8", "--batch-seqs", "16",
                     "--val-max-tokens", "4096"]) == 0
    wall = time.perf_counter() - t0
    assert len(budgets) == 1 and 1950 - wall <= budgets[0] <= 1950 - 0.5  # load + roundtrip deducted
    stride = expected_auto_stride(4096, 64, 8, 16, budgets[0], 100.0)
    assert 8 < stride < 64
    out = capsys.readouterr().out
    assert f"eval_sliding: stride 8 -> {stride}" in out
    m = SLIDING_RE.search(out)
    assert m and m[3] == str(stride), out


def test_score_cli_refuses_a_tokenizer_not_the_datas_even_when_the_artifact_records_none(
        tiny_artifact, tiny_dataset, sp1024_model, tmp_path):
    """Before: an artifact without run metadata was scored with any same-vocab tokenizer (3.7515 vs
    3.5241); now the data's manifest binds it (shards/format.py verify_dataset), in one line."""
    data = shutil.copytree(tiny_dataset, tmp_path / "data")
    manifest = json.loads((data / "manifest.json").read_text())
    manifest["tokenizer_sha256"] = "e" * 64
    (data / "manifest.json").write_text(json.dumps(manifest))
    proc = run_cli("score", "--artifact", tiny_artifact, "--data-path", data, "--tokenizer", sp1024_model,
                   "--seq-len", "64", check=False)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    assert re.fullmatch(r"error: TOKENIZER_PATH='\S+': sha256 [0-9a-f]{16}\.\.\. is not the tokenizer_sha256 e{16}\.\.\. "
                        r"of \S+/manifest.json; expected the tokenizer the data was made with \(.*\)\n", proc.stderr)


def test_score_cli_errors_are_clear(tiny_artifact, tiny_dataset, sp1024_model, tmp_path):
    bad = tmp_path / "bad.ptz"
    bad.write_bytes(tiny_artifact.read_bytes()[:-100])
    proc = run_cli("score", "--artifact", bad, "--data-path", tiny_dataset, "--tokenizer", sp1024_model, check=False)
    assert proc.returncode == 2 and "bad.ptz" in proc.stderr and "Traceback" not in proc.stderr


@pytest.mark.slow
def test_score_cli_reproduces_the_training_run_from_the_artifact_alone(tiny_dataset, sp1024_model, shared_dir, tmp_path):
    """Issue 12: a seq-64 run's artifact, scored with no flag but the data and the tokenizer, gives the
    run's numbers (the old CLI assumed seq 2048); a different tokenizer is refused by name."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PRESET", "RUN_ID", "EVAL_", "VAL_"))}
    env.update(PRESET="smoke", NUM_LAYERS="2", MODEL_DIM="64", NUM_HEADS="2", NUM_KV_HEADS="1", ROPE_DIMS="16",
               XSA_LAST_N="1", TRAIN_SEQ_LEN="64", TRAIN_BATCH_TOKENS="1024", ITERATIONS="6", MAX_WALLCLOCK_SECONDS="0",
               EVAL_STRIDE="32", EVAL_BATCH_SEQS="32", VAL_BATCH_SIZE="8192", SEED="11",
               DATA_PATH=str(tiny_dataset), TOKENIZER_PATH=str(sp1024_model), OUT_DIR=str(tmp_path), RUN_ID="score",
               OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
    proc = subprocess.run([sys.executable, str(REPO / "train_gpt.py")], env=env, cwd=REPO, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    log = (tmp_path / "score" / "train.log").read_text()
    logged_rt, logged_sl = ROUNDTRIP_RE.search(log), SLIDING_RE.search(log)
    assert logged_rt and logged_sl, log[-2000:]
    result = json.loads((tmp_path / "score" / "result.json").read_text())
    artifact = tmp_path / "score" / "final_model.ptz"
    from quant.artifact import load_artifact

    meta = load_artifact(artifact)[2]
    assert meta["format_version"] == 3 and meta["run"].items() >= dict(
        train_seq_len=64, vocab_size=1024, eval_stride=32,
        tokenizer_sha256=hashlib.sha256(Path(sp1024_model).read_bytes()).hexdigest()).items()
    assert meta["run"]["ttt"]["enabled"] == 0  # and the TTT settings it would score with
    out = run_cli("score", "--artifact", artifact, "--data-path", tiny_dataset, "--tokenizer", sp1024_model).stdout
    rt, sl = ROUNDTRIP_RE.search(out), SLIDING_RE.search(out)
    assert rt and sl and "seq_len:64 " in out, out
    for got, logged in ((rt, logged_rt), (sl, logged_sl)):
        assert abs(float(got[1]) - float(logged[1])) <= 1e-6 and abs(float(got[2]) - float(logged[2])) <= 1e-6, (got[0], logged[0])
    assert abs(float(sl[2]) - result["val_bpb_sliding"]) <= 1e-6
    assert sl[3] == logged_sl[3] == "32"
    # another tokenizer: refused before any scoring, both sha256 named
    other = tmp_path / "other.model"
    if shared_dir is not None and (shared_dir / "data/tokenizers/fineweb_2048_bpe.model").is_file():
        shutil.copyfile(shared_dir / "data/tokenizers/fineweb_2048_bpe.model", other)
    else:
        other.write_bytes(Path(sp1024_model).read_bytes() + b"\0")
    bad = run_cli("score", "--artifact", artifact, "--data-path", tiny_dataset, "--tokenizer", other, check=False)
    assert bad.returncode == 2 and "Traceback" not in bad.stderr and "final_" not in bad.stdout
    assert (f"tokenizer {other} has sha256 {hashlib.sha256(other.read_bytes()).hexdigest()}, but the artifact "
            f"{artifact} was trained with a tokenizer of sha256 {meta['run']['tokenizer_sha256']}") in bad.stderr
