"""Settings: `Hyperparameters`, every knob of a run, read from env vars with the official names.

The class defaults are the default preset (`1xh100-sp8192`, primitives/presets.py has the evidence);
PRESET picks another group of defaults and explicit variables override it.
"""

import contextlib
import dataclasses
import os

from primitives.domains import domain_violations, inert_settings, relation_holds, setting
from primitives.env import BUNDLE_KIND, parse_env_value, warn_unknown_env
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
# when the TTT_* settings have an effect (a Domain's `applies`: condition text, predicate)
TTT_ON = ("TTT_ENABLED=1", lambda hp: hp.ttt_enabled)
# the mode of an artifact whose run["ttt"] records none (those written before modes; trainer/finish.py records
# every other mode, so chunked artifacts stay byte-identical)
UNRECORDED_TTT_MODE = "chunked"
# TTT_MODE's names: the rows of eval/ttt_modes.py's registry (layer 3, which this layer cannot import; a test
# asserts the two lists equal, so a new mode is its row plus its name here). Settings compare a mode name only
# in ttt_modes_apply.
TTT_MODE_NAMES = (UNRECORDED_TTT_MODE, "phased", "lora", "phased_lora")


def ttt_modes_apply(*modes: str) -> tuple:
    """A Domain's `applies` (condition text, predicate): TTT_ENABLED=1 and TTT_MODE one of `modes`."""
    return f"TTT_ENABLED=1 and TTT_MODE={' or '.join(modes)}", lambda hp: hp.ttt_enabled and hp.ttt_mode in modes


# TTT_MODE=phased_lora (PR #1855's phased TTT, eval/phased_lora.py) reads the SGD settings for its global SGD, the
# TTT_LORA_* settings for its adapters, TTT_PHASES, and its own (TTT_PREFIX_DOCS, ...)
# (the package's only: `applies` is the settings' help, kit/bundle_fold.py, and the relations its preflight)
if BUNDLE_KIND == "package":
    TTT_RECORD = ttt_modes_apply("phased_lora")
    TTT_SGD, TTT_CHUNKED = ttt_modes_apply("chunked", "phased", "phased_lora"), ttt_modes_apply("chunked", "phased_lora")
    TTT_LORA, TTT_PHASED = ttt_modes_apply("lora", "phased_lora"), ttt_modes_apply("phased", "phased_lora")


