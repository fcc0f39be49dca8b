"""Checks of tools/audit.py that read the unpacked script and the folder's files, never running them.

- val_not_trained: val tokens reach an optimizer step before they are scored (pre-quant "TTT": N
  epochs of AdamW on `val_tokens`, then the score). Ruled illegal by the organizers: PR #1376 closed
  2026-04-10, openai/parameter-golf issue #677 (the #1487/#1992 cluster), issue #1017 ("the model
  state that scores a val token must come only from data seen strictly before it"). Score-first TTT
  (a no_grad / inference_mode scoring block before the update, merged 2026-03-23_LeakyReLU_LegalTTT) passes.
- no_network: downloads or `pip install` at run time (the artifact must be self-contained: official README).
- code_inside_folder: runpy / importlib / sys.path / exec of files outside the record folder.
- full_val_split: a log that says only part of the val split was scored (VAL_MAX_TOKENS, "N of M val tokens").
- file_safety: symlinks (outside the folder: fail), non-UTF-8 log bytes, oversized files: one line each.
"""

from __future__ import annotations

import ast
import os
import re
from pathlib import Path

from tools.auditor.audit_checks import Check
from tools.auditor.audit_parse import parse_any
from tools.auditor.audit_valtrain import inline_findings, log_findings

_OPT_STEP = {"step"}
_NO_GRAD = ("no_grad", "inference_mode")
_NET_CALLS = {"urlopen", "urlretrieve", "hf_hub_download", "snapshot_download", "load_dataset", "create_connection"}
_NET_MODULES = {"requests", "httpx", "urllib3", "aiohttp", "wget"}
_RUN_FILE_CALLS = {"run_path", "run_module", "spec_from_file_location", "load_source"}


def _name(node) -> str:
    """Dotted text of a call target (`torch.no_grad`, `opt.step`), '' when not a plain chain."""
    try:
        return ast.unparse(node)
    except Exception:  # noqa: BLE001 (odd nodes: no name)
        return ""


def _valish(node) -> bool:
    return any(isinstance(n, (ast.Name, ast.Attribute)) and "val" in (n.id if isinstance(n, ast.Name) else n.attr).lower()
               and "eval" not in (n.id if isinstance(n, ast.Name) else n.attr).lower() for n in ast.walk(node))


def _root(node) -> str:
    while isinstance(node, (ast.Attribute, ast.Subscript, ast.Call)):
        node = node.func if isinstance(node, ast.Call) else node.value
    return node.id if isinstance(node, ast.Name) else ""


def _slices_in_backward_loop(fn, param: str) -> bool:
    """`param` (or an attribute of it) is indexed inside a loop that also calls backward(): its tokens
    are training data there (`local = val_tokens[a:b]` ... `loss.backward()`), not merely handed to
    an eval function (`eval_val(..., val_data)` in a training loop)."""
    for loop in ast.walk(fn):
        if not isinstance(loop, (ast.For, ast.While)):
            continue
        nodes = list(ast.walk(loop))
        if any(isinstance(n, ast.Call) and _name(n.func).endswith(".backward") for n in nodes) and any(
                isinstance(n, ast.Subscript) and _root(n.value) == param for n in nodes):
            return True
    return False


def _param_for(fn, call: ast.Call, arg) -> str:
    names = [a.arg for a in fn.args.posonlyargs + fn.args.args]
    if arg in call.args:
        i = call.args.index(arg)
        return names[i] if i < len(names) else ""
    return next((k.arg for k in call.keywords if k.value is arg), "") or ""


def _trains_before_scoring(fn: ast.FunctionDef) -> bool:
    """The function calls backward() and an optimizer .step() with no no_grad/inference_mode scoring
    block ahead of the first backward (score-first TTT scores each chunk before adapting on it)."""
    backward = [n.lineno for n in ast.walk(fn) if isinstance(n, ast.Call) and _name(n.func).endswith(".backward")]
    steps = [n for n in ast.walk(fn) if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute)
             and n.func.attr in _OPT_STEP and not n.args]
    if not backward or not steps:
        return False
    scoring = [n.lineno for n in ast.walk(fn) if isinstance(n, (ast.With, ast.FunctionDef)) and any(
        k in _name(item.context_expr if isinstance(n, ast.With) else item) for k in _NO_GRAD
        for item in (n.items if isinstance(n, ast.With) else n.decorator_list))]
    return not any(line < min(backward) for line in scoring)


