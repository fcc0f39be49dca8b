"""Bad input is refused before the clock starts, with a message naming the input (issue 6)."""

import re
import shutil
import struct
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from model.attention import resolve_attention_backend

from trainer.checks import check_inputs

from trainer.context import RunContext

from primitives.settings import warn_unknown_settings

from primitives.settings import Hyperparameters

REPO = Path(__file__).resolve().parents[1]


def ctx(tmp_path, world_size=1):
    return RunContext(rank=0, world_size=world_size, local_rank=0, device=torch.device("cpu"), run_dir=tmp_path)


def hp_for(dataset, tokenizer, **env):
    base = {"PRESET": "smoke", "DATA_PATH": str(dataset), "TOKENIZER_PATH": str(tokenizer), "VOCAB_SIZE": "1024"}
    return Hyperparameters.from_env({**base, **{k: str(v) for k, v in env.items()}}, log=lambda *_: None)


@pytest.mark.parametrize("name,value,expected", [
    ("MATRIX_LR", "-0.1", "MATRIX_LR=-0.1: expected a finite number >= 0"),
    ("NUM_LAYERS", "eight", "NUM_LAYERS='eight': expected a whole number"),
    ("NUM_LAYERS", "2.5", "NUM_LAYERS='2.5': expected a whole number"),
    ("EMA_DECAY", "nan", r"EMA_DECAY=nan: expected a finite number in \[0, 1\)"),
    ("TIE_EMBEDDINGS", "maybe", "TIE_EMBEDDINGS='maybe': expected 0/1/true/false"),
    ("PRESET", "4xh100", "PRESET='4xh100'"),
    ("NUM_KV_HEADS", "3", "NUM_HEADS=8: expected a multiple of NUM_KV_HEADS=3"),
    ("ROPE_DIMS", "65", "ROPE_DIMS=65: expected even and <= head_dim=64"),
    ("EVAL_STRIDE", "0", "EVAL_STRIDE=0: expected a whole number >= 1"),
    ("ATTN_BACKEND", "xformers", "ATTN_BACKEND='xformers': expected one of auto, fa3, fa4, fa2, sdpa"),
    ("VOCAB_SIZE", "70000", r"VOCAB_SIZE=70000: expected a whole number in \[1, 65536\]"),
])
def test_bad_setting_raises_value_error_naming_the_variable(name, value, expected):
    with pytest.raises(ValueError, match=expected):
        Hyperparameters.from_env({name: value}, log=lambda *_: None)


def test_preset_defaults_and_explicit_override():
    hp = Hyperparameters.from_env({"PRESET": "8xh100", "NUM_LAYERS": "12"}, log=lambda *_: None)
    assert hp.num_layers == 12 and hp.train_batch_tokens == 786_432 and hp.xsa_last_n == 4
    smoke = Hyperparameters.from_env({"PRESET": "smoke"}, log=lambda *_: None)
    assert (smoke.num_layers, smoke.model_dim, smoke.train_seq_len, smoke.train_batch_tokens) == (4, 256, 256, 8192)
    assert (smoke.max_wallclock_seconds, smoke.expected_steps) == (240.0, 150)
    default = Hyperparameters.from_env({}, log=lambda *_: None)
    assert (default.preset, default.num_layers, default.xsa_last_n, default.vocab_size) == ("1xh100-sp8192", 7, 7, 8192)
    assert (default.train_seq_len, default.eval_stride, default.qk_gain_init, default.matrix_lr) == (2048, 64, 4.0, 0.025)
    assert default.data_path.endswith("fineweb10B_sp8192") and default.tokenizer_path.endswith("fineweb_8192_bpe.model")
    sp4096 = Hyperparameters.from_env({"PRESET": "1xh100-sp4096"}, log=lambda *_: None)
    assert (sp4096.num_layers, sp4096.xsa_last_n, sp4096.vocab_size, sp4096.qk_gain_init) == (8, 2, 4096, 3.0)
    assert Hyperparameters.from_env({"PRESET": "1xh100"}, log=lambda *_: None).num_layers == 8


