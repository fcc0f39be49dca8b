"""What the bundle drops because it can never run there (tools/bundle.py): package-only blocks and the
functions nothing in the file calls. Stdlib only.

1. `fold_package_only`: a block `if BUNDLE_KIND == "package":` runs only in the package (the bundler
   rewrites BUNDLE_KIND to "human" or "packed" in the files it writes), so in the bundle it is replaced
   by its `else:` body (or dropped). The kit's own features (signals, resume, checkpoints, the bundler)
   sit in such blocks: the package runs them, a record's train_gpt.py does not carry them. Applied to
   every module as it is read, so an import inside such a block reaches nothing in the bundle.
2. `unused_definitions`: top-level functions and classes (without decorators, which may register them)
   that no code left in the file names, found again until none is left: what only a package-only block,
   a left-out module or a CLI used.
"""

from __future__ import annotations

import ast

BUNDLE_KIND_NAME = "BUNDLE_KIND"


def _is_package_test(test) -> bool:
    return (isinstance(test, ast.Compare) and isinstance(test.left, ast.Name) and test.left.id == BUNDLE_KIND_NAME
            and len(test.ops) == 1 and isinstance(test.ops[0], ast.Eq) and isinstance(test.comparators[0], ast.Constant)
            and test.comparators[0].value == "package")


def _first_line(node) -> int:
    """1-based first line of a statement, its decorators included."""
    return min([node.lineno] + [d.lineno for d in getattr(node, "decorator_list", [])])


def _outermost_package_blocks(tree) -> list:
    """[(If node, whether it is the only statement of its block)] of the package-only blocks not inside another."""
    found = []

    def visit(node):
        for _, value in ast.iter_fields(node):
            for child in value if isinstance(value, list) else [value]:
                if isinstance(child, ast.If) and _is_package_test(child.test):
                    found.append((child, len(value) == 1 if isinstance(value, list) else True))
                elif isinstance(child, ast.AST):
                    visit(child)

    visit(tree)
    return found


def fold_package_only(source: str, relpath: str = "") -> str:
    """`source` with every `if BUNDLE_KIND == "package":` block replaced by its else-body, dedented to the
    `if` (without one: dropped, or `pass` where it is its block's only statement). ValueError for an
    `elif` chain (write `else:` + `if`)."""
    while True:
        blocks = _outermost_package_blocks(ast.parse(source))
        if not blocks:
            return source
        lines = source.split("\n")
        for node, alone in sorted(blocks, key=lambda b: -b[0].lineno):
            indent = " " * node.col_offset
            first, last = node.lineno - 1, node.end_lineno
            if not node.orelse:
                lines[first:last] = [f"{indent}pass"] if alone else []
                continue
            if len(node.orelse) == 1 and isinstance(node.orelse[0], ast.If) \
                    and lines[node.orelse[0].lineno - 1].lstrip().startswith("elif"):
                raise ValueError(f"{relpath}:{node.orelse[0].lineno}: `elif` after `if {BUNDLE_KIND_NAME} == "
                                 f"\"package\":` cannot be folded by the bundler; write `else:` and an `if` inside it")
            start = _first_line(node.orelse[0]) - 1
            cut = node.orelse[0].col_offset - node.col_offset
            body = [line[cut:] if line[:cut].strip() == "" else line for line in lines[start:node.orelse[-1].end_lineno]]
            lines[first:last] = body
        source = "\n".join(lines)


def unused_definitions(texts: list, keep=()) -> set:
    """Names of the top-level functions and classes (undecorated) of the concatenated `texts` (each a
    module's body, parseable alone) that nothing else in them names, found again until none is left;
    `keep`: names that stay whatever (bound or read from outside the code)."""
    trees = [ast.parse(t) for t in texts]
    defs = {}
    for tree in trees:
        for node in tree.body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and not node.decorator_list \
                    and node.name not in keep:
                defs[node.name] = node
    uses = {}  # name -> set of ids of the top-level statements that read it
    for tree in trees:
        for node in tree.body:
            for sub in ast.walk(node):
                if isinstance(sub, ast.Name) and not isinstance(sub.ctx, ast.Store):
                    uses.setdefault(sub.id, set()).add(id(node))
    dead = set()
    while True:
        dead_ids = {id(defs[d]) for d in dead}
        more = {n for n, node in defs.items()
                if n not in dead and not (uses.get(n, set()) - dead_ids - {id(node)})}
        if not more:
            return dead
        dead |= more


def drop_definitions(text: str, names: set) -> str:
    """`text` without the top-level (undecorated) function and class definitions named `names`."""
    lines = text.split("\n")
    nodes = [n for n in ast.parse(text).body
             if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and n.name in names]
    for node in sorted(nodes, key=lambda n: -n.lineno):
        del lines[node.lineno - 1:node.end_lineno]
    out = "\n".join(lines)
    while "\n\n\n\n" in out:
        out = out.replace("\n\n\n\n", "\n\n\n")
    return out
