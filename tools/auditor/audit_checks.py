"""The checks of tools/audit.py, one function each, over a `Record` (what the folder holds).

Each returns a Check(name, status, evidence): "pass", "fail" or "n/a" (not checkable, with why).
A check that lacks its input (no submission.json, no train_gpt.py, nothing logged) says n/a
rather than fail, so each broken folder fails exactly the checks about what is wrong in it.
Limits and their sources: README of openai/parameter-golf (16,000,000 bytes decimal of code +
compressed model; 10 minutes of training and 10 more of evaluation on 8xH100; record folders hold
README.md, submission.json, train logs, train_gpt.py, requirements.txt for extra packages;
a new record beats the best by 0.005 nats at p < 0.01, usually 3 seeds).
"""

from __future__ import annotations

import dataclasses
import platform
import re
import statistics
import sys
from pathlib import Path

from primitives.files import sha256_file
from tools.auditor.audit_bytes import candidates, ratio_deviation, tolerance

RECORD_TRACK = "track_10min_16mb"
NON_RECORD_TRACK = "track_non_record_16mb"
MIN_RECORD_SEEDS = 3
EARLY_FOLDERS_BEFORE = "2026-04-01"
# bytes of the val split's text (first 50,000 docs), whatever the tokenizer: 151,073,604 decoded bytes (PR #1289
# thread, the Scylla audit); val tokens / tokens-per-byte of the sp1024/4096/8192 rows give 151.07-151.08 M
VAL_SPLIT_BYTES = 151_073_604
VAL_SPLIT_HALF_WIDTH = 4e-4  # the scored tokens differ from the logged count by up to a sequence, BOS per doc
VAL_SPLIT = object()  # merged folders dated before this lack submission.json or logs
TAIL_FACTOR = 4
SUBMISSION_FIELDS = ("author", "github_id", "name", "blurb", "date", "val_loss", "val_bpb", "bytes_total", "bytes_code")
# openai/parameter-golf requirements.txt: the evaluation environment has these ("all packages installed");
# torch brings triton. Anything else a script imports needs requirements.txt / README setup notes.
BASE_PACKAGES = {"numpy", "tqdm", "torch", "huggingface_hub", "kernels", "setuptools", "typing_extensions",
                 "datasets", "tiktoken", "sentencepiece", "triton"}
IMPORT_ALIASES = {  # import name -> names a requirements.txt or README may use for it
    "flash_attn_interface": ("flash_attn_3", "flash_attn", "flashattention", "fa3"),
    "flash_attn": ("flash_attn", "flashattention"), "yaml": ("pyyaml",), "fla": ("flash_linear_attention",),
    "mamba_ssm": ("mamba_ssm",), "python_minifier": ("python_minifier",), "PIL": ("pillow",),
    "sklearn": ("scikit_learn",), "cv2": ("opencv_python",), "zstd": ("zstd", "zstandard"),
}


@dataclasses.dataclass
class Check:
    name: str
    status: str  # "pass" | "warn" (stricter than the organizers' practice) | "fail" | "n/a"
    evidence: str


def _norm(name: str) -> str:
    return re.sub(r"[-_.\s]+", "", name.lower())


def _fmt_s(seconds: float) -> str:
    return f"{seconds:.3f} s"


# -----------------------------------------------------------------------------------------------
# files and code
# -----------------------------------------------------------------------------------------------


