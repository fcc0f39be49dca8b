"""quant/artifact.py + estimate.py + offline.py + CLI: bit-exact round trips, damage, budget fitting,
byte-identical artifacts across processes."""

import dataclasses
import json
import lzma
import os
import random
import re
import struct
import subprocess
import sys
import tracemalloc
import zlib
from pathlib import Path

import brotli
import pytest
import torch
import zstandard

from quant.__main__ import quant_cli
from quant.artifact import (
    QUANT_PREFIX,
    decode_artifact,
    export_artifact,
    load_artifact,
    quant_build_payload,
    quant_wrap_container,
    quantize_state_dict,
)
from primitives.rowquant import dequantize_per_row, fake_quantize_per_row
from quant.estimate import estimate_artifact_bytes
from quant.offline import quant_byte_budget, quant_check_shapes, quant_compress, quant_policy_from_dict
from quant.policy import QuantPolicy

REPO = Path(__file__).resolve().parents[1]
CONFIG = {"vocab_size": 256, "num_layers": 2, "model_dim": 64, "note": "tiny"}
QUIET = dict(log=lambda msg: None)
HEADER_BYTES = 14


def tiny_model_config(vocab_size=128):
    """A tiny GPT config built the trainer's way (follows its renames)."""
    env = {"NUM_LAYERS": "2", "MODEL_DIM": "32", "NUM_HEADS": "4", "NUM_KV_HEADS": "2", "ROPE_DIMS": "8",
           "XSA_LAST_N": "1", "VOCAB_SIZE": str(vocab_size), "MLP_MULT": "2"}
    from model.gpt import build_model_config
    from primitives.settings import Hyperparameters

    return build_model_config(Hyperparameters.from_env(env, log=lambda msg: None))


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
@pytest.mark.parametrize("compressor", ["zlib", "zstd", "lzma", "brotli"])
def test_export_load_is_bit_exact(tmp_path, packing, compressor):
    sd = _state()
    shuffle = packing == "bits"  # both ways across the cases; every encoding: test_all_encodings_...
    policy = QuantPolicy(packing=packing, compressor=compressor, shuffle="on" if shuffle else "off", mlp_bits=5)
    path = tmp_path / "m.ptz"
    report = export_artifact(sd, CONFIG, path, code_bytes=1234, policy=policy, **QUIET)
    assert report["bytes_model"] == path.stat().st_size and report["bytes_total"] == report["bytes_model"] + 1234
    assert (report["packing"], report["shuffle"], report["compressor"], report["fit_steps"]) == (
        packing, shuffle, compressor, [])
    assert not [p.name for p in tmp_path.iterdir() if ".tmp" in p.name]  # the writer's `.{name}.tmp{pid}`
    loaded, config, meta = load_artifact(path)
    assert config == CONFIG and meta["packing"] == packing and meta["compressor"] == compressor
    assert meta["shuffle"] is shuffle
    assert quant_policy_from_dict(meta["policy"]) == policy
    assert list(loaded) == list(sd)
    entries, _ = quantize_state_dict(sd, policy)
    for name, t in sd.items():
        shape, bits, q, scale, _ = entries[name]
        if bits:
            expected = dequantize_per_row(q, scale).reshape(t.shape)
            assert bits == (5 if ".mlp." in name else 8)
        else:
            expected = t.half().float()
        assert _bits_equal(loaded[name], expected), name


@pytest.mark.parametrize("failure", ["disk full at fsync", "interrupt at fsync", "rename refused"])
def test_an_interrupted_write_keeps_the_previous_file_and_leaves_no_temp_file(tmp_path, monkeypatch, failure):
    path = tmp_path / "m.ptz"
    export_artifact(_state(), CONFIG, path, code_bytes=0, policy=QuantPolicy(compressor="zlib"), **QUIET)
    before = path.read_bytes()
    temp = tmp_path / f".m.ptz.tmp{os.getpid()}"  # the writer's temp name
    seen = []

    def fail(*args):
        seen.append(temp.stat().st_size)  # the new bytes are in the temp file when the failure hits
        raise KeyboardInterrupt if failure.startswith("interrupt") else OSError(28, "No space left on device")

    monkeypatch.setattr(os, "replace" if failure.startswith("rename") else "fsync", fail)
    with pytest.raises(KeyboardInterrupt if failure.startswith("interrupt") else OSError):
        export_artifact(_state(seed=9), CONFIG, path, code_bytes=0, policy=QuantPolicy(compressor="zlib"), **QUIET)
    monkeypatch.undo()
    assert seen and seen[0] > 0
    assert path.read_bytes() == before and load_artifact(path)[1] == CONFIG
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.ptz"]


