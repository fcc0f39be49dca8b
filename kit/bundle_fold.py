"""What the bundle drops because it can never run there (tools/bundle.py): package-only blocks and the
functions nothing in the file calls. Stdlib only.

1. `fold_package_only`: a block `if BUNDLE_KIND == "package":` runs only in the package (the bundler
   rewrites BUNDLE_KIND to "human" or "packed" in the files it writes), so in the bundle it is replaced
   by its `else:` body (or dropped). The kit's own features (signals, resume, checkpoints, the bundler)
   sit in such blocks: the package runs them, a record's train_gpt.py does not carry them. Applied to
   every module as it is read, so an import inside such a block reaches nothing in the bundle.
2. `unused_definitions`: top-level functions and classes (without decorators, which may register them)
   and constants (a name bound once, to an expression that calls nothing) that no code left in the file
   names, found again until none is left: what only a package-only block, a left-out module or a CLI used.
3. `keep_presets`: packed for one preset, the rows of the other presets (but the default and smoke ones).
4. `drop_package_arguments`: a setting's declaration replaced by its default (its domain, units and `applies` are the kit's).
5. `unused_methods`: the methods whose name nothing in the file uses (but the ones frameworks call by name).
6. `drop_unused_imports`: the standard library's names the hoisted imports bind that nothing left reads.
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


# the expression forms of a constant whose assignment the bundle may drop when nothing reads it: building it
# calls nothing (no call, comprehension, subscript or f-string: none of them runs code or can fail)
_PURE_NODES = (ast.Constant, ast.Tuple, ast.List, ast.Set, ast.Dict, ast.Name, ast.Load, ast.Attribute, ast.Starred,
               ast.BinOp, ast.UnaryOp, ast.operator, ast.unaryop, ast.Lambda, ast.arguments, ast.arg)


def _constant_name(node) -> str | None:
    """The name a top-level `NAME = <pure expression>` binds (None for any other statement)."""
    if (isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name)
            and all(isinstance(sub, _PURE_NODES) for sub in ast.walk(node.value))):
        return node.targets[0].id
    return None


def unused_definitions(texts: list, keep=()) -> set:
    """Names of the top-level functions and classes (undecorated) and of the constants (a name bound once
    by `NAME = <pure expression>`, _PURE_NODES) of the concatenated `texts` (each a module's body,
    parseable alone) that nothing else in them names, found again until none is left; `keep`: names
    that stay whatever (bound or read from outside the code)."""
    trees = [ast.parse(t) for t in texts]
    defs, bound = {}, {}
    for tree in trees:
        for node in tree.body:
            for sub in ast.walk(node) if isinstance(node, ast.Assign) else ():
                if isinstance(sub, ast.Name) and isinstance(sub.ctx, ast.Store):
                    bound[sub.id] = bound.get(sub.id, 0) + 1
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and not node.decorator_list \
                    and node.name not in keep:
                defs[node.name] = node
    for tree in trees:
        for node in tree.body:
            name = _constant_name(node)
            if name is not None and name not in keep and name not in defs and bound.get(name) == 1:
                defs[name] = node
    uses = {}  # name -> set of ids of the top-level statements that read it (a constant: that name it at all)
    for tree in trees:
        for node in tree.body:
            for sub in ast.walk(node):
                if isinstance(sub, ast.Name) and (not isinstance(sub.ctx, ast.Store) or isinstance(defs.get(sub.id),
                                                                                                  ast.Assign)):
                    uses.setdefault(sub.id, set()).add(id(node))
                elif isinstance(sub, (ast.Global, ast.Nonlocal)):
                    for n in sub.names:
                        uses.setdefault(n, set()).add(id(node))
    dead = set()
    while True:
        dead_ids = {id(defs[d]) for d in dead}
        more = {n for n, node in defs.items()
                if n not in dead and not (uses.get(n, set()) - dead_ids - {id(node)})}
        if not more:
            return dead
        dead |= more


def drop_definitions(text: str, names: set) -> str:
    """`text` without the top-level (undecorated) function and class definitions and the constants
    (`_constant_name`) named `names`."""
    lines = text.split("\n")
    nodes = [n for n in ast.parse(text).body
             if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and n.name in names
             or _constant_name(n) in names]
    for node in sorted(nodes, key=lambda n: -n.lineno):
        del lines[node.lineno - 1:node.end_lineno]
    out = "\n".join(lines)
    while "\n\n\n\n" in out:
        out = out.replace("\n\n\n\n", "\n\n\n")
    return out


# 3. `keep_presets`: a file packed for one preset runs that preset, the default one and the CPU smoke preset (the
# record's smoke run, tools/record/record_smoke.py): the other presets' rows of the preset tables can never run
# there, and PRESET=<another> is refused in one line by the settings themselves (primitives/settings.py: PRESET's
# choices are PRESETS' keys).
PRESET_TABLES = ("PRESETS", "PRESET_QUANT")  # primitives/presets.py: {preset name: its values}
DEFAULT_PRESET_NAME = "DEFAULT_PRESET"
SMOKE_PRESET = "smoke"


def keep_presets(text: str, preset: str) -> str:
    """`text` (a module's body) with its top-level PRESET_TABLES dict literals reduced to the rows of `preset`,
    DEFAULT_PRESET and SMOKE_PRESET (unchanged without them). A dropped row's lines go when the row has
    lines of its own, else its table is written again by ast.unparse."""
    tree = ast.parse(text)
    default = next((n.value.value for n in tree.body if isinstance(n, ast.Assign) and len(n.targets) == 1
                    and isinstance(n.targets[0], ast.Name) and n.targets[0].id == DEFAULT_PRESET_NAME
                    and isinstance(n.value, ast.Constant)), None)
    keep = {preset, default, SMOKE_PRESET}
    lines, cuts = text.split("\n"), []  # cuts: (first line, last line + 1, replacement lines)
    for node in tree.body:
        if not (isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name)
                and node.targets[0].id in PRESET_TABLES and isinstance(node.value, ast.Dict)):
            continue
        rows = list(zip(node.value.keys, node.value.values))
        drop = [(k, v) for k, v in rows if isinstance(k, ast.Constant) and k.value not in keep]
        after = lambda v: lines[v.end_lineno - 1][v.end_col_offset:].lstrip()  # noqa: E731
        if all(lines[k.lineno - 1][:k.col_offset].strip() == "" and after(v)[:1] == ","
               and after(v)[1:].lstrip()[:1] in ("", "#") for k, v in drop):
            cuts += [(k.lineno - 1, v.end_lineno, []) for k, v in drop]
        elif drop:
            gone = {id(k) for k, _ in drop}
            kept = ast.Dict([k for k, _ in rows if id(k) not in gone], [v for k, v in rows if id(k) not in gone])
            cuts.append((node.lineno - 1, node.end_lineno, [f"{node.targets[0].id} = {ast.unparse(kept)}"]))
    for first, end, new in sorted(cuts, key=lambda c: -c[0]):
        lines[first:end] = new
    return "\n".join(lines)


# 4. `drop_package_arguments`: the arguments of a setting's declaration after its default: its domain (bounds,
# choices: the kit's preflight), units (the out-of-domain message) and when it applies (the WARNING for a setting
# set without effect, primitives/domains.py). A record's file reads each setting's value with its type and default
# (primitives/domains.py setting: a plain dataclass field outside the package).
PACKAGE_ONLY_ARGUMENTS = ("setting",)


def drop_package_arguments(text: str) -> str:
    """`text` with every PACKAGE_ONLY_ARGUMENTS call replaced by its first argument (`x: float = setting(0.2, 0,
    1, units="...")` -> `x: float = 0.2`: outside the package `setting` is a plain dataclass default, and a
    dataclass refuses a mutable default either way); the rest of the text, comments included, is unchanged."""
    tree = ast.parse(text)
    data = text.encode("utf-8")  # the nodes' column offsets count UTF-8 bytes
    starts = [0]
    for line in data.split(b"\n"):
        starts.append(starts[-1] + len(line) + 1)
    at = lambda line, col: starts[line - 1] + col  # noqa: E731
    spans = []
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in PACKAGE_ONLY_ARGUMENTS):
            continue
        default = node.args[0]
        spans.append((at(node.lineno, node.col_offset), at(node.end_lineno, node.end_col_offset),
                      data[at(default.lineno, default.col_offset):at(default.end_lineno, default.end_col_offset)]))
    for start, end, default in sorted(spans, reverse=True):
        data = data[:start] + default + data[end:]
    return data.decode("utf-8")


# 5. `unused_methods`: a method that nothing in the file names (as an attribute, a keyword or a string) is never
# called there, except by a framework that calls it by its name: those below, and every `_name` (dunders, torch's
# hooks such as _load_from_state_dict), always stay.
FRAMEWORK_METHODS = ("forward", "backward", "setup_context", "jvp", "vjp", "vmap", "extra_repr", "reset_parameters",
                     "step", "zero_grad", "state_dict", "load_state_dict", "run", "default")


def _method_nodes(tree):
    """(class node, method node) of every undecorated or static/class method of the top-level classes."""
    for cls in tree.body:
        if isinstance(cls, ast.ClassDef):
            for node in cls.body:
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and all(
                        isinstance(d, ast.Name) and d.id in ("staticmethod", "classmethod") for d in node.decorator_list):
                    yield cls, node


def unused_methods(texts: list) -> set:
    """{"Class.method"} of the methods (_method_nodes; not a dunder, a `_name` or FRAMEWORK_METHODS) whose name
    nothing else in the concatenated `texts` uses as an attribute, a keyword argument or a string, found again
    until none is left (a method only a dropped one named goes too)."""
    trees = [ast.parse(t) for t in texts]
    dead = set()
    while True:
        named = set()
        for tree in trees:
            skip = {id(n) for cls, m in _method_nodes(tree) if f"{cls.name}.{m.name}" in dead for n in ast.walk(m)}
            for node in ast.walk(tree):
                if id(node) in skip:
                    continue
                if isinstance(node, ast.Attribute):
                    named.add(node.attr)
                elif isinstance(node, ast.keyword) and node.arg:
                    named.add(node.arg)
                elif isinstance(node, ast.Constant) and isinstance(node.value, str):
                    named.add(node.value)
        more = {f"{cls.name}.{m.name}" for tree in trees for cls, m in _method_nodes(tree)
                if not m.name.startswith("_") and m.name not in FRAMEWORK_METHODS and m.name not in named}
        if more <= dead:
            return dead
        dead |= more


def drop_methods(text: str, names: set) -> str:
    """`text` without the methods named "Class.method" in `names` (a class left empty keeps a `pass`)."""
    lines = text.split("\n")
    tree = ast.parse(text)
    cuts = []
    for cls, m in _method_nodes(tree):
        if f"{cls.name}.{m.name}" in names:
            first = min([m.lineno] + [d.lineno for d in m.decorator_list]) - 1
            left = [n for n in cls.body if n is not m and f"{cls.name}.{getattr(n, 'name', '')}" not in names]
            cuts.append((first, m.end_lineno, [] if left else [" " * m.col_offset + "pass"]))
    for first, end, new in sorted(cuts, key=lambda c: -c[0]):
        lines[first:end] = new
    return "\n".join(lines)


# names every bundle keeps: the entry (its `__main__` block calls it), the flag the bundler rewrites, the refusals
BUNDLE_KEEP_NAMES = ("main", BUNDLE_KIND_NAME, "BUNDLE_REFUSALS")


def drop_unused(texts: list) -> tuple[list, set]:
    """(`texts` without the definitions and methods nothing left in them names, the names dropped), found
    again until nothing more drops: what only a dropped method or function called goes next round."""
    unused = set()
    while True:
        names = unused_definitions(texts, keep=BUNDLE_KEEP_NAMES)
        texts = [drop_definitions(t, names) for t in texts]
        methods = unused_methods(texts)
        texts = [drop_methods(t, methods) for t in texts]
        if not names | methods:
            return texts, unused
        unused |= names | methods


def drop_unused_imports(text: str) -> str:
    """`text` without the top-level imports of the standard library whose bound name nothing in it reads but
    the annotations python-minifier removes (a module whose only user was dropped, a type only annotations
    name); other packages' imports stay (importing one may register things)."""
    import sys

    tree = ast.parse(text)
    dropped = set()  # the annotations the minifier removes: arguments', returns', variables' outside class bodies
    for node in ast.walk(tree):
        notes = [a.annotation for a in ast.walk(node.args) if isinstance(a, ast.arg)] + [node.returns] if isinstance(
            node, (ast.FunctionDef, ast.AsyncFunctionDef)) else []
        notes += [st.annotation for st in getattr(node, "body", []) if isinstance(st, ast.AnnAssign)
                  and not isinstance(node, ast.ClassDef)] if isinstance(getattr(node, "body", None), list) else []
        dropped |= {id(sub) for note in notes if note is not None for sub in ast.walk(note)}
    read = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name) and id(n) not in dropped}
    stdlib = getattr(sys, "stdlib_module_names", frozenset())
    lines, changed = text.split("\n"), False
    for node in sorted((n for n in tree.body if isinstance(n, (ast.Import, ast.ImportFrom)) and n.col_offset == 0
                        and n.lineno == n.end_lineno), key=lambda n: -n.lineno):
        root = (node.module or "") if isinstance(node, ast.ImportFrom) else ""
        keep = [a for a in node.names if (a.asname or a.name.split(".")[0]) in read
                or (root or a.name).split(".")[0] not in stdlib or root == "__future__"]
        if len(keep) == len(node.names):
            continue
        changed = True
        if not keep:
            lines[node.lineno - 1] = ""
            continue
        names = ", ".join(f"{a.name} as {a.asname}" if a.asname else a.name for a in keep)
        lines[node.lineno - 1] = f"from {root} import {names}" if root else f"import {names}"
    return "\n".join(lines) if changed else text

