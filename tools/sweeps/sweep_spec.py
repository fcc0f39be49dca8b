"""The definition of a sweep for tools/sweep.py: its file (YAML or JSON) and command-line options,
checked and expanded into one SweepRun per configuration x grid point x seed.

A bad definition is a SweepError (a ValueError) naming the option or the file entry; the CLI turns
it into one line and exit 2. `check_trainer_settings` asks the kit's Hyperparameters about each
config before anything starts.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import os
import re
from pathlib import Path

SWEEP_METRICS = ("sliding", "roundtrip", "prequant", "ttt", "final")  # final: final_score_key, per run
SWEEP_RESERVED = ("SEED", "RUN_ID", "OUT_DIR", "CUDA_VISIBLE_DEVICES", "RESUME")  # set by the sweep per run
_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.,=+-]*$")
_ENV_RE = re.compile(r"^[A-Z][A-Z0-9_]*$")


class SweepError(ValueError):
    """A bad sweep definition; the message names the option or file entry."""


@dataclasses.dataclass(frozen=True)
class SweepRun:
    config: str
    seed: int
    settings: dict  # the config's own env vars (without the shared env)
    env: dict  # everything the sweep sets for this run (shared env + config + SEED/RUN_ID/OUT_DIR)
    run_dir: Path


# -----------------------------------------------------------------------------------------------
# the sweep definition
# -----------------------------------------------------------------------------------------------


def parse_assignments(items, where: str) -> dict:
    """["K=V", ...] -> {K: V}; SweepError naming `where` for anything else."""
    out = {}
    for item in items or []:
        key, sep, value = str(item).partition("=")
        if not sep or not _ENV_RE.match(key):
            raise SweepError(f"{where}: {item!r}: expected NAME=VALUE with an upper-case env var name")
        out[key] = value
    return out


def _env_dict(obj, where: str) -> dict:
    if obj is None:
        return {}
    if not isinstance(obj, dict):
        raise SweepError(f"{where}: expected a mapping of env vars, got {type(obj).__name__}")
    out = {}
    for key, value in obj.items():
        if not isinstance(key, str) or not _ENV_RE.match(key):
            raise SweepError(f"{where}: {key!r} is not an upper-case env var name")
        if isinstance(value, (dict, list)) or value is None:
            raise SweepError(f"{where}: {key}={value!r}: expected a number or a string")
        out[key] = str(int(value)) if isinstance(value, bool) else str(value)
    return out


SWEEP_MAX_SEED = 2**64  # torch.manual_seed's range (the trainer's SEED check)


def check_seeds(seeds, where: str) -> list:
    """`seeds` if it is a non-empty list of distinct integers in [0, 2**64); SweepError naming
    `where` (the file and key, or --seeds) otherwise: `seeds: []` or `seeds: 0` never fall back to
    the default seed."""
    if not isinstance(seeds, list) or not seeds:
        raise SweepError(f"{where} {seeds!r}: expected a non-empty list of integer seeds, e.g. [1337, 42]")
    bad = [s for s in seeds if not isinstance(s, int) or isinstance(s, bool) or not 0 <= s < SWEEP_MAX_SEED]
    if bad:
        raise SweepError(f"{where} {seeds!r}: expected a list of integers in [0, 2**64) ({bad[0]!r} is not one)")
    if len(set(seeds)) != len(seeds):
        raise SweepError(f"{where} {seeds!r}: a seed is listed twice; expected each seed once")
    return seeds


def load_spec_file(path) -> dict:
    """A sweep file (.yaml/.yml or .json) as a dict; SweepError naming the file when it is unreadable."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as e:
        raise SweepError(f"--file {path}: {e.strerror or e}") from None
    try:
        spec = _load_yaml_unique(text, path) if path.suffix in (".yaml", ".yml") else json.loads(
            text, object_pairs_hook=lambda pairs: _unique_pairs(pairs, path))
    except SweepError:
        raise
    except Exception as e:  # yaml.YAMLError / json.JSONDecodeError: say where
        mark = getattr(e, "problem_mark", None)
        detail = f"{e.problem} at line {mark.line + 1}, column {mark.column + 1}" if mark else e
        kind = "YAML" if path.suffix in (".yaml", ".yml") else "JSON"
        raise SweepError(f"--file {path}: not valid {kind} ({detail})") from None
    if not isinstance(spec, dict):
        raise SweepError(f"--file {path}: expected a mapping at the top level")
    unknown = set(spec) - {"name", "seeds", "env", "configs", "grid", "metric", "baseline"}
    if unknown:
        raise SweepError(f"--file {path}: unknown keys {sorted(unknown)} (expected name, seeds, env, configs, grid, "
                         "metric, baseline)")
    if "seeds" in spec:
        check_seeds(spec["seeds"], f"--file {path}: seeds")
    return spec


