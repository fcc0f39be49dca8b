"""When a bundled module is needed: the `PACKED_WHEN` declaration of an optional module, read by the
bundler (tools/bundle.py) to pack only what a run's settings reach.

An optional module says, next to its code, which settings need it, as a module-level string: a Python
expression over the settings' environment names (the `Hyperparameters` fields upper-cased, the
`QuantPolicy` fields as QUANT_<FIELD>), literals, `and` / `or` / `not`, comparisons and `in`:

    PACKED_WHEN = "TTT_ENABLED and TTT_MODE == 'lora'"

Packed for settings (`pack_settings`), a module whose condition is false is left out, and so is every
module only it reaches; the declaration line itself is never bundled. The packed file carries one
refusal per left-out condition (`refusal_source`): run with settings that make it true, it exits with
one line naming the settings before anything runs. A module without a declaration is needed whenever
an included module imports it. Packed without settings (`--all`), every module is in and nothing is
refused.
"""

from __future__ import annotations

import ast
import dataclasses

from kit.bundle_modules import PACKED_WHEN_NAME, BundleError, SourceModule
# the expression forms a condition may use: settings, literals, boolean logic, comparisons
_ALLOWED_NODES = (ast.Expression, ast.BoolOp, ast.And, ast.Or, ast.UnaryOp, ast.Not, ast.Compare, ast.Eq, ast.NotEq,
                  ast.Lt, ast.LtE, ast.Gt, ast.GtE, ast.In, ast.NotIn, ast.Name, ast.Load, ast.Constant, ast.Tuple)


@dataclasses.dataclass(frozen=True)
class PackSettings:
    """A run's resolved settings as the bundler reads them: `values` {env name: value} and `owner`
    {env name: "h" (Hyperparameters) or "q" (QuantPolicy)}; `preset` names the preset they came from."""

    values: dict
    owner: dict
    preset: str

    def field(self, name: str) -> str:
        """"h.ttt_enabled" / "q.lqer": how the packed file reads setting `name`."""
        owner = self.owner[name]
        return f"{owner}.{name.lower() if owner == 'h' else name[len('QUANT_'):].lower()}"


def pack_settings(environ=None) -> PackSettings:
    """The settings a run with `environ` (default os.environ) resolves: PRESET and every variable, as the
    trainer reads them (Hyperparameters.from_env, QuantPolicy.from_env; their ValueError for a bad value)."""
    import os

    from primitives.settings import Hyperparameters
    from quant.policy import QuantPolicy

    environ = dict(os.environ if environ is None else environ)
    environ.setdefault("RUN_ID", "bundle")  # no fresh random id: the settings name no run
    hp = Hyperparameters.from_env(environ, log=lambda *_: None)
    quant = QuantPolicy.from_env(environ, log=lambda *_: None)
    return settings_from(dataclasses.asdict(hp), dataclasses.asdict(quant))


def settings_from(hyperparameters: dict, quant_policy: dict) -> PackSettings:
    """PackSettings from the dicts a run's result.json records (`hyperparameters`, `quant_policy`)."""
    values, owner = {}, {}
    for name, value in quant_policy.items():
        values[f"QUANT_{name.upper()}"], owner[f"QUANT_{name.upper()}"] = value, "q"
    for name, value in hyperparameters.items():  # QUANT_ESTIMATE_SCALE is a Hyperparameters field
        values[name.upper()], owner[name.upper()] = value, "h"
    return PackSettings(values, owner, str(hyperparameters.get("preset", "")))


def settings_from_result(result: dict) -> PackSettings:
    """PackSettings of a finished run from its result.json: its `hyperparameters` and `quant_policy`
    (quant_policy holds only the fields that differ from their defaults: the rest are QuantPolicy's;
    a field newer than the run is its class default)."""
    from primitives.settings import Hyperparameters
    from quant.policy import QuantPolicy

    hp = {f.name: f.default for f in dataclasses.fields(Hyperparameters)}
    return settings_from({**hp, **(result.get("hyperparameters") or {})},
                         {**dataclasses.asdict(QuantPolicy()), **(result.get("quant_policy") or {})})


