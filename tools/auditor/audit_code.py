"""Read a record's `train_gpt.py` the way a reviewer does, without running any of it (tools/audit.py).

Record scripts are often packed: a short stub that decompresses a literal payload and `exec`s it.
The forms seen in openai/parameter-golf records and in our bundler (tools/bundle.py):

    import lzma as L,base64 as B
    exec(L.decompress(B.b85decode("..."),format=L.FORMAT_RAW,filters=[{"id":L.FILTER_LZMA2}]))
    #coding:l1                                   (our latin-1 form: PEP 263 cookie, bytes in a str)
    import lzma as L
    exec(BUNDLE_SOURCE:=L.decompress(\n"...".encode('l1')).decode())
    import lzma as L                             (our ASCII default: base93 digits, decoded by a lambda)
    f=lambda s:...
    exec(BUNDLE_SOURCE:=L.decompress(f(\nb"...").to_bytes(N,"big")).decode())
    exec(open(__file__.replace("train_gpt.py","train_gpt_decode.py")).read())   (code in a sibling file)

`unpack_script` parses the file with `ast` (which honours the coding cookie), finds the top-level
`exec(...)` calls and evaluates their argument with a small interpreter that knows only literals,
the module aliases bound by the stub's imports, a whitelist of pure decoders (lzma / zlib / bz2 /
gzip / zstandard / brotli decompress, base64 decoders, `bytes.decode`, `str.encode`, `bytes.fromhex`,
tools/bundle.py's base93 lambda, recognized by its exact text and computed by `base93_value`, and
`int.to_bytes`) and
`open(<sibling of __file__>).read()`. Nothing of the file is executed, imported or compiled to
code objects; decompression output is capped (`MAX_UNPACKED_BYTES`) against decompression bombs.
Nested stubs (a payload that is itself a stub) are unpacked up to `MAX_DEPTH` levels.

`imported_modules(source)` lists the top-level module names a source imports (and which of them
sit in `try: ... except ImportError` blocks, i.e. are optional).
"""

from __future__ import annotations

import ast
import base64
import binascii
import bz2
import codecs
import dataclasses
import lzma
import zlib
from pathlib import Path

from tools.auditor.audit_parse import imported_modules, parse_any
from kit.bundle import BUNDLE_BASE93_DECODER, base93_value

MAX_UNPACKED_BYTES = 64 << 20  # a record's source is < 1 MB; anything near this is a bomb
MAX_DEPTH = 3

_LZMA_CONSTANTS = {name: getattr(lzma, name) for name in dir(lzma) if name.isupper()}
_ZLIB_CONSTANTS = {name: getattr(zlib, name) for name in dir(zlib) if name.isupper()}
_BASE64_DECODERS = ("b85decode", "b64decode", "a85decode", "b32decode", "b16decode", "decodebytes",
                    "standard_b64decode", "urlsafe_b64decode", "decodestring")


# tools/bundle.py's base93 decoder (`f=lambda s:...`), matched by its AST: only this exact lambda is read
_BASE93_LAMBDA = ast.dump(ast.parse(BUNDLE_BASE93_DECODER).body[0].value)


class UnsupportedStub(ValueError):
    """The file execs something this reader cannot evaluate without running code."""


@dataclasses.dataclass
class Script:
    """What a record script is. `kind`: "plain" (no top-level exec: the file is the source),
    "packed" (one or more exec payloads decoded) or "unreadable". `source`: the code that runs
    (payloads joined for "packed"), `layers`: one line per decoding step (e.g. "b85decode ->
    lzma.decompress(FORMAT_RAW) -> decode"), `files`: sibling files the stub reads (their bytes count
    as code), `error`: why the payload could not be read."""

    kind: str
    source: str | None
    layers: list
    files: list
    error: str | None = None


def _capped(data: bytes, what: str) -> bytes:
    if len(data) > MAX_UNPACKED_BYTES:
        raise ValueError(f"{what}: output over {MAX_UNPACKED_BYTES:,} bytes (decompression bomb?)")
    return data


def _lzma_decompress(data, format=lzma.FORMAT_AUTO, memlimit=None, filters=None):
    d = lzma.LZMADecompressor(format=format, memlimit=memlimit, filters=filters)
    out = d.decompress(data, max_length=MAX_UNPACKED_BYTES + 1)
    return _capped(out, "lzma.decompress")