@dataclasses.dataclass(frozen=True)
class Hyperparameters:
    """Every setting of a run; each field is read from the env var of the same name, upper-cased.

    Build with `Hyperparameters.from_env()`: PRESET picks a group of defaults, explicit variables
    override it. Raises ValueError naming the variable for a malformed or out-of-range value.
    """

    preset: str = setting(DEFAULT_PRESET, choices=tuple(PRESETS))
    # data and run
    data_path: str = setting("./data/datasets/fineweb10B_sp8192", nonempty=True)
    tokenizer_path: str = setting("./data/tokenizers/fineweb_8192_bpe.model", nonempty=True)
    # CaseOps data (PR #1729, #1855; its switch's name): val_bpb counts the original text's bytes from the data's byte
    # sidecar (shards/sidecar.py); the data must say the same (shards/data_kind.py: refused before training otherwise)
    caseops_enabled: bool = setting(False)
    vocab_size: int = setting(8192, 1, 65536, units="uint16 tokens")
    run_id: str = setting("")  # default: a fresh random id (validate: a folder name)
    out_dir: str = setting("runs", nonempty=True)
    seed: int = setting(1337, 0, 2**64 - 1, units="torch.manual_seed")
    # schedule and batch (official names and defaults unless noted)
    iterations: int = setting(20_000, 0, units="steps")
    train_batch_tokens: int = setting(524_288, 1, units="tokens")
    train_seq_len: int = setting(2048, 1, units="tokens")  # records: 2048 (official baseline 1024)
    grad_accum_steps: int = setting(0, 0)  # 0 = CUDA_GRAD_ACCUM // world_size on CUDA (at least 1), 1 on CPU
    # 0 = no cap (non-record runs; use ITERATIONS); 1e7 s (116 days) is far beyond any run, 1e308 would be inf ms
    max_wallclock_seconds: float = setting(600.0, 0, MAX_SECONDS, units="seconds, 0: no cap")
    warmup_steps: int = setting(20, 0, units="steps")  # compile/prime steps before the clock, then state is restored
    # LR decays linearly to 0 over this last fraction of the budget
    warmdown_frac: float = setting(0.2, 0, 1, units="a fraction of the run")
    warmdown_iters: int = setting(0, 0, units="steps")  # records' step form (official WARMDOWN_ITERS); 0 = WARMDOWN_FRAC
    expected_steps: int = setting(1843, 1, units="steps")  # the run length the preset's schedule was set for (logged)
    val_loss_every: int = setting(0, 0, units="steps, 0: only the final evaluation")
    val_batch_size: int = setting(524_288, 1, units="tokens")
    train_log_every: int = setting(200, 1, units="steps")
    # model
    num_layers: int = setting(7, 1)
    model_dim: int = setting(512, 1)
    num_heads: int = setting(8, 1)
    num_kv_heads: int = setting(4, 1)
    mlp_mult: float = setting(3.0, 0, low_open=True)
    mlp_activation: str = setting("relu2", choices=("relu2", "leaky_relu2"))  # leaky_relu2: LeakyReLU(0.5)^2
    tie_embeddings: bool = setting(True)
    rope_base: float = setting(10_000.0, 0, low_open=True)
    # partial RoPE: rotate only the first ROPE_DIMS dims of each head (at least one pair: 0 divided by zero in the
    # first step)
    rope_dims: int = setting(32, 2)
    logit_softcap: float = setting(30.0, 0, low_open=True)  # 0 would make every logit 0
    qk_gain_init: float = setting(4.0, 0)
    xsa_last_n: int = setting(7, 0, units="layers")  # exclusive self attention on the last N layers
    # GPT-J parallel attention + MLP from this layer on; -1 = off (PR #1204, #1608)
    parallel_residual_start: int = setting(-1, -1)
    tied_embed_init_std: float = setting(0.005, 0)
    # optimizers: Muon for block matrices, AdamW for embeddings and scalars
    matrix_lr: float = setting(0.025, 0)
    scalar_lr: float = setting(0.025, 0)
    tied_embed_lr: float = setting(0.04, 0, applies=("TIE_EMBEDDINGS=1", lambda hp: hp.tie_embeddings))
    embed_lr: float = setting(0.6, 0, applies=("TIE_EMBEDDINGS=0", lambda hp: not hp.tie_embeddings))  # official
    head_lr: float = setting(0.008, 0, applies=("TIE_EMBEDDINGS=0", lambda hp: not hp.tie_embeddings))  # official
    muon_momentum: float = setting(0.95, 0, 1, high_open=True)  # records' form, any run length; 0 = the horizon
    # momentum time constant 1/(1-momentum) as a fraction of the run
    muon_momentum_horizon_frac: float = setting(0.0, 0, units="a fraction of the run")
    muon_momentum_warmup_start: float = setting(0.85, 0, 1, high_open=True)
    muon_momentum_warmup_steps: int = setting(0, 0, units="steps")  # records' step form; 0 = MUON_MOMENTUM_WARMUP_FRAC
    # warmup start -> MUON_MOMENTUM over this fraction of the run
    muon_momentum_warmup_frac: float = setting(500 / 1843, 0, 1, units="a fraction of the run")
    muon_backend_steps: int = setting(5, 0)
    muon_wd: float = setting(0.02, 0)
    adam_wd: float = setting(0.04, 0)
    # the embedding's own AdamW weight decay (PR #1855: 0.085, its EMBED_WD); -1: ADAM_WD, as before it existed
    embed_wd: float = setting(-1.0, -1, units="-1: ADAM_WD")
    beta1: float = setting(0.9, 0, 1, high_open=True)
    beta2: float = setting(0.95, 0, 1, high_open=True)
    adam_eps: float = setting(1e-8, 0)
    grad_clip_norm: float = setting(0.0, 0)  # 0 = off
    # zero-cost switches of the 8xH100 records after PR #1617 (names and values theirs; gains as they report
    # them on 8xH100). All off by default: off, the model, optimizer and artifact are today's, bit for bit.
    # polar_express: Polar Express Newton-Schulz steps (PR #1787: -0.0004 with MIN_LR)
    muon_ns_coeffs: str = setting("jordan", choices=("jordan", "polar_express"))
    muon_row_normalize: bool = setting(False)  # MuonEq-R: rows of the update normalized before Newton-Schulz (PR #1285)
    # Muon's arithmetic: torch (torch.optim.Muon's lerp momentum, float32 state), records (PR #1855's: bf16 gradient
    # and momentum, buf = m buf + g, Newton-Schulz in its op order) or classic (PR #1617's: float32 buf = m buf + g,
    # its Newton-Schulz order, the update scaled in bf16; trainer/optim.py)
    muon_form: str = setting("torch", choices=("torch", "records", "classic"))
    min_lr: float = setting(0.0, 0, 1, units="a fraction of the peak LR")  # the warmdown's LR floor (PR #1787: 0.10)
    # Muon WD tapers linearly from this fraction of the run ... (PR #1729)
    wd_taper_start_frac: float = setting(0.7, 0, 1, units="a fraction of the run", applies=(
        "WD_TAPER_FINAL_MULT != 1", lambda hp: hp.wd_taper_final_mult != 1))
    # ... to this multiple of MUON_WD at the end; 1 = off (PR #1729: 0.5, -0.004 with CaseOps)
    wd_taper_final_mult: float = setting(1.0, 0)
    smear_gate_enabled: bool = setting(False)  # SmearGate: previous token mixed in, not across BOS (PR #1667, #1851)
    sparse_attn_gate_enabled: bool = setting(False)  # per-head sigmoid gate on the attention output (PR #1787)
    # the gate's logit scale (PR #1787: 1.0, PR #1855: 0.5)
    sparse_attn_gate_scale: float = setting(1.0, 0, applies=(
        "SPARSE_ATTN_GATE_ENABLED=1", lambda hp: hp.sparse_attn_gate_enabled))
    # leading residual dims the gates read (PR #1667, #1787)
    gate_window: int = setting(12, 1, applies=("SMEAR_GATE_ENABLED=1 or SPARSE_ATTN_GATE_ENABLED=1",
                                               lambda hp: hp.smear_gate_enabled or hp.sparse_attn_gate_enabled))
    # depth recurrence: blocks LOOP_START..LOOP_END run 1 + NUM_LOOPS times from ENABLE_LOOPING_AT of the run; costs
    # steps (PR #1204, #1285, #1493; #1855: 3..5 of 11 layers, 2 loops, from 0.35: -0.002..-0.003 on 8 GPUs)
    num_loops: int = setting(0, 0)  # 0 = off
    loop_start: int = setting(3, 0, applies=("NUM_LOOPS > 0", lambda hp: hp.num_loops > 0))
    loop_end: int = setting(5, 0, applies=("NUM_LOOPS > 0", lambda hp: hp.num_loops > 0))
    enable_looping_at: float = setting(0.35, 0, 1, units="a fraction of the run",
                                       applies=("NUM_LOOPS > 0", lambda hp: hp.num_loops > 0))
    # PR #1855's model switches (names its own; off: the model is today's, bit for bit). DOC_PACKED_ATTENTION: no
    # token attends across a BOS (its packed-document training and eval); LN_SCALE: every block's norms times
    # 1/sqrt(layer + 1); SKIP_GATES_ENABLED: U-Net skips mixed in by a learned sigmoid gate; PARALLEL_START_LAYER
    # (> 0): its 2-lane parallel decoder from that layer on, the lanes joined at the end by PARALLEL_FINAL_LANE
    doc_packed_attention: bool = setting(False)
    ln_scale: bool = setting(False)
    skip_gates_enabled: bool = setting(False)
    parallel_start_layer: int = setting(0, 0, units="a layer index, 0: off")
    parallel_final_lane: str = setting("mean", choices=("mean", "mlp", "attn"), applies=(
        "PARALLEL_START_LAYER > 0", lambda hp: hp.parallel_start_layer > 0))
    # late QAT and EMA
    # fake-quant switches on for the last fraction of the budget
    qat_start_frac: float = setting(0.15, 0, 1, units="a fraction of the run")
    ema_decay: float = setting(0.0, 0, 1, high_open=True)  # records' step form: a fixed per-step decay (0.997); 0 = horizon
    # EMA time constant 1/(1-decay) as a fraction of the run; 0 = off
    ema_horizon_frac: float = setting(0.0, 0, units="a fraction of the run")
    # the EMA starts averaging at this fraction of the run (before: = weights)
    ema_start_frac: float = setting(0.0, 0, 1, units="a fraction of the run", applies=(
        "EMA_DECAY > 0 or EMA_HORIZON_FRAC > 0", lambda hp: hp.ema_decay > 0 or hp.ema_horizon_frac > 0))
    # the EMA's warmup: decay min(EMA_DECAY, (1 + t) / (10 + t)) at update t; 0: EMA_DECAY from the first update
    # (PR #1855's EMA)
    ema_warmup: bool = setting(True)
    # evaluation and export
    eval_stride: int = setting(64, 1, units="tokens")
    eval_batch_seqs: int = setting(64, 1)
    eval_max_seconds: float = setting(600.0, 0, MAX_SECONDS, units="seconds")
    eval_auto_stride: bool = setting(True)  # GPU presets: stride planned before training (plan_eval_stride); smoke: off
    val_max_tokens: int = setting(0, 0, units="tokens, 0: the whole val split (required for a record)")
    # legal score-first TTT in place of the sliding pass (eval/ttt.py): off until an H100 run measures its
    # gain; the values are the merged legal-TTT records' (PR #461, #549: 32K-token chunks, SGD lr 0.002,
    # momentum 0.9, 3 epochs, clip 1.0, all blocks). The plan before training cuts epochs or skips it to fit.
    ttt_enabled: bool = setting(False)
    ttt_chunk_tokens: int = setting(32_768, 1, units="tokens", applies=TTT_CHUNKED)
    ttt_epochs: int = setting(3, 0, applies=TTT_ON)
    ttt_lr: float = setting(0.002, 0, applies=TTT_SGD)
    ttt_momentum: float = setting(0.9, 0, 1, high_open=True, applies=TTT_SGD)
    ttt_grad_clip: float = setting(1.0, 0, applies=TTT_SGD)  # 0 = off
    ttt_batch_seqs: int = setting(32, 1, applies=TTT_SGD)  # sequences per TTT step, all ranks together (capped at a chunk's)
    ttt_params: str = setting("all", applies=TTT_SGD)  # all | scalars | a regular expression of parameter names
    # TTT_MODE=phased (eval/phased_ttt.py; PR #1610, #1626, #1736: about -0.012 bpb post-quant -> post-TTT on
    # 8xH100 with their per-document LoRA, which the kit does not build): TTT_PHASES phases of whole
    # documents, each scored, then TTT_EPOCHS of SGD on every scored document; TTT_CHUNK_TOKENS unused.
    ttt_mode: str = setting("chunked", choices=TTT_MODE_NAMES, applies=TTT_ON)
    ttt_phases: int = setting(3, 1, applies=TTT_PHASED)
    # TTT_MODE=lora (eval/lora_ttt.py; PR #77: per-document rank-8 LoRA on q and v, reset at each document,
    # 256-token chunks, one Adam step of lr 0.01 per scored chunk; PR #1530/#1610/#1626/#1736 pair it with
    # phased SGD for about -0.012 bpb in total on 8xH100): adapters on attn.c_q, attn.c_v and mlp.proj, each
    # chunk of TTT_LORA_CHUNK_TOKENS scored then TTT_EPOCHS Adam steps; the base weights are never changed.
    ttt_lora_rank: int = setting(8, 1, applies=TTT_LORA)
    ttt_lora_lr: float = setting(0.01, 0, applies=TTT_LORA)
    ttt_lora_chunk_tokens: int = setting(256, 1, units="tokens", applies=TTT_LORA)
    # adapter slots: documents adapted side by side, each with its own adapter (64: PR #77's batch of documents,
    # the batching PR #1530's records keep); the score is the same at any value, up to float rounding
    ttt_lora_batch_docs: int = setting(64, 1, applies=TTT_LORA)
    # TTT_MODE=phased_lora (PR #1855's phased TTT, eval/phased_lora.py; the record's names in its log: PHASED_TTT_
    # PREFIX_DOCS, GLOBAL_TTT_EPOCHS, TTT_LORA_ALPHA, TTT_WEIGHT_DECAY, TTT_BETA1/2, TTT_K/MLP/O_LORA): the phases
    # cover the first TTT_PREFIX_DOCS documents of its batch order; adapters scaled alpha / rank, AdamW
    ttt_prefix_docs: int = setting(2500, 0, units="documents", applies=TTT_RECORD)
    ttt_global_epochs: int = setting(1, 0, applies=TTT_RECORD)
    ttt_lora_alpha: float = setting(144.0, 0, low_open=True, applies=TTT_RECORD)
    ttt_lora_wd: float = setting(0.5, 0, applies=TTT_RECORD)
    ttt_lora_beta1: float = setting(0.0, 0, 1, high_open=True, applies=TTT_RECORD)
    ttt_lora_beta2: float = setting(0.99, 0, 1, high_open=True, applies=TTT_RECORD)
    ttt_lora_k: bool = setting(True, applies=TTT_RECORD)
    ttt_lora_mlp: bool = setting(True, applies=TTT_RECORD)
    ttt_lora_o: bool = setting(True, applies=TTT_RECORD)
    byte_budget: int = setting(16_000_000, 1, units="bytes of code + artifact")
    # measured / estimated artifact bytes that the fit before training assumes (quant/estimate.py is
    # calibrated on Gaussian weights; 1 = trust it; the 1xh100-sp* presets use PR #1617's ratios)
    quant_estimate_scale: float = setting(0.82, 0, low_open=True)
    # full GPTQ (QUANT_GPTQ=1): Hessians from this many train micro-batches, read inside the clock in
    # the last GPTQ_RESERVE_SECONDS (64 batches took about 7 s on one H100 in PR #1763)
    gptq_calib_batches: int = setting(64, 1)
    # calibration attends across documents (the model's DOC_PACKED_ATTENTION off while the Hessians are collected), as
    # PR #1855 calibrates (its forward without cu_seqlens on plain train rows); 0: the model's own attention
    gptq_calib_cross_docs: bool = setting(False)
    gptq_reserve_seconds: float = setting(10.0, 0, MAX_SECONDS, units="seconds")
    # machinery
    compile: int = setting(-1, choices=(-1, 0, 1))  # -1 = on for CUDA, off for CPU
    num_threads: int = setting(0, 0, 4096)  # CPU threads per process; 0 = the cores / processes on this node
    attn_backend: str = setting("auto", choices=("auto", "fa3", "fa4", "fa2", "sdpa"))
    # the fused linear + softcap + cross entropy (model/fused_loss.py)
    loss_kernel: str = setting("auto", choices=("auto", "liger", "torch"))
    # auto = bf16 on CUDA, none on CPU | bf16 (also on CPU: the CUDA twin) | none
    autocast: str = setting("auto", choices=("auto", "bf16", "none"))
    save_prequant: bool = setting(False)
    skip_final_eval: bool = setting(False)
    checkpoint_every: int = setting(0, 0, units="steps, 0: off")
    resume: bool = setting(False)

    @classmethod
    def from_env(cls, environ=None, log=print, code_bytes: int = None) -> "Hyperparameters":
        """The settings of `environ` (default os.environ) over PRESET's defaults: ValueError for an unknown
        PRESET or a malformed value. In the package also checked as a whole (the kit's preflight, which a
        record's file leaves out, docs/bundle.md): one ValueError listing every malformed or out-of-domain
        variable ("; " between them), BYTE_BUDGET against `code_bytes` (the shipped code's, when given), a
        WARNING line for each unknown variable that looks like ours and each variable set whose effect never
        happens in this run (primitives/domains.py inert_settings)."""
        environ = os.environ if environ is None else environ
        preset = environ.get("PRESET", DEFAULT_PRESET)
        if preset not in PRESETS:
            raise ValueError(f"PRESET={preset!r}: expected one of {sorted(PRESETS)}")
        values, errors = {**PRESETS[preset]}, {}  # (PRESET, when set, is one of PRESETS' names: parsed as itself)
        for f in dataclasses.fields(cls):
            name = f.name.upper()
            if name in environ:
                if BUNDLE_KIND == "package":
                    try:
                        values[f.name] = parse_env_value(name, environ[name], f.type)
                    except ValueError as err:  # listed with the others; the field keeps its default meanwhile
                        errors[f.name] = str(err)
                else:
                    values[f.name] = parse_env_value(name, environ[name], f.type)
        for pair in SCHEDULE_PAIRS:  # MUON_MOMENTUM_WARMUP_STEPS=500 alone replaces the preset's fraction
            given = [n for n in pair if n.upper() in environ]
            if len(given) == 1:
                values[pair[pair.index(given[0]) - 1]] = 0
        for name in PATH_SETTINGS:  # "~/runs" in quotes reaches us unexpanded: never a literal "~" folder
            if name in values:
                values[name] = os.path.expanduser(values[name])
                if BUNDLE_KIND == "package":
                    if values[name].startswith("~"):
                        errors[name] = (f"{name.upper()}={values[name]!r}: '~' cannot be expanded here (no such user, "
                                        "or HOME unset); expected a path")
        if BUNDLE_KIND == "package":
            warn_unknown_settings(environ, log)
        if "run_id" not in values:  # unset: a fresh id; set, it must be a folder name (validate)
            values["run_id"] = f"{preset}_{os.urandom(4).hex()}"  # 8 random hex digits
        hp = cls(**values)
        if BUNDLE_KIND == "package":  # the kit's preflight: every domain and relation, the inert settings
            found = {**hp.violations(code_bytes), **errors}
            if found:
                raise ValueError("; ".join(found.values()))
            for line in inert_settings(hp, {f.name for f in dataclasses.fields(cls) if f.name.upper() in environ}):
                log(line)
        return hp

    # The kit's preflight: each field's domain and the relations between settings. A record's file reads its
    # settings only (from_env), so these methods are the package's (docs/bundle.md, what a record's file leaves out).
    if BUNDLE_KIND == "package":
        def validate(self, code_bytes: int = None) -> None:
            """Raise one ValueError listing every setting out of its domain or its relations ("; " between them)."""
            found = self.violations(code_bytes)
            if found:
                raise ValueError("; ".join(found.values()))

        def violations(self, code_bytes: int = None) -> dict:
            """{field name: "NAME=value: expected ..."}: each field's declared domain (setting(...)), then the
            relations between settings, each a predicate of a view `s` of the settings (one entry per field; a
            relation that reads a field already out of its domain is not reported: it would only repeat it)."""
            found = domain_violations(self)
            try:
                relations = self.relations(code_bytes)
            except (ArithmeticError, TypeError, ValueError):  # a field of the wrong type (built by hand): reported above
                relations = ()
            for name, ok, expected in relations:
                lower = name.lower()
                if lower not in found and not relation_holds(self, ok, found):
                    found[lower] = f"{name}={getattr(self, lower)!r}: expected {expected}"
            return found

        def relations(self, code_bytes: int = None) -> tuple:
            """(NAME, predicate(s) -> bool, expected) for each relation between settings."""
            steps = self.iterations if self.max_wallclock_seconds == 0 else 0  # the exact run length, when step-bounded
            return (
                # RUN_ID names the run's folder under OUT_DIR: nothing may be written outside it
                ("RUN_ID", lambda s: s.run_id.strip(".") and not {"/", "\\", "\0"} & set(s.run_id),
                 "a folder name: no '/' or '\\', not empty or dots"),
                ("RUN_ID", lambda s: len(s.run_id.encode("utf-8", "surrogateescape")) <= MAX_RUN_ID_BYTES,
                 f"a folder name of at most {MAX_RUN_ID_BYTES} bytes"),
                ("MODEL_DIM", lambda s: s.model_dim % s.num_heads == 0, f"a multiple of NUM_HEADS={self.num_heads}"),
                ("NUM_HEADS", lambda s: s.num_heads % s.num_kv_heads == 0, f"a multiple of NUM_KV_HEADS={self.num_kv_heads}"),
                ("ROPE_DIMS", lambda s: s.rope_dims % 2 == 0 and s.rope_dims <= s.model_dim // s.num_heads,
                 f"even and <= head_dim={self.model_dim // max(1, self.num_heads)}"),
                ("MLP_MULT", lambda s: int(s.mlp_mult * s.model_dim) >= 1, "MLP_MULT x MODEL_DIM >= 1 (the MLP's width)"),
                ("XSA_LAST_N", lambda s: s.xsa_last_n <= s.num_layers, "<= NUM_LAYERS"),
                ("EVAL_STRIDE", lambda s: s.eval_stride <= s.train_seq_len, "<= TRAIN_SEQ_LEN"),
                ("TRAIN_BATCH_TOKENS", lambda s: s.train_batch_tokens % s.train_seq_len == 0,
                 f"a multiple of TRAIN_SEQ_LEN={self.train_seq_len} (whole sequences)"),
                ("TTT_CHUNK_TOKENS", lambda s: not TTT_SGD[1](s) or s.ttt_chunk_tokens >= s.train_seq_len,
                 f">= TRAIN_SEQ_LEN={self.train_seq_len} (TTT_ENABLED=1)"),
                ("TTT_LORA_CHUNK_TOKENS", lambda s: not (TTT_LORA[1](s) and s.ttt_lora_chunk_tokens > s.train_seq_len),
                 f"<= TRAIN_SEQ_LEN={self.train_seq_len} (TTT_MODE=lora)"),
                ("TTT_PARAMS", lambda s: valid_ttt_params(s.ttt_params),
                 "all, scalars or a regular expression of parameter names"),
                ("PARALLEL_RESIDUAL_START", lambda s: s.parallel_residual_start < s.num_layers,
                 f"-1 (off) or a layer index 0..{self.num_layers - 1}"),
                ("EMBED_WD", lambda s: s.embed_wd == -1 or s.embed_wd >= 0, "-1 (ADAM_WD) or >= 0"),
                ("PARALLEL_START_LAYER", lambda s: s.parallel_start_layer < s.num_layers and not (
                    s.parallel_start_layer and s.parallel_residual_start >= 0),
                 f"0 (off) or a layer index 1..{self.num_layers - 1}, with PARALLEL_RESIDUAL_START=-1 (one parallel form)"),
                ("LOOP_END", lambda s: not s.num_loops or s.loop_start <= s.loop_end < s.num_layers,
                 f"LOOP_START={self.loop_start}..NUM_LAYERS-1={self.num_layers - 1} (NUM_LOOPS={self.num_loops})"),
                # a loop that starts at the run's end never trains, yet the scored graph loops
                ("ENABLE_LOOPING_AT", lambda s: not s.num_loops or s.enable_looping_at < 1 and (
                    not steps or s.enable_looping_at * steps <= steps - 1),
                 "a start inside the run: < 1" + (f" and <= (ITERATIONS-1)/ITERATIONS = {(steps - 1) / steps:.4g}" if steps
                                                  else "") + f" (NUM_LOOPS={self.num_loops})"),
                ("WD_TAPER_START_FRAC", lambda s: s.wd_taper_final_mult == 1 or s.wd_taper_start_frac < 1,
                 f"< 1, a taper that starts inside the run (WD_TAPER_FINAL_MULT={self.wd_taper_final_mult})"),
                ("GATE_WINDOW", lambda s: s.gate_window <= s.model_dim, f"1..MODEL_DIM={self.model_dim}"),
                *((a.upper(), lambda s, a=a, b=b: not (getattr(s, a) and getattr(s, b)), f"0 when {b.upper()} is set")
                  for a, b in SCHEDULE_PAIRS),
                ("ITERATIONS", lambda s: s.max_wallclock_seconds > 0 or s.iterations > 0, "> 0 when MAX_WALLCLOCK_SECONDS=0"),
                ("VAL_MAX_TOKENS", lambda s: s.val_max_tokens == 0 or s.val_max_tokens >= s.train_seq_len,
                 f"0 (the whole val split) or >= TRAIN_SEQ_LEN={self.train_seq_len} (one sequence)"),
                # the artifact gets BYTE_BUDGET less the shipped code: a budget at or below the code's bytes fits nothing
                ("BYTE_BUDGET", lambda s: code_bytes is None or s.byte_budget > code_bytes,
                 f"more than the shipped train_gpt.py's {code_bytes} bytes (code + artifact are counted)"),
            )

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
    import re

    try:
        re.compile(value)
    except re.error:
        return False
    return bool(value)


def setting_warnings(hp: Hyperparameters, environ=None) -> list:
    """The WARNING lines Hyperparameters.from_env logs for `environ` (default os.environ) and its `hp`: a
    variable that looks like ours but is not, a setting whose effect never happens in this run. The trainer
    writes them into train.log too: the log is what a reviewer reads, the console is gone."""
    environ = os.environ if environ is None else environ
    lines = []
    warn_unknown_settings(environ, lines.append)
    return lines + inert_settings(hp, {f.name for f in dataclasses.fields(hp) if f.name.upper() in environ})


def warn_unknown_settings(environ, log=print) -> list:
    """Warn about env vars that look like the trainer's but are not (QUANT_* names: QuantPolicy's)."""
    known = {f.name.upper() for f in dataclasses.fields(Hyperparameters)} | {"PRESET"}
    return warn_unknown_env({k: v for k, v in environ.items() if k not in SETTINGS_FOREIGN}, known,
                            SETTINGS_PREFIXES, log, skip_prefixes=("QUANT_",))
