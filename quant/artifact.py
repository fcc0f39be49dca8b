"""The counted model artifact (.ptz): export a trained state dict into the byte budget, load it back.

export_artifact: quantize by policy (GPTQ-lite per matrix) -> payload per packing -> every
compressor (in threads) -> keep the smallest (QUANT_PACKING / QUANT_COMPRESSOR = auto) -> if model
bytes + code bytes exceed the budget, walk QUANT_FIT_LADDER (least sensitive first: MLP int6 ->
int5, then magnitude pruning, attention int5, embedding int7, more pruning), logging bytes and
reconstruction error per step -> write the file atomically. load_artifact reverses it; nothing is
unpickled.

File layout (little-endian):
    offset 0   4 bytes  magic b"PGQZ"
    offset 4   1 byte   format version, 3 (QUANT_PREFIX holds both). Version 2 (same layout, no
                        "run" entry in the header: no training sequence length, tokenizer sha256
                        or eval stride) still loads; version 1 was a safetensors payload, whose
                        metadata key order changed from process to process, and is refused
    offset 5   1 byte   compressor id: 1 zlib (level 9), 2 zstd (level 22), 3 lzma (raw LZMA2, preset 9|extreme)
    offset 6   4 bytes  uint32 length L of the decompressed payload
    offset 10  4 bytes  uint32 CRC-32 of bytes 0..9 followed by the compressed payload
    offset 14  ...      compressed payload
Payload (L bytes, decompressed):
    data: the q values of every quantized tensor in header order, as pack_bits streams: packing
          "int8" stores one offset byte per value (pack_bits(q, 8): q + 128, the int8 bytes with the
          top bit flipped, which compresses exactly like int8), packing "bits" ceil(R*C*N/8) bytes
          (pack_bits(q, N)); then, in header order, the float16 scale [R] of each quantized tensor
          or the stored passthrough tensor (raw bytes of its dtype). Integer data first: a few kB
          of float16 noise in front of it cost zstd ~4% of the whole artifact in measurements.
    header: UTF-8 JSON {"config": model_config, "packing": "int8"|"bits", "policy": policy dict,
          "tensors": [[name, shape, kind, clip quantile], ...], "run": run} in state-dict order; kind is the
          int bit width N of a quantized tensor or the dtype name ("float16", "int64", ...) of a
          passthrough one. No dict with hash-ordered keys: the bytes depend only on the inputs
          (same state dict -> same file, in any process; tests/test_quant_artifact.py runs two).
          run (format 3): what scoring the file needs besides the data and the tokenizer, as the
          trainer writes it: {"train_seq_len": int (the eval window), "vocab_size": int,
          "tokenizer_sha256": hex str, "eval_stride": int (EVAL_STRIDE the run started its sliding
          eval with)}; {} when the writer had none (tests, benches). `python -m eval score` reads it.
    4 bytes: uint32 length of the header.
Decoding checks magic + version and the CRC before anything else, inflates with the output capped
at the declared length (no zip bombs), then requires the data to split exactly into the pieces the
header describes (so no allocation exceeds the file's own size class). Every failure, including
any exception of the parsing code on a crafted payload with a valid CRC, is a ValueError naming
the file: a damaged file never crashes or hangs the loader; nothing is unpickled.

Bit packing: value i of the flattened q is stored as u = q + 2**(N-1) in bits [N*i, N*i + N) of a
little-endian bit stream, LSB first, zero-padded to whole bytes; for int6 "4 values in 3 bytes".
Groups of 8 values (8*N bits = N bytes) are built in one int64 word (little-endian machines; every
supported platform is).

Size note: bundled into the counted train_gpt.py; CLI / bench helpers live in quant/offline.py.
"""

import dataclasses
import json
import lzma
import math
import os
from pathlib import Path
import struct
import zlib
from concurrent.futures import ThreadPoolExecutor

import torch
import zstandard

from quant.core import dequantize_per_row, gptq_lite_quantize, quantize_per_row
from quant.policy import QUANT_COMPRESSORS, QuantPolicy

