"""The auditor's run probe (tools/auditor/audit_probe.py) on a merged record's own script: PR #1617's
train_gpt.py from ../shared/reference passes the four conditions, and each rule break patched into its
text fails the condition that break violates (skipped without ../shared); the sweep's snapshot reading."""

import json
import re
from pathlib import Path

import numpy as np
import pytest

from tools.auditor import audit_probe_data as D
from tools.auditor import audit_probe_trace as T
from tools.auditor.audit_probe_verdicts import check_after_clock, check_single_pass, passes, untraced_results

SHARED = Path(__file__).resolve().parents[2] / "shared"
PR1617 = SHARED / "reference" / "pr1617" / "train_gpt.py"
needs_reference = pytest.mark.skipif(not (PR1617.is_file() and (SHARED / "data" / "tokenizers").is_dir()),
                                     reason="needs ../shared/reference/pr1617 and ../shared/data/tokenizers")

SCORE_LINE = "                scored_nll = nll[i, score_start:wlen].to(torch.float64)\n"
MIX = "                scored_nll = -torch.log(0.9 * torch.exp(-nll[i, score_start:wlen].to(torch.float64)) + 0.1 * {})\n"
SLIDING, TTT = r"pass '\w+_sliding_window'", r"pass 'ttt_sliding:done'"  # PR #1617's eval passes, as named
# one rule break each, as (the check it must fail, a pattern its evidence must match (the condition and the
# pass the break sits in), the other rows it may fail, (old text, new text) in PR #1617's script)
VIOLATIONS = {
    "train_before_score": ("run_score_first", rf"^\(3\) trained on val positions .*: {TTT}", {"run_causal"}, [(
        "        is_last_chunk = ci == num_chunks - 1\n",
        "        chunk_start, chunk_end = chunk_end, min(chunk_end + ttt_chunk, total_tokens)\n"
        "        is_last_chunk = ci == num_chunks - 1\n")]),
    "rescore_after_adapting": ("run_single_pass", rf"^\(4\) {TTT} .*, with a training step between$", {"run_causal"}, [(
        "    for ci in range(num_chunks):\n", "    for ci in [c for c in range(num_chunks) for _ in (0, 1)]:\n")]),
    "hashed_ngram_target_only": ("run_normalized", rf"^\(2\) {SLIDING}", set(), [(SCORE_LINE, (
        "                _ng = globals().setdefault('_NGRAM', torch.zeros(2, 4096, dtype=torch.float64))\n"
        "                _prev, _tgt = x_batch[i, score_start:wlen], y_batch[i, score_start:wlen]\n"
        "                _hp, _hc = (_prev * 1009 + _tgt) % 4096, (_prev * 1009) % 4096\n"
        "                _p_ng = (_ng[0][_hp] + 1.0) / (_ng[1][_hc] + 1.0)\n"
        + MIX.format("_p_ng") +
        "                _ng[0].index_add_(0, _hp, torch.ones_like(_p_ng))\n"
        "                _ng[1].index_add_(0, _hc, torch.ones_like(_p_ng))\n"))]),
    # a mixture in logit space (a softmax, so condition 2 holds and needs no sweep) with an expert that
    # boosts the token after the target (read from the val stream, past a window's end too), by an amount
    # that grows with its id (a toy model's logits are nearly equal: a fixed boost moves -log p by < 1e-6)
    "mixture_reads_next_token": ("run_causal", rf"^\(1\) {SLIDING}", set(), [(
        "                logits = base_model.forward_logits(x_batch)\n            nll = F.cross_entropy(\n",
        "                logits = base_model.forward_logits(x_batch)\n"
        "            _at = torch.tensor(batch_ws).unsqueeze(1) + torch.arange(seq_len) + 2\n"
        "            _nxt = val_tokens[_at.clamp(max=total_tokens)].to(torch.int64).unsqueeze(-1)\n"
        "            logits = logits.float().scatter_add(-1, _nxt, _nxt.float() / 128)\n"
        "            nll = F.cross_entropy(\n")]),
    # a target-only cache probability (0.5 for every entry: far from normalized) mixed in only on a multi-process run
    # and after 2,000 tokens scored on this rank (closed PRs #727 and #720 gate theirs so): the probe runs the copy
    # as two ranks and writes a warm-up prefix before the anchored split
    "cache_on_ranks_after_warmup": ("run_normalized", rf"^\(2\) {SLIDING}", set(), [(SCORE_LINE, SCORE_LINE + (
        "                _state = globals().setdefault('_WARM', {'scored_tokens': 0})\n"
        "                _state['scored_tokens'] += wlen - score_start\n"
        "                seen_tokens = _state['scored_tokens']\n"
        "                if world_size > 1:\n"
        "                    if seen_tokens > 2000:\n"
        "                        scored_nll = -torch.log(0.9 * torch.exp(-scored_nll) + 0.1 * 0.5)\n"))]),
    "space_counted_twice": ("run_bytes", r"^pass '[^']+': the bpb denominator is .*, the decoded text", set(), [
        ("            piece = piece[1:]\n", "            piece = ' ' + piece[1:]\n")]),
    "calibration_after_clock": ("run_after_clock", r"^\d+ forward passes on [\d,]+ training tokens after the log's training stop", set(), [(
        "    log0(\n        f\"peak memory allocated:",
        "    with torch.no_grad():\n"
        "        for _ in range(2):\n"
        "            (cx, cy) = train_loader.next_batch(args.train_batch_tokens, args.train_seq_len, grad_accum_steps)\n"
        "            base_model(cx, cy)\n"
        "    log0(\n        f\"peak memory allocated:")]),
}
# Rule breaks in different passes (or rows) share one patched copy: three copies test the seven, so the probe
# runs four scripts, not eight (the gated cache needs two ranks and a warm-up prefix: a copy of its own). A
# break's row names the pass it sits in (the sliding window comes before the TTT pass, so the next-token
# mixture's causality break is the first the probe reports), and every row a copy fails is one its breaks
# may fail; the merged script passes every row (the breaks removed).
COPIES = {"ttt_trains_first": ("train_before_score", "hashed_ngram_target_only", "space_counted_twice",
                               "calibration_after_clock"),
          "ttt_rescores": ("rescore_after_adapting", "mixture_reads_next_token"),
          "ranks_warmup": ("cache_on_ranks_after_warmup",)}