def packed_when(tree: ast.Module, relpath: str) -> str | None:
    """The module's PACKED_WHEN expression (str), or None when it declares none (always needed).
    BundleError for a declaration that is not one string of the allowed expression forms."""
    found = None
    for node in tree.body:
        targets = node.targets if isinstance(node, ast.Assign) else []
        if not any(isinstance(t, ast.Name) and t.id == PACKED_WHEN_NAME for t in targets):
            continue
        if found is not None or len(targets) != 1 or not (isinstance(node.value, ast.Constant)
                                                          and isinstance(node.value.value, str)):
            raise BundleError(f"{relpath}:{node.lineno}: expected one `{PACKED_WHEN_NAME} = \"<condition>\"` "
                              f"(a string) at module level")
        found = node.value.value
        condition_names(found, f"{relpath}:{node.lineno}")
    return found


def needed_for(settings: PackSettings | None):
    """The discovery's keep rule: None (every module) without settings, else module -> its condition holds."""
    if settings is None:
        return None

    def needed(module: SourceModule) -> bool:
        condition = packed_when(module.tree, module.relpath)
        return condition is None or condition_holds(condition, settings, module.relpath)

    return needed


def is_packed_when(node) -> bool:
    """The statement is a PACKED_WHEN declaration (the bundler drops it from both files)."""
    return (isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name)
            and node.targets[0].id == PACKED_WHEN_NAME)


def condition_names(condition: str, where: str = "") -> list:
    """The setting names a condition reads, in order of first use; BundleError for a syntax error, a
    form outside the allowed ones or a name that is not an UPPER_CASE setting name."""
    try:
        tree = ast.parse(condition, mode="eval")
    except SyntaxError as e:
        raise BundleError(f"{where}: {PACKED_WHEN_NAME} = {condition!r}: not an expression ({e.msg})") from e
    names = []
    for node in ast.walk(tree):
        if not isinstance(node, _ALLOWED_NODES):
            raise BundleError(f"{where}: {PACKED_WHEN_NAME} = {condition!r}: {type(node).__name__} is not allowed "
                              f"(settings, literals, and/or/not, comparisons, in)")
        if isinstance(node, ast.Name):
            if not node.id.isupper():
                raise BundleError(f"{where}: {PACKED_WHEN_NAME} = {condition!r}: {node.id!r} is not a setting's "
                                  f"environment name (UPPER_CASE)")
            if node.id not in names:
                names.append(node.id)
    return names


def condition_holds(condition: str, settings: PackSettings, where: str = "") -> bool:
    """The condition's truth for these settings; BundleError naming a setting that does not exist."""
    names = condition_names(condition, where)
    unknown = [n for n in names if n not in settings.values]
    if unknown:
        raise BundleError(f"{where}: {PACKED_WHEN_NAME} = {condition!r}: {', '.join(unknown)} is not a setting "
                          f"(Hyperparameters or QuantPolicy)")
    code = compile(ast.parse(condition, mode="eval"), where or PACKED_WHEN_NAME, "eval")
    return bool(eval(code, {"__builtins__": {}}, {n: settings.values[n] for n in names}))  # noqa: S307 (checked forms)


class _ToFields(ast.NodeTransformer):
    def __init__(self, settings: PackSettings):
        self.settings = settings

    def visit_Name(self, node):
        owner, field = self.settings.field(node.id).split(".")
        return ast.copy_location(ast.Attribute(ast.Name(owner, ast.Load()), field, ast.Load()), node)


def refusal_source(left_out: dict, settings: PackSettings) -> str:
    """The packed file's `BUNDLE_REFUSALS = (...)` line for {condition: [left-out relpaths]}: per
    condition (modules, probe): the modules, and probe(h, q) -> the condition over the run's Hyperparameters h
    and QuantPolicy q (trainer/context.py check_packed_for names the settings from the probe's attribute names)."""
    entries = []
    for condition, relpaths in sorted(left_out.items()):
        body = ast.unparse(_ToFields(settings).visit(ast.parse(condition, mode="eval")).body)
        entries.append(f"({' '.join(sorted(relpaths))!r},lambda h,q:{body})")
    return "BUNDLE_REFUSALS = (" + "".join(e + "," for e in entries) + ")"


def refused_names(left_out: dict) -> list:
    """Every setting name a left-out condition reads, sorted: what the packed file's header lists."""
    return sorted({n for condition in left_out for n in condition_names(condition)})
