"""Always-on CPU guard of the training step's activation dtypes (issue 25).

On an H100 the kit's float32 residual stream cost ~65 ms of a 426 ms step (torch 2.11: fused
RMSNorm-backward reductions spilling float32 tiles; ../shared/gpu/codegen/README.md). The cause is
visible on a CPU: under bf16 autocast, the tensors autograd saves for backward include float32
[B, T, model_dim] activations. These tests fail if that stream comes back, and check that fp32 runs
(no autocast) keep every saved tensor float32 (nothing changes there).
"""

import pytest
import torch

from tools.bench.step_twin import saved_activation_census

CONFIG = dict(vocab_size=512, num_layers=4, model_dim=64, num_heads=4, num_kv_heads=2, mlp_mult=3.0,
              rope_dims=8, xsa_last_n=2)


@pytest.mark.parametrize("parallel_residual_start", [-1, 2])
def test_no_float32_residual_stream_saved_under_bf16_autocast(parallel_residual_start):
    census = saved_activation_census({**CONFIG, "parallel_residual_start": parallel_residual_start}, 2, 32)
    assert census.residual_fp32() == [], f"float32 [B, T, D] saved for backward: {census.residual_fp32()[:4]}"


def test_bf16_census_saves_fewer_float32_bytes_than_fp32_run():
    """The bf16 step's float32 saved bytes stay a small share (logits path, norms' rstd), measured here so a
    regression shows as a number in the failure message."""
    bf16 = saved_activation_census(CONFIG, 2, 32)
    fp32 = saved_activation_census(CONFIG, 2, 32, autocast_dtype=None)
    assert set(fp32.bytes_by_dtype()) <= {torch.float32, torch.int64}
    share = bf16.bytes_by_dtype(skip_norm_copies=True)[torch.float32] / fp32.bytes_by_dtype()[torch.float32]
    assert share < 0.3, f"bf16 step saves {share:.0%} of the fp32 step's float32 bytes"


def test_guard_catches_a_float32_residual_reintroduced(monkeypatch):
    """The guard itself: make the embedding output float32 again and the census must see it."""
    import model.gpt as trainer_model

    monkeypatch.setattr(trainer_model, "residual_dtype", lambda x: torch.float32)
    census = saved_activation_census(CONFIG, 2, 32)
    assert len(census.residual_fp32()) >= CONFIG["num_layers"]


def test_muon_allocates_momentum_buffers_once_and_updates_bit_for_bit(monkeypatch):
    """Muon's momentum buffers are created on the first step only (the old setdefault(..., zeros_like(p))
    zero-filled a fresh tensor per matrix every step); the update is the same, bit for bit."""
    from trainer.optim import Muon

    torch.manual_seed(0)
    shapes = [(32, 32), (16, 32), (16, 32), (96, 32)]
    params = [torch.nn.Parameter(torch.randn(*s) * 0.02) for s in shapes]
    grads = [[torch.randn(*s) for s in shapes] for _ in range(3)]
    old = [torch.nn.Parameter(p.detach().clone()) for p in params]

    class OldMuon(Muon):  # the previous buffer rule, same arithmetic
        @torch.no_grad()
        def step(self):
            for p in self.param_groups[0]["params"]:
                self.state[p].setdefault("momentum_buffer", torch.zeros_like(p))
            return super().step()

    calls = []
    real = torch.zeros_like
    monkeypatch.setattr(torch, "zeros_like", lambda *a, **k: calls.append(1) or real(*a, **k))
    settings = dict(lr=0.03, momentum=0.95, weight_decay=0.02)
    ours, ref = Muon(params, **settings), OldMuon(old, **settings)
    for step, gs in enumerate(grads):
        for p, q, g in zip(params, old, gs):
            p.grad, q.grad = g.clone(), g.clone()
        before = len(calls)
        ours.step()
        assert len(calls) - before == (len(shapes) if step == 0 else 0)
        ref.step()
    assert all(torch.equal(a, b) for a, b in zip(params, old))


def test_no_float32_full_size_activation_saved_with_cuda_autocasts_float32_rms_norm():
    """torch >= 2.12 CUDA autocast runs rms_norm in float32 (tools/flash_twin twin): the q/k norms and the
    residual norms must come back to bf16 before RoPE / the next op saves them."""
    from tools.bench.flash_twin import cuda_autocast_rms_norm

    with cuda_autocast_rms_norm():
        census = saved_activation_census(CONFIG, 2, 32)
    # what F.rms_norm saves itself is reported apart; the loss (model/softcap_loss.py) saves its logits' gradient
    # in bf16 even though the final rms_norm hands it float32 (a float32 [tokens x vocab] gradient would double
    # the head's backward traffic and run its matmuls in float32)
    outside_norms = [t for t in census.full_size() if not t[2]]
    assert outside_norms == [], f"float32 full-size tensors saved: {outside_norms[:4]}"
    vocab_wide = [(shape, dtype) for shape, dtype, _ in census.saved
                  if shape and shape[-1] == CONFIG["vocab_size"]]
    assert vocab_wide and all(dtype == torch.bfloat16 for _, dtype in vocab_wide), vocab_wide