def test_train_shards_holding_fewer_tokens_than_the_run_reads_warn(tiny_dataset, sp1024_model, tmp_path, capsys):
    from shards.format import list_shards, read_shard_header
    from trainer.checks import check_train_tokens

    held = sum(read_shard_header(p) for p in list_shards(tiny_dataset, "train"))
    logs = []
    steps = held // 8192  # smoke: 8,192 tokens per step; the wallclock run is EXPECTED_STEPS long
    assert check_train_tokens(hp_for(tiny_dataset, sp1024_model, EXPECTED_STEPS=steps), logs.append) == (held, steps * 8192)
    assert logs == []
    over = hp_for(tiny_dataset, sp1024_model, EXPECTED_STEPS=steps + 1)
    assert check_train_tokens(over, logs.append) == (held, (steps + 1) * 8192)
    assert logs == [f"WARNING: the train shards of DATA_PATH={tiny_dataset} hold {held:,} tokens; this run reads about "
                    f"{(steps + 1) * 8192:,} ({steps + 1} steps x TRAIN_BATCH_TOKENS=8,192) and will repeat data, which "
                    f"costs bpb; `tools/prepare_data.py fineweb --train-shards 1` covers it with 20% margin (100M tokens per shard)"]
    capsys.readouterr()  # without a wallclock cap the run is ITERATIONS long; check_inputs logs the warning
    check_inputs(hp_for(tiny_dataset, sp1024_model, MAX_WALLCLOCK_SECONDS=0, ITERATIONS=steps + 1), ctx(tmp_path))
    assert f"WARNING: the train shards of DATA_PATH={tiny_dataset} hold {held:,} tokens" in capsys.readouterr().out
    check_inputs(hp_for(tiny_dataset, sp1024_model, MAX_WALLCLOCK_SECONDS=0, ITERATIONS=steps), ctx(tmp_path))
    assert "WARNING: the train shards" not in capsys.readouterr().out


def test_unknown_lookalike_env_var_warns_with_a_suggestion():
    lines = []
    unknown = warn_unknown_settings({"MATRIX_LRR": "0.1", "MUON_WEIGHT_DECAY": "0.1", "HOME": "/root",
                                "MATRIX_LR": "0.02", "PATH": "/bin", "OMP_NUM_THREADS": "1"}, log=lines.append)
    assert unknown == ["MATRIX_LRR", "MUON_WEIGHT_DECAY"]
    assert "did you mean MATRIX_LR?" in lines[0]


def test_batch_not_divisible_by_world_accum_seq():
    hp = Hyperparameters.from_env({"PRESET": "smoke", "TRAIN_BATCH_TOKENS": "8448"}, log=lambda *_: None)
    with pytest.raises(ValueError, match=r"TRAIN_BATCH_TOKENS=8448: expected a multiple of world_size\(2\)"):
        hp.resolve_grad_accum(world_size=2, is_cuda=False)
    assert Hyperparameters.from_env({"PRESET": "smoke"}, log=lambda *_: None).resolve_grad_accum(2, False) == 1


def test_flash_attn_forced_without_cuda():
    with pytest.raises(ValueError, match="ATTN_BACKEND='fa3': flash-attn needs CUDA"):
        resolve_attention_backend("fa3", torch.device("cpu"))
    assert resolve_attention_backend("auto", torch.device("cpu")) == "sdpa"


def test_missing_data_dir_and_tokenizer(tiny_dataset, sp1024_model, tmp_path):
    with pytest.raises(ValueError, match="DATA_PATH='/nonexistent/data': no such file or folder"):
        check_inputs(hp_for("/nonexistent/data", sp1024_model), ctx(tmp_path))
    with pytest.raises(ValueError, match="TOKENIZER_PATH='/nonexistent/tok.model': no such file or folder"):
        check_inputs(hp_for(tiny_dataset, "/nonexistent/tok.model"), ctx(tmp_path))


