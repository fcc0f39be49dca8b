"""Code a packed file's refusals make dead (tools/bundle.py): what the settings they pin can never reach.

A file packed without a module refuses the settings that need it (`BUNDLE_REFUSALS`, trainer/context.py
check_packed_for, right after the settings are read), so past that check some settings have a known value:
`lambda h,q:q.lqer` pins QUANT_LQER to False, `lambda h,q:h.muon_form != 'torch'` pins MUON_FORM to 'torch',
`lambda h,q:h.loss_kernel == 'liger'` pins LOSS_KERNEL to anything but 'liger'. `fold_refused` writes those
values into the code that reads them and folds what becomes constant (`if q.lqer:` blocks, `x if q.grouped
else y`, `not h.ttt_enabled or ...`), so that the functions only dead code called go too
(kit/bundle_fold.py unused_definitions). Stdlib only.

What is pinned: each atom of a refusal's top-level `or` that is a bool setting (then False), `setting !=
literal` (then the literal, as the setting's declared type) or `setting == literal` (then only comparisons
with that literal fold). A setting is left alone when anything could give the attribute another value or
owner: an attribute assignment or deletion of that name anywhere, a keyword argument of that name to
`dataclasses.replace` or a settings class, another class declaring the name, a `setattr` naming it. A
`setattr` or `replace(**...)` whose names are not literal leaves the settings alone. A settings class built
from a dict (`cls(**values)`) is taken to be the run's own settings (from_env, the artifact the run wrote).
The refusals themselves are never folded. The file's `BUNDLE_KIND` (the bundler writes its value) is written
in and folded too.
"""

from __future__ import annotations

import ast

BUNDLE_REFUSALS_NAME = "BUNDLE_REFUSALS"
BUNDLE_KIND_NAME = "BUNDLE_KIND"  # "human" / "packed" in the files the bundler writes (primitives/env.py)
_TYPES = {"bool": bool, "int": int, "float": float, "str": str}
_CMP = {ast.Eq: lambda a, b: a == b, ast.NotEq: lambda a, b: a != b, ast.Lt: lambda a, b: a < b,
        ast.LtE: lambda a, b: a <= b, ast.Gt: lambda a, b: a > b, ast.GtE: lambda a, b: a >= b}


def _top_assign(tree, name: str) -> ast.Assign | None:
    """The first top-level `name = ...` of the module, or None."""
    return next((n for n in tree.body if isinstance(n, ast.Assign) and len(n.targets) == 1
                 and isinstance(n.targets[0], ast.Name) and n.targets[0].id == name), None)


def _field_types(tree) -> dict:
    """{field: [(class name, annotation id)]} of every annotated name in a top-level class body."""
    out = {}
    for cls in tree.body:
        if isinstance(cls, ast.ClassDef):
            for node in cls.body:
                targets = [node.target] if isinstance(node, ast.AnnAssign) else getattr(node, "targets", [])
                for t in targets:
                    if isinstance(t, ast.Name):
                        ann = node.annotation if isinstance(node, ast.AnnAssign) else None
                        out.setdefault(t.id, []).append((cls.name, getattr(ann, "id", None)))
    return out


