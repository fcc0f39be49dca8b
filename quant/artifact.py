"""Export a trained state dict to the counted artifact (fitting the byte budget), and load it back.

export_artifact: quantize by policy (GPTQ-lite per matrix) -> safetensors payload per packing ->
every compressor -> keep the smallest (QUANT_PACKING / QUANT_COMPRESSOR = auto) -> if model bytes +
code bytes exceed the budget, walk QUANT_FIT_LADDER (least sensitive first: MLP int6 -> int5, then
magnitude pruning, attention int5, embedding int7, more pruning), logging bytes and reconstruction
error per step -> write the file atomically. load_artifact reverses it with no pickle anywhere.
"""

import dataclasses
import json
import os
import time
from concurrent.futures import ThreadPoolExecutor

import torch

from quant.codec import (
    QUANT_FORMAT_VERSION, quant_build_payload, quant_dequantize_payload, quant_parse_payload,
    quant_unwrap_container, quant_wrap_container,
)
from quant.core import gptq_lite_quantize, quant_sq_error, quantize_per_row
from quant.packing import QUANT_PACKINGS
from quant.policy import QUANT_COMPRESSORS, QuantPolicy

QUANT_DEFAULT_BYTE_BUDGET = 16_000_000
# (policy field, value): applied in order while the artifact does not fit; a step that would not
# lower the bits / raise the prune fraction of the current policy is skipped.
QUANT_FIT_LADDER = (
    ("mlp_bits", 5), ("prune_fraction", 0.02), ("attn_bits", 5), ("prune_fraction", 0.05),
    ("embed_bits", 7), ("prune_fraction", 0.1), ("mlp_bits", 4), ("prune_fraction", 0.2),
    ("embed_bits", 6), ("prune_fraction", 0.35),
)


def quant_byte_budget(byte_budget=None, environ=None) -> int:
    """Budget in bytes: the argument, else env BYTE_BUDGET, else 16,000,000. ValueError if not > 0."""
    env = os.environ if environ is None else environ
    raw = byte_budget if byte_budget is not None else env.get("BYTE_BUDGET", QUANT_DEFAULT_BYTE_BUDGET)
    try:
        value = int(raw)
    except (TypeError, ValueError):
        value = -1
    if value <= 0:
        raise ValueError(f"BYTE_BUDGET={raw!r}: expected a positive integer number of bytes")
    return value


def prune_smallest(w: torch.Tensor, fraction: float) -> torch.Tensor:
    """Copy of w [R, C] with the `fraction` smallest-|w| entries set to 0 (ties at the threshold too)."""
    k = int(fraction * w.numel())
    if k <= 0:
        return w
    threshold = w.abs().reshape(-1).kthvalue(k).values
    return torch.where(w.abs() <= threshold, torch.zeros_like(w), w)


