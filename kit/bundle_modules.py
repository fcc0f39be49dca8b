"""The bundler's view of the package (tools/bundle.py): which modules train_gpt.py reaches, in which
order they can be concatenated, and the checks that concatenating them changes no behaviour
(unique top-level names, no `__main__` guard, internal imports resolvable). Stdlib only.
"""

from __future__ import annotations

import ast
import dataclasses
import heapq
from pathlib import Path

from kit.bundle_fold import drop_package_arguments, fold_package_only

REPO_ROOT = Path(__file__).resolve().parents[1]
BUNDLE_PACKAGES = ("primitives", "model", "shards", "trainer", "quant", "eval")
BUNDLE_ENTRY = "train_gpt.py"
BUNDLE_SKIP_FILES = ("__init__.py", "__main__.py")
BUNDLE_KIND_LINE = 'BUNDLE_KIND = "package"'
BUNDLE_HUMAN_NAME = "train_gpt_human.py"
BUNDLE_PACKED_NAME = "train_gpt.py"
BUNDLE_BANNER = "# " + "=" * 98
# an optional module's declaration of the settings that need it (kit/bundle_when.py); never bundled
PACKED_WHEN_NAME = "PACKED_WHEN"


class BundleError(ValueError):
    """The package cannot be bundled into one file without changing its behaviour."""


@dataclasses.dataclass
class SourceModule:
    """One .py file of the package: `relpath` like "primitives/rowquant.py", `name` like "primitives.rowquant"."""

    relpath: str
    name: str
    source: str
    tree: ast.Module
    internal_imports: list = dataclasses.field(default_factory=list)  # [(ast node, target name, top_level)]
    top_level_deps: set = dataclasses.field(default_factory=set)
    all_deps: set = dataclasses.field(default_factory=set)

    @property
    def is_entry(self) -> bool:
        return self.relpath == BUNDLE_ENTRY


# -----------------------------------------------------------------------------------------------
# discovery and checks
# -----------------------------------------------------------------------------------------------


def _read_module(root: Path, relpath: str) -> SourceModule:
    path = root / relpath
    source = path.read_text(encoding="utf-8")
    try:
        tree = ast.parse(source, filename=str(path))
        source = fold_package_only(source, relpath)  # kit/bundle_fold.py: package-only blocks never run in the bundle
        source = drop_package_arguments(source)  # and the settings' domains and help (the kit's preflight)
        tree = ast.parse(source, filename=str(path))
    except SyntaxError as e:
        raise BundleError(f"{relpath}:{e.lineno}: cannot parse: {e.msg}") from e
    except ValueError as e:
        raise BundleError(str(e)) from e
    name = relpath[:-3].replace("/", ".")
    return SourceModule(relpath, name, source, tree)


def _internal_root(module_name: str) -> bool:
    head = module_name.split(".")[0]
    return head in BUNDLE_PACKAGES or module_name == BUNDLE_ENTRY[:-3]


def _top_level_statements(body):
    """Statements executed at import time: the module body and the bodies of top-level
    if/try/with/for/while blocks (never function or class bodies)."""
    for node in body:
        yield node
        if isinstance(node, (ast.If, ast.For, ast.AsyncFor, ast.While)):
            yield from _top_level_statements(node.body)
            yield from _top_level_statements(node.orelse)
        elif isinstance(node, (ast.With, ast.AsyncWith)):
            yield from _top_level_statements(node.body)
        elif isinstance(node, ast.Try) or type(node).__name__ == "TryStar":
            yield from _top_level_statements(node.body)
            for handler in node.handlers:
                yield from _top_level_statements(handler.body)
            yield from _top_level_statements(node.orelse)
            yield from _top_level_statements(node.finalbody)


def _target_names(target) -> list:
    if isinstance(target, ast.Name):
        return [target.id]
    if isinstance(target, (ast.Tuple, ast.List)):
        return [n for elt in target.elts for n in _target_names(elt)]
    if isinstance(target, ast.Starred):
        return _target_names(target.value)
    return []


def _import_bindings(node) -> list:
    """[(bound name, source key)] of an import statement; equal keys bind the same object."""
    out = []
    if isinstance(node, ast.Import):
        for alias in node.names:
            if alias.asname:
                out.append((alias.asname, ("import", alias.name)))
            else:
                root_name = alias.name.split(".")[0]
                out.append((root_name, ("import", root_name)))
    else:
        for alias in node.names:
            out.append((alias.asname or alias.name, ("from", node.module, alias.name)))
    return out