def code_tree(rec):
    """The parsed code that runs (unpacked, any Python version's f-strings), cached on `rec`; None when
    there is no code or it does not parse."""
    if getattr(rec, "_tree", None) is None and rec.script is not None and rec.script.source:
        try:
            rec._tree = parse_any(rec.script.source)[0]
        except (SyntaxError, ValueError, RecursionError):
            rec._tree = False
    return getattr(rec, "_tree", None) or None


def code_unreadable(rec, name: str):
    """The `not checkable` Check of a code rule when there is no readable code or it does not parse
    here; None when code_tree(rec) has the tree."""
    if rec.script is None or not rec.script.source:
        return Check(name, "n/a", "no readable code")
    return Check(name, "n/a", "the code does not parse here") if code_tree(rec) is None else None


def check_val_training(rec) -> Check:
    name = "val_not_trained"
    log_hits = [(lg.name, n, op) for lg in rec.seed_logs for op, _, n in lg.facts.eval_ops
                if "prequant" in op.lower() and "ttt" in op.lower()]
    if rec.script is None or not rec.script.source:
        if log_hits:
            lg, n, op = log_hits[0]
            return Check(name, "fail", f"{lg}:{n} `{op}`: test-time training on val before quantization and scoring "
                                       f"(PR #1376 ruling, issue #677)")
    unreadable = code_unreadable(rec, name)
    if unreadable:
        return unreadable
    tree = code_tree(rec)
    funcs = {n.name: n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}
    trainers = {k for k, fn in funcs.items() if _trains_before_scoring(fn)}
    for call in ast.walk(tree):
        if isinstance(call, ast.Call) and isinstance(call.func, ast.Name) and call.func.id in trainers:
            fn = funcs[call.func.id]
            args = [a for a in list(call.args) + [k.value for k in call.keywords]
                    if _valish(a) and _slices_in_backward_loop(fn, _param_for(fn, call, a))]
            if args:
                return Check(name, "fail", f"train_gpt.py line {call.lineno}: {call.func.id}(... "
                                           f"{next(_name(a) for a in args if _valish(a))} ...) trains on val tokens "
                                           f"(backward + step, line {fn.lineno}) with no scoring pass before its update: "
                                           f"score-after-update, ruled out (PR #1376, issue #677, issue #1017)")
    if log_hits:
        lg, n, op = log_hits[0]
        return Check(name, "fail", f"{lg}:{n} `{op}`: test-time training on val before scoring (issue #677)")
    found = inline_findings(tree) + log_findings(rec.seed_logs)
    for status in ("fail", "n/a"):
        hits = [t for s, t in found if s == status]
        if hits:
            return Check(name, status, "; ".join(hits[:2]) + (" (not checkable: the reading stops here; never a "
                                                              "pass)" if status == "n/a" else ""))
    return Check(name, "pass", f"no optimizer step on val tokens before they are scored ({len(trainers)} training "
                               f"routine(s), none given val data without a score-first pass)")


def check_network(rec) -> Check:
    name = "no_network"
    unreadable = code_unreadable(rec, name)
    if unreadable:
        return unreadable
    tree = code_tree(rec)
    hits = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            mods = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""]
            hits += [(node.lineno, f"import {m}") for m in mods if m.split(".")[0] in _NET_MODULES]
        elif isinstance(node, ast.Call):
            target = _name(node.func).split(".")[-1]
            text = " ".join(a.value for a in ast.walk(node) if isinstance(a, ast.Constant) and isinstance(a.value, str))
            if target in _NET_CALLS:
                hits.append((node.lineno, f"{target}(...)"))
            elif ("pip install" in text or ("pip" in text.split() and "install" in text.split())) and re.search(
                    r"(?i)subprocess|system|popen|check_call|check_output|\brun$|\bcall$|spawn|exec", _name(node.func)):
                hits.append((node.lineno, f"{_name(node.func)}(... pip install ...)"))
    if hits:
        return Check(name, "fail", "train_gpt.py " + "; ".join(f"line {n}: {w}" for n, w in hits[:3])
                     + ": network access or installs at run time (the artifact must be self-contained)")
    return Check(name, "pass", "no downloads, sockets or pip installs in the code")