QUANT_PREFIX = b"PGQZ\x03"  # magic + format version 3 (b"PGQZ\x02", version 2, still loads)
# (policy field, value): applied in order while the artifact does not fit; a step that would not
# lower the bits / raise the prune fraction of the current policy is skipped.
QUANT_FIT_LADDER = (("mlp_bits", 5), ("prune_fraction", 0.02), ("attn_bits", 5), ("prune_fraction", 0.05),
                    ("embed_bits", 7), ("prune_fraction", 0.1), ("mlp_bits", 4), ("prune_fraction", 0.2),
                    ("embed_bits", 6), ("prune_fraction", 0.35))


def pack_bits(q, bits):
    """Pack integers q (any shape, values in [-2**(bits-1), 2**(bits-1)-1], bits 1..8) densely.

    Returns uint8 [ceil(q.numel() * bits / 8)] (CPU). Values out of range corrupt their
    neighbours: callers pass quantizer output.
    """
    u = q.reshape(-1).long() + (1 << bits - 1)
    n = u.numel()
    u = torch.cat([u, u.new_zeros(-n % 8)]).view(-1, 8) << torch.arange(0, 8 * bits, bits)
    # sum of disjoint bit fields = bitwise or; keep the low `bits` bytes of each little-endian word
    return u.sum(1).view(torch.uint8).view(-1, 8)[:, :bits].reshape(-1)[:(n * bits + 7) // 8]


def unpack_bits(packed, bits, n):
    """Inverse of pack_bits: uint8 [ceil(n * bits / 8)] -> int64 [n]."""
    offset, g = 1 << bits - 1, -(-n // 8)  # (bits < 1 fails here, before any allocation)
    w = torch.cat([packed, packed.new_zeros(g * bits - packed.numel())]).view(g, bits)
    w = torch.cat([w, w.new_zeros(g, 8 - bits)], 1).view(torch.int64)  # [G, 1]
    return ((w >> torch.arange(0, 8 * bits, bits)) & (1 << bits) - 1).view(-1)[:n] - offset


def quantize_state_dict(state_dict, policy):
    """Quantize each tensor as the policy says -> (entries for quant_build_payload, rel_mse).

    state_dict: name -> tensor (float tensors any dtype/device, all finite). entries: name ->
    (shape, bits, q int8 [R, C], scale float16 [R], clip quantile) for a quantized tensor, or
    (shape, None, stored tensor, None, None) for a passthrough one (floats in policy.float_dtype,
    other dtypes as they are). rel_mse: squared reconstruction error / squared norm of the
    quantized matrices (float64 sums; the float16 passthrough error is negligible).
    ValueError for a non-finite float tensor.
    """
    entries, err, norm = {}, 0.0, 1e-30
    for name, t in state_dict.items():
        t = t.detach().cpu()
        shape, fp = tuple(t.shape), t.is_floating_point()
        if fp and not t.isfinite().all():
            raise ValueError(f"state_dict[{name!r}] is not finite")
        bits = fp and t.numel() and policy.bits_for(name, shape)
        if not bits:
            entries[name] = shape, None, t.to(getattr(torch, policy.float_dtype)) if fp else t, None, None
            continue
        w = t.double().reshape(shape[0], -1)
        k = int(policy.prune_fraction * w.numel())  # magnitude pruning: zero the k smallest |w|
        v = w.where(w.abs() > w.abs().view(-1).kthvalue(k).values, 0) if k else w
        q, s, c = gptq_lite_quantize(v, bits) if policy.gptq_lite else (*quantize_per_row(v, bits), 1.0)
        entries[name] = shape, bits, q, s, c
        err += float((dequantize_per_row(q, s, torch.double) - w).square().sum())
        norm += float(w.square().sum())
    return entries, err / norm


def quant_build_payload(entries, model_config, policy_dict, packing, run=None):
    """Serialize quantize_state_dict entries to payload bytes (layout: module docstring).

    packing: "int8" (q as offset bytes, pack_bits(q, 8)) or "bits" (pack_bits(q, bits)); run: the
    header's run metadata (JSON-serializable dict; None stores {}).
    """
    info, ints, rest = [], [], []
    for name, (shape, bits, t, s, clip) in entries.items():
        if bits:
            ints.append(pack_bits(t, bits if packing == "bits" else 8))
            t = s
        info.append([name, shape, bits or str(t.dtype)[6:], clip])
        rest.append(t)
    head = json.dumps(dict(config=model_config, packing=packing, policy=policy_dict, tensors=info, run=run or {})).encode()
    return (b"".join(t.reshape(-1).view(torch.uint8).numpy().tobytes() for t in ints + rest)
            + head + struct.pack("<I", len(head)))


def quant_wrap_container(raw, compressor):
    """Compress payload bytes with `compressor` (zlib/zstd/lzma) and prepend the 14-byte header."""
    data = (zlib.compress(raw, 9) if compressor == "zlib" else zstandard.ZstdCompressor(22).compress(raw)
            if compressor == "zstd" else lzma.compress(raw, lzma.FORMAT_ALONE, preset=9 | lzma.PRESET_EXTREME))
    head = struct.pack("<5sBI", QUANT_PREFIX, QUANT_COMPRESSORS.index(compressor) + 1, len(raw))
    return head + struct.pack("<I", zlib.crc32(data, zlib.crc32(head))) + data


def export_artifact(state_dict, model_config, path, *, code_bytes, byte_budget=16_000_000, policy=None,
                    compressor="auto", log=print, run=None):
    """Quantize, compress and atomically write the artifact; fit model + code bytes into the budget.

    state_dict: name -> tensor (CPU or CUDA, float32/bf16/...); model_config: JSON-serializable
    dict stored in the file (GPT(**model_config) rebuilds the model); code_bytes: counted code
    bytes (int >= 0); byte_budget: int > 0; policy: QuantPolicy, default QuantPolicy.from_env();
    compressor: "auto" (use the policy's, itself auto by default) or zlib/zstd/lzma to force it;
    run: the run metadata stored in the header (module docstring; the trainer always passes it).
    Every packing x compressor candidate is compressed in its own thread (zlib/zstd/lzma release
    the GIL); the smallest wins and later fit steps reuse its encoding. One log line per attempt.
    Returns a report: bytes_model, bytes_code, bytes_total, compressor, packing, fit_steps (list of
    dicts: change, bytes_model, rel_mse), policy (dict of the final policy), rel_mse.
    (tools/bench_quant.py tabulates every packing x compressor.)
    ValueError when it cannot fit (message has the numbers), on bad inputs or non-finite weights;
    nothing is written then.
    """
    policy = policy or QuantPolicy.from_env()
    if compressor != "auto":
        policy = dataclasses.replace(policy, compressor=compressor)
    jobs = [(p, c) for p in ("int8", "bits") for c in QUANT_COMPRESSORS
            if policy.packing in ("auto", p) and policy.compressor in ("auto", c)]
    steps, ladder, change = [], iter(QUANT_FIT_LADDER), ""
    while True:
        entries, rel_mse = quantize_state_dict(state_dict, policy)
        blobs = dict(zip(jobs, ThreadPoolExecutor(6).map(lambda j: quant_wrap_container(
            quant_build_payload(entries, model_config, policy.to_dict(), j[0], run), j[1]), jobs)))
        job, blob = min(blobs.items(), key=lambda kv: len(kv[1]))
        jobs, total = [job], len(blob) + code_bytes
        if change:
            steps.append(dict(change=change, bytes_model=len(blob), rel_mse=rel_mse))
        log(f"quant export {change or 'start'}: {'+'.join(job)} model {len(blob)} + code {code_bytes} = {total} bytes "
            f"(budget {byte_budget}) rel_mse {rel_mse:.3e}")
        if total <= byte_budget:
            break
        # next ladder step that changes the policy: prune_fraction must rise, bits must fall
        step = policy.fit and next(((f, v) for f, v in ladder if (v - getattr(policy, f)) * (f[0] == "p" or -1) > 0), 0)
        if not step:
            raise ValueError(f"model {len(blob)} + code {code_bytes} bytes > BYTE_BUDGET={byte_budget} "
                             f"(QUANT_FIT={policy.fit:d}, {len(steps)} fit steps)")
        policy, change = dataclasses.replace(policy, **dict([step])), "%s=%s" % step
    atomic_write_bytes(path, blob)
    return dict(bytes_model=len(blob), bytes_code=code_bytes, bytes_total=total, packing=job[0], compressor=job[1],
                fit_steps=steps, policy=policy.to_dict(), rel_mse=rel_mse)


def atomic_write_bytes(path, data: bytes) -> None:
    """Write to a temp file `.{name}.tmp{pid}` in the same folder, fsync, then rename: a crash never
    leaves a half-written file at `path`, and a failed write (an OSError, an interrupt) leaves the
    previous file intact and removes its temp file before re-raising. The one atomic writer of the
    kit (artifact, result.json, shards, checkpoints, record files)."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def decode_artifact(data, label="artifact"):
    """Artifact bytes -> (state_dict float32 tensors, model_config dict, meta dict).

    Non-float passthrough tensors keep their dtype. meta: the payload header (config, packing,
    policy dict, tensors: [[name, shape, kind, clip], ...], run: the run metadata, format 3 only)
    plus compressor and format_version (2 or 3).
    ValueError "<label>: ..." for any truncated, corrupted, foreign or other-version data.
    """
    try:
        prefix, cid, n, crc = struct.unpack_from("<5sBII", data)
        if prefix not in (QUANT_PREFIX, b"PGQZ\x02"):  # version 2: no run metadata
            raise ValueError(f"starts {prefix!r}, not {QUANT_PREFIX!r} (magic, format version)")
        if zlib.crc32(data[14:], zlib.crc32(data[:10])) != crc:
            raise ValueError("checksum mismatch (truncated or corrupted)")
        data = data[14:]
        # at most n + 1 bytes are ever inflated (no zip bombs); a short or long stream fails below
        raw = (zstandard.ZstdDecompressor().stream_reader(data).read(n + 1) if cid == 2 else
               (zlib.decompressobj() if cid == 1 else lzma.LZMADecompressor(lzma.FORMAT_ALONE))
               .decompress(data, n + 1))
        if len(raw) != n:
            raise ValueError(f"payload inflates to {len(raw)} bytes, not {n}")
        k = int.from_bytes(raw[-4:], "little")
        head = json.loads(raw[-4 - k:-4])
        tensors = head["tensors"]
        container = 8 * (head["packing"] == "int8")  # bits per stored q value (0: the tensor's own bits)
        sizes = [-(-math.prod(shape) * (container or kind) // 8) for _, shape, kind, _ in tensors if type(kind) is int]
        sizes += [shape[0] * 2 if type(kind) is int else math.prod(shape) * getattr(torch, kind).itemsize
                  for _, shape, kind, _ in tensors]
        # split() raises unless the data is exactly these pieces: bounds every later allocation
        pieces = torch.frombuffer(bytearray(raw), dtype=torch.uint8)[:n - 4 - k].split(sizes)
        q_pieces, state_dict = iter(pieces), {}
        for (name, shape, kind, _), t in zip(tensors, pieces[-len(tensors):]):  # (no tensors: zip is empty)
            t = t.clone().view(getattr(torch, "float16" if type(kind) is int else kind))
            if type(kind) is int:
                t = dequantize_per_row(
                    unpack_bits(next(q_pieces), container or kind, math.prod(shape)).view(shape[0], -1), t)
            state_dict[name] = (t.float() if t.is_floating_point() else t).view(shape)
        return state_dict, head["config"], dict(head, compressor=QUANT_COMPRESSORS[cid - 1], format_version=prefix[4])
    except Exception as err:  # a damaged file must never surface as anything but a ValueError
        raise ValueError(f"{label}: {err}") from None


def load_artifact(path):
    """Read an artifact file -> (state_dict float32 tensors, model_config dict, meta dict).

    ValueError naming the file for any truncated, corrupted, foreign or other-version file.
    """
    with open(path, "rb") as f:
        return decode_artifact(f.read(), path)
