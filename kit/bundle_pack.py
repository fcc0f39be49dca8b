"""The packed file of the bundle (tools/bundle.py): the human source minified (python-minifier),
compressed (LZMA / bz2 / zlib, brotli or zstd when the code imports them), its payload written as
base93, base85 or a latin-1 literal, in a short exec wrapper; and the way back (unpack_packed).
"""

from __future__ import annotations

import ast
import base64
import builtins
import bz2
import codecs
import lzma
import math
import os
import re
import zlib

from kit.bundle_fold import drop_unused, drop_unused_imports
from kit.bundle_modules import BUNDLE_PACKED_NAME, BundleError
from kit.bundle_pinned import fold_refused
from kit.bundle_posonly import make_positional_only
from kit.bundle_source import build_human_parts

# lzma constants spelled as literals in the wrapper (saves counted bytes); stable across CPython.
_LZMA_FORMAT_RAW = 3
_LZMA_FILTER_LZMA2 = 33
assert lzma.FORMAT_RAW == _LZMA_FORMAT_RAW and lzma.FILTER_LZMA2 == _LZMA_FILTER_LZMA2
# .lzma header dict size: the encoder rounds it to 2^n or 2^n + 2^(n-1); 24 MiB has two zero bytes
# (each NUL costs an escape in a latin1 literal), the fewest of any size that holds the whole source.
_LZMA_ALONE_DICT_BYTES = (1 << 24) | (1 << 23)
# Payload encodings. "ascii" (the default) keeps the smaller of the ASCII ones; latin1 is opt-in.
BUNDLE_ASCII_ENCODINGS = ("base93", "base85")  # this order breaks ties
BUNDLE_ENCODINGS = BUNDLE_ASCII_ENCODINGS + ("latin1",)
BUNDLE_ENCODING_CHOICES = ("ascii",) + BUNDLE_ENCODINGS
# Builtins whose use makes python-minifier rename nothing in the file (renaming_blockers).
BUNDLE_RENAME_BLOCKERS = ("locals", "globals", "vars", "exec", "eval")
# Globals the minifier must not rename: the wrapper binds BUNDLE_SOURCE before the code runs.
BUNDLE_PACKED_GLOBALS = ("BUNDLE_SOURCE",)
BUNDLE_LATIN1_CODEC = "l1"  # Python's shortest alias of latin-1
BUNDLE_LATIN1_COOKIE = f"#coding:{BUNDLE_LATIN1_CODEC}\n"  # PEP 263: line 1 matches `^[ \t\f]*#.*?coding[:=]`
BUNDLE_LATIN1_QUOTES = ('"', "'", '"""', "'''")  # quoting styles tried for the payload literal
assert codecs.lookup(BUNDLE_LATIN1_CODEC).name == "iso8859-1"
# (lc, lp, pb) tried for raw LZMA2 and .lzma; text likes lc high and pb low, the default is (3, 0, 2).
_LZMA_PROPS_GRID = tuple((lc, 0, pb) for lc in (0, 1, 2, 3, 4) for pb in (0, 2))


# -----------------------------------------------------------------------------------------------
# the packed file
# -----------------------------------------------------------------------------------------------


def set_bundle_kind(source: str, kind: str) -> str:
    """Rewrite the `BUNDLE_KIND = "human"` line of a human source to `kind`."""
    line = 'BUNDLE_KIND = "human"'
    if source.count("\n" + line + "\n") != 1:
        raise BundleError(f"expected exactly one line `{line}` in the human source")
    return source.replace("\n" + line + "\n", f'\nBUNDLE_KIND = "{kind}"\n')


def renaming_blockers(source: str) -> list:
    """["name (line N)", ...]: what makes python-minifier rename NO name of the whole file (it cannot
    tell which names such code reads): the builtins locals/globals/vars/exec/eval and star imports.
    Measured on this package: renaming saves ~1.3 KB of the ASCII packed file."""
    out = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Name) and node.id in BUNDLE_RENAME_BLOCKERS:
            out.append(f"{node.id} (line {node.lineno})")
        elif isinstance(node, ast.ImportFrom) and any(a.name == "*" for a in node.names):
            out.append(f"from {node.module} import * (line {node.lineno})")
    return out