def test_tokenizer_vocab_must_match(tiny_dataset, sp1024_model, tmp_path):
    with pytest.raises(ValueError, match="VOCAB_SIZE=2048: the tokenizer .* has 1024 ids"):
        check_inputs(hp_for(tiny_dataset, sp1024_model, VOCAB_SIZE=2048), ctx(tmp_path))


def test_a_record_file_refuses_the_kit_features(tiny_dataset, sp1024_model, tmp_path, monkeypatch):
    """A record's train_gpt.py (no kit/) refuses CHECKPOINT_EVERY, RESUME and SAVE_PREQUANT before the clock."""
    import trainer.checks

    monkeypatch.setattr(trainer.checks, "BUNDLE_KIND", "packed")
    for name in ("CHECKPOINT_EVERY", "RESUME", "SAVE_PREQUANT"):
        with pytest.raises(ValueError, match=r"^CHECKPOINT_EVERY/RESUME/SAVE_PREQUANT: expected the kit's repo"):
            check_inputs(hp_for(tiny_dataset, sp1024_model, **{name: 1}), ctx(tmp_path))
    assert check_inputs(hp_for(tiny_dataset, sp1024_model), ctx(tmp_path))[2] > 0  # none of them: the checks pass


def test_val_split_shorter_than_one_sequence(tiny_dataset, sp1024_model, tmp_path):
    from shards.format import load_validation_tokens

    num_val = load_validation_tokens(tiny_dataset).numel()
    hp = hp_for(tiny_dataset, sp1024_model, TRAIN_SEQ_LEN=num_val, TRAIN_BATCH_TOKENS=num_val)
    with pytest.raises(ValueError, match=f"val split has {num_val} tokens, fewer than one sequence"):
        check_inputs(hp, ctx(tmp_path))


def copy_dataset(src, dst):
    shutil.copytree(src, dst)
    return dst


def corrupt_first(path: Path, split: str, how: str, which: int = 0) -> Path:
    """Damage shard number `which` (0: the first, -1: the last) of `split` in the dataset at `path`."""
    shard = sorted(path.glob(f"fineweb_{split}_*.bin"))[which]
    raw = bytearray(shard.read_bytes())
    if how == "magic":
        raw[0:4] = struct.pack("<i", 12345)
    elif how == "version":
        raw[4:8] = struct.pack("<i", 7)
    elif how == "truncated":
        raw = raw[: len(raw) - 10]
    elif how == "big_id":
        raw[1024 + 2 * 5: 1024 + 2 * 6] = struct.pack("<H", 5000)
    shard.write_bytes(bytes(raw))
    return shard


@pytest.mark.parametrize("split", ["val", "train"])
@pytest.mark.parametrize("how,message", [("magic", "magic"), ("version", "version"), ("truncated", "bytes")])
def test_damaged_shards_are_refused_naming_the_file(tiny_dataset, sp1024_model, tmp_path, split, how, message):
    from shards.loader import DistributedTokenLoader

    data = copy_dataset(tiny_dataset, tmp_path / "data")
    shard = corrupt_first(data, split, how)
    # the pre-clock check and the loader each refuse it on their own (one call per pytest.raises:
    # a second line there would never run)
    with pytest.raises(ValueError, match=message) as err:
        check_inputs(hp_for(data, sp1024_model), ctx(tmp_path))
    assert shard.name in str(err.value)
    if split == "train":  # the loader checks every header up front, not only the first shard it opens
        data = copy_dataset(tiny_dataset, tmp_path / "data_last")
        shard = corrupt_first(data, split, how, which=-1)
        with pytest.raises(ValueError, match=message) as err:
            DistributedTokenLoader(str(data), 1024)
        assert shard.name in str(err.value)


