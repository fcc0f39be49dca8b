"""`pytest -m gpu`: the step's hand-written backwards (model/softcap_loss.py, model/attn_ops.py) on a real CUDA
device, compiled as the trainer compiles them, against the plain ops under autograd (skipped without CUDA)."""

import pytest
import torch

import model.gpt as gpt
from tests.test_attn_ops import check_step_against_plain_ops

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def test_compiled_step_gradients_as_accurate_as_the_plain_ops_on_cuda(monkeypatch):
    saved = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        check_step_against_plain_ops("cuda", monkeypatch)
    finally:
        torch.backends.cuda.matmul.allow_tf32 = saved
        torch._dynamo.reset()


def test_loss_saves_a_bf16_gradient_when_cuda_autocast_hands_it_float32():
    """torch >= 2.12 CUDA autocast returns the final rms_norm in float32: GPT.forward's loss still saves its [N, V]
    gradient in bf16 (the CPU twin of this: tests/test_step_dtypes.py)."""
    torch.manual_seed(0)
    model = gpt.GPT(vocab_size=8192, num_layers=2, model_dim=256, num_heads=4, num_kv_heads=2, mlp_mult=2.0,
                    rope_dims=32).cuda()
    model.init_weights()
    x = torch.randint(0, 8192, (2, 512), device="cuda")
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append((tuple(t.shape), t.dtype)) or t, lambda t: t):
        with torch.autocast("cuda", torch.bfloat16):
            loss = model(x, x)
    vocab_wide = [(shape, dtype) for shape, dtype in saved if shape and shape[-1] == 8192]  # 0-d saved tensors too
    assert ((1024, 8192), torch.bfloat16) in vocab_wide and all(dt == torch.bfloat16 for _, dt in vocab_wide), vocab_wide
    loss.backward()
    assert all(torch.isfinite(p.grad).all() for p in model.parameters())