def _class_names(source: str) -> list:
    """Top-level class names: they stay, because a class's name is behaviour (`type(err).__name__` in
    a log line or result.json, a dataclass repr, a pickle); measured cost ~0.5% of the packed file."""
    return [node.name for node in ast.parse(source).body if isinstance(node, ast.ClassDef)]


def minify_source(source: str, whole: bool = True) -> str:
    """Strip comments, docstrings and annotations (class attribute annotations stay: dataclasses
    read them) and shorten local and global names (python-minifier's rename_locals/rename_globals;
    attributes, keyword arguments, dataclass fields, class names and BUNDLE_PACKED_GLOBALS keep their
    names, so behaviour is unchanged; tracebacks of the packed file show the short function names,
    train_gpt_human.py has the readable ones). Code the file's refusals make dead goes first
    (kit/bundle_pinned.py fold_refused), with what only it called and the standard library's unread
    imports (whole=False, for a prefix of the file, keeps them: a later part may read them). Literals are
    not hoisted (measured: +1% compressed)."""
    import python_minifier

    folded = fold_refused(source)[0]  # what the refusals make dead (kit/bundle_pinned.py), then what only it called
    if whole:  # (an unfolded source had its unused definitions dropped when it was built)
        folded = drop_unused_imports(drop_unused([folded])[0][0] if folded is not source else folded)
    source = folded
    source = make_positional_only(source)[0]  # parameters no caller can name: the minifier renames them
    options = python_minifier.RemoveAnnotationsOptions(
        remove_variable_annotations=True, remove_return_annotations=True,
        remove_argument_annotations=True, remove_class_attribute_annotations=False)
    out = python_minifier.minify(
        source, remove_annotations=options, remove_literal_statements=True, hoist_literals=False,
        rename_locals=True, rename_globals=True, preserve_globals=list(BUNDLE_PACKED_GLOBALS) + _class_names(source),
        remove_asserts=False, remove_debug=False, preserve_shebang=False, prefer_single_line=True)
    compile(out, BUNDLE_PACKED_NAME, "exec")
    return out


def _lzma_compress(data: bytes, lc: int, lp: int, pb: int, alone: bool = False) -> bytes:
    """Raw LZMA2 (no header: the wrapper names the filter), or .lzma ("alone": a 13-byte header that
    `lzma.decompress(x)` detects, so the wrapper is 19 bytes shorter)."""
    filt = {"id": lzma.FILTER_LZMA1 if alone else lzma.FILTER_LZMA2, "preset": 9 | lzma.PRESET_EXTREME,
            "dict_size": _LZMA_ALONE_DICT_BYTES if alone else 1 << 24, "lc": lc, "lp": lp, "pb": pb, "nice_len": 273}
    return lzma.compress(data, format=lzma.FORMAT_ALONE if alone else lzma.FORMAT_RAW, filters=[filt])


def _lzma_raw(data: bytes, lc: int, lp: int, pb: int) -> bytes:
    return _lzma_compress(data, lc, lp, pb)


# --- base93: the compressed bytes as one big integer written in base 93 -------------------------
# Digit d is the printable ASCII char d + 32, skipping '"' (34) and '\\' (92): the digits sit in a
# plain b"..." literal without a single escape. 8 / log2(93) = 1.2234 chars per byte (base85: 1.25).
# The wrapper decodes by divide and conquer (~40 ms for 15 KB; digit by digit would be ~0.5 s).
BUNDLE_BASE93_DECODER = "f=lambda s:f(s[:h])*93**(len(s)-h)+f(s[h:])if(h:=len(s)//2)else s[0]-32-(s[0]>34)-(s[0]>92)"


def _base93_num_digits(n: int) -> int:
    """Number of base-93 digits of n >= 0 (1 for 0)."""
    k = max(1, int((n.bit_length() - 1) / math.log2(93)) + 1) if n else 1
    while 93 ** k <= n:
        k += 1
    while k > 1 and 93 ** (k - 1) > n:
        k -= 1
    return k


def base93_encode(data: bytes) -> bytes:
    """data as the ASCII digits of int.from_bytes(data, "big") in base 93, most significant first
    (no '"' or '\\'); BUNDLE_BASE93_DECODER's f(digits).to_bytes(len(data), "big") inverts it.
    Divide and conquer, so building a 15 KB file takes milliseconds, not seconds."""
    n = int.from_bytes(data, "big")
    powers = {}

    def digits(n: int, k: int) -> list:  # exactly k digits
        if k <= 8:
            out = []
            for _ in range(k):
                n, d = divmod(n, 93)
                out.append(d)
            return out[::-1]
        h = k // 2
        if h not in powers:
            powers[h] = 93 ** h
        hi, lo = divmod(n, powers[h])
        return digits(hi, k - h) + digits(lo, h)

    return bytes(d + 32 + (d > 1) + (d > 58) for d in digits(n, _base93_num_digits(n)))


