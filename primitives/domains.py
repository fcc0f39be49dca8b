"""Setting domains: every field of `Hyperparameters` is declared with `setting(default, ...)`, which
records its domain (range, choices, units) and when it has an effect, next to the field itself.

`domain_violations(hp)` lists every value outside its field's domain (type, finiteness, range, choices,
non-empty text); `inert_settings(hp, given)` the explicitly set settings whose effect never happens in
the run (one WARNING line each). Relations between settings (softcap vs nothing, a loop start inside
the run, ...) are `Hyperparameters.validate`'s. Primitives layer: standard library only.
"""

import dataclasses
import math

from primitives.env import BUNDLE_KIND


# A setting's domain is the kit's preflight (docs/reliability.md): a record's file reads the values only, and
# leaves the class out (the bundle keeps every decorated class it carries).
if BUNDLE_KIND == "package":
    @dataclasses.dataclass(frozen=True)
    class Domain:
        """A setting's values: numbers finite within [low, high] (an open end with low_open/high_open),
        text among `choices` or non-empty; `units` for the message; `applies` = (condition text,
        predicate(hp) -> bool): the setting has an effect only when the predicate holds."""

        low: float = None
        high: float = None
        low_open: bool = False
        high_open: bool = False
        choices: tuple = ()
        nonempty: bool = False
        units: str = ""
        applies: tuple = ()

        def expected(self, kind: type) -> str:
            """The domain in words, e.g. "a number in [0, 1) (a fraction)"."""
            if self.choices:
                return "one of " + ", ".join(map(str, self.choices))
            if kind is bool:
                return "0/1/true/false"
            if kind is str:
                return "a non-empty path" if self.nonempty else "text"
            what = "a whole number" if kind is int else "a finite number"
            low, high = (str(x) if kind is int or x is None else f"{x:g}" for x in (self.low, self.high))
            if self.low is not None and self.high is not None:
                what += f" in {'(' if self.low_open else '['}{low}, {high}{')' if self.high_open else ']'}"
            elif self.low is not None:
                what += f" {'>' if self.low_open else '>='} {low}"
            elif self.high is not None:
                what += f" {'<' if self.high_open else '<='} {high}"
            return what + (f" ({self.units})" if self.units else "")

        def contains(self, value, kind: type) -> bool:
            """Whether `value` (of the field's type `kind`) lies in the domain."""
            if kind is bool or kind is str:
                ok = type(value) is kind and (not self.nonempty or bool(value.strip()))
            else:
                ok = (type(value) is kind or kind is float and type(value) is int) and math.isfinite(value)
                ok = ok and (self.low is None or (value > self.low if self.low_open else value >= self.low))
                ok = ok and (self.high is None or (value < self.high if self.high_open else value <= self.high))
            return ok and (not self.choices or value in self.choices)


def setting(default, low=None, high=None, *, low_open=False, high_open=False, choices=(), nonempty=False, units="",
            applies=()):
    """A dataclass field with its domain: `x: float = setting(0.2, 0, 1, units="a fraction of the run")`.
    Numbers are finite; `low`/`high` are inclusive unless `low_open`/`high_open`. `applies`:
    (condition text, predicate(hp) -> bool), when the setting has an effect at all."""
    if BUNDLE_KIND == "package":  # the domain is the kit's preflight: a record's file reads the value only
        domain = Domain(low, high, low_open, high_open, tuple(choices), nonempty, units, tuple(applies))
        return dataclasses.field(default=default, metadata={"domain": domain})
    return dataclasses.field(default=default)


def field_domain(field: dataclasses.Field) -> Domain:
    """The domain `setting` declared for `field`; KeyError for a field declared without one."""
    return field.metadata["domain"]


def domain_violations(obj) -> dict:
    """{field name: "NAME=value: expected ..."} for every field of the dataclass `obj` outside its domain."""
    found = {}
    for f in dataclasses.fields(obj):
        domain, value = field_domain(f), getattr(obj, f.name)
        if not domain.contains(value, f.type):
            found[f.name] = f"{f.name.upper()}={value!r}: expected {domain.expected(f.type)}"
    return found


def inert_settings(obj, given) -> list:
    """`WARNING:` lines, one per setting named in `given` (field names set explicitly) whose effect
    never happens with the values of `obj` (its domain's `applies` predicate is false)."""
    lines = []
    for f in dataclasses.fields(obj):
        applies = field_domain(f).applies
        if f.name in given and applies and not applies[1](obj):
            lines.append(f"WARNING: {f.name.upper()}={getattr(obj, f.name)!r} has no effect in this run: it applies only "
                         f"when {applies[0]}")
    return lines


class FieldReads:
    """A read-only view of `obj` that records the names of the attributes read through it."""

    def __init__(self, obj):
        self.obj, self.names = obj, set()

    def __getattr__(self, name):
        self.names.add(name)
        return getattr(self.obj, name)


def relation_holds(obj, predicate, malformed) -> bool:
    """predicate(view of `obj`), or True when it reads a field named in `malformed` (already reported
    out of its domain: a relation on it would only repeat that) or cannot be computed from them."""
    view = FieldReads(obj)
    try:
        holds = predicate(view)
    except (ArithmeticError, TypeError, ValueError, AttributeError):  # a malformed field: its domain says so
        return True
    return bool(holds) or bool(view.names & set(malformed))