COPY_OF = {name: copy for copy, names in COPIES.items() for name in names}


def patched_folder(tmp_path: Path, patches) -> Path:
    text = PR1617.read_text(encoding="utf-8")
    for old, new in patches:
        assert text.count(old) == 1, old
        text = text.replace(old, new)
    folder = tmp_path / "record"
    folder.mkdir()
    (folder / "train_gpt.py").write_text(text, encoding="utf-8")
    return folder


def probe(folder):
    from tools.auditor.audit_probe import probe_folder

    return {c.name: c for c in probe_folder(folder)}


# -----------------------------------------------------------------------------------------------
# the pieces, without running a script
# -----------------------------------------------------------------------------------------------


def test_record_standins_put_cuda_work_on_the_cpu_in_every_thread():
    import threading

    import torch

    from tools.parity.standins_cuda import record_standins

    got = {}
    with record_standins():
        import triton  # noqa: F401 - the fake, handed to a script (and never to torch itself)

        x = torch.zeros(4, device="cuda", pin_memory=True).cuda()
        with torch.autocast(device_type="cuda", dtype=torch.bfloat16):
            y = torch.ones(2, 3, device="cuda") @ torch.ones(3, 2).to("cuda", non_blocking=True)
        gen = torch.Generator(device=torch.device("cuda", 0))  # a CUDA generator (PR #1019's calibration draws)
        drawn = torch.randint(0, 9, (3,), device="cuda", generator=gen.manual_seed(5))
        worker = threading.Thread(target=lambda: got.update(t=torch.empty(2, device="cuda").device.type))
        worker.start()
        worker.join()
        assert torch.cuda.is_available() and torch.compile(len) is len
        with torch.inference_mode():  # no_grad: no inference tensors for a TTT to reuse in autograd
            cached = torch.ones(3)
        got["ttt"] = (torch.ones(3, requires_grad=True) * cached).sum().requires_grad
        got["bare"] = torch.inference_mode(lambda: torch.is_grad_enabled())()
        props = torch.cuda.get_device_properties(torch.device("cuda", 0))  # the kit's describe_device
        got["props"] = (props.name, props.total_memory, props.multi_processor_count)
    assert x.device.type == "cpu" and y.dtype == torch.bfloat16 and got["t"] == "cpu"
    assert got["props"][0].startswith("CPU stand-in") and got["props"][1] > 0 and got["props"][2] == 132
    assert got["ttt"] and got["bare"] is False and not torch.is_inference_mode_enabled()
    assert isinstance(gen, torch.Generator) and drawn.tolist() == torch.randint(
        0, 9, (3,), generator=torch.Generator().manual_seed(5)).tolist()
    assert not torch.cuda.is_available() or torch.cuda.device_count() > 0


