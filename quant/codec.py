"""Artifact bytes: an 18-byte container header around a compressed safetensors payload.

File layout (all little-endian):
    offset 0  4 bytes  magic b"PGQZ"
    offset 4  1 byte   format version (QUANT_FORMAT_VERSION)
    offset 5  1 byte   compressor id: 1 zlib (level 9), 2 zstd (level 22), 3 lzma (raw LZMA2, preset 9|extreme)
    offset 6  4 bytes  uint32 length L of the decompressed payload
    offset 10 4 bytes  uint32 rotation K <= L: the compressed stream holds payload[K:] + payload[:K]
    offset 14 4 bytes  uint32 CRC-32 of bytes 0..13 followed by the compressed payload
    offset 18 ...      compressed payload
Why the rotation: safetensors puts float16 data (scales, passthrough tensors) before the int8
data; K is where the 1-byte integer data starts, so the entropy coder sees the bulk first. A few
kB of float16 noise in front cost zstd ~4% of the whole artifact in measurements.
Decoding checks, in order: length, magic, version, compressor id, CRC (before any parsing), payload
length bound, decompression with its output capped at the declared length, then the safetensors
header (own JSON parse, offsets and sizes validated) and the tensors against the quant metadata.
Every failure is a ValueError naming the problem; nothing is unpickled.

Payload: safetensors (https://github.com/huggingface/safetensors) with metadata keys
"format" ("parameter-golf-quant"), "model_config" (JSON) and "quant" (JSON: packing, policy and per
tensor [shape, kind, clip quantile]); kind is an int bit width (tensors NAME.q and NAME.scale), a
float dtype name (tensor NAME) or "raw:<dtype>" for non-float tensors kept as they are.
"""

import json
import lzma
import struct
import zlib

import safetensors.torch
import torch
import zstandard

from quant.core import dequantize_per_row, quant_qmax
from quant.packing import QUANT_PACKINGS, pack_bits, quant_packed_num_bytes, unpack_bits
from quant.policy import QUANT_COMPRESSORS

QUANT_ARTIFACT_MAGIC = b"PGQZ"
QUANT_FORMAT_VERSION = 1
QUANT_HEADER = struct.Struct("<4sBBIII")
QUANT_MAX_PAYLOAD_BYTES = 1 << 31  # refuse to inflate more than 2 GiB, whatever the header says
QUANT_PAYLOAD_FORMAT = "parameter-golf-quant"
_QUANT_LZMA_FILTERS = [{"id": lzma.FILTER_LZMA2, "preset": 9 | lzma.PRESET_EXTREME}]
_QUANT_ST_DTYPES = {
    "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16, "F64": torch.float64,
    "I8": torch.int8, "U8": torch.uint8, "I16": torch.int16, "I32": torch.int32, "I64": torch.int64, "BOOL": torch.bool,
}


def quant_compress(raw: bytes, compressor: str) -> bytes:
    """Compress `raw` with zlib (level 9), zstd (level 22) or lzma (raw LZMA2, preset 9|extreme)."""
    if compressor == "zlib":
        return zlib.compress(raw, 9)
    if compressor == "zstd":
        return zstandard.ZstdCompressor(level=22, write_checksum=False, write_content_size=True).compress(raw)
    if compressor == "lzma":
        return lzma.compress(raw, format=lzma.FORMAT_RAW, filters=_QUANT_LZMA_FILTERS)
    raise ValueError(f"compressor={compressor!r}: expected one of {QUANT_COMPRESSORS}")


