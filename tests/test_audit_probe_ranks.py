"""The run probe's gates of eval-time caches, without running a record: scripts whose eval code branches on the
world size run as two ranks (tools/auditor/audit_probe_ranks.py) and their events merge at the collectives;
a cache that waits for N scored tokens gets a warm-up prefix of N tokens before the anchored val split
(tools/auditor/audit_probe_data.py), located by its 4-grams."""

from pathlib import Path

import numpy as np
import pytest

from tools.auditor import audit_probe_data as D
from tools.auditor import audit_probe_trace as T
from tools.auditor.audit_probe_ranks import merge_ranks, probe_world_size, rank_env, world_size_branches

SHARED = Path(__file__).resolve().parents[2] / "shared"

PR727_LIKE = '''
def eval_val_sliding(args, model, rank, world_size):
    _ngram_default = "1" if world_size > 1 else "0"
    return _ngram_default
'''
ALL_REDUCE_ONLY = '''
def eval_val(args, model, rank, world_size, loss_sum):
    if world_size > 1:
        dist.all_reduce(loss_sum)
    return loss_sum
'''
TRAINING_ONLY = '''
def main(world_size):
    mode = "ddp" if world_size > 1 else "single"
    return mode
'''


def test_an_eval_branch_on_the_world_size_asks_for_two_ranks():
    assert world_size_branches(PR727_LIKE) == [("eval_val_sliding", 3, "world_size > 1")]
    assert probe_world_size(PR727_LIKE) == 2
    # summing over ranks computes the same on one process; a branch outside eval code is not an eval path
    assert probe_world_size(ALL_REDUCE_ONLY) == 1 and probe_world_size(TRAINING_ONLY) == 1
    assert probe_world_size("def eval_val(:\n") == 1
    env = rank_env({"PATH": "/bin"}, 1, 2, 29501)
    assert (env["RANK"], env["LOCAL_RANK"], env["WORLD_SIZE"], env["MASTER_PORT"], env["PATH"]) == ("1", "1", "2", "29501", "/bin")


def _run(*events):
    return {"events": [{"seq": i, **e} for i, e in enumerate(events)], "error": None}


def test_ranks_merge_at_their_collectives_with_rank_zeros_lines():
    rank0 = _run({"kind": "score", "pos": [1, 2]}, {"kind": "sync", "op": "all_reduce"},
                 {"kind": "line", "text": "final val_loss:1 val_bpb:1"}, {"kind": "train", "pos": [1, 2]},
                 {"kind": "sync", "op": "all_reduce"})
    rank1 = _run({"kind": "score", "pos": [3, 4]}, {"kind": "line", "text": "rank 1 says"},
                 {"kind": "sync", "op": "all_reduce"}, {"kind": "train", "pos": [3, 4]},
                 {"kind": "sync", "op": "all_reduce"})
    got = merge_ranks([rank0, rank1])
    kinds = [(e["kind"], e.get("rank"), e.get("pos") or e.get("text")) for e in got["events"]]
    assert kinds == [("score", 0, [1, 2]), ("score", 1, [3, 4]), ("sync", None, None),
                     ("line", 0, "final val_loss:1 val_bpb:1"), ("train", 0, [1, 2]), ("train", 1, [3, 4]),
                     ("sync", None, None)]
    assert [e["seq"] for e in got["events"]] == list(range(7)) and got["ranks"] == 2
    assert merge_ranks([rank0, {"error": "rank 1 stopped"}]) == {"error": "rank 1 stopped"}


HEDGE_LIKE = '''
class Mixer:
    def mix_and_score(self, logits):
        if self.total_tokens < 10000:
            return logits
        return logits * 2

def eval_val(model, seen):
    if seen > 2:  # below the smallest threshold counted
        return 1
'''


def test_a_cache_waiting_for_scored_tokens_names_its_threshold():
    assert D.warmup_tokens(HEDGE_LIKE) == 10_000
    assert D.warmup_tokens(HEDGE_LIKE.replace("10000", "500000")) == 0  # over WARMUP_MAX_TOKENS: not written
    assert D.warmup_tokens("def train(step):\n    return step < 5000\n") == 0
    assert D.warmup_tokens("def eval_val(:\n") == 0


@pytest.mark.skipif(not (SHARED / "data" / "tokenizers").is_dir(), reason="needs ../shared/data/tokenizers")
def test_the_warm_up_prefix_keeps_the_anchors_unique_and_is_located_by_its_4_grams():
    import sentencepiece as spm

    sp = spm.SentencePieceProcessor(model_file=str(D.challenge_tokenizer(1024, SHARED)))
    rng = np.random.default_rng(0)
    phrases = D.make_phrases(sp, rng)
    val = D.make_stream(sp, D.VAL_DOCS, D.VAL_DOC_TOKENS, rng, distinct=True, phrases=phrases)
    prefix = D.make_filler(sp, val, phrases, 3000, rng)
    full = np.concatenate([prefix, val])
    assert len(prefix) >= 3000 and not np.isin(prefix, val[np.bincount(val)[val] == 1]).any()
    assert not np.isin(phrases, prefix).any()  # a phrase's repeats would make the prefix's 4-grams ambiguous
    index = T.ValIndex(full, sp.bos_id(), len(prefix))
    located = wrong = total = 0
    starts = np.arange(0, len(full) - 129, 32)
    for batch in np.array_split(starts, len(starts) // 8):  # sliding windows of 128 targets, 8 rows a batch
        pos = index.locate(np.stack([full[b + 1:b + 129] for b in batch])).reshape(-1)
        truth = np.concatenate([np.arange(b + 1, b + 129) for b in batch])
        total, located, wrong = total + len(pos), located + (pos >= 0).sum(), wrong + (pos[pos >= 0] != truth[pos >= 0]).sum()
    assert wrong == 0 and located >= 0.995 * total, (located, total)
    plain = T.ValIndex(full, sp.bos_id(), 0)  # without the 4-grams: only the prefix's pieces drawn once place it
    windows = [full[s + 1:s + 129] for s in range(0, len(prefix) - 129, 32)]
    assert sum((plain.locate(w) >= 0).sum() for w in windows) < 0.9 * sum((index.locate(w) >= 0).sum() for w in windows)