def _zlib_decompress(data, wbits=zlib.MAX_WBITS, bufsize=0):
    out = zlib.decompressobj(wbits).decompress(data, MAX_UNPACKED_BYTES + 1)
    return _capped(out, "zlib.decompress")


def _bz2_decompress(data):
    out = bz2.BZ2Decompressor().decompress(data, max_length=MAX_UNPACKED_BYTES + 1)
    return _capped(out, "bz2.decompress")


def _gzip_decompress(data):
    return _zlib_decompress(data, 16 + zlib.MAX_WBITS)


def _zstd_decompress(data, max_output_size=0):
    import zstandard

    return _capped(zstandard.ZstdDecompressor().decompress(data, max_output_size=MAX_UNPACKED_BYTES + 1),
                   "zstandard.decompress")


def _brotli_decompress(data):
    import brotli

    return _capped(brotli.Decompressor().process(data, output_buffer_limit=MAX_UNPACKED_BYTES + 1), "brotli.decompress")


# (module, function) -> the pure decoder it names
_FUNCTIONS = {("lzma", "decompress"): _lzma_decompress, ("zlib", "decompress"): _zlib_decompress,
              ("bz2", "decompress"): _bz2_decompress, ("gzip", "decompress"): _gzip_decompress,
              ("zstandard", "decompress"): _zstd_decompress, ("zstd", "decompress"): _zstd_decompress,
              ("brotli", "decompress"): _brotli_decompress,
              **{("base64", name): getattr(base64, name) for name in _BASE64_DECODERS if hasattr(base64, name)},
              ("binascii", "a2b_base64"): binascii.a2b_base64, ("binascii", "unhexlify"): binascii.unhexlify,
              ("bundle", "base93"): base93_value,
              ("codecs", "decode"): None}  # codecs.decode handled below (bytes codecs only)