def check_files(rec) -> Check:
    have, missing = [], []
    for label, present in (("README.md", rec.readme is not None), ("submission.json", rec.submission_path is not None),
                           ("train_gpt.py", rec.script_bytes is not None), ("a train log", bool(rec.logs))):
        (have if present else missing).append(label)
    logs = ", ".join(lg.name for lg in rec.logs[:6]) + (" ..." if len(rec.logs) > 6 else "")
    ev = f"found {', '.join(have) or 'nothing'}" + (f" ({len(rec.logs)} train log(s): {logs})" if rec.logs else "")
    if len(missing) == 4:
        return Check("files", "fail", f"none of README.md, submission.json, train_gpt.py, a train log; {ev}")
    hard = [m for m in missing if m in ("submission.json", "a train log")]
    early = re.match(r"(\d{4}-\d{2}-\d{2})_", rec.folder.name)
    if hard and not (early and early.group(1) < EARLY_FOLDERS_BEFORE):
        # organizers, PR #2124 / PR #2146 audit notes: a row needs submission.json-verified seeds and
        # their logs ("not record-ready", "not leaderboard-ready")
        return Check("files", "fail", f"missing {', '.join(missing)}: a record folder without submission.json "
                                      f"and its train logs is not leaderboard-ready (organizers' audit, PR #2146); {ev}")
    if missing:  # merged precedents lack some: track_non_record_16mb/2026-03-29_HNet (no train_gpt.py),
        # 2026-03-24_74M_Ternary (no submission.json), 2026-03-21_DepthRecurrence (no train log)
        return Check("files", "warn", f"missing {', '.join(missing)} (the official README asks for each; merged "
                                      f"folders of March 2026 lack some: 2026-03-24_74M_Ternary, "
                                      f"2026-03-21_DepthRecurrence); {ev}")
    return Check("files", "pass", ev)


def check_submission_fields(rec) -> Check:
    if rec.submission_path is None:
        return Check("submission_fields", "n/a", "no submission.json")
    if rec.submission_error:
        return Check("submission_fields", "fail", f"submission.json: {rec.submission_error}")
    sub = rec.submission
    missing = [k for k in SUBMISSION_FIELDS if sub.get(k) in (None, "")]
    bad = [k for k in ("val_loss", "val_bpb") if k not in missing and not isinstance(sub[k], (int, float))]
    bad += [k for k in ("bytes_total", "bytes_code") if k not in missing and not isinstance(sub[k], int)]
    extra = len([k for k in sub if k not in SUBMISSION_FIELDS])
    if missing or bad:
        alt = {k: a for k, a in (("val_bpb", "mean_val_bpb"), ("val_loss", "mean_val_loss"),
                                 ("bytes_total", "artifact_bytes"), ("bytes_code", "code_bytes"))
               if k in missing and a in sub}
        detail = "; ".join(filter(None, [f"missing {', '.join(missing)}" if missing else "",
                                         f"not numbers: {', '.join(bad)}" if bad else "",
                                         ", ".join(f"has {a} instead of {k}" for k, a in alt.items())]))
        # merged records lack some (2026-04-09_A2: val_loss, bytes_code): a warning, never a rejection
        return Check("submission_fields", "warn", f"submission.json {detail}")
    return Check("submission_fields", "pass", f"submission.json has the {len(SUBMISSION_FIELDS)} official fields "
                                             f"(+{extra} more)")


def check_code_size(rec) -> Check:
    if rec.script_bytes is None:
        return Check("code_size", "n/a", "no train_gpt.py")
    real = rec.code_bytes
    parts = f"train_gpt.py {len(rec.script_bytes):,} bytes" + "".join(
        f" + {n} {(rec.folder / n).stat().st_size:,} bytes (exec'd by train_gpt.py)" for n in
        (rec.script.files if rec.script else ()))
    problems = []
    claimed = rec.submission.get("bytes_code")
    if isinstance(claimed, int) and claimed != real:
        problems.append(f"submission.json bytes_code={claimed:,} but the shipped code is {real:,} bytes")
    accepted = {real, len(rec.script_bytes)}
    if rec.script is not None and rec.script.source is not None:
        accepted.add(len(rec.script.source.encode("utf-8")))
    for lg in rec.seed_logs:
        if lg.facts.codes and not {b for _, b, _ in lg.facts.codes} & accepted:
            label, b, line = lg.facts.codes[-1]
            problems.append(f"{lg.name}:{line} logs {label} {b:,}: not the shipped file's size (the code changed "
                            f"since the run?)")
    if problems:  # merged records differ by 1 and 17 bytes (2026-04-01_Vocab4096, 2026-03-19_SlidingWindowEval)
        return Check("code_size", "warn", f"{parts}; " + "; ".join(problems[:3]))
    logged = sorted({f"{lg.name}:{lg.facts.codes[-1][2]}" for lg in rec.seed_logs if lg.facts.codes})
    return Check("code_size", "pass", f"{parts} = {real:,} counted" + (" = submission.json bytes_code" if
                                                                        isinstance(claimed, int) else "")
                 + (f"; logged sizes agree ({', '.join(logged[:3])})" if logged else ""))


