"""The human file of the bundle (tools/bundle.py): the package's modules concatenated in dependency
order under one hoisted import block, with internal imports removed; readable and runnable as is.
Stdlib only.
"""

from __future__ import annotations

import ast
import sys

from kit.bundle_modules import (BUNDLE_BANNER, BUNDLE_HUMAN_NAME, BUNDLE_KIND_LINE, BUNDLE_PACKED_NAME, BundleError,
                                  SourceModule, _is_internal_import, discover_for)
from kit.bundle_fold import drop_unused, keep_presets
from kit.bundle_when import (PackSettings, is_packed_when, needed_for, pack_settings, packed_when, refusal_source,
                             refused_names)

# the one line (trainer/context.py) that the bundler rewrites to the packed file's refusals
BUNDLE_REFUSALS_LINE = "BUNDLE_REFUSALS = ()"


# -----------------------------------------------------------------------------------------------
# the human file
# -----------------------------------------------------------------------------------------------


def _statement_span(lines: list, node, relpath: str) -> tuple[int, int]:
    """0-based [first, last] line indices of a statement that must occupy whole lines."""
    first, last = node.lineno - 1, node.end_lineno - 1
    before = lines[first][:node.col_offset]
    after = lines[last][node.end_col_offset:].strip()
    if before.strip() or (after and not after.startswith("#")):
        raise BundleError(f"{relpath}:{node.lineno}: put `{ast.unparse(node)}` on lines of its own "
                          f"(no `;` with other statements)")
    return first, last


class _ImportCollector:
    """Hoisted external imports, deduplicated, printed future / stdlib / third-party, sorted."""

    def __init__(self):
        self.future = []
        self.plain = {}  # (module, asname) -> None
        self.from_names = {}  # module -> {(name, asname): None}

    def add(self, node) -> None:
        if isinstance(node, ast.Import):
            for a in node.names:
                self.plain[(a.name, a.asname)] = None
        elif node.module == "__future__":
            for a in node.names:
                if a.name not in self.future:
                    self.future.append(a.name)
        else:
            names = self.from_names.setdefault(node.module, {})
            for a in node.names:
                names[(a.name, a.asname)] = None

    @staticmethod
    def _alias(name, asname):
        return f"{name} as {asname}" if asname else name

    def render(self) -> tuple[str, str]:
        """(future import block, the other imports)."""
        stdlib = getattr(sys, "stdlib_module_names", frozenset())
        entries = []
        for (mod, asname) in self.plain:
            entries.append((mod.split(".")[0] not in stdlib, mod, 0, f"import {self._alias(mod, asname)}"))
        for mod, names in self.from_names.items():
            items = ", ".join(self._alias(n, a) for n, a in sorted(names))
            line = f"from {mod} import {items}"
            if len(line) > 110:
                inner = "".join(f"    {self._alias(n, a)},\n" for n, a in sorted(names))
                line = f"from {mod} import (\n{inner})"
            entries.append((mod.split(".")[0] not in stdlib, mod, 1, line))
        entries.sort()
        groups = [[e[3] for e in entries if not e[0]], [e[3] for e in entries if e[0]]]
        body = "\n\n".join("\n".join(g) for g in groups if g)
        future = f"from __future__ import {', '.join(self.future)}" if self.future else ""
        return future, body


def _module_body(module: SourceModule, imports: _ImportCollector) -> str:
    """The module's text with top-level imports hoisted (external) or dropped (internal) and nested
    internal imports replaced by the equivalent alias assignments (or `pass`)."""
    lines = module.source.splitlines()
    replace = {}  # first line index -> (last line index, replacement lines)
    for node in module.tree.body:
        if is_packed_when(node):  # read by the bundler, never shipped
            replace[_statement_span(lines, node, module.relpath)[0]] = (node.end_lineno - 1, [])
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            first, last = _statement_span(lines, node, module.relpath)
            new = []
            if not _is_internal_import(node):
                imports.add(node)
            else:
                new = [f"{a.asname} = {a.name}" for a in node.names if a.asname and a.asname != a.name]
            replace[first] = (last, new)
    for node, _target, is_top in module.internal_imports:
        if is_top:
            continue
        first, last = _statement_span(lines, node, module.relpath)
        indent = lines[first][:node.col_offset]
        aliases = [f"{indent}{a.asname} = {a.name}" for a in node.names if a.asname and a.asname != a.name]
        replace[first] = (last, aliases or [f"{indent}pass"])
    out, i = [], 0
    while i < len(lines):
        if i in replace:
            last, new = replace[i]
            out.extend(new)
            i = last + 1
        else:
            out.append(lines[i])
            i += 1
    out = ['BUNDLE_KIND = "human"' if line == BUNDLE_KIND_LINE else line for line in out]
    text = "\n".join(out).strip("\n")
    while "\n\n\n\n" in text:  # hoisting leaves holes; keep at most two blank lines
        text = text.replace("\n\n\n\n", "\n\n\n")
    return text