class _Reader:
    """Evaluates the expression inside `exec(...)` over a whitelist; raises UnsupportedStub."""

    def __init__(self, folder: Path | None, script_name: str):
        self.folder, self.script_name = folder, script_name
        self.aliases = {}  # local name -> ("module", name) | ("function", module, name)
        self.layers, self.files = [], []

    def bind_imports(self, tree: ast.Module) -> None:
        for node in tree.body:
            if isinstance(node, ast.Import):
                for a in node.names:
                    root = a.name.split(".")[0]
                    self.aliases[a.asname or root] = ("module", a.name if a.asname else root)
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                for a in node.names:
                    self.aliases[a.asname or a.name] = ("function", node.module, a.name)
            elif (isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name)
                  and ast.dump(node.value) == _BASE93_LAMBDA):
                self.aliases[node.targets[0].id] = ("function", "bundle", "base93")

    def eval(self, node):
        if isinstance(node, ast.Constant) and isinstance(node.value, (str, bytes, int, float, type(None), bool)):
            return node.value
        if isinstance(node, ast.NamedExpr):
            return self.eval(node.value)
        if isinstance(node, (ast.List, ast.Tuple)):
            return [self.eval(e) for e in node.elts]
        if isinstance(node, ast.Dict) and None not in node.keys:
            return {self.eval(k): self.eval(v) for k, v in zip(node.keys, node.values)}
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
            return -self.eval(node.operand)
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
            return self.eval(node.left) + self.eval(node.right)
        if isinstance(node, ast.Name) and node.id == "__file__":
            return str((self.folder or Path(".")) / self.script_name)
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
            target = self.aliases.get(node.value.id)
            if target and target[0] == "module":
                consts = {"lzma": _LZMA_CONSTANTS, "zlib": _ZLIB_CONSTANTS}.get(target[1], {})
                if node.attr in consts:
                    return consts[node.attr]
        if isinstance(node, ast.Call):
            return self.call(node)
        raise UnsupportedStub(f"cannot evaluate `{ast.unparse(node)[:80]}` without running it")

    def _function_of(self, func):
        """(module, name) for `alias.name`, `name` (from-import) or `module.Class().method`."""
        if isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name):
            target = self.aliases.get(func.value.id)
            if target and target[0] == "module":
                return target[1], func.attr
        if isinstance(func, ast.Name):
            target = self.aliases.get(func.id)
            if target and target[0] == "function":
                return target[1], target[2]
        if (isinstance(func, ast.Attribute) and func.attr == "decompress" and isinstance(func.value, ast.Call)
                and isinstance(func.value.func, ast.Attribute) and func.value.func.attr == "ZstdDecompressor"):
            return "zstandard", "decompress"
        return None

    def call(self, node: ast.Call):
        func = node.func
        if isinstance(func, ast.Name) and func.id == "open":
            return self.open_sibling(node)
        if isinstance(func, ast.Name) and func.id == "compile" and node.args:
            return self.eval(node.args[0])
        key = self._function_of(func)
        args = [self.eval(a) for a in node.args]
        kwargs = {k.arg: self.eval(k.value) for k in node.keywords if k.arg}
        if key is not None and key in _FUNCTIONS:
            module, name = key
            if key == ("codecs", "decode"):
                codec = codecs.lookup(args[1] if len(args) > 1 else kwargs.get("encoding", "utf-8"))
                if not isinstance(args[0], bytes) or codec.name not in ("base64", "zlib", "bz2", "hex", "uu"):
                    raise UnsupportedStub(f"codecs.decode with codec {codec.name!r}")
                out = codecs.decode(args[0], codec.name)
            else:
                out = _FUNCTIONS[key](*args, **kwargs)
            detail = ""
            if module == "lzma":
                fmt = kwargs.get("format", args[1] if len(args) > 1 else lzma.FORMAT_AUTO)
                detail = {lzma.FORMAT_RAW: "(raw)", lzma.FORMAT_ALONE: "(alone)", lzma.FORMAT_XZ: "(xz)"}.get(fmt, "")
            self.layers.append(f"{module}.{name}{detail}")
            return out
        if isinstance(func, ast.Attribute):  # methods on evaluated values: .decode() .encode() .read() .replace()
            value = self.eval(func.value)
            if func.attr == "decode" and isinstance(value, bytes):
                enc = args[0] if args else kwargs.get("encoding", "utf-8")
                self.layers.append(f"decode({codecs.lookup(enc).name})")
                return value.decode(enc)
            if func.attr == "encode" and isinstance(value, str):
                enc = args[0] if args else kwargs.get("encoding", "utf-8")
                self.layers.append(f"str.encode({codecs.lookup(enc).name})")
                return value.encode(enc)
            if func.attr == "replace" and isinstance(value, str) and all(isinstance(a, str) for a in args):
                return value.replace(*args)
            if func.attr == "read" and isinstance(value, (str, bytes)):
                return value
            if func.attr == "to_bytes" and type(value) is int and args and type(args[0]) is int:
                if args[0] > MAX_UNPACKED_BYTES:
                    raise ValueError(f"int.to_bytes({args[0]}): larger than {MAX_UNPACKED_BYTES} bytes (a bomb?)")
                return value.to_bytes(*args, **kwargs)
            if func.attr == "fromhex" and isinstance(func.value, ast.Name) and func.value.id == "bytes":
                return bytes.fromhex(args[0])
        raise UnsupportedStub(f"cannot evaluate call `{ast.unparse(node)[:80]}` without running it")

    def open_sibling(self, node: ast.Call):
        """`open(path)` where path is a literal or built from __file__: read a file of the folder."""
        path = Path(self.eval(node.args[0]))
        mode = self.eval(node.args[1]) if len(node.args) > 1 else "r"
        if self.folder is None or path.parent.resolve() != self.folder.resolve() or not path.is_file():
            raise UnsupportedStub(f"opens {path.name!r}, which is not a file of the record folder")
        self.files.append(path.name)
        self.layers.append(f"open({path.name})")
        data = path.read_bytes()
        return data if "b" in str(mode) else data.decode("utf-8")


def _exec_calls(tree: ast.Module) -> list:
    return [n.value for n in tree.body if isinstance(n, ast.Expr) and isinstance(n.value, ast.Call)
            and isinstance(n.value.func, ast.Name) and n.value.func.id == "exec" and n.value.args]


