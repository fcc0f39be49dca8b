"""tools/bundle.py: the package -> train_gpt_human.py -> packed train_gpt.py.

Fast tests use a small fake package (stdlib only) written into tmp_path; the slow test runs the
real trainer three ways (package, human file, packed file) and compares losses and code bytes.
The packed file comes in three encodings (base93 and base85: plain ASCII, "ascii" keeps the smaller and
is the default; latin1: opt-in, PEP 263 cookie, raw bytes in a str literal); all must round-trip
byte-exactly and run the same.
"""

import ast
import codecs
import functools
import hashlib
import io
import json
import math
import os
import random
import tokenize
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from kit import bundle, bundle_cache, bundle_modules
from kit.bundle import BundleError

REPO = Path(__file__).resolve().parents[1]

FAKE_TREE = {
    "eval/__init__.py": '"""Fake eval package."""\n',
    "eval/__main__.py": '"""CLI (never bundled)."""\nfrom eval.bpb import bpb_of\n\nprint(bpb_of(1.0))\n',
    "eval/shards.py": (
        '"""Shards: the first module of the pipeline."""\n\nimport math\nimport os\n\n'
        "SHARD_SCALE = 3  # a comment that costs no counted bytes\n"
        'SHARD_NOTE = "na\u00efve \u2248 \u00b5s"  # non-ASCII source text survives every encoding\n\n\n'
        "def shard_value(x: float) -> float:\n    \"\"\"Scaled value.\"\"\"\n    return x * SHARD_SCALE + math.pi\n"),
    "eval/cli_only.py": '"""Only the CLI uses this."""\n\n\ndef cli_helper():\n    return 1\n',
    "eval/bpb.py": (
        '"""Needs shards and (inside a function) quant."""\n\nimport math\n\nfrom eval.shards import shard_value\n\n\n'
        "def bpb_of(x: float) -> float:\n"
        "    from quant.core import quant_round as rounder\n"
        "    return rounder(shard_value(x) / math.log(2))\n"),
    "quant/__init__.py": '"""Fake quant package."""\n',
    "quant/core.py": (
        '"""Core."""\n\nimport math\nfrom typing import Optional\n\nQUANT_BASE = 2\n\n\n'
        "def quant_round(x: float, digits: Optional[int] = None) -> float:\n"
        "    return round(x, 6 if digits is None else digits)\n"),
    "quant/policy.py": (
        '"""Policy: an import-time dependency on quant.core (a dataclass default)."""\n\nimport dataclasses\n'
        "from typing import Optional\n\nfrom quant.core import QUANT_BASE, quant_round as qround\n\n\n"
        "@dataclasses.dataclass(frozen=True)\nclass QuantPolicyFake:\n    bits: int = QUANT_BASE + 4\n"
        "    note: Optional[str] = None\n\n    def apply(self, x: float) -> float:\n        return qround(x) + self.bits\n"),
    "train_gpt.py": (
        '"""Fake trainer with the real measure_code_bytes hook."""\n\nimport dataclasses\nimport hashlib\n'
        "import importlib\nimport json\nimport os\nimport sys\nfrom pathlib import Path\n\n"
        "from eval.bpb import bpb_of\nfrom eval.shards import SHARD_NOTE\nfrom quant.policy import QuantPolicyFake\n\n"
        'BUNDLE_KIND = "package"\n\n\n'
        "def measure_code_bytes() -> int:\n"
        '    if BUNDLE_KIND == "packed":\n        return os.path.getsize(__file__)\n'
        '    if BUNDLE_KIND == "human":\n        return os.path.getsize(Path(__file__).with_name("train_gpt.py"))\n'
        '    return len(importlib.import_module("kit.bundle").build_packed_bytes(Path(__file__).parent,\n'
        '                                                                          os.environ.get("ENCODING")))\n\n\n'
        "def main() -> int:\n    policy = QuantPolicyFake()\n"
        '    code = BUNDLE_SOURCE if BUNDLE_KIND == "packed" else Path(__file__).read_text(encoding="utf-8")\n'
        '    out = {"kind": BUNDLE_KIND, "name": __name__, "value": policy.apply(bpb_of(float(os.environ.get("X", "5")))),\n'
        '           "fields": [f.name for f in dataclasses.fields(policy)], "code_bytes": measure_code_bytes(),\n'
        '           "file": os.path.basename(__file__), "note": SHARD_NOTE, "policy_class": type(policy).__name__,\n'
        '           "code_sha": hashlib.sha256(code.encode()).hexdigest()}\n'
        "    print(json.dumps(out))\n    return 0\n\n\n"
        'if __name__ == "__main__":\n    sys.exit(main())\n'),
}