def pinned_settings(source_or_tree) -> dict:
    """{attribute: ("is", value) | ("not", value)} the refusals of a packed source pin (module docstring);
    {} without refusals or when a dynamic setattr / replace(**...) could write any attribute."""
    tree = ast.parse(source_or_tree) if isinstance(source_or_tree, str) else source_or_tree
    refusals = _top_assign(tree, BUNDLE_REFUSALS_NAME)
    if refusals is None or not isinstance(refusals.value, ast.Tuple):
        return {}
    fields, pins = _field_types(tree), {}
    for entry in refusals.value.elts:
        probe = entry.elts[1] if isinstance(entry, ast.Tuple) and len(entry.elts) == 2 else None
        if not isinstance(probe, ast.Lambda):
            continue
        args = {a.arg for a in probe.args.args}
        body = probe.body
        for atom in body.values if isinstance(body, ast.BoolOp) and isinstance(body.op, ast.Or) else [body]:
            op, value = None, None
            if isinstance(atom, ast.Compare) and len(atom.ops) == 1 and isinstance(atom.comparators[0], ast.Constant):
                op, value, atom = type(atom.ops[0]), atom.comparators[0].value, atom.left
            if not (isinstance(atom, ast.Attribute) and isinstance(atom.value, ast.Name) and atom.value.id in args):
                continue
            declared = fields.get(atom.attr, [])
            kind = _TYPES.get(declared[0][1]) if len(declared) == 1 else None
            if kind is None:
                continue
            if op is None and kind is bool:
                pins[atom.attr] = ("is", False)
            elif op is ast.NotEq and isinstance(value, (bool, int, float, str)):
                pins[atom.attr] = ("is", kind(value))
            elif op is ast.Eq:
                pins[atom.attr] = ("not", value)
    if not pins:
        return {}
    classes = {owner for declared in fields.values() for owner, _ in declared}  # dataclasses and the like
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and not isinstance(node.ctx, ast.Load):
            pins.pop(node.attr, None)
        elif isinstance(node, ast.Call) and _callee(node) in ("replace", *classes):
            for k in node.keywords:  # dataclasses.replace(hp, lqer=...), QuantPolicy(lqer=...)
                if k.arg is None and not isinstance(k.value, ast.Dict):
                    if _callee(node) == "replace":
                        return {}
                    continue  # a settings class built from a dict: the run's own (from_env, its artifact)
                for name in [k.arg] if k.arg else [c.value for c in k.value.keys if isinstance(c, ast.Constant)]:
                    pins.pop(name, None)
        if isinstance(node, ast.Call) and _callee(node) in ("setattr", "__setattr__"):
            name = node.args[1] if len(node.args) > 1 else None
            if not (isinstance(name, ast.Constant) and isinstance(name.value, str)):
                return {}
            pins.pop(name.value, None)
    return pins


def _callee(call) -> str | None:
    return getattr(call.func, "id", None) or getattr(call.func, "attr", None)


def _const(node) -> bool:
    return isinstance(node, ast.Constant)


def _pure(node) -> bool:
    """Reading it runs no code of ours (names, attributes, literals, comparisons of those)."""
    return all(isinstance(n, (ast.Name, ast.Attribute, ast.Constant, ast.Compare, ast.BoolOp, ast.UnaryOp, ast.Load,
                              ast.cmpop, ast.boolop, ast.unaryop)) for n in ast.walk(node))