def quantize_state_dict(state_dict: dict, policy: QuantPolicy, cache=None) -> tuple[dict, dict]:
    """Quantize each tensor as the policy says -> (entries for quant_build_payload, stats).

    state_dict: name -> tensor (float tensors any dtype/device; all must be finite).
    stats: num_params, num_quantized_params, sq_error, sq_norm (float64 sums over float tensors;
    rel_mse = sq_error / sq_norm). `cache` (a dict) reuses per-tensor work across policies.
    ValueError for a non-tensor value or non-finite weights.
    """
    entries, cache = {}, {} if cache is None else cache
    stats = dict(num_params=0, num_quantized_params=0, sq_error=0.0, sq_norm=0.0)
    dtype = getattr(torch, policy.float_dtype)
    for name, t in state_dict.items():
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"state_dict[{name!r}] is a {type(t).__name__}, expected a tensor")
        t = t.detach().to("cpu")
        shape = tuple(t.shape)
        stats["num_params"] += t.numel()
        if not t.is_floating_point():
            entries[name] = {"shape": shape, "tensor": t.contiguous()}
            continue
        if not bool(torch.isfinite(t).all()):
            raise ValueError(f"state_dict[{name!r}] has non-finite values; refusing to export")
        bits = policy.bits_for(name, shape) if t.numel() else None
        w = t.float().reshape(shape[0], -1) if bits else t.float()
        stats["sq_norm"] += float(w.double().square().sum())
        if bits is None:
            stored = t.to(dtype).contiguous()
            stats["sq_error"] += float((stored.double() - w.double()).square().sum())
            entries[name] = {"shape": shape, "tensor": stored}
            continue
        key = (name, bits, policy.prune_fraction, policy.gptq_lite)
        if key not in cache:
            wp = prune_smallest(w, policy.prune_fraction)
            q, scale, clip = gptq_lite_quantize(wp, bits) if policy.gptq_lite else (*quantize_per_row(wp, bits), 1.0)
            cache[key] = ({"shape": shape, "bits": bits, "q": q, "scale": scale, "clip": clip}, quant_sq_error(w, q, scale))
        entries[name], err = cache[key]
        stats["sq_error"] += err
        stats["num_quantized_params"] += t.numel()
    return entries, stats


def _quant_best_encoding(entries, model_config, policy, packings, compressors) -> tuple[bytes, str, str, dict]:
    """Try packing x compressor (compressors run in threads: zlib/zstd/lzma release the GIL)."""
    raws = {p: quant_build_payload(entries, model_config, policy.to_dict(), p) for p in packings}
    jobs = [(p, c) for p in packings for c in compressors]
    with ThreadPoolExecutor(max_workers=len(jobs)) as pool:
        blobs = list(pool.map(lambda job: quant_wrap_container(raws[job[0]], job[1]), jobs))
    sizes = {f"{p}+{c}": len(b) for (p, c), b in zip(jobs, blobs)}
    best = min(range(len(jobs)), key=lambda i: len(blobs[i]))
    return blobs[best], jobs[best][0], jobs[best][1], sizes


