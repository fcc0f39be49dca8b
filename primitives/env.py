"""Environment settings: the one parser of every env var the kit reads (trainer, quant policy, eval CLI).

A value is parsed to its field's type with the variable named in every error, and a variable that
looks like one of ours but is not gets one warning line (typos are silent killers of 10-minute runs).
"""


# The form this code runs in: "package" (the kit's repo). The bundler rewrites this one line to "human" or "packed"
# in the files it writes (kit/bundle.py) and replaces each `if BUNDLE_KIND == "package":` block by its else-body
# there (kit/bundle_fold.py): the kit's own features stay in the package.
BUNDLE_KIND = "package"


def parse_env_value(name: str, raw: str, kind: type):
    """Parse env var `name`'s text `raw` to `kind` (int, float, bool or str).

    int: a whole number, also written as a float ("2e4"); float: finite or not (ranges are the
    caller's); bool: 1/true/0/false (any case) or empty (false). Raises ValueError naming the
    variable, its raw value and the expected type.
    """
    text = raw.strip().lower()
    try:
        if kind is bool:
            if text not in ("1", "true", "0", "false", ""):
                raise ValueError
            return text in ("1", "true")
        if kind is int:
            value = int(text) if text.lstrip("+-").isdigit() else float(text)  # digits: exact, however long
            if value != int(value):  # (int() of inf or nan raises, as a bad value should)
                raise ValueError
            return int(value)
        return kind(raw.strip())
    except (ValueError, OverflowError):
        expected = {bool: "0/1/true/false", int: "a whole number", float: "a number"}.get(kind, kind.__name__)
        raise ValueError(f"{name}={raw!r}: expected {expected}") from None


def warn_unknown_env(environ, known, prefixes=(), log=print, skip_prefixes=()) -> list:
    """Log `WARNING: unknown setting NAME=value is ignored (did you mean X?)` for each variable of
    `environ` that looks like a setting in `known` but is not one: a close spelling of a known name
    or a name starting with one of `prefixes`. Names starting with `skip_prefixes` are another
    parser's. Returns the unknown names, sorted."""
    unknown = []
    if BUNDLE_KIND == "package":  # the kit's advice: a record's file reads its settings only
        import difflib

        for name in sorted(environ):
            if name in known or name.startswith(tuple(skip_prefixes)):
                continue
            close = difflib.get_close_matches(name, known, 1, 0.8)
            if close or name.startswith(tuple(prefixes)):
                unknown.append(name)
                hint = f" (did you mean {close[0]}?)" if close else ""
                log(f"WARNING: unknown setting {name}={environ[name]!r} is ignored{hint}")
    return unknown
