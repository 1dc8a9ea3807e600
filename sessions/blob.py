"""The stored form of one KV chunk of one layer, and the chain key of a chunk.

Owns: the versioned blob header, the zstd frame around the payload, the checksum,
the chain hash that names a chunk, and the packing of token ids. Does not own: what
the payload bytes mean (the model packs FP4 records; we only carry them) or where
blobs live (the store).

Blob layout (little-endian)::

    magic    4s   b"DSKV"
    version  u16  FORMAT_VERSION
    hdr_len  u16  bytes before the zstd frame
    start    u64  first token of the chunk
    end      u64  one past the last token
    raw      u64  payload bytes before compression
    stored   u64  bytes of the zstd frame
    name_len u16  then the layer name, UTF-8
    digest   16s  BLAKE2b-128 over every header byte before it + the raw payload
    frame         one zstd frame (content size written)
"""

from __future__ import annotations

import hashlib
import struct
import sys
from array import array
from dataclasses import dataclass, field
from typing import Sequence

import zstandard

from .errors import BlobError

MAGIC = b"DSKV"
FORMAT_VERSION = 1
DEFAULT_ZSTD_LEVEL = 1  # measured (README): levels 1-9 store FP4 KV alike; 1 is fastest
ROOT_KEY = "0" * 64
_FIXED = struct.Struct("<4sHHQQQQH")
_DIGEST_BYTES = 16
_MAX_RAW = 1 << 34  # refuse absurd sizes read from a damaged header


@dataclass(frozen=True)
class ImageSpan:
    """An image occupying token positions [start, end) of the token log."""

    start: int
    end: int
    sha256: str


@dataclass
class KVChunk:
    """Global KV for tokens [start, end): packed bytes per KV-source layer name."""

    start: int
    end: int
    blobs: dict[str, bytes] = field(default_factory=dict)

    @property
    def nbytes(self) -> int:
        return sum(len(b) for b in self.blobs.values())


def tokens_to_bytes(tokens: Sequence[int]) -> bytes:
    """Pack token ids as little-endian uint32."""
    arr = array("I", tokens)
    assert arr.itemsize == 4
    if sys.byteorder != "little":
        arr.byteswap()
    return arr.tobytes()


def tokens_from_bytes(data: bytes) -> list[int]:
    arr = array("I")
    arr.frombytes(data)
    if sys.byteorder != "little":
        arr.byteswap()
    return arr.tolist()


def chunk_key(
    parent: str,
    start: int,
    tokens: Sequence[int],
    spans: Sequence[ImageSpan],
    fingerprint: str,
) -> str:
    """Chain hash naming the chunk of `tokens` that starts at `start` after `parent`.

    Equal prefixes give equal keys, so forks share chunk rows; any change to an
    earlier token, image or the model changes every later key.
    """
    h = hashlib.sha256(b"dsagent.kv-chunk.v1\0")
    h.update(parent.encode() + b"\0" + fingerprint.encode() + b"\0")
    h.update(struct.pack("<QQ", start, start + len(tokens)))
    h.update(tokens_to_bytes(tokens))
    for span in spans:
        h.update(struct.pack("<QQ", span.start, span.end) + bytes.fromhex(span.sha256))
    return h.hexdigest()


def _header(layer: str, start: int, end: int, raw: int, stored: int) -> bytes:
    name = layer.encode()
    hdr_len = _FIXED.size + len(name) + _DIGEST_BYTES
    fixed = _FIXED.pack(MAGIC, FORMAT_VERSION, hdr_len, start, end, raw, stored, len(name))
    return fixed + name


def _digest(header: bytes, payload: bytes) -> bytes:
    h = hashlib.blake2b(header, digest_size=_DIGEST_BYTES)
    h.update(payload)
    return h.digest()


def encode_blob(layer: str, start: int, end: int, payload: bytes, level: int) -> bytes:
    """Header + zstd frame of `payload`."""
    frame = zstandard.ZstdCompressor(level=level, write_content_size=True).compress(payload)
    header = _header(layer, start, end, len(payload), len(frame))
    return header + _digest(header, payload) + frame


def blob_version(blob: bytes) -> int | None:
    """The format version a blob claims, or None when it has no readable header."""
    if len(blob) < _FIXED.size or blob[:4] != MAGIC:
        return None
    return _FIXED.unpack_from(blob)[1]


def _parse_header(blob: bytes) -> tuple:
    if len(blob) < _FIXED.size or blob[:4] != MAGIC:
        raise BlobError("has no DSKV header")
    fields = _FIXED.unpack_from(blob)
    if fields[1] != FORMAT_VERSION:
        raise BlobError(f"has format version {fields[1]}, this dsagent reads {FORMAT_VERSION}")
    hdr_len, name_len = fields[2], fields[7]
    if hdr_len != _FIXED.size + name_len + _DIGEST_BYTES or len(blob) < hdr_len:
        raise BlobError("has a damaged header")
    return fields


def decode_blob(blob: bytes, *, layer: str, start: int, end: int) -> bytes:
    """Check a blob against what the store expects and return its payload."""
    _, _, hdr_len, b_start, b_end, raw, stored, name_len = _parse_header(blob)
    name = blob[_FIXED.size : _FIXED.size + name_len]
    if name != layer.encode() or (b_start, b_end) != (start, end):
        raise BlobError(f"header says {name!r} tokens {b_start}-{b_end}, expected {layer!r} {start}-{end}")
    frame = blob[hdr_len:]
    if len(frame) != stored or raw > _MAX_RAW:
        raise BlobError(f"is truncated or padded: frame has {len(frame)} B, header says {stored} B")
    try:
        payload = zstandard.ZstdDecompressor().decompress(frame, max_output_size=raw)
    except zstandard.ZstdError as exc:
        raise BlobError(f"has a corrupt zstd frame ({exc})") from None
    if len(payload) != raw:
        raise BlobError(f"decodes to {len(payload)} B, header says {raw} B")
    if _digest(blob[: hdr_len - _DIGEST_BYTES], payload) != blob[hdr_len - _DIGEST_BYTES : hdr_len]:
        raise BlobError("fails its checksum")
    return payload