def quant_write_atomic(path, data: bytes) -> None:
    """Write bytes to path via path.tmp in the same directory, fsync, os.replace."""
    path = os.fspath(path)
    tmp = path + ".tmp"
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def export_artifact(state_dict: dict, model_config: dict, path, *, code_bytes: int, byte_budget=None,
                    policy=None, compressor="auto", log=print) -> dict:
    """Quantize, compress and atomically write the artifact; fit model + code bytes into the budget.

    state_dict: name -> tensor (CPU or CUDA, float32/bf16/...); model_config: JSON-serializable
    dict stored in the file (GPT(**model_config) rebuilds the model); code_bytes: counted code
    bytes; byte_budget: int, default env BYTE_BUDGET or 16,000,000; policy: QuantPolicy, default
    QuantPolicy.from_env(); compressor: "auto" (use the policy's, itself auto by default) or one of
    zlib/zstd/lzma to force it.
    Returns a report: bytes_model, bytes_code, bytes_total, byte_budget, compressor, packing,
    fit_steps (list of dicts), policy (dict of the final policy), candidates (bytes per
    packing+compressor of the first attempt), rel_mse, num_params, num_quantized_params,
    bits_per_param, export_seconds.
    ValueError when it cannot fit (message has the numbers), on bad inputs or non-finite weights.
    """
    t0 = time.perf_counter()
    policy = QuantPolicy.from_env() if policy is None else policy
    if compressor != "auto":
        policy = dataclasses.replace(policy, compressor=compressor)
    budget = quant_byte_budget(byte_budget)
    if not isinstance(code_bytes, int) or code_bytes < 0:
        raise ValueError(f"code_bytes={code_bytes!r}: expected a non-negative int")
    try:
        ok = isinstance(model_config, dict) and bool(json.dumps(model_config))
    except (TypeError, ValueError):
        ok = False
    if not ok:
        raise ValueError(f"model_config {model_config!r}: expected a JSON-serializable dict")
    packings = QUANT_PACKINGS if policy.packing == "auto" else (policy.packing,)
    compressors = QUANT_COMPRESSORS if policy.compressor == "auto" else (policy.compressor,)
    cache, fit_steps, candidates, ladder, change = {}, [], None, iter(QUANT_FIT_LADDER), None
    while True:
        entries, stats = quantize_state_dict(state_dict, policy, cache)
        blob, packing, comp, sizes = _quant_best_encoding(entries, model_config, policy, packings, compressors)
        candidates = candidates or sizes
        packings, compressors = (packing,), (comp,)  # later fit steps reuse the winning encoding
        rel_mse = stats["sq_error"] / max(stats["sq_norm"], 1e-30)
        total = len(blob) + code_bytes
        if change:
            fit_steps.append(dict(change=change, bytes_model=len(blob), bytes_total=total, rel_mse=rel_mse))
        log(f"quant export{' fit ' + change if change else ''}: attn{policy.attn_bits} mlp{policy.mlp_bits} "
            f"embed{policy.embed_bits} prune{policy.prune_fraction:g} {packing}+{comp}: model {len(blob)} + code "
            f"{code_bytes} = {total} bytes (budget {budget}) rel_mse {rel_mse:.3e}")
        if total <= budget:
            break
        if not policy.fit:
            raise ValueError(f"artifact {total} bytes (model {len(blob)} + code {code_bytes}) exceeds BYTE_BUDGET={budget} "
                             f"by {total - budget} and QUANT_FIT=0")
        for field, value in ladder:
            current = getattr(policy, field)
            if (value > current) if field == "prune_fraction" else (value < current):
                policy, change = dataclasses.replace(policy, **{field: value}), f"{field}={value}"
                break
        else:
            raise ValueError(
                f"artifact cannot fit BYTE_BUDGET={budget}: smallest try is {total} bytes (model {len(blob)} + code "
                f"{code_bytes}, over by {total - budget}) after steps {[s['change'] for s in fit_steps]}; "
                f"shrink the model (NUM_LAYERS / MODEL_DIM / MLP_MULT / VOCAB_SIZE)")
    quant_write_atomic(path, blob)
    num_params = max(stats["num_params"], 1)
    return dict(
        bytes_model=len(blob), bytes_code=code_bytes, bytes_total=total, byte_budget=budget, compressor=comp,
        packing=packing, fit_steps=fit_steps, policy=policy.to_dict(), candidates=candidates, rel_mse=rel_mse,
        num_params=stats["num_params"], num_quantized_params=stats["num_quantized_params"],
        bits_per_param=8.0 * len(blob) / num_params, export_seconds=time.perf_counter() - t0,
    )


def decode_artifact(data: bytes) -> tuple[dict, dict, dict]:
    """Artifact bytes -> (state_dict float32 tensors, model_config, meta); ValueError if damaged.

    meta: format_version, compressor, packing, policy (dict), tensors (name -> [shape, kind, clip]),
    bytes_file, bytes_payload (decompressed safetensors bytes).
    """
    raw, compressor = quant_unwrap_container(data)
    tensors, model_config, quant = quant_parse_payload(raw)
    state_dict = quant_dequantize_payload(tensors, quant)
    meta = dict(format_version=QUANT_FORMAT_VERSION, compressor=compressor, packing=quant["packing"],
                policy=quant["policy"], tensors=quant["tensors"], bytes_file=len(data), bytes_payload=len(raw))
    return state_dict, model_config, meta


def load_artifact(path) -> tuple[dict, dict, dict]:
    """Read an artifact file -> (state_dict float32 tensors, model_config dict, meta dict).

    ValueError naming the file for any truncated, corrupted, foreign or future-version file.
    """
    with open(path, "rb") as f:
        data = f.read()
    try:
        return decode_artifact(data)
    except ValueError as err:
        raise ValueError(f"{os.fspath(path)}: {err}") from None