def check_code_parses(rec) -> Check:
    from tools.auditor.audit_code import parse_imports

    if rec.script_bytes is None:
        return Check("code_parses", "n/a", "no train_gpt.py")
    if rec.script_error:
        return Check("code_parses", "fail", f"train_gpt.py does not parse: {rec.script_error}")
    s = rec.script
    how = "plain source" if s.kind == "plain" else f"packed: {'; '.join(s.layers)}"
    if s.kind == "unreadable":
        status = "n/a" if s.error.startswith("unsupported stub") else "fail"
        return Check("code_parses", status, f"train_gpt.py parses but its payload is unreadable: {s.error}")
    try:
        required, optional, version = parse_imports(s.source, rec.pythons)
    except SyntaxError as e:
        newer = sorted({lg.facts.python for lg in rec.logs if lg.facts.python}, reverse=True)
        here = f"{sys.version_info[0]}.{sys.version_info[1]}"
        if getattr(e, "interpreter_failed", False) and not newer:
            return Check("code_parses", "n/a", f"{how}; line {e.lineno}: {e.msg}: not checkable (no newer interpreter "
                                               f"ran; pass --python PATH)")
        if newer and tuple(map(int, newer[0].split(".")[:2])) > sys.version_info[:2]:
            return Check("code_parses", "n/a", f"{how}; line {e.lineno}: {e.msg}; its logs ran Python {newer[0]}, this "
                                               f"is {here} (pass --python PATH to a newer interpreter)")
        return Check("code_parses", "fail", f"{how}; the code does not parse: line {e.lineno}: {e.msg}")
    rec.imports = (required, optional)
    lines = s.source.count("\n") + 1
    from tools.auditor.audit_parse import parse_any

    note = parse_any(s.source)[1] if version == platform.python_version() else ""
    return Check("code_parses", "pass", f"{how}; {lines:,} lines, parses with Python {version}"
                 + (f" ({note})" if note else ""))


def check_requirements(rec) -> Check:
    if rec.imports is None:
        return Check("requirements", "n/a", "the code could not be read")
    required, optional = rec.imports
    local = {p.stem for p in rec.folder.glob("*.py")} | {p.name for p in rec.folder.iterdir() if p.is_dir()}
    third = sorted(m for m in required if m not in sys.stdlib_module_names and m not in local and m != "__future__")
    extra = [m for m in third if m not in BASE_PACKAGES]
    if not extra:
        return Check("requirements", "pass", f"imports {', '.join(third) or 'only the standard library'}: all in the "
                                             f"official environment" + (f" (optional: {', '.join(sorted(optional))})"
                                                                        if optional else ""))
    req_text = rec.requirements or ""
    listed = {_norm(re.split(r"[<>=!~;\[ #]", ln.strip(), maxsplit=1)[0]) for ln in req_text.splitlines()
              if ln.strip() and not ln.strip().startswith("#")}
    mentioned_req, mentioned_readme = _norm(req_text), _norm(rec.readme or "")
    unlisted, via_notes = [], []
    for mod in extra:
        names = {_norm(mod)} | {_norm(a) for a in IMPORT_ALIASES.get(mod, ())}
        if names & listed:
            continue
        if any(n in mentioned_req or n in mentioned_readme for n in names):
            via_notes.append(mod)
            continue
        unlisted.append(mod)
    where = "requirements.txt" if rec.requirements is not None else "there is no requirements.txt"
    if unlisted:  # merged: 2026-03-23_LeakyReLU imports flash_attn_interface with no requirements.txt
        return Check("requirements", "warn", f"imports {', '.join(unlisted)} (not in the official environment) but "
                                             f"{where} and README.md do not name {'it' if len(unlisted) == 1 else 'them'}")
    in_req = [m for m in extra if m not in via_notes]
    return Check("requirements", "pass", "packages beyond the official environment: "
                 + "; ".join(filter(None, [f"{', '.join(in_req)} in requirements.txt" if in_req else "",
                                           f"{', '.join(via_notes)} named in the setup notes" if via_notes else ""])))