def unpack_script(data: bytes, folder=None, name: str = "train_gpt.py") -> Script:
    """Decode a record script (bytes) without executing it. Raises SyntaxError when the file itself
    does not parse as Python. Returns Script(kind="unreadable", error=...) when a stub's payload
    cannot be evaluated or decoded (a damaged payload, an unsupported stub form); the caller decides
    whether that is a failure (damaged) or not checkable (unsupported)."""
    folder = Path(folder) if folder is not None else None
    source = None
    layers, files = [], []
    tree = ast.parse(data, filename=name)
    for depth in range(MAX_DEPTH + 1):
        calls = _exec_calls(tree)
        if not calls or len(tree.body) > 12:  # a plain script may call exec somewhere; a stub is tiny
            if depth == 0:
                text = data.decode(_source_encoding(data), errors="replace")
                return Script("plain", text, [], [])
            break
        reader = _Reader(folder, name)
        reader.bind_imports(tree)
        parts = []
        try:
            for call in calls:
                value = reader.eval(call.args[0])
                if isinstance(value, bytes):
                    value = value.decode("utf-8")
                if not isinstance(value, str):
                    raise UnsupportedStub(f"exec argument evaluates to {type(value).__name__}, not source text")
                parts.append(value)
        except UnsupportedStub as e:
            return Script("unreadable", None, layers + reader.layers, files + reader.files, f"unsupported stub: {e}")
        except (ValueError, TypeError, LookupError, lzma.LZMAError, zlib.error, OSError, EOFError) as e:
            return Script("unreadable", None, layers + reader.layers, files + reader.files,
                          f"payload does not decode ({type(e).__name__}: {e})")
        layers.append(" -> ".join(reader.layers) or "exec(literal)")
        files += reader.files
        source = "\n".join(parts)
        try:
            tree = parse_any(source)[0]
        except SyntaxError:  # maybe newer syntax, maybe damaged: the caller's parse check tells (parse_imports)
            break
    return Script("packed", source, layers, files)


def _source_encoding(data: bytes) -> str:
    """The PEP 263 encoding of a Python file (utf-8 by default)."""
    import io
    import tokenize

    try:
        return tokenize.detect_encoding(io.BytesIO(data).readline)[0]
    except SyntaxError:
        return "utf-8"


PYTHON_CANDIDATES = ("python3.14", "python3.13", "python3.12")


def tried_parsed(tried: list) -> bool:
    """Some newer interpreter ran the parse helper (and rejected the source)."""
    return any(" failed (exit" not in t for t in tried)


def parse_imports(source: str, pythons=()) -> tuple[set, set, str]:
    """`imported_modules(source)` plus the Python version that parsed it: this interpreter first,
    then each of `pythons` (executables) and the newer `python3.X` on PATH (record scripts often use
    Python 3.12 syntax, e.g. PEP 701 f-strings), run as `python3.X -I tools/auditor/audit_parse.py` (stdlib
    only, so it needs no `tools` on sys.path; it only parses, nothing of the source runs). Raises
    SyntaxError (this interpreter's, with the interpreters tried appended to its msg, and
    `interpreter_failed` set when a newer interpreter could not be run) when none parses it."""
    import json
    import platform
    import shutil
    import subprocess

    try:
        required, optional = imported_modules(source)
        return required, optional, platform.python_version()
    except SyntaxError as e:
        error = e
    tried = []
    pyenv = sorted(Path.home().glob(".pyenv/versions/3.1[2-9]*/bin/python3"), reverse=True)
    failed = False
    for exe in list(pythons) + [p for p in (shutil.which(c) for c in PYTHON_CANDIDATES) if p] + [str(p) for p in pyenv]:
        try:
            proc = subprocess.run([exe, "-I", str(Path(__file__).resolve().with_name("audit_parse.py"))],
                                  input=source.encode("utf-8"), capture_output=True, timeout=60)
        except (OSError, subprocess.SubprocessError):
            continue
        if proc.returncode == 0:
            out = json.loads(proc.stdout)
            return set(out["required"]), set(out["optional"]), out["python"]
        if proc.returncode == 1 and proc.stdout.startswith(b"{"):
            tried.append(json.loads(proc.stdout)["python"])
        else:  # the helper itself failed: say so rather than report the script as unparseable
            failed = True
            tried.append(f"{Path(exe).name} failed (exit {proc.returncode}: "
                         f"{proc.stderr.decode('utf-8', 'replace').strip().splitlines()[-1:] or ['?']})")
    error.msg = f"{error.msg} (Python {platform.python_version()}" + "".join(f", {v}" for v in tried) + ")"
    error.interpreter_failed = failed and not tried_parsed(tried)
    raise error
