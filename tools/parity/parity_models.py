"""The kit's GPT and a record's GPT with the same weights, run on the same document-packed batches (CPU, float32).

The record's model is built from its own script (standins.import_script) with `h` from the kit's settings
(parity_config.record_hparams) and the kit model's weights (parity_map.load_kit_into_record). The record trains
on one packed row with cu_seqlens from its own `_build_cu_seqlens`; the kit on [B, T] rows with its
document mask. `compare_forward` runs both, row by row for the record, and returns the differences.
"""

from pathlib import Path

import torch

from model.gpt import GPT, build_model_config
from primitives.settings import Hyperparameters
from tools.parity.parity_config import record_hparams
from tools.parity.parity_map import load_kit_into_record, record_to_kit
from tools.parity.standins import cpu_standins

REFERENCE_DIR = Path(__file__).resolve().parents[3] / "shared" / "reference"
PR1855_SCRIPT = REFERENCE_DIR / "pr1855" / "train_gpt.py"
PR1617_SCRIPT = REFERENCE_DIR / "pr1617" / "train_gpt.py"
# toy widths that keep PR #1855's structure (11 layers, loops 3-5, lanes from 8, gates): d 32, 4/2 heads of 8
TOY_ENV = {"MODEL_DIM": "32", "NUM_HEADS": "4", "NUM_KV_HEADS": "2", "ROPE_DIMS": "4", "VOCAB_SIZE": "64",
           "TRAIN_SEQ_LEN": "64", "EVAL_STRIDE": "16"}
BOS_ID = 1


def toy_settings(preset: str = "8xh100-pr1855", **env) -> Hyperparameters:
    """The preset's settings at TOY_ENV's widths (env: more overrides, as environment strings)."""
    return Hyperparameters.from_env({"PRESET": preset, **TOY_ENV, **env}, log=lambda *_: None)


def kit_model(hp: Hyperparameters, seed: int = 0, noise: float = 0.3) -> GPT:
    """The kit's float32 GPT for hp: its own init, then every parameter plus N(0, noise^2) (zero-initialized
    projections, gates and lambdas would otherwise hide their paths). The init draws from torch's global RNG: seeded
    with `seed` inside a forked RNG, so the weights do not depend on what ran before and the caller's stream is kept."""
    gen = torch.Generator().manual_seed(seed)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = GPT(**build_model_config(hp))
        model.init_weights(hp.tied_embed_init_std)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * noise)
    return model


def record_model(module, kit: GPT, hp: Hyperparameters):
    """The record script's GPT (float32) with `kit`'s weights (its `h` kept as .parity_h), its fused CE off (the
    Triton CE checks CUDA tensors in Python before any kernel: its stand-in is compared on its own,
    tests/test_parity_standins.py)."""
    module.BOS_ID = BOS_ID
    h = record_hparams(module, hp, fused_ce_enabled=False)
    model = module.GPT(h).float()
    model.parity_h = h  # the record's settings, for its Optimizers (parity_train.py)
    load_kit_into_record(model, kit, hp.num_layers)
    return model


def pr1617_model(module, kit: GPT, hp: Hyperparameters):
    """PR #1617's GPT (float32) for the kit's settings hp with `kit`'s weights: its tensors have the kit's names
    (its stack is the kit's origin), so the state dict loads as it is (strict). Its MLP_MULT is a whole number
    (its hidden width mlp_mult * dim must be one)."""
    model = module.GPT(vocab_size=hp.vocab_size, num_layers=hp.num_layers, model_dim=hp.model_dim,
                       num_heads=hp.num_heads, num_kv_heads=hp.num_kv_heads, mlp_mult=int(hp.mlp_mult),
                       rope_dims=hp.rope_dims, tie_embeddings=hp.tie_embeddings,
                       tied_embed_init_std=hp.tied_embed_init_std, logit_softcap=hp.logit_softcap,
                       rope_base=hp.rope_base, qk_gain_init=hp.qk_gain_init, xsa_last_n=hp.xsa_last_n,
                       parallel_residual_start=hp.parallel_residual_start).float()
    model.load_state_dict(kit.state_dict(), strict=True)
    return model


def packed_batch(batch: int, seq_len: int, vocab: int, doc_starts: list, seed: int = 0):
    """(x, y) int64 [batch, seq_len]: random tokens (never BOS) with BOS at doc_starts[b] (positions of x's row b,
    so each row holds several documents); y is x shifted by one as in the shards."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(BOS_ID + 1, vocab, (batch, seq_len + 1), generator=gen)
    for b, starts in enumerate(doc_starts):
        ids[b, list(starts)] = BOS_ID
    return ids[:, :-1], ids[:, 1:]


def record_rows(module, x: torch.Tensor, fn) -> list:
    """[fn(b, cu_seqlens, max_seqlen) for each row b of x], the documents cut as the record's loader cuts them
    (its _build_cu_seqlens on the row's BOS positions, documents longer than the row split at its length)."""
    out = []
    for b in range(x.size(0)):
        bos = (x[b] == BOS_ID).nonzero().flatten().tolist()
        cu, max_seqlen = module._build_cu_seqlens(bos, x.size(1), x.device, x.size(1), 64)
        out.append(fn(b, cu, max_seqlen))
    return out


def compare_forward(module, kit: GPT, record, x: torch.Tensor, y: torch.Tensor, looping: bool) -> dict:
    """Both models on (x, y): {"logits": max |diff| of the eval-mode softcapped logits, "loss": |diff| of the
    train-mode loss (the record's fused Triton MLP through its stand-in), "grad": max over parameters of
    max |diff| / max |grad| after that loss's backward, mapped to the kit's names}."""
    kit.looping_active = record.looping_active = looping
    with cpu_standins():
        kit.eval(), record.eval()
        with torch.no_grad():
            ref = torch.cat(record_rows(module, x, lambda b, cu, n: record.forward_logits(x[b:b + 1], cu_seqlens=cu,
                                                                                              max_seqlen=n)))
            logits_diff = (ref - kit.forward_logits(x)).abs().max().item()
        kit.train(), record.train()
        kit.zero_grad(), record.zero_grad()
        rows = record_rows(module, x, lambda b, cu, n: record(x[b:b + 1], y[b:b + 1], cu_seqlens=cu, max_seqlen=n))
        loss_ref = sum(rows) / len(rows)  # equal rows: the mean over all tokens
        loss = kit(x, y)
        (loss_ref + loss).backward()
    grads = record_to_kit({n: p.grad for n, p in record.named_parameters()}, len(kit.blocks))
    grad_diff = max(((grads[n] - p.grad).abs().max() / p.grad.abs().max().clamp_min(1e-30)).item()
                    for n, p in kit.named_parameters())
    return {"logits": logits_diff, "loss": abs(loss_ref.item() - loss.item()), "grad": grad_diff}
