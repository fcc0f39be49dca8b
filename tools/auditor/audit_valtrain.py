"""Training on val tokens written inline (tools/audit_rules.check_val_training's second half).

The first half finds a function that trains (backward + step, no scoring before its update) and is
handed val data. Records also train on val inline: a loop in `main()` slicing the val tokens with
`backward()` / `step()` in it, epochs that rescore chunks already trained on, a scoring pass after
TTT. Rules (organizers: issue #677, issue #1017 "the model state that scores a val token must come
only from data seen strictly before it"; PR #1376 closed):

- a loop with backward() and an optimizer step() that indexes or iterates a val-named tensor (or a name
  assigned from one) with no no_grad / inference_mode scoring block ahead of its backward: fail;
- a scoring block and a backward in one loop whose variable or range names epochs, where the loop runs
  over the val chunks: every later epoch scores tokens already trained on: fail;
- a loop training on tensors derived from val through a call (`chunks = split(val_tokens)`) that this
  reading cannot follow: not checkable, with the lines;
- logs: the claimed score printed after a TTT score line by a pass whose name is not TTT's (a re-score
  of adapted tokens), or two TTT epochs scored on the same tokens: fail.
"""

from __future__ import annotations

import ast
import re

_NO_GRAD = ("no_grad", "inference_mode")
_RE_EPOCH = re.compile(r"(?i)epoch|\bep\b")
_RE_VAL = re.compile(r"(?i)(^|_)val(_|$|id)|valid")


def _text(node) -> str:
    try:
        return ast.unparse(node)
    except Exception:  # noqa: BLE001
        return ""


_RE_DATA = re.compile(r"(?i)tok|data|ids|loader|chunk|seq|doc|batch|stream|^val$|^x_|^y_|_x$|_y$|input|target")


def _valname(name: str) -> bool:
    """A name for val data (`val_tokens`, `val_data`, `valid_ids`), not a val metric (`val_loss`)."""
    low = name.lower()
    return bool(_RE_VAL.search(name)) and "eval" not in low and bool(_RE_DATA.search(name)) and not any(
        k in low for k in ("loss", "bpb", "every", "byte", "lut", "metric", "step"))


def _names(node) -> set:
    return {n.id if isinstance(n, ast.Name) else n.attr for n in ast.walk(node) if isinstance(n, (ast.Name, ast.Attribute))}


def _root(node) -> str:
    while isinstance(node, (ast.Attribute, ast.Subscript, ast.Call)):
        node = node.func if isinstance(node, ast.Call) else node.value
    return node.id if isinstance(node, ast.Name) else ""


def _taint(fn) -> tuple:
    """({name: "direct"|"derived"}, {name: line}) of names in `fn` bound to val data: direct when sliced
    or copied from a val-named tensor, derived when returned by a call given val data."""
    kinds, lines = {}, {}
    for _ in range(2):  # two passes: names assigned from names assigned from val
        for node in ast.walk(fn):
            if isinstance(node, (ast.Assign, ast.AnnAssign)) and node.value is not None:
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                src = node.value
                direct = any(_valname(n) or kinds.get(n) == "direct" for n in _names(src)) and not isinstance(src, ast.Call)
                derived = isinstance(src, ast.Call) and any(_valname(n) or n in kinds for n in _names(src))
                direct = direct or (isinstance(src, ast.Call) and isinstance(src.func, ast.Attribute)
                                    and _root(src.func) and (_valname(_root(src.func)) or kinds.get(_root(src.func)) == "direct"))
                for t in targets:
                    for n in ast.walk(t):
                        if isinstance(n, ast.Name) and (direct or derived) and n.id not in kinds:
                            kinds[n.id], lines[n.id] = ("direct" if direct else "derived"), node.lineno
    return kinds, lines


def _loop_facts(loop):
    nodes = list(ast.walk(loop))
    backward = [n.lineno for n in nodes if isinstance(n, ast.Call) and _text(n.func).endswith(".backward")]
    steps = [n.lineno for n in nodes if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute)
             and n.func.attr == "step" and not n.args]
    scoring = [n.lineno for n in nodes if _is_scoring(n)]
    return nodes, backward, steps, scoring


_RE_FORWARD = re.compile(r"(?i)logits|forward|cross_entropy|nll|loss|model|eval|score|fwd")


def _is_scoring(node) -> bool:
    """A no_grad / inference_mode block that runs the model (not one that edits gradients)."""
    return isinstance(node, ast.With) and any(k in _text(i.context_expr) for i in node.items for k in _NO_GRAD) and any(
        isinstance(c, ast.Call) and _RE_FORWARD.search(_text(c.func)) for b in node.body for c in ast.walk(b))


def _scores_after(fn, line: int) -> int | None:
    """Line of the first scoring of val data in `fn` after `line`: a scoring block, or a call whose
    name scores (eval/score) given a val-named argument."""
    for n in sorted(ast.walk(fn), key=lambda n: getattr(n, "lineno", 0)):
        if getattr(n, "lineno", 0) <= line:
            continue
        if _is_scoring(n):
            return n.lineno
        if isinstance(n, ast.Call) and re.search(r"(?i)eval|score", _text(n.func)) and any(
                _valname(x) for a in list(n.args) + [k.value for k in n.keywords] for x in _names(a)):
            return n.lineno
    return None