def top_level_bindings(module: SourceModule) -> dict:
    """{name: source key or None} for every name the module binds at import time, except the
    names brought in by internal imports (those are the defining module's own names)."""
    names = {}
    for node in _top_level_statements(module.tree.body):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names[node.name] = None
        elif isinstance(node, ast.Assign):
            for t in node.targets:
                for n in _target_names(t):
                    names[n] = None
        elif isinstance(node, (ast.AnnAssign, ast.AugAssign)):
            for n in _target_names(node.target):
                names[n] = None
        elif isinstance(node, (ast.For, ast.AsyncFor)):
            for n in _target_names(node.target):
                names[n] = None
        elif isinstance(node, (ast.With, ast.AsyncWith)):
            for item in node.items:
                if item.optional_vars is not None:
                    for n in _target_names(item.optional_vars):
                        names[n] = None
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            if _is_internal_import(node):
                # `from quant.x import a as b` becomes the assignment `b = a` in the bundle
                for alias in node.names:
                    if alias.asname and alias.asname != alias.name:
                        names[alias.asname] = None
                continue
            for n, key in _import_bindings(node):
                # a name bound by an import and also by code (or another import) is the module's own
                names[n] = key if names.get(n, key) == key else None
        if isinstance(node, ast.Try):
            for handler in node.handlers:
                if handler.name:
                    names[handler.name] = None
    return names


def _is_internal_import(node) -> bool:
    if isinstance(node, ast.ImportFrom):
        return node.level > 0 or (node.module is not None and _internal_root(node.module))
    return any(_internal_root(alias.name) for alias in node.names)


def _analyse_imports(module: SourceModule, available: dict) -> None:
    """Fill module.internal_imports / deps; raise BundleError on a forbidden import form."""
    top_nodes = {id(n) for n in module.tree.body}
    import_time = {id(n) for n in _top_level_statements(module.tree.body)}
    for node in ast.walk(module.tree):
        if not isinstance(node, (ast.Import, ast.ImportFrom)) or not _is_internal_import(node):
            continue
        where = f"{module.relpath}:{node.lineno}"
        text = ast.unparse(node)
        allowed = "`from <package>.x import ...` (package: " + ", ".join(BUNDLE_PACKAGES) + ") or `from train_gpt import ...`"
        if isinstance(node, ast.Import) or node.level > 0:
            raise BundleError(f"{where}: `{text}`: internal imports must have the form {allowed}")
        parts = node.module.split(".")
        if node.module == BUNDLE_ENTRY[:-3]:
            target = node.module
        elif len(parts) == 2 and parts[0] in BUNDLE_PACKAGES:
            target = node.module
        else:
            raise BundleError(f"{where}: `{text}`: internal imports must have the form {allowed}")
        if target not in available:
            raise BundleError(f"{where}: `{text}`: {target.replace('.', '/')}.py is not a bundlable library "
                              f"module (missing, or a CLI/__init__/__main__ file)")
        if target == module.name:
            raise BundleError(f"{where}: `{text}`: a module importing itself")
        defined = top_level_bindings(available[target])
        defined.update(_reexported_names(available[target]))
        for alias in node.names:
            if alias.name == "*":
                raise BundleError(f"{where}: `{text}`: star imports cannot be bundled")
            if alias.name not in defined:
                raise BundleError(f"{where}: `{text}`: {available[target].relpath} defines no top-level "
                                  f"name {alias.name!r}")
        module.internal_imports.append((node, target, id(node) in top_nodes))
        module.all_deps.add(target)
        if id(node) in import_time:
            module.top_level_deps.add(target)


def _reexported_names(module: SourceModule) -> dict:
    """Names a module binds through its own top-level internal imports (re-exports)."""
    out = {}
    for node in _top_level_statements(module.tree.body):
        if isinstance(node, ast.ImportFrom) and _is_internal_import(node):
            for alias in node.names:
                out[alias.asname or alias.name] = None
    return out