ENCODINGS = [(p, b, c) for p in ("int8", "bits") for b in (False, True) for c in ("zlib", "zstd", "lzma", "brotli")]


def test_all_encodings_decode_to_the_same_weights():
    sd = _state(seed=1)
    sd["blocks.0.attn.q_gain"] = torch.randn(4, dtype=torch.float64)  # multi-byte passthrough of another width
    sd["step"] = torch.tensor([3, -1], dtype=torch.int64)
    policy = QuantPolicy(mlp_bits=5, attn_bits=6)
    entries, _ = quantize_state_dict(sd, policy)
    results = []
    for packing, shuffle, compressor in ENCODINGS:
        raw = quant_build_payload(entries, CONFIG, policy.to_dict(), packing, shuffle)
        loaded, _, meta = decode_artifact(quant_wrap_container(raw, compressor))
        assert (meta["packing"], meta["shuffle"], meta["compressor"]) == (packing, shuffle, compressor)
        results.append(loaded)
    for other in results[1:]:
        assert all(_bits_equal(results[0][k], other[k]) if other[k].is_floating_point() else torch.equal(
            results[0][k], other[k]) for k in sd)
    assert torch.equal(results[0]["step"], sd["step"]) and results[0]["blocks.0.attn.q_gain"].dtype == torch.float32
    # byte-shuffle groups the bytes of each multi-byte value by significance: high bytes of float16 scales
    # (sign + exponent) repeat, so the float section compresses better
    num_int_bytes = sum(e[2].numel() for e in entries.values() if e[1])
    floats = []
    for shuffle in (False, True):
        raw = quant_build_payload(entries, CONFIG, {}, "int8", shuffle)
        floats.append(raw[num_int_bytes:len(raw) - 4 - int.from_bytes(raw[-4:], "little")])
    assert sorted(floats[0]) == sorted(floats[1]) and floats[0] != floats[1]
    assert len(zlib.compress(floats[1], 9)) < len(zlib.compress(floats[0], 9))


def test_auto_keeps_the_smallest_candidate(tmp_path):
    logs = []
    report = export_artifact(_state(), CONFIG, tmp_path / "m.ptz", code_bytes=0, log=logs.append)
    entries, _ = quantize_state_dict(_state(), QuantPolicy())
    sizes = {(p, b, c): len(quant_wrap_container(quant_build_payload(entries, CONFIG, QuantPolicy().to_dict(), p, b), c))
             for p, b, c in ENCODINGS}
    assert report["bytes_model"] == min(sizes.values()) == sizes[report["packing"], report["shuffle"], report["compressor"]]
    assert report["policy"]["compressor"] == report["policy"]["shuffle"] == "auto"  # the file header holds the choice
    assert load_artifact(tmp_path / "m.ptz")[2]["compressor"] == report["compressor"]
    assert len(logs) == 2 and f"model {report['bytes_model']} " in logs[0] and logs[1].startswith("quant_estimate: ")


def test_artifact_bytes_are_identical_across_processes(tmp_path):
    """Two fresh interpreters (different hash seeds) export the same state dict to the same bytes."""
    script = (f"import sys; sys.path.insert(0, {str(REPO)!r}); from pathlib import Path\n"
              "from quant.artifact import export_artifact\n"
              "from tests.test_quant_artifact import CONFIG, _state\n"
              "export_artifact(_state(), dict(CONFIG, extra={'b': 1.5, 'a': [1, 2]}), Path(sys.argv[1]), code_bytes=7,"
              " log=lambda msg: None)\n")
    outputs = []
    for seed in ("1", "2"):
        path = tmp_path / f"seed{seed}.ptz"
        env = {k: v for k, v in os.environ.items() if not k.startswith("QUANT_")}
        run = subprocess.run([sys.executable, "-c", script, str(path)], cwd=REPO, capture_output=True, text=True,
                             env=dict(env, PYTHONHASHSEED=seed, QUANT_COMPRESSOR="brotli"))
        assert run.returncode == 0, run.stderr
        outputs.append(path.read_bytes())
    assert outputs[0] == outputs[1]
    export_artifact(_state(), dict(CONFIG, extra={"b": 1.5, "a": [1, 2]}), tmp_path / "here.ptz", code_bytes=7,
                    policy=QuantPolicy(compressor="brotli"), **QUIET)
    assert (tmp_path / "here.ptz").read_bytes() == outputs[0]