def _val_use(loop, nodes, kinds) -> tuple:
    """('direct'|'derived'|None, line): how the loop reaches val data: a subscript of / iteration over a
    val-named or tainted name (call arguments alone, `eval_val(..., val_tokens)`, are not training data)."""
    best = (None, 0)
    roots = []
    if isinstance(loop, ast.For):
        roots += [(n, loop.lineno) for n in _names(loop.iter)]
    roots += [(_root(n.value), n.lineno) for n in nodes if isinstance(n, ast.Subscript)]
    for name, line in roots:
        kind = "direct" if _valname(name) else kinds.get(name)
        if kind == "direct":
            return "direct", line
        if kind == "derived" and best[0] is None:
            best = ("derived", line)
    return best


def _scores_before(fn, line: int) -> bool:
    return any(_is_scoring(n) and n.lineno < line for n in ast.walk(fn))


def _is_epoch_loop(loop) -> bool:
    if isinstance(loop, ast.For):
        return bool(_RE_EPOCH.search(_text(loop.target)) or _RE_EPOCH.search(_text(loop.iter)))
    return bool(_RE_EPOCH.search(_text(loop.test)))


def inline_findings(tree) -> list:
    """[(status, text)] of loops training on val tokens outside a function handed val data."""
    out = []
    for fn in [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]:
        kinds, lines = _taint(fn)
        loops = [n for n in ast.walk(fn) if isinstance(n, (ast.For, ast.While))]
        for loop in loops:
            nodes, backward, steps, _ = _loop_facts(loop)
            if not backward or not steps:
                continue
            use, line = _val_use(loop, nodes, kinds)
            if use is None:
                continue
            where = f"train_gpt.py {fn.name}() lines {loop.lineno}-{loop.end_lineno}"
            first = min(backward)
            chain = [c for c in loops if c.lineno <= loop.lineno and c.end_lineno >= loop.end_lineno]
            scoring = sorted({s for c in chain for s in _loop_facts(c)[3]})
            epoch_scoring = [s for c in chain if _is_epoch_loop(c) for s in _loop_facts(c)[3]]
            if epoch_scoring:
                out.append(("fail", f"{where}: an epoch loop that scores (no_grad, line {min(epoch_scoring)}) and trains "
                                    f"(backward, line {first}) on val tokens (line {line}): every later epoch scores "
                                    f"tokens already trained on (score after adaptation; issue #677, issue #1017)"))
            elif not any(s < first for s in scoring) and not _scores_before(fn, loop.lineno):
                later = _scores_after(fn, loop.end_lineno)
                how = "slices val tokens" if use == "direct" else "reads tensors built from val data by a call"
                text = (f"{where}: backward (line {first}) and step (line {min(steps)}) in a loop that {how} "
                        f"(line {line}) with no scoring before the update")
                stepped = {_root(n.func) for n in nodes if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute)
                           and n.func.attr == "step" and not n.args}
                dropped = [n.lineno for n in ast.walk(fn) if isinstance(n, ast.Delete) and n.lineno > min(steps)
                           and stepped & {_root(t) for t in n.targets}]
                if dropped:
                    out.append(("n/a", f"{text}; its optimizer is deleted after the loop (line {dropped[0]}): a "
                                       f"warm-up whose updates are thrown away, as far as this reading can tell"))
                elif use == "direct" and later:
                    out.append(("fail", f"{text}; the same function scores val after it (line {later}): trains on "
                                        f"val before scoring it (issue #677, PR #1376)"))
                else:
                    out.append(("n/a", f"{text}; whether these val tokens were scored before this update is decided "
                                       f"outside {fn.name}() and cannot be read statically"))
    return out


def log_findings(logs) -> list:
    """[(status, text)] from the logs: the claim scored by a pass after TTT, or epochs rescoring one split."""
    out = []
    for lg in logs:
        metrics = lg.facts.metrics
        ttt = [m for m in metrics if "ttt" in m.name.lower()]
        score = lg.score
        if score is not None and ttt and "ttt" not in score.name.lower() and score.line > min(m.line for m in ttt):
            first = min(ttt, key=lambda m: m.line)
            out.append(("fail", f"{lg.name}:{score.line} the claimed {score.name} {score.val_bpb} is a pass after "
                                f"{first.name} (line {first.line}): the adapted model re-scores val tokens it has "
                                f"trained on (issue #677)"))
        epochs = [m for m in metrics if _RE_EPOCH.search(m.name) and "ttt" in m.name.lower()]
        if len(epochs) >= 2:
            out.append(("fail", f"{lg.name}:{epochs[0].line},{epochs[1].line} {epochs[0].name} / {epochs[1].name}: "
                                f"each TTT epoch scores the same val tokens again (score after adaptation)"))
    return out
