"""The bundler packs what a run's settings reach (kit/bundle_when.py): PACKED_WHEN declarations, the
modules they leave out, the refusal a packed file carries for them, and its header."""

import ast
import dataclasses
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kit import bundle
from kit.bundle import BundleError
from kit.bundle_when import (PackSettings, condition_holds, condition_names, pack_settings, refusal_source,
                             settings_from)
from primitives.settings import Hyperparameters
from quant.policy import QuantPolicy

REPO = Path(__file__).resolve().parents[1]

TREE = {
    "quant/__init__.py": "",
    "quant/base.py": '"""Always needed."""\n\n\ndef base_value():\n    return 3\n',
    "quant/extra.py": ('"""Needed only with QUANT_LQER."""\n\nfrom quant.base import base_value\n\n'
                       'PACKED_WHEN = "QUANT_LQER"\n\n\ndef extra_value():\n    return base_value() + 1\n'),
    "quant/deep.py": '"""Reached only through quant/extra.py."""\n\n\ndef deep_value():\n    return 5\n',
    "trainer/__init__.py": "",
    "trainer/context.py": 'BUNDLE_KIND = "package"\nBUNDLE_REFUSALS = ()\n',
    "train_gpt.py": ('"""Entry."""\n\nfrom quant.base import base_value\nfrom quant.extra import extra_value\n'
                     "from trainer.context import BUNDLE_KIND, BUNDLE_REFUSALS\n\n\ndef main():\n"
                     "    return extra_value() if BUNDLE_KIND == 'x' else base_value()\n"),
}


def write(root: Path, files: dict) -> Path:
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text, encoding="utf-8")
    return root


def settings(**env) -> PackSettings:
    return pack_settings({"RUN_ID": "x", **env})


def test_settings_name_each_field_by_its_env_name_and_owner():
    s = settings(PRESET="smoke", QUANT_LQER="1")
    assert s.preset == "smoke" and s.values["QUANT_LQER"] is True and s.values["TTT_ENABLED"] is False
    assert s.field("QUANT_LQER") == "q.lqer" and s.field("TTT_MODE") == "h.ttt_mode"
    assert s.field("QUANT_ESTIMATE_SCALE") == "h.quant_estimate_scale"  # a Hyperparameters field, not the policy's
    again = settings_from(dataclasses.asdict(Hyperparameters.from_env({"RUN_ID": "x", "PRESET": "smoke"})),
                          dataclasses.asdict(QuantPolicy.from_env({"QUANT_LQER": "1"})))
    assert again == s


def test_conditions_read_settings_and_refuse_other_forms():
    s = settings(TTT_ENABLED="1", TTT_MODE="lora")
    assert condition_holds("TTT_ENABLED and TTT_MODE == 'lora'", s)
    assert not condition_holds("TTT_ENABLED and TTT_MODE in ('phased', 'chunked')", s)
    assert condition_names("TTT_ENABLED and TTT_MODE == 'lora' or not TTT_ENABLED") == ["TTT_ENABLED", "TTT_MODE"]
    for bad, why in (("__import__('os')", "Call is not allowed"), ("ttt_enabled", "not a setting's environment name"),
                     ("TTT_ENABLED and", "not an expression"), ("TTT_MODE.upper()", "not allowed")):
        with pytest.raises(BundleError, match=why):
            condition_names(bad, "x.py:1")
    with pytest.raises(BundleError, match="NO_SUCH_SETTING is not a setting"):
        condition_holds("NO_SUCH_SETTING", s, "x.py")


