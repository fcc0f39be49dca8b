"""Which modules does a Python source import? Standard library only, so that any interpreter runs it.

    python3.12 -I tools/audit_parse.py < SOURCE    -> {"python": "3.12.x", "required": [...], "optional": [...]}

tools/audit_code.py runs it under a newer interpreter when this one cannot parse a record script
(PEP 701 f-strings need Python 3.12). Exit 1 with {"python", "error"} when the source does not parse.
Nothing of the source runs.
"""

import ast
import json
import platform
import sys


def imported_modules(source: str) -> tuple[set, set]:
    """(top-level module names imported anywhere in `source`, those imported only inside a
    `try:` whose handlers catch ImportError/ModuleNotFoundError/Exception, i.e. optional ones).
    Relative imports are skipped. Raises SyntaxError for source that does not parse."""
    tree = ast.parse(source)
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