# -----------------------------------------------------------------------------------------------
# claims, byte accounting, seeds, significance, data
# -----------------------------------------------------------------------------------------------


class JsonFloat(float):
    """A float read from JSON that remembers how many decimals were printed (`1.08000` -> 5), since
    float("1.08000") == 1.08 loses them. Use as json.loads(..., parse_float=JsonFloat)."""

    decimals: int

    def __new__(cls, text: str):
        self = super().__new__(cls, text)
        mantissa = text.lower().split("e")[0]
        self.decimals = len(mantissa.split(".")[1]) if "." in mantissa else 0
        return self


def _claim_tolerance(value, log_decimals: int = 8) -> float:
    """Half a unit in the last decimal the claim printed (it is a rounding of the true mean) + half a
    unit in the last decimal of the log lines it is compared with."""
    decimals = getattr(value, "decimals", None)
    if decimals is None:
        text = repr(float(value))
        decimals = len(text.split(".")[1]) if "." in text and "e" not in text else 8
    return 0.5 * 10.0 ** -decimals + 0.5 * 10.0 ** -log_decimals + 1e-12


def _bytes_of_logs(rec, scored) -> list:
    out = []
    for lg in scored:
        f = lg.facts
        if f.counted_total:
            out.append(f.counted_total[1])
        if f.counted_model and rec.code_bytes is not None:
            out.append(f.counted_model[1] + rec.code_bytes)
    return out


# a claim off by more than its rounding warns up to this; beyond it the logs contradict it (the largest
# difference in a merged folder: 2e-4, 2026-03-17_LoRA_TTT claims 1.1929 where its log says 1.1927)
CLAIM_MATERIAL_BPB = 5e-4


def check_claims(rec) -> Check:
    """submission.json val_bpb = the mean of the seed logs' final lines (per seed too), at the claim's
    printed precision. A claim the logs contradict by more than its rounding and CLAIM_MATERIAL_BPB (no
    logged line and no mean of one metric over the seed logs gives it) fails; a smaller difference, or
    a claim that is another logged figure (one seed, another metric: merged
    2026-03-19_TrainingOptSeq4096, 2026-03-17_LoRA_TTT), warns."""
    sub = rec.submission
    claimed = sub.get("val_bpb", sub.get("mean_val_bpb"))
    scored = [lg for lg in rec.seed_logs if lg.score is not None]
    if not isinstance(claimed, (int, float)) or not scored:
        why = "no claimed val_bpb" if not isinstance(claimed, (int, float)) else "no final val_bpb in the logs"
        return Check("claims_match_logs", "n/a", why)
    problems = [f"no log for claimed seed(s) {', '.join(map(str, rec.missing_seeds))}"] if rec.missing_seeds else []
    contradicted = []
    for lg in scored:
        per = (lg.seed_result or {}).get("val_bpb")
        if isinstance(per, (int, float)) and abs(per - lg.score.val_bpb) > _claim_tolerance(per, lg.score.bpb_decimals):
            problems.append(f"seed {lg.seed}: submission.json val_bpb {per} but {lg.name}:{lg.score.line} "
                            f"{lg.score.name} {lg.score.val_bpb:.8f}")
            if abs(per - lg.score.val_bpb) > CLAIM_MATERIAL_BPB:  # the closest line of its own log
                contradicted.append(problems[-1])
    mean = statistics.fmean(lg.score.val_bpb for lg in scored)
    names = sorted({lg.score.name for lg in scored})
    least = min(lg.score.bpb_decimals for lg in scored)
    tol = _claim_tolerance(claimed, least)
    single = None
    if not rec.claims and len(scored) > 1:  # no seeds listed: the claim may be one run (early records: train.log)
        single = next((lg for lg in scored if abs(lg.score.val_bpb - claimed) <= tol), None)
    if single is not None and not problems:
        return Check("claims_match_logs", "pass", f"val_bpb {claimed} = {single.name}:{single.score.line} "
                                                  f"{single.score.name} {single.score.val_bpb:.8f}: one run "
                                                  f"(submission.json lists no seeds), not the mean of the "
                                                  f"{len(scored)} logs ({mean:.8f})")
    if single is None and abs(mean - claimed) > tol:
        if abs(mean - claimed) > CLAIM_MATERIAL_BPB and not _logged_figure(rec, scored, claimed, tol):
            contradicted.append(f"submission.json val_bpb {claimed}")
        problems.append(f"submission.json val_bpb {claimed} but the mean of {len(scored)} log(s) is {mean:.8f}, "
                        f"off by {abs(mean - claimed):.2e} > {tol:.1e} ({', '.join(names)}: "
                        + ", ".join(f"{lg.name}:{lg.score.line} {lg.score.val_bpb:.8f}" for lg in scored[:4]) + ")")
    sizes = _bytes_of_logs(rec, scored)
    claimed_bytes = sub.get("bytes_total")
    if isinstance(claimed_bytes, int) and sizes and claimed_bytes < min(sizes):
        problems.append(f"submission.json bytes_total {claimed_bytes:,} but the logs give {min(sizes):,}..{max(sizes):,}")
    if contradicted:
        return Check("claims_match_logs", "fail", "; ".join(problems[:3]) + f": the logs contradict the claim by "
                     f"more than its rounding and {CLAIM_MATERIAL_BPB} (no logged line or mean of one metric gives it)")
    if problems:
        return Check("claims_match_logs", "warn", "; ".join(problems[:3]) + " (the claim is another logged figure, "
                     f"or within {CLAIM_MATERIAL_BPB} of the logs)")
    extra = f"; {len(rec.extra_logs)} other log(s) not backing the claim: " + ", ".join(
        lg.name for lg in rec.extra_logs[:3]) if rec.extra_logs else ""
    return Check("claims_match_logs", "pass", f"val_bpb {claimed} = mean of {len(scored)} seed log(s) "
                                              f"{mean:.8f} ({', '.join(names)}, within {tol:.1e})"
                 + (f"; bytes_total {claimed_bytes:,} within the logged sizes" if isinstance(claimed_bytes, int)
                    and sizes else "") + extra)