def test_refusal_source_probes_each_condition_over_the_settings_and_names_their_values(monkeypatch):
    import trainer.context as context

    line = refusal_source({"TTT_ENABLED and TTT_MODE == 'lora'": ["eval/b.py", "eval/a.py"], "QUANT_LQER": ["q.py"]},
                          settings())
    assert line == ("BUNDLE_REFUSALS = (('q.py',lambda h,q:q.lqer),('eval/a.py eval/b.py',lambda h,q:h.ttt_enabled "
                    "and h.ttt_mode == 'lora'),)")
    scope = {}
    exec(line, scope)  # noqa: S102 (the generated line)
    monkeypatch.setattr(context, "BUNDLE_REFUSALS", scope["BUNDLE_REFUSALS"])
    context.check_packed_for(Hyperparameters.from_env({"RUN_ID": "x", "TTT_ENABLED": "1", "TTT_MODE": "chunked"}))
    with pytest.raises(ValueError, match=r"^TTT_ENABLED=True TTT_MODE=lora: this train_gpt.py was packed without "
                                         r"eval/a.py eval/b.py; pack one"):
        context.check_packed_for(Hyperparameters.from_env({"RUN_ID": "x", "TTT_ENABLED": "1", "TTT_MODE": "lora"}))
    from quant.policy import QuantPolicy  # the message names a probe's attribute by the class that has it

    assert not {f.name for f in dataclasses.fields(Hyperparameters)} & {f.name for f in dataclasses.fields(QuantPolicy)}
    monkeypatch.setenv("QUANT_LQER", "1")  # a QuantPolicy setting, read as the run reads it
    with pytest.raises(ValueError, match=r"^QUANT_LQER=True: this train_gpt.py was packed without q.py"):
        context.check_packed_for(Hyperparameters.from_env({"RUN_ID": "x"}))


def test_a_module_off_for_the_settings_is_left_out_with_what_only_it_reaches(tmp_path):
    root = write(tmp_path / "src", {**TREE, "quant/extra.py": TREE["quant/extra.py"] + (
        "\n\ndef deeper():\n    from quant.deep import deep_value\n    return deep_value()\n")})
    parts, info = bundle.build_human_parts(root, settings())
    assert sorted(info["modules"]) == ["quant/base.py", "train_gpt.py", "trainer/context.py"]
    assert info["off"] == {"QUANT_LQER": ["quant/extra.py"]} and "quant/deep.py" in info["left_out"]
    assert info["packed_for"] == "packed for PRESET=1xh100-sp8192"  # QUANT_LQER=False is the preset's own
    apart = bundle.build_human_parts(root, settings(QUANT_LQER="0", PRESET="smoke"))[1]["packed_for"]
    assert apart == "packed for PRESET=smoke"
    human = "".join(text for _, text in parts)
    assert "PACKED_WHEN" not in human and "BUNDLE_REFUSALS = (('quant/extra.py',lambda h,q:q.lqer)," in human
    on = bundle.build_human_parts(root, settings(QUANT_LQER="1"))[1]
    assert "quant/extra.py" in on["modules"] and on["off"] == {} and on["packed_for"] == ""
    every = bundle.build_human_parts(root)[1]  # no settings: every module, nothing refused
    assert every["modules"] == on["modules"] and "PACKED_WHEN" not in "".join(t for _, t in bundle.build_human_parts(root)[0])


def test_a_left_out_name_used_at_import_time_or_a_bad_declaration_is_refused(tmp_path):
    root = write(tmp_path / "a", {**TREE, "quant/base.py": TREE["quant/base.py"]})
    write(root, {"train_gpt.py": TREE["train_gpt.py"] + "\nDEFAULT = extra_value\n"})
    with pytest.raises(BundleError, match=r"train_gpt.py:\d+: 'extra_value' of quant/extra.py is used at import time"):
        bundle.build_human_parts(root, settings())
    assert bundle.build_human_parts(root, settings(QUANT_LQER="1"))  # included: fine
    write(root, {"train_gpt.py": TREE["train_gpt.py"], "quant/extra.py": TREE["quant/extra.py"].replace(
        '"QUANT_LQER"', '"QUANT_LQER or NO_SUCH"')})
    with pytest.raises(BundleError, match="quant/extra.py: PACKED_WHEN = .*NO_SUCH is not a setting"):
        bundle.build_human_parts(root, settings())
    write(root, {"quant/extra.py": TREE["quant/extra.py"].replace('"QUANT_LQER"', "1")})
    with pytest.raises(BundleError, match=r"quant/extra.py:\d+: expected one `PACKED_WHEN = \"<condition>\"`"):
        bundle.build_human_parts(root, settings())