def test_token_id_beyond_vocab_is_refused(tiny_dataset, sp1024_model, tmp_path):
    from shards.format import load_validation_tokens
    from shards.loader import DistributedTokenLoader

    data = copy_dataset(tiny_dataset, tmp_path / "data")
    corrupt_first(data, "train", "big_id")
    with pytest.raises(ValueError, match="5000"):
        DistributedTokenLoader(str(data), 1024)
    corrupt_first(data, "val", "big_id")
    with pytest.raises(ValueError, match="5000"):
        load_validation_tokens(str(data), vocab_size=1024)


def broken_dataset(tiny_dataset, tmp_path, *, manifest: bool, split: str, how: str) -> Path:
    """A copy of the tiny dataset with or without manifest.json whose `split` shards are deleted
    (how="missing") or hold no tokens (how="empty"). The official HF export has no manifest."""
    from shards.format import write_data_shard

    data = copy_dataset(tiny_dataset, tmp_path / "data")
    if not manifest:
        (data / "manifest.json").unlink()
    for shard in data.glob(f"fineweb_{split}_*.bin"):
        shard.unlink()
        if how == "empty":
            write_data_shard(shard, np.zeros(0, dtype=np.uint16))
    return data


@pytest.mark.parametrize("manifest", [False, True])
@pytest.mark.parametrize("how", ["missing", "empty"])
def test_empty_or_missing_val_split_is_a_value_error(tiny_dataset, sp1024_model, tmp_path, manifest, how):
    data = broken_dataset(tiny_dataset, tmp_path, manifest=manifest, split="val", how=how)
    with pytest.raises(ValueError, match=str(data)):
        check_inputs(hp_for(data, sp1024_model), ctx(tmp_path))


@pytest.mark.slow
@pytest.mark.parametrize("manifest, split, how, expected", [
    (False, "val", "missing", "DATA_PATH={data}: no fineweb_val_*.bin"),
    (False, "val", "empty", "val shards in DATA_PATH={data}: max id -1"),
    (False, "train", "missing", "DATA_PATH={data}: no fineweb_train_*.bin"),
    (True, "val", "missing", "manifest {data}/manifest.json: "),
])
def test_data_errors_exit_2_with_one_line_through_the_cli(tiny_dataset, sp1024_model, tmp_path, manifest, split, how,
                                                          expected):
    """Before the fix a dataset without manifest.json and without val shards ended in a
    FileNotFoundError traceback and exit 1."""
    data = broken_dataset(tiny_dataset, tmp_path, manifest=manifest, split=split, how=how)
    env = {"PATH": "/usr/bin:/bin", "PRESET": "smoke", "DATA_PATH": str(data), "TOKENIZER_PATH": str(sp1024_model),
           "OUT_DIR": str(tmp_path / "runs"), "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, str(REPO / "train_gpt.py")], env=env, cwd=REPO, capture_output=True,
                          text=True, timeout=300)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr[-3000:]
    assert lines[0].startswith("error: " + expected.format(data=data)), lines[0]