def _unique_pairs(pairs, path, lines=None) -> dict:
    """dict(pairs), or SweepError naming a key that occurs twice (and its lines, when known): YAML and
    JSON loaders keep the last one silently, which would drop a config of the sweep."""
    seen = {}
    for i, (key, _) in enumerate(pairs):
        try:
            hash(key)
        except TypeError:
            raise SweepError(f"--file {path}: key {key!r} is not a name; expected a string key") from None
        if key in seen:
            where = f" (lines {lines[seen[key]]} and {lines[i]})" if lines else ""
            raise SweepError(f"--file {path}: {key!r} is defined twice{where}; expected each name once")
        seen[key] = i
    return dict(pairs)


def _load_yaml_unique(text: str, path):
    """yaml.safe_load that refuses a mapping with a duplicate key (SweepError with both lines)."""
    import yaml

    class UniqueKeyLoader(yaml.SafeLoader):
        pass

    def construct_mapping(loader, node, deep=False):
        if isinstance(node, yaml.MappingNode):
            own = [(k, v) for k, v in node.value if k.tag != "tag:yaml.org,2002:merge"]
            keys = [(loader.construct_object(k, deep=True), None) for k, _ in own]
            _unique_pairs(keys, path, [k.start_mark.line + 1 for k, _ in own])
        return yaml.SafeLoader.construct_mapping(loader, node, deep)

    UniqueKeyLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, construct_mapping)
    return yaml.load(text, Loader=UniqueKeyLoader)


def build_runs(spec: dict, out_root) -> list:
    """Expand a sweep spec (the file's keys) into SweepRuns: configs x grid x seeds, in that order."""
    name = str(spec.get("name") or "")
    if not _NAME_RE.match(name):
        raise SweepError(f"name {name!r}: expected letters, digits and _.,=+- (it becomes a folder name)")
    seeds = check_seeds(spec["seeds"], "seeds") if "seeds" in spec else [1337]
    shared = _env_dict(spec.get("env"), "env")
    configs = spec.get("configs") or {"base": {}}
    if not isinstance(configs, dict):
        raise SweepError("configs: expected a mapping of config name -> env vars")
    grid = spec.get("grid") or {}
    if not isinstance(grid, dict) or not all(isinstance(v, list) and v for v in grid.values()):
        raise SweepError("grid: expected a mapping of env var -> non-empty list of values")
    grid_env = {k: [_env_dict({k: v}, "grid")[k] for v in values] for k, values in grid.items()}
    combos = [dict(zip(grid_env, values)) for values in itertools.product(*grid_env.values())]
    sweep_dir = Path(out_root) / name
    runs, names = [], set()
    for config, own in configs.items():
        own = _env_dict(own, f"configs.{config}")
        for combo in combos:
            label = ",".join([str(config)] * bool(not grid_env or len(configs) > 1 or own)
                             + [f"{k}={v}" for k, v in combo.items()])
            if not _NAME_RE.match(label):
                raise SweepError(f"config {label!r}: expected letters, digits and _.,=+- (it becomes a folder name)")
            if label in names:
                raise SweepError(f"config {label!r} is defined twice")
            names.add(label)
            replaced = sorted(k for k in combo if k in own and own[k] != combo[k])
            if replaced:  # the grid would silently run another value than the config's own
                raise SweepError(f"config {config!r}: sets {', '.join(f'{k}={own[k]}' for k in replaced)}, which the grid "
                                 "varies; expected each variable in the config or in the grid, not both")
            settings = {**own, **combo}
            reserved = sorted(set(SWEEP_RESERVED) & (set(settings) | set(shared)))
            if reserved:
                raise SweepError(f"config {label!r}: {reserved} are set by the sweep for each run")
            for seed in seeds:
                env = {**shared, **settings, "SEED": str(seed), "RUN_ID": f"seed{seed}",
                       "OUT_DIR": str(sweep_dir / label)}
                runs.append(SweepRun(label, seed, settings, env, sweep_dir / label / f"seed{seed}"))
    return runs


