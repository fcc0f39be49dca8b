"""The GPU presets (issue 15): their projected bytes fit, and the sp8192 one runs end to end on CPU."""

import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

import dataclasses

from primitives.presets import DEFAULT_PRESET, PRESETS
from primitives.settings import Hyperparameters

REPO = Path(__file__).resolve().parents[1]
GPU_PRESETS = [p for p in PRESETS if p != "smoke"]
GOLDEN_PRESETS = Path(__file__).resolve().parent / "golden" / "presets.json"
# settings added after the golden file was written (issue 24's TTT): every preset keeps the class default
ADDED_AFTER_THE_MOVE = ("ttt_enabled", "ttt_chunk_tokens", "ttt_epochs", "ttt_lr", "ttt_momentum", "ttt_grad_clip",
                        "ttt_batch_seqs", "ttt_params", "muon_ns_coeffs", "muon_row_normalize", "min_lr",
                        "wd_taper_start_frac", "wd_taper_final_mult", "smear_gate_enabled", "sparse_attn_gate_enabled",
                        "sparse_attn_gate_scale", "gate_window", "num_loops", "loop_start", "loop_end", "enable_looping_at", "ttt_mode", "ttt_phases",
                        "loss_kernel", "ttt_lora_rank", "ttt_lora_lr", "ttt_lora_chunk_tokens",
                        "ttt_lora_batch_docs", "doc_packed_attention", "ln_scale", "skip_gates_enabled",
                        "parallel_start_layer", "parallel_final_lane", "embed_wd", "ema_warmup", "muon_form",
                        "ttt_prefix_docs", "ttt_global_epochs", "ttt_lora_alpha", "ttt_lora_wd", "ttt_lora_beta1",
                        "ttt_lora_beta2", "ttt_lora_k", "ttt_lora_mlp", "ttt_lora_o", "gptq_calib_cross_docs",
                        "caseops_enabled")


def test_every_preset_resolves_as_before_the_package_move():
    """tests/golden/presets.json holds every preset's resolved settings from before issue 21 (when the
    presets were absolute and the class defaults were `1xh100`'s): the move to deltas from the default
    preset changed no value."""
    golden = json.loads(GOLDEN_PRESETS.read_text())
    assert sorted(golden) == sorted(PRESETS)
    for preset, values in golden.items():
        hp = dataclasses.asdict(Hyperparameters.from_env({"PRESET": preset, "RUN_ID": "x"}, log=lambda *_: None))
        added = {k: hp.pop(k) for k in ADDED_AFTER_THE_MOVE if k not in values}  # a later preset lists those it sets
        assert added == {k: Hyperparameters.__dataclass_fields__[k].default for k in added}, preset
        assert hp == values, preset
        assert [type(hp[k]) for k in sorted(hp)] == [type(values[k]) for k in sorted(values)], preset  # 2 vs 2.0


def test_class_defaults_are_the_default_preset():
    """Reading the dataclass tells you what runs: no field differs from PRESET=<default> but the run id."""
    defaults = dataclasses.asdict(Hyperparameters(run_id="x"))
    assert PRESETS[DEFAULT_PRESET] == {} and defaults["preset"] == DEFAULT_PRESET
    assert defaults == dataclasses.asdict(Hyperparameters.from_env({"RUN_ID": "x"}, log=lambda *_: None))


@pytest.mark.parametrize("preset", GPU_PRESETS)
def test_every_gpu_preset_projects_under_the_byte_budget(preset, capsys, monkeypatch):
    """`python -m quant estimate` under PRESET: the fit's bits, the estimate x QUANT_ESTIMATE_SCALE, plus
    the packed code, within 16,000,000 bytes; sp8192 keeps int8 everywhere (PR #1617 measured 15.82 MB)."""
    from quant.__main__ import quant_cli

    monkeypatch.setenv("PRESET", preset)
    assert quant_cli(["estimate", "--code-bytes", "30000"]) == 0
    out = capsys.readouterr().out
    total = int(re.search(r"= ([\d,]+) bytes; budget 16,000,000: fits", out).group(1).replace(",", ""))
    assert 15_000_000 < total <= 16_000_000
    if preset == "1xh100-sp8192":
        scale = Hyperparameters.from_env({"PRESET": preset}, log=lambda *_: None).quant_estimate_scale
        assert "quant_fit: 0 steps" in out and re.search(r"tensors per bits int8:\d+\n", out)
        assert f"(the table x QUANT_ESTIMATE_SCALE {scale:g})" in out