def test_package_only_blocks_fold_to_their_else_and_what_nothing_calls_is_dropped(tmp_path):
    from kit.bundle_fold import fold_package_only

    src = ("def f(x):\n    if BUNDLE_KIND == \"package\":\n        from kit.extra import helper\n        return helper(x)\n"
           "    else:\n        y = [x,\n             2]\n        return y\n\n\nif BUNDLE_KIND == \"package\":\n    import os\n")
    assert fold_package_only(src) == "def f(x):\n    y = [x,\n         2]\n    return y\n\n\n"
    assert fold_package_only("for a in b:\n    if BUNDLE_KIND == 'package':\n        c()\n") == "for a in b:\n    pass\n"
    with pytest.raises(ValueError, match="x.py:3: `elif` after"):
        fold_package_only("if BUNDLE_KIND == 'package':\n    a = 1\nelif a:\n    a = 2\n", "x.py")
    tree = {**TREE, "quant/base.py": TREE["quant/base.py"] + (
        "\n\ndef kit_only():\n    from quant.deep import deep_value\n    return deep_value() + only_here()\n\n\n"
        "def only_here():\n    return 2\n\n\ndef base_twice():\n    if BUNDLE_KIND == 'package':\n"
        "        return kit_only()\n    return 2 * base_value()\n"),
        "train_gpt.py": TREE["train_gpt.py"] + "\n\nprint(base_twice())\n"}
    root = write(tmp_path / "src", tree)
    parts, info = bundle.build_human_parts(root, settings())
    human = "".join(text for _, text in parts)
    assert info["unused"] == ["deep_value", "kit_only", "only_here"]  # quant/deep.py: reached, then empty
    assert "def base_twice():\n    return 2 * base_value()" in human and "def kit_only" not in human
    assert "called by nothing in this file: deep_value, kit_only, only_here" in human


def test_constants_nothing_reads_are_dropped_and_those_built_by_a_call_or_rebound_stay():
    from kit.bundle_fold import drop_definitions, unused_definitions

    texts = ["A = 1\nB = (A, 2)  # only B reads A\nC = {'k': [3]}\nD = dict(x=1)\nE = 1\nE = 2\n"
             "F = 5\n\n\ndef g():\n    global F\n    F = 6\n",
             "KEEP = 0\nprint(C, g)\n"]
    dead = unused_definitions(texts, keep=("KEEP",))
    assert dead == {"A", "B"}  # C read; D a call; E bound twice; F named by `global` in g
    assert unused_definitions(texts[:1]) == {"A", "B", "C", "F", "g"}  # g unread: F's `global` goes with it
    assert drop_definitions(texts[0], dead).startswith("C = {'k': [3]}\nD = dict(x=1)\n")


def test_a_file_packed_for_a_preset_keeps_its_default_and_smoke_rows_and_refuses_the_others():
    from kit.bundle_fold import keep_presets

    text = ('DEFAULT_PRESET = "a"\nPRESETS = {\n    "a": {},\n    "b": {"x": 1,\n          "y": 2},  # b\n'
            '    "c": {"x": 3},\n    "smoke": {},\n}\nPRESET_QUANT = {"b": {"Q": "1"}, "c": {"Q": "2"}}\n')
    assert keep_presets(text, "c") == ('DEFAULT_PRESET = "a"\nPRESETS = {\n    "a": {},\n    "c": {"x": 3},\n'
                                       '    "smoke": {},\n}\nPRESET_QUANT = {\'c\': {\'Q\': \'2\'}}\n')
    parts = dict(bundle.build_human_parts(REPO, settings(PRESET="1xh100-frontier"))[0])
    presets = parts["primitives/presets.py"]
    assert '"1xh100-frontier": {' in presets and '"smoke": {' in presets and '"8xh100": {' not in presets
    assert '"1xh100-sp8192": {}' in presets  # the default preset: a run without PRESET