def test_stream_index_locates_rows_and_drops_padding():
    rng = np.random.default_rng(0)
    val = rng.integers(4, 1000, size=500)
    index = T.StreamIndex(val)
    rows = np.stack([val[10:40], np.concatenate([val[470:500], np.zeros(0, int)])])
    assert index.locate(rows).tolist() == [list(range(10, 40)), list(range(470, 500))]
    padded = np.concatenate([val[100:110], [0, 0, 0]])
    assert index.locate(padded).tolist() == list(range(100, 110)) + [-1, -1, -1]


def test_unique_index_needs_a_neighbour_and_places_bos():
    val = np.array([1, 10, 11, 12, 1, 20, 21, 22])
    index = T.UniqueIndex(val, bos=1)
    # two overlapping windows' rows, flattened: the row boundary does not mislead the next row
    assert index.locate(np.array([11, 12, 1, 20, 10, 11, 12, 1])).tolist() == [2, 3, 4, 5, 1, 2, 3, 4]
    assert index.locate(np.array([12, 30, 21, 0])).tolist() == [-1, -1, -1, -1]  # lone tokens: not a run
    assert index.locate(np.array([30, 21, 22, 30])).tolist() == [-1, -1, -1, -1]  # two in a row: not a run
    swept = T.UniqueIndex(np.array([1, 10, 11, 21, 1, 20, 21, 22, 1]), bos=1, override={21: 3})
    assert swept.locate(np.array([10, 11, 21, 1, 20, 21, 22, 1])).tolist() == [1, 2, 3, 4, 5, -1, -1, -1]


def test_unique_index_places_phrase_tokens_by_their_anchors():
    """The val split's phrases repeat (an n-gram cache sees them again); a phrase token takes its index from
    a located anchor beside it, and an anchor followed by a phrase elsewhere (a train row) is not a run."""
    phrase = [50, 51, 52, 53, 54, 55]
    val = np.array([1, *phrase, 10, 11, 12, 13, *phrase, 20, 21, 22, 23])
    index = T.UniqueIndex(val, bos=1)
    assert index.locate(val[7:21]).tolist() == list(range(7, 21))
    assert index.locate(val[9:17]).tolist() == list(range(9, 17))  # the second phrase, by the anchors before it
    assert index.locate(np.array([*phrase, 20, 21, 22])).tolist() == list(range(11, 20))  # by the ones after
    assert index.locate(np.array([13, *phrase, 99])).tolist() == [-1] * 8  # one anchor: not a run of the split