def quant_decompress(data: bytes, compressor: str, raw_len: int) -> bytes:
    """Inverse of quant_compress, producing exactly raw_len bytes; never inflates beyond raw_len + 1.

    ValueError on corrupt data, a stream that ends early, or one that would exceed raw_len.
    """
    try:
        if compressor == "zlib":
            d = zlib.decompressobj()
            out, done = d.decompress(data, raw_len + 1), d.eof
        elif compressor == "lzma":
            d = lzma.LZMADecompressor(format=lzma.FORMAT_RAW, filters=_QUANT_LZMA_FILTERS)
            out, done = d.decompress(data, max_length=raw_len + 1), d.eof
        elif compressor == "zstd":
            if zstandard.frame_content_size(data) != raw_len:
                raise ValueError("zstd frame content size differs from the header's payload length")
            out, done = zstandard.ZstdDecompressor().decompress(data, max_output_size=raw_len), True
        else:
            raise ValueError(f"unknown compressor {compressor!r}")
    except (zlib.error, lzma.LZMAError, zstandard.ZstdError, EOFError, MemoryError) as err:
        raise ValueError(f"corrupt {compressor} payload: {err}") from None
    if len(out) != raw_len or not done:
        raise ValueError(f"{compressor} payload inflates to {len(out)}{'' if done else '+'} bytes, header says {raw_len}")
    return out


def quant_int_data_offset(payload_raw: bytes) -> int:
    """Offset in our own safetensors bytes where the 1-byte integer tensor data starts (0 if none)."""
    (n,) = struct.unpack_from("<Q", payload_raw)
    header = json.loads(payload_raw[8:8 + n])
    begins = [v["data_offsets"][0] for k, v in header.items() if k != "__metadata__" and v["dtype"] in ("I8", "U8")]
    return 8 + n + min(begins) if begins else 0


def quant_wrap_container(payload_raw: bytes, compressor: str, rotation=None) -> bytes:
    """Rotate (default: at quant_int_data_offset), compress, prepend the header -> artifact file bytes."""
    if len(payload_raw) > QUANT_MAX_PAYLOAD_BYTES:
        raise ValueError(f"payload of {len(payload_raw)} bytes exceeds {QUANT_MAX_PAYLOAD_BYTES}")
    k = quant_int_data_offset(payload_raw) if rotation is None else rotation
    comp = quant_compress(payload_raw[k:] + payload_raw[:k], compressor)
    prefix = QUANT_HEADER.pack(QUANT_ARTIFACT_MAGIC, QUANT_FORMAT_VERSION, QUANT_COMPRESSORS.index(compressor) + 1,
                               len(payload_raw), k, 0)[:14]
    return prefix + struct.pack("<I", zlib.crc32(comp, zlib.crc32(prefix))) + comp


def quant_unwrap_container(data: bytes) -> tuple[bytes, str]:
    """Check and decompress artifact bytes -> (raw payload, compressor name). ValueError if damaged."""
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise ValueError(f"artifact data: expected bytes, got {type(data).__name__}")
    data = bytes(data)
    if len(data) < QUANT_HEADER.size:
        raise ValueError(f"artifact truncated: {len(data)} bytes, the header alone is {QUANT_HEADER.size}")
    magic, version, comp_id, raw_len, rotation, crc = QUANT_HEADER.unpack_from(data)
    if magic != QUANT_ARTIFACT_MAGIC:
        raise ValueError(f"not a parameter-golf quant artifact: magic {magic!r}, expected {QUANT_ARTIFACT_MAGIC!r}")
    if version != QUANT_FORMAT_VERSION:
        newer = "newer than this code supports" if version > QUANT_FORMAT_VERSION else "unknown"
        raise ValueError(f"artifact format version {version} is {newer} (this code reads version {QUANT_FORMAT_VERSION})")
    if not 1 <= comp_id <= len(QUANT_COMPRESSORS):
        raise ValueError(f"artifact compressor id {comp_id} unknown (expected 1..{len(QUANT_COMPRESSORS)})")
    if zlib.crc32(data[QUANT_HEADER.size:], zlib.crc32(data[:14])) != crc:
        raise ValueError(f"artifact checksum mismatch (file of {len(data)} bytes is truncated or corrupted)")
    if raw_len > QUANT_MAX_PAYLOAD_BYTES:
        raise ValueError(f"artifact declares a {raw_len}-byte payload, more than the {QUANT_MAX_PAYLOAD_BYTES} allowed")
    if rotation > raw_len:
        raise ValueError(f"artifact rotation {rotation} exceeds its payload length {raw_len}")
    compressor = QUANT_COMPRESSORS[comp_id - 1]
    body = quant_decompress(data[QUANT_HEADER.size:], compressor, raw_len)
    return body[raw_len - rotation:] + body[:raw_len - rotation], compressor


