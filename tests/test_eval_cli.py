"""`python -m eval bytes` and `python -m eval score` (from the artifact on disk), as a user runs them."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from eval.offline import load_sentencepiece_luts
from eval.roundtrip import eval_roundtrip
from eval.shards import load_validation_tokens
from eval.sliding import eval_sliding
from test_eval_bpb import decode_bytes

REPO = Path(__file__).resolve().parents[1]
ROUNDTRIP_RE = re.compile(r"^final_roundtrip_exact val_loss:(\S+) val_bpb:(\S+)$", re.M)
SLIDING_RE = re.compile(r"^final_sliding_window_exact val_loss:(\S+) val_bpb:(\S+) stride:(\d+) eval_time:(\d+)ms$", re.M)


def run_cli(*args, timeout=300, check=True):
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
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
    artifact = pytest.importorskip("quant.artifact")
    train_gpt = pytest.importorskip("train_gpt")
    config = dict(vocab_size=1024, num_layers=2, model_dim=64, num_heads=2, num_kv_heads=1, mlp_mult=2,
                  rope_dims=16, xsa_last_n=1)
    torch.manual_seed(0)
    model = train_gpt.GPT(**config)
    model.init_weights(0.05)
    path = tmp_path_factory.mktemp("artifact") / "final_model.ptz"
    state = {k: v.detach().float() for k, v in model.state_dict().items()}
    artifact.export_artifact(state, config, path, code_bytes=0, log=lambda msg: None)
    return path


def test_score_cli_rebuilds_the_model_from_the_artifact(tiny_artifact, tiny_dataset, sp1024_model):
    from quant.artifact import load_artifact
    from train_gpt import GPT

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


def test_score_cli_errors_are_clear(tiny_artifact, tiny_dataset, tmp_path):
    bad = tmp_path / "bad.ptz"
    bad.write_bytes(tiny_artifact.read_bytes()[:-100])
    proc = run_cli("score", "--artifact", bad, "--data-path", tiny_dataset, "--tokenizer", tmp_path / "none.model", check=False)
    assert proc.returncode == 2 and "bad.ptz" in proc.stderr and "Traceback" not in proc.stderr


@pytest.mark.slow
def test_score_cli_reproduces_the_training_run(tiny_dataset, sp1024_model, tmp_path):
    if not (REPO / "train_gpt.py").is_file() or not (REPO / "quant" / "artifact.py").is_file():
        pytest.skip("needs train_gpt.py and quant/artifact.py")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PRESET", "RUN_ID", "EVAL_", "VAL_"))}
    env.update(PRESET="smoke", NUM_LAYERS="2", MODEL_DIM="64", NUM_HEADS="2", NUM_KV_HEADS="1", ROPE_DIMS="16",
               XSA_LAST_N="1", TRAIN_SEQ_LEN="64", TRAIN_BATCH_TOKENS="1024", ITERATIONS="6", MAX_WALLCLOCK_SECONDS="0",
               VAL_MAX_TOKENS="6000", EVAL_STRIDE="16", EVAL_BATCH_SEQS="8", VAL_BATCH_SIZE="2048", SEED="11",
               DATA_PATH=str(tiny_dataset), TOKENIZER_PATH=str(sp1024_model), OUT_DIR=str(tmp_path), RUN_ID="score",
               OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
    proc = subprocess.run([sys.executable, str(REPO / "train_gpt.py")], env=env, cwd=REPO, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    log = (tmp_path / "score" / "train.log").read_text()
    logged_rt, logged_sl = ROUNDTRIP_RE.search(log), SLIDING_RE.search(log)
    assert logged_rt and logged_sl, log[-2000:]
    result = json.loads((tmp_path / "score" / "result.json").read_text())
    seq_len = result["hyperparameters"]["train_seq_len"]
    out = run_cli("score", "--artifact", tmp_path / "score" / "final_model.ptz", "--data-path", tiny_dataset,
                  "--tokenizer", sp1024_model, "--seq-len", seq_len, "--stride", logged_sl[3], "--batch-seqs", 13,
                  "--val-max-tokens", 6000).stdout
    rt, sl = ROUNDTRIP_RE.search(out), SLIDING_RE.search(out)
    assert rt and sl, out
    for got, logged in ((rt, logged_rt), (sl, logged_sl)):
        assert abs(float(got[1]) - float(logged[1])) <= 1e-6 and abs(float(got[2]) - float(logged[2])) <= 1e-6, (got[0], logged[0])
    assert sl[3] == logged_sl[3] == "16"