def sp8192_dataset(real_text_docs, shared_dir, root):
    from tools.data.data_shards import prepare_jsonl_dataset

    model = shared_dir / "data/tokenizers/fineweb_8192_bpe.model"
    text = root / "docs.jsonl"
    text.write_text("".join(json.dumps({"text": d}) + "\n" for d in real_text_docs), encoding="utf-8")
    prepare_jsonl_dataset([text], model, root / "sp8192", num_val_docs=20, shard_tokens=65_536, progress=False,
                          log=lambda msg: None)
    return root / "sp8192", model


@pytest.mark.slow
def test_sp8192_preset_runs_end_to_end_on_cpu(real_text_docs, shared_dir, tmp_path):
    """PRESET=1xh100-sp8192 with CPU-sized overrides (d 64, seq 64, 6 steps) on shards of ../shared text
    made with the challenge's fineweb_8192_bpe.model: 7 layers, XSA on all, QK gain 4, no EMA, int8."""
    if shared_dir is None or not (shared_dir / "data/tokenizers/fineweb_8192_bpe.model").is_file():
        pytest.skip("needs ../shared/data/tokenizers/fineweb_8192_bpe.model")

    data, model = sp8192_dataset(real_text_docs, shared_dir, tmp_path)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PRESET", "RUN_ID"))}
    env.update(PRESET="1xh100-sp8192", DATA_PATH=str(data), TOKENIZER_PATH=str(model), OUT_DIR=str(tmp_path / "runs"),
               RUN_ID="sp8192", MODEL_DIM="64", ROPE_DIMS="4", TRAIN_SEQ_LEN="64", TRAIN_BATCH_TOKENS="1024",
               ITERATIONS="6", MAX_WALLCLOCK_SECONDS="0", VAL_MAX_TOKENS="4096", EVAL_AUTO_STRIDE="0",
               EVAL_STRIDE="32", EVAL_BATCH_SEQS="16", VAL_BATCH_SIZE="4096", GPTQ_CALIB_BATCHES="4",
               WARMUP_STEPS="0", PARALLEL_RESIDUAL_START="5", OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
    proc = subprocess.run([sys.executable, str(REPO / "train_gpt.py")], env=env, cwd=REPO, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads((tmp_path / "runs/sp8192/result.json").read_text())
    hp = result["hyperparameters"]
    assert result["preset"] == "1xh100-sp8192" and result["status"] == "ok" and result["steps"] == 6
    assert (hp["vocab_size"], hp["num_layers"], hp["xsa_last_n"], hp["qk_gain_init"], hp["matrix_lr"]) == (8192, 7, 7, 4.0, 0.025)
    for key in ("val_bpb_prequant", "val_bpb_roundtrip", "val_bpb_sliding"):
        assert math.isfinite(result[key]) and 0 < result[key] < 20, key
    assert abs(result["val_bpb_roundtrip"] - result["val_bpb_prequant"]) < 0.05
    assert result["bytes_total"] == result["bytes_model"] + result["bytes_code"] < 16_000_000
    log = (tmp_path / "runs/sp8192/train.log").read_text()
    # int8 everywhere: 7 layers x 6 block matrices + the 8192 x 64 tied embedding
    assert "quant_fit: 0 steps" in log and "tensors per bits int8:43" in log
    assert "muon_momentum:0.8500->0.9500 ema_decay:0.00000" in log and "warmdown_steps:1 qat_steps:1 " in log
    from quant.artifact import load_artifact  # the eval rebuilds GPT(**config) from the artifact

    config = load_artifact(tmp_path / "runs/sp8192/final_model.ptz")[1]
    assert config["parallel_residual_start"] == 5 and config["vocab_size"] == 8192
