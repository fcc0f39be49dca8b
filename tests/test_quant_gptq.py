"""quant/gptq.py: full GPTQ against round-to-nearest and GPTQ-lite, the identity-Hessian case, and the
calibration Hessians (every linear's inputs, train shards only, inside the trainer's clock)."""

from pathlib import Path

import pytest
import torch

from primitives.rowquant import QUANT_CLIP_QUANTILES, dequantize_per_row, gptq_lite_quantize, quantize_per_row
from quant.gptq import collect_gptq_hessians, gptq_quantize
import train_gpt
import trainer.context as trainer_context
import shards.loader as trainer_loader
import trainer.loop as trainer_loop
import model.gpt as trainer_model
import primitives.settings as trainer_settings
import shards.format as trainer_shards


def _calibration_inputs(n=4096, c=160, seed=0):
    """Correlated inputs with a few large channels, like a transformer's activations: x [n, c]."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, c, generator=g) @ (torch.randn(c, c, generator=g) / c ** 0.5) + 0.3 * torch.randn(n, c, generator=g)
    x[:, :5] *= 6
    return x


def _output_error(w, x, q, s):
    return float(((dequantize_per_row(q, s) - w) @ x.T).square().sum())


@pytest.mark.parametrize("bits", [3, 4, 5, 6, 8])
def test_gptq_output_error_is_lower_than_round_to_nearest(bits):
    x = _calibration_inputs()
    w = torch.randn(48, x.shape[1], generator=torch.Generator().manual_seed(bits)) * 0.05
    h = x.T @ x / len(x)
    rtn = _output_error(w, x, *quantize_per_row(w, bits))
    lite = _output_error(w, x, *gptq_lite_quantize(w, bits)[:2])
    one_clip = _output_error(w, x, *gptq_quantize(w, h, bits, (1.0,))[:2])
    full = _output_error(w, x, *gptq_quantize(w, h, bits)[:2])
    assert one_clip < 0.8 * rtn and full < 0.8 * lite, (rtn, lite, one_clip, full)
    assert full <= one_clip * (1 + 1e-5)  # each row keeps its best clip, 1.0 included


@pytest.mark.parametrize("bits", [2, 4, 5, 6, 8])
def test_identity_hessian_equals_round_to_nearest(bits):
    w = torch.randn(40, 200, generator=torch.Generator().manual_seed(bits))  # 200 columns: two GPTQ blocks
    w[3, 7] = 25.0  # an outlier row: its clip quantile matters
    for clip in QUANT_CLIP_QUANTILES:
        q, s, chosen = gptq_quantize(w, 3.0 * torch.eye(200), bits, (clip,))
        q0, s0 = quantize_per_row(w, bits, clip)
        assert torch.equal(q, q0) and torch.equal(s, s0) and chosen == pytest.approx(clip)
    # with every candidate, each row keeps the clip with the lowest squared error (ties: the earlier one)
    q, s, _ = gptq_quantize(w, torch.eye(200), bits)
    row_err = (dequantize_per_row(q, s) - w).square().sum(1)
    for clip in QUANT_CLIP_QUANTILES:
        assert (row_err <= (dequantize_per_row(*quantize_per_row(w, bits, clip)) - w).square().sum(1)).all()


def test_gptq_handles_dead_and_rank_deficient_inputs_deterministically():
    x = _calibration_inputs(n=40, c=64)  # fewer samples than columns: H is singular
    x[:, 10] = 0  # an input that never fires
    w = torch.randn(16, 64, generator=torch.Generator().manual_seed(1))
    h = x.T @ x
    q, s, clip = gptq_quantize(w, h, 4)
    assert q.dtype == torch.int8 and q.abs().max() <= 7 and s.dtype == torch.float16 and 0.999 <= clip <= 1.0
    assert torch.equal(q, gptq_quantize(w, h.clone(), 4)[0])
    assert _output_error(w, x, q, s) < _output_error(w, x, *quantize_per_row(w, 4))


def _tiny_gpt(train_gpt, vocab_size=1024, **extra):
    env = {"NUM_LAYERS": "2", "MODEL_DIM": "32", "NUM_HEADS": "4", "NUM_KV_HEADS": "2", "ROPE_DIMS": "8",
           "XSA_LAST_N": "1", "VOCAB_SIZE": str(vocab_size), "MLP_MULT": "2", **extra}
    hp = trainer_settings.Hyperparameters.from_env(env, log=lambda msg: None)
    torch.manual_seed(0)
    model = trainer_model.GPT(**trainer_model.build_model_config(hp))
    model.init_weights()
    return model


def test_collected_hessians_are_the_inputs_second_moment_of_every_linear():
    model = _tiny_gpt(train_gpt, vocab_size=64, TIE_EMBEDDINGS="0")
    g = torch.Generator().manual_seed(0)
    batches = [torch.randint(0, 64, (3, 16), generator=g) for _ in range(5)]
    inputs, handles = {}, []
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear):
            handles.append(module.register_forward_hook(
                lambda m, a, o, name=name: inputs.setdefault(name + ".weight", []).append(a[0].reshape(-1, a[0].shape[-1]))))
    with torch.no_grad():
        for x in batches:
            model(x, x)
    for handle in handles:
        handle.remove()
    stream = iter(batches)
    hessians, n = collect_gptq_hessians(model, lambda: (lambda x: (x, x))(next(stream)), 5)
    assert n == 5 and len(inputs) == 2 * 6 and set(hessians) == {*inputs, "lm_head.weight"}
    hidden = torch.cat([model.forward_hidden(x).detach().reshape(-1, 32) for x in batches])  # the head's input
    torch.testing.assert_close(hessians["lm_head.weight"], hidden.T @ hidden / len(hidden), rtol=1e-5, atol=1e-6)
    assert "forward_hidden" not in model.__dict__  # the capture is gone: the class's method again
    for name, xs in inputs.items():
        x = torch.cat(xs)
        torch.testing.assert_close(hessians[name], x.T @ x / len(x), rtol=1e-5, atol=1e-6)
    assert torch.equal(hessians["blocks.0.attn.c_q.weight"], hessians["blocks.0.attn.c_v.weight"])  # one input
    assert hessians["blocks.1.mlp.proj.weight"].shape == (64, 64) and not model._forward_hooks
    # the deadline stops it early, after at least one batch (every rank must have every H)
    stream = iter(batches)
    assert collect_gptq_hessians(model, lambda: (lambda x: (x, x))(next(stream)), 5, deadline=0)[1] == 1


def test_the_tied_head_gets_the_final_norm_outputs_hessian_under_the_embeddings_name():
    """The tied embedding is the head (F.linear, no module): its H is forward_hidden's output second moment."""
    model = _tiny_gpt(train_gpt, vocab_size=64)
    batches = [torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(i)) for i in range(3)]
    stream = iter(batches)
    hessians, n = collect_gptq_hessians(model, lambda: (lambda x: (x, x))(next(stream)), 3)
    with torch.no_grad():
        hidden = torch.cat([model.forward_hidden(x).reshape(-1, 32) for x in batches])
    assert n == 3 and "tok_emb.weight" in hessians and "lm_head.weight" not in hessians
    torch.testing.assert_close(hessians["tok_emb.weight"], hidden.T @ hidden / len(hidden), rtol=1e-5, atol=1e-6)
    stream = iter([batches[0]])  # an error inside the forward leaves no capture behind
    with pytest.raises(StopIteration):
        collect_gptq_hessians(model, lambda: (lambda x: (x, x))(next(stream)), 2, deadline=float("inf"))
    assert "forward_hidden" not in model.__dict__


