"""The counted model artifact (.ptz): export a trained state dict into the byte budget, load it back.

export_artifact: quantize by policy (full GPTQ where a calibration Hessian exists, else GPTQ-lite
per matrix) -> payload per packing x byte-shuffle -> every compressor (in threads) -> keep the
smallest (QUANT_PACKING / QUANT_SHUFFLE / QUANT_COMPRESSOR = auto) -> if model bytes + code bytes
exceed the budget, step tensors down by measured error per byte (quant/fit.py), logging every step
and round -> write the file atomically. load_artifact reverses it; nothing is unpickled.

File layout (little-endian):
    offset 0   4 bytes  magic b"PGQZ"
    offset 4   1 byte   format version, 3 (QUANT_PREFIX holds both). Version 2 (same layout, no
                        "run" entry in the header: no training sequence length, tokenizer sha256
                        or eval stride) still loads; version 1 was a safetensors payload, whose
                        metadata key order changed from process to process, and is refused
    offset 5   1 byte   compressor id: 1 zlib (level 9), 2 zstd (level 22), 3 lzma (.lzma "alone" format,
                        preset 9|extreme), 4 brotli (quality 11, window 2**24; ~500 KB smaller than
                        LZMA-9 with byte-shuffle on a record's checkpoint, PR #1218), 5 grouped
                        (quant/grouped.py: streams by role, sorted rows, a coder each; QUANT_GROUPED=1)
    offset 6   4 bytes  uint32 length L of the decompressed payload
    offset 10  4 bytes  uint32 CRC-32 of bytes 0..9 followed by the compressed payload
    offset 14  ...      compressed payload
Payload (L bytes, decompressed):
    data: the q values of every quantized tensor in header order, as pack_bits streams: packing
          "int8" stores one offset byte per value (pack_bits(q, 8): q + 128, the int8 bytes with the
          top bit flipped, which compresses exactly like int8), packing "bits" ceil(R*C*N/8) bytes
          (pack_bits(q, N)); then, in header order, the float16 scale [R] of each quantized tensor
          or the stored passthrough tensor (raw bytes of its dtype; with "shuffle" true, its
          bytes grouped by significance: all first bytes of its values, then all second bytes,
          ...). Integer data first: a few kB of float16 noise in front of it cost zstd ~4% of the
          whole artifact in measurements.
    header: UTF-8 JSON {"config": model_config, "packing": "int8"|"bits", "shuffle": bool,
          "policy": policy dict, "tensors": [[name, shape, kind, clip quantile], ...], "run": run}
          in state-dict order; kind is the
          int bit width N of a quantized tensor or the dtype name ("float16", "int64", ...) of a
          passthrough one. No dict with hash-ordered keys: the bytes depend only on the inputs
          (same state dict -> same file, in any process; tests/test_quant_artifact.py runs two).
          run (format 3): what scoring the file needs besides the data and the tokenizer, as the
          trainer writes it: {"train_seq_len": int (the eval window), "vocab_size": int,
          "tokenizer_sha256": hex str, "eval_stride": int (the stride the run's plan started its sliding
          or TTT eval with), "ttt": the TTT settings it scored with (trainer/finish.py
          ttt_artifact_settings; absent in older files; "mode": "phased" and "phases" only for phased TTT,
          no "mode" = chunked)}; {} when the writer had none (tests, benches).
          `python -m eval score` reads it. Readers ignore keys they do not know (additions need no new version).
    4 bytes: uint32 length of the header.
Decoding checks magic + version, the CRC and the compressor id before anything else, inflates with
the output capped at the declared length (no zip bombs; brotli's cap is its output buffer limit),
then requires the data to split exactly into the pieces the
header describes (so no allocation exceeds the file's own size class). Every failure, including
any exception of the parsing code on a crafted payload with a valid CRC, is a ValueError naming
the file: a damaged file never crashes or hangs the loader; nothing is unpickled.

Bit packing: value i of the flattened q is stored as u = q + 2**(N-1) in bits [N*i, N*i + N) of a
little-endian bit stream, LSB first, zero-padded to whole bytes; for int6 "4 values in 3 bytes".
Groups of 8 values (8*N bits = N bytes) are built in one int64 word (little-endian machines; every
supported platform is).

Size note: bundled into the counted train_gpt.py; CLI / bench helpers live in quant/offline.py.
"""

