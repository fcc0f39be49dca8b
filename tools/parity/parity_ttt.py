"""The eval stage of the PR #1855 parity: its phased score-first TTT (eval_val_ttt_phased, on CPU stand-ins) against
the kit's TTT_MODE=phased_lora (eval/phased_lora.py) on the same weights, val tokens and bytes.

Both models start from the same float32 weights (parity_models.record_model copies the kit's through the name map;
each eval adapts its own copy in place). The val stream is documents of given lengths, each starting with BOS;
its bytes are a CaseOps-style sidecar (a byte count per token position) or the three byte LUTs. The record's
adapters are drawn from torch's global generator, the kit's from its own seeded with eval.record_lora.RECORD_LORA_SEED:
the harness seeds the global one with it, so both hold the same adapters. Returns both val_bpb values.
"""

import os
import types

import torch

from eval.record_lora import RECORD_LORA_SEED
from eval.ttt_modes import mode_settings, run_mode
from tools.parity.parity_config import record_hparams
from tools.parity.parity_models import BOS_ID, record_model
from tools.parity.standins import cpu_standins


def val_documents(doc_lens: list, vocab: int, seed: int = 0) -> torch.Tensor:
    """int64 [sum(doc_lens)]: documents of doc_lens tokens, each a BOS then random non-BOS tokens."""
    gen = torch.Generator().manual_seed(seed)
    parts = [torch.cat([torch.tensor([BOS_ID]), torch.randint(BOS_ID + 1, vocab, (n - 1,), generator=gen)])
             for n in doc_lens]
    return torch.cat(parts)


def byte_sidecar(num_tokens: int, seed: int = 0) -> torch.Tensor:
    """int32 [num_tokens]: 0..4 bytes per token position (a CaseOps sidecar's form: shards/sidecar.py)."""
    return torch.randint(0, 5, (num_tokens,), generator=torch.Generator().manual_seed(seed), dtype=torch.int32)


def byte_luts(vocab: int, seed: int = 0) -> list:
    """The official three tables for a toy vocabulary: base bytes int16 [V] (1..4), has_leading_space and
    is_boundary_token bool [V]."""
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(1, 5, (vocab,), generator=gen).to(torch.int16), torch.rand(vocab, generator=gen) < 0.5,
            torch.rand(vocab, generator=gen) < 0.2]


def kit_phased_lora(model, hp, tokens: torch.Tensor, luts: list) -> dict:
    """The kit's TTT_MODE=phased_lora result dict (eval/walk.py run_score_first) of hp's settings on model (adapted in place)."""
    return run_mode("phased_lora", model.eval(), tokens, luts, seq_len=hp.train_seq_len, stride=hp.eval_stride,
                    epochs=hp.ttt_epochs, log=lambda *_: None, **mode_settings("phased_lora", hp))


def record_phased_lora(module, record, hp, tokens: torch.Tensor, luts: list) -> tuple:
    """(val_loss, val_bpb) of the record's eval_val_ttt_phased with hp's settings (its `h` through the config map)
    on `record` (its GPT, adapted in place), looping on as its eval sets it; luts: [sidecar] or the three tables."""
    h = record_hparams(module, hp, fused_ce_enabled=False, run_id=f"kit_parity_{os.getpid()}", rank=0, world_size=1)
    sidecar = luts[0] if len(luts) == 1 else None
    tables = luts if sidecar is None else byte_luts(hp.vocab_size)
    val_data = types.SimpleNamespace(val_tokens=tokens, val_bytes=sidecar, caseops_enabled=sidecar is not None,
                                     base_bytes_lut=tables[0], has_leading_space_lut=tables[1],
                                     is_boundary_token_lut=tables[2])
    record.looping_active = hp.num_loops > 0
    module.BOS_ID = BOS_ID
    torch.manual_seed(RECORD_LORA_SEED)
    with cpu_standins():
        return module.eval_val_ttt_phased(h, record, torch.device("cpu"), val_data,
                                          lambda x, y, lora: record.forward_ttt(x, y, lora=lora))


def compare_phased_ttt(module, kit, hp, tokens: torch.Tensor, luts: list) -> dict:
    """Both evals from kit's weights: {"kit": its val_bpb, "record": the record's, "diff": |difference|,
    "kit_result": the kit's result dict}."""
    record = record_model(module, kit, hp)
    ours = kit_phased_lora(kit, hp, tokens, luts)
    _, theirs = record_phased_lora(module, record, hp, tokens, luts)
    return {"kit": ours["val_bpb"], "record": theirs, "diff": abs(ours["val_bpb"] - theirs), "kit_result": ours}
