"""primitives/rowquant.py: per-row intN quantization, GPTQ-lite, fake-quant parity with export rounding."""

import numpy as np
import pytest
import torch

from primitives.rowquant import (
    QUANT_CLIP_QUANTILES, dequantize_per_row, fake_quantize_per_row, gptq_lite_quantize, quant_fp16_scale,
    quantize_per_row,
)

SHAPES = [(1, 1), (3, 7), (64, 300), (17, 1), (5, 1024)]


def _bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.view(torch.int32), b.view(torch.int32))


def _reference_quantize(w: np.ndarray, bits: int):
    """Plain numpy float32 version of the documented rule (max-abs clip)."""
    qmax = 2 ** (bits - 1) - 1
    w = w.astype(np.float32)
    s32 = np.clip(np.abs(w).max(axis=1) / np.float32(qmax), 2.0 ** -24, 65504).astype(np.float32)
    scale = np.where(s32 < 2.0 ** -14, np.ceil(s32 * 2.0 ** 24) * 2.0 ** -24, s32).astype(np.float16)
    q = np.clip(np.rint(w / scale.astype(np.float32)[:, None]), -qmax, qmax).astype(np.int8)
    return q, scale


@pytest.mark.parametrize("bits", [2, 3, 4, 5, 6, 7, 8])
@pytest.mark.parametrize("shape", SHAPES)
def test_roundtrip_error_within_half_step(bits, shape):
    torch.manual_seed(bits * 100 + shape[0])
    w = torch.randn(shape) * 0.05
    q, scale = quantize_per_row(w, bits)
    qmax = 2 ** (bits - 1) - 1
    assert q.dtype == torch.int8 and q.shape == shape
    assert scale.dtype == torch.float16 and scale.shape == (shape[0],)
    assert int(q.abs().max()) <= qmax
    # the row max maps to +-qmax (up to fp16 rounding of the scale)
    assert int(q.abs().amax(dim=1).min()) >= qmax - 1
    dq = dequantize_per_row(q, scale)
    assert dq.dtype == torch.float32 and dq.shape == shape
    half_step = scale.float()[:, None] / 2
    # unclipped values: error <= scale/2 (+ float32 rounding of w/scale)
    assert bool(((dq - w).abs() <= half_step * (1 + 1e-5) + 1e-12).all())


@pytest.mark.parametrize("bits", [5, 6, 7, 8])
def test_matches_numpy_reference(bits):
    rng = np.random.default_rng(bits)
    w = (rng.standard_normal((128, 257)) * np.exp(rng.uniform(-12, 1, (128, 1)))).astype(np.float32)
    q, scale = quantize_per_row(torch.from_numpy(w), bits)
    q_ref, scale_ref = _reference_quantize(w, bits)
    assert np.array_equal(scale.numpy().view(np.uint16), scale_ref.view(np.uint16))
    assert np.array_equal(q.numpy(), q_ref)


def test_hand_computed_int6_row():
    w = torch.tensor([[1.0, -0.5, 0.25, 0.0, -1.0]])
    q, scale = quantize_per_row(w, 6)
    assert scale.item() == float(np.float16(1.0 / 31))  # 0.032257080078125
    # -0.5 / 0.032257 = -15.5005 -> -16; 0.25 / 0.032257 = 7.7502 -> 8
    assert q.tolist() == [[31, -16, 8, 0, -31]]


def test_input_dtypes_and_clipped_values():
    torch.manual_seed(0)
    w = torch.randn(32, 200)
    for dtype in (torch.float16, torch.bfloat16, torch.float64):
        q, scale = quantize_per_row(w.to(dtype), 6)
        q_ref, scale_ref = quantize_per_row(w.to(dtype).float(), 6)
        assert torch.equal(q, q_ref) and torch.equal(scale, scale_ref)
    q, scale = quantize_per_row(w, 6, clip_quantile=0.99)
    clip = torch.quantile(w.abs(), 0.99, dim=1)
    dq = dequantize_per_row(q, scale)
    inside = w.abs() <= clip[:, None] * 0.999
    assert bool(((dq - w).abs()[inside] <= (scale.float()[:, None] / 2 * 1.00001).expand_as(w)[inside]).all())
    assert bool((q.abs().amax(dim=1) == 31).all())  # clipped values saturate


