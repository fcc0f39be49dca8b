"""kit/bundle_pinned.py: the settings a packed file's refusals pin are written into the code, and what becomes
constant is folded, with the same results for every run the refusals let through."""

import ast

import pytest

from kit.bundle_pinned import fold_refused, pinned_settings

SOURCE = '''
import dataclasses


@dataclasses.dataclass(frozen=True)
class Hyperparameters:
    ttt_enabled: bool = False
    muon_form: str = "torch"
    taper: float = 1.0
    loss_kernel: str = "auto"
    num_loops: int = 0
    stride: int = 64


@dataclasses.dataclass(frozen=True)
class QuantPolicy:
    lqer: bool = False
    grouped: bool = False


BUNDLE_REFUSALS = (("eval/ttt.py", lambda h, q: h.ttt_enabled),
                   ("a.py", lambda h, q: h.muon_form != "torch" or q.lqer or h.num_loops > 0),
                   ("b.py", lambda h, q: h.taper != 1 or h.loss_kernel == "liger"),
                   ("c.py", lambda h, q: q.grouped and h.stride > 2))


def plan(h, q):
    if not (h.ttt_enabled and h.stride) or h.stride > 100:
        return ("sliding", h.stride)
    return ("ttt", missing_ttt_planner(h))


def export(h, q):
    jobs = ["zlib"]
    jobs += ["lqer"] if q.lqer else []
    extra = dict(updates=0) if h.ttt_enabled else {}
    kernel = "liger" if h.loss_kernel == "liger" else "torch"
    return jobs, dict(enabled=int(h.ttt_enabled), **extra), kernel, h.muon_form, h.taper * 2, h.num_loops, q.grouped


def check(h, q):
    for modules, probe in BUNDLE_REFUSALS:
        if probe(h, q):
            return modules
'''


def _run(source: str, h_kwargs: dict, q_kwargs: dict, functions=("plan", "export", "check")):
    space = {}
    exec(compile(source, "<test>", "exec"), space)
    h, q = space["Hyperparameters"](**h_kwargs), space["QuantPolicy"](**q_kwargs)
    return [space[f](h, q) for f in functions]


def test_pins_from_the_refusals_atoms():
    assert pinned_settings(SOURCE) == {
        "ttt_enabled": ("is", False), "muon_form": ("is", "torch"), "lqer": ("is", False),
        "taper": ("is", 1.0), "loss_kernel": ("not", "liger")}  # num_loops > 0 and an `and` pin nothing
    assert isinstance(pinned_settings(SOURCE)["taper"][1], float)  # the declared type: 1 -> 1.0
    assert pinned_settings(SOURCE.replace("BUNDLE_REFUSALS = (", "OTHER = (")) == {}


@pytest.mark.parametrize("blocker, unpinned", [
    ("def f(h):\n    h.lqer = True\n", "lqer"),  # an assignment to the attribute
    ("def f(h):\n    return dataclasses.replace(h, muon_form='classic')\n", "muon_form"),
    ("def f():\n    return QuantPolicy(lqer=True)\n", "lqer"),
    ("def f(h):\n    setattr(h, 'ttt_enabled', True)\n", "ttt_enabled"),
    ("class Other:\n    lqer: bool = True\n", "lqer"),  # another class declares the name
])
def test_anything_that_could_change_a_pinned_attribute_unpins_it(blocker, unpinned):
    pins = pinned_settings(SOURCE + "\n\n" + blocker)
    assert unpinned not in pins and len(pins) == 4


@pytest.mark.parametrize("blocker", ["def f(h, d):\n    return dataclasses.replace(h, **d)\n",
                                     "def f(h, n):\n    setattr(h, n, 1)\n"])
def test_a_dynamic_write_pins_nothing(blocker):
    assert pinned_settings(SOURCE + "\n\n" + blocker) == {}
    assert fold_refused(SOURCE + "\n\n" + blocker)[0] == SOURCE + "\n\n" + blocker


