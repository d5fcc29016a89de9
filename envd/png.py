"""A minimal PNG encoder (zlib + struct) for RGB/RGBA/grey frames, so backends need no imaging library."""
from __future__ import annotations

import struct
import zlib

import numpy as np

_SIG = b"\x89PNG\r\n\x1a\n"
_COLOR_TYPES = {1: 0, 3: 2, 4: 6}   # channels -> PNG colour type (grey, RGB, RGBA)


def _chunk(kind: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)


def encode_png(frame: np.ndarray, level: int = 6) -> bytes:
    """PNG bytes of an [H, W], [H, W, 1], [H, W, 3] or [H, W, 4] image; floats in [0, 1] or integers 0..255."""
    a = np.asarray(frame)
    if a.ndim == 2:
        a = a[:, :, None]
    if a.ndim != 3 or a.shape[2] not in _COLOR_TYPES or a.shape[0] < 1 or a.shape[1] < 1:
        raise ValueError(f"cannot encode an image of shape {a.shape} as PNG")
    if a.dtype.kind == "f":
        a = np.clip(np.nan_to_num(a) * 255.0 + 0.5, 0, 255)
    a = np.ascontiguousarray(a.astype(np.uint8))
    h, w, c = a.shape
    # Each row is prefixed with filter type 0 (none): simple, and zlib still squeezes flat regions well.
    raw = np.concatenate([np.zeros((h, 1), np.uint8), a.reshape(h, w * c)], axis=1).tobytes()
    header = struct.pack(">IIBBBBB", w, h, 8, _COLOR_TYPES[c], 0, 0, 0)
    return _SIG + _chunk(b"IHDR", header) + _chunk(b"IDAT", zlib.compress(raw, level)) + _chunk(b"IEND", b"")


def decode_png(data: bytes) -> np.ndarray:
    """Decode the PNGs `encode_png` writes (8-bit, unfiltered rows, no interlace): for tests and round trips."""
    if not data.startswith(_SIG):
        raise ValueError("not a PNG")
    pos, idat, header = len(_SIG), b"", None
    while pos < len(data):
        (n,), kind = struct.unpack(">I", data[pos:pos + 4]), data[pos + 4:pos + 8]
        body = data[pos + 8:pos + 8 + n]
        if struct.unpack(">I", data[pos + 8 + n:pos + 12 + n])[0] != zlib.crc32(kind + body) & 0xFFFFFFFF:
            raise ValueError(f"bad CRC in {kind!r}")
        if kind == b"IHDR":
            header = struct.unpack(">IIBBBBB", body)
        elif kind == b"IDAT":
            idat += body
        pos += 12 + n
    if header is None:
        raise ValueError("no IHDR")
    w, h, depth, ctype = header[:4]
    c = {v: k for k, v in _COLOR_TYPES.items()}[ctype]
    rows = np.frombuffer(zlib.decompress(idat), np.uint8).reshape(h, 1 + w * c)
    if depth != 8 or rows[:, 0].any():
        raise ValueError("only 8-bit unfiltered PNGs are supported")
    return rows[:, 1:].reshape(h, w, c)


def encode_rgb(pixels, width: int, height: int, level: int = 6) -> bytes:
    """PNG bytes of packed 8-bit RGB (row-major, len = width*height*3): mss's `rgb` or a [H, W, 3] uint8 buffer."""
    raw = np.frombuffer(memoryview(pixels).cast("B"), np.uint8)
    if width <= 0 or height <= 0 or raw.size != width * height * 3:
        raise ValueError(f"expected {width}x{height}x3 = {width * height * 3} bytes of RGB, got {raw.size}")
    return encode_png(raw.reshape(height, width, 3), level)


def decode_rgb(data: bytes) -> tuple[int, int, bytes]:
    """(width, height, packed RGB bytes) of an RGB PNG written by this module (tests and checks)."""
    a = decode_png(data)
    if a.shape[2] != 3:
        raise ValueError(f"not an RGB PNG: {a.shape[2]} channels")
    return a.shape[1], a.shape[0], a.tobytes()