def test_zero_and_tiny_rows_are_finite():
    w = torch.zeros(4, 16)
    w[1] = 1e-30
    w[2, 3] = -3e-6
    w[3] = torch.linspace(-1e-5, 1e-5, 16)
    q, scale = quantize_per_row(w, 6)
    dq = dequantize_per_row(q, scale)
    assert bool(torch.isfinite(scale.float()).all()) and bool((scale.float() > 0).all())
    assert torch.equal(dq[0], torch.zeros(16))
    assert bool(((dq - w).abs() <= scale.float()[:, None] / 2 + 1e-12).all())


def test_invalid_bits_raise():
    for bits in (1, 9, 6.0, True):
        with pytest.raises(ValueError, match="bits"):
            quantize_per_row(torch.randn(2, 2), bits)
        with pytest.raises(ValueError, match="bits"):
            fake_quantize_per_row(torch.randn(2, 2), bits)


def test_clip_quantile_matches_torch_quantile():
    """clip_quantile c clips each row at torch.quantile(|w|, c) (linear interpolation)."""
    torch.manual_seed(1)
    w = torch.randn(37, 513)
    for c in (0.0, 0.5, 0.999, 0.99999, 1.0):
        clip = torch.quantile(w.abs(), c, dim=1)
        q, s = quantize_per_row(w, 6, clip_quantile=c)
        assert torch.equal(s, quant_fp16_scale((clip / 31).clamp(2.0 ** -24, 65504)).half())
        assert torch.equal(q, torch.round(w / s.float()[:, None]).clamp(-31, 31).to(torch.int8))


def test_round_to_fp16_matches_cast():
    torch.manual_seed(2)
    x = torch.cat([
        torch.rand(20000) * 65504, torch.rand(20000) * 1e-3, torch.rand(20000) * 2.0 ** -14,
        torch.rand(20000) * 1e-7, torch.exp(torch.randn(20000) * 6).clamp(max=65504), torch.tensor([0.0, 65504.0]),
    ])
    h = x.half().float()
    ulp = torch.nextafter(h.half(), torch.tensor(float("inf")).half()).float() - h
    ties = (h + ulp / 2).clamp(max=65504)  # exact halfway points: ties to even
    for v in (x, ties):
        normal = v >= 2.0 ** -14
        assert _bits_equal(quant_fp16_scale(v)[normal], v[normal].half().float())
        sub, got = v[~normal], quant_fp16_scale(v)[~normal]  # subnormal range: smallest fp16 >= x
        assert _bits_equal(got.half().float(), got) and bool((got >= sub).all())
        assert bool((got - 2.0 ** -24 < sub).all())


def _mse(w, q, s):
    return float((dequantize_per_row(q, s) - w).double().square().sum()) / w.numel()


@pytest.mark.parametrize("bits", [5, 6, 7, 8])
@pytest.mark.parametrize("dist", ["gauss", "laplace", "outliers", "student_t"])
def test_gptq_lite_never_worse_than_max_abs(bits, dist):
    g = torch.Generator().manual_seed(bits)
    w = torch.randn(96, 512, generator=g)
    if dist == "laplace":
        w = torch.distributions.Laplace(0.0, 1.0).sample((96, 512))
    elif dist == "outliers":
        w[torch.rand(96, 512, generator=g) < 0.001] *= 25
    elif dist == "student_t":
        w = torch.distributions.StudentT(3.0).sample((96, 512))
    q, s, clip = gptq_lite_quantize(w, bits)
    assert clip in QUANT_CLIP_QUANTILES
    q1, s1 = quantize_per_row(w, bits)
    assert _mse(w, q, s) <= _mse(w, q1, s1)
    # the returned tensors are exactly the quantization at the chosen quantile
    q2, s2 = quantize_per_row(w, bits, clip_quantile=clip)
    assert torch.equal(q, q2) and torch.equal(s, s2)


