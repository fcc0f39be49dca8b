"""The layout rules: a thin entry, small modules, lint-clean, and the layers read from every import
(docs/layout.md): primitives -> model and shards -> quant, eval, kit -> trainer -> entries and tools."""

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
LIBRARY_PACKAGES = ("primitives", "model", "shards", "quant", "eval", "kit", "trainer")
MAX_MODULE_LINES = 450


def test_entry_and_every_bundled_module_stay_small():
    sizes = {p.relative_to(REPO).as_posix(): len(p.read_text().splitlines())
             for p in [REPO / "train_gpt.py", *(f for pkg in LIBRARY_PACKAGES for f in (REPO / pkg).glob("*.py"))]}
    assert {k: v for k, v in sizes.items() if v > MAX_MODULE_LINES} == {}
    assert len(sizes) >= 20


def test_no_library_module_imports_the_entry():
    """eval/, quant/ and trainer/ take the model and the settings from the package, never from train_gpt
    (function-level imports included)."""
    offenders = []
    for pkg in LIBRARY_PACKAGES:
        for path in (REPO / pkg).glob("*.py"):
            for node in ast.walk(ast.parse(path.read_text())):
                names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                         else [node.module] if isinstance(node, ast.ImportFrom) else [])
                offenders += [f"{path.name}:{node.lineno}" for n in names if n and n.split(".")[0] == "train_gpt"]
    assert offenders == []


def test_ruff_is_clean():
    """`ruff check .` with the rules of ruff.toml (E, W, F, B); a finding fails the suite."""
    pytest.importorskip("ruff")
    proc = subprocess.run([sys.executable, "-m", "ruff", "check", "--no-cache", str(REPO)], cwd=REPO,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]


# -----------------------------------------------------------------------------------------------
# layers: every import read from the code (module and function level), bottom to top
# -----------------------------------------------------------------------------------------------

# layer of each top folder; quant/eval CLIs (__main__.py) are entries, like train_gpt.py and tools/
LAYERS = {"primitives": 1, "model": 2, "shards": 2, "quant": 3, "eval": 3, "kit": 3, "trainer": 4,
          "train_gpt": 5, "tools": 5}
ENTRY_MODULES = ("quant.__main__", "eval.__main__")
# the module name is data (which flash-attn is installed), not a hidden project module
IMPORTLIB_ALLOWED = {"model/attention.py": "the flash-attn choice (FA3 -> FA4 -> FA2), a name from a list of packages",
                     "tools/bench/gpu_check.py": "the installed flash-attn packages' versions"}
# what users type (README, docs/): thin files at the top of tools/ whose code lives in a kind's package
TOOL_KINDS = {"auditor": ("audit",), "bench": ("bench_", "step_twin", "flash_twin", "cpu_twin", "gpu_check", "gpu_report", "kernel_bench"),
              "data": ("data_", "prepare_data"), "record": ("record_", "make_record", "runs", "significance"),
              "sweeps": ("sweep", "proxy_"), "parity": ("standins", "parity_")}
TOOL_COMMANDS = {"audit", "bench_eval", "bench_muon", "bench_quant", "bench_recipes", "bench_step", "bench_train",
                 "bench_ttt", "bundle", "gpu_check", "gpu_report", "make_record", "prepare_data", "significance", "sweep"}
# commands whose code has not moved into its package yet: other open work edits these files, and a move
# would turn its merge into a conflict instead of a rename (move them when it has landed)
TOOL_COMMANDS_NOT_THIN = {}
THIN_COMMAND_LINES = 15


def project_modules() -> dict:
    """{"pkg.mod": path} for train_gpt.py and every .py under the layered folders."""
    out = {"train_gpt": REPO / "train_gpt.py"}
    for top in LAYERS:
        folder = REPO / top
        if folder.is_dir():
            for path in sorted(folder.rglob("*.py")):
                parts = path.relative_to(REPO).with_suffix("").parts
                out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def module_layer(name: str) -> int:
    return 5 if name in ENTRY_MODULES else LAYERS[name.split(".")[0]]


def imports_of(path: Path, modules: dict) -> list:
    """[(line, imported project module)] of every import statement in `path`, at any depth."""
    out = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names = [f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in modules else node.module
                     for a in node.names]
        else:
            continue
        out += [(node.lineno, n) for n in names if n in modules]
    return out + run_module_calls(path, modules)