def quant_build_payload(entries: dict, model_config: dict, policy_dict: dict, packing: str) -> bytes:
    """Serialize quantized entries to safetensors bytes.

    entries: name -> {"shape": tuple, "bits": int, "q": int8 [R, C], "scale": float16 [R], "clip": float}
    or name -> {"shape": tuple, "tensor": tensor} (float passthrough in its stored dtype, or non-float).
    packing: "int8" (q stored as int8 [R, C]) or "bits" (q stored as uint8 [ceil(R*C*bits/8)]).
    """
    if packing not in QUANT_PACKINGS:
        raise ValueError(f"packing={packing!r}: expected one of {QUANT_PACKINGS}")
    tensors, info = {}, {}
    for name, e in entries.items():
        if "bits" in e:
            tensors[name + ".q"] = pack_bits(e["q"], e["bits"]) if packing == "bits" else e["q"].contiguous()
            tensors[name + ".scale"] = e["scale"].contiguous()
            info[name] = [list(e["shape"]), e["bits"], e["clip"]]
        else:
            t = e["tensor"].contiguous()
            kind = str(t.dtype).removeprefix("torch.")
            info[name] = [list(e["shape"]), kind if t.is_floating_point() else "raw:" + kind, None]
            tensors[name] = t
    quant = {"packing": packing, "policy": policy_dict, "tensors": info}
    metadata = {"format": QUANT_PAYLOAD_FORMAT, "model_config": json.dumps(model_config), "quant": json.dumps(quant)}
    return safetensors.torch.save(tensors, metadata=metadata)


def _quant_parse_safetensors_header(raw: bytes) -> tuple[dict, dict]:
    """Validate the safetensors header ourselves (so malformed input never reaches native code)."""
    if len(raw) < 8:
        raise ValueError(f"payload of {len(raw)} bytes is too short for a safetensors header")
    (n,) = struct.unpack_from("<Q", raw)
    if n > len(raw) - 8:
        raise ValueError(f"safetensors header length {n} exceeds the payload ({len(raw)} bytes)")
    try:
        header = json.loads(raw[8:8 + n])
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as err:
        raise ValueError(f"safetensors header is not valid JSON: {err}") from None
    if not isinstance(header, dict) or not isinstance(header.get("__metadata__"), dict):
        raise ValueError("safetensors header lacks __metadata__")
    meta = header.pop("__metadata__")
    data_len = len(raw) - 8 - n
    for name, spec in header.items():
        ok = isinstance(spec, dict) and spec.get("dtype") in _QUANT_ST_DTYPES and isinstance(spec.get("shape"), list)
        ok = ok and all(isinstance(d, int) and d >= 0 for d in spec["shape"]) and isinstance(spec.get("data_offsets"), list)
        ok = ok and len(spec["data_offsets"]) == 2 and all(isinstance(o, int) for o in spec["data_offsets"])
        if ok:
            begin, end = spec["data_offsets"]
            numel = 1
            for d in spec["shape"]:
                numel *= d
            ok = 0 <= begin <= end <= data_len and end - begin == numel * _QUANT_ST_DTYPES[spec["dtype"]].itemsize
        if not ok:
            raise ValueError(f"safetensors entry {name!r} is malformed: {spec!r}")
    return header, meta


def _quant_json_field(meta: dict, key: str, kind: type):
    try:
        value = json.loads(meta[key])
    except (KeyError, TypeError, json.JSONDecodeError, RecursionError):
        raise ValueError(f"payload metadata {key!r} is missing or not JSON") from None
    if not isinstance(value, kind):
        raise ValueError(f"payload metadata {key!r} is not a {kind.__name__}")
    return value