def _logged_figure(rec, scored, claimed, tol) -> bool:
    """Some logged line of the folder, or the mean of one metric name over the scored logs, equals the claim."""
    if any(abs(m.val_bpb - claimed) <= tol for lg in rec.logs for m in lg.facts.metrics):
        return True
    names = set.intersection(*({m.name for m in lg.facts.metrics} for lg in scored)) if scored else set()
    return any(abs(statistics.fmean([m for m in lg.facts.metrics if m.name == n][-1].val_bpb for lg in scored)
                   - claimed) <= tol for n in names)


def _log_candidates(rec, lg):
    f = lg.facts
    name = Path(f.tokenizer[0]).name if f.tokenizer else None
    sha = None
    if name:
        for path in (rec.folder / name, *rec.folder.glob(f"*/{name}"), Path(f.tokenizer[0]),
                     rec.folder / f.tokenizer[0]):
            if path.is_file():
                sha = sha256_file(path)
                break
    val_tokens = (f.val_tokens[0] if f.val_tokens else None) or (lg.seed_result or {}).get("val_tokens")
    return candidates(tokenizer_name=name, sha256=sha, vocab_size=f.vocab_size[0] if f.vocab_size else None,
                      dataset=f.dataset[0] if f.dataset else None, val_tokens=val_tokens,
                      byte_level=f.byte_level), name, sha, val_tokens


def check_byte_accounting(rec) -> Check:
    from tools.auditor.audit_bytes import shipped_byte_tables

    tables = shipped_byte_tables(rec.folder)
    if any(s == "fail" for s, _ in tables):
        return Check("byte_accounting", "fail", "; ".join(t for s, t in tables if s == "fail")[:600])
    check = _check_lines_bytes(rec)
    if tables:
        check.evidence += "; " + "; ".join(t for _, t in tables[:2])
    return check