def check_trainer_settings(runs: list, environ=None) -> None:
    """Build the kit's Hyperparameters once per config (its seeds differ only in SEED, an integer)
    before anything starts: a value the trainer would refuse, or a name that only looks like one of
    its settings (a typo), is a SweepError naming the config. Hours of sweep lost to MATRIX_LRR are
    worth one import of torch."""
    from primitives.settings import warn_unknown_settings
    from primitives.settings import Hyperparameters

    environ = dict(os.environ if environ is None else environ)
    for run in {run.config: run for run in runs}.values():
        own = {k: v for k, v in run.env.items() if k not in SWEEP_RESERVED}
        unknown = warn_unknown_settings(own, log=lambda msg: None)
        if unknown:
            raise SweepError(f"config {run.config!r}: {unknown} are not settings of train_gpt.py")
        try:
            Hyperparameters.from_env({**environ, **run.env}, log=lambda msg: None)
        except ValueError as e:
            raise SweepError(f"config {run.config!r}: {e}") from None


# -----------------------------------------------------------------------------------------------
# the command line's options, added to the file's keys
# -----------------------------------------------------------------------------------------------


def spec_from_args(args) -> dict:
    spec = load_spec_file(args.file) if args.file else {}
    spec = dict(spec)
    if args.name:
        spec["name"] = args.name
    if args.seeds is not None:
        spec["seeds"] = check_seeds(args.seeds, "--seeds")
    if args.set:
        spec["env"] = {**_env_dict(spec.get("env"), "env"), **parse_assignments(args.set, "--set")}
    if args.config:
        configs = dict(spec.get("configs") or {})
        for name, *items in args.config:
            if name in configs:
                raise SweepError(f"--config {name}: defined twice")
            configs[name] = parse_assignments(items, f"--config {name}")
            key, sep, value = name.partition("=")
            if sep and _ENV_RE.match(key):  # `--config MATRIX_LR=0.02` alone: named by, and running at, that setting
                if configs[name].get(key, value) != value:
                    raise SweepError(f"--config {name}: sets {key}={configs[name][key]}; expected the value its name says")
                configs[name] = {key: value, **configs[name]}
        spec["configs"] = configs
    if args.grid:
        grid = dict(spec.get("grid") or {})
        for key, values in parse_assignments(args.grid, "--grid").items():
            grid[key] = values.split(",")
        spec["grid"] = grid
    for key in ("metric", "baseline"):
        if getattr(args, key):
            spec[key] = getattr(args, key)
    if not spec.get("name"):
        raise SweepError("--name: a sweep needs a name (or `name:` in --file)")
    if spec.get("metric", "sliding") not in SWEEP_METRICS:
        raise SweepError(f"metric {spec['metric']!r}: expected one of {', '.join(SWEEP_METRICS)}")
    return spec