def test_hessians_are_summed_in_float32_under_bf16_autocast():
    """CPU twin of the CUDA run: train() collects under ctx.autocast (bf16 on CUDA), where a plain
    X^T X would be a bf16 matmul and the 64-batch sums would keep 8 bits of mantissa."""
    model = _tiny_gpt(train_gpt, vocab_size=64)
    batches = [torch.randint(0, 64, (3, 16), generator=torch.Generator().manual_seed(i)) for i in range(3)]
    bf16 = lambda: torch.autocast("cpu", dtype=torch.bfloat16)
    inputs = []
    handle = model.blocks[0].mlp.fc.register_forward_hook(lambda m, a, o: inputs.append(a[0].reshape(-1, a[0].shape[-1])))
    with torch.no_grad(), bf16():
        for x in batches:
            model(x, x)
    handle.remove()
    stream = iter(batches)
    hessians, n = collect_gptq_hessians(model, lambda: (lambda x: (x, x))(next(stream)), 3, autocast=bf16)
    assert n == 3 and {h.dtype for h in hessians.values()} == {torch.float32}
    x = torch.cat(inputs).float()
    torch.testing.assert_close(hessians["blocks.0.mlp.fc.weight"], x.T @ x / len(x), rtol=1e-5, atol=1e-6)


