"""kit/bundle_posonly.py: the parameters no call can name become positional-only (python-minifier renames them)."""

import ast

from kit.bundle_posonly import make_positional_only

SOURCE = '''
import dataclasses, functools


@dataclasses.dataclass
class Row:
    width: int = 1


def area(height, width, scale=1.0):
    return height * width * scale


def volume(depth, height, width):
    return depth * area(height, width=width)


def labelled(name, value):
    return {"name": name, "value": value}


@functools.lru_cache
def cached(size):
    return size


def callback(item, extra):
    return item + extra


class Box:
    def __init__(self, side, lid=False):
        self.side, self.lid = side, lid

    def forward(self, x):
        return x

    def grow(self, by, factor=2):
        return Box(self.side * factor + by)


def run(fn, *args):
    return fn(*args, extra=1)


def main():
    box = Box(2, lid=True).grow(1)
    return volume(2, 3, 4), labelled("a", 1), cached(3), run(callback, 5), box.side, Row().width
'''


def _params(source: str) -> dict:
    """{qualname: (positional-only names, other positional names)} of every def."""
    out = {}
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ClassDef):
            for f in node.body:
                if isinstance(f, ast.FunctionDef):
                    out[f"{node.name}.{f.name}"] = ([a.arg for a in f.args.posonlyargs], [a.arg for a in f.args.args])
        elif isinstance(node, ast.FunctionDef) and f"Box.{node.name}" not in out:
            out.setdefault(node.name, ([a.arg for a in node.args.posonlyargs], [a.arg for a in node.args.args]))
    return out


def test_only_parameters_no_call_can_name_become_positional_only():
    new, done = make_positional_only(SOURCE)
    p = _params(new)
    assert p["area"] == (["height"], ["width", "scale"])  # `width=` is passed to area by keyword
    assert p["volume"] == (["depth", "height"], ["width"])  # a dataclass field's name stays a keyword
    assert p["labelled"] == ([], ["name", "value"])  # a string spells "name": a ** dict could carry it
    assert p["cached"] == ([], ["size"]) and p["callback"] == ([], ["item", "extra"])  # decorated; passed as a value
    assert p["Box.__init__"] == (["self", "side"], ["lid"]) and p["Box.forward"] == ([], ["self", "x"])
    assert p["Box.grow"] == (["self", "by", "factor"], []) and "Box.grow(3)" in done
    scope_old, scope_new = {}, {}
    exec(compile(SOURCE, "old", "exec"), scope_old)  # noqa: S102 (the test's own source)
    exec(compile(new, "new", "exec"), scope_new)  # noqa: S102
    assert scope_old["main"]() == scope_new["main"]() == (24, {"name": "a", "value": 1}, 3, 6, 5, 1)
    assert make_positional_only("def f(a):\n    return a\n\nf(a=1)\n") == ("def f(a):\n    return a\n\nf(a=1)\n", [])