def _outside_literal(node, folder: Path) -> str | None:
    for c in ast.walk(node):
        if isinstance(c, ast.Constant) and isinstance(c.value, str) and ("/" in c.value or c.value.endswith(".py")):
            v = c.value
            if v.startswith(("/", "~")) or ".." in Path(v).parts or "records/" in v:
                return v
        if isinstance(c, ast.Attribute) and c.attr in ("parents", "parent") and _name(c).count(".parent") >= 2:
            return _name(c)
        if isinstance(c, ast.Subscript) and _name(c.value).endswith("parents"):
            return _name(c)
    return None


def check_outside_code(rec) -> Check:
    name = "code_inside_folder"
    unreadable = code_unreadable(rec, name)
    if unreadable:
        return unreadable
    tree = code_tree(rec)
    hits = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        target = _name(node.func)
        tail = target.split(".")[-1]
        if tail in _RUN_FILE_CALLS:
            where = _outside_literal(node, rec.folder)
            hits.append((node.lineno, f"{target}({where or 'a computed path'})", where is not None or "runpy" in target))
        elif target in ("sys.path.insert", "sys.path.append", "exec") or tail == "chdir":
            where = _outside_literal(node, rec.folder)
            if where:
                hits.append((node.lineno, f"{target}({where})", True))
    bad = [h for h in hits if h[2]]
    if bad:
        return Check(name, "fail", "train_gpt.py " + "; ".join(f"line {n}: {w}" for n, w, _ in bad[:3])
                     + ": runs code from outside the record folder (the folder must hold all of its code)")
    if hits:
        return Check(name, "warn", "train_gpt.py " + "; ".join(f"line {n}: {w}" for n, w, _ in hits[:3])
                     + ": loads a file by path; check it lies in the folder")
    return Check(name, "pass", "no runpy / importlib / sys.path use of files outside the folder")


def check_partial_val(rec) -> Check:
    name = "full_val_split"
    hits = [(lg.name, lg.facts.val_subset) for lg in rec.seed_logs if lg.facts.val_subset]
    if hits:
        lg, (text, n) = hits[0]
        return Check(name, "fail", f"{lg}:{n} `{text}`: only part of the val split was scored (the score is on the "
                                   f"full FineWeb val split, official README)")
    counts = sorted({lg.facts.val_tokens[0] for lg in rec.seed_logs if lg.facts.val_tokens})
    if counts:
        return Check(name, "pass", f"no val subset in the logs; val tokens logged: {', '.join(f'{c:,}' for c in counts)}")
    return Check(name, "pass" if rec.seed_logs else "n/a", "no val subset marker in the logs")


def folder_files(folder: Path):
    """(relative path, os.DirEntry-like status) of everything under `folder`, symlinks not followed."""
    for root, dirs, files in os.walk(folder, followlinks=False):
        for n in sorted(dirs + files):
            yield Path(root, n)


def is_inside(folder: Path, path: Path) -> bool:
    """`path` (after resolving symlinks) lies inside `folder`."""
    try:
        return Path(os.path.realpath(path)).is_relative_to(Path(os.path.realpath(folder)))
    except OSError:
        return False


def check_file_safety(rec, max_bytes: int) -> Check:
    name = "file_safety"
    lines, fail = [], False
    for p in folder_files(rec.folder):
        rel = p.relative_to(rec.folder)
        if p.is_symlink():
            target = os.readlink(p)
            if is_inside(rec.folder, p):
                lines.append(f"{rel} is a symlink to {target} (inside the folder)")
            else:
                fail = True
                lines.append(f"{rel} is a symlink to {target}, outside the folder: not read")
        elif p.is_file() and p.stat().st_size > max_bytes and p.suffix in (".log", ".txt", ".py", ".json"):
            lines.append(f"{rel} is {p.stat().st_size:,} bytes (over {max_bytes:,}): not read")
    for lg in rec.logs:
        if lg.facts.bad_bytes:
            off, n = lg.facts.bad_bytes
            lines.append(f"{lg.name}:{n} has bytes that are not UTF-8 (first at byte {off:,}); read with replacement")
    if fail:
        return Check(name, "fail", "; ".join(lines[:4]))
    if lines:
        return Check(name, "warn", "; ".join(lines[:4]))
    return Check(name, "pass", "no symlinks, oversized files or undecodable log bytes")