def write_tree(root: Path, overrides=None) -> Path:
    files = dict(FAKE_TREE)
    files.update(overrides or {})
    for rel, text in files.items():
        if text is None:
            continue
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8")
    return root


@pytest.fixture
def fake_root(tmp_path):
    return write_tree(tmp_path / "src")


def clean_env(**extra):
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(extra)
    return env


# -----------------------------------------------------------------------------------------------
# fake package
# -----------------------------------------------------------------------------------------------


def test_modules_in_pipeline_order_cli_modules_left_out(fake_root, monkeypatch):
    # the pipeline list decides wherever the imports leave a choice
    monkeypatch.setattr(bundle_modules, "BUNDLE_PIPELINE", ("eval/shards.py", "quant/core.py", "quant/policy.py"))
    modules, left_out = bundle.discover_modules(fake_root)
    assert [m.relpath for m in modules] == ["eval/shards.py", "quant/core.py", "quant/policy.py", "eval/bpb.py",
                                            "train_gpt.py"]
    assert left_out == ["eval/cli_only.py"]
    human = bundle.build_human_source(fake_root)
    banners = re.findall(r"^# (\S+\.py)$", human, re.M)
    assert banners == [m.relpath for m in modules]
    assert "__main__.py" not in human and "cli_helper" not in human


def test_imports_hoisted_deduplicated_and_internal_ones_removed(fake_root):
    human = bundle.build_human_source(fake_root)
    head = human.split("# eval/shards.py")[0]
    assert head.count("import math\n") == 1 and "import math" not in human.split("# eval/shards.py")[1]
    assert "from typing import Optional" in head and human.count("from typing import") == 1
    assert not re.search(r"^\s*(from|import) (quant|eval|train_gpt)\b", human, re.M)
    assert "qround = quant_round" in human  # a top-level alias becomes an assignment
    assert "    rounder = quant_round" in human  # so does a nested one, at its indentation
    assert 'BUNDLE_KIND = "human"' in human and '"package"' not in human


ENCODINGS = ("ascii", "base93", "base85", "latin1")


def test_build_is_deterministic_and_independent_of_the_location(fake_root, tmp_path):
    def build(root):
        return (bundle.build_human_source(root), *(bundle.build_packed_bytes(root, enc) for enc in bundle.BUNDLE_ENCODINGS))

    first = build(fake_root)
    moved = shutil.copytree(fake_root, tmp_path / "elsewhere" / "copy")
    assert build(moved) == first
    a, b = tmp_path / "out_a", tmp_path / "out_b"
    bundle.write_bundle(a, fake_root, "latin1")
    bundle.write_bundle(b, moved, "latin1")
    for name in ("train_gpt.py", "train_gpt_human.py"):
        assert (a / name).read_bytes() == (b / name).read_bytes()
    assert (a / "train_gpt.py").read_bytes() == first[3]
    assert (a / "train_gpt_human.py").read_bytes() == first[0].encode()


def test_packed_size_is_remembered_per_source_and_rebuilt_when_the_source_changes(fake_root, tmp_path, monkeypatch):
    cache = tmp_path / "cache"
    size = bundle.packed_size(fake_root, "base93", cache_dir=cache)
    assert size == len(bundle.build_packed_bytes(fake_root, "base93")) and len(list(cache.glob("*.z"))) == 1
    packs = []
    monkeypatch.setattr(bundle_cache, "pack_code", lambda *a: packs.append(a) or (b"x" * 7, "", []))
    assert bundle.packed_size(fake_root, "base93", cache_dir=cache) == size and packs == []  # from the cache
    assert bundle.packed_size(fake_root, "base85", cache_dir=cache) == 7 and len(packs) == 1  # another encoding
    (fake_root / "quant" / "policy.py").write_text((fake_root / "quant" / "policy.py").read_text() + "\nX_NEW = 1\n")
    assert bundle.packed_size(fake_root, "base93", cache_dir=cache) == 7 and len(packs) == 2  # the source changed
    (cache / "broken.z").write_text("{")
    for path in cache.glob("*.z"):  # a damaged entry is rebuilt, not trusted
        path.write_bytes(b"not zlib")
    assert bundle.packed_size(fake_root, "base93", cache_dir=cache) == 7 and len(packs) == 3


def _minified(root) -> str:
    return bundle.minify_source(bundle.set_bundle_kind(bundle.build_human_source(root), "packed"))


def test_minified_source_drops_comments_docstrings_and_argument_annotations(fake_root):
    minified = _minified(fake_root)
    assert "#" not in minified.replace('"#"', "") and "Scaled value" not in minified  # comments, docstrings gone
    # class attribute annotations stay (dataclasses read them; `int` may be a shortened alias of it)
    assert re.search(r"\bbits:\w+=", minified.replace(" ", ""))
    assert "digits:" not in minified  # argument annotations go
    assert "shard_value" not in minified and "QUANT_BASE" not in minified  # global names are shortened
    assert "na\u00efve \u2248 \u00b5s" in minified  # non-ASCII text is kept as is


