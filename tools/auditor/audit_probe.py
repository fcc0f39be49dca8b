"""The auditor's run probe: the record's own train_gpt.py run on the CPU at a toy size, its scoring
traced, and the four conditions of a valid score (openai/parameter-golf issue #1017, "A Field Guide
to Valid Submissions") tested on what it computed.

    checks = probe_folder(folder)   # a list of audit_checks.Check, names PROBE_CHECKS

How: a toy data split (tools/auditor/audit_probe_data.py) is written twice, the second time with
every val token from index t on redrawn; the script runs once on each (tools/auditor/
audit_probe_child.py: CPU stand-ins, a deterministic clock, its own settings, toy sizes through the
environment variables it reads). Verdicts (tools/auditor/audit_probe_verdicts.py):
  run_causal          (1) no -log p of a target before t differs between the two runs
  run_normalized      (2) the scored probability is a full softmax over the vocabulary, or the
                          probabilities the script gives every vocabulary entry at a sampled position
                          (one run per entry, forked) sum to 1 (1e-4)
  run_score_first     (3) a difference of (1) after a training step on val tokens from t on
  run_single_pass     (4) no position is scored twice within one eval pass (a pass ends at a line
                          with val_loss and val_bpb)
  run_bytes           the bpb denominator (from the pass's val_loss, val_bpb and token count) equals
                          the UTF-8 bytes of the scored tokens' decoded text
  run_after_clock     no forward pass on training tokens after the log's training stop, unless the
                          log gives it time (a GPTQ reserve or a timed calibration line)
A script that cannot run on the CPU even with the stand-ins gets `not checkable (could not run: why)`.
Caches gated off on a one-process toy run are switched on: a script whose eval code branches on the world size
runs as two gloo ranks (tools/auditor/audit_probe_ranks.py: closed PR #727), and one whose eval cache waits for
N scored tokens gets a warm-up prefix of N tokens per rank before the anchored split (audit_probe_data.warmup_tokens,
make_filler: closed PR #720).
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from tools.auditor.audit_checks import Check
from tools.auditor.audit_code import unpack_script
from tools.auditor.audit_probe_ranks import probe_world_size

PROBE_CHECKS = ("run_causal", "run_normalized", "run_score_first", "run_single_pass", "run_bytes", "run_after_clock")
_KIT_ROOT = Path(__file__).resolve().parents[2]


def _tokenizer_root() -> Path:
    """The folder whose data/tokenizers holds the challenge's fineweb_<V>_bpe.model files: the kit's own
    (`tools/prepare_data.py fineweb` writes them there), else a `shared/` folder beside the kit."""
    for root in (_KIT_ROOT, _KIT_ROOT.parent / "shared"):
        if any((root / "data" / "tokenizers").glob("fineweb_*_bpe.model")):
            return root
    return _KIT_ROOT


SHARED = _tokenizer_root()
RUN_TIMEOUT_S = 300  # a shared, loaded machine runs a toy run several times slower than its ~30 s
PERTURB_FRACTION = 0.6  # t: the first redrawn val index, as a fraction of the val stream
# the toy size, set only for the variables the script reads (its other settings stay its own)
TOY_ENV = {
    "ITERATIONS": "3", "WARMUP_STEPS": "0", "WARMDOWN_ITERS": "1", "TRAIN_SEQ_LEN": "128", "EVAL_SEQ_LEN": "128",
    "TRAIN_BATCH_TOKENS": "2048", "VAL_BATCH_SIZE": "4096", "VAL_BATCH_TOKENS": "4096", "MODEL_DIM": "64",
    "NUM_HEADS": "4", "NUM_KV_HEADS": "2", "ROPE_DIMS": "8", "EVAL_STRIDE": "32", "EVAL_BATCH_SEQS": "8",
    "TTT_CHUNK_TOKENS": "256", "TTT_CHUNK_SIZE": "64", "TTT_EVAL_SEQ_LEN": "128", "TTT_BATCH_SEQS": "4", "TTT_BATCH_SIZE": "4",
    "VAL_LOSS_EVERY": "0", "TRAIN_LOG_EVERY": "1", "MAX_WALLCLOCK_SECONDS": "100000", "SEED": "1337",
    "RUN_ID": "probe", "GPTQ_CALIBRATION_BATCHES": "2", "GPTQ_CALIB_BATCHES": "2",
    "GPTQ_CALIB_SAMPLES": "8",  # self-generated calibration sequences (token by token: 64 took minutes on the CPU)
}
# TTT_CHUNK_SIZE stays inside TTT_EVAL_SEQ_LEN: a LoRA TTT whose chunk (256) outgrew its window (128) scored the
# window's part of each chunk but counted the whole chunk's tokens (merged 2026-03-17_LoRA_TTT logged val_loss 1.31
# over a traced mean of 5.40), and conditions (1)-(3) were not checkable in the LoRA/phased TTT records

# what a probe run inherits of the auditor's environment: the machine's, never a setting (a shell that exported
# PRESET or DATA_PATH for its own runs, as the README's CPU record does, must not change the folder's run)
INHERITED_ENV = re.compile(r"^(PATH|HOME|USER|LOGNAME|SHELL|TERM|LANG|LANGUAGE|TZ|TMPDIR|TEMP|TMP|PYTHONPATH|VIRTUAL_ENV|"
                           r"LD_LIBRARY_PATH|LC_\w+|CONDA\w*|XDG_\w+|SYSTEMROOT|COMSPEC)$")
# a script that reads its settings under computed names (this kit's: each dataclass field's `f.name.upper()`)
# reads any of them: it gets every toy variable (the kit's packed file refused the toy data at its default size)
_COMPUTED_NAMES = re.compile(r"\.name\.upper\(\)")
_ENV_NAME = re.compile(r"""(?:environ\.get|getenv|environ\[)\(?\s*["']([A-Z][A-Z0-9_]*)["']""")
# the run command of a README: `NAME=value ... torchrun ... train_gpt.py` (lines joined at a trailing backslash)
_RUN_COMMAND = re.compile(r"^\s*(?:export\s+)?((?:[A-Z][A-Z0-9_]*=\S*\s+)+)(?:torchrun|python3?)\b[^\n]*train_gpt\.py", re.M)
_ASSIGN = re.compile(r"([A-Z][A-Z0-9_]*)=(\S*)")
# a step of the training schedule (RECUR_START_STEP=3000 of the merged 2026-03-31_ParallelResiduals record: a
# feature that switches on late in the real run is on by the toy's last step, so the code after it runs too)
_STEP_SETTING = re.compile(r"(START|WARMUP|WARMDOWN)_(STEP|STEPS|ITERS)$|_EVERY$")
_TOY_LAST_STEP = int(TOY_ENV["ITERATIONS"]) - 1
_PROBE_OWN = {"DATA_PATH", "DATA_DIR", "TOKENIZER_PATH", "VOCAB_SIZE", "RUN_ID", "SEED", "PYTHONPATH"}


def _na(reason: str) -> list:
    return [Check(name, "n/a", f"not checkable (could not run: {reason})") for name in PROBE_CHECKS]


def declared_settings(folder: Path, source: str) -> dict:
    """The settings the folder says it ran with: the variables its README's first run command
    (`NAME=value ... torchrun ... train_gpt.py`) sets, kept where the script reads the name and the probe
    sets neither the toy size (TOY_ENV) nor the data; values that are paths or shell expansions are left
    out, and a schedule step past the toy's last step is moved onto it. Scripts ship features off by default
    and switch them on in that command (closed PRs #806, #887: NGRAM_CACHE=1; #1992: PREQUANT_TTT_ENABLED=1;
    #727: TTT_ENABLED=0)."""
    readme = Path(folder) / "README.md"
    if not readme.is_file():
        return {}
    text = readme.read_text(encoding="utf-8", errors="replace").replace("\\\n", " ")
    m = _RUN_COMMAND.search(text)
    if not m:
        return {}
    names = set(_ENV_NAME.findall(source))
    out = {}
    for name, value in _ASSIGN.findall(m.group(1)):
        value = value.strip("'\"")
        if name in names and name not in TOY_ENV and name not in _PROBE_OWN and not re.search(r"[/$`(]", value):
            out[name] = value
            if _STEP_SETTING.search(name) and value.isdigit() and int(value) > _TOY_LAST_STEP:
                out[name] = str(_TOY_LAST_STEP)  # a schedule point of the real run, inside the toy's 3 steps
    return out


def probe_env(source: str, data_dir: Path, tokenizer: Path, vocab_size: int, declared: dict | None = None) -> dict:
    """The environment of a probe run: the machine's variables (INHERITED_ENV), the folder's `declared`
    settings (declared_settings), TOY_ENV and the data/tokenizer paths, each only where the script reads
    that variable; one CPU thread per run."""
    names = set(_ENV_NAME.findall(source))
    wanted = {**(declared or {}), **TOY_ENV, "DATA_PATH": str(data_dir), "DATA_DIR": "data",
              "TOKENIZER_PATH": str(tokenizer), "VOCAB_SIZE": str(vocab_size)}
    env = {k: v for k, v in os.environ.items() if INHERITED_ENV.match(k)}
    env.update({k: v for k, v in wanted.items() if k in names or _COMPUTED_NAMES.search(source)})
    env.update(PROBE_SHARDS=str(data_dir), OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", TORCHDYNAMO_DISABLE="1", PYTHONHASHSEED="0",
               PYTHONPATH=os.pathsep.join([str(Path(__file__).resolve().parents[2]), env.get("PYTHONPATH", "")]))
    return env


def _start(script: Path, folder: Path, data_dir: Path, work: Path, env: dict, sweep: dict | None = None,
           world: int = 1) -> list:
    """The probe child of each rank (one unless `world` > 1: audit_probe_ranks), as [(process, stdout, events path)]."""
    from tools.auditor.audit_probe_ranks import free_port, rank_env

    work.mkdir(parents=True, exist_ok=True)
    if sweep is not None:
        (work / "sweep.json").write_text(json.dumps(sweep))
    env = {**env, "PYTHONPATH": os.pathsep.join([env["PYTHONPATH"], str(folder)])}
    port, started = free_port() if world > 1 else None, []
    for rank in range(world):
        events = work / ("events.json" if world == 1 else f"events_rank{rank}.json")
        args = [sys.executable, "-m", "tools.auditor.audit_probe_child", str(script), str(data_dir), str(events)]
        args += [str(work / "sweep.json")] if sweep is not None else []
        out = open(work / ("stdout.txt" if rank == 0 else f"stdout_rank{rank}.txt"), "wb")
        rank_vars = rank_env(env, rank, world, port) if world > 1 else env
        started.append((subprocess.Popen(args, cwd=work, env=rank_vars, stdout=out, stderr=subprocess.STDOUT), out, events))
    return started


def _read(proc, events: Path, work: Path, rank: int) -> dict:
    if not events.is_file():
        stdout = work / ("stdout.txt" if rank == 0 else f"stdout_rank{rank}.txt")
        tail = stdout.read_text(errors="replace").strip().splitlines()[-1:] or ["no output"]
        return {"error": f"the probe process{f' of rank {rank}' if rank else ''} exited {proc.returncode}: {tail[0][:300]}"}
    return json.loads(events.read_text())


def _finish(started: list, work: Path, timeout_s: float, sweep: bool = False) -> dict:
    """The run dict of the started ranks (merged: audit_probe_ranks.merge_ranks); a rank that stops with an error
    stops the others (they would wait at a collective), and so does a sweep result of any rank."""
    from tools.auditor.audit_probe_ranks import merge_ranks

    deadline, got = time.monotonic() + timeout_s, [None] * len(started)
    try:
        while any(g is None for g in got):
            for i, (proc, _, events) in enumerate(started):
                if got[i] is None and proc.poll() is not None:
                    got[i] = _read(proc, events, work, i)
                    if len(started) > 1 and (_swept(got[i]) if sweep else got[i].get("error")):
                        return got[i]
            if time.monotonic() > deadline:
                return {"error": f"the toy run took over {timeout_s:.0f} s"}
            time.sleep(0.05)
    finally:
        for proc, out, _ in started:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            out.close()
    if sweep:  # the rank that scores the position (another rank's forks stop at a collective: no value)
        return max(got, key=lambda g: sum(math.isfinite(x) for x in g.get("nll") or []))
    return got[0] if len(got) == 1 else merge_ranks(got)


def _swept(run: dict) -> bool:
    return bool(run.get("nll")) and all(math.isfinite(x) for x in run["nll"])


def run_pair(folder: Path, shared: Path = SHARED, timeout_s: float = RUN_TIMEOUT_S, keep: Path | None = None) -> dict:
    """Both toy runs of `folder`'s train_gpt.py. Returns {"a", "b": run dicts (events, error), "t",
    "val", "sp", "vocab", "tokenizer", "work", "script", "env", "data"} or {"error": reason}."""
    import numpy as np
    import sentencepiece as spm

    from tools.auditor import audit_probe_data as D

    folder = Path(folder).resolve()  # the toy runs' cwd is their work folder: `audit.py records/...` must still find it
    script = folder / "train_gpt.py"
    if not script.is_file():
        return {"error": "no train_gpt.py"}
    if not script.read_bytes().strip():  # merged non-record 2026-03-19_SwiGLU_WarmdownFix ships a 0-byte file
        return {"error": "train_gpt.py is empty"}
    try:
        unpacked = unpack_script(script.read_bytes(), folder)
    except SyntaxError as e:
        return {"error": f"train_gpt.py does not parse (line {e.lineno})"}
    if unpacked.source is None:
        return {"error": f"train_gpt.py could not be decoded ({unpacked.error})"}
    try:
        tokenizer, vocab, tok_source = D.pick_tokenizer(unpacked.source, folder, shared)
    except ValueError as e:
        return {"error": str(e)}
    sp = spm.SentencePieceProcessor(model_file=str(tokenizer))
    work = Path(keep) if keep else Path(tempfile.mkdtemp(prefix="audit_probe_"))
    rng = np.random.default_rng(0)
    try:
        phrases = D.make_phrases(sp, rng)
        val = D.make_stream(sp, D.VAL_DOCS, D.VAL_DOC_TOKENS, rng, distinct=True, phrases=phrases)
    except ValueError as e:
        return {"error": str(e)}
    train = D.make_stream(sp, D.TRAIN_TOKENS // (D.VAL_DOC_TOKENS + 1), D.VAL_DOC_TOKENS, rng, phrases=phrases)
    # an eval cache that waits for N scored tokens gets N first, on each rank (a rank counts what it scores)
    warmup, world = D.warmup_tokens(unpacked.source), probe_world_size(unpacked.source)
    try:
        prefix = D.make_filler(sp, val, phrases, warmup * world + D.WARMUP_MARGIN_TOKENS, rng) if warmup else val[:0]
    except ValueError as e:
        return {"error": str(e)}
    t = len(prefix) + int(len(val) * PERTURB_FRACTION) | 1
    val = np.concatenate([prefix, val])
    # the official layout (data/datasets/fineweb10B_spV/, data/tokenizers/), at the same relative paths in
    # both runs (a loader may seed its sampling from the shard paths)
    shards = Path("data") / "datasets" / f"fineweb10B_sp{vocab}"
    tok = Path("data") / "tokenizers" / tokenizer.name
    declared = declared_settings(folder, unpacked.source)
    caseops = "fineweb_val_bytes_" in unpacked.source and any(
        "CASEOPS" in k and v.lower() not in ("", "0", "false") for k, v in declared.items())
    for name, split in (("run_a", val), ("run_b", D.perturbed(sp, val, t))):
        D.write_split(work / name / shards, split, train, sp.bos_id(), len(prefix))
        if caseops:  # the README's run scores on a CaseOps byte sidecar: the script reads one
            D.write_byte_sidecar(work / name / shards, sp, split)
        (work / name / tok).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(tokenizer, work / name / tok)
    env = probe_env(unpacked.source, shards, tok, vocab, declared)
    started = [_start(script, folder, work / name / shards, work / name, env, world=world) for name in ("run_a", "run_b")]
    runs = [_finish(s, work / name, timeout_s) for s, name in zip(started, ("run_a", "run_b"))]
    return {"a": runs[0], "b": runs[1], "t": t, "val": val, "sp": sp, "vocab": vocab, "tokenizer": tok_source,
            "work": work, "script": script, "env": env, "folder": folder, "timeout_s": timeout_s,
            "declared": declared, "world": world, "prefix": len(prefix)}


def run_sweep(pair: dict, position: int, lines_before: int) -> dict:
    """Condition 2's sweep: -log q(v) at `position` for every v < vocab, in the eval pass whose first
    score follows `lines_before` printed val_loss/val_bpb lines."""
    work = pair["work"] / f"sweep_{position}"
    shutil.copytree(pair["work"] / "run_a" / "data", work / "data")
    started = _start(pair["script"], pair["folder"], work / pair["env"]["PROBE_SHARDS"], work, pair["env"],
                     {"position": position, "lines": lines_before, "vocab": pair["vocab"]}, world=pair.get("world", 1))
    return _finish(started, work, 2 * pair["timeout_s"], sweep=True)  # the run, then one short fork per entry


def probe_folder(folder, *, shared=SHARED, timeout_s: float = RUN_TIMEOUT_S, keep=None) -> list:
    """The PROBE_CHECKS of one record folder (module docstring); never raises for a script that fails."""
    from tools.auditor.audit_probe_verdicts import verdicts

    folder = Path(folder)
    if not (Path(shared) / "data" / "tokenizers").is_dir():
        return _na(f"no challenge tokenizers in {shared}/data/tokenizers (tools/prepare_data.py fineweb writes them)")
    pair = run_pair(folder, Path(shared), timeout_s, keep)
    try:
        if "error" in pair:
            return _na(pair["error"])
        for side in ("a", "b"):
            if pair[side].get("error"):
                return _na(pair[side]["error"])
        return verdicts(pair, run_sweep)
    finally:
        if keep is None and "work" in pair:
            shutil.rmtree(pair["work"], ignore_errors=True)


def attach_probe(result, *, run: bool, shared=SHARED, timeout_s: float = RUN_TIMEOUT_S) -> None:
    """Append the PROBE_CHECKS to an audit_folder result (`result.checks`) and say how they were
    decided in `result.probe_note`; `run=False` (--no-run) appends nothing and says the probe was skipped."""
    if not run:
        result.probe_note = "run probe skipped (--no-run): conditions (1)-(4) were not tested by running the script"
        return
    checks = probe_folder(result.folder, shared=shared, timeout_s=timeout_s)
    result.checks.extend(checks)
    ran = [c.name for c in checks if c.status != "n/a"]
    result.probe_note = (f"from running train_gpt.py on the CPU at a toy size: {', '.join(ran)}" if ran else
                         f"run probe: {checks[0].evidence}")