import json
import math
import os
import struct
import zlib
from concurrent.futures import ThreadPoolExecutor

import torch

from primitives.baseline_quant import quantize_per_row_baseline, quantize_per_tensor_baseline
from primitives.rowquant import QUANT_CLIP_QUANTILES, dequantize_per_row, gptq_lite_quantize, quantize_per_row
from quant.estimate import estimate_artifact_bytes
from quant.fit import quant_fit_step
from quant.gptq import gptq_quantize
from quant.policy import QUANT_COMPRESSORS, QuantPolicy, quant_compress, quant_inflate
from quant.grouped import grouped_compress, grouped_inflate
from quant.lqer import lqer_add_corrections, lqer_factors, lqer_pack, lqer_piece_bytes
from quant.sdclip import sdclip_k_for, sdclip_matrix
from primitives.env import BUNDLE_KIND
from primitives.files import atomic_write_bytes
from primitives.progress import Progress

QUANT_PREFIX = b"PGQZ\x03"  # magic + format version 3 (b"PGQZ\x02", version 2, still loads)


def pack_bits(q: torch.Tensor, bits: int, /) -> bytes:
    """Pack integers q (any shape, values in [-2**(bits-1), 2**(bits-1)-1], bits 1..8) densely.

    Returns uint8 [ceil(q.numel() * bits / 8)] (CPU). Values out of range corrupt their
    neighbours: callers pass quantizer output.
    """
    u = q.reshape(-1).long() + (1 << bits - 1)
    n = u.numel()
    u = torch.cat([u, u.new_zeros(-n % 8)]).view(-1, 8) << torch.arange(0, 8 * bits, bits)
    # sum of disjoint bit fields = bitwise or; keep the low `bits` bytes of each little-endian word
    return u.sum(1).view(torch.uint8).view(-1, 8)[:, :bits].reshape(-1)[:(n * bits + 7) // 8]


def unpack_bits(packed: bytes, bits: int, n: int, /) -> torch.Tensor:
    """Inverse of pack_bits: uint8 [ceil(n * bits / 8)] -> int64 [n]."""
    offset, g = 1 << bits - 1, -(-n // 8)  # (bits < 1 fails here, before any allocation)
    w = torch.cat([packed, packed.new_zeros(g * bits - packed.numel())]).view(g, bits)
    w = torch.cat([w, w.new_zeros(g, 8 - bits)], 1).view(torch.int64)  # [G, 1]
    return ((w >> torch.arange(0, 8 * bits, bits)) & (1 << bits) - 1).view(-1)[:n] - offset


def quantize_matrix(cache: dict, name: str, t: torch.Tensor, bits: int, policy: QuantPolicy,
                    hessians: dict | None = None, /) -> tuple:
    """cache[name, bits], computed on first use: tensor t (>= 2 dims, as [shape[0], -1]) at `bits`.

    Full GPTQ (quant/gptq.py) when policy.gptq and hessians has `name` (a [C, C] H; for the embedding
    group also policy.gptq_embed, its H being the head input's), GPTQ-lite
    clip search when policy.gptq_lite, else max-abs round-to-nearest (the QAT forward's rule);
    magnitude pruning first (policy.prune_fraction). Value: (q int8 [R, C], scale float16 [R],
    clip, rel_err, sq_err, sq_norm): rel_err = tr(dW H dW^T) / tr(W H W^T) (H = I without a
    Hessian: the fit's error measure), sq_err / sq_norm the plain squared error and norm (float64).
    """
    if (name, bits) not in cache:
        w = t.detach().cpu().double().reshape(t.shape[0], -1)
        k = int(policy.prune_fraction * w.numel())  # magnitude pruning: zero the k smallest |w|
        v = w.where(w.abs() > w.abs().view(-1).kthvalue(k).values, 0) if k else w
        shape = tuple(t.shape)
        embed = policy.group_of(name, shape) == "embed"
        h = (hessians or {}).get(name) if policy.gptq and (policy.gptq_embed or not embed) else None
        if policy.int8_gate(name, shape):  # QUANT_GATE_INT8: max |row| / 127, no GPTQ (PR #1855)
            q, s, c = (*quantize_per_row(v, 8), 1.0)
        elif policy.baseline_clip:  # QUANT_BASELINE_CLIP: PR #1617's rows, no GPTQ
            q, s, c = (*quantize_per_row_baseline(v, bits, policy.baseline_clip), policy.baseline_clip)
        elif policy.sdclip and (k_sd := sdclip_k_for(policy, name, shape)):  # SDClip: k * std(row) scales (GPTQ keeps them fixed)
            q, s, c = sdclip_matrix(v, h, bits, k_sd, policy.gptq_records)
        else:
            q, s, c = (gptq_quantize(v, h, bits, QUANT_CLIP_QUANTILES if policy.gptq_lite else (1.0,), None, policy.gptq_records)
                       if h is not None
                       else gptq_lite_quantize(v, bits) if policy.gptq_lite else (*quantize_per_row(v, bits), 1.0))
        d = dequantize_per_row(q, s, torch.double) - w
        sq_err, sq_norm = float(d.square().sum()), float(w.square().sum())
        if h is None:  # H = I: the plain ratio (no [C, C] identity matmul)
            rel_err = sq_err / sq_norm if sq_norm else 0.0
        else:
            h = h.cpu().double()
            rel_err = float(((d @ h) * d).sum() / ((w @ h) * w).sum())
        cache[name, bits] = q, s, c, rel_err, sq_err, sq_norm
    return cache[name, bits]


def quantize_state_dict(state_dict: dict, policy: QuantPolicy, hessians: dict | None = None,
                        cache: dict | None = None, /) -> list:
    """Quantize each tensor as the policy says -> (entries for quant_build_payload, rel_mse).

    state_dict: name -> tensor (float tensors any dtype/device, all finite); hessians: see
    quantize_matrix; cache: a dict that keeps each (name, bits) result across calls (the fit
    re-reads them). entries: name -> (shape, bits, q int8 [R, C], scale float16 [R], clip) for a
    quantized tensor, or (shape, None, stored tensor, None, None) for a passthrough one (floats in
    policy.float_dtype, other dtypes as they are). rel_mse: squared reconstruction error / squared
    norm of the quantized matrices (float64 sums; the float16 passthrough error is negligible).
    ValueError for a non-finite float tensor.
    """
    entries, err, norm, cache = {}, 0.0, 1e-30, {} if cache is None else cache
    if BUNDLE_KIND == "package":  # the kit's progress line (GPTQ solves here, one matrix per tensor)
        bar = Progress("quant export", len(state_dict), "tensors")
    for name, t in state_dict.items():
        t = t.detach()
        shape, fp = tuple(t.shape), t.is_floating_point()
        if fp and not t.isfinite().all():
            raise ValueError(f"state_dict[{name!r}] is not finite")
        bits = fp and t.numel() and policy.bits_for(name, shape)
        if bits and len(shape) < 2 and policy.baseline_clip:  # PR #1617's vectors: per-tensor rounding, float32 values
            entries[name] = shape, None, quantize_per_tensor_baseline(t.cpu(), bits, policy.baseline_clip), None, None
        elif not bits:
            entries[name] = shape, None, t.cpu().to(getattr(torch, policy.float_dtype)) if fp else t.cpu(), None, None
        else:
            q, s, c, _, e, n = quantize_matrix(cache, name, t, bits, policy, hessians)
            entries[name] = shape, bits, q, s, c
            err, norm = err + e, norm + n
        if BUNDLE_KIND == "package":
            bar.update()
    if BUNDLE_KIND == "package":
        bar.close()
    return entries, err / norm


def quant_build_payload(entries: list, model_config: dict, policy_dict: dict, packing: str, shuffle: bool = False,
                        run: dict | None = None, lqer: dict | None = None, /) -> bytes:
    """Serialize quantize_state_dict entries to payload bytes (layout: module docstring).

    packing: "int8" (q as offset bytes, pack_bits(q, 8)) or "bits" (pack_bits(q, bits)); shuffle:
    store the bytes of each multi-byte float/int tensor grouped by significance (byte-shuffle);
    run: the header's run metadata (JSON-serializable dict; None stores {}); lqer: LQER factors
    (quant/lqer.py lqer_factors), stored after the other pieces and listed in the header's "lqer".
    """
    info, ints, rest = [], [], []
    for name, (shape, bits, t, s, clip) in entries.items():
        if bits:
            ints.append(pack_bits(t, bits if packing == "bits" else 8))
            t = s
        info.append([name, shape, bits or str(t.dtype)[6:], clip])
        k = t.element_size()
        t = t.reshape(-1).view(torch.uint8)
        rest.append(t.view(-1, k).T if shuffle else t)
    head = dict(config=model_config, packing=packing, shuffle=shuffle, policy=policy_dict, tensors=info, run=run or {})
    if lqer:  # (absent without LQER: the bytes of other artifacts do not change)
        head["lqer"] = [[name, r] for name, (r, _) in lqer.items()]
    head = json.dumps(head).encode()
    return (b"".join(t.reshape(-1).numpy().tobytes() for t in ints + rest) + (lqer_pack(lqer) if lqer else b"") + head
            + struct.pack("<I", len(head)))


def quant_wrap_container(raw: bytes, compressor: str, /) -> bytes:
    """Compress payload bytes with `compressor` (zlib/zstd/lzma/brotli: quant/policy.py quant_compress, or "grouped":
    quant/grouped.py) and prepend the 14-byte header."""
    cid = (*QUANT_COMPRESSORS, "grouped").index(compressor) + 1
    head = struct.pack("<5sBI", QUANT_PREFIX, cid, len(raw))
    data = grouped_compress(raw) if cid == 5 else quant_compress(raw, cid)
    return head + struct.pack("<I", zlib.crc32(data, zlib.crc32(head))) + data


def export_artifact(state_dict, model_config, path, /, *, code_bytes, byte_budget=16_000_000, policy=None,
                    hessians=None, log=print, run=None):
    """Quantize, compress and atomically write the artifact; fit model + code bytes into the budget.

    state_dict: name -> tensor (CPU or CUDA, float32/bf16/...); model_config: JSON-serializable
    dict stored in the file (GPT(**model_config) rebuilds the model); code_bytes: counted code
    bytes (int >= 0); byte_budget: int > 0; policy: QuantPolicy, default QuantPolicy.from_env() (its packing,
    shuffle and compressor name the candidates);
    hessians: {param name: H [C, C]} from quant.gptq.collect_gptq_hessians (full GPTQ for those
    matrices when policy.gptq; the fit's error measure); run: the run metadata stored in the
    header (module docstring; the trainer always passes it).
    Every packing x shuffle x compressor candidate is compressed in its own thread (the
    compressors release the GIL); the smallest wins and later fit rounds reuse its encoding. While
    over budget, the fit (quant/fit.py) steps tensors down one bit at a time by measured error per
    byte and compresses again, then steps back up what the slack holds; one log line per round (and per step
    in the package).
    Returns a report: bytes_model, bytes_total, packing, shuffle, compressor, fit_steps
    (list of "name=intN" strings, in order), policy (dict of the final policy), rel_mse.
    (tools/bench_quant.py tabulates every candidate.)
    ValueError when it cannot fit (message has the numbers), on bad inputs or non-finite weights;
    nothing is written then.
    """
    policy = policy or QuantPolicy.from_env()
    pairs = [(p, b) for p in ("int8", "bits") if policy.packing in ("auto", p)
             for b in (False, True) if policy.shuffle in ("auto", "on" if b else "off")]
    jobs = [(*j, c) for j in pairs for c in QUANT_COMPRESSORS if policy.compressor in ("auto", c)]
    jobs += [(*j, "grouped") for j in pairs if policy.grouped]
    shapes = {k: tuple(v.shape) for k, v in state_dict.items() if v.is_floating_point() and v.numel()}
    cache, steps = {}, []

    def err(n: str, b: int, p: QuantPolicy) -> float:  # measured relative error of tensor n at b bits under p
        return quantize_matrix(cache, n, state_dict[n], b, p, hessians)[3]

    def compress(policy: QuantPolicy, /) -> tuple:  # (blob, its job, rel_mse): the smallest of the candidate encodings
        entries, rel_mse = quantize_state_dict(state_dict, policy, hessians, cache)
        lqer = lqer_factors(entries, state_dict, policy.lqer_rank, policy.lqer_top_n, policy.lqer_asym) if policy.lqer else None
        head = policy.to_dict()
        with ThreadPoolExecutor(len(jobs)) as pool:
            blobs = pool.map(lambda j: quant_wrap_container(
                quant_build_payload(entries, model_config, head, *j[:2], run, lqer), j[2]), jobs)
            if BUNDLE_KIND == "package":  # the kit's progress line: one update per finished candidate
                bar = Progress("quant export: compressing", len(jobs), "candidates")
                blobs = [bar.update() or b for b in blobs]
                bar.close()
            blob, job = min(zip(blobs, jobs), key=lambda bj: len(bj[0]))
        log(f"quant export: {job[0]}{'+shuffle' * job[1]}+{job[2]} model {len(blob)} + code {code_bytes} = "
            f"{len(blob) + code_bytes} bytes (budget {byte_budget}) rel_mse {rel_mse:.3e}")
        return blob, job, rel_mse

    def walk(p: QuantPolicy, over: float, start: QuantPolicy | None = None, /) -> tuple:
        """One round of fit steps from p: down (start None) until the estimated saving, scaled to real bytes,
        covers `over` real bytes; up (start: the policy before the fit; over < 0, the slack) while the bytes added
        fit 99% of the slack (a 1% margin: the estimate's error). -> (policy, ["name=intN", ...])."""
        ratio, taken = len(blob) / estimate_artifact_bytes(shapes, p), []
        while (start or over > 0) and (step := quant_fit_step(p, shapes, lambda n, b, p=p: err(n, b, p) - err(n, b + 1, p),
                                                              start, -0.99 * over / ratio)):
            name, bits, size = step
            over, p = over + (ratio * size if start else -ratio * size), p.with_bits(name, bits)
            taken.append(f"{name}=int{bits}")
            if BUNDLE_KIND == "package":  # each step (result.json's fit_steps lists them)
                log(f"quant_fit export step{' up' * bool(start)}:{len(taken) + (0 if start else len(steps))} {name} -> "
                    f"int{bits} rel_err {err(name, bits, p):.3e}")
        return p, taken

    start, steps = policy, []
    while True:
        blob, job, rel_mse = compress(policy)
        jobs, total = [job], len(blob) + code_bytes  # later rounds reuse the winning encoding
        if total <= byte_budget:
            break
        policy, taken = walk(policy, total - byte_budget)  # over budget: a fitting round, then compress again
        if not taken:  # nothing left to step: these are the smallest policy's real bytes
            raise ValueError(f"model {len(blob)} + code {code_bytes} bytes > BYTE_BUDGET={byte_budget} "
                             f"(QUANT_FIT={policy.fit:d}, {len(steps)} fit steps)")
        steps += taken
    if steps:  # one-bit steps overshoot: give back what the slack holds (one round), confirmed by one more compression
        trial, ups = walk(policy, total - byte_budget, start)
        if ups:
            up = compress(trial)
            if len(up[0]) + code_bytes <= byte_budget:
                (blob, job, rel_mse), policy, steps, total = up, trial, steps + ups, len(up[0]) + code_bytes
            else:
                log("quant_fit export: the steps up are over the budget: the previous round is kept")
    atomic_write_bytes(path, blob)
    measured_scale = len(blob) / estimate_artifact_bytes(shapes, policy)  # what QUANT_ESTIMATE_SCALE should be
    if BUNDLE_KIND == "package":  # advice for the next run's projection (result.json records the number)
        log(f"quant_estimate: measured / estimated model bytes {measured_scale:.3f} for the stored policy "
            f"(the QUANT_ESTIMATE_SCALE that projects this run's artifact)")
    return dict(bytes_model=len(blob), bytes_total=total, packing=job[0], shuffle=job[1],
                compressor=job[2], fit_steps=steps, policy=policy.to_dict(), rel_mse=rel_mse,
                quant_estimate_scale_measured=round(measured_scale, 4))


def decode_artifact(data: bytes, label: str = "artifact", /) -> tuple:
    """Artifact bytes -> (state_dict float32 tensors, model_config dict, meta dict).

    Non-float passthrough tensors keep their dtype. meta: the payload header (config, packing,
    policy dict, tensors: [[name, shape, kind, clip], ...], run: the run metadata, format 3 only)
    plus compressor and format_version (2 or 3); in a record's packed file the payload header alone.
    ValueError "<label>: ..." for any truncated, corrupted, foreign or other-version data.
    """
    try:
        prefix, cid, n, crc = struct.unpack_from("<5sBII", data)
        if BUNDLE_KIND == "package":  # the container's checks but the CRC: a record's file reads what it just wrote
            if prefix not in (QUANT_PREFIX, b"PGQZ\x02"):  # a foreign file (version 2: no run metadata)
                raise ValueError(f"starts {prefix!r}, not {QUANT_PREFIX!r} (magic, format version)")
        if zlib.crc32(data[14:], zlib.crc32(data[:10])) != crc:  # in every file: no score from damaged weights
            raise ValueError("checksum mismatch")
        if BUNDLE_KIND == "package":
            if not 0 < cid <= len(QUANT_COMPRESSORS) + 1:  # + grouped (GROUPED_ID)
                raise ValueError(f"unknown compressor id {cid}")
        data = data[14:]
        # at most about n + 1 bytes are ever inflated (no zip bombs); a short or long stream fails below
        raw, layout = grouped_inflate(data, n) if cid == 5 else (quant_inflate(data, cid, n), None)  # 5: grouped
        if BUNDLE_KIND == "package":
            if len(raw) != n:
                raise ValueError(f"payload inflates to {len(raw)} bytes, not {n}")
        k = int.from_bytes(raw[-4:], "little")
        head = json.loads(raw[-4 - k:-4])
        tensors, shuffle = head["tensors"], head.get("shuffle") is True
        container = {"int8": 8, "bits": 0}[head["packing"]]  # bits per stored q value (0: the tensor's own bits)
        sizes = [-(-math.prod(shape) * (container or kind) // 8) for _, shape, kind, _ in tensors if type(kind) is int]
        sizes += [shape[0] * 2 if type(kind) is int else math.prod(shape) * getattr(torch, kind).itemsize
                  for _, shape, kind, _ in tensors]
        lqer = [lqer_piece_bytes(head)] if "lqer" in head else []  # LQER: one more piece
        # split() raises unless the data is exactly these pieces: bounds every later allocation
        pieces = torch.frombuffer(bytearray(raw), dtype=torch.uint8)[:n - 4 - k].split(sizes + lqer)
        q_pieces, state_dict = iter(pieces), {}
        for (name, shape, kind, _), t in zip(tensors, pieces[len(sizes) - len(tensors):]):  # (no tensors: zip is empty)
            dtype = getattr(torch, "float16" if type(kind) is int else kind)
            t = (t.view(dtype.itemsize, -1).T if shuffle else t).flatten().clone().view(dtype)
            if type(kind) is int:
                t = dequantize_per_row(
                    unpack_bits(next(q_pieces), container or kind, math.prod(shape)).view(shape[0], -1), t)
            state_dict[name] = (t.float() if t.is_floating_point() else t).view(shape)
        if lqer:
            lqer_add_corrections(state_dict, pieces[-1], head)
        if BUNDLE_KIND == "package":  # what the kit's readers show (a record's file reads the weights only)
            head = dict(head, compressor=(*QUANT_COMPRESSORS, "grouped")[cid - 1], format_version=prefix[4],
                        **{"groups": layout} if layout else {})
        return state_dict, head["config"], head
    except Exception as err:  # a damaged file must never surface as anything but a ValueError
        raise ValueError(f"{label}: {err}") from None


def load_artifact(path: str | os.PathLike, /) -> tuple:
    """Read an artifact file -> (state_dict float32 tensors, model_config dict, meta dict).

    ValueError naming the file for any truncated, corrupted, foreign or other-version file.
    """
    with open(path, "rb") as f:
        return decode_artifact(f.read(), path)