class _Fold(ast.NodeTransformer):
    """Writes the pinned values in and folds constant tests, `not`, `and` / `or` and comparisons."""

    def __init__(self, pins: dict, names: dict):
        self.pins, self.names, self.folded = pins, names, 0

    def visit_Name(self, node):
        if node.id in self.names and isinstance(node.ctx, ast.Load):
            self.folded += 1
            return ast.copy_location(ast.Constant(self.names[node.id]), node)
        return node

    def visit_Attribute(self, node):
        self.generic_visit(node)
        pin = self.pins.get(node.attr)
        if pin and pin[0] == "is" and isinstance(node.ctx, ast.Load):
            self.folded += 1
            return ast.copy_location(ast.Constant(pin[1]), node)
        return node

    def visit_Compare(self, node):
        self.generic_visit(node)
        if len(node.ops) != 1:
            return node
        left, op, right = node.left, type(node.ops[0]), node.comparators[0]
        pin = isinstance(left, ast.Attribute) and self.pins.get(left.attr)
        if pin and pin[0] == "not" and op in (ast.Eq, ast.NotEq) and _const(right) and right.value == pin[1]:
            self.folded += 1
            return ast.copy_location(ast.Constant(op is ast.NotEq), node)
        if _const(left) and _const(right) and op in _CMP:
            try:
                return ast.copy_location(ast.Constant(bool(_CMP[op](left.value, right.value))), node)
            except TypeError:
                return node
        return node

    def visit_UnaryOp(self, node):
        self.generic_visit(node)
        if isinstance(node.op, ast.Not) and _const(node.operand):
            return ast.copy_location(ast.Constant(not node.operand.value), node)
        return node

    def visit_BoolOp(self, node):
        self.generic_visit(node)
        stop = (lambda v: not v) if isinstance(node.op, ast.And) else bool  # the value that ends the chain
        values = []
        for i, v in enumerate(node.values):
            if _const(v) and stop(v.value):
                values.append(v)
                break
            if _const(v) and i < len(node.values) - 1:
                continue  # `True and x` is x, `False or x` is x
            values.append(v)
        if len(values) == 1:
            return values[0]
        node.values = values
        return node

    def _test(self, node):
        """A test's value as a truth: `x and False` with a pure x is False, `x or True` is True."""
        test = node.test
        if isinstance(test, ast.BoolOp) and _const(test.values[-1]) and all(_pure(v) for v in test.values[:-1]):
            last = bool(test.values[-1].value)
            if last is isinstance(test.op, ast.Or):
                return ast.Constant(last)
        return test

    def visit_Call(self, node):
        self.generic_visit(node)
        node.keywords = [k for k in node.keywords if not (k.arg is None and isinstance(k.value, ast.Dict)
                                                          and not k.value.keys)]  # f(**{})
        return node

    def visit_AugAssign(self, node):
        self.generic_visit(node)
        empty = isinstance(node.value, (ast.List, ast.Tuple)) and not node.value.elts
        return None if empty and isinstance(node.op, ast.Add) else node  # x += []

    def visit_IfExp(self, node):
        self.generic_visit(node)
        test = self._test(node)
        if _const(test):
            return node.body if test.value else node.orelse
        return node

    def visit_If(self, node):
        self.generic_visit(node)
        test = self._test(node)
        if _const(test):
            return (node.body if test.value else node.orelse) or ast.Pass()
        return node

    def visit_While(self, node):
        self.generic_visit(node)
        if _const(node.test) and not node.test.value:
            return node.orelse or ast.Pass()
        return node


_ENDS = (ast.Return, ast.Raise, ast.Continue, ast.Break)


def _tidy(tree) -> None:
    """Statements after a return / raise / continue / break go (a folded test leaves them); a block left
    empty gets a `pass`."""
    for node in ast.walk(tree):
        for field in ("body", "orelse", "finalbody"):
            block = getattr(node, field, None)
            if not isinstance(block, list) or (not block and field != "body") or isinstance(node, ast.Expression):
                continue
            end = next((i for i, st in enumerate(block) if isinstance(st, _ENDS)), None)
            if end is not None:
                del block[end + 1:]
            if not block and not isinstance(node, ast.Module):
                block.append(ast.Pass())


def _bundle_kind(tree) -> dict:
    """{BUNDLE_KIND: its value} when the module binds it once, at top level, to a str literal (the bundler's
    rewrite) and nothing else binds it; else {}."""
    binds = [n for n in ast.walk(tree) if isinstance(n, ast.Name) and n.id == BUNDLE_KIND_NAME
             and not isinstance(n.ctx, ast.Load)] + [n for n in ast.walk(tree) if isinstance(n, (
                 ast.Global, ast.Nonlocal)) and BUNDLE_KIND_NAME in n.names]
    top = _top_assign(tree, BUNDLE_KIND_NAME)
    if len(binds) == 1 and top is not None and isinstance(top.value, ast.Constant) and isinstance(top.value.value, str):
        return {BUNDLE_KIND_NAME: top.value.value}
    return {}


def fold_refused(source: str) -> tuple[str, dict]:
    """`source` with the settings its refusals pin and its BUNDLE_KIND written in and the constant code folded
    (module docstring), and the pins {attribute: ("is" | "not", value)}; `source` unchanged when nothing folds."""
    tree = ast.parse(source)
    pins, names = pinned_settings(tree), _bundle_kind(tree)
    if not pins and not names:
        return source, {}
    kept = {id(_top_assign(tree, n)) for n in (BUNDLE_REFUSALS_NAME, *names)}  # the refusals, BUNDLE_KIND's binding
    fold = _Fold(pins, names)
    tree.body = [node if id(node) in kept else fold.visit(node) for node in tree.body]
    if not fold.folded:
        return source, pins
    _tidy(tree)
    return ast.unparse(ast.fix_missing_locations(tree)) + "\n", pins