def base93_decode(digits: bytes, num_bytes: int) -> bytes:
    """Inverse of base93_encode without running any code of a packed file. ValueError for a char
    outside the alphabet, OverflowError for a value that does not fit num_bytes."""
    return base93_value(digits).to_bytes(num_bytes, "big")


def base93_value(digits: bytes) -> int:
    """The integer BUNDLE_BASE93_DECODER's f(digits) returns, computed here (tools/auditor/audit_code.py reads
    packed files with it, running nothing of them). ValueError for a char outside the alphabet."""
    if not isinstance(digits, bytes) or any(c < 32 or c > 126 or c in (34, 92) for c in digits):
        raise ValueError("base93: expected bytes of printable ASCII but '\"' and '\\'")
    powers = {}

    def value(s: bytes) -> int:
        if len(s) <= 8:
            n = 0
            for c in s:
                n = n * 93 + c - 32 - (c > 34) - (c > 92)
            return n
        h = len(s) // 2
        if len(s) - h not in powers:
            powers[len(s) - h] = 93 ** (len(s) - h)
        return value(s[:h]) * powers[len(s) - h] + value(s[h:])

    return value(digits)


def _quote_latin1(text: str, quote: str) -> str:
    """`text` (chars U+0000..U+00FF) as a str literal in `quote` (one of BUNDLE_LATIN1_QUOTES),
    escaping only what must be: backslash; CR (the tokenizer reads a raw CR as a line end); NUL (not
    allowed in source) as `\\0`, or `\\000` before an octal digit (which `\\0` would swallow); with
    a one-char quote, LF and the quote; with a triple quote, every third quote of a run and a final
    quote (which would merge with the closing ones)."""
    triple = len(quote) == 3
    table = {0x5C: "\\\\", 0x0D: "\\r"}
    if not triple:
        table.update({0x0A: "\\n", ord(quote): "\\" + quote})
    out = text.translate(table)
    out = re.sub("\x00([0-7]?)", lambda m: ("\\000" if m[1] else "\\0") + m[1], out)
    if triple:
        q = quote[0]
        end = len(out)

        def fix_run(m):
            run = ["\\" + q if j % 3 == 2 else q for j in range(len(m[0]))]
            if m.end() == end:
                run[-1] = "\\" + q
            return "".join(run)

        out = re.sub(re.escape(q) + "+", fix_run, out)
    return quote + out + quote


def latin1_literal(data: bytes) -> str:
    """The shortest Python str literal (of BUNDLE_LATIN1_QUOTES; ties to the earlier style) whose
    value `.encode('latin-1')` is exactly `data`, for a source file declared latin-1 (PEP 263)."""
    text = data.decode("latin-1")
    return min((_quote_latin1(text, q) for q in BUNDLE_LATIN1_QUOTES), key=len)


def _wrapper(imports: str, decompress: str, payload: bytes, encoding: str, size_only: bool = False,
             header: str = "") -> bytes:
    """The packed file: `#header` (which settings it was packed for; none when empty), `imports` (and,
    for base93, the decoder line), then
    `exec(BUNDLE_SOURCE:=<decompress>.decode())` with the payload expression in place of PAYLOAD.
    The payload starts on a line of its own (one byte) so that a traceback through the wrapper
    prints `exec(BUNDLE_SOURCE:=L.decompress(` and not the payload (Python 3.11/3.12; 3.13+ also
    prints a later line of a multi-line statement, payload included). size_only: the base93 digits
    are replaced by as many placeholder chars (the exact file size, without the encoding work)."""
    head, pre = "", ""
    if encoding == "base85":
        data = 'B.b85decode(\n"' + base64.b85encode(payload).decode("ascii") + '")'
        imports += ",base64 as B"
    elif encoding == "base93":
        n = _base93_num_digits(int.from_bytes(payload, "big")) if size_only else 0
        digits = "#" * n if size_only else base93_encode(payload).decode("ascii")
        pre, data = BUNDLE_BASE93_DECODER + "\n", f'f(\nb"{digits}").to_bytes({len(payload)},"big")'
    else:
        head, data = BUNDLE_LATIN1_COOKIE, "\n" + latin1_literal(payload) + f".encode('{BUNDLE_LATIN1_CODEC}')"
    head += f"#{header}\n" if header else ""
    text = f"{head}import {imports}\n{pre}exec(BUNDLE_SOURCE:={decompress.replace('PAYLOAD', data)}.decode())"
    return text.encode("latin-1")