def quant_parse_payload(raw: bytes) -> tuple[dict, dict, dict]:
    """Parse and validate payload bytes -> (stored tensors by safetensors name, model_config, quant meta).

    ValueError if the header, metadata or any tensor disagrees with the quant metadata.
    """
    header, meta = _quant_parse_safetensors_header(raw)
    if meta.get("format") != QUANT_PAYLOAD_FORMAT:
        raise ValueError(f"payload format {meta.get('format')!r}, expected {QUANT_PAYLOAD_FORMAT!r}")
    model_config = _quant_json_field(meta, "model_config", dict)
    quant = _quant_json_field(meta, "quant", dict)
    info, packing = quant.get("tensors"), quant.get("packing")
    if not isinstance(info, dict) or packing not in QUANT_PACKINGS or not isinstance(quant.get("policy"), dict):
        raise ValueError("payload quant metadata lacks tensors / packing / policy")
    expected = {}
    for name, item in info.items():
        ok = isinstance(item, list) and len(item) == 3 and isinstance(item[0], list)
        ok = ok and all(isinstance(d, int) and d >= 0 for d in item[0]) and len(item[0]) <= 8
        if not ok:
            raise ValueError(f"quant metadata for {name!r} is malformed: {item!r}")
        shape, kind = item[0], item[1]
        numel = 1
        for d in shape:
            numel *= d
        if isinstance(kind, int) and not isinstance(kind, bool) and len(shape) >= 2:
            quant_qmax(kind)
            rows = shape[0]
            q_spec = ("U8", [quant_packed_num_bytes(numel, kind)]) if packing == "bits" else ("I8", [rows, numel // max(rows, 1)])
            expected[name + ".q"], expected[name + ".scale"] = q_spec, ("F16", [rows])
        elif isinstance(kind, str) and kind.removeprefix("raw:") in {str(t).removeprefix("torch.") for t in _QUANT_ST_DTYPES.values()}:
            st_name = {str(t).removeprefix("torch."): k for k, t in _QUANT_ST_DTYPES.items()}[kind.removeprefix("raw:")]
            expected[name] = (st_name, shape)
        else:
            raise ValueError(f"quant metadata for {name!r} has unknown kind {kind!r}")
    got = {name: (spec["dtype"], tuple(spec["shape"])) for name, spec in header.items()}
    expected = {name: (dtype, tuple(shape)) for name, (dtype, shape) in expected.items()}
    if got != expected:
        diff = sorted(set(got.items()) ^ set(expected.items()), key=str)[:4]
        raise ValueError(f"payload tensors disagree with the quant metadata, e.g. {diff}")
    try:
        tensors = safetensors.torch.load(raw)
    except Exception as err:  # safetensors raises its own SafetensorError
        raise ValueError(f"safetensors payload unreadable: {err}") from None
    return tensors, model_config, quant


def quant_dequantize_payload(tensors: dict, quant: dict) -> dict:
    """Stored tensors -> float32 state dict (non-float passthrough tensors keep their dtype).

    ValueError if a quantized tensor holds values outside its bit width.
    """
    out = {}
    for name, (shape, kind, _) in quant["tensors"].items():
        if not isinstance(kind, int):
            t = tensors[name]
            out[name] = t.float() if t.is_floating_point() else t
            continue
        rows, q = shape[0], tensors[name + ".q"]
        numel = 1
        for d in shape:
            numel *= d
        q = unpack_bits(q, kind, numel) if quant["packing"] == "bits" else q
        q = q.reshape(rows, numel // max(rows, 1))
        if q.numel() and (int(q.min()) < -quant_qmax(kind) or int(q.max()) > quant_qmax(kind)):
            raise ValueError(f"tensor {name!r}: values exceed the int{kind} range")
        scale = tensors[name + ".scale"]
        if not bool(torch.isfinite(scale).all()):
            raise ValueError(f"tensor {name!r}: non-finite scales")
        out[name] = dequantize_per_row(q, scale).reshape(shape)
    return out
