"""Settings: `Hyperparameters`, every knob of a run, read from env vars with the official names.

The class defaults are the default preset (`1xh100-sp8192`, primitives/presets.py has the evidence);
PRESET picks another group of defaults and explicit variables override it.
"""

import contextlib
import dataclasses
import math
import os
import re
import uuid

from primitives.env import parse_env_value, warn_unknown_env
from primitives.presets import DEFAULT_PRESET, PRESETS

# A step form and its fraction of the run: an explicit variable for one of them replaces the other.
SCHEDULE_PAIRS = (("muon_momentum_warmup_steps", "muon_momentum_warmup_frac"), ("warmdown_iters", "warmdown_frac"),
                  ("ema_decay", "ema_horizon_frac"), ("muon_momentum", "muon_momentum_horizon_frac"))
# prefixes of our names: an unknown variable starting with one is probably a typo
SETTINGS_PREFIXES = ("MUON_", "ADAM_", "EVAL_", "QAT_", "EMA_", "TRAIN_", "VAL_", "ROPE_", "XSA_", "MLP_", "WARMDOWN_",
                     "TTT_", "WD_TAPER_", "SMEAR_", "SPARSE_ATTN_", "LOOP_")
MAX_SECONDS = 1e7  # the largest time setting accepted
PATH_SETTINGS = ("data_path", "tokenizer_path", "out_dir")
# a folder name is at most 255 bytes on the usual file systems; the kit's own file names add to it
MAX_RUN_ID_BYTES = 200
# GRAD_ACCUM_STEPS=0 on CUDA: CUDA_GRAD_ACCUM // world_size micro-steps (at least 1). The official script uses 8
# (32 sequences of 2048 per micro-batch at 524,288 tokens); on one H100 (2026-11-27, default preset, FA4) 64
# sequences ran 287.4 ms/step against 300.3 (peak 20.8 GiB against 10.6), the same gradient up to summation
# order. 8 GPUs resolve to 1 either way. OFFICIAL_GRAD_ACCUM: the official script's, for side-by-side timing.
CUDA_GRAD_ACCUM = 4
OFFICIAL_GRAD_ACCUM = 8
# standard variables near ours (NUM_THREADS): not typos
SETTINGS_FOREIGN = ("OMP_NUM_THREADS", "MKL_NUM_THREADS")


