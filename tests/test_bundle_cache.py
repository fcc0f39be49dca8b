"""kit/bundle_cache.py: a package run's human source (and its packed size) read back from the cache only while
nothing it depends on has changed: the package's sources, the bundler's code, the settings."""

import os
from pathlib import Path

import pytest

from kit import bundle, bundle_cache
from kit.bundle_modules import BUNDLE_PACKAGES
from kit.bundle_when import pack_settings

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture
def builds(monkeypatch):
    """The human builds the cache asks for (each still the real build)."""
    calls = []
    real = bundle_cache.human_and_header

    def counted(root=None, settings=None):
        calls.append((root, settings))
        return real(root, settings)

    monkeypatch.setattr(bundle_cache, "human_and_header", counted)
    return calls


def test_the_second_run_reads_the_human_source_back_and_it_is_the_build(tmp_path, builds):
    settings = pack_settings({})
    first = bundle_cache.cached_human_and_header(settings, cache_dir=tmp_path)
    assert first == bundle.human_and_header(None, settings) and len(builds) == 1
    assert bundle_cache.cached_human_and_header(settings, cache_dir=tmp_path) == first and len(builds) == 1
    # other settings (another module set) are another entry
    frontier = bundle_cache.cached_human_and_header(pack_settings({"PRESET": "1xh100-frontier"}), cache_dir=tmp_path)
    assert len(builds) == 2 and frontier != first and "eval/ttt.py" in frontier[0]
    assert len(list(tmp_path.glob("human-*.z"))) == 2


def _copy_kit(dst: Path) -> Path:
    """The package's sources (what package_fingerprint reads) copied under dst."""
    for package in BUNDLE_PACKAGES:
        (dst / package).mkdir(parents=True)
        for p in (REPO / package).glob("*.py"):
            (dst / package / p.name).write_text(p.read_text(encoding="utf-8"), encoding="utf-8")
    (dst / "train_gpt.py").write_text((REPO / "train_gpt.py").read_text(encoding="utf-8"), encoding="utf-8")
    return dst


def test_a_changed_source_or_bundler_is_a_new_entry_never_a_stale_one(tmp_path, monkeypatch, builds):
    root = _copy_kit(tmp_path / "src")
    cache = tmp_path / "cache"
    human, _ = bundle_cache.cached_human_and_header(None, cache_dir=cache, root=root)
    bundle_cache.cached_human_and_header(None, cache_dir=cache, root=root)
    assert len(builds) == 1
    policy = root / "quant" / "policy.py"
    policy.write_text(policy.read_text(encoding="utf-8") + "\n# a line added to the source\n", encoding="utf-8")
    changed, _ = bundle_cache.cached_human_and_header(None, cache_dir=cache, root=root)
    assert len(builds) == 2 and "# a line added to the source" in changed and "# a line added" not in human
    # the bundler's own code is part of the key: a copy of kit/ with one file changed
    kit = tmp_path / "kit"
    kit.mkdir()
    for p in bundle_cache.KIT_DIR.glob("bundle*.py"):
        (kit / p.name).write_text(p.read_text(encoding="utf-8"), encoding="utf-8")
    monkeypatch.setattr(bundle_cache, "KIT_DIR", kit)
    bundle_cache.cached_human_and_header(None, cache_dir=cache, root=root)
    assert len(builds) == 2  # the same bundler code: the same key
    (kit / "bundle_pinned.py").write_text((kit / "bundle_pinned.py").read_text(encoding="utf-8") + "\n# changed\n")
    bundle_cache.cached_human_and_header(None, cache_dir=cache, root=root)
    assert len(builds) == 3


def test_a_damaged_or_unwritable_cache_only_costs_the_build(tmp_path, builds, monkeypatch):
    settings = pack_settings({})
    expected = bundle_cache.cached_human_and_header(settings, cache_dir=tmp_path)
    for path in tmp_path.glob("human-*.z"):
        path.write_bytes(path.read_bytes()[:100])  # cut short
    assert bundle_cache.cached_human_and_header(settings, cache_dir=tmp_path) == expected and len(builds) == 2
    blocked = tmp_path / "a_file"
    blocked.write_text("not a folder")
    assert bundle_cache.cached_human_and_header(settings, cache_dir=blocked / "cache") == expected
    assert len(builds) == 3