def test_cli_exits_nonzero_with_the_message_and_no_traceback(tmp_path):
    env = {"PATH": "/usr/bin:/bin", "PRESET": "smoke", "NUM_LAYERS": "-1", "OUT_DIR": str(tmp_path)}
    proc = subprocess.run([sys.executable, str(REPO / "train_gpt.py")], env=env, cwd=REPO, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 2
    assert proc.stderr == "error: NUM_LAYERS=-1: expected a whole number >= 1\n"  # one line: no relation on it repeats it
    assert "Traceback" not in proc.stderr


@pytest.mark.parametrize("run_id", ["../../escaped_run", "a/b", "/tmp/abs", "..", ".", "a\\b", ""])
def test_run_id_that_is_not_a_folder_name_is_refused(run_id):
    expected = f"RUN_ID={run_id!r}: expected a folder name: no '/' or '\\', not empty or dots"
    with pytest.raises(ValueError) as err:
        Hyperparameters.from_env({"RUN_ID": run_id}, log=lambda *_: None)
    assert str(err.value) == expected


def test_run_id_defaults_to_a_fresh_name_and_keeps_a_plain_one():
    assert Hyperparameters.from_env({"RUN_ID": "seed1.v2_a-b"}, log=lambda *_: None).run_id == "seed1.v2_a-b"
    fresh = Hyperparameters.from_env({"PRESET": "smoke"}, log=lambda *_: None).run_id
    assert re.fullmatch(r"smoke_[0-9a-f]{8}", fresh)


def test_escaping_run_id_writes_nothing(tmp_path):
    """RUN_ID=../../escaped_run used to train and write train.log and the artifact outside runs/."""
    work = tmp_path / "a" / "b"
    work.mkdir(parents=True)
    env = {"PATH": "/usr/bin:/bin", "PRESET": "smoke", "RUN_ID": "../../escaped_run", "OUT_DIR": "runs"}
    proc = subprocess.run([sys.executable, str(REPO / "train_gpt.py")], env=env, cwd=work, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert "error: RUN_ID='../../escaped_run': expected a folder name" in proc.stderr
    assert sorted(p.relative_to(tmp_path).as_posix() for p in tmp_path.rglob("*")) == ["a", "a/b"]


def test_a_path_setting_starting_with_tilde_is_expanded(monkeypatch, tmp_path):
    """Before: OUT_DIR="~/runs" (quoted: the shell leaves ~ alone) made a literal `~` folder in the repo."""
    monkeypatch.setenv("HOME", str(tmp_path))
    hp = Hyperparameters.from_env({"OUT_DIR": "~/runs", "DATA_PATH": "~/data", "TOKENIZER_PATH": "~/t.model",
                                   "RUN_ID": "r"}, log=lambda *_: None)
    assert (hp.out_dir, hp.data_path, hp.tokenizer_path) == (f"{tmp_path}/runs", f"{tmp_path}/data", f"{tmp_path}/t.model")
    with pytest.raises(ValueError, match=r"^OUT_DIR='~nosuchuser_pg/x': '~' cannot be expanded here"):
        Hyperparameters.from_env({"OUT_DIR": "~nosuchuser_pg/x"}, log=lambda *_: None)


def test_default_micro_batch_on_cuda_is_64_sequences_on_one_gpu_and_the_official_one_on_eight():
    """GRAD_ACCUM_STEPS=0 on CUDA: 4 micro-steps on one GPU (64 x 2048 tokens each, measured faster than the
    official script's 32), 1 on eight GPUs as the official script; an explicit value wins."""
    hp = Hyperparameters.from_env({}, log=lambda *_: None)
    assert [hp.resolve_grad_accum(w, True) for w in (1, 2, 4, 8)] == [4, 2, 1, 1]
    assert hp.train_batch_tokens // (hp.resolve_grad_accum(1, True) * hp.train_seq_len) == 64
    assert Hyperparameters.from_env({"GRAD_ACCUM_STEPS": "8"}, log=lambda *_: None).resolve_grad_accum(1, True) == 8


def test_the_other_micro_batches_are_half_and_twice_the_resolved_one_where_the_batch_splits():
    hp = Hyperparameters.from_env({}, log=lambda *_: None)
    assert hp.micro_batch_seqs(1, True) == 64 and hp.micro_batch_seqs(8, True) == 32
    assert hp.other_micro_batches(1, True) == [(8, 32), (2, 128)]
    one = Hyperparameters.from_env({"GRAD_ACCUM_STEPS": "1"}, log=lambda *_: None)
    assert one.other_micro_batches(1, True) == [(2, 128)]  # half of 1 would be the default's 0
    four = Hyperparameters.from_env({"TRAIN_BATCH_TOKENS": str(4 * 2048), "GRAD_ACCUM_STEPS": "4"}, log=lambda *_: None)
    assert four.other_micro_batches(1, True) == [(2, 2)]  # 8 micro-steps would not be whole sequences
