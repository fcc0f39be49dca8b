"""What the run probe records inside a record script's process (tools/auditor/audit_probe_child.py).

Scoring is traced where scripts compute it: F.cross_entropy. Each call's targets are located in the
val stream (by the probe's val split's anchors, tokens that appear once: tools/auditor/audit_probe_data.py), and
with reduction="none" the result is a TrackedNLL: a tensor that carries, per element, the val
position of its target (-1: not a val token) through views, casts, indexing, elementwise math and
masks (a zero weight drops the position). Reducing it (sum, mean, item) is an event:
  score: the reduced value does not require grad: these positions' -log p entered a result
  train: it requires grad: the positions are a training loss (test-time training on val tokens)
A mean-reduced CE on val targets is a score without grad and a train event with grad. Printed lines
are events too (a line with val_loss and val_bpb closes an eval pass), every token embedding
lookup is classified as train or val tokens (the after-the-clock probe), and each torch.distributed
collective is a `sync` event (the ranks of a multi-process run are merged at them:
tools/auditor/audit_probe_ranks.py). Events share one counter.
"""

from __future__ import annotations

import sys

import numpy as np
import torch
import torch.nn.functional as F

KGRAM = 4
MIN_RUN = 4  # consecutive val positions a located run of targets needs
MIN_ANCHORS = 2  # of them placed by an anchor (a token that appears once in the val split)
_PRIME = np.uint64(1_000_003)


def _kgram_hashes(tokens: np.ndarray, k: int = KGRAM) -> np.ndarray:
    t = tokens.astype(np.uint64)
    n = len(t) - k + 1
    if n <= 0:
        return np.zeros(0, np.uint64)
    h = np.zeros(n, np.uint64)
    with np.errstate(over="ignore"):
        for j in range(k):
            h = h * _PRIME + t[j:j + n] + np.uint64(1)
    return h


class StreamIndex:
    """Positions of a token stream's unique 4-grams: locate(targets) -> the stream index of each
    target (-1 where it is not a run of the stream)."""

    def __init__(self, tokens, k: int = KGRAM):
        self.tokens, self.k = np.asarray(tokens, dtype=np.int64), k
        h = _kgram_hashes(self.tokens, k)
        order = np.argsort(h, kind="stable")
        hs = h[order]
        dup = np.zeros(len(hs), bool)
        if len(hs) > 1:
            same = hs[1:] == hs[:-1]
            dup[1:] |= same
            dup[:-1] |= same
        self.hashes, self.starts = hs[~dup], order[~dup]

    def hits(self, flat: np.ndarray) -> np.ndarray:
        """The stream index of each flat[j] whose k-gram flat[j:j+k] is a unique k-gram of the stream, else -1
        (no extension to neighbours)."""
        pos = np.full(len(flat), -1, np.int64)
        h = _kgram_hashes(flat, self.k)
        if len(h) and len(self.hashes):
            i = np.clip(np.searchsorted(self.hashes, h), 0, len(self.hashes) - 1)
            hit = self.hashes[i] == h
            pos[:len(h)][hit] = self.starts[i[hit]]
        return pos

    def locate(self, targets: np.ndarray) -> np.ndarray:
        flat = np.asarray(targets, dtype=np.int64).reshape(-1)
        pos = np.full(len(flat), -1, np.int64)
        h = _kgram_hashes(flat, self.k)
        if len(h) == 0 or len(self.hashes) == 0:
            return pos.reshape(np.shape(targets))
        i = np.clip(np.searchsorted(self.hashes, h), 0, len(self.hashes) - 1)
        hit = self.hashes[i] == h
        pos[:len(h)][hit] = self.starts[i[hit]]
        if not hit.any():
            return pos.reshape(np.shape(targets))
        n = len(self.tokens)
        for j in np.flatnonzero(pos < 0):  # the last k-1 of a run, and rows shorter than k
            if j > 0 and pos[j - 1] >= 0 and pos[j - 1] + 1 < n and self.tokens[pos[j - 1] + 1] == flat[j]:
                pos[j] = pos[j - 1] + 1
        return pos.reshape(np.shape(targets))