@pytest.mark.parametrize("encoding", ["base93", "base85", "latin1"])
def test_each_encoding_keeps_its_smallest_candidate_and_round_trips(fake_root, encoding):
    minified = _minified(fake_root)
    packed, name, tried = bundle.pack_code(minified, encoding)
    assert isinstance(packed, bytes) and name.endswith(f" + {encoding}")
    assert all(n.endswith(f" + {encoding}") for n, _ in tried) and len(tried) == len({n for n, _ in tried})
    assert len(packed) == min(size for _, size in tried) == dict(tried)[name]
    assert bundle.packed_encoding(packed) == encoding
    assert bundle.unpack_packed(packed) == minified
    if encoding != "latin1":  # plain printable ASCII: any tool reads it as UTF-8 text
        assert packed.isascii() and not packed.startswith(b"#")
        assert all(32 <= c < 127 or c == 10 for c in packed)
        assert ast.dump(ast.parse(packed.decode("utf-8"))) == ast.dump(ast.parse(packed))
    else:
        assert packed.startswith(b"#coding:l1\n")
        assert tokenize.detect_encoding(io.BytesIO(packed).readline)[0] == "l1"  # what tracebacks/linecache use
        assert codecs.lookup("l1").name == "iso8859-1"
    # a large source compresses: an LZMA wrapper wins; the line the traceback shows stays short
    big = minified + "\n" + "\n".join(f"def f{i}(x):\n    return x + {i}" for i in range(400))
    packed_big, name_big, _ = bundle.pack_code(big, encoding)
    assert name_big.startswith("lzma") and len(packed_big) < len(big) / 3
    exec_line = [ln for ln in packed_big.split(b"\n") if ln.startswith(b"exec(")][0]
    assert exec_line.startswith(b"exec(BUNDLE_SOURCE:=L.decompress(") and len(exec_line) < 60, exec_line
    assert bundle.unpack_packed(packed_big) == big


def test_ascii_is_the_default_and_keeps_the_smaller_ascii_encoding(fake_root, monkeypatch):
    monkeypatch.delenv("BUNDLE_ENCODING", raising=False)
    minified = _minified(fake_root)
    rng = random.Random(0)  # a payload of several KB, like the real one (base93's decoder line pays off above ~3.4 KB)
    big = minified + "\n" + "\n".join(f"def g{i}(x):\n    return x * {rng.randrange(10**9)} - {i * i}" for i in range(800))
    for code in (minified, big):
        packed, name, tried = bundle.pack_code(code)  # the default
        sizes = {enc: size for enc, (_, size) in bundle._best_by_encoding(tried).items()}
        assert set(sizes) == {"base93", "base85"} and packed.isascii()
        assert len(packed) == min(sizes.values()) == len(bundle.pack_code(code, name.rsplit(" + ")[1])[0])
    # on compressed code base93 beats base85 (1.223 vs 1.25 chars per byte); latin1 beats both but is opt-in
    latin1 = len(bundle.pack_code(big, "latin1")[0])
    assert name.endswith(" + base93") and latin1 < sizes["base93"] < sizes["base85"]
    monkeypatch.setenv("BUNDLE_ENCODING", "latin1")  # the opt-in for runs and make_record alike
    assert bundle.pack_code(minified)[1].endswith(" + latin1") and bundle.default_encoding() == "latin1"
    monkeypatch.setenv("BUNDLE_ENCODING", "auto")
    with pytest.raises(ValueError, match="BUNDLE_ENCODING='auto': expected one of ascii, base93, base85, latin1"):
        bundle.pack_code(minified)
    with pytest.raises(ValueError, match="encoding='utf8'"):
        bundle.pack_code(minified, "utf8")


@pytest.mark.parametrize("data", [b"\x00", b"\x00\x00\x01", b"\xff" * 40, bytes(range(256)), b"\x00" * 7 + b"x",
                                  bytes(random.Random(3).randrange(256) for _ in range(20_001))])
def test_base93_round_trips_through_the_wrapper_decoder(data):
    digits = bundle.base93_encode(data)
    assert b'"' not in digits and b"\\" not in digits and all(32 <= c < 127 for c in digits)
    env = {}
    exec(bundle.BUNDLE_BASE93_DECODER, env)  # the exact line the packed file carries
    assert env["f"](digits).to_bytes(len(data), "big") == data == bundle.base93_decode(digits, len(data))
    value = int.from_bytes(data, "big")
    assert len(digits) == bundle._base93_num_digits(value) and (value == 0 or 93 ** (len(digits) - 1) <= value)
    if len(data) > 1000:  # 8 / log2(93) chars per byte
        assert len(digits) <= len(data) * 8 / math.log2(93) + 1
    with pytest.raises(ValueError):
        bundle.base93_decode(digits + b"\\", len(data) + 1)
    with pytest.raises(OverflowError):  # more digits than the bytes can hold
        bundle.base93_decode(b"~" * (math.ceil(len(data) * 8 / math.log2(93)) + 1), len(data))


