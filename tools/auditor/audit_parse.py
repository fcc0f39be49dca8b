"""Which modules does a Python source import? Standard library only, so that any interpreter runs it.

`parse_any(source)` parses with this interpreter's grammar and, where that fails, once more with every
f-string replaced by a plain string literal of the same line span (`neutralize_fstrings`): Python 3.12
f-strings (PEP 701: the same quote nested inside, comments, backslashes) then parse on 3.8-3.11 too,
and every other code fact (calls, imports, loops, line numbers) stays where it was.

    python3.12 -I tools/auditor/audit_parse.py < SOURCE    -> {"python": "3.12.x", "required": [...], "optional": [...]}

tools/auditor/audit_code.py runs it under a newer interpreter when this one cannot parse a record script
(PEP 701 f-strings need Python 3.12). Exit 1 with {"python", "error"} when the source does not parse.
Nothing of the source runs.
"""

import ast
import json
import platform
import re
import sys


_PREFIX = re.compile(r"(?i)(rb|br|fr|rf|b|r|u|f)?(\'\'\'|\"\"\"|\'|\")")
_WORD = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def _string_end(s: str, i: int, is_f: bool) -> int:
    """Index just past the string literal whose opening quote starts at s[i]."""
    q = s[i:i + 3] if s[i:i + 3] in ("'''", '"""') else s[i]
    j = i + len(q)
    while j < len(s):
        if s.startswith(q, j):
            return j + len(q)
        c = s[j]
        if c == "\\":
            j += 2
        elif is_f and c == "{":
            j = j + 2 if s.startswith("{{", j) else _expr_end(s, j + 1)
        else:
            j += 1
    raise SyntaxError("unterminated string literal")


def _string_at(s: str, j: int):
    """(prefix, index of the quote) when a string literal starts at s[j], else None."""
    m = _PREFIX.match(s, j)
    return (m.group(1) or "", m.start(2)) if m else None


def _expr_end(s: str, j: int) -> int:
    """Index just past the `}` closing a replacement field whose expression starts at s[j]."""
    depth = 0
    while j < len(s):
        c = s[j]
        hit = _string_at(s, j) if (c.isalpha() or c in "'\"") else None
        if hit is not None:
            j = _string_end(s, hit[1], "f" in hit[0].lower())
            continue
        if c.isalpha() or c == "_":
            j = _WORD.match(s, j).end()
            continue
        if c in "([{":
            depth += 1
        elif c in ")]":
            depth -= 1
        elif c == "}":
            if depth == 0:
                return j + 1
            depth -= 1
        elif c == ":" and depth == 0 and not s.startswith(":=", j):  # format spec: literal with {fields}
            j += 1
            while j < len(s) and s[j] != "}":
                j = _expr_end(s, j + 1) if s[j] == "{" else j + 1
            return j + 1
        j += 1
    raise SyntaxError("unterminated f-string replacement field")


def neutralize_fstrings(source: str) -> str:
    """`source` with each f-string literal replaced by an empty string literal spanning the same lines."""
    out, i, last = [], 0, 0
    while i < len(source):
        c = source[i]
        if c == "#":
            nl = source.find("\n", i)
            i = len(source) if nl < 0 else nl
            continue
        hit = _string_at(source, i) if (c.isalpha() or c in "'\"") else None
        if hit is not None and (hit[1] == i or not (i and (source[i - 1].isalnum() or source[i - 1] == "_"))):
            end = _string_end(source, hit[1], "f" in hit[0].lower())
            if "f" in hit[0].lower():
                lines = source.count("\n", i, end)
                out += [source[last:i], '"""' + "\n" * lines + '"""' if lines else '""']
                last = end
            i = end
            continue
        if c.isalpha() or c == "_":
            i = _WORD.match(source, i).end()
            continue
        i += 1
    out.append(source[last:])
    return "".join(out)


def parse_any(source: str) -> tuple:
    """(ast.Module, note): parsed by this interpreter, else with f-strings neutralized (note says so).
    Raises this interpreter's SyntaxError when neither parses."""
    try:
        return ast.parse(source), ""
    except SyntaxError as e:
        error = e
    try:
        return ast.parse(neutralize_fstrings(source)), "f-strings of newer Python read as plain strings"
    except (SyntaxError, ValueError, RecursionError, IndexError):
        raise error from None


def imported_modules(source: str) -> tuple[set, set]:
    """(top-level module names imported anywhere in `source`, those imported only inside a
    `try:` whose handlers catch ImportError/ModuleNotFoundError/Exception, i.e. optional ones).
    Relative imports are skipped. Raises SyntaxError for source that does not parse."""
    tree = parse_any(source)[0]
    required, optional = set(), set()

    def visit(node, guarded: bool):
        if isinstance(node, ast.Try) or type(node).__name__ == "TryStar":
            catches = {ast.unparse(h.type) if h.type is not None else "" for h in node.handlers}
            is_guard = bool(catches & {"ImportError", "ModuleNotFoundError", "Exception", ""}) or any(
                "ImportError" in c or "ModuleNotFoundError" in c for c in catches)
            for child in node.body:
                visit(child, guarded or is_guard)
            for child in node.handlers + node.orelse + node.finalbody:
                visit(child, guarded)
            return
        if isinstance(node, ast.Import):
            for a in node.names:
                (optional if guarded else required).add(a.name.split(".")[0])
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            (optional if guarded else required).add(node.module.split(".")[0])
        for child in ast.iter_child_nodes(node):
            visit(child, guarded)

    visit(tree, False)
    return required, optional - required



if __name__ == "__main__":
    try:
        req, opt = imported_modules(sys.stdin.buffer.read().decode("utf-8"))
    except SyntaxError as err:
        print(json.dumps({"python": platform.python_version(), "error": f"line {err.lineno}: {err.msg}"}))
        sys.exit(1)
    print(json.dumps({"python": platform.python_version(), "required": sorted(req), "optional": sorted(opt)}))