def _left_out_conditions(off: list) -> dict:
    """{condition: [relpaths]} of the modules the settings left out by their PACKED_WHEN."""
    out = {}
    for m in off:
        out.setdefault(packed_when(m.tree, m.relpath), []).append(m.relpath)
    return out


def packed_for_line(settings: PackSettings | None, conditions: dict) -> str:
    """The packed file's header: the preset it was packed for and, of the settings its refusals read, those
    whose value is not the preset's ("" when packed with every module: it refuses nothing). Every setting of
    an unknown preset is listed."""
    if settings is None or not conditions:
        return ""
    try:
        preset = pack_settings({"PRESET": settings.preset}).values
    except ValueError:  # a preset this package does not have (an older result.json): name every value
        preset = {}
    own = [f"{n}={settings.values[n]}" for n in refused_names(conditions)
           if n not in preset or preset[n] != settings.values[n]]
    return " ".join([f"packed for PRESET={settings.preset}", *own])


def build_human_parts(root=None, settings: PackSettings | None = None) -> tuple[list, dict]:
    """[(label, text)] whose concatenation (joined by blank lines) is the human file, and info:
    modules, left_out (relpaths), off {condition: [relpaths]} and packed_for (the header line).
    `settings`: pack only the modules these settings need (kit/bundle_when.py); None: every module."""
    found = discover_for(root, needed_for(settings))
    modules, left_out = found.modules, found.left_out
    imports = _ImportCollector()
    bodies = [(m.relpath, _module_body(m, imports)) for m in modules]
    if settings is not None:  # the rows of the presets this file can never run (kit/bundle_fold.py keep_presets)
        bodies = [(r, keep_presets(body, settings.preset)) for r, body in bodies]
    kinds = [r for r, body in bodies if 'BUNDLE_KIND = "human"' in body.splitlines()]
    if len(kinds) != 1:
        raise BundleError(f"expected exactly one top-level line `{BUNDLE_KIND_LINE}` among the bundled modules, "
                          f"found {len(kinds)} ({', '.join(kinds) or 'none'})")
    texts, unused = drop_unused([body for _, body in bodies])
    bodies = [(r, text) for (r, _), text in zip(bodies, texts)]
    conditions = _left_out_conditions(found.off)
    if conditions:
        holders = [r for r, body in bodies if BUNDLE_REFUSALS_LINE in body.splitlines()]
        if len(holders) != 1:
            raise BundleError(f"expected exactly one top-level line `{BUNDLE_REFUSALS_LINE}` among the bundled modules "
                              f"(the packed file's refusals), found {len(holders)}")
        line = refusal_source(conditions, settings)
        bodies = [(r, "\n".join(line if x == BUNDLE_REFUSALS_LINE else x for x in body.splitlines())) for r, body in bodies]
    future, import_block = imports.render()
    listing = ", ".join(m.relpath for m in modules)
    packed_for = packed_for_line(settings, conditions)
    without = "".join(f"Left out, refused when {c}: {', '.join(r)}.\n" for c, r in sorted(conditions.items()))
    without += f"Left out, called by nothing in this file: {', '.join(sorted(unused))}.\n" if unused else ""
    header = (f'"""{BUNDLE_HUMAN_NAME}: GENERATED by tools/bundle.py from the parameter-golf kit; do not edit.\n\n'
              + (f"{packed_for[0].upper()}{packed_for[1:]}.\n" if packed_for else "Packed with every module.\n")
              + without + f"Modules, in pipeline order: {listing}.\n"
              f"The counted file is {BUNDLE_PACKED_NAME} (this code, stripped and compressed"
              + ("; the settings the refusals pin written in and the code they make dead folded" if conditions else "")
              + ").\n"
              '"""')
    head = "\n\n".join(p for p in (header, future, import_block) if p)
    parts = [("<header+imports>", head)]
    for relpath, body in bodies:
        parts.append((relpath, f"{BUNDLE_BANNER}\n# {relpath}\n{BUNDLE_BANNER}\n\n{body}"))
    return parts, {"modules": [m.relpath for m in modules], "left_out": left_out, "off": conditions,
                   "packed_for": packed_for, "unused": sorted(unused)}


def build_human_source(root=None, settings: PackSettings | None = None) -> str:
    """The readable single file (train_gpt_human.py): str, ends with a newline. `settings`: as
    build_human_parts.

    Raises BundleError when the package cannot be bundled faithfully (see module docstring)."""
    parts, _ = build_human_parts(root, settings)
    text = "\n\n\n".join(p for _, p in parts) + "\n"
    try:
        compile(text, BUNDLE_HUMAN_NAME, "exec")
    except SyntaxError as e:  # a bundler bug, not a user error
        raise AssertionError(f"generated {BUNDLE_HUMAN_NAME} does not compile: line {e.lineno}: {e.msg}") from e
    return text

