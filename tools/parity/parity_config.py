"""PR #1855's hyperparameters against the kit's settings: the documented map, both ways.

`RECORD_TO_KIT` maps each `Hyperparameters:` key the record's log prints to the kit setting of the same
meaning (a name, or (name, kit value -> record value)), `QUANT_RECORD_TO_KIT` its quantizer's keys to the
kit's QuantPolicy (the QUANT_* settings); `NOT_APPLICABLE` lists the keys that are not
settings of a model or run (paths, launch, per-run choices) with the reason; `PENDING` the keys whose
feature the kit does not have yet, with what brings it. Every log key is in exactly one of the four
(tests/test_parity_config.py checks it against train_seed42.log).
"""

import types
from pathlib import Path

RECORD_TO_KIT = {
    **{k: k for k in (
        "adam_eps", "adam_wd", "beta1", "beta2", "ema_decay", "embed_lr", "enable_looping_at", "eval_stride",
        "gate_window", "grad_clip_norm", "iterations", "ln_scale", "logit_softcap", "loop_end", "loop_start",
        "matrix_lr", "max_wallclock_seconds", "min_lr", "mlp_mult", "model_dim", "muon_backend_steps", "muon_momentum",
        "muon_momentum_warmup_start", "muon_momentum_warmup_steps", "muon_row_normalize", "muon_wd", "num_heads",
        "num_kv_heads", "num_layers", "num_loops", "parallel_final_lane", "parallel_start_layer", "qk_gain_init",
        "rope_base", "rope_dims", "scalar_lr", "skip_gates_enabled", "smear_gate_enabled", "sparse_attn_gate_enabled",
        "sparse_attn_gate_scale", "tie_embeddings", "tied_embed_init_std", "tied_embed_lr", "train_batch_tokens",
        "train_log_every", "train_seq_len", "val_loss_every", "vocab_size", "warmdown_frac", "warmup_steps",
        "xsa_last_n", "gptq_reserve_seconds", "embed_wd", "caseops_enabled")},
    "eval_seq_len": "train_seq_len",  # the kit evaluates at TRAIN_SEQ_LEN
    "val_batch_tokens": "val_batch_size",
    "gptq_calibration_batches": "gptq_calib_batches",
    "val_doc_fraction": ("val_max_tokens", lambda v: 1.0 if v == 0 else None),  # 0 = the whole val split
    "sparse_attn_gate_init_std": ("sparse_attn_gate_enabled", lambda v: 0.0),  # the kit's gate: zero init
    # the phased LoRA TTT (TTT_MODE=phased_lora, eval/phased_lora.py)
    **{k: k for k in ("ttt_enabled", "ttt_lora_lr", "ttt_lora_rank")},
    "ttt_batch_size": "ttt_lora_batch_docs", "ttt_chunk_size": "ttt_lora_chunk_tokens", "ttt_beta1": "ttt_lora_beta1",
    "ttt_beta2": "ttt_lora_beta2", "ttt_weight_decay": "ttt_lora_wd", "ttt_k_lora": "ttt_lora_k",
    "ttt_mlp_lora": "ttt_lora_mlp", "ttt_o_lora": "ttt_lora_o", "ttt_grad_steps": "ttt_epochs",
    "ttt_eval_seq_len": "train_seq_len", "phased_ttt_num_phases": "ttt_phases", "phased_ttt_prefix_docs": "ttt_prefix_docs",
    "global_ttt_lr": "ttt_lr", "global_ttt_momentum": "ttt_momentum", "global_ttt_epochs": "ttt_global_epochs",
    "global_ttt_chunk_tokens": "ttt_chunk_tokens", "global_ttt_batch_seqs": "ttt_batch_seqs",
    "global_ttt_grad_clip": "ttt_grad_clip",
    # the global SGD attends within documents as the model does (DOC_PACKED_ATTENTION)
    "global_ttt_respect_doc_boundaries": "doc_packed_attention",
    # the kit's global SGD has no warmup: the record's 0 warmup chunks (its start lr then unused)
    "global_ttt_warmup_chunks": ("ttt_lr", lambda v: 0), "global_ttt_warmup_start_lr": ("ttt_lr", lambda v: 0.0),
}

def _sdclip_k(field: str):
    return lambda q: getattr(q, field) if q.sdclip else None


# the record's quantizer keys -> the value the kit's QuantPolicy q implies (QUANT_* settings, which a preset sets through
# primitives/presets.py PRESET_QUANT); SDClip's k only means the record's clip_sigmas with QUANT_SDCLIP on
QUANT_RECORD_TO_KIT = {
    "matrix_bits": lambda q: q.attn_bits if q.attn_bits == q.mlp_bits else (q.attn_bits, q.mlp_bits),
    "embed_bits": lambda q: q.embed_bits,
    **{key: _sdclip_k(field) for key, field in (
        ("attn_clip_sigmas", "sdclip_k_attn"), ("mlp_clip_sigmas", "sdclip_k_mlp"), ("embed_clip_sigmas", "sdclip_k_embed"),
        ("matrix_clip_sigmas", "sdclip_k_other"))},
    "gated_attn_quant_gate": lambda q: q.gate_int8,
    "lqer_enabled": lambda q: q.lqer, "lqer_rank": lambda q: q.lqer_rank, "lqer_top_k": lambda q: q.lqer_top_n,
    "lqer_asym_enabled": lambda q: q.lqer_asym,
    "lqer_factor_bits": lambda q: 4, "lqer_asym_group": lambda q: 64,  # quant/lqer.py: int4 factors, LQER_GROUP 64
}