class UniqueIndex:
    """Positions in a val stream whose anchors appear once each (its BOS and phrase tokens repeat:
    tools/auditor/audit_probe_data.py): locate(targets) -> the stream index of each target, -1 where it is
    not part of a run of at least MIN_RUN consecutive stream positions with MIN_ANCHORS anchors. An anchor
    is placed by its token, a repeated token by a located neighbour whose next (previous) stream token it
    is. `override` {token: index} places a token there wherever it appears (the normalization sweep's
    changed token)."""

    def __init__(self, tokens, bos: int, override: dict | None = None):
        self.tokens, self.bos = np.asarray(tokens, dtype=np.int64), int(bos)
        counts = np.bincount(self.tokens, minlength=int(self.tokens.max()) + 2)
        self.where = np.full(len(counts), -1, np.int64)
        once = counts[self.tokens] == 1
        self.where[self.tokens[once]] = np.flatnonzero(once)
        self.where[self.bos] = -1
        for tok, idx in (override or {}).items():
            self.where[tok] = idx

    def locate(self, targets: np.ndarray) -> np.ndarray:
        flat = np.asarray(targets, dtype=np.int64).reshape(-1)
        inside = (flat >= 0) & (flat < len(self.where))
        pos = np.where(inside, self.where[np.clip(flat, 0, len(self.where) - 1)], -1)
        anchored = pos >= 0
        n, toks = len(self.tokens), self.tokens
        todo = np.flatnonzero((pos < 0) & inside)
        for j in todo:  # forward from a located neighbour, then backward
            if j > 0 and 0 <= pos[j - 1] < n - 1 and toks[pos[j - 1] + 1] == flat[j]:
                pos[j] = pos[j - 1] + 1
        for j in todo[::-1]:
            if pos[j] < 0 and j + 1 < len(flat) and pos[j + 1] > 0 and toks[pos[j + 1] - 1] == flat[j]:
                pos[j] = pos[j + 1] - 1
        prev_ok = np.zeros(len(flat), bool)
        next_ok = np.zeros(len(flat), bool)
        prev_ok[1:] = (pos[1:] >= 0) & (pos[:-1] == pos[1:] - 1)
        next_ok[:-1] = (pos[:-1] >= 0) & (pos[1:] == pos[:-1] + 1)
        pos[~(prev_ok | next_ok)] = -1
        # a run of the stream is at least MIN_RUN consecutive positions, MIN_ANCHORS of them placed by an anchor
        # (train tokens that happen to follow each other in the val split, or an anchor before a phrase, are not one)
        start = np.ones(len(flat), bool)
        start[1:] = ~prev_ok[1:] | (pos[1:] < 0)
        run_id = np.cumsum(start) - 1
        if len(run_id):
            lengths = np.bincount(run_id, minlength=run_id[-1] + 1)
            anchors = np.bincount(run_id, weights=anchored & (pos >= 0), minlength=run_id[-1] + 1)
            pos[(lengths[run_id] < MIN_RUN) | (anchors[run_id] < MIN_ANCHORS)] = -1
        return pos.reshape(np.shape(targets))


class ValIndex(UniqueIndex):
    """UniqueIndex of a val stream whose first `prefix` tokens are a warm-up prefix without anchors
    (tools/auditor/audit_probe_data.py make_filler): targets UniqueIndex cannot place are located there by
    the unique 4-grams of the prefix that start and that end at them, where the two agree or only one is found
    (a flattened batch's 4-gram across two rows matches a prefix 4-gram when one token coincides: the other one
    then disagrees, and the target stays unplaced rather than misplaced)."""

    def __init__(self, tokens, bos: int, prefix: int = 0, override: dict | None = None):
        super().__init__(tokens, bos, override)
        self.prefix = int(prefix)
        self.warm = StreamIndex(self.tokens[:self.prefix + 1]) if self.prefix else None

    def locate(self, targets: np.ndarray) -> np.ndarray:
        pos = super().locate(targets)
        if self.warm is None:
            return pos
        flat, k = np.asarray(targets, dtype=np.int64).reshape(-1), self.warm.k
        starts = self.warm.hits(flat)
        ends = np.full(len(flat), -1, np.int64)
        ends[k - 1:] = np.where(starts[:len(flat) - k + 1] >= 0, starts[:len(flat) - k + 1] + k - 1, -1)
        both = (starts >= 0) & (ends >= 0)
        more = np.where(both & (starts != ends), -1, np.maximum(starts, ends))
        more = more.reshape(pos.shape)
        return np.where((pos < 0) & (more >= 0) & (more < self.prefix), more, pos)


class Trace:
    """The event log of one probe run (see the module docstring); `events` is what the child writes."""

    def __init__(self, val_tokens, train_tokens, bos: int, prefix: int = 0):
        self.val, self.train = ValIndex(val_tokens, bos, prefix), StreamIndex(train_tokens)
        self.events: list = []
        self.on_score = None  # callable(positions, values) for the normalization sweep
        self.on_collective = None  # callable() before each collective (a sweep's fork stops there)

    def add(self, kind: str, **fields) -> None:
        self.events.append({"seq": len(self.events), "kind": kind, **fields})

    def reduced(self, tracked, value) -> None:
        pos = tracked._pos.reshape(-1).numpy()
        vals = tracked.detach().reshape(-1).to(torch.float64).numpy() if tracked.numel() else np.zeros(0)
        keep = pos >= 0
        if not keep.any():
            return
        kind = "train" if getattr(value, "requires_grad", False) else "score"
        self.add(kind, pos=pos[keep].tolist(), val=vals[keep].tolist())
        if kind == "score" and self.on_score is not None:
            self.on_score(pos[keep], vals[keep])


