"""quant/artifact.py + codec.py + estimate.py + CLI: bit-exact round trips, damage, budget fitting."""

import json
import lzma
import os
import random
import struct
import subprocess
import sys
import tracemalloc
import zlib
from pathlib import Path

import pytest
import safetensors.torch
import torch
import zstandard

from quant.__main__ import quant_cli
from quant.artifact import decode_artifact, export_artifact, load_artifact, quant_byte_budget, quantize_state_dict
from quant.codec import (
    QUANT_ARTIFACT_MAGIC, QUANT_HEADER, quant_build_payload, quant_compress, quant_unwrap_container, quant_wrap_container,
)
from quant.core import dequantize_per_row, fake_quantize_per_row, quantize_per_row
from quant.estimate import estimate_artifact_bytes
from quant.policy import QuantPolicy

REPO = Path(__file__).resolve().parents[1]
CONFIG = {"vocab_size": 256, "num_layers": 2, "model_dim": 64, "note": "tiny"}
QUIET = dict(log=lambda msg: None)


def tiny_model_config(train_gpt, vocab_size=128):
    """A tiny GPT config built the trainer's way (follows its renames)."""
    env = {"NUM_LAYERS": "2", "MODEL_DIM": "32", "NUM_HEADS": "4", "NUM_KV_HEADS": "2", "ROPE_DIMS": "8",
           "XSA_LAST_N": "1", "VOCAB_SIZE": str(vocab_size), "MLP_MULT": "2"}
    return train_gpt.build_model_config(train_gpt.Hyperparameters.from_env(env, log=lambda msg: None))