def test_the_settings_domains_and_help_stay_in_the_package_and_their_defaults_in_the_file():
    from kit.bundle_fold import drop_package_arguments

    text = ('x: float = setting(0.7, 0, 1, units="a fraction", applies=(\n    "N > 0", lambda hp: hp.n > 0))\n'
            'y: int = setting(3, applies=ON)  # note\nz = other(1, units="kept")\nw: str = setting("a")\n')
    assert drop_package_arguments(text) == ('x: float = 0.7\ny: int = 3  # note\n'
                                            'z = other(1, units="kept")\nw: str = "a"\n')
    human = bundle.build_human_source(REPO, settings())
    fields = human.split("class Hyperparameters")[1].split("def from_env")[0]
    assert "warmdown_frac: float = 0.2\n" in fields and "setting(" not in fields and "units=" not in fields and "choices=" not in fields


def test_methods_nothing_names_are_dropped_but_the_ones_frameworks_call():
    from kit.bundle_fold import drop_methods, unused_methods

    cls = ("class A:\n    def f(self):\n        return self.g()\n\n    def g(self):\n        return 1\n\n"
           "    def h(self):\n        return 2\n\n    def forward(self):\n        return 3\n\n"
           "    def _hook(self):\n        pass\n\n    @property\n    def p(self):\n        return 4\n")
    assert unused_methods([cls, "print(A().h(), getattr(A(), 'x'))\n"]) == {"A.f", "A.g"}  # g: only the dead f calls it
    dead = unused_methods([cls, "print(A())\n"])
    assert dead == {"A.f", "A.g", "A.h"}
    assert drop_methods(cls, dead) == ("class A:\n\n\n\n    def forward(self):\n        return 3\n\n"
                                       "    def _hook(self):\n        pass\n\n    @property\n    def p(self):\n"
                                       "        return 4\n")


def test_packed_header_names_the_settings_and_the_file_still_unpacks(tmp_path):
    root = write(tmp_path / "src", TREE)
    for enc in bundle.BUNDLE_ENCODINGS:
        packed = bundle.build_packed_bytes(root, enc, settings())
        lines = packed.split(b"\n")
        header = lines[1] if enc == "latin1" else lines[0]
        assert header == b"#packed for PRESET=1xh100-sp8192", enc
        assert bundle.packed_encoding(packed) == enc and "extra_value" not in bundle.unpack_packed(packed).split("def")[0]
    assert not bundle.build_packed_bytes(root, "base93").startswith(b"#")  # every module: no header


def test_grouped_id_is_the_artifact_decoders_id_after_the_compressors():
    from quant.grouped import GROUPED_ID
    from quant.policy import QUANT_COMPRESSORS

    assert GROUPED_ID == len(QUANT_COMPRESSORS) + 1  # quant/artifact.py decodes it without importing quant/grouped.py


def test_real_package_default_leaves_out_the_off_techniques_and_every_module_is_in_without_settings():
    on = bundle.build_human_parts(REPO)[1]
    default = bundle.build_human_parts(REPO, settings())[1]
    off = {r for rs in default["off"].values() for r in rs}
    assert {"quant/lqer.py", "quant/sdclip.py", "quant/grouped.py"} <= off
    assert off.isdisjoint(default["modules"]) and off <= set(on["modules"]) and on["off"] == {}
    assert default["packed_for"] == "packed for PRESET=1xh100-sp8192"  # every refused setting is the preset's
    apart = bundle.build_human_parts(REPO, settings(LOSS_KERNEL="torch", QUANT_SDCLIP="0"))[1]["packed_for"]
    assert apart == "packed for PRESET=1xh100-sp8192 LOSS_KERNEL=torch"  # only what differs from the preset


@pytest.fixture(scope="module")
def packed_default(tmp_path_factory):
    out = tmp_path_factory.mktemp("record")
    bundle.write_bundle(out, REPO, "ascii", settings())
    return out