TRACE: Trace | None = None

_VIEW_FUNCS = {"__getitem__", "reshape", "view", "flatten", "squeeze", "unsqueeze", "contiguous", "clone",
               "detach", "permute", "transpose", "t", "narrow", "select", "index_select", "masked_select",
               "expand", "expand_as", "view_as", "reshape_as", "flip", "roll", "gather", "take_along_dim"}
_SPLIT_FUNCS = {"split", "chunk", "unbind", "tensor_split"}
_CAST_FUNCS = {"to", "float", "double", "half", "bfloat16", "type", "cpu", "cuda", "type_as", "abs", "neg",
               "__neg__", "exp", "log", "log2", "clamp", "clamp_min", "clamp_max", "clamp_", "nan_to_num",
               "add", "__add__", "__radd__", "sub", "__sub__", "__rsub__", "div", "__truediv__", "__rtruediv__",
               "mul_", "add_", "sub_", "div_", "pow", "__pow__", "sqrt", "log1p", "expm1", "exp2",
               "logaddexp", "maximum", "minimum", "__iadd__", "__isub__", "__itruediv__"}
_MUL_FUNCS = {"mul", "__mul__", "__rmul__", "multiply", "__imul__", "mul_"}
_REDUCE_FUNCS = {"sum", "mean", "nansum", "item", "tolist"}


def _name(func) -> str:
    return getattr(func, "__name__", "")


def _pos_like(func, args, kwargs, tracked, out):
    """The position tensor of `out`, or None when the op does not keep positions elementwise."""
    name = _name(func)
    if name in _VIEW_FUNCS:
        pos_args = [tracked._pos if a is tracked else a for a in args]
        with torch._C.DisableTorchFunctionSubclass():
            try:
                p = func(*pos_args, **kwargs)
            except (RuntimeError, TypeError, IndexError):
                return None
        return p if isinstance(p, torch.Tensor) and p.shape == out.shape else None
    if name in ("where", "masked_fill", "masked_fill_") and out.shape == tracked.shape:
        return _selected_pos(name, args, kwargs, tracked, out)
    if name in _MUL_FUNCS and out.shape == tracked.shape:
        other = next((a for a in args if a is not tracked), None)
        if isinstance(other, torch.Tensor):
            keep = torch.broadcast_to(other.detach().to("cpu") != 0, out.shape)
            return torch.where(keep, tracked._pos, torch.full_like(tracked._pos, -1))
        return tracked._pos if other != 0 else torch.full_like(tracked._pos, -1)
    if name in _CAST_FUNCS and out.shape == tracked.shape:
        return tracked._pos
    return None


def _selected_pos(name, args, kwargs, tracked, out):
    """Positions of a where/masked_fill result: the tracked tensor's where its values were kept (the kit's
    sliding window: `nll.where(scored, 0).sum()`)."""
    args = list(args) + [kwargs[k] for k in ("condition", "mask", "input", "other", "value") if k in kwargs]
    if name == "where" and len(args) >= 3 and args[0] is not tracked:  # torch.where(cond, input, other)
        cond, keep_if = args[0], args[1] is tracked
    elif name == "where" and len(args) >= 2:  # tracked.where(cond, other)
        cond, keep_if = args[1], True
    elif name.startswith("masked_fill") and len(args) >= 2 and args[0] is tracked:
        cond, keep_if = args[1], False
    else:
        return None
    if not isinstance(cond, torch.Tensor):
        return None
    keep = torch.broadcast_to(cond.detach().to("cpu").bool(), out.shape)
    keep = keep if keep_if else ~keep
    return torch.where(keep, tracked._pos, torch.full_like(tracked._pos, -1))


class TrackedNLL(torch.Tensor):
    """A per-token -log p tensor that knows the val position of each element (`_pos`, int64, -1: none)."""

    @staticmethod
    def wrap(t: torch.Tensor, pos: torch.Tensor):
        out = torch.Tensor._make_subclass(TrackedNLL, t, t.requires_grad)
        out._pos = pos
        return out

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = _name(func)
        with torch._C.DisableTorchFunctionSubclass():
            out = func(*args, **kwargs)
        tracked = next((a for a in args if isinstance(a, TrackedNLL)), None)
        if tracked is None or not hasattr(tracked, "_pos"):
            return out
        if name in _REDUCE_FUNCS and TRACE is not None:
            TRACE.reduced(tracked, out)
            return out
        if name in _SPLIT_FUNCS and isinstance(out, (tuple, list)):
            with torch._C.DisableTorchFunctionSubclass():
                parts = func(tracked._pos, *args[1:], **kwargs)
            return type(out)(TrackedNLL.wrap(o, p) for o, p in zip(out, parts))
        if isinstance(out, torch.Tensor) and not isinstance(out, TrackedNLL):
            pos = _pos_like(func, args, kwargs, tracked, out)
            if pos is not None:
                return TrackedNLL.wrap(out, pos)
        elif isinstance(out, TrackedNLL) and out is not tracked and not hasattr(out, "_pos"):
            out._pos = tracked._pos
        return out