def _tricky_payloads():
    rng = random.Random(1234)
    every = bytes(range(256))
    yield every
    yield every[::-1]
    yield bytes(rng.randrange(256) for _ in range(20_000)) + every
    alphabet = b"\x00\r\n\\\"'07893a\x85\xa0\xff\x0c\x1a"
    for _ in range(300):
        yield bytes(rng.choice(alphabet) for _ in range(rng.randrange(0, 14)))
    yield b'"' * 7
    yield b"'" * 8
    yield b"\\"
    yield b"\x00"
    yield b"\x000" + b"\x007" + b"\x008" + b"\x00\x00"


def test_latin1_literal_is_byte_exact_for_every_byte_value_and_quoting_style():
    cookie = bundle.BUNDLE_LATIN1_COOKIE.encode()
    for payload in _tricky_payloads():
        for quote in bundle.BUNDLE_LATIN1_QUOTES:
            literal = bundle._quote_latin1(payload.decode("latin-1"), quote)
            src = cookie + b"X=" + literal.encode("latin-1") + b".encode('l1')\n"
            env = {}
            exec(compile(src, "t.py", "exec"), env)  # bytes: the tokenizer honours the cookie
            assert env["X"] == payload, (quote, payload)
            assert b"\x00" not in src and b"\r" not in src
        best = bundle.latin1_literal(payload)
        assert len(best) == min(len(bundle._quote_latin1(payload.decode("latin-1"), q))
                                for q in bundle.BUNDLE_LATIN1_QUOTES)
    # escapes cost only what they must: random bytes grow by ~3/256 (backslash, NUL, CR)
    rnd = bytes(random.Random(7).randrange(256) for _ in range(50_000))
    assert len(bundle.latin1_literal(rnd)) < 50_000 * 1.02