def test_the_least_recently_used_human_sources_beyond_the_limit_are_removed(tmp_path, monkeypatch):
    monkeypatch.setattr(bundle_cache, "MAX_HUMAN_ENTRIES", 2)
    built = []
    monkeypatch.setattr(bundle_cache, "human_and_header",
                        lambda root, settings: built.append(settings.preset) or (f"source {settings.preset}", ""))
    clock = iter(range(1_000_000, 2_000_000, 10))
    real_utime, real_write = os.utime, bundle_cache._write

    def tick(path, times=None):  # every write and every hit one tick later than the last: a strict order of use
        t = next(clock)
        real_utime(path, (t, t))

    def write(path, entry):
        real_write(path, entry)
        tick(path)

    monkeypatch.setattr(bundle_cache.os, "utime", tick)
    monkeypatch.setattr(bundle_cache, "_write", write)

    def use(preset):
        out = bundle_cache.cached_human_and_header(pack_settings({"PRESET": preset}), cache_dir=tmp_path)
        assert out == (f"source {preset}", "")

    use("smoke")
    use("1xh100-sp8192")
    use("smoke")  # a hit: smoke is now the more recently used
    use("1xh100-frontier")  # the third entry: the least recently used one (1xh100-sp8192) goes
    assert len(list(tmp_path.glob("human-*.z"))) == 2 and built == ["smoke", "1xh100-sp8192", "1xh100-frontier"]
    use("smoke")
    use("1xh100-frontier")
    assert built == ["smoke", "1xh100-sp8192", "1xh100-frontier"]  # both kept: read back, not built
    use("1xh100-sp8192")
    assert built[-1] == "1xh100-sp8192"  # removed: built again


def test_settings_that_decide_no_module_share_an_entry_and_the_entry_is_their_build(tmp_path, builds):
    base = {"RUN_ID": "a", "SEED": "1", "DATA_PATH": "/data/a"}
    first = bundle_cache.cached_human_and_header(pack_settings(base), cache_dir=tmp_path)
    other = pack_settings({"RUN_ID": "b", "SEED": "7", "DATA_PATH": "/data/b", "MATRIX_LR": "0.03"})
    assert bundle_cache.cached_human_and_header(other, cache_dir=tmp_path) == first and len(builds) == 1
    assert first == bundle.human_and_header(None, other)  # what a fresh build for those settings gives
    # a setting a condition reads is another entry, and its entry is its own build
    for env in ({**base, "QUANT_LQER": "1"}, {**base, "PRESET": "smoke"}):
        settings = pack_settings(env)
        assert bundle_cache.cached_human_and_header(settings, cache_dir=tmp_path) == bundle.human_and_header(None,
                                                                                                           settings)
    assert len(builds) == 3


def test_a_declaration_not_on_one_line_makes_every_setting_decide(tmp_path):
    root = _copy_kit(tmp_path / "src")
    _, names = bundle_cache.package_fingerprint(root)
    assert {"QUANT_LQER", "TTT_ENABLED", "TTT_MODE"} <= names and "RUN_ID" not in names and "SEED" not in names
    lqer = root / "quant" / "lqer.py"
    text = lqer.read_text(encoding="utf-8")
    assert 'PACKED_WHEN = "QUANT_LQER"' in text
    lqer.write_text(text.replace('PACKED_WHEN = "QUANT_LQER"', 'PACKED_WHEN = (\n    "QUANT_LQER"\n)'), encoding="utf-8")
    assert bundle_cache.package_fingerprint(root)[1] is None
    a, b = pack_settings({"RUN_ID": "a"}), pack_settings({"RUN_ID": "b"})
    assert bundle_cache._settings_key(a, None) != bundle_cache._settings_key(b, None)
    assert bundle_cache._settings_key(a, names) == bundle_cache._settings_key(b, names)