@pytest.mark.parametrize("bits", [5, 6])
def test_gptq_lite_clips_single_outliers(bits):
    """One moderate outlier (7 sigma) per 4096-wide row: clipping it beats max-abs clearly.

    (A huge outlier is better kept: clipping it costs more than the finer step saves.)"""
    g = torch.Generator().manual_seed(7)
    w = torch.randn(32, 4096, generator=g)
    w[torch.arange(32), torch.randint(0, 4096, (32,), generator=g)] = 7.0
    q, s, clip = gptq_lite_quantize(w, bits)
    assert clip < 1.0
    assert _mse(w, q, s) < {5: 0.5, 6: 0.85}[bits] * _mse(w, *quantize_per_row(w, bits))


def test_gptq_lite_picks_lowest_mse_candidate():
    torch.manual_seed(3)
    w = torch.distributions.StudentT(2.5).sample((64, 256))
    q, s, clip = gptq_lite_quantize(w, 6)
    errs = {c: _mse(w, *quantize_per_row(w, 6, clip_quantile=c)) for c in QUANT_CLIP_QUANTILES}
    assert _mse(w, q, s) == min(errs.values()) and errs[clip] == min(errs.values())


@pytest.mark.parametrize("bits", [5, 6, 7, 8])
@pytest.mark.parametrize("shape", SHAPES)
def test_fake_quant_equals_export_rounding_bit_for_bit(bits, shape):
    torch.manual_seed(bits + shape[1])
    w = (torch.randn(shape) * 0.03).requires_grad_(True)
    fq = fake_quantize_per_row(w, bits)
    dq = dequantize_per_row(*quantize_per_row(w.detach(), bits))
    assert _bits_equal(fq.detach(), dq)
    upstream = torch.randn(shape)
    fq.backward(upstream)
    assert torch.equal(w.grad, upstream)  # straight-through: identity gradient


def test_fake_quant_gated_pattern_of_the_trainer_is_exact():
    """CastedLinear computes w + gate * (fake_quant(w) - w) with a 0/1 tensor gate."""
    torch.manual_seed(4)
    w = torch.randn(48, 96) * 0.02
    dq = dequantize_per_row(*quantize_per_row(w, 6))
    on, off = torch.ones(()), torch.zeros(())
    assert _bits_equal(w + on * (fake_quantize_per_row(w, 6) - w), dq)
    assert _bits_equal(w + off * (fake_quantize_per_row(w, 6) - w), w)


def test_fake_quant_bf16_weight_keeps_dtype():
    w = torch.randn(8, 32).bfloat16()
    fq = fake_quantize_per_row(w, 6)
    assert fq.dtype == torch.bfloat16
    assert torch.equal(fq, dequantize_per_row(*quantize_per_row(w, 6), dtype=torch.bfloat16))


@pytest.mark.slow
def test_compiled_fake_quant_equals_export_rounding():
    """torch.compile must not change the rounding (Inductor elides fp16 casts: see quant_fp16_scale)."""
    compiled = torch.compile(lambda w, gate: w + gate * (fake_quantize_per_row(w, 6) - w))
    for seed, scale in ((0, 0.02), (1, 1.0), (2, 1e-4)):
        torch.manual_seed(seed)
        w = torch.randn(128, 200) * scale
        w[0] = 0.0
        assert _bits_equal(compiled(w, torch.ones(())), dequantize_per_row(*quantize_per_row(w, 6)))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_fake_quant_equals_cpu_export():
    torch.manual_seed(5)
    w = torch.randn(512, 1536) * 0.02
    ref = dequantize_per_row(*quantize_per_row(w, 6))
    assert _bits_equal(fake_quantize_per_row(w.cuda(), 6).cpu(), ref)
    compiled = torch.compile(lambda w, gate: w + gate * (fake_quantize_per_row(w, 6) - w))
    out = compiled(w.cuda(), torch.ones((), device="cuda")).cpu()
    assert (out != ref).float().mean().item() < 1e-4  # Triton FMA contraction may move a rare value 1 ulp