def test_latin1_file_with_every_byte_value_runs_from_disk(tmp_path):
    payload = bytes(random.Random(5).randrange(256) for _ in range(5_000)) + bytes(range(256)) + b'\r\n"\\'
    src = (bundle.BUNDLE_LATIN1_COOKIE.encode() + b"import sys\nX=" + bundle.latin1_literal(payload).encode("latin-1")
           + b".encode('l1')\nsys.stdout.buffer.write(X)\n")
    (tmp_path / "t.py").write_bytes(src)
    proc = subprocess.run([sys.executable, "t.py"], cwd=tmp_path, capture_output=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == payload


def test_unpack_refuses_a_file_that_is_not_a_wrapper_without_running_it(tmp_path):
    marker = tmp_path / "ran"
    with pytest.raises(ValueError, match="not a packed file"):
        bundle.unpack_packed(f"import pathlib\npathlib.Path({str(marker)!r}).write_text('x')\n".encode())
    assert not marker.exists()


def test_a_damaged_payload_fails_the_round_trip(fake_root):
    packed = bytearray(bundle.pack_code(_minified(fake_root), "latin1")[0])
    packed[len(packed) // 2] ^= 0x20
    with pytest.raises(Exception):  # noqa: B017 (whichever decoder meets the damage raises its own error)
        bundle.unpack_packed(bytes(packed))


def run_py(script: Path, cwd: Path, cmd=None, **env):
    proc = subprocess.run(cmd or [sys.executable, str(script.name)], cwd=cwd, env=clean_env(**env),
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("encoding", ENCODINGS)
def test_package_human_and_packed_behave_identically(fake_root, tmp_path, encoding):
    out = tmp_path / "record"
    bundle.write_bundle(out, fake_root, encoding)
    packed_file = (out / "train_gpt.py").read_bytes()
    if encoding == "ascii":  # a tiny payload: base85's shorter wrapper wins; the real package picks base93
        assert bundle.packed_encoding(packed_file) in bundle.BUNDLE_ASCII_ENCODINGS and packed_file.isascii()
    else:
        assert bundle.packed_encoding(packed_file) == encoding
    package = run_py(fake_root / "train_gpt.py", fake_root, X="7", PYTHONPATH=str(REPO), ENCODING=encoding)
    human = run_py(out / "train_gpt_human.py", out, X="7")
    packed = run_py(out / "train_gpt.py", out, X="7")
    assert (package["kind"], human["kind"], packed["kind"]) == ("package", "human", "packed")
    for result in (package, human, packed):
        assert result["name"] == "__main__"
        assert result["value"] == package["value"]
        assert result["fields"] == ["bits", "note"]
        assert result["note"] == "na\u00efve \u2248 \u00b5s"
        assert result["policy_class"] == "QuantPolicyFake"  # class names stay (type(err).__name__ is logged)
        assert result["code_bytes"] == len(packed_file)  # measured, in all three modes
    assert packed["file"] == "train_gpt.py"  # __file__ is the packed file itself
    # BUNDLE_SOURCE, set by the wrapper, is the code that runs: the minified source
    assert packed["code_sha"] == hashlib.sha256(bundle.unpack_packed(packed_file).encode()).hexdigest()


@pytest.mark.parametrize("encoding", ["base93", "latin1"])
def test_packed_file_runs_under_torchrun(fake_root, tmp_path, encoding):
    pytest.importorskip("torch.distributed.run")
    out = tmp_path / "record"
    bundle.write_bundle(out, fake_root, encoding)
    packed_file = (out / "train_gpt.py").read_bytes()
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=1", "train_gpt.py"]
    result = run_py(out / "train_gpt.py", out, cmd=cmd, X="7", OMP_NUM_THREADS="1")
    assert (result["kind"], result["name"], result["code_bytes"]) == ("packed", "__main__", len(packed_file))


def test_cli_writes_both_files_and_reports_the_split_and_the_encodings(fake_root, tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("BUNDLE_ENCODING", raising=False)
    assert bundle.main(["--out", str(tmp_path / "o"), "--root", str(fake_root)]) == 0
    out = capsys.readouterr().out
    packed_file = (tmp_path / "o" / "train_gpt.py").read_bytes()
    ast.parse((tmp_path / "o" / "train_gpt.py").read_text())  # opens as text (UTF-8): ASCII by default
    report = bundle.bundle_report(fake_root)
    chosen = report["encoding"]
    assert chosen in ("base93", "base85") and packed_file.isascii()
    assert f"packed train_gpt.py: {len(packed_file):,} bytes ({chosen}: {report['candidate']};" in out
    for enc in ("base93", "base85", "latin1"):  # every encoding is measured, whichever is chosen
        name, size = report["by_encoding"][enc]
        assert re.search(rf"^{enc} +{size:,}  {re.escape(name)} \((ASCII|not UTF-8)\)"
                         rf"{'  <- chosen' if enc == chosen else ''}$", out, re.M)
    assert report["packed_bytes"] == len(packed_file) == min(report["by_encoding"][e][1] for e in ("base93", "base85"))
    assert report["packed_file"] == packed_file and bundle.packed_encoding(packed_file) == chosen
    for rel in ("eval/shards.py", "quant/core.py", "quant/policy.py", "eval/bpb.py", "train_gpt.py"):
        assert rel in out
    assert "left out (not reached from train_gpt.py): eval/cli_only.py" in out
    modules = [r for r in report["split"] if r["module"] != "<wrapper>"]
    assert all(r["compressed_bytes"] > 0 for r in modules)
    # the per-module shares add up to the real file: payload shares + the wrapper
    assert sum(r["packed_share_bytes"] for r in report["split"]) == len(packed_file)
    assert re.search(rf"^total +[\d,]+ +[\d,]+ +{len(packed_file):,}$", out, re.M)
    assert report["rename_blockers"] == [] and "WARNING" not in out


@pytest.mark.parametrize("encoding", ["base93", "base85", "latin1"])
def test_cli_encoding_flag_forces_one_and_states_the_trade_off(fake_root, tmp_path, capsys, encoding):
    assert bundle.main(["--out", str(tmp_path / "o"), "--root", str(fake_root), "--encoding", encoding]) == 0
    out = capsys.readouterr().out
    packed_file = (tmp_path / "o" / "train_gpt.py").read_bytes()
    assert bundle.packed_encoding(packed_file) == encoding
    assert f"packed train_gpt.py: {len(packed_file):,} bytes ({encoding}: " in out
    assert ("note: a latin1" in out and "GitHub shows it as binary" in out) == (encoding == "latin1")
    doc = " ".join(bundle.__doc__.split())
    assert "NOT UTF-8" in doc and "GitHub shows it as binary" in doc
    assert bundle.main(["--out", str(tmp_path / "q"), "--root", str(fake_root), "--encoding", encoding,
                        "--quiet"]) == 0
    assert (tmp_path / "q" / "train_gpt.py").read_bytes() == packed_file
    with pytest.raises(SystemExit):
        bundle.main(["--out", str(tmp_path / "x"), "--root", str(fake_root), "--encoding", "utf8"])


BAD_TREES = {
    "duplicate name": ({"quant/core.py": FAKE_TREE["quant/core.py"] + "\n\ndef shard_value():\n    return 0\n"},
                       "'shard_value' is bound in both eval/shards.py and quant/core.py"),
    "duplicate via import": ({"quant/core.py": "from os import sep as SHARD_SCALE\n" + FAKE_TREE["quant/core.py"]},
                             "'SHARD_SCALE'"),
    "import quant.x": ({"eval/bpb.py": FAKE_TREE["eval/bpb.py"].replace(
        "from eval.shards import shard_value", "import eval.shards")}, "eval/bpb.py:5: `import eval.shards`"),
    "from package import module": ({"eval/bpb.py": FAKE_TREE["eval/bpb.py"].replace(
        "from eval.shards import shard_value", "from eval import shards")}, "internal imports must have the form"),
    "relative import": ({"eval/bpb.py": FAKE_TREE["eval/bpb.py"].replace(
        "from eval.shards import shard_value", "from .shards import shard_value")}, "internal imports must have"),
    "missing name": ({"eval/bpb.py": FAKE_TREE["eval/bpb.py"].replace(
        "import shard_value", "import shard_value, nope")}, "eval/shards.py defines no top-level name 'nope'"),
    "star import": ({"eval/bpb.py": FAKE_TREE["eval/bpb.py"].replace(
        "import shard_value", "import *")}, "star imports"),
    "import from a CLI module": ({"eval/bpb.py": FAKE_TREE["eval/bpb.py"] + "\n\ndef g():\n    from eval.__main__ import x\n"},
                                 "not a bundlable library module"),
    "main guard in library": ({"quant/core.py": FAKE_TREE["quant/core.py"] + '\nif __name__ == "__main__":\n    print(1)\n'},
                              "quant/core.py:12: `if __name__"),
    "no BUNDLE_KIND line": ({"train_gpt.py": FAKE_TREE["train_gpt.py"].replace('BUNDLE_KIND = "package"',
                                                                               'BUNDLE_KIND = "pkg"')},
                            'BUNDLE_KIND = "package"'),
    "import sharing a line": ({"quant/core.py": FAKE_TREE["quant/core.py"].replace("import math\n", "import math; X = 1\n")},
                              "on lines of its own"),
    "library imports the trainer at top level": (
        {"quant/core.py": "from train_gpt import main\n" + FAKE_TREE["quant/core.py"]}, "imports train_gpt at top level"),
}


@pytest.mark.parametrize("case", sorted(BAD_TREES))
def test_refuses_what_would_not_behave_like_the_package(tmp_path, case):
    overrides, message = BAD_TREES[case]
    root = write_tree(tmp_path / "bad", overrides)
    with pytest.raises(BundleError) as err:
        bundle.build_human_source(root)
    assert message in str(err.value)


def test_cli_reports_a_bundle_error_with_exit_2(tmp_path, capsys):
    root = write_tree(tmp_path / "bad", BAD_TREES["duplicate name"][0])
    assert bundle.main(["--out", str(tmp_path / "o"), "--root", str(root)]) == 2
    assert "shard_value" in capsys.readouterr().err
    assert not (tmp_path / "o" / "train_gpt.py").exists()


def test_locals_or_globals_anywhere_stop_renaming_and_the_report_says_so(tmp_path, capsys):
    src = FAKE_TREE["quant/core.py"] + ("\n\ndef peek():\n    return sorted(locals()) + sorted(globals())\n\n\n"
                                       "QUANT_PEEK = dict(peek=peek)  # built by a call: the bundle keeps it\n")
    root = write_tree(tmp_path / "tainted", {"quant/core.py": src})
    human = bundle.set_bundle_kind(bundle.build_human_source(root), "packed")
    blockers = bundle.renaming_blockers(human)
    assert [b.split(" ")[0] for b in blockers] == ["locals", "globals"]
    assert "shard_value" in bundle.minify_source(human)  # python-minifier then renames nothing
    assert bundle.main(["--out", str(tmp_path / "o"), "--root", str(root)]) == 0
    assert "WARNING: names are not shortened" in capsys.readouterr().out


def test_without_a_trainer_all_library_modules_are_bundled(tmp_path, monkeypatch):
    monkeypatch.setattr(bundle_modules, "BUNDLE_PIPELINE", ("eval/shards.py", "quant/core.py", "quant/policy.py"))
    root = write_tree(tmp_path / "lib", {"train_gpt.py": None})
    modules, left_out = bundle.discover_modules(root)
    assert [m.relpath for m in modules] == ["eval/shards.py", "quant/core.py", "quant/policy.py", "eval/bpb.py",
                                            "eval/cli_only.py"] and left_out == []


# -----------------------------------------------------------------------------------------------
# the real package
# -----------------------------------------------------------------------------------------------

def test_real_package_bundles_deterministically_in_pipeline_order():
    modules, _ = bundle.discover_modules(REPO)
    order = [m.relpath for m in modules]
    assert order[:2] == ["primitives/env.py", "primitives/files.py"] and order[-1] == "train_gpt.py"
    assert order[:-1] == list(bundle_modules.BUNDLE_PIPELINE)  # a bundled module missing from the list moves others
    assert order.index("shards/format.py") < min(i for i, r in enumerate(order) if r.startswith(("quant/", "eval/")))
    quant = [i for i, r in enumerate(order) if r.startswith("quant/")]
    evals = [order.index(r) for r in ("eval/bpb.py", "eval/roundtrip.py", "eval/sliding.py") if r in order]
    assert quant and evals and max(quant) < min(evals)
    position = {m.name: i for i, m in enumerate(modules)}
    for i, m in enumerate(modules):  # dependencies first (eval/roundtrip.py imports eval/sliding.py)
        assert all(position[d] < i for d in m.top_level_deps), m.relpath
    human = bundle.set_bundle_kind(bundle.build_human_source(REPO), "packed")
    assert bundle.renaming_blockers(human) == []  # locals()/globals()/... would cost ~1.4 KB of the shipped file
    minified = bundle.minify_source(human)
    packed, name, tried = bundle.pack_code(minified, "ascii")
    latin1 = bundle.pack_code(minified, "latin1")[0]
    assert bundle.unpack_packed(packed) == minified == bundle.unpack_packed(latin1)
    assert bundle.pack_code(minified, "ascii")[0] == packed and packed.isascii()  # deterministic
    sizes = {enc: size for enc, (_, size) in bundle._best_by_encoding(tried).items()}
    print(f"real package: {len(packed):,} bytes ({name}); {sizes}; latin1 {len(latin1):,}")
    assert len(latin1) < sizes["base93"] == len(packed) < sizes["base85"]


@pytest.mark.slow
def test_cli_ascii_bundle_is_byte_identical_across_runs_and_opens_as_text(tmp_path):
    env = clean_env()
    env.pop("BUNDLE_ENCODING", None)
    files = []
    for run in ("a", "b"):  # two processes: nothing may depend on hash order, time or the output folder
        proc = subprocess.run([sys.executable, str(REPO / "tools" / "bundle.py"), "--out", str(tmp_path / run), "--quiet"],
                              cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stderr
        files.append((tmp_path / run / "train_gpt.py").read_bytes())
    assert files[0] == files[1] and files[0].isascii()
    path = tmp_path / "a" / "train_gpt.py"
    ast.parse(open(path).read())  # what reviewers' scripts do (UTF-8 text)
    # the CLI packs for the settings of its environment, as a run measures its code bytes
    assert files[0] == bundle.build_packed_bytes(REPO, settings=bundle.pack_settings(env))
    assert bundle.packed_encoding(files[0]) == "base93"


TINY_ENV = {
    "PRESET": "smoke", "NUM_LAYERS": "2", "MODEL_DIM": "64", "NUM_HEADS": "2", "NUM_KV_HEADS": "1",
    "ROPE_DIMS": "16", "XSA_LAST_N": "1", "TRAIN_SEQ_LEN": "64", "TRAIN_BATCH_TOKENS": "1024",
    "ITERATIONS": "3", "MAX_WALLCLOCK_SECONDS": "0", "TRAIN_LOG_EVERY": "1", "VAL_MAX_TOKENS": "2048",
    "EVAL_STRIDE": "32", "EVAL_BATCH_SEQS": "16", "VAL_BATCH_SIZE": "2048", "QAT_START_FRAC": "0.5",
    "SEED": "11", "OMP_NUM_THREADS": "1",
}
_VOLATILE = re.compile(r" (train_time|step_avg|tok_s|eval_time):\S+")
# fields only the package logs (the kit's diagnostics: the bundle leaves them out, docs/bundle.md)
_PACKAGE_ONLY_FIELDS = re.compile(r" train_flops_per_token:\S+")


def _loss_lines(log: str) -> list:
    body = log.split("\n" + "=" * 100 + "\n", 1)[-1]
    # "Total submission size" is left out: the model blob's bytes can differ by run (safetensors
    # writes its __metadata__ dict in a per-process hash order), which is not the bundler's doing
    keep = [ln for ln in body.splitlines() if ln.startswith(("step:", "final_")) or "code_bytes:" in ln]
    return [_PACKAGE_ONLY_FIELDS.sub("", _VOLATILE.sub("", ln)) for ln in keep]


@pytest.mark.slow
def test_package_human_and_packed_trainer_give_identical_losses_and_code_bytes(tiny_dataset, sp1024_model, tmp_path):
    out = tmp_path / "record"
    bundle.write_bundle(out, REPO, settings=bundle.pack_settings(TINY_ENV))  # --encoding auto: what the runs measure
    packed_file = (out / "train_gpt.py").read_bytes()
    packed_bytes = len(packed_file)
    print(f"packed train_gpt.py: {packed_bytes:,} bytes, {bundle.packed_encoding(packed_file)}")
    logs = {}
    for kind, script, cwd, pythonpath in (("package", REPO / "train_gpt.py", REPO, str(REPO)),
                                          ("human", out / "train_gpt_human.py", out, None),
                                          ("packed", out / "train_gpt.py", out, None)):
        env = clean_env(**TINY_ENV, DATA_PATH=str(tiny_dataset), TOKENIZER_PATH=str(sp1024_model),
                        OUT_DIR=str(tmp_path / "runs"), RUN_ID=kind)
        if pythonpath:
            env["PYTHONPATH"] = pythonpath
        proc = subprocess.run([sys.executable, str(script)], cwd=cwd, env=env, capture_output=True, text=True,
                              timeout=400)
        assert proc.returncode == 0, f"{kind}:\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}"
        logs[kind] = (tmp_path / "runs" / kind / "train.log").read_text()
    lines = {k: _loss_lines(v) for k, v in logs.items()}
    assert sum(ln.startswith("step:") for ln in lines["package"]) == 3
    assert any(ln.startswith("final_sliding_window_exact") for ln in lines["package"])
    assert lines["human"] == lines["package"] and lines["packed"] == lines["package"]
    logged_code = {k: v.split("\n" + "=" * 100 + "\n", 1)[0].rstrip("\n") for k, v in logs.items()}
    assert logged_code["packed"] == bundle.unpack_packed(packed_file).rstrip("\n")  # BUNDLE_SOURCE: the code run
    assert logged_code["human"] == logged_code["package"] == (out / "train_gpt_human.py").read_text().rstrip("\n")
    for kind, log in logs.items():
        assert f"code_bytes:{packed_bytes}" in log, kind
        result = json.loads((tmp_path / "runs" / kind / "result.json").read_text())
        assert result["bytes_code"] == packed_bytes


PACKED_GROWTH_ALLOWED_BYTES = 1000


@functools.cache
def packed_real(preset: str | None) -> bytes:
    """The real package's file (ascii) packed for `preset`'s settings (None: every module), built once per session."""
    return bundle.build_packed_bytes(REPO, "ascii", None if preset is None else bundle.pack_settings({"PRESET": preset}))


def test_each_presets_packed_file_within_the_budget_the_docs_table_records():
    """The file packed for each preset of docs/bundle.md's per-preset table (and `--all`) may grow by at
    most 1,000 bytes over its figure there; more needs the row updated, saying what bought it."""
    doc = (REPO / "docs" / "bundle.md").read_text(encoding="utf-8")
    rows = re.findall(r"^\| `([\w.-]+)`[^|]* \| ([\d,]+) \|", doc.split("\n## Budget\n", 1)[1], re.M)
    assert {"1xh100-sp8192", "1xh100-frontier", "--all"} <= {p for p, _ in rows}
    for preset, figure in rows:
        size = len(packed_real(None if preset == "--all" else preset))
        assert size <= int(figure.replace(",", "")) + PACKED_GROWTH_ALLOWED_BYTES, (
            f"PRESET={preset}: train_gpt.py packs to {size:,} bytes, more than {figure} + "
            f"{PACKED_GROWTH_ALLOWED_BYTES:,}: update its row of docs/bundle.md's budget table saying what bought it")


def test_packed_file_within_the_budget_the_docs_table_records():
    """The file with every module may grow by at most 1,000 bytes over the last figure of the all-modules
    budget table in docs/bundle.md; more needs a new row there saying what bought it."""
    doc = (REPO / "docs" / "bundle.md").read_text(encoding="utf-8")
    table = doc.split("\n**Every module (`--all`).**", 1)[1].split("\n\n**", 1)[0]
    rows = re.findall(r"^\| ([\d,]+) \| (.*) \|$", table, re.M)
    assert rows and all(why.strip() for _, why in rows), "docs/bundle.md: the budget table has no figure"
    recorded = int(rows[-1][0].replace(",", ""))
    size = len(packed_real(None))
    assert size <= recorded + PACKED_GROWTH_ALLOWED_BYTES, (
        f"train_gpt.py packs to {size:,} bytes, more than {recorded:,} + {PACKED_GROWTH_ALLOWED_BYTES:,}: add a row "
        f"to the budget table of docs/bundle.md saying what bought it")
