"""The run probe's multi-process mode: a script whose eval code branches on the world size runs as torchrun
ranks would, two CPU processes on gloo (tools/parity/standins_cuda.py maps nccl to gloo), and the ranks'
traced events are merged into one log.

    world = probe_world_size(source)          # 2 when an eval function compares world_size, else 1
    env_r = rank_env(env, rank, world, port)  # RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT
    run = merge_ranks([run_0, run_1])         # one events list, rank 0's printed lines

Why: closed PR #727 turns its eval-time n-gram cache on only when `world_size > 1` (`_ngram_default = "1" if
world_size > 1 else "0"` in eval_val_sliding); one process scores the plain softmax. Merging: collectives are
matched across ranks in call order, so every traced collective is a `sync` event, and the events each rank
logged between its (k-1)-th and k-th collective belong to the same stretch of the run; a stretch holds rank 0's
events, then the other ranks', then the collective. Printed lines are rank 0's (a pass ends at the line that
prints its all-reduced result).
"""

from __future__ import annotations

import ast
import re
import socket

from tools.auditor.audit_parse import parse_any

PROBE_RANKS = 2
_EVALISH = re.compile(r"eval|score|val|ttt|ngram|cache|mix", re.I)
_COLLECTIVE_CALLS = {"all_reduce", "all_gather", "broadcast", "barrier", "reduce_scatter_tensor", "reduce",
                     "all_gather_into_tensor", "all_gather_object", "broadcast_object_list", "gather", "scatter"}


def _mentions_world_size(node) -> bool:
    return any((isinstance(n, ast.Name) and "world_size" in n.id.lower())
               or (isinstance(n, ast.Attribute) and "world_size" in n.attr.lower()) for n in ast.walk(node))


def _calls(nodes) -> set:
    return {(n.func.attr if isinstance(n.func, ast.Attribute) else getattr(n.func, "id", ""))
            for node in nodes for n in ast.walk(node) if isinstance(n, ast.Call)}


def world_size_branches(source: str) -> list:
    """(function, line, test) of each branch on the world size inside an eval-like function (its name holds
    eval, score, val, ttt, ngram, cache or mix): a conditional expression, or an `if` whose body is more than
    collectives (an `if world_size > 1: dist.all_reduce(...)` computes the same on one process)."""
    try:
        tree = parse_any(source)[0]
    except (SyntaxError, ValueError, RecursionError):
        return []
    hits = []
    for fn in ast.walk(tree):
        if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)) or not _EVALISH.search(fn.name):
            continue
        for n in ast.walk(fn):
            if not (isinstance(n, (ast.If, ast.IfExp)) and isinstance(n.test, ast.Compare)
                    and _mentions_world_size(n.test)):
                continue
            if isinstance(n, ast.IfExp) or (
                    not _calls(n.body) & _COLLECTIVE_CALLS and not any(isinstance(b, ast.Raise) for b in n.body)):
                hits.append((fn.name, n.lineno, ast.unparse(n.test)[:80]))
    return hits


def probe_world_size(source: str) -> int:
    """PROBE_RANKS when the script's eval code branches on the world size (world_size_branches), else 1."""
    return PROBE_RANKS if world_size_branches(source) else 1


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rank_env(env: dict, rank: int, world: int, port: int) -> dict:
    """`env` with torchrun's variables for `rank` of `world` (one node, the rendezvous on 127.0.0.1:port)."""
    return {**env, "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world),
            "LOCAL_WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}


def merge_ranks(runs: list) -> dict:
    """One run dict from the ranks' run dicts (module docstring): the first error, else the merged events,
    renumbered, each with its `rank`."""
    for r in runs:
        if r.get("error"):
            return r
    keyed = []
    for rank, run in enumerate(runs):
        k = 0
        for e in run["events"]:
            if e["kind"] == "line" and rank:
                continue
            if e["kind"] == "sync":
                if not rank:
                    keyed.append(((k, 1, 0, e["seq"]), e))
                k += 1
                continue
            keyed.append(((k, 0, rank, e["seq"]), {**e, "rank": rank}))
    keyed.sort(key=lambda x: x[0])
    return {"events": [{**e, "seq": i} for i, (_, e) in enumerate(keyed)], "error": None, "ranks": len(runs)}