_PATH = "a path on the record's machine (the kit: DATA_PATH, TOKENIZER_PATH, OUT_DIR and its run folder)"
_LAUNCH = "set by torchrun for each process (8 ranks), not a setting"
_OFF_GATE = "an alternative output gate the record leaves off (sparse_attn_gate is its gate); the kit does not build it"
NOT_APPLICABLE = {
    **dict.fromkeys(("artifact_dir", "data_dir", "datasets_dir", "tokenizer_path", "train_files", "val_files",
                     "val_bytes_files", "logfile", "model_path", "quantized_model_path", "run_id"), _PATH),
    **dict.fromkeys(("distributed", "is_main_process", "local_rank", "rank", "world_size"), _LAUNCH),
    **dict.fromkeys(("attn_out_gate_enabled", "attn_out_gate_src", "gated_attn_enabled", "gated_attn_init_std"),
                    _OFF_GATE),
    "seed": "a per-run choice (the record's seeds 42, 0, 1234; SEED)",
    "grad_accum_steps": "8 // WORLD_SIZE in the record (1 on 8 GPUs); the kit's GRAD_ACCUM_STEPS=0 also resolves to 1 "
                        "at 8 ranks",
    "fused_ce_enabled": "a kernel choice for the same loss (the kit's LOSS_KERNEL picks its own fused kernel)",
    "rope_train_seq_len": "read only with ROPE_YARN=1; the record runs without YaRN",
    "rope_yarn": "off in the record: plain RoPE, as the kit's",
    "ttt_optimizer": "the adapters' optimizer: phased_lora's is AdamW, the record's 'adam' (its 'sgd' option is not built)",
    "ttt_eval_batches": "a logging filter (which batches' running score the record prints; empty: all), not a setting "
                        "of the score",
}
PENDING = {
    "compressor": "the per-group lrzip/ZPAQ stream (pergroup): not in the kit yet",
}


def read_log_hyperparameters(path) -> dict:
    """{key: printed value} of the `Hyperparameters:` block of a record's train log (two-space indented
    `key: value` lines after it). Raises ValueError naming the file when it has no such block."""
    lines = Path(path).read_text(encoding="utf-8").splitlines()
    if "Hyperparameters:" not in lines:
        raise ValueError(f"{path}: no 'Hyperparameters:' line (expected a record's train log)")
    out = {}
    for line in lines[lines.index("Hyperparameters:") + 1:]:
        if not line.startswith("  ") or ":" not in line:
            break
        key, _, value = line.strip().partition(":")
        out[key] = value.strip()
    return out


def kit_value_as_record(hp, key: str):
    """The record's value of `key` implied by the kit's settings hp (RECORD_TO_KIT)."""
    target = RECORD_TO_KIT[key]
    name, convert = target if isinstance(target, tuple) else (target, None)
    value = getattr(hp, name)
    return convert(value) if convert else value


def printed_matches(printed: str, value) -> bool:
    """Whether the log's printed value equals `value` (bool: True/False, numbers by value, text as is)."""
    if isinstance(value, bool):
        return printed == str(value)
    if isinstance(value, (int, float)):
        try:
            return float(printed) == float(value)
        except ValueError:
            return False
    return printed == str(value)


def log_mismatches(log_values: dict, hp) -> list:
    """['key: log X, kit Y' ...] for every mapped key whose kit value differs, and 'key: not mapped' for a log key
    in none of RECORD_TO_KIT, QUANT_RECORD_TO_KIT, NOT_APPLICABLE and PENDING."""
    out = []
    for key, printed in log_values.items():
        if key in RECORD_TO_KIT:
            value = kit_value_as_record(hp, key)
            if not printed_matches(printed, value):
                out.append(f"{key}: log {printed!r}, kit {value!r}")
        elif key not in NOT_APPLICABLE and key not in PENDING and key not in QUANT_RECORD_TO_KIT:  # quant_log_mismatches
            out.append(f"{key}: not mapped")
    return out


def quant_log_mismatches(log_values: dict, policy) -> list:
    """['key: log X, kit Y' ...] for every QUANT_RECORD_TO_KIT key of the log whose value the kit's QuantPolicy
    differs in."""
    return [f"{key}: log {log_values[key]!r}, kit {convert(policy)!r}" for key, convert in QUANT_RECORD_TO_KIT.items()
            if key in log_values and not printed_matches(log_values[key], convert(policy))]


def record_hparams(module, hp, **overrides) -> types.SimpleNamespace:
    """The record's `h` (what its GPT and Optimizers read) for the kit's settings hp: the record script's class
    defaults (module.Hyperparameters), every RECORD_TO_KIT key from hp, then overrides."""
    cls = module.Hyperparameters
    h = types.SimpleNamespace(**{k: getattr(cls, k) for k in dir(cls) if not k.startswith("__")})
    for key in RECORD_TO_KIT:
        value = kit_value_as_record(hp, key)
        if value is not None:
            setattr(h, key, value)
    for key, value in overrides.items():
        setattr(h, key, value)
    return h