def test_the_toy_split_repeats_phrases_and_no_train_run_is_located(tmp_path):
    sp = pytest.importorskip("sentencepiece").SentencePieceProcessor(
        model_file=str(SHARED / "data" / "tokenizers" / "fineweb_1024_bpe.model")) if (
        SHARED / "data" / "tokenizers").is_dir() else pytest.skip("needs ../shared/data/tokenizers")
    rng = np.random.default_rng(0)
    phrases = D.make_phrases(sp, rng)
    val = D.make_stream(sp, D.VAL_DOCS, D.VAL_DOC_TOKENS, rng, distinct=True, phrases=phrases)
    train = D.make_stream(sp, D.TRAIN_TOKENS // (D.VAL_DOC_TOKENS + 1), D.VAL_DOC_TOKENS, rng, phrases=phrases)
    counts = np.bincount(val)
    assert len(val) == D.VAL_DOCS * (D.VAL_DOC_TOKENS + 1) and counts[phrases].min() >= 3  # contexts seen before
    for stream in (val, D.perturbed(sp, val, int(len(val) * 0.6) | 1)):
        index = T.UniqueIndex(stream, sp.bos_id())
        assert index.locate(stream).tolist() == list(range(len(stream)))
        assert (index.locate(train) < 0).all()
    from shards.format import load_data_shard

    D.write_byte_sidecar(tmp_path, sp, val)  # a CaseOps script's per-token bytes: the decoded text's, in total
    sidecar = load_data_shard(tmp_path / "fineweb_val_bytes_000000.bin")
    assert len(sidecar) == len(val) and int(sidecar.sum()) == D.decoded_bytes(sp, val, np.flatnonzero(val != sp.bos_id()))


def test_tracked_nll_follows_views_masks_and_reductions():
    import torch
    import torch.nn.functional as F

    rng = np.random.default_rng(1)
    val = rng.permutation(np.arange(4, 304))
    trace = T.Trace(val, rng.integers(4, 300, size=300), bos=1)
    T.TRACE, real = trace, T._REAL.setdefault("cross_entropy", F.cross_entropy)
    try:
        y = torch.tensor(np.stack([val[1:33], val[40:72]]))
        nll = T.traced_cross_entropy(torch.randn(64, 310), y.reshape(-1), reduction="none").reshape(2, 32)
        nll[1, 8:].to(torch.float64).sum()  # a window's scored part
        mask = torch.zeros(2, 32, dtype=torch.float64)
        mask[0, :4] = 1
        (nll.to(torch.float64) * mask).sum()  # a masked sum drops the zero-weight positions
        nll.double().where(mask.bool(), 0).sum()  # so do where (the kit's sliding window) and masked_fill
        torch.where(mask.bool(), 0.0, nll).sum()
        nll.masked_fill(~mask.bool(), 0).sum()
    finally:
        T.TRACE = None
    scores = [e for e in trace.events if e["kind"] == "score"]
    assert real is F.cross_entropy or real is T._REAL["cross_entropy"]
    assert scores[0]["pos"] == list(range(48, 72)) and scores[1]["pos"] == [1, 2, 3, 4]
    assert scores[2]["pos"] == scores[4]["pos"] == [1, 2, 3, 4] and len(scores[3]["pos"]) == 60


def test_passes_merge_the_exact_restatement_and_tail_rescoring_warns():
    ev = [{"seq": 0, "kind": "score", "pos": [1, 2, 3], "val": [1.0, 2.0, 3.0]},
          {"seq": 1, "kind": "score", "pos": [3], "val": [3.5]},
          {"seq": 2, "kind": "line", "text": "final val_loss:2.3750 val_bpb:1.2000"},
          {"seq": 3, "kind": "line", "text": "final_exact val_loss:2.37500000 val_bpb:1.20001000"}]
    ps = passes(ev)
    assert len(ps) == 1 and ps[0]["bpb_decimals"] == 8 and ps[0]["scores"][3] == [(0, 3.0), (1, 3.5)]
    assert check_single_pass(ps).status == "warn"
    ps[0]["trains"].append((0.5, [3]))  # a training step between the two scores of position 3
    assert check_single_pass(ps).status == "fail"
    ev[1]["pos"] = [1]  # the first position again: not the tail
    assert check_single_pass(passes(ev)).status == "fail"


def test_a_printed_result_the_trace_does_not_explain_is_named():
    """PR #779 mixes n-gram probabilities in numpy and prints that pass with no traced -log p; PR #982's
    n-gram pass logs a val_loss that is not the mean of its traced -log p: the scoring left torch."""
    ev = [{"seq": 0, "kind": "score", "pos": [1, 2], "val": [1.0, 3.0]},
          {"seq": 1, "kind": "line", "text": "sliding val_loss:2.0000 val_bpb:1.0000"},
          {"seq": 2, "kind": "line", "text": "sliding_exact val_loss:2.00000000 val_bpb:1.00004000"}]
    assert T is not None and untraced_results(ev, passes(ev)) == []  # a restatement of a traced pass
    ev.append({"seq": 3, "kind": "line", "text": "ngram val_loss:1.2000 val_bpb:0.6000"})
    assert untraced_results(ev, passes(ev)) == ["'ngram val_loss:1.2000 val_bpb:0.6000' has no traced -log p behind it"]
    ev[1]["text"], ev[2]["text"] = "sliding val_loss:1.5000 val_bpb:1.0000", "sliding_exact val_loss:1.5 val_bpb:1.0"
    assert "pass 'sliding' logs val_loss 1.5 where its traced -log p average 2.000000" in untraced_results(
        ev[:3], passes(ev[:3]))


def test_after_clock_reads_the_log_for_a_reserve():
    ev = [{"seq": 0, "kind": "line", "text": "step:3/3 train_loss:2.0 train_time:6ms"},
          {"seq": 1, "kind": "embed", "stream": "train", "tokens": 512, "grad": False}]
    assert check_after_clock(ev).status == "fail"
    ev.insert(0, {"seq": -1, "kind": "line", "text": "gptq:reserving 4s, effective=596000ms"})
    assert check_after_clock(ev).status == "pass"


def test_decoded_bytes_count_a_document_start_without_its_space():
    sp = pytest.importorskip("sentencepiece").SentencePieceProcessor(
        model_file=str(SHARED / "data" / "tokenizers" / "fineweb_1024_bpe.model")) if (
        SHARED / "data" / "tokenizers").is_dir() else pytest.skip("needs ../shared/data/tokenizers")
    ids = sp.encode("Hello world, this is a test.")
    val = np.array([sp.bos_id(), *ids, sp.bos_id(), *ids])
    n = len(ids)
    assert D.decoded_bytes(sp, val, range(1, len(val))) == 2 * len("Hello world, this is a test.")
    assert D.decoded_bytes(sp, val, [n + 2 + 3]) == len(sp.id_to_piece(ids[3]).replace("\u2581", " ").encode())


def test_the_probe_runs_a_folder_with_the_settings_its_readme_runs(tmp_path):
    """Features off by default and switched on in the README's command (closed PR #887's NGRAM_ENABLED=1, PR
    #1992's PREQUANT_TTT_ENABLED=1) are probed on; the toy size, the data paths and shell values stay the probe's."""
    from tools.auditor.audit_probe import declared_settings, probe_env

    source = "".join(f"x = os.environ.get('{n}', '0')\n" for n in (
        "NGRAM_ENABLED", "NGRAM_ORDER", "ITERATIONS", "DATA_PATH", "EXTRA_PATH", "SEED", "TTT_ENABLED", "RECUR_START_STEP"))
    (tmp_path / "README.md").write_text("## Run\n```bash\nRUN_ID=s1 SEED=42 NGRAM_ENABLED=1 NGRAM_ORDER=7 RECUR_START_STEP=3000 \\\n"
                                        "  ITERATIONS=9000 DATA_PATH=./data/x EXTRA_PATH=$HOME UNREAD=1 \\\n"
                                        "  torchrun --standalone --nproc_per_node=8 train_gpt.py\n```\n"
                                        "TTT_ENABLED=1 torchrun train_gpt.py\n")
    declared = declared_settings(tmp_path, source)
    assert declared == {"NGRAM_ENABLED": "1", "NGRAM_ORDER": "7", "RECUR_START_STEP": "2"}  # the first command only;
    # a schedule step of the real run lands on the toy's last step
    env = probe_env(source, Path("data"), Path("tok.model"), 1024, declared)
    assert env["NGRAM_ENABLED"] == "1" and env["ITERATIONS"] == "3" and env["DATA_PATH"] == "data"
    assert declared_settings(tmp_path / "none", source) == {}


def test_an_empty_script_is_named_not_run(tmp_path):
    """A 0-byte train_gpt.py (merged non-record SwiGLU_WarmdownFix) is not checkable because it is empty, not
    because no eval pass was traced."""
    from tools.auditor.audit_probe import probe_folder

    (tmp_path / "train_gpt.py").write_text("\n")
    (tmp_path / "shared" / "data" / "tokenizers").mkdir(parents=True)  # refused before a tokenizer is read
    checks = probe_folder(tmp_path, shared=tmp_path / "shared")
    assert {c.status for c in checks} == {"n/a"}
    assert all("train_gpt.py is empty" in c.evidence for c in checks), [c.evidence for c in checks]


def test_sweep_reads_a_pull_request_head_whose_model_blob_is_absent(tmp_path):
    """A snapshot lists a PR head's model file without its blob (git archive fails on it): the folder is
    still extracted, the model left out; a folder the head deletes is not one of its folders."""
    import subprocess

    from tools.auditor.audit_probe_sweep import extract, pr_folders

    work, bare = tmp_path / "work", tmp_path / "snap.git"
    git = ["git", "-c", "user.name=t", "-c", "user.email=t@t", "-C", str(work)]
    rec = work / "records" / "track_10min_16mb"
    (rec / "old").mkdir(parents=True)
    (rec / "old" / "train_gpt.py").write_text("print('old')\n")
    subprocess.run(["git", "init", "-q", "-b", "main", str(work)], check=True)
    subprocess.run([*git, "add", "-A"], check=True)
    subprocess.run([*git, "commit", "-qm", "base"], check=True)
    (rec / "new").mkdir()
    (rec / "new" / "train_gpt.py").write_text("print('new')\n")
    (rec / "new" / "final_model.ptz").write_bytes(b"weights" * 10)
    subprocess.run([*git, "rm", "-rq", str(rec / "old")], check=True)
    subprocess.run([*git, "add", "-A"], check=True)
    subprocess.run([*git, "commit", "-qm", "head"], check=True)
    subprocess.run(["git", "clone", "-q", "--bare", str(work), str(bare)], check=True)
    subprocess.run(["git", "--git-dir", str(bare), "update-ref", "refs/pull/7/head", "main"], check=True)
    subprocess.run(["git", "--git-dir", str(bare), "update-ref", "refs/heads/main", "main~1"], check=True)
    blob = subprocess.run(["git", "--git-dir", str(bare), "rev-parse", "refs/pull/7/head:records/track_10min_16mb/"
                           "new/final_model.ptz"], capture_output=True, text=True, check=True).stdout.strip()
    for pack in list((bare / "objects" / "pack").glob("*.pack")):  # loose objects, then drop the model's blob
        moved = pack.rename(tmp_path / pack.name)
        pack.with_suffix(".idx").unlink()
        with open(moved, "rb") as fh:
            subprocess.run(["git", "--git-dir", str(bare), "unpack-objects", "-q"], stdin=fh, check=True)
    (bare / "objects" / blob[:2] / blob[2:]).unlink()
    assert pr_folders(bare, "main", 7) == ["records/track_10min_16mb/new"]
    got = extract(bare, "refs/pull/7/head", "records/track_10min_16mb/new", tmp_path / "out")
    assert (got / "train_gpt.py").read_text() == "print('new')\n" and not (got / "final_model.ptz").exists()


# -----------------------------------------------------------------------------------------------
# the record's own script, run
# -----------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def probed(tmp_path_factory):
    """{copy name: {check: Check}} for the merged script ("merged") and each copy of COPIES, each probed
    once per test session (module scope; `--dist loadfile` keeps this file on one worker)."""
    got = {}

    def probe_copy(name: str) -> dict:
        if name not in got:
            patches = [p for v in COPIES.get(name, ()) for p in VIOLATIONS[v][3]]
            got[name] = probe(patched_folder(tmp_path_factory.mktemp(name), patches))
        return got[name]
    return probe_copy


@pytest.mark.slow
@needs_reference
def test_the_merged_script_passes_every_condition(probed):
    checks = probed("merged")
    assert {k: c.status for k, c in checks.items()} == {
        "run_causal": "pass", "run_normalized": "pass", "run_score_first": "pass",
        "run_single_pass": "warn",  # its sliding window scores the last positions again (tail windows)
        "run_bytes": "pass", "run_after_clock": "pass"}, json.dumps({k: c.evidence for k, c in checks.items()})


@pytest.mark.slow
@needs_reference
@pytest.mark.parametrize("name", sorted(VIOLATIONS))
def test_each_rule_break_fails_its_condition(probed, name):
    check, marker, _, _ = VIOLATIONS[name]
    checks = probed(COPY_OF[name])
    assert checks[check].status == "fail" and re.search(marker, checks[check].evidence), checks[check].evidence
    may_fail = {r for v in COPIES[COPY_OF[name]] for r in {VIOLATIONS[v][0], *VIOLATIONS[v][2]}}
    assert {k for k, c in checks.items() if c.status == "fail"} <= may_fail, {
        k: c.evidence for k, c in checks.items() if c.status == "fail"}


@pytest.mark.slow
@pytest.mark.skipif(not (SHARED / "data" / "tokenizers").is_dir(), reason="needs ../shared/data/tokenizers")
def test_the_kits_own_packed_script_passes_every_condition(tmp_path):
    """The train_gpt.py tools/bundle.py packs (what tools/make_record.py ships) runs under the stand-ins
    (torch.cuda.get_device_properties; its FLOP count on the meta device is not traced) and passes."""
    import subprocess
    import sys

    kit = Path(__file__).resolve().parents[1]
    subprocess.run([sys.executable, str(kit / "tools" / "bundle.py"), "--out", str(tmp_path)], check=True,
                   capture_output=True)
    (tmp_path / "train_gpt_human.py").unlink()
    checks = probe(tmp_path)
    assert {k: c.status for k, c in checks.items()} == dict.fromkeys(checks, "pass"), json.dumps(
        {k: c.evidence for k, c in checks.items()})