def _state(num_layers=2, dim=64, vocab=256, mlp=3, seed=0):
    g = torch.Generator().manual_seed(seed)
    sd = {"tok_emb.weight": torch.randn(vocab, dim, generator=g) * 0.02,
          "skip_weights": torch.rand(num_layers // 2 or 1, dim, generator=g)}
    for i in range(num_layers):
        p = f"blocks.{i}."
        sd[p + "attn.c_q.weight"] = torch.randn(dim, dim, generator=g) * 0.05
        sd[p + "attn.c_k.weight"] = torch.randn(dim // 2, dim, generator=g) * 0.05
        sd[p + "attn.proj.weight"] = torch.randn(dim, dim, generator=g) * 0.05
        sd[p + "attn.q_gain"] = torch.full((4,), 1.5)
        sd[p + "mlp.fc.weight"] = torch.randn(mlp * dim, dim, generator=g) * 0.05
        sd[p + "mlp.proj.weight"] = torch.randn(dim, mlp * dim, generator=g) * 0.05
        sd[p + "attn_scale"] = torch.rand(dim, generator=g)
        sd[p + "resid_mix"] = torch.rand(2, dim, generator=g)
    return sd


@pytest.fixture(scope="module")
def artifact_bytes(tmp_path_factory):
    path = tmp_path_factory.mktemp("art") / "model.ptz"
    export_artifact(_state(), CONFIG, path, code_bytes=0, policy=QuantPolicy(compressor="zlib"), **QUIET)
    return path.read_bytes()


def _bits_equal(a, b):
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.view(torch.int32), b.view(torch.int32))


@pytest.mark.parametrize("packing", ["int8", "bits"])
@pytest.mark.parametrize("compressor", ["zlib", "zstd", "lzma"])
def test_export_load_is_bit_exact(tmp_path, packing, compressor):
    sd = _state()
    policy = QuantPolicy(packing=packing, compressor=compressor, mlp_bits=5)
    path = tmp_path / "m.ptz"
    report = export_artifact(sd, CONFIG, path, code_bytes=1234, policy=policy, **QUIET)
    assert report["bytes_model"] == path.stat().st_size and report["bytes_total"] == report["bytes_model"] + 1234
    assert (report["packing"], report["compressor"], report["fit_steps"]) == (packing, compressor, [])
    assert not list(tmp_path.glob("*.tmp"))
    loaded, config, meta = load_artifact(path)
    assert config == CONFIG and meta["packing"] == packing and meta["compressor"] == compressor
    assert QuantPolicy.from_dict(meta["policy"]) == policy
    assert list(loaded) == list(sd)
    entries, _ = quantize_state_dict(sd, policy)
    for name, t in sd.items():
        e = entries[name]
        if "bits" in e:
            expected = dequantize_per_row(e["q"], e["scale"]).reshape(t.shape)
            assert e["bits"] == (5 if ".mlp." in name else 6 if ".attn." in name else 8)
        else:
            expected = t.half().float()
        assert _bits_equal(loaded[name], expected), name


def test_all_encodings_decode_to_the_same_weights(tmp_path):
    sd, results = _state(seed=1), []
    for packing in ("int8", "bits"):
        for compressor in ("zlib", "zstd", "lzma"):
            export_artifact(sd, CONFIG, tmp_path / "m.ptz", code_bytes=0,
                            policy=QuantPolicy(packing=packing, compressor=compressor), **QUIET)
            results.append(load_artifact(tmp_path / "m.ptz")[0])
    for other in results[1:]:
        assert all(_bits_equal(results[0][k], other[k]) for k in sd)


def test_auto_keeps_the_smallest_candidate(tmp_path):
    report = export_artifact(_state(), CONFIG, tmp_path / "m.ptz", code_bytes=0, **QUIET)
    assert len(report["candidates"]) == 6
    assert report["bytes_model"] == min(report["candidates"].values())
    assert report["candidates"][f"{report['packing']}+{report['compressor']}"] == report["bytes_model"]
    assert report["policy"]["compressor"] == "auto"  # recorded: the file header holds the choice
    assert load_artifact(tmp_path / "m.ptz")[2]["compressor"] == report["compressor"]


def test_export_matches_qat_forward_without_clip_search(tmp_path):
    """With GPTQ-lite off, the artifact holds exactly what the QAT forward computed."""
    sd = _state(seed=2)
    export_artifact(sd, CONFIG, tmp_path / "m.ptz", code_bytes=0, policy=QuantPolicy(gptq_lite=False), **QUIET)
    loaded = load_artifact(tmp_path / "m.ptz")[0]
    for name in ("blocks.0.attn.c_q.weight", "blocks.1.mlp.proj.weight"):
        assert _bits_equal(loaded[name], fake_quantize_per_row(sd[name], 6))


def test_real_model_roundtrip(tmp_path):
    train_gpt = pytest.importorskip("train_gpt")
    config = tiny_model_config(train_gpt)
    torch.manual_seed(0)
    model = train_gpt.GPT(**config)
    if hasattr(model, "init_weights"):
        model.init_weights(0.02)
    sd = {k: v.detach().clone() for k, v in model.state_dict().items()}
    export_artifact(sd, config, tmp_path / "m.ptz", code_bytes=0, **QUIET)
    loaded, loaded_config, _ = load_artifact(tmp_path / "m.ptz")
    rebuilt = train_gpt.GPT(**loaded_config)
    rebuilt.load_state_dict(loaded, strict=True)
    x = torch.randint(0, 128, (2, 16))
    with torch.no_grad():
        ref, got = model.forward_logits(x), rebuilt.forward_logits(x)
    assert (got - ref).abs().max().item() < 0.05 * ref.abs().max().item() + 1e-3


def test_non_float_and_odd_tensors(tmp_path):
    sd = {"tok_emb.weight": torch.randn(16, 8), "step": torch.tensor([7], dtype=torch.int64),
          "blocks.0.mlp.fc.weight": torch.randn(4, 2, 3), "empty.weight": torch.zeros(0, 4), "scalar": torch.tensor(2.5)}
    export_artifact(sd, {}, tmp_path / "m.ptz", code_bytes=0, **QUIET)
    loaded = load_artifact(tmp_path / "m.ptz")[0]
    assert loaded["step"].dtype == torch.int64 and loaded["step"].tolist() == [7]
    assert loaded["blocks.0.mlp.fc.weight"].shape == (4, 2, 3) and loaded["empty.weight"].shape == (0, 4)
    assert loaded["scalar"].item() == 2.5


def test_bad_export_inputs(tmp_path):
    bad = _state()
    bad["blocks.0.mlp.fc.weight"][0, 0] = float("nan")
    with pytest.raises(ValueError, match="non-finite"):
        export_artifact(bad, CONFIG, tmp_path / "m.ptz", code_bytes=0, **QUIET)
    with pytest.raises(ValueError, match="model_config"):
        export_artifact(_state(), {"x": object()}, tmp_path / "m.ptz", code_bytes=0, **QUIET)
    with pytest.raises(ValueError, match="code_bytes"):
        export_artifact(_state(), CONFIG, tmp_path / "m.ptz", code_bytes=-1, **QUIET)
    with pytest.raises(ValueError, match="BYTE_BUDGET"):
        quant_byte_budget(None, {"BYTE_BUDGET": "16MB"})
    assert quant_byte_budget(None, {"BYTE_BUDGET": "1000"}) == 1000 and quant_byte_budget(None, {}) == 16_000_000
    assert not (tmp_path / "m.ptz").exists()


# ---------------------------------------------------------------- damaged files

def _expect_value_error(data: bytes):
    with pytest.raises(ValueError):
        decode_artifact(data)


def _rewrap(raw_payload: bytes, compressor="zlib", *, comp=None, raw_len=None, version=1, rotation=0):
    """A container with a VALID checksum around arbitrary (possibly broken) content."""
    comp = quant_compress(raw_payload, compressor) if comp is None else comp
    prefix = QUANT_HEADER.pack(QUANT_ARTIFACT_MAGIC, version, 1 + ("zlib", "zstd", "lzma").index(compressor),
                               len(raw_payload) if raw_len is None else raw_len, rotation, 0)[:14]
    return prefix + struct.pack("<I", zlib.crc32(comp, zlib.crc32(prefix))) + comp


def test_valid_file_decodes(artifact_bytes):
    sd, config, meta = decode_artifact(artifact_bytes)
    assert config == CONFIG and meta["bytes_file"] == len(artifact_bytes) and len(sd) == len(_state())


def test_truncations_raise(artifact_bytes):
    rng = random.Random(0)
    cuts = list(range(0, 40)) + [len(artifact_bytes) - k for k in range(1, 20)] + rng.sample(range(len(artifact_bytes)), 60)
    for cut in cuts:
        _expect_value_error(artifact_bytes[:cut])
    _expect_value_error(artifact_bytes + b"\0")


def test_bit_flips_raise(artifact_bytes):
    rng = random.Random(1)
    positions = list(range(QUANT_HEADER.size * 8)) + [rng.randrange(len(artifact_bytes) * 8) for _ in range(250)]
    for pos in positions:
        data = bytearray(artifact_bytes)
        data[pos // 8] ^= 1 << (pos % 8)
        _expect_value_error(bytes(data))


def test_random_and_foreign_bytes_raise(artifact_bytes):
    rng = random.Random(2)
    for _ in range(100):
        _expect_value_error(bytes(rng.randrange(256) for _ in range(rng.randrange(0, 400))))
    for _ in range(30):  # our magic + random rest
        _expect_value_error(QUANT_ARTIFACT_MAGIC + bytes(rng.randrange(256) for _ in range(rng.randrange(0, 300))))
    for data, match in [
        (b"PK\x03\x04" + artifact_bytes[4:], "magic"), (zlib.compress(os.urandom(100)), "magic"),
        (artifact_bytes[:4] + bytes([2]) + artifact_bytes[5:], "version 2 is newer"),
        (artifact_bytes[:4] + bytes([0]) + artifact_bytes[5:], "version 0"),
        (artifact_bytes[:5] + bytes([9]) + artifact_bytes[6:], "compressor id 9"),
        (artifact_bytes[:-1] + bytes([artifact_bytes[-1] ^ 1]), "checksum"),
    ]:
        with pytest.raises(ValueError, match=match):
            decode_artifact(data)


def test_valid_checksum_but_broken_content_raises(artifact_bytes):
    raw, _ = quant_unwrap_container(artifact_bytes)
    rng = random.Random(3)
    with pytest.raises(ValueError, match="corrupt zlib"):
        decode_artifact(_rewrap(b"", comp=bytes(rng.randrange(256) for _ in range(500)), raw_len=1000))
    for compressor in ("zlib", "zstd", "lzma"):
        with pytest.raises(ValueError, match="inflates|content size"):  # declared length lies
            decode_artifact(_rewrap(raw, compressor, raw_len=len(raw) - 1))
        with pytest.raises(ValueError):
            decode_artifact(_rewrap(raw, compressor, raw_len=len(raw) + 10))
        with pytest.raises(ValueError):  # compressed stream cut short
            decode_artifact(_rewrap(raw, compressor, comp=quant_compress(raw, compressor)[:-7]))
    with pytest.raises(ValueError, match="rotation"):
        decode_artifact(_rewrap(raw, rotation=len(raw) + 1))
    rot = 1000  # a valid rotation round-trips
    assert decode_artifact(_rewrap(raw[rot:] + raw[:rot], rotation=rot))[1] == CONFIG
    bomb = bytes(200_000_000)
    for compressor in ("zlib", "lzma", "zstd"):  # zip bombs: never inflated past the header's length
        comp = {  # fast settings: any of these streams is valid input for our decoders
            "zlib": lambda: zlib.compress(bomb, 1),
            "lzma": lambda: lzma.compress(bomb, format=lzma.FORMAT_RAW, filters=[{"id": lzma.FILTER_LZMA2, "preset": 1}]),
            "zstd": lambda: zstandard.ZstdCompressor(level=1, write_content_size=False).compress(bomb),
        }[compressor]()
        tracemalloc.start()
        with pytest.raises(ValueError, match="inflates|content size"):
            decode_artifact(_rewrap(b"", compressor, comp=comp, raw_len=1000))
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
        limit = 80_000_000 if compressor == "lzma" else 20_000_000  # lzma: its fixed 64 MiB dictionary
        assert peak < limit, (compressor, peak)
    with pytest.raises(ValueError, match="safetensors|format"):
        decode_artifact(_rewrap(b"\x10" + bytes(7) + b"{}" * 8))
    with pytest.raises(ValueError, match="safetensors"):
        decode_artifact(_rewrap(struct.pack("<Q", 10**12) + raw[8:]))
    header_len = struct.unpack("<Q", raw[:8])[0]
    outcomes = {"error": 0, "ok": 0}
    for _ in range(150):  # flips inside the payload, re-checksummed: ValueError or a structurally sound load
        data = bytearray(raw)
        pos = rng.randrange(8, 8 + header_len) if rng.random() < 0.7 else rng.randrange(len(raw))
        data[pos] ^= 1 << rng.randrange(8)
        try:
            sd, config, _ = decode_artifact(_rewrap(bytes(data)))
        except ValueError:
            outcomes["error"] += 1
            continue
        outcomes["ok"] += 1
        assert set(sd) == set(_state()) and all(sd[k].shape == v.shape for k, v in _state().items())
    assert outcomes["error"] > 50


def _edited_payload(packing, edit_quant=None, edit_tensors=None):
    """Our payload with its quant metadata / tensor set edited (everything else consistent)."""
    entries, _ = quantize_state_dict(_state(), QuantPolicy())
    raw = quant_build_payload(entries, CONFIG, QuantPolicy().to_dict(), packing)
    n = struct.unpack("<Q", raw[:8])[0]
    meta = json.loads(raw[8:8 + n])["__metadata__"]
    quant = json.loads(meta["quant"])
    tensors = safetensors.torch.load(raw)
    if edit_quant:
        edit_quant(quant)
    if edit_tensors:
        edit_tensors(tensors)
    return safetensors.torch.save(tensors, metadata=dict(meta, quant=json.dumps(quant)))


def test_safetensors_entries_must_match_quant_metadata():
    name = "blocks.0.mlp.fc.weight"
    cases = [
        ("bits", lambda q: q["tensors"][name].__setitem__(1, 7), None, "disagree"),  # packed length
        ("int8", lambda q: q["tensors"][name].__setitem__(0, [64, 192]), None, "disagree"),
        ("int8", lambda q: q["tensors"][name].__setitem__(1, "float8"), None, "unknown kind"),
        ("int8", lambda q: q["tensors"][name].__setitem__(1, 12), None, "bits=12"),
        ("int8", lambda q: q["tensors"].pop("skip_weights"), None, "disagree"),
        ("int8", None, lambda t: t.pop(name + ".scale"), "disagree"),
        ("bits", None, lambda t: t.__setitem__("extra", torch.ones(2)), "disagree"),
        ("int8", lambda q: q.__setitem__("packing", "int4"), None, "packing"),
        ("int8", lambda q: q["tensors"].__setitem__("x", [[2], "float16"]), None, "malformed"),
    ]
    for packing, edit_quant, edit_tensors, match in cases:
        with pytest.raises(ValueError, match=match):
            decode_artifact(_rewrap(_edited_payload(packing, edit_quant, edit_tensors)))
    assert decode_artifact(_rewrap(_edited_payload("bits")))[1] == CONFIG  # the unedited control case loads
    q, scale = quantize_per_row(torch.randn(4, 4), 6)
    over = {"w.weight": {"shape": (4, 4), "bits": 6, "q": q * 0 + 40, "scale": scale, "clip": 1.0}}
    with pytest.raises(ValueError, match="int6 range"):
        decode_artifact(_rewrap(quant_build_payload(over, {}, {}, "int8")))
    wrapped = quant_wrap_container(_edited_payload("bits"), "lzma")
    assert decode_artifact(wrapped)[1] == CONFIG


def test_load_artifact_names_the_file(tmp_path):
    path = tmp_path / "broken.ptz"
    path.write_bytes(b"PGQZ\x01")
    with pytest.raises(ValueError, match="broken.ptz.*truncated"):
        load_artifact(path)


# ---------------------------------------------------------------- budget fitting

def test_autofit_steps_down_until_it_fits(tmp_path):
    sd = _state(num_layers=4, dim=128, vocab=512)
    full = export_artifact(sd, CONFIG, tmp_path / "a.ptz", code_bytes=0, policy=QuantPolicy(compressor="zstd"), **QUIET)
    assert full["fit_steps"] == []
    budget = int(full["bytes_model"] * 0.88) + 5000  # int6 does not fit; MLP int5 alone is not enough either
    logs = []
    report = export_artifact(sd, CONFIG, tmp_path / "b.ptz", code_bytes=5000, byte_budget=budget,
                             policy=QuantPolicy(compressor="zstd"), log=logs.append)
    assert report["bytes_total"] <= budget and (tmp_path / "b.ptz").stat().st_size == report["bytes_model"]
    changes = [s["change"] for s in report["fit_steps"]]
    assert changes[0] == "mlp_bits=5" and len(changes) >= 2
    assert len(logs) == 1 + len(changes) and all("rel_mse" in line for line in logs)
    errs = [full["rel_mse"]] + [s["rel_mse"] for s in report["fit_steps"]]
    assert errs == sorted(errs) and errs[-1] > errs[0]  # each step trades error for bytes
    sizes = [full["bytes_model"]] + [s["bytes_model"] for s in report["fit_steps"]]
    assert sizes == sorted(sizes, reverse=True)
    meta = load_artifact(tmp_path / "b.ptz")[2]
    assert meta["policy"]["mlp_bits"] == 5 and meta["policy"] == report["policy"]


def test_cannot_fit_fails_loudly(tmp_path):
    sd = _state()
    with pytest.raises(ValueError, match=r"cannot fit BYTE_BUDGET=20000: smallest try is \d+ bytes"):
        export_artifact(sd, CONFIG, tmp_path / "m.ptz", code_bytes=0, byte_budget=20_000,
                        policy=QuantPolicy(compressor="zlib", packing="int8"), **QUIET)
    with pytest.raises(ValueError, match="QUANT_FIT=0"):
        export_artifact(sd, CONFIG, tmp_path / "m.ptz", code_bytes=0, byte_budget=20_000,
                        policy=QuantPolicy(compressor="zlib", fit=False), **QUIET)
    with pytest.raises(ValueError, match="code 10000000"):  # the code alone is over
        export_artifact(sd, CONFIG, tmp_path / "m.ptz", code_bytes=10_000_000, byte_budget=9_000_000,
                        policy=QuantPolicy(compressor="zlib"), **QUIET)
    assert not (tmp_path / "m.ptz").exists()


# ---------------------------------------------------------------- estimate

def test_estimate_tracks_real_exports(tmp_path):
    sd = _state(num_layers=3, dim=256, vocab=1024, seed=4)
    for w in sd.values():  # Gaussian-like weights: the calibration case
        w.mul_(1.0)
    shapes = {k: tuple(v.shape) for k, v in sd.items()}
    for policy in (QuantPolicy(), QuantPolicy(mlp_bits=5, attn_bits=5), QuantPolicy(embed_bits=6, float_dtype="float32")):
        real = export_artifact(sd, CONFIG, tmp_path / "m.ptz", code_bytes=0, byte_budget=10**9,
                               policy=policy, **QUIET)["bytes_model"]
        est = estimate_artifact_bytes(shapes, policy)
        assert 0.99 * real <= est <= 1.04 * real, (policy, est, real)
    assert estimate_artifact_bytes(shapes, QuantPolicy(mlp_bits=5)) < estimate_artifact_bytes(shapes, QuantPolicy())
    with pytest.raises(ValueError, match="non-negative"):
        estimate_artifact_bytes({"w": (3, -1)}, QuantPolicy())


# ---------------------------------------------------------------- CLI

def test_cli_inspect_totals_equal_file_size(tmp_path, capsys):
    path = tmp_path / "m.ptz"
    export_artifact(_state(), CONFIG, path, code_bytes=0, **QUIET)
    assert quant_cli(["inspect", str(path)]) == 0
    out = capsys.readouterr().out
    assert "blocks.0.mlp.fc.weight" in out and "int6" in out and "float16" in out
    total_line = [line for line in out.splitlines() if line.startswith("file total")][0]
    header, comp, total = [int(x.replace(",", "")) for x in
                           (total_line.split("header ")[1].split()[0], total_line.split("payload ")[1].split()[0],
                            total_line.split("= ")[1].split()[0])]
    assert header + comp == total == path.stat().st_size
    path.write_bytes(path.read_bytes()[:-3])
    assert quant_cli(["inspect", str(path)]) == 2
    assert "checksum" in capsys.readouterr().err
    assert quant_cli(["inspect", str(tmp_path / "missing.ptz")]) == 2


def test_cli_estimate_with_shapes(tmp_path, capsys):
    shapes = tmp_path / "shapes.json"
    shapes.write_text(json.dumps({"tok_emb.weight": [1024, 512], "blocks.0.mlp.fc.weight": [1536, 512]}))
    assert quant_cli(["estimate", "--shapes", str(shapes), "--code-bytes", "50000"]) == 0
    assert "fits" in capsys.readouterr().out
    assert quant_cli(["estimate", "--shapes", str(shapes), "--byte-budget", "100000"]) == 1
    assert "DOES NOT FIT" in capsys.readouterr().out


@pytest.mark.slow
def test_cli_subprocess_estimate_and_inspect(tmp_path):
    pytest.importorskip("train_gpt")
    env = dict(os.environ, NUM_LAYERS="2", MODEL_DIM="64", NUM_HEADS="4", NUM_KV_HEADS="2", ROPE_DIMS="8", VOCAB_SIZE="1024")
    run = subprocess.run([sys.executable, "-m", "quant", "estimate"], cwd=REPO, env=env, capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    assert "projected model" in run.stdout
    run = subprocess.run([sys.executable, "-m", "quant", "estimate", "--byte-budget", "1000"], cwd=REPO, env=env,
                         capture_output=True, text=True)
    assert run.returncode == 1 and "DOES NOT FIT" in run.stdout
    bad = tmp_path / "bad.ptz"
    bad.write_bytes(b"PGQZ\x07" + bytes(40))
    run = subprocess.run([sys.executable, "-m", "quant", "inspect", str(bad)], cwd=REPO, capture_output=True, text=True)
    assert run.returncode == 2 and "version 7" in run.stderr