_REAL = {}


_DEPTH = [0]  # a TorchFunctionMode routes F.cross_entropy through itself once more: trace the outer call only


def traced_cross_entropy(input, target, *args, **kwargs):
    _DEPTH[0] += 1
    try:
        out = _REAL["cross_entropy"](input, target, *args, **kwargs)
    finally:
        _DEPTH[0] -= 1
    if (TRACE is None or _DEPTH[0] or not isinstance(target, torch.Tensor) or target.dtype.is_floating_point
            or target.is_meta):  # meta: a FLOP count (the kit's count_train_flops_per_token), no data
        return out
    pos = torch.from_numpy(TRACE.val.locate(target.detach().to("cpu").numpy()))
    if not (pos >= 0).any():
        return out
    reduction = kwargs.get("reduction", "mean")
    _DEPTH[0] += 1
    try:
        with torch.no_grad():
            nll = out if reduction == "none" else _REAL["cross_entropy"](
                input, target, *args, **{**kwargs, "reduction": "none"})
    finally:
        _DEPTH[0] -= 1
    keep = (pos >= 0).reshape(-1)
    TRACE.add("ce", pos=pos.reshape(-1)[keep].tolist(),
              val=nll.detach().reshape(-1)[keep].to(torch.float64).tolist())
    if reduction == "none":
        return TrackedNLL.wrap(out, pos.reshape(out.shape))
    TRACE.reduced(TrackedNLL.wrap(nll.detach(), pos.reshape(nll.shape)), out)
    return out


def traced_embedding(input, weight, *args, **kwargs):
    if (TRACE is not None and not _DEPTH[0] and isinstance(input, torch.Tensor) and not input.is_meta
            and input.numel() >= 2 * KGRAM):
        ids = input.detach().to("cpu").numpy()
        on_val = int((TRACE.val.locate(ids) >= 0).sum())
        on_train = int((TRACE.train.locate(ids) >= 0).sum())
        if on_val or on_train:
            TRACE.add("embed", stream="val" if on_val >= on_train else "train", tokens=int(ids.size),
                      grad=torch.is_grad_enabled())
    _DEPTH[0] += 1
    try:
        return _REAL["embedding"](input, weight, *args, **kwargs)
    finally:
        _DEPTH[0] -= 1


class LineEvents:
    """sys.stdout wrapper: forwards everything, and records each complete line as a `line` event."""

    def __init__(self, inner, trace: Trace):
        self.inner, self.trace, self.buf = inner, trace, ""

    def write(self, s):
        self.buf += s
        while "\n" in self.buf:
            line, self.buf = self.buf.split("\n", 1)
            self.trace.add("line", text=line[:2000])
        return self.inner.write(s)

    def flush(self):
        self.inner.flush()

    def __getattr__(self, name):
        return getattr(self.inner, name)


COLLECTIVES = ("all_reduce", "broadcast", "barrier", "all_gather", "all_gather_into_tensor", "reduce_scatter_tensor",
               "reduce", "all_gather_object", "broadcast_object_list", "gather", "scatter")


def _traced_collective(name: str, real):
    def collective(*args, **kwargs):  # a `sync` event: ranks' k-th collectives are one point of the run
        if TRACE is not None:
            if TRACE.on_collective is not None:
                TRACE.on_collective()
            TRACE.add("sync", op=name)
        return real(*args, **kwargs)
    return collective


def install(trace: Trace) -> None:
    """Route F.cross_entropy, F.embedding, stdout and torch.distributed's collectives through `trace` (for the
    rest of the process)."""
    import torch.distributed as dist

    global TRACE
    TRACE = trace
    _REAL.setdefault("cross_entropy", F.cross_entropy)
    _REAL.setdefault("embedding", F.embedding)
    F.cross_entropy, F.embedding = traced_cross_entropy, traced_embedding
    torch.nn.functional.cross_entropy = traced_cross_entropy
    for name in COLLECTIVES:
        if hasattr(dist, name):
            setattr(dist, name, _traced_collective(name, getattr(dist, name)))
    sys.stdout = LineEvents(sys.stdout, trace)