def _check_lines_bytes(rec) -> Check:
    rows, unknown = [], []
    for lg in rec.seed_logs:
        finals = [m for m in lg.facts.metrics if m.tokens_per_byte]
        if not finals:
            continue
        if rec.measured is not None:
            cands = [(rec.measured_label, rec.measured["tokens_per_byte"], 0.0)]
            val_tokens = rec.measured["val_tokens"]
        else:
            found, name, sha, val_tokens = _log_candidates(rec, lg)
            official = any("fineweb10b" in str(x).lower() for x in
                           [lg.facts.dataset[0] if lg.facts.dataset else ""] + [p for p, _ in lg.facts.val_patterns])
            if not found and val_tokens and official:
                # any tokenizer: the logged val tokens over the val split's fixed byte count
                found = [VAL_SPLIT]
                val_tokens_tpb = val_tokens / VAL_SPLIT_BYTES
            if found == [VAL_SPLIT]:
                cands = [(f"{val_tokens:,} val tokens / the val split's {VAL_SPLIT_BYTES:,} bytes = "
                          f"{val_tokens_tpb:.7f} (tokenizer {name or 'not in the table'})", val_tokens_tpb,
                          VAL_SPLIT_HALF_WIDTH)]
                found = ()
            elif not found:
                unknown.append(f"{lg.name}: tokenizer {name or '?'}" + (f" (sha256 {sha[:12]}...)" if sha else "")
                               + (f", {val_tokens:,} val tokens" if val_tokens else ""))
                continue
            if found:
                cands = [(f"{c.key} {c.tokens_per_byte:.7f} ({c.source.split(':')[0]})", c.tokens_per_byte,
                          c.half_width) for c in found]
                val_tokens = val_tokens or min(c.val_tokens or 0 for c in found) or None
        # the roundtrip eval drops the tail that does not fill a sequence: a subset of the split whose
        # ratio differs by at most ~seq_len/val_tokens (x4 for byte-dense tails); 3e-5 on the official split
        seq_len = lg.facts.seq_len[0] if lg.facts.seq_len else None
        tail = TAIL_FACTOR * seq_len / val_tokens if seq_len and val_tokens else 0.0
        for m in finals:
            best = min(cands, key=lambda c: abs(ratio_deviation(m.tokens_per_byte, c[1])))
            dev = ratio_deviation(m.tokens_per_byte, best[1])
            tol = tolerance(m.rounding, best[2]) + tail
            rows.append((abs(dev) / tol, lg, m, dev, tol, best[0]))
    if not rows:
        why = "; ".join(unknown[:2]) if unknown else "no final val_loss/val_bpb lines"
        return Check("byte_accounting", "n/a", f"{why}: not in the canonical table (pass --tokenizer/--data-path)"
                     if unknown else why)
    score, lg, m, dev, tol, label = max(rows, key=lambda r: r[0])
    text = (f"{lg.name}:{m.line} {m.name} implies {m.tokens_per_byte:.7f} tokens/byte, {dev * 100:+.3f}% from "
            f"{label} (tolerance {tol * 100:.3f}%)")
    if score > 1:
        bad = len([r for r in rows if r[0] > 1])
        return Check("byte_accounting", "fail", f"{text}; {bad} of {len(rows)} final lines off: the val bytes were "
                                                f"counted differently (or other text was scored)")
    return Check("byte_accounting", "pass", f"{len(rows)} final lines; worst {text}")


def check_seeds(rec) -> Check:
    seeds = sorted({lg.seed for lg in rec.seed_logs if lg.score is not None and lg.seed is not None})
    count = len(seeds) or len([lg for lg in rec.seed_logs if lg.score is not None])
    listed = f"{count} seed(s) with final results" + (f" ({', '.join(map(str, seeds))})" if seeds else "")
    if rec.track == RECORD_TRACK:
        if count >= MIN_RECORD_SEEDS:
            return Check("three_seeds", "pass", listed)
        # merged one-seed records (2026-03-17_NaiveBaseline, 2026-03-19_SlidingWindowEval): a warning
        return Check("three_seeds", "warn", f"{listed}; a record needs enough seeds for p < 0.01, usually "
                                            f"{MIN_RECORD_SEEDS}")
    return Check("three_seeds", "n/a", f"{listed}; track {rec.track or 'unknown'}: no significance rule")