def _top_level_imports(code: str) -> set:
    """Root names of the modules a source imports at top level (`import a.b` -> "a")."""
    out = set()
    for node in ast.parse(code).body:
        if isinstance(node, ast.Import):
            out.update(a.name.split(".")[0] for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            out.add(node.module.split(".")[0])
    return out


def _streams(code: bytes, imported=frozenset()) -> list:
    """[(name, compressed bytes, imports, decompress expression with PAYLOAD)] for every compressor
    setting tried: raw LZMA2 and .lzma over _LZMA_PROPS_GRID, zlib-9, bz2-9 (stdlib), and zstd-22 /
    brotli-11 when the code itself imports zstandard / brotli at top level (`imported`), so the
    wrapper never needs a package the code does not (brotli measured 4% below LZMA on this code)."""
    streams = []
    for lc, lp, pb in _LZMA_PROPS_GRID:
        streams.append((f"lzma2-raw lc={lc} lp={lp} pb={pb}", _lzma_compress(code, lc, lp, pb), "lzma as L",
                        f'L.decompress(PAYLOAD,{_LZMA_FORMAT_RAW},None,[{{"id":{_LZMA_FILTER_LZMA2}}}])'))
    for lc, lp, pb in _LZMA_PROPS_GRID:
        streams.append((f"lzma-alone lc={lc} lp={lp} pb={pb}", _lzma_compress(code, lc, lp, pb, alone=True),
                        "lzma as L", "L.decompress(PAYLOAD)"))
    streams.append(("zlib-9", zlib.compress(code, 9), "zlib", "zlib.decompress(PAYLOAD)"))
    streams.append(("bz2-9", bz2.compress(code, 9), "bz2", "bz2.decompress(PAYLOAD)"))
    if "zstandard" in imported:
        import zstandard

        streams.append(("zstd-22", zstandard.ZstdCompressor(22).compress(code), "zstandard as Z",
                        "Z.ZstdDecompressor().decompress(PAYLOAD)"))
    if "brotli" in imported:
        import brotli

        streams.append(("brotli-11", brotli.compress(code, quality=11, lgwin=24), "brotli as Q", "Q.decompress(PAYLOAD)"))
    return streams


def default_encoding(environ=None) -> str:
    """The packed file's encoding when none is given: env BUNDLE_ENCODING (one of
    BUNDLE_ENCODING_CHOICES), else "ascii". Runs from the package measure their code bytes with it,
    and tools/make_record.py ships it, so both agree. ValueError naming BUNDLE_ENCODING if unknown."""
    value = (os.environ if environ is None else environ).get("BUNDLE_ENCODING", "ascii")
    if value not in BUNDLE_ENCODING_CHOICES:
        raise ValueError(f"BUNDLE_ENCODING={value!r}: expected one of {', '.join(BUNDLE_ENCODING_CHOICES)}")
    return value


def packed_encoding(packed: bytes) -> str:
    """"latin1", "base85" or "base93": how a packed file holds its payload (read from its wrapper)."""
    if packed.startswith(BUNDLE_LATIN1_COOKIE.encode("ascii")):
        return "latin1"
    return "base85" if b"b85decode(" in packed[:600] else "base93"


def unpack_packed(packed: bytes) -> str:
    """The source a packed file execs, found by running its wrapper with `exec` captured (the payload
    never runs): the file must compile as Python reads it (coding cookie included), have the
    wrapper's shape (`import ...`, optionally `f=lambda ...`, then `exec(BUNDLE_SOURCE:=...)`) and
    bind the str it execs to the global BUNDLE_SOURCE.

    Raises ValueError for a file that is not a packed file (then nothing of it runs) or whose
    wrapper misbehaves; SyntaxError, or the decoder's own error (lzma.LZMAError, zlib.error,
    ValueError, ...) for a damaged file."""
    body = ast.parse(packed).body
    call = body[-1].value if body and isinstance(body[-1], ast.Expr) else None
    middle = body[1:-1]
    if not (len(body) in (2, 3) and isinstance(body[0], ast.Import) and isinstance(call, ast.Call)
            and all(isinstance(n, ast.Assign) and isinstance(n.value, ast.Lambda) for n in middle)
            and isinstance(call.func, ast.Name) and call.func.id == "exec" and len(call.args) == 1
            and not call.keywords and isinstance(call.args[0], ast.NamedExpr)
            and call.args[0].target.id == "BUNDLE_SOURCE"):
        raise ValueError("not a packed file of tools/bundle.py (expected `import ...` then `exec(BUNDLE_SOURCE:=...)`)")
    captured = []
    env = {"__builtins__": {**vars(builtins), "exec": lambda source, *rest: captured.append(source)},
           "__name__": "__bundle_check__", "__file__": BUNDLE_PACKED_NAME}
    exec(compile(packed, BUNDLE_PACKED_NAME, "exec"), env)  # noqa: S102 (shape checked: imports, then decoding)
    if len(captured) != 1 or not isinstance(captured[0], str) or env.get("BUNDLE_SOURCE") is not captured[0]:
        raise ValueError("the packed file's wrapper does not exec one str bound to BUNDLE_SOURCE")
    return captured[0]


def pack_code(code: str, encoding: str | None = None, header: str = "") -> tuple[bytes, str, list]:
    """(packed file bytes, winning candidate like "lzma-alone lc=3 lp=0 pb=0 + base93", [(candidate,
    bytes)] of all tried). `encoding`: "ascii" (the smallest of BUNDLE_ASCII_ENCODINGS: a plain
    ASCII file), "base93", "base85" or "latin1" (opt-in, not UTF-8); None: default_encoding(). The
    smallest file wins; ties go to the earlier candidate, so the choice is deterministic. Sizes are
    computed exactly without encoding every candidate; only the winner is built. `header`: the
    file's first comment line (kit/bundle_source.py packed_for_line; ASCII).

    Raises ValueError for an unknown encoding, AssertionError when the winner does not round-trip
    to `code` (a bundler bug)."""
    encoding = default_encoding() if encoding is None else encoding
    if encoding not in BUNDLE_ENCODING_CHOICES:
        raise ValueError(f"encoding={encoding!r}: expected one of {', '.join(BUNDLE_ENCODING_CHOICES)}")
    encodings = BUNDLE_ASCII_ENCODINGS if encoding == "ascii" else (encoding,)
    best, tried = None, []
    streams = _streams(code.encode("utf-8"), _top_level_imports(code))
    for enc in encodings:
        for name, payload, imports, decompress in streams:
            size = len(_wrapper(imports, decompress, payload, enc, size_only=True, header=header))
            tried.append((f"{name} + {enc}", size))
            if best is None or size < best[0]:
                best = (size, f"{name} + {enc}", (imports, decompress, payload, enc, False, header))
    size, name, args = best
    packed = _wrapper(*args)
    assert len(packed) == size, (name, len(packed), size)
    try:
        unpacked = unpack_packed(packed)
    except Exception as e:  # whatever fails here, it is the bundler's fault
        raise AssertionError(f"packed file ({name}) does not unpack: {type(e).__name__}: {e}") from e
    if unpacked != code:
        raise AssertionError(f"packed file ({name}) does not decode to the minified source")
    return packed, name, tried


def human_and_header(root=None, settings=None) -> tuple[str, str]:
    """(the human source, the packed file's header line) for these settings (None: every module)."""
    parts, info = build_human_parts(root, settings)
    return "\n\n\n".join(p for _, p in parts) + "\n", info["packed_for"]


def build_packed_bytes(root=None, encoding: str | None = None, settings=None) -> bytes:
    """The counted train_gpt.py: the exact bytes of the file (stripped, compressed, exec wrapper).
    Its length is the code bytes of every run (train_gpt.measure_code_bytes). Bytes, never str: a
    latin1 file is not UTF-8. encoding: as pack_code (None: default_encoding(), ASCII unless
    BUNDLE_ENCODING says otherwise). settings: kit/bundle_when.py PackSettings, the modules a run with
    them needs (None: every module). Raises BundleError like build_human_source."""
    human, header = human_and_header(root, settings)
    return pack_code(minify_source(set_bundle_kind(human, "packed")), encoding, header)[0]