# The bundled modules in pipeline order (primitives, quantization, evaluation, model and trainer): the
# order the packed file concatenates them in, wherever the import graph leaves a choice. A module not
# listed goes after the listed ones (by path); moving a module means renaming it here, or the packed
# bytes change.
BUNDLE_PIPELINE = (
    "primitives/env.py", "primitives/files.py", "primitives/presets.py", "primitives/progress.py", "primitives/domains.py",
    "primitives/settings.py",
    "shards/format.py", "shards/data_kind.py", "shards/sidecar.py", "primitives/baseline_quant.py", "primitives/rowquant.py",
    "quant/gptq_records.py", "quant/gptq.py", "quant/policy.py", "quant/lqer.py",
    "quant/sdclip.py", "quant/estimate.py", "quant/fit.py", "quant/grouped.py", "quant/artifact.py", "eval/bpb.py",
    "eval/walk.py", "eval/sliding.py", "eval/roundtrip.py", "eval/ttt.py", "eval/phased_ttt.py", "eval/sgd_modes.py",
    "eval/lora_batch.py", "eval/lora_ttt.py", "eval/lora_mode.py", "eval/record_lora.py", "eval/phased_lora.py",
    "eval/ttt_modes.py", "eval/plan.py", "eval/ttt_plan.py",
    "model/fa4.py", "model/doc_attention.py", "model/attention.py", "trainer/context.py",
    "shards/loader.py", "model/attn_ops.py", "model/softcap_loss.py", "model/fused_loss.py", "model/gates.py",
    "model/stack.py", "model/gpt.py", "trainer/timing.py", "trainer/sgd_timing.py", "trainer/ttt_eval.py",
    "trainer/evaluate.py", "trainer/muon_switches.py", "trainer/muon_forms.py", "trainer/optim.py", "trainer/runfolder.py",
    "trainer/wd_taper.py", "trainer/ema.py", "trainer/schedule.py", "trainer/checks.py", "trainer/finish.py",
    "trainer/loop.py",
)


def _module_rank(relpath: str) -> int:
    """Pipeline order: the position in BUNDLE_PIPELINE (an unlisted module goes last)."""
    return BUNDLE_PIPELINE.index(relpath) if relpath in BUNDLE_PIPELINE else len(BUNDLE_PIPELINE)


def discover_modules(root=None, needed=None) -> tuple[list, list]:
    """The modules to bundle, in order, and the relpaths of library modules left out.

    With a train_gpt.py present, exactly the library modules it reaches through internal imports are
    bundled (CLI-only modules are left out); without one (tests on small trees), all of them.
    `needed(module) -> bool` (kit/bundle_when.py needed_for): a reached module it rejects is left out,
    and so is what only that module reaches (`discover_for` also says which were rejected).
    Raises BundleError on a forbidden import, a dependency cycle or a duplicate top-level name.
    """
    found = discover_for(root, needed)
    return found.modules, found.left_out


@dataclasses.dataclass
class Discovered:
    """What discover_for found: `modules` to bundle in order, `left_out` relpaths (not reached or not
    needed), `off` the reached modules that `needed` rejected (SourceModule)."""

    modules: list
    left_out: list
    off: list


def package_relpaths(root: Path) -> list:
    """Every file the bundler reads under `root`, in a fixed order: each package's modules, then the entry."""
    relpaths = [f"{package}/{p.name}" for package in BUNDLE_PACKAGES for p in sorted((root / package).glob("*.py"))
                if p.name not in BUNDLE_SKIP_FILES]
    if (root / BUNDLE_ENTRY).is_file():
        relpaths.append(BUNDLE_ENTRY)
    return relpaths


def discover_for(root=None, needed=None) -> Discovered:
    """discover_modules with the rejected modules named (see there)."""
    root = Path(root) if root is not None else REPO_ROOT
    relpaths = package_relpaths(root)
    if not relpaths:
        raise BundleError(f"{root}: no {BUNDLE_ENTRY} and no modules under {'/, '.join(BUNDLE_PACKAGES)}/")
    modules = {m.name: m for m in (_read_module(root, r) for r in relpaths)}
    for m in modules.values():
        _analyse_imports(m, modules)
        if not m.is_entry:
            _check_no_main_guard(m)
            if BUNDLE_ENTRY[:-3] in m.top_level_deps:
                raise BundleError(f"{m.relpath}: imports train_gpt at top level (circular; the trainer is bundled last)")
    entry = modules.get(BUNDLE_ENTRY[:-3])
    off = {}
    if entry is not None:
        keep, todo = {entry.name}, [entry.name]
        while todo:
            for dep in sorted(modules[todo.pop()].all_deps):
                if dep in keep or dep in off:
                    continue
                if needed is not None and not needed(modules[dep]):
                    off[dep] = modules[dep]
                    continue
                keep.add(dep)
                todo.append(dep)
    else:
        keep = {n for n, m in modules.items() if needed is None or needed(m)}
        off = {n: m for n, m in modules.items() if n not in keep}
    left_out = sorted(modules[n].relpath for n in modules if n not in keep)
    ordered = _order_modules([modules[n] for n in keep])
    _check_unique_names(ordered)
    _check_import_time_names(ordered, [m for n, m in modules.items() if n not in keep])
    return Discovered(ordered, left_out, sorted(off.values(), key=lambda m: m.relpath))


