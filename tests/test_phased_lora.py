"""TTT_MODE=phased_lora (PR #1855's phased TTT, eval/phased_lora.py) in the kit's engine: the ledger accepts the
record's order (documents longest batch first, side by side, global SGD on the scored prefix between phases) and
refuses a global SGD that reaches a document not yet scored; untrained, the score is each document's own forward;
bad settings are refused naming the variable. Its parity with the record's script: tests/test_parity_ttt.py."""

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from eval.ttt_modes import TTT_MODES, run_mode
from model.gpt import GPT
from primitives.settings import Hyperparameters

DOC_LENS = [12, 30, 7, 25, 18, 9, 22]
SETTINGS = dict(lora_chunk_tokens=4, batch_docs=2, prefix_docs=5, phases=2, chunk_tokens=32, batch_seqs=1, lora_rank=2,
                lora_lr=0.01, lr=0.01)


def tiny_gpt(seed: int = 0) -> GPT:
    torch.manual_seed(seed)
    model = GPT(vocab_size=32, num_layers=3, model_dim=16, num_heads=2, num_kv_heads=1, mlp_mult=2, rope_dims=4,
                num_loops=1, loop_start=1, loop_end=1, doc_packed_attention=True)
    model.init_weights()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.2)
    return model.eval()


def stream(lens=DOC_LENS) -> torch.Tensor:
    gen = torch.Generator().manual_seed(0)
    return torch.cat([torch.cat([torch.tensor([1]), torch.randint(2, 32, (n - 1,), generator=gen)]) for n in lens])


def run(model, tokens, **over):
    luts = [torch.ones(len(tokens), dtype=torch.int32)]
    return run_mode("phased_lora", model, tokens, luts, seq_len=32, stride=8, epochs=over.pop("epochs", 1),
                    log=lambda *_: None, **{**SETTINGS, **over})


def test_the_ledger_accepts_the_records_order():
    tokens = stream()
    res = run(tiny_gpt(), tokens)
    chunks = res["chunks"]  # run_mode returns only after the engine's legality check of the whole ledger passed
    assert res["num_scored_tokens"] == len(tokens) - 1 and res["phases"] == 2 and res["num_documents"] == len(DOC_LENS)
    first = min(chunks, key=lambda c: (c["scored_at_step"], c["round"]))
    assert first["document"] == DOC_LENS.index(max(DOC_LENS))  # the batch of the longest documents runs first
    steps = [c["scored_at_step"] for c in chunks]
    assert steps != sorted(steps)  # not stream order: the documents run by length
    trained = [c for c in chunks if c["first_update_step"] is not None]
    assert trained and all(c["first_update_step"] > c["scored_at_step"] for c in trained)


def test_a_global_sgd_on_a_document_not_yet_scored_is_refused(monkeypatch):
    schedule = TTT_MODES["phased_lora"].schedule

    def leaky(run_):
        sched = schedule(run_)
        last_scored = {c for r in sched.rounds[-1:] for _, c, _ in r}
        late_doc = next(d for d, (lo, hi) in enumerate(sched.docs) if lo <= sched.bounds[min(last_scored)] < hi)
        first_pause = min(sched.pauses)
        sched.pauses[first_pause] = [late_doc] + sched.pauses[first_pause]  # a document the last round scores
        return sched

    monkeypatch.setitem(TTT_MODES, "phased_lora", dataclasses.replace(TTT_MODES["phased_lora"], schedule=leaky))
    with pytest.raises(ValueError, match="TTT illegal"):
        run(tiny_gpt(), stream())


def test_untrained_the_score_is_each_documents_own_forward():
    """No adapter step and no global SGD: every document (none longer than the window) is scored by the model on
    its own tokens, chunk by chunk through the adapters' path (B = 0 adds nothing)."""
    tokens, model = stream(), tiny_gpt()
    res = run(model, tokens, epochs=0, prefix_docs=0)
    nll, start = 0.0, 0
    with torch.no_grad():
        for n in DOC_LENS:
            doc = tokens[start:start + n + 1]
            logits = model.forward_logits(doc[None, :-1])[0]
            nll += F.cross_entropy(logits.float(), doc[1:], reduction="sum").item()
            start += n
    assert res["val_loss"] == pytest.approx(nll / (len(tokens) - 1), rel=1e-6)


def test_bad_settings_are_refused_naming_the_variable():
    with pytest.raises(ValueError, match=r"^run_phased_lora_ttt: .*TTT_LORA_BETA1=1.0.*betas in \[0, 1\)"):
        run(tiny_gpt(), stream(), lora_beta1=1.0)
    with pytest.raises(ValueError, match="TTT_LORA_ALPHA"):
        Hyperparameters.from_env({"RUN_ID": "x", "TTT_ENABLED": "1", "TTT_MODE": "phased_lora", "TTT_LORA_ALPHA": "0"},
                                 log=lambda *_: None)