def test_export_matches_qat_forward_without_clip_search(tmp_path):
    """With GPTQ-lite off, the artifact holds exactly what the QAT forward computed."""
    sd = _state(seed=2)
    export_artifact(sd, CONFIG, tmp_path / "m.ptz", code_bytes=0, policy=QuantPolicy(gptq_lite=False, attn_bits=6, mlp_bits=6),
                    **QUIET)
    loaded = load_artifact(tmp_path / "m.ptz")[0]
    for name in ("blocks.0.attn.c_q.weight", "blocks.1.mlp.proj.weight"):
        assert _bits_equal(loaded[name], fake_quantize_per_row(sd[name], 6))


def test_real_model_roundtrip(tmp_path):
    import model.gpt as trainer_model

    config = tiny_model_config()
    torch.manual_seed(0)
    model = trainer_model.GPT(**config)
    if hasattr(model, "init_weights"):
        model.init_weights(0.02)
    sd = {k: v.detach().clone() for k, v in model.state_dict().items()}
    export_artifact(sd, config, tmp_path / "m.ptz", code_bytes=0, **QUIET)
    loaded, loaded_config, _ = load_artifact(tmp_path / "m.ptz")
    rebuilt = trainer_model.GPT(**loaded_config)
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
    with pytest.raises(ValueError, match=r"blocks.0.mlp.fc.weight'\] is not finite"):
        export_artifact(bad, CONFIG, tmp_path / "m.ptz", code_bytes=0, **QUIET)
    with pytest.raises(TypeError, match="JSON serializable"):
        export_artifact(_state(), {"x": object()}, tmp_path / "m.ptz", code_bytes=0, **QUIET)
    with pytest.raises(ValueError, match="BYTE_BUDGET"):
        quant_byte_budget(None, {"BYTE_BUDGET": "16MB"})
    assert quant_byte_budget(None, {"BYTE_BUDGET": "1000"}) == 1000 and quant_byte_budget(None, {}) == 16_000_000
    assert not (tmp_path / "m.ptz").exists()


# ---------------------------------------------------------------- damaged files

def _expect_value_error(data: bytes):
    with pytest.raises(ValueError):
        decode_artifact(data)


def _rewrap(raw_payload: bytes, compressor="zlib", *, comp=None, raw_len=None, prefix=QUANT_PREFIX, cid=None):
    """A container with a VALID checksum around arbitrary (possibly broken) content."""
    comp = quant_compress(raw_payload, compressor) if comp is None else comp
    cid = 1 + ("zlib", "zstd", "lzma", "brotli").index(compressor) if cid is None else cid
    head = struct.pack("<5sBI", prefix, cid, len(raw_payload) if raw_len is None else raw_len)
    return head + struct.pack("<I", zlib.crc32(comp, zlib.crc32(head))) + comp


def _payload(data: bytes) -> bytes:
    """The decompressed payload of a zlib artifact."""
    return zlib.decompress(data[HEADER_BYTES:])


def test_valid_file_decodes(artifact_bytes):
    sd, config, meta = decode_artifact(artifact_bytes)
    assert config == CONFIG and meta["compressor"] == "zlib" and len(sd) == len(_state())
    assert decode_artifact(_rewrap(_payload(artifact_bytes)))[1] == CONFIG  # the helper builds valid files


RUN = dict(train_seq_len=256, vocab_size=256, eval_stride=64, tokenizer_sha256="ab" * 32)


def test_format_3_stores_the_run_metadata_and_format_2_still_loads(tmp_path, artifact_bytes):
    path = tmp_path / "m.ptz"
    export_artifact(_state(), CONFIG, path, code_bytes=0, policy=QuantPolicy(compressor="zlib"), run=RUN, **QUIET)
    data = path.read_bytes()
    assert data[:5] == QUANT_PREFIX == b"PGQZ\x03"
    sd, config, meta = decode_artifact(data)
    assert meta["run"] == RUN and meta["format_version"] == 3 and config == CONFIG
    assert decode_artifact(artifact_bytes)[2]["run"] == {}  # written without metadata (tests, benches)
    # format 2 = the same layout without "run": an old artifact loads, and says what it is
    head = json.loads(_payload(data)[-4 - struct.unpack("<I", _payload(data)[-4:])[0]:-4])
    old_head = json.dumps({k: v for k, v in head.items() if k != "run"}).encode()
    raw = _payload(data)
    old_raw = raw[:len(raw) - 4 - len(json.dumps(head).encode())] + old_head + struct.pack("<I", len(old_head))
    sd2, config2, meta2 = decode_artifact(_rewrap(old_raw, prefix=b"PGQZ\x02"))
    assert meta2["format_version"] == 2 and "run" not in meta2 and config2 == CONFIG
    assert all(torch.equal(sd[k], sd2[k]) for k in sd)