def _import_time_nodes(body):
    """The expressions a module evaluates when it is imported: top-level statements, class bodies,
    decorators, default arguments and base classes (never a function's body)."""
    for node in body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            yield from node.decorator_list
            yield from node.args.defaults
            yield from (d for d in node.args.kw_defaults if d is not None)
        elif isinstance(node, ast.ClassDef):
            yield from node.decorator_list
            yield from node.bases
            yield from node.keywords
            yield from _import_time_nodes(node.body)
        elif isinstance(node, (ast.If, ast.For, ast.AsyncFor, ast.While, ast.With, ast.AsyncWith, ast.Try)):
            yield from (n for n in ast.iter_child_nodes(node) if not isinstance(n, ast.stmt))
            for field in ("body", "orelse", "finalbody"):
                yield from _import_time_nodes(getattr(node, field, []))
            for handler in getattr(node, "handlers", []):
                yield from _import_time_nodes(handler.body)
        else:
            yield node


def _check_import_time_names(kept: list, dropped: list) -> None:
    """A kept module may name a left-out module's function inside its own functions (the packed file
    refuses the settings that would call it) but never at import time, where the packed file would fail
    for every setting: BundleError naming the module, line and name."""
    owner = {}
    for m in dropped:
        for name in top_level_bindings(m):
            owner.setdefault(name, m.relpath)
    kept_names = {name for m in kept for name in top_level_bindings(m)}
    for m in kept:
        for node in _import_time_nodes(m.tree.body):
            for sub in ast.walk(node):
                if (isinstance(sub, ast.Name) and isinstance(sub.ctx, ast.Load) and sub.id in owner
                        and sub.id not in kept_names):
                    raise BundleError(f"{m.relpath}:{sub.lineno}: {sub.id!r} of {owner[sub.id]} is used at import time, "
                                      f"but {owner[sub.id]} is left out for these settings; use it inside a function "
                                      f"(or give {m.relpath} the same PACKED_WHEN)")


def _order_modules(mods: list) -> list:
    """Topological order (dependencies first) with ties broken by pipeline rank, then path.

    Import-time dependencies must come first (a class base, a default argument, a constant built
    from another module's constant); function-level ones are ordered too when that is acyclic."""
    for edges_of in (lambda m: m.all_deps, lambda m: m.top_level_deps):
        names = {m.name for m in mods}
        deps = {m.name: {d for d in edges_of(m) if d in names} for m in mods}
        by_name = {m.name: m for m in mods}
        users = {n: set() for n in names}
        for n, ds in deps.items():
            for d in ds:
                users[d].add(n)
        heap = [(_module_rank(by_name[n].relpath), by_name[n].relpath, n) for n in names if not deps[n]]
        heapq.heapify(heap)
        order = []
        while heap:
            _, _, n = heapq.heappop(heap)
            order.append(by_name[n])
            for u in sorted(users[n]):
                deps[u].discard(n)
                if not deps[u]:
                    heapq.heappush(heap, (_module_rank(by_name[u].relpath), by_name[u].relpath, u))
        if len(order) == len(mods):
            entry = [m for m in order if m.is_entry]
            return [m for m in order if not m.is_entry] + entry
    cyc = sorted(m.relpath for m in mods if m.name not in {o.name for o in order})
    raise BundleError(f"import cycle at module top level among {', '.join(cyc)}")


def _check_no_main_guard(module: SourceModule) -> None:
    for node in module.tree.body:
        if isinstance(node, ast.If) and "__name__" in ast.unparse(node.test) and "__main__" in ast.unparse(node.test):
            raise BundleError(f"{module.relpath}:{node.lineno}: `if __name__ == \"__main__\"` in a library module "
                              f"would run inside the bundle; move the CLI to the package's __main__.py")


def _check_unique_names(modules: list) -> None:
    owners = {}
    for m in modules:
        for name, key in top_level_bindings(m).items():
            if name == PACKED_WHEN_NAME:  # dropped from the bundle
                continue
            if name in owners:
                other, other_key = owners[name]
                if key is not None and key == other_key:
                    continue  # the same import in two modules: hoisted once
                raise BundleError(f"top-level name {name!r} is bound in both {other} and {m.relpath}; "
                                  f"names must be unique across the bundled modules (rename or prefix one)")
            owners[name] = (m.relpath, key)

