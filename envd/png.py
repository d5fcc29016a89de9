"""PNG encoding of raw RGB pixels with zlib + struct only (no imaging library needed by the backends).

Screenshots leave envd as PNG (envd.base.Screenshot). Backends hold pixels as an [H, W, 3] uint8 array (MiniWoB) or
as packed RGB bytes (mss); both go through `encode_rgb`.
"""
from __future__ import annotations

import struct
import zlib

_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def _chunk(kind: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)


def encode_rgb(pixels, width: int, height: int, level: int = 6) -> bytes:
    """PNG bytes of an 8-bit RGB image. `pixels`: row-major RGB bytes (len = width*height*3) or anything exposing
    the buffer protocol with that many bytes, e.g. a C-contiguous numpy array [H, W, 3] of uint8."""
    raw = memoryview(pixels).cast("B")
    stride = width * 3
    if width <= 0 or height <= 0 or len(raw) != stride * height:
        raise ValueError(f"expected {width}x{height}x3 = {stride * height} bytes of RGB, got {len(raw)}")
    # Each scanline is prefixed with filter type 0 (None): the cheapest encode; zlib still shrinks flat GUI areas.
    rows = bytearray((stride + 1) * height)
    for y in range(height):
        start = y * (stride + 1) + 1
        rows[start:start + stride] = raw[y * stride:(y + 1) * stride]
    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)  # 8-bit depth, colour type 2 (RGB)
    return _SIGNATURE + _chunk(b"IHDR", header) + _chunk(b"IDAT", zlib.compress(bytes(rows), level)) + _chunk(b"IEND", b"")


def decode_rgb(png: bytes) -> tuple[int, int, bytes]:
    """(width, height, RGB bytes) of a PNG written by `encode_rgb` (8-bit RGB, filter 0 only). For tests and checks."""
    if not png.startswith(_SIGNATURE):
        raise ValueError("not a PNG")
    pos, width, height, idat = len(_SIGNATURE), 0, 0, bytearray()
    while pos < len(png):
        (length,) = struct.unpack(">I", png[pos:pos + 4])
        kind, data = png[pos + 4:pos + 8], png[pos + 8:pos + 8 + length]
        pos += 12 + length
        if kind == b"IHDR":
            width, height, depth, colour = struct.unpack(">IIBB", data[:10])
            if (depth, colour) != (8, 2):
                raise ValueError(f"only 8-bit RGB is supported, got depth {depth} colour type {colour}")
        elif kind == b"IDAT":
            idat += data
    rows = zlib.decompress(bytes(idat))
    stride = width * 3
    out = bytearray()
    for y in range(height):
        line = rows[y * (stride + 1):(y + 1) * (stride + 1)]
        if line[0] != 0:
            raise ValueError(f"scanline filter {line[0]} is not supported")
        out += line[1:]
    return width, height, bytes(out)