def test_truncations_raise(artifact_bytes):
    rng = random.Random(0)
    cuts = list(range(0, 40)) + [len(artifact_bytes) - k for k in range(1, 20)] + rng.sample(range(len(artifact_bytes)), 60)
    for cut in cuts:
        _expect_value_error(artifact_bytes[:cut])
    _expect_value_error(artifact_bytes + b"\0")


def test_bit_flips_raise(artifact_bytes):
    rng = random.Random(1)
    positions = list(range(HEADER_BYTES * 8)) + [rng.randrange(len(artifact_bytes) * 8) for _ in range(250)]
    for pos in positions:
        data = bytearray(artifact_bytes)
        data[pos // 8] ^= 1 << (pos % 8)
        _expect_value_error(bytes(data))


def test_random_and_foreign_bytes_raise(artifact_bytes):
    rng = random.Random(2)
    for _ in range(100):
        _expect_value_error(bytes(rng.randrange(256) for _ in range(rng.randrange(0, 400))))
    for _ in range(30):  # our magic and version + random rest
        _expect_value_error(QUANT_PREFIX + bytes(rng.randrange(256) for _ in range(rng.randrange(0, 300))))
    payload = _payload(artifact_bytes)
    for data, match in [
        (b"PK\x03\x04" + artifact_bytes[4:], "magic"), (zlib.compress(os.urandom(100)), "magic"),
        (artifact_bytes[:4] + bytes([4]) + artifact_bytes[5:], r"b'PGQZ\\x04', not b'PGQZ\\x03' \(magic, format version"),
        (artifact_bytes[:4] + bytes([1]) + artifact_bytes[5:], "format version"),  # version 1: the old safetensors format
        (_rewrap(payload, prefix=b"PGQZ\x01"), "format version"),  # even with a valid checksum
        (artifact_bytes[:-1] + bytes([artifact_bytes[-1] ^ 1]), "checksum"),
        (artifact_bytes[:5] + bytes([9]) + artifact_bytes[6:], "checksum"),
    ]:
        with pytest.raises(ValueError, match=match):
            decode_artifact(data)
    for cid in (0, 2, 3, 4, 5, 9, 255):  # wrong / unknown compressor id with a valid checksum (5: grouped)
        _expect_value_error(_rewrap(payload, cid=cid))
    with pytest.raises(ValueError, match="unknown compressor id 6"):
        decode_artifact(_rewrap(payload, cid=6))


def test_valid_checksum_but_broken_content_raises(artifact_bytes):
    raw = _payload(artifact_bytes)
    rng = random.Random(3)
    with pytest.raises(ValueError, match="artifact: Error -3 while decompressing"):
        decode_artifact(_rewrap(b"", comp=bytes(rng.randrange(256) for _ in range(500)), raw_len=1000))
    for compressor in ("zstd", "lzma", "brotli"):  # random streams with a valid checksum
        for _ in range(20):
            _expect_value_error(_rewrap(b"", compressor, comp=bytes(rng.randrange(256) for _ in range(300)), raw_len=1000))
        comp = bytearray(quant_compress(raw, compressor))
        for _ in range(30):  # flipped bits inside a real stream, re-checksummed
            data = bytearray(comp)
            data[rng.randrange(len(data))] ^= 1 << rng.randrange(8)
            try:
                decode_artifact(_rewrap(raw, compressor, comp=bytes(data)))
            except ValueError:
                pass
    for compressor in ("zlib", "zstd", "lzma", "brotli"):
        with pytest.raises(ValueError, match="inflates to"):  # declared length lies
            decode_artifact(_rewrap(raw, compressor, raw_len=len(raw) - 1))
        with pytest.raises(ValueError):
            decode_artifact(_rewrap(raw, compressor, raw_len=len(raw) + 10))
        with pytest.raises(ValueError):  # compressed stream cut short
            decode_artifact(_rewrap(raw, compressor, comp=quant_compress(raw, compressor)[:-7]))
    bomb = bytes(200_000_000)
    for compressor in ("zlib", "lzma", "zstd", "brotli"):  # zip bombs: never inflated past the header's length
        comp = {  # fast settings: any of these streams is valid input for our decoders
            "zlib": lambda: zlib.compress(bomb, 1),
            "lzma": lambda: lzma.compress(bomb, format=lzma.FORMAT_ALONE, preset=1),
            "zstd": lambda: zstandard.ZstdCompressor(level=1, write_content_size=False).compress(bomb),
            "brotli": lambda: brotli.compress(bomb, quality=0),
        }[compressor]()
        tracemalloc.start()
        with pytest.raises(ValueError, match=r"inflates to \d+ bytes, not 1000"):  # brotli: whole output blocks
            decode_artifact(_rewrap(b"", compressor, comp=comp, raw_len=1000))
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
        assert peak < 20_000_000, (compressor, peak)
    for junk in (b"", b"\x10" + bytes(7) + b"{}" * 8, raw[:-1] + b"\xff", raw + b"x", b"x" + raw, raw[1:]):
        _expect_value_error(_rewrap(junk))
    header_len = int.from_bytes(raw[-4:], "little")
    outcomes = {"error": 0, "ok": 0}
    for _ in range(150):  # flips inside the payload, re-checksummed: ValueError or a structurally sound load
        data = bytearray(raw)
        pos = rng.randrange(len(raw) - 4 - header_len, len(raw)) if rng.random() < 0.7 else rng.randrange(len(raw))
        data[pos] ^= 1 << rng.randrange(8)
        try:
            sd, config, _ = decode_artifact(_rewrap(bytes(data)))
        except ValueError:
            outcomes["error"] += 1
            continue
        outcomes["ok"] += 1  # (a flipped letter in the JSON header may rename a tensor or change the config)
        assert len(sd) == len(_state()) and all(isinstance(t, torch.Tensor) for t in sd.values())
    assert outcomes["error"] > 50


def _edited_payload(packing, edit_header=None, extra_data=b""):
    """Our payload with its JSON header edited (and optional bytes appended to the tensor data)."""
    entries, _ = quantize_state_dict(_state(), QuantPolicy())
    raw = quant_build_payload(entries, CONFIG, QuantPolicy().to_dict(), packing)
    n = int.from_bytes(raw[-4:], "little")
    head = json.loads(raw[-4 - n:-4])
    if edit_header:
        edit_header(head)
    head = json.dumps(head).encode()
    return raw[:-4 - n] + extra_data + head + struct.pack("<I", len(head))


def test_payload_header_must_match_the_data():
    name = "blocks.0.mlp.fc.weight"

    def entry(edit):
        return lambda head: edit(next(t for t in head["tensors"] if t[0] == name))

    cases = [
        ("bits", entry(lambda t: t.__setitem__(2, 7)), b""),  # packed length changes
        ("int8", entry(lambda t: t.__setitem__(1, [64, 200])), b""),
        ("int8", entry(lambda t: t.__setitem__(1, [10**6, 10**6])), b""),  # huge: refused before any allocation
        ("int8", entry(lambda t: t.__setitem__(1, [-192, -64])), b""),
        ("int8", entry(lambda t: t.__setitem__(2, "float8")), b""),
        ("int8", entry(lambda t: t.__setitem__(2, "nn")), b""),
        ("bits", entry(lambda t: t.__setitem__(2, 12)), b""),
        ("bits", entry(lambda t: t.__setitem__(2, 0)), b""),  # 0 bits: no q bytes, refused before unpacking
        ("int8", lambda head: head["tensors"].pop(0), b""),
        ("int8", lambda head: head["tensors"].append(["x", [2], "float16", None]), b""),
        ("bits", None, b"\0\0"),  # extra data
        ("int8", lambda head: head.__setitem__("packing", "int4"), b""),
        ("int8", lambda head: head["tensors"].__setitem__(0, ["x", [2], "float16"]), b""),
        ("int8", lambda head: head.pop("config"), b""),
        ("int8", lambda head: head.__setitem__("tensors", {}), b""),
    ]
    for packing, edit, extra in cases:
        with pytest.raises(ValueError, match="^artifact: "):
            decode_artifact(_rewrap(_edited_payload(packing, edit, extra)))
    assert decode_artifact(_rewrap(_edited_payload("bits")))[1] == CONFIG  # the unedited control case loads
    assert decode_artifact(quant_wrap_container(_edited_payload("int8"), "lzma"))[1] == CONFIG


def test_load_artifact_names_the_file(tmp_path):
    path = tmp_path / "broken.ptz"
    path.write_bytes(b"PGQZ\x02")
    with pytest.raises(ValueError, match="broken.ptz: .*at least 14 bytes"):
        load_artifact(path)


# ---------------------------------------------------------------- budget fitting

def test_cannot_fit_fails_loudly(tmp_path):
    sd = _state()
    with pytest.raises(ValueError, match=r"model \d+ \+ code 0 bytes > BYTE_BUDGET=20000 \(QUANT_FIT=1, \d+ fit steps") as err:
        export_artifact(sd, CONFIG, tmp_path / "m.ptz", code_bytes=0, byte_budget=20_000,
                        policy=QuantPolicy(compressor="zlib", packing="int8"), **QUIET)
    # the bytes named are the smallest policy's (every fittable tensor at its floor), not the first round's
    smallest = QuantPolicy(compressor="zlib", packing="int8", attn_bits=4, mlp_bits=4, embed_bits=5, fit=False)
    floor = export_artifact(sd, CONFIG, tmp_path / "s.ptz", code_bytes=0, byte_budget=10**9, policy=smallest, **QUIET)
    first_round = export_artifact(sd, CONFIG, tmp_path / "f.ptz", code_bytes=0, byte_budget=10**9,
                                  policy=QuantPolicy(compressor="zlib", packing="int8"), **QUIET)["bytes_model"]
    named = int(str(err.value).split()[1])  # (the header differs: the fitted list vs bits per group)
    assert abs(named - floor["bytes_model"]) < 200 and named < 0.75 * first_round
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
    for policy in (QuantPolicy(), QuantPolicy(mlp_bits=5, attn_bits=5), QuantPolicy(attn_bits=6, mlp_bits=6, embed_bits=6,
                                                                                   float_dtype="float32")):
        real = export_artifact(sd, CONFIG, tmp_path / "m.ptz", code_bytes=0, byte_budget=10**9,  # measured on zstd
                               policy=dataclasses.replace(policy, compressor="zstd", shuffle="off"), **QUIET)["bytes_model"]
        est = estimate_artifact_bytes(shapes, policy)
        assert 0.99 * real <= est <= 1.04 * real, (policy, est, real)
    assert estimate_artifact_bytes(shapes, QuantPolicy(mlp_bits=5)) < estimate_artifact_bytes(shapes, QuantPolicy())
    with pytest.raises(ValueError, match="non-negative"):
        quant_check_shapes({"w": (3, -1)})


def _remap_matrices(sd, draw):
    """The same shapes and standard deviations, values drawn from another distribution (unit variance)."""
    gen = torch.Generator().manual_seed(5)
    return {k: draw(v.shape, gen) * v.std() if v.ndim == 2 and k != "skip_weights" else v.clone() for k, v in sd.items()}


@pytest.mark.parametrize("tails, draw, low, high", [
    # measured est/real (int8 + zstd): Student-t 1.18, Laplace 1.12 (a larger row max, most values near 0: compress better)
    ("Student-t, 3 dof", lambda shape, g: torch.randn(shape, generator=g) / torch.sqrt(
        torch.randn(3, *shape, generator=g).square().mean(0)) / 3 ** 0.5, 1.05, 1.40),
    ("Laplace", lambda shape, g: torch.empty(shape).exponential_(generator=g) * torch.randint(0, 2, shape, generator=g)
     .mul(2).sub(1) / 2 ** 0.5, 1.05, 1.25),
    # uniform values fill every level evenly: the one case measured well under (est/real 0.92)
    ("uniform", lambda shape, g: (torch.rand(shape, generator=g) * 2 - 1) * 3 ** 0.5, 0.88, 0.95),
])
def test_estimate_on_other_weight_distributions(tmp_path, tails, draw, low, high):
    """The estimate is calibrated on Gaussian weights and is NOT an upper bound: heavier tails make the
    artifact smaller than projected, light (uniform) tails larger. (Trained weights:
    tests/test_train.py::test_size_estimate_on_trained_weights.)"""
    sd = _remap_matrices(_state(num_layers=3, dim=256, vocab=1024, seed=4), draw)
    shapes = {k: tuple(v.shape) for k, v in sd.items()}
    policy = QuantPolicy(packing="int8", compressor="zstd")  # the calibration's encoding (auto is never larger)
    real = export_artifact(sd, CONFIG, tmp_path / "m.ptz", code_bytes=0, byte_budget=10**9, policy=policy,
                           **QUIET)["bytes_model"]
    assert low <= estimate_artifact_bytes(shapes, policy) / real <= high, tails
    assert quant_check_shapes({"w": [3, "4"]}) == {"w": (3, 4)}


# ---------------------------------------------------------------- CLI

def test_cli_inspect_rows_and_header_add_up_to_the_payload(tmp_path, capsys):
    """The per-tensor rows plus the payload's JSON header (and its 4-byte length) are the payload the
    container declares, read from the file itself; one int6 row and one float16 row by hand."""
    path = tmp_path / "m.ptz"
    export_artifact(_state(), CONFIG, path, code_bytes=0, run=RUN,
                    policy=QuantPolicy(packing="bits", shuffle="off", compressor="zlib", mlp_bits=6), **QUIET)
    assert quant_cli(["inspect", str(path)]) == 0
    out = capsys.readouterr().out
    assert f"format: 3   run: {json.dumps(RUN)}" in out
    rows = {}
    for line in out.splitlines():
        m = re.fullmatch(r"(\S+)\s+(\S+)\s+(.+?)\s+([\d,]+)\s+[\d.]+%", line)
        if m:
            rows[m[1]] = (m[2], m[3], int(m[4].replace(",", "")))
    assert len(rows) == len(_state())
    data = path.read_bytes()
    declared = struct.unpack_from("<I", data, 6)[0]  # the container's payload length (offset 6)
    payload = zlib.decompress(data[14:])
    header_len = struct.unpack("<I", payload[-4:])[0]
    assert len(payload) == declared
    assert sum(nbytes for _, _, nbytes in rows.values()) + header_len + 4 == declared
    assert f"raw payload: {declared:,} bytes" in out
    # blocks.0.mlp.fc.weight [192, 64] at int6, bit-packed: 192 * 64 * 6 / 8 bytes + a float16 scale per row
    shape, fmt, nbytes = rows["blocks.0.mlp.fc.weight"]
    assert (shape, fmt.split(" clip=")[0], nbytes) == ("192x64", "int6 packed", 192 * 64 * 6 // 8 + 2 * 192)
    assert rows["blocks.0.attn_scale"] == ("64", "float16", 64 * 2)
    total_line = [line for line in out.splitlines() if line.startswith("file total")][0]
    assert f"container header 14 + compressed payload {len(data) - 14:,} = {len(data):,} bytes" in total_line
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
    out = capsys.readouterr().out
    assert "DOES NOT FIT" in out
    # without --code-bytes: the size of the packed train_gpt.py a record ships, not of the readable package
    from kit.bundle import build_packed_bytes, pack_settings

    shipped = len(build_packed_bytes(settings=pack_settings()))  # packed for this environment's settings
    readable = sum(p.stat().st_size for p in [REPO / "train_gpt.py", *REPO.glob("trainer/*.py")])
    assert f" + code {shipped:,} = " in out and shipped < readable / 2


@pytest.mark.slow
def test_cli_subprocess_estimate_and_inspect(tmp_path):
    env = dict(os.environ, NUM_LAYERS="2", XSA_LAST_N="2", MODEL_DIM="64", NUM_HEADS="4", NUM_KV_HEADS="2", ROPE_DIMS="8",
               VOCAB_SIZE="1024")
    run = subprocess.run([sys.executable, "-m", "quant", "estimate"], cwd=REPO, env=env, capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    assert "projected model" in run.stdout
    run = subprocess.run([sys.executable, "-m", "quant", "estimate", "--byte-budget", "1000"], cwd=REPO, env=env,
                         capture_output=True, text=True)
    assert run.returncode == 1 and "DOES NOT FIT" in run.stdout
    bad = tmp_path / "bad.ptz"
    bad.write_bytes(b"PGQZ\x07" + bytes(40))
    run = subprocess.run([sys.executable, "-m", "quant", "inspect", str(bad)], cwd=REPO, capture_output=True, text=True)
    assert run.returncode == 2 and "PGQZ\\x07" in run.stderr and "format version" in run.stderr