def _gptq_run_parts(env: dict, tmp_path) -> tuple:
    """(hp, a CPU RunContext whose log lines go to `logs`, logs, a seeded GPT with GPTQ calibration on)."""
    from quant.policy import QuantPolicy

    hp = trainer_settings.Hyperparameters.from_env(env, log=lambda msg: None)
    logs = []
    ctx = trainer_context.RunContext(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"), run_dir=tmp_path)
    ctx.log = lambda msg="", console=True: logs.append(msg)
    torch.manual_seed(0)
    model = trainer_model.GPT(**trainer_model.build_model_config(hp))
    model.init_weights()
    model.configure_qat(QuantPolicy(gptq=True))
    return hp, ctx, logs, model


def test_calibration_inside_the_clock_reads_train_shards_only(real_text_docs, sp1024_model, monkeypatch, tmp_path):
    """train() with QUANT_GPTQ=1 reserves GPTQ_RESERVE_SECONDS, then reads its calibration batches through
    the train loader: every shard file opened during train() is a train shard, never a val shard."""
    import dataclasses
    import json

    from shards.format import list_shards
    from tools.data.data_shards import prepare_jsonl_dataset

    (tmp_path / "docs.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in real_text_docs[:40]))
    dataset = tmp_path / "small_shards"  # 4096-token shards: the calibration stream wraps around all of them
    prepare_jsonl_dataset([tmp_path / "docs.jsonl"], sp1024_model, dataset, num_val_docs=10, shard_tokens=4096,
                          progress=False, log=lambda msg: None)
    num_train_tokens = sum(p.stat().st_size - 1024 for p in list_shards(dataset, "train")) // 2

    opened, real_load = [], trainer_shards.load_data_shard
    monkeypatch.setattr(trainer_loader, "load_data_shard", lambda path: opened.append(Path(path).name) or real_load(path))
    monkeypatch.setattr(train_gpt, "load_validation_tokens", lambda *a, **k: pytest.fail("val tokens loaded"))
    # a fast batch (a loaded machine's real timing could raise the 5 s reserve: tests below)
    monkeypatch.setattr(trainer_loop, "time_calibration_batch", lambda *a: 0.01)
    env = {"PRESET": "smoke", "NUM_LAYERS": "2", "MODEL_DIM": "32", "NUM_HEADS": "4", "NUM_KV_HEADS": "2",
           "ROPE_DIMS": "8", "XSA_LAST_N": "1", "MLP_MULT": "2", "TRAIN_SEQ_LEN": "64", "TRAIN_BATCH_TOKENS": "2048",
           "ITERATIONS": "2", "MAX_WALLCLOCK_SECONDS": "500", "GPTQ_RESERVE_SECONDS": "5",
           "GPTQ_CALIB_BATCHES": str(num_train_tokens // 2048 + 2), "EMA_DECAY": "0", "DATA_PATH": str(dataset)}
    hp, ctx, logs, model = _gptq_run_parts(env, tmp_path)
    loader = trainer_loader.DistributedTokenLoader(hp.data_path, hp.vocab_size)
    no_time_left = dataclasses.replace(hp, max_wallclock_seconds=5.0)  # a 5 s reserve of a 5 s cap: refused up front
    num_opened = len(opened)
    with pytest.raises(ValueError, match=r"^GPTQ_RESERVE_SECONDS=5\.0: expected < MAX_WALLCLOCK_SECONDS=5\.0 with QUANT_GPTQ=1$"):
        trainer_loop.train(ctx, no_time_left, model, loader, flops_per_token=0.0)
    assert len(opened) == num_opened and not logs  # no batch read, nothing logged
    steps = trainer_loop.train(ctx, hp, model, loader, flops_per_token=0.0).steps
    train_names = [p.name for p in list_shards(dataset, "train")]
    assert steps == 2 and len(train_names) > 5 and sorted(set(opened)) == train_names  # wrapped around the split
    assert not set(opened) & {p.name for p in list_shards(dataset, "val")}
    assert "gptq_reserve_seconds:5.0 training cap:495000ms" in logs
    line = next(m for m in logs if m.startswith("gptq_calibration"))
    assert line.startswith(f"gptq_calibration batches:{hp.gptq_calib_batches} tokens:{hp.gptq_calib_batches * 2048} ")
    assert "reserve:5000ms" in line
    linears = [n + ".weight" for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)]
    assert sorted(model.gptq_hessians) == sorted(linears + ["tok_emb.weight"]) and len(linears) == 12


class FakeClock:
    """A clock that advances only when the model runs: `train_seconds` per training forward (grad on),
    `calib_seconds` per calibration forward (no grad). Stands in for trainer.loop's `time` module."""

    def __init__(self, train_seconds: float, calib_seconds: float):
        self.now, self.train_seconds, self.calib_seconds = 1000.0, train_seconds, calib_seconds

    def perf_counter(self) -> float:
        return self.now

    def wrap(self, forward):
        def timed(model, *args, **kwargs):
            self.now += self.train_seconds if torch.is_grad_enabled() else self.calib_seconds
            return forward(model, *args, **kwargs)
        return timed


def test_calibration_stops_at_its_deadline_on_an_injected_clock():
    """Batches of 1 s, deadline 3.5 s away: 3 batches end at 3 s; a fourth would end at 4 s (the old
    check, `now < deadline` before a batch, read it and overran)."""
    model = _tiny_gpt(train_gpt, vocab_size=64)
    clock = FakeClock(0.0, 1.0)
    x = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(0))
    model.forward = clock.wrap(type(model).forward).__get__(model)
    hessians, n = collect_gptq_hessians(model, lambda: (x, x), 10, deadline=1003.5, clock=clock.perf_counter)
    assert n == 3 and clock.now == 1003.0 and hessians
    # the estimate from before the clock counts too: at 2 s a batch only the first (mandatory) one runs
    clock.now = 1000.0
    assert collect_gptq_hessians(model, lambda: (x, x), 10, deadline=1003.5, clock=clock.perf_counter,
                                 batch_seconds=2.0)[1] == 2 and clock.now == 1002.0


def _clocked_train(monkeypatch, tmp_path, tiny_dataset, clock, **settings):
    env = {"PRESET": "smoke", "NUM_LAYERS": "1", "MODEL_DIM": "32", "NUM_HEADS": "2", "NUM_KV_HEADS": "1",
           "ROPE_DIMS": "8", "XSA_LAST_N": "0", "MLP_MULT": "2", "TRAIN_SEQ_LEN": "32", "TRAIN_BATCH_TOKENS": "256",
           "ITERATIONS": "100000", "EMA_DECAY": "0", "DATA_PATH": str(tiny_dataset), "TRAIN_LOG_EVERY": "1000",
           "EVAL_STRIDE": "16",
           **settings}
    hp, ctx, logs, model = _gptq_run_parts(env, tmp_path)
    monkeypatch.setattr(trainer_loop, "time", clock)
    monkeypatch.setattr(trainer_model.GPT, "forward", clock.wrap(trainer_model.GPT.forward))
    loader = trainer_loader.DistributedTokenLoader(hp.data_path, hp.vocab_size)
    return trainer_loop.train(ctx, hp, model, loader, flops_per_token=0.0), logs, model


def test_training_plus_calibration_never_passes_the_cap(monkeypatch, tmp_path, tiny_dataset):
    """Injected clock: 0.1 s a training step, 1 s a calibration batch, MAX_WALLCLOCK_SECONDS=6 and a 0.5 s
    reserve. Before: training ran to 5.5 s and the calibration batches to 6.5 s (train_time over the cap).
    Now the reserve is sized from a batch timed before the clock (2 batches: 2 s) and calibration stops at
    the cap: training to 4 s, 2 batches, 6.0 s in all."""
    result, logs, model = _clocked_train(monkeypatch, tmp_path, tiny_dataset, FakeClock(0.1, 1.0),
                                         MAX_WALLCLOCK_SECONDS="6", GPTQ_RESERVE_SECONDS="0.5", GPTQ_CALIB_BATCHES="64")
    assert result.train_seconds <= 6.0 + 1e-9 and result.steps == pytest.approx(40, abs=1)
    assert ("gptq_reserve: GPTQ_RESERVE_SECONDS=0.5 raised to 2.0s: one calibration batch takes 1.00s (timed before "
            "the clock), the reserve holds two") in logs
    line = next(m for m in logs if m.startswith("gptq_calibration"))
    assert line.startswith("gptq_calibration batches:2 tokens:512 time:2000ms reserve:2000ms")
    assert line.endswith(" (of GPTQ_CALIB_BATCHES=64: stopped at MAX_WALLCLOCK_SECONDS=6)") and model.gptq_hessians


class QueuedClock(FakeClock):
    """FakeClock whose calibration forwards run behind the launches, as CUDA's do: their seconds reach the
    clock only at ctx.sync() (torch.cuda.synchronize). Training forwards stay synchronous."""

    def __init__(self, train_seconds: float, calib_seconds: float):
        super().__init__(train_seconds, calib_seconds)
        self.queued = 0.0

    def wrap(self, forward):
        def timed(model, *args, **kwargs):
            if torch.is_grad_enabled():
                self.now += self.train_seconds
            else:
                self.queued += self.calib_seconds
            return forward(model, *args, **kwargs)
        return timed

    def sync(self) -> None:
        self.now, self.queued = self.now + self.queued, 0.0


def test_calibration_on_queued_batches_never_passes_the_cap(monkeypatch, tmp_path, tiny_dataset):
    """As above, with the calibration batches queued as on a GPU. Before, the calibration read the launch
    clock: all 64 batches were launched "in no time" and ran past the cap (an H200 run: 0.13 s past it).
    Its clock now waits for the device, so it stops at 2 batches and 6.0 s, as on a CPU."""
    clock = QueuedClock(0.1, 1.0)
    monkeypatch.setattr(trainer_context.RunContext, "sync", lambda self: clock.sync())
    result, logs, model = _clocked_train(monkeypatch, tmp_path, tiny_dataset, clock,
                                         MAX_WALLCLOCK_SECONDS="6", GPTQ_RESERVE_SECONDS="0.5", GPTQ_CALIB_BATCHES="64")
    assert result.train_seconds <= 6.0 + 1e-9 and result.steps == pytest.approx(40, abs=1)
    line = next(m for m in logs if m.startswith("gptq_calibration"))
    assert line.startswith("gptq_calibration batches:2 tokens:512 time:2000ms reserve:2000ms") and model.gptq_hessians


def test_calibration_with_no_time_left_is_skipped_and_says_so(monkeypatch, tmp_path, tiny_dataset):
    """A training step that runs deep into the reserve (3.5 s a step, cap 4 s, reserve 2 s): no 1 s batch
    fits the 0.5 s left; the calibration is skipped (the export falls back to GPTQ-lite), never run past
    the cap (before: one batch, 4.5 s)."""
    result, logs, model = _clocked_train(monkeypatch, tmp_path, tiny_dataset, FakeClock(3.5, 1.0),
                                         MAX_WALLCLOCK_SECONDS="4", GPTQ_RESERVE_SECONDS="2")
    assert result.steps == 1 and result.train_seconds == pytest.approx(3.5)  # one step, then the cap
    assert "WARNING: gptq_calibration skipped: 0.5s left of MAX_WALLCLOCK_SECONDS=4, one batch takes 1.0s: the export " \
           "uses GPTQ-lite" in logs
    assert model.gptq_hessians == {}


def test_gptq_on_the_tied_embedding_lowers_the_head_output_error_and_decodes_to_what_it_evaluated(tmp_path):
    """QUANT_GPTQ_EMBED=1: the embedding is solved with the head input's H; the artifact decodes to exactly
    that solve's weights, and its head-output error tr(dW H dW^T) is below the GPTQ-lite clip search's."""
    from quant.artifact import export_artifact, load_artifact
    from quant.policy import QuantPolicy

    model = _tiny_gpt(train_gpt, vocab_size=64)
    with torch.no_grad():  # a heavy-tailed, trained-looking embedding
        model.tok_emb.weight.copy_(torch.distributions.StudentT(3).sample(model.tok_emb.weight.shape) * 0.05)
    batches = [torch.randint(0, 64, (4, 32), generator=torch.Generator().manual_seed(i)) for i in range(4)]
    stream = iter(batches)
    hessians, _ = collect_gptq_hessians(model, lambda: (lambda x: (x, x))(next(stream)), 4)
    h, w = hessians["tok_emb.weight"].double(), model.tok_emb.weight.detach().double()
    state, config = model.state_dict(), {"vocab_size": 64}
    errors = {}
    for on in (False, True):
        policy = QuantPolicy(embed_bits=5, fit=False, gptq_embed=on, compressor="zlib")
        export_artifact(state, config, tmp_path / f"{on}.ptz", code_bytes=0, policy=policy, hessians=hessians,
                        log=lambda msg: None)
        d = load_artifact(tmp_path / f"{on}.ptz")[0]["tok_emb.weight"].double() - w
        errors[on] = float(((d @ h) * d).sum())
        if on:
            q, s, _ = gptq_quantize(w.float(), h.float(), 5)
            torch.testing.assert_close(d + w, dequantize_per_row(q, s, torch.double), rtol=0, atol=0)
    assert errors[True] < 0.9 * errors[False], errors
    from quant.offline import quant_policy_from_dict

    # on by default and always in the artifact's policy; a policy written before the setting existed reads as off
    assert QuantPolicy().to_dict()["gptq_embed"] is True and QuantPolicy(gptq_embed=False).to_dict()["gptq_embed"] is False
    older = {k: v for k, v in QuantPolicy().to_dict().items() if k != "gptq_embed"}
    assert quant_policy_from_dict(older).gptq_embed is False and quant_policy_from_dict(QuantPolicy().to_dict()).gptq_embed