def seed_values(rec) -> list:
    """significance.SeedValue per seed log with a final result (the folder's claimed metric)."""
    from tools.record.significance import SeedValue

    return [SeedValue(f"{rec.folder.name}/{lg.name}", lg.seed, lg.score.val_bpb, lg.score.val_loss,
                      lg.score.tokens_per_byte) for lg in rec.seed_logs if lg.score is not None]


def check_significance(rec, baseline_bpb=None, baseline_values=None) -> Check:
    if baseline_bpb is None and baseline_values is None:
        return Check("significance", "n/a", "no --baseline-bpb / --baseline given")
    from tools.record.significance import analyse

    values = seed_values(rec)
    if len(values) < 2:
        return Check("significance", "fail" if values else "n/a",
                     f"{len(values)} seed(s): a t-test needs at least 2")
    res = analyse(values, baseline_bpb=baseline_bpb, baseline_values=baseline_values)
    text = (f"{res['test']} t-test over {res['n']} seeds: mean {res['mean']:.8f} vs baseline {res['baseline_mean']:.8f}, "
            f"improvement {res['improvement_nats']:+.5f} nats (need > {res['min_improvement_nats']}), "
            f"p = {res['p']:.3g} (need < {res['alpha']})")
    return Check("significance", "pass" if res["significant"] else "fail", text)


_VAL_AS_TRAIN = re.compile(r"\b(?:ln|cp|mv)\b[^\n#]*fineweb_val_\S*\s+\S*fineweb_train_")


def _val_linked_as_train(readme: Path):
    """(line number, line) of a README command that links or copies a val shard to a train shard's name."""
    if not readme.is_file():
        return None
    for n, line in enumerate(readme.read_text(encoding="utf-8", errors="replace").splitlines(), 1):
        if _VAL_AS_TRAIN.search(line):
            return n, line.strip()
    return None


def check_data(rec) -> Check:
    manifests = [p for p in (rec.folder / "manifest.json",
                             Path(rec.data_path) / "manifest.json" if rec.data_path else None) if p and p.is_file()]
    for path in manifests:
        from shards.format import check_data_manifest, shards_unverified  # imports torch: only when a manifest is there

        notes = []
        try:
            manifest = check_data_manifest(path.parent, log=notes.append)
        except KeyError:
            continue  # a manifest of another kind (a tokenizer export's): not a document-hash manifest
        except ValueError as e:
            if '"format"' not in path.read_text(errors="replace"):
                continue  # not a shard manifest (a tokenizer export's manifest.json): no document hashes in it
            return Check("data_disjoint", "fail", str(e))
        if manifest is not None:
            n = {k: v.get("num_docs") for k, v in manifest.get("splits", {}).items()}
            why = shards_unverified(path.parent) if rec.data_path and path.parent == Path(rec.data_path) else None
            return Check("data_disjoint", "pass", f"{path}: document hashes of train ({n.get('train')}) and val "
                                                  f"({n.get('val')}) docs do not intersect" + (f"; {why}" if why else ""))
    linked = _val_linked_as_train(rec.folder / "README.md")
    if linked:
        return Check("data_disjoint", "fail", f"README.md:{linked[0]}: its data setup makes a val shard a train shard "
                                              f"({linked[1][:160]}): training on the val split (PR #44)")
    for lg in rec.seed_logs:
        f = lg.facts
        bad = [(p, n, "train") for p, n in f.train_patterns if "val" in Path(p).name] + \
              [(p, n, "val") for p, n in f.val_patterns if "train" in Path(p).name]
        if bad:
            p, n, split = bad[0]
            return Check("data_disjoint", "fail", f"{lg.name}:{n}: the {split} loader reads {p}")
    pats = [(lg, f.train_patterns[-1], f.val_patterns[-1]) for lg in rec.seed_logs
            for f in [lg.facts] if f.train_patterns and f.val_patterns]
    if pats:
        lg, (tp, tn), (vp, vn) = pats[0]
        return Check("data_disjoint", "pass", f"{lg.name}:{tn},{vn}: train shards {Path(tp).name}, val shards "
                                              f"{Path(vp).name} (disjoint file sets)")
    return Check("data_disjoint", "n/a", "no manifest, document hashes or train shard names in the folder or its "
                                         "logs (pass --data-path with a manifest.json)")