def run_module_calls(path: Path, modules: dict) -> list:
    """[(line, module)] of `runpy.run_module("tools.x.y", ...)`: a command that runs its code as a script
    (`python -m tools.x.y`) depends on it as an import does."""
    return [(node.lineno, node.args[0].value) for node in ast.walk(ast.parse(path.read_text(encoding="utf-8")))
            if isinstance(node, ast.Call) and ast.unparse(node.func).endswith("run_module") and node.args
            and isinstance(node.args[0], ast.Constant) and node.args[0].value in modules]


def import_graph() -> dict:
    modules = project_modules()
    return {name: imports_of(path, modules) for name, path in modules.items()}


def test_no_import_runs_up_a_layer():
    """primitives -> model, shards -> quant, eval, kit -> trainer -> entries: a module imports only its own
    layer or those below (function-level imports count)."""
    modules = project_modules()
    up = [f"{modules[src].relative_to(REPO)}:{line} imports {dst} (layer {module_layer(src)} -> {module_layer(dst)})"
          for src, edges in import_graph().items() for line, dst in edges if module_layer(dst) > module_layer(src)]
    assert up == []
    assert len(modules) > 80


def test_no_import_circle():
    graph = {src: {dst for _, dst in edges if dst != src} for src, edges in import_graph().items()}
    index, low, stack, on_stack, circles = {}, {}, [], set(), []

    def visit(v):  # Tarjan's strongly connected components
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            part = []
            while not part or part[-1] != v:
                part.append(stack.pop())
                on_stack.discard(part[-1])
            if len(part) > 1:
                circles.append(sorted(part))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    assert circles == []


def test_no_importlib_hides_a_project_module():
    """importlib.import_module / __import__ only where the module name is data; never a project module."""
    modules = project_modules()
    found = []
    for path in modules.values():
        rel = path.relative_to(REPO).as_posix()
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if not isinstance(node, ast.Call):
                continue
            func = ast.unparse(node.func)
            if func.split(".")[-1] not in ("import_module", "__import__"):
                continue
            arg = node.args[0] if node.args else None
            if isinstance(arg, ast.Constant) and str(arg.value).split(".")[0] not in LAYERS:
                continue  # a third-party module by its literal name
            if rel not in IMPORTLIB_ALLOWED:
                found.append(f"{rel}:{node.lineno}: {ast.unparse(node)}")
    assert found == []


def test_tools_grouped_by_kind_with_thin_commands_on_top():
    """tools/: the commands users type stay at the top as thin files; every other module lives in the
    package of its kind (audit_* in tools/auditor/, bench_* and the twins in tools/bench/, ...)."""
    tools = REPO / "tools"
    top = {p.stem for p in tools.glob("*.py")} - {"__init__"}
    assert top == TOOL_COMMANDS
    fat = {}
    for name in sorted(TOOL_COMMANDS - set(TOOL_COMMANDS_NOT_THIN)):
        source = (tools / f"{name}.py").read_text(encoding="utf-8")
        targets = {n.module for n in ast.walk(ast.parse(source)) if isinstance(n, ast.ImportFrom) and n.module}
        targets |= {m for _, m in run_module_calls(tools / f"{name}.py", project_modules())}
        if len(source.splitlines()) > THIN_COMMAND_LINES or not any(t.startswith(("tools.", "kit.")) for t in targets):
            fat[name] = len(source.splitlines())
    assert fat == {}
    packages = {p.name for p in tools.iterdir() if p.is_dir() and (p / "__init__.py").is_file()}
    assert packages == set(TOOL_KINDS)
    misplaced = []
    for path in tools.rglob("*.py"):
        if path.parent == tools or path.stem == "__init__":
            continue
        kinds = [k for k, prefixes in TOOL_KINDS.items() if path.stem.startswith(prefixes)]
        if path.parent.parent != tools or kinds != [path.parent.name]:
            misplaced.append(f"{path.relative_to(REPO)} (kind: {kinds or 'none'})")
    assert misplaced == []


def test_the_commands_the_docs_type_exist():
    """Every `tools/....py` path the README and docs/ show is a file: moving code never moves a command."""
    typed = set()
    for doc in [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]:
        typed |= set(re.findall(r"python (tools/[\w/]+\.py)", doc.read_text(encoding="utf-8")))
    assert typed and sorted(t for t in typed if not (REPO / t).is_file()) == []
    assert {t.split("/")[1][:-3] for t in typed if t.count("/") == 1} <= TOOL_COMMANDS