def test_folded_code_gives_the_same_results_and_keeps_the_refusals():
    folded, pins = fold_refused(SOURCE)
    assert folded != SOURCE and len(pins) == 5
    tree = ast.parse(folded)
    refusals = next(n for n in tree.body if isinstance(n, ast.Assign) and n.targets[0].id == "BUNDLE_REFUSALS")
    assert ast.unparse(refusals) == ast.unparse(next(n for n in ast.parse(SOURCE).body if isinstance(n, ast.Assign)))
    reads = {n.attr for node in tree.body if node is not refusals for n in ast.walk(node) if isinstance(n, ast.Attribute)}
    assert not reads & {"ttt_enabled", "lqer", "muon_form", "taper"}  # written in, then folded
    assert "missing_ttt_planner" not in folded and "'lqer'" not in folded and "updates" not in folded
    assert "q.grouped" in folded and "h.num_loops" in folded  # not pinned: read as before
    for h, q in [({}, {}), ({"stride": 128}, {}), ({"num_loops": -1, "loss_kernel": "torch"}, {"grouped": True})]:
        assert _run(folded, h, q) == _run(SOURCE, h, q)  # a run the refusals let through
    # what the refusals stop still stops, in the folded file too
    refused = {"ttt_enabled": True}, {"loss_kernel": "liger"}, {"muon_form": "classic"}
    assert [_run(folded, h, {}, ["check"]) for h in refused] == [["eval/ttt.py"], ["b.py"], ["a.py"]]
    assert _run(folded, {}, {"lqer": True}, ["check"]) == _run(SOURCE, {}, {"lqer": True}, ["check"]) == ["a.py"]


def test_statements_after_a_folded_return_go():
    source = SOURCE + '''

def k(q, name):
    if not q.lqer or name:
        return 0.0
    return lookup(name)
'''
    folded = fold_refused(source)[0]
    body = next(n for n in ast.parse(folded).body if isinstance(n, ast.FunctionDef) and n.name == "k").body
    assert ast.unparse(body[0]) == "return 0.0" and len(body) == 1


def test_the_default_packed_source_reads_no_pinned_setting():
    """The default preset's file: every pinned setting's read outside the refusals is folded."""
    from kit.bundle_pack import set_bundle_kind
    from kit.bundle_source import build_human_source
    from kit.bundle_when import pack_settings

    human = set_bundle_kind(build_human_source(settings=pack_settings({})), "packed")
    folded, pins = fold_refused(human)
    assert {"lqer", "grouped", "sdclip", "ttt_enabled", "caseops_enabled", "muon_form"} <= set(pins)
    tree = ast.parse(folded)
    refusals = next(n for n in tree.body if isinstance(n, ast.Assign) and getattr(n.targets[0], "id", "") == "BUNDLE_REFUSALS")
    left = sorted({n.attr for node in tree.body if node is not refusals for n in ast.walk(node)
                   if isinstance(n, ast.Attribute) and pins.get(n.attr, ("",))[0] == "is"})
    assert left == []
    assert len(folded) < len(ast.unparse(ast.parse(human)))


def test_stdlib_imports_nothing_reads_go_and_others_stay():
    """kit/bundle_fold.py drop_unused_imports: a name only the minifier's removed annotations read is unused."""
    from kit.bundle_fold import drop_unused_imports

    source = ("import bisect\nimport json, math as m\nfrom collections.abc import Callable, Iterable\n"
              "import numpy as np\nfrom typing import ClassVar\n\n\n"
              "class Row:\n    size: ClassVar = 1\n\n\n"
              "def f(x: Callable, y: 'Row' = None) -> Iterable:\n    z: int = m.floor(x)\n    return json.dumps(z)\n")
    out = drop_unused_imports(source)
    assert out.splitlines()[:5] == ["", "import json, math as m", "", "import numpy as np", "from typing import ClassVar"]
    assert drop_unused_imports(out) == out and out.splitlines()[5:] == source.splitlines()[5:]


def test_the_files_bundle_kind_is_written_in():
    source = ('BUNDLE_KIND = "packed"\n\n\ndef path(f):\n    return f if BUNDLE_KIND == "packed" else f + ".py"\n\n\n'
              'def check(h):\n    if BUNDLE_KIND != "package" and h:\n        raise ValueError(h)\n')
    folded = fold_refused(source)[0]
    assert "BUNDLE_KIND ==" not in folded and "BUNDLE_KIND !=" not in folded and "BUNDLE_KIND = 'packed'" in folded
    space = {}
    exec(folded, space)
    assert space["path"]("x") == "x" and space["check"](0) is None
    with pytest.raises(ValueError):
        space["check"](1)
    twice = source + "\n\ndef reset():\n    global BUNDLE_KIND\n    BUNDLE_KIND = 'package'\n"
    assert fold_refused(twice)[0] == twice  # bound again: not a constant


def test_a_prefix_of_the_file_keeps_what_a_later_part_calls():
    """The size report minifies prefixes of the file (kit/bundle.py bundle_report): there nothing may be dropped as
    unused, or a module's share would move to the part that calls it."""
    from kit.bundle_pack import minify_source

    prefix = 'import bisect\nBUNDLE_KIND = "packed"\n\n\ndef helper(x):\n    return x + 1 if BUNDLE_KIND == "packed" else x\n'
    assert "bisect" in minify_source(prefix, whole=False) and "+1" in minify_source(prefix, whole=False)
    assert "bisect" not in minify_source(prefix) and "+1" not in minify_source(prefix)  # the whole file: dropped