@dataclasses.dataclass(frozen=True)
class Hyperparameters:
    """Every setting of a run; each field is read from the env var of the same name, upper-cased.

    Build with `Hyperparameters.from_env()`: PRESET picks a group of defaults, explicit variables
    override it. Raises ValueError naming the variable for a malformed or out-of-range value.
    """

    preset: str = DEFAULT_PRESET
    # data and run
    data_path: str = "./data/datasets/fineweb10B_sp8192"
    tokenizer_path: str = "./data/tokenizers/fineweb_8192_bpe.model"
    vocab_size: int = 8192
    run_id: str = ""  # default: a fresh random id
    out_dir: str = "runs"
    seed: int = 1337
    # schedule and batch (official names and defaults unless noted)
    iterations: int = 20_000
    train_batch_tokens: int = 524_288
    train_seq_len: int = 2048  # records: 2048 (official baseline 1024)
    grad_accum_steps: int = 0  # 0 = CUDA_GRAD_ACCUM // world_size on CUDA (at least 1), 1 on CPU
    max_wallclock_seconds: float = 600.0  # 0 = no cap (non-record runs; use ITERATIONS)
    warmup_steps: int = 20  # compile/prime steps before the clock, then state is restored
    warmdown_frac: float = 0.2  # LR decays linearly to 0 over this last fraction of the budget
    warmdown_iters: int = 0  # records' step form (official WARMDOWN_ITERS): the last N steps; 0 = WARMDOWN_FRAC
    expected_steps: int = 1843  # the run length (steps) the preset's schedule was set for (logged)
    val_loss_every: int = 0  # 0 = only the final evaluation
    val_batch_size: int = 524_288
    train_log_every: int = 200
    # model
    num_layers: int = 7
    model_dim: int = 512
    num_heads: int = 8
    num_kv_heads: int = 4
    mlp_mult: float = 3.0
    mlp_activation: str = "relu2"  # relu2 | leaky_relu2 (LeakyReLU(0.5)^2)
    tie_embeddings: bool = True
    rope_base: float = 10_000.0
    rope_dims: int = 32  # partial RoPE: rotate only the first ROPE_DIMS dims of each head
    logit_softcap: float = 30.0
    qk_gain_init: float = 4.0
    xsa_last_n: int = 7  # exclusive self attention on the last N layers
    parallel_residual_start: int = -1  # GPT-J parallel attention + MLP from this layer on; -1 = off (PR #1204, #1608)
    tied_embed_init_std: float = 0.005
    # optimizers: Muon for block matrices, AdamW for embeddings and scalars
    matrix_lr: float = 0.025
    scalar_lr: float = 0.025
    tied_embed_lr: float = 0.04
    embed_lr: float = 0.6  # untied input embedding (official)
    head_lr: float = 0.008  # untied output head (official)
    muon_momentum: float = 0.95  # records' form, any run length; 0 = MUON_MOMENTUM_HORIZON_FRAC
    muon_momentum_horizon_frac: float = 0.0  # momentum time constant 1/(1-momentum) as a fraction of the run
    muon_momentum_warmup_start: float = 0.85
    muon_momentum_warmup_steps: int = 0  # records' step form; 0 = MUON_MOMENTUM_WARMUP_FRAC
    muon_momentum_warmup_frac: float = 500 / 1843  # warmup start -> MUON_MOMENTUM over this fraction of the run
    muon_backend_steps: int = 5
    muon_wd: float = 0.02
    adam_wd: float = 0.04
    beta1: float = 0.9
    beta2: float = 0.95
    adam_eps: float = 1e-8
    grad_clip_norm: float = 0.0  # 0 = off
    # zero-cost switches of the 8xH100 records after PR #1617 (names and values theirs; gains as they report
    # them on 8xH100). All off by default: off, the model, optimizer and artifact are today's, bit for bit.
    muon_ns_coeffs: str = "jordan"  # jordan | polar_express: Polar Express Newton-Schulz steps (PR #1787: -0.0004 with MIN_LR)
    muon_row_normalize: bool = False  # MuonEq-R: rows of the update normalized before Newton-Schulz (PR #1285: ~-0.001)
    min_lr: float = 0.0  # the warmdown's LR floor, a fraction of the peak LR (PR #1787: 0.10)
    wd_taper_start_frac: float = 0.7  # Muon WD tapers linearly from this fraction of the run ... (PR #1729)
    wd_taper_final_mult: float = 1.0  # ... to this multiple of MUON_WD at the end; 1 = off (PR #1729: 0.5, -0.004 with CaseOps)
    smear_gate_enabled: bool = False  # SmearGate: previous token mixed in, not across BOS (PR #1667, #1851: -0.002 with LQER)
    sparse_attn_gate_enabled: bool = False  # per-head sigmoid gate on the attention output (PR #1787)
    sparse_attn_gate_scale: float = 1.0  # the gate's logit scale (PR #1787: 1.0, PR #1855: 0.5)
    gate_window: int = 12  # leading residual dims the gates read (PR #1667, #1787)
    # depth recurrence: blocks LOOP_START..LOOP_END run 1 + NUM_LOOPS times from ENABLE_LOOPING_AT of the run; costs
    # steps (PR #1204, #1285, #1493; #1855: 3..5 of 11 layers, 2 loops, from 0.35: -0.002..-0.003 on 8 GPUs)
    num_loops: int = 0  # 0 = off
    loop_start: int = 3
    loop_end: int = 5
    enable_looping_at: float = 0.35
    # PR #1855's model switches (names its own; off: the model is today's, bit for bit). DOC_PACKED_ATTENTION: no
    # token attends across a BOS (its packed-document training and eval); LN_SCALE: every block's norms times
    # 1/sqrt(layer + 1); SKIP_GATES_ENABLED: U-Net skips mixed in by a learned sigmoid gate; PARALLEL_START_LAYER
    # (> 0): its 2-lane parallel decoder from that layer on, the lanes joined at the end by PARALLEL_FINAL_LANE
    doc_packed_attention: bool = False
    ln_scale: bool = False
    skip_gates_enabled: bool = False
    parallel_start_layer: int = 0  # a layer index, 0: off
    parallel_final_lane: str = "mean"  # mean | mlp | attn
    # late QAT and EMA
    qat_start_frac: float = 0.15  # fake-quant switches on for the last fraction of the budget
    ema_decay: float = 0.0  # records' step form: a fixed per-step decay (0.997); 0 = EMA_HORIZON_FRAC
    ema_horizon_frac: float = 0.0  # EMA time constant 1/(1-decay) as a fraction of the run; 0 = off
    ema_start_frac: float = 0.0  # the EMA starts averaging at this fraction of the run (before: = weights)
    # evaluation and export
    eval_stride: int = 64
    eval_batch_seqs: int = 64
    eval_max_seconds: float = 600.0
    eval_auto_stride: bool = True  # GPU presets: stride planned before training (plan_eval_stride); smoke: off
    val_max_tokens: int = 0  # 0 = the whole val split (required for a record)
    # legal score-first TTT in place of the sliding pass (eval/ttt.py): off until an H100 run measures its
    # gain; the values are the merged legal-TTT records' (PR #461, #549: 32K-token chunks, SGD lr 0.002,
    # momentum 0.9, 3 epochs, clip 1.0, all blocks). The plan before training cuts epochs or skips it to fit.
    ttt_enabled: bool = False
    ttt_chunk_tokens: int = 32_768
    ttt_epochs: int = 3
    ttt_lr: float = 0.002
    ttt_momentum: float = 0.9
    ttt_grad_clip: float = 1.0  # 0 = off
    ttt_batch_seqs: int = 32  # sequences per TTT step, all ranks together (capped at a chunk's)
    ttt_params: str = "all"  # all | scalars | a regular expression of parameter names
    # TTT_MODE=phased (eval/phased_ttt.py; PR #1610, #1626, #1736: about -0.012 bpb post-quant -> post-TTT on
    # 8xH100 with their per-document LoRA, which the kit does not build): TTT_PHASES phases of whole
    # documents, each scored, then TTT_EPOCHS of SGD on every scored document; TTT_CHUNK_TOKENS unused.
    ttt_mode: str = "chunked"  # chunked | phased | lora
    ttt_phases: int = 3
    # TTT_MODE=lora (eval/lora_ttt.py; PR #77: per-document rank-8 LoRA on q and v, reset at each document,
    # 256-token chunks, one Adam step of lr 0.01 per scored chunk; PR #1530/#1610/#1626/#1736 pair it with
    # phased SGD for about -0.012 bpb in total on 8xH100): adapters on attn.c_q, attn.c_v and mlp.proj, each
    # chunk of TTT_LORA_CHUNK_TOKENS scored then TTT_EPOCHS Adam steps; the base weights are never changed.
    ttt_lora_rank: int = 8
    ttt_lora_lr: float = 0.01
    ttt_lora_chunk_tokens: int = 256
    # adapter slots: documents adapted side by side, each with its own adapter (64: PR #77's batch of documents,
    # the batching PR #1530's records keep); the score is the same at any value, up to float rounding
    ttt_lora_batch_docs: int = 64
    byte_budget: int = 16_000_000
    # measured / estimated artifact bytes that the fit before training assumes (quant/estimate.py is
    # calibrated on Gaussian weights; 1 = trust it; the 1xh100-sp* presets use PR #1617's ratios)
    quant_estimate_scale: float = 0.82
    # full GPTQ (QUANT_GPTQ=1): Hessians from this many train micro-batches, read inside the clock in
    # the last GPTQ_RESERVE_SECONDS (64 batches took about 7 s on one H100 in PR #1763)
    gptq_calib_batches: int = 64
    gptq_reserve_seconds: float = 10.0
    # machinery
    compile: int = -1  # -1 = on for CUDA, off for CPU
    num_threads: int = 0  # CPU threads per process; 0 = the cores / processes on this node
    attn_backend: str = "auto"  # auto | fa3 | fa4 | fa2 | sdpa
    loss_kernel: str = "auto"  # auto | liger | torch: the fused linear + softcap + cross entropy (model/fused_loss.py)
    autocast: str = "auto"  # auto = bf16 on CUDA, none on CPU | bf16 (also on CPU: the CUDA twin) | none
    save_prequant: bool = False
    skip_final_eval: bool = False
    checkpoint_every: int = 0
    resume: bool = False

    @classmethod
    def from_env(cls, environ=None, log=print) -> "Hyperparameters":
        environ = os.environ if environ is None else environ
        preset = environ.get("PRESET", DEFAULT_PRESET)
        if preset not in PRESETS:
            raise ValueError(f"PRESET={preset!r}: expected one of {sorted(PRESETS)}")
        values = {**PRESETS[preset], "preset": preset}
        for f in dataclasses.fields(cls):
            name = f.name.upper()
            if f.name == "preset" or name not in environ:
                continue
            values[f.name] = parse_env_value(name, environ[name], f.type)
        for pair in SCHEDULE_PAIRS:  # MUON_MOMENTUM_WARMUP_STEPS=500 alone replaces the preset's fraction
            given = [n for n in pair if n.upper() in environ]
            if len(given) == 1:
                values[pair[pair.index(given[0]) - 1]] = 0
        for name in PATH_SETTINGS:  # "~/runs" in quotes reaches us unexpanded: never a literal "~" folder
            if name in values and str(values[name]).startswith("~"):
                values[name] = os.path.expanduser(values[name])
                if values[name].startswith("~"):
                    raise ValueError(f"{name.upper()}={values[name]!r}: '~' cannot be expanded here (no such user, or "
                                     "HOME unset); expected a path")
        warn_unknown_settings(environ, log)
        if "run_id" not in values:  # unset: a fresh id; set, it must be a folder name (validate)
            values["run_id"] = f"{preset}_{uuid.uuid4().hex[:8]}"
        hp = cls(**values)
        hp.validate()
        return hp

    def validate(self) -> None:
        """Raise ValueError naming the first variable whose value is out of range."""
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            signed = f.name in ("compile", "parallel_residual_start")
            if f.type in (int, float) and not signed and not (math.isfinite(v) and v >= 0):
                raise ValueError(f"{f.name.upper()}={v!r}: expected a finite value >= 0")
        hd = self.model_dim // max(1, self.num_heads)
        for name, ok, expected in (
            ("VOCAB_SIZE", 0 < self.vocab_size <= 65536, "1..65536 (uint16 tokens)"),
            # RUN_ID names the run's folder under OUT_DIR: nothing may be written outside it
            ("RUN_ID", self.run_id.strip(".") and not {"/", "\\", "\0"} & set(self.run_id),
             "a folder name: no '/' or '\\', not empty or dots"),
            ("RUN_ID", len(self.run_id.encode("utf-8", "surrogateescape")) <= MAX_RUN_ID_BYTES,
             f"a folder name of at most {MAX_RUN_ID_BYTES} bytes"),
            *((n, getattr(self, n.lower()) > 0, "> 0") for n in (
                "TRAIN_BATCH_TOKENS", "TRAIN_SEQ_LEN", "NUM_LAYERS", "NUM_HEADS", "NUM_KV_HEADS", "EVAL_STRIDE",
                "EVAL_BATCH_SEQS", "TRAIN_LOG_EVERY", "EXPECTED_STEPS")),
            ("MODEL_DIM", self.model_dim % self.num_heads == 0, f"a multiple of NUM_HEADS={self.num_heads}"),
            ("NUM_HEADS", self.num_heads % self.num_kv_heads == 0, f"a multiple of NUM_KV_HEADS={self.num_kv_heads}"),
            ("ROPE_DIMS", self.rope_dims % 2 == 0 and self.rope_dims <= hd, f"even and <= head_dim={hd}"),
            ("XSA_LAST_N", self.xsa_last_n <= self.num_layers, "<= NUM_LAYERS"),
            ("EVAL_STRIDE", self.eval_stride <= self.train_seq_len, "<= TRAIN_SEQ_LEN"),
            ("TTT_CHUNK_TOKENS", not self.ttt_enabled or self.ttt_mode == "lora" or self.ttt_chunk_tokens >= self.train_seq_len,
             f">= TRAIN_SEQ_LEN={self.train_seq_len} (TTT_ENABLED=1)"),
            ("TTT_BATCH_SEQS", self.ttt_batch_seqs > 0, "> 0"),
            ("TTT_MODE", self.ttt_mode in ("chunked", "phased", "lora"), "chunked, phased or lora"),
            ("TTT_LORA_RANK", self.ttt_lora_rank >= 1, ">= 1"),
            ("TTT_LORA_LR", self.ttt_lora_lr >= 0, ">= 0"),
            ("TTT_LORA_BATCH_DOCS", self.ttt_lora_batch_docs >= 1, ">= 1"),
            ("TTT_LORA_CHUNK_TOKENS", self.ttt_lora_chunk_tokens > 0 and not (
                self.ttt_enabled and self.ttt_mode == "lora" and self.ttt_lora_chunk_tokens > self.train_seq_len),
             f"> 0 and <= TRAIN_SEQ_LEN={self.train_seq_len} (TTT_MODE=lora)"),
            ("TTT_PHASES", self.ttt_phases >= 1, ">= 1"),
            ("TTT_PARAMS", valid_ttt_params(self.ttt_params), "all, scalars or a regular expression of parameter names"),
            ("MLP_ACTIVATION", self.mlp_activation in ("relu2", "leaky_relu2"), "relu2 or leaky_relu2"),
            ("ATTN_BACKEND", self.attn_backend in ("auto", "fa3", "fa4", "fa2", "sdpa"), "auto, fa3, fa4, fa2 or sdpa"),
            ("LOSS_KERNEL", self.loss_kernel in ("auto", "liger", "torch"), "auto, liger or torch"),
            ("COMPILE", self.compile in (-1, 0, 1), "-1 (auto), 0 or 1"),
            ("PARALLEL_RESIDUAL_START", -1 <= self.parallel_residual_start < self.num_layers,
             f"-1 (off) or a layer index 0..{self.num_layers - 1}"),
            ("PARALLEL_START_LAYER", self.parallel_start_layer < self.num_layers and not (
                self.parallel_start_layer and self.parallel_residual_start >= 0),
             f"0 (off) or a layer index 1..{self.num_layers - 1}, with PARALLEL_RESIDUAL_START=-1 (one parallel form)"),
            ("PARALLEL_FINAL_LANE", self.parallel_final_lane in ("mean", "mlp", "attn"), "mean, mlp or attn"),
            ("AUTOCAST", self.autocast in ("auto", "bf16", "none"), "auto, bf16 or none"),
            *((n, getattr(self, n.lower()) <= 1, "a fraction in [0, 1]") for n in (
                "WARMDOWN_FRAC", "QAT_START_FRAC", "MUON_MOMENTUM_WARMUP_FRAC", "EMA_START_FRAC", "MIN_LR",
                "WD_TAPER_START_FRAC", "ENABLE_LOOPING_AT")),
            ("LOOP_END", not self.num_loops or self.loop_start <= self.loop_end < self.num_layers,
             f"LOOP_START={self.loop_start}..NUM_LAYERS-1={self.num_layers - 1} (NUM_LOOPS={self.num_loops})"),
            ("MUON_NS_COEFFS", self.muon_ns_coeffs in ("jordan", "polar_express"), "jordan or polar_express"),
            ("GATE_WINDOW", 0 < self.gate_window <= self.model_dim, f"1..MODEL_DIM={self.model_dim}"),
            ("EMA_DECAY", self.ema_decay < 1, "< 1"),
            ("QUANT_ESTIMATE_SCALE", self.quant_estimate_scale > 0, "> 0"),
            *((a.upper(), not (getattr(self, a) and getattr(self, b)), f"0 when {b.upper()} is set") for a, b in SCHEDULE_PAIRS),
            ("ITERATIONS", self.max_wallclock_seconds > 0 or self.iterations > 0, "> 0 when MAX_WALLCLOCK_SECONDS=0"),
            # a cap of 1e308 s is inf ms on the clock: "no cap" is 0, and 1e7 s (116 days) is far beyond any run
            *((n, getattr(self, n.lower()) <= MAX_SECONDS, f"<= {MAX_SECONDS:g} seconds" + " (0: no cap)" * (n[0] == "M"))
              for n in ("MAX_WALLCLOCK_SECONDS", "EVAL_MAX_SECONDS", "GPTQ_RESERVE_SECONDS")),
            ("VAL_MAX_TOKENS", self.val_max_tokens == 0 or self.val_max_tokens >= self.train_seq_len,
             f"0 (the whole val split) or >= TRAIN_SEQ_LEN={self.train_seq_len} (one sequence)"),
            ("SEED", self.seed < 2**64, "< 2**64 (torch.manual_seed)"),
            ("NUM_THREADS", self.num_threads <= 4096, "<= 4096 (0: the cores / processes)"),
        ):
            if not ok:
                raise ValueError(f"{name}={getattr(self, name.lower())!r}: expected {expected}")

    def resolve_grad_accum(self, world_size: int, is_cuda: bool) -> int:
        """Micro-steps per optimizer step; raises ValueError unless the batch splits evenly."""
        accum = self.grad_accum_steps or (max(1, CUDA_GRAD_ACCUM // world_size) if is_cuda else 1)
        span = world_size * accum * self.train_seq_len
        if self.train_batch_tokens % span:
            raise ValueError(
                f"TRAIN_BATCH_TOKENS={self.train_batch_tokens}: expected a multiple of world_size({world_size})"
                f" x GRAD_ACCUM_STEPS({accum}) x TRAIN_SEQ_LEN({self.train_seq_len}) = {span}")
        return accum

    def micro_batch_seqs(self, world_size: int, is_cuda: bool) -> int:
        """TRAIN_SEQ_LEN sequences in each rank's micro-batch (resolve_grad_accum's split; its ValueError)."""
        accum = self.resolve_grad_accum(world_size, is_cuda)
        return self.train_batch_tokens // (world_size * accum * self.train_seq_len)

    def other_micro_batches(self, world_size: int, is_cuda: bool) -> list:
        """[(GRAD_ACCUM_STEPS, sequences per micro-batch)] at half and at twice the resolved micro-batch, those
        that split the batch into whole sequences: the sizes gpu_check --micro-batches and gpu_report time."""
        accum, out = self.resolve_grad_accum(world_size, is_cuda), []
        for a in (2 * accum, accum // 2):
            if a >= 1:  # 0 would mean the default
                with contextlib.suppress(ValueError):
                    out.append((a, dataclasses.replace(self, grad_accum_steps=a).micro_batch_seqs(world_size, is_cuda)))
        return out


def valid_ttt_params(value: str) -> bool:
    """TTT_PARAMS is `all`, `scalars` or a regular expression that compiles (eval/ttt.py select_ttt_params)."""
    try:
        re.compile(value)
    except re.error:
        return False
    return bool(value)


def warn_unknown_settings(environ, log=print) -> list:
    """Warn about env vars that look like the trainer's but are not (QUANT_* names: QuantPolicy's)."""
    known = {f.name.upper() for f in dataclasses.fields(Hyperparameters)} | {"PRESET"}
    return warn_unknown_env({k: v for k, v in environ.items() if k not in SETTINGS_FOREIGN}, known,
                            SETTINGS_PREFIXES, log, skip_prefixes=("QUANT_",))