@pytest.mark.parametrize("env, named", [({"QUANT_LQER": "1"}, "QUANT_LQER=True"),
                                        ({"QUANT_GROUPED": "1", "QUANT_SDCLIP": "1"}, "QUANT_GROUPED=True")])
def test_a_packed_file_refuses_a_setting_it_left_out_in_one_line_before_anything_runs(packed_default, tmp_path, env,
                                                                                      named):
    runs = tmp_path / "runs"
    proc = subprocess.run([sys.executable, "train_gpt.py"], cwd=packed_default, capture_output=True, text=True,
                          timeout=120, env={**{k: v for k, v in os.environ.items() if k != "PYTHONPATH"}, **env,
                                            "OUT_DIR": str(runs), "RUN_ID": "refused", "PRESET": "smoke"})
    assert proc.returncode == 2 and proc.stdout == ""
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: {named}: this train_gpt.py was packed without quant/")
    assert not runs.exists()  # nothing written: refused before the run folder, the data or the model
    tree = ast.parse((packed_default / "train_gpt.py").read_text())  # plain ASCII text with its header
    assert tree.body and (packed_default / "train_gpt.py").read_text().startswith("#packed for PRESET=1xh100-sp8192\n")


def _frontier_switches() -> dict:
    """The 1xh100-frontier preset's switches as variables (its schedule values stay the smoke preset's)."""
    from primitives.presets import PRESETS

    switches = {k.upper(): str(int(v) if isinstance(v, bool) else v) for k, v in PRESETS["1xh100-frontier"].items()
                if k != "muon_momentum"}
    # chunks within TRAIN_SEQ_LEN 64; one epoch over the first 1,024 val tokens keeps the CPU run short
    return {**switches, "TTT_LORA_CHUNK_TOKENS": "32", "TTT_LORA_BATCH_DOCS": "4", "TTT_EPOCHS": "1",
            "VAL_MAX_TOKENS": "1024", "VAL_BATCH_SIZE": "1024"}


@pytest.mark.slow
@pytest.mark.parametrize("pack_env, run_extra", [({}, {}), ({"PRESET": "1xh100-frontier"}, "frontier")],
                         ids=["default", "frontier"])
def test_a_file_packed_for_a_preset_scores_as_the_package_from_a_copied_record_folder(
        tiny_dataset, sp1024_model, tmp_path, pack_env, run_extra):
    """The file packed for the default (or the frontier) preset, copied with its folder as a record's is and run
    there without the package on the smoke preset's CPU settings: the same losses, artifact bytes and score as
    the package on the same settings (bit for bit on one platform)."""
    import shutil

    from tests.test_train import read_result, run_trainer, trainer_env

    extra = _frontier_switches() if run_extra == "frontier" else {}
    built = tmp_path / "built"
    bundle.write_bundle(built, REPO, "ascii", settings(**pack_env))
    folder = shutil.copytree(built, tmp_path / "copy" / "record")
    env = trainer_env(tiny_dataset, sp1024_model, tmp_path / "packed", RUN_ID="r", ITERATIONS=3, **extra)
    env.pop("PYTHONPATH")
    proc = subprocess.run([sys.executable, "train_gpt.py"], cwd=folder, env=env, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    run_trainer(trainer_env(tiny_dataset, sp1024_model, tmp_path / "pkg", RUN_ID="r", ITERATIONS=3, **extra),
                timeout=600)
    packed, package = read_result(tmp_path / "packed", "r"), read_result(tmp_path / "pkg", "r")
    assert packed["bytes_code"] == (folder / "train_gpt.py").stat().st_size
    score = "ttt" if run_extra == "frontier" else "sliding"
    assert f"val_bpb_{score}" in package and len(packed["train_losses"]) == 3
    for key in ("train_losses", "bytes_model", f"val_loss_{score}", f"val_bpb_{score}", "val_bpb_roundtrip"):
        assert packed[key] == package[key], key
