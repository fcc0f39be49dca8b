"""Parameters made positional-only in the packed file, so that python-minifier renames them (it keeps every
name a caller could pass by keyword). Stdlib only; used by kit/bundle_pack.py minify_source.

A function's leading parameters become positional-only when nothing in the file could name them: no call passes
a keyword of that name, no string literal spells it, no dataclass field has it, and the function is
only ever called by name (never passed to a library that may call it with keywords, never decorated but by
staticmethod / classmethod, never a framework hook, never read by `inspect.signature`). Behaviour is unchanged
for every call the file makes; the parity tests run the packed files against the package.
"""

from __future__ import annotations

import ast

from kit.bundle_fold import FRAMEWORK_METHODS

# methods torch or Python call by name (with their own argument conventions) are never rewritten: the same list
# kit/bundle_fold.py keeps such methods by
_FRAMEWORK_NAMES = frozenset(FRAMEWORK_METHODS)
_SAFE_DECORATORS = frozenset(("staticmethod", "classmethod"))


def _blocked_names(tree: ast.AST, defined: set) -> tuple[set, dict, set]:
    """(names no parameter may take, {function or method name: keyword names its calls pass}, names of
    functions used as values: passed, stored or inspected). A keyword of a call whose target is not a name the file
    defines (a callable held in a variable, a library's function) blocks its name everywhere."""
    blocked, by_target, values = set(), {}, set()
    called = {id(n.func) for n in ast.walk(tree) if isinstance(n, ast.Call)}
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            f = node.func
            target = f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else None
            names = {k.arg for k in node.keywords if k.arg}
            if target in defined:
                by_target.setdefault(target, set()).update(names)
            else:
                blocked.update(names)
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value.isidentifier():
            blocked.add(node.value)
        elif isinstance(node, ast.Attribute):
            if id(node) not in called:
                values.add(node.attr)
        elif isinstance(node, ast.Name) and id(node) not in called and isinstance(node.ctx, ast.Load):
            values.add(node.id)
        elif isinstance(node, ast.ClassDef):
            blocked.update(s.target.id for s in node.body if isinstance(s, ast.AnnAssign)
                           and isinstance(s.target, ast.Name))
    return blocked, by_target, values


def _decorators_ok(fn: ast.FunctionDef) -> bool:
    return all(isinstance(d, ast.Name) and d.id in _SAFE_DECORATORS for d in fn.decorator_list)


def _functions(tree: ast.AST):
    """(function node, its class node or None) for every def at module or class level, nested ones included."""
    def visit(body, cls):
        for node in body:
            if isinstance(node, ast.ClassDef):
                yield from visit(node.body, node)
            elif isinstance(node, ast.FunctionDef):
                yield node, cls
                yield from visit(node.body, None)
            else:
                for field in ("body", "orelse", "finalbody", "handlers"):
                    inner = getattr(node, field, None)
                    if isinstance(inner, list):
                        yield from visit([n for n in inner if isinstance(n, ast.AST)], cls)
    yield from visit(tree.body, None)


def make_positional_only(source: str) -> tuple[str, list]:
    """(source with the safe leading parameters of each function made positional-only, ["qualname(n)", ...]
    of the functions rewritten). Returns `source` unchanged when nothing qualifies."""
    tree = ast.parse(source)
    functions = list(_functions(tree))
    defined = {fn.name for fn, _ in functions} | {n.name for n in ast.walk(tree) if isinstance(n, ast.ClassDef)}
    blocked, by_target, values = _blocked_names(tree, defined)
    done = []
    for fn, cls in functions:
        if (fn.name in values or fn.name in _FRAMEWORK_NAMES or not _decorators_ok(fn)
                or (fn.name.startswith("_") and fn.name != "__init__") or (cls is not None and cls.name in values
                                                                            and fn.name == "__init__")):
            continue
        args = fn.args
        params = args.posonlyargs + args.args
        n = len(args.posonlyargs)
        # a class is called by its name (its __init__), a method or function by its own
        named = by_target.get(cls.name if cls is not None and fn.name == "__init__" else fn.name, set())
        while n < len(params) and params[n].arg not in blocked and params[n].arg not in named:
            n += 1
        if n > len(args.posonlyargs):
            args.posonlyargs, args.args = params[:n], params[n:]
            done.append(f"{cls.name + '.' if cls else ''}{fn.name}({n})")
    return (ast.unparse(tree) if done else source), done
