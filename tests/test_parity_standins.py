"""tools/parity/standins.py: FlashAttention's interfaces and a record's Triton kernels as reference math on a CPU,
installed and removed by one context manager. The kernel tests run PR #1855's own kernel objects (skip without
../shared)."""

import sys

import pytest
import torch
import torch.nn.functional as F

from tools.parity.parity_models import PR1855_SCRIPT
from tools.parity.standins import cpu_standins, flash_attn_func, flash_attn_varlen_func, import_script

needs_record = pytest.mark.skipif(not PR1855_SCRIPT.is_file(), reason="needs ../shared/reference/pr1855")


def sdpa(q, k, v):
    return F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True,
                                          enable_gqa=True).transpose(1, 2)


def test_flash_attn_func_is_causal_gqa_attention():
    q, k, v = torch.randn(2, 9, 4, 8), torch.randn(2, 9, 2, 8), torch.randn(2, 9, 2, 8)
    assert torch.allclose(flash_attn_func(q, k, v, causal=True), sdpa(q, k, v), atol=1e-6)


def test_varlen_attends_within_each_sequence_only():
    """Packed sequences of 3, 1, 5 tokens (the cu_seqlens padded with the total, as PR #1855 pads to a bucket)
    equal three separate causal attentions."""
    q, k, v = torch.randn(9, 4, 8), torch.randn(9, 2, 8), torch.randn(9, 2, 8)
    cu = torch.tensor([0, 3, 4, 9, 9, 9], dtype=torch.int32)
    out = flash_attn_varlen_func(q, k, v, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=5, max_seqlen_k=5, causal=True)
    ref = torch.cat([sdpa(q[None, a:b], k[None, a:b], v[None, a:b])[0] for a, b in ((0, 3), (3, 4), (4, 9))])
    assert torch.allclose(out, ref, atol=1e-6)
    with pytest.raises(NotImplementedError, match="window_size"):
        flash_attn_varlen_func(q, k, v, cu, cu, 5, 5, causal=True, window_size=(8, 0))


def test_the_context_installs_and_restores():
    before = {n: sys.modules.get(n) for n in ("triton", "flash_attn_interface")}
    compile_before = torch.compile
    with cpu_standins() as fakes:
        assert sys.modules["flash_attn_interface"] is fakes["flash_attn_interface"]
        assert torch.compile(len) is len and torch.cuda.get_device_properties("cpu").multi_processor_count == 132
        kernel = sys.modules["triton"].jit(lambda: None)
        with pytest.raises(NotImplementedError, match="no CPU stand-in for the Triton kernel '<lambda>'"):
            kernel[(1,)]()
    assert {n: sys.modules.get(n) for n in before} == before and torch.compile is compile_before


@needs_record
def test_the_records_fused_softcapped_ce_kernels_are_its_loss_and_gradient():
    m = import_script(PR1855_SCRIPT)
    logits, targets, c = torch.randn(6, 50) * 20, torch.randint(0, 50, (6,)), 30.0
    losses, lse, grad = torch.empty(6), torch.empty(6), torch.empty(6, 50)
    m._softcapped_ce_fwd_kernel[(6,)](logits, losses, lse, targets, 50, 1, 6, 50, c, block_size=1024, num_warps=4)
    x = logits.clone().requires_grad_()
    ref = F.cross_entropy(c * torch.tanh(x / c), targets, reduction="none")
    g = torch.rand(6)
    ref.backward(g)
    m._softcapped_ce_bwd_kernel[(6,)](grad, g, lse, logits, targets, 50, 1, 50, 1, 6, 50, c, block_size=1024)
    assert torch.allclose(losses, ref.detach(), atol=2e-5) and torch.allclose(grad, x.grad, atol=1e-6)


@needs_record
def test_the_records_fused_mlp_is_leaky_relu_squared():
    """PR #1855's FusedLinearLeakyReLUSquareFunction (its Triton GEMM through the stand-in): values and gradients."""
    m = import_script(PR1855_SCRIPT)
    x, w1, w2 = (torch.randn(*s, requires_grad=True) for s in ((3, 5, 16), (64, 16), (16, 64)))
    with cpu_standins():
        out = m.FusedLeakyReLUSquareMLP(x, w1, w2)
        out.square().sum().backward()
    got = [out.detach(), x.grad, w1.grad, w2.grad]
    for t in (x, w1, w2):
        t.grad = None
    ref = F.linear(F.leaky_relu(F.linear(x, w1), 0.5).square(), w2)
    ref.square().sum().backward()
    for a, b in zip(got, [ref.detach(), x.grad, w1.grad, w2.grad]):
        assert torch.allclose(a, b, rtol=1e-5, atol=1e-4)


def test_the_kits_varlen_path_cuts_documents_as_its_mask_path(monkeypatch):
    """model/attention.py's CUDA form (cu_seqlens of fixed size B*T + 1, flash-attn's varlen kernel: here the
    stand-in, in bf16 as flash-attn runs) gives the dense-mask path's attention."""
    from model import attention as A

    ids = torch.randint(2, 50, (2, 24))
    ids[0, [0, 7, 8, 20]] = ids[1, [11]] = 1
    q, k, v = torch.randn(2, 24, 4, 8), torch.randn(2, 24, 2, 8), torch.randn(2, 24, 2, 8)
    masked = A.attention(q, k, v, A.doc_segments(ids, 1, varlen=False))
    docs = A.doc_segments(ids, 1, varlen=True)
    assert docs.cu_seqlens.tolist() == [0, 7, 8, 20, 24, 35] + [48] * 43 and docs.max_seqlen == 24
    monkeypatch.setattr(A, "_FLASH_ATTN", [flash_attn_func, flash_attn_varlen_func])
    assert torch.allclose(A.attention(q, k, v, docs), masked, atol=3e-2)
    assert not torch.allclose(A.attention(q, k, v), masked, atol=3e-2)  # plain causal reads across the BOS
