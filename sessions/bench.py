"""Measurements of the store: zstd levels on KV payloads, save/load throughput and
stored bytes per token against a formula.

Owns: the measuring functions `dsagent bench store` calls with real payloads from
the model, and `fp4_records`, a synthetic stand-in (Gaussian values quantized to
FP4 e2m1 exactly as ARCHITECTURE.md §2.10 describes) for runs without a model.
Does not own: printing (the caller prints the returned dicts as JSON) or timing
policy beyond a plain `perf_counter` best-of-N.
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path
from typing import Callable, Mapping

import zstandard

from .blob import KVChunk

_E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)


def _best_s(fn: Callable[[], object], repeat: int) -> float:
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def zstd_levels(payloads: Mapping[str, bytes], levels=(1, 3, 6, 9, 15, 19), repeat: int = 3) -> list[dict]:
    """Ratio and MB/s of zstd per payload and level (stored/raw; lower ratio is better)."""
    out = []
    for name, data in payloads.items():
        for level in levels:
            cctx = zstandard.ZstdCompressor(level=level, write_content_size=True)
            frame = cctx.compress(data)
            dctx = zstandard.ZstdDecompressor()
            c_s = _best_s(lambda: cctx.compress(data), repeat)
            d_s = _best_s(lambda: dctx.decompress(frame), repeat)
            out.append({"payload": name, "level": level, "raw_bytes": len(data), "stored_bytes": len(frame),
                        "ratio": round(len(frame) / len(data), 4),
                        "compress_MBps": round(len(data) / c_s / 1e6, 1),
                        "decompress_MBps": round(len(data) / d_s / 1e6, 1)})
    return out


def split_records(payload: bytes, record_bytes: int, code_bytes: int) -> tuple[bytes, bytes]:
    """Split packed records (codes then scales, e.g. 288 = 256 + 32) into codes and scales."""
    assert len(payload) % record_bytes == 0
    recs = [payload[i : i + record_bytes] for i in range(0, len(payload), record_bytes)]
    return b"".join(r[:code_bytes] for r in recs), b"".join(r[code_bytes:] for r in recs)


def _e4m3(v):
    import numpy as np
    e = np.clip(np.floor(np.log2(v)), -6, 8)
    m = np.round((v / 2.0**e - 1.0) * 8)
    e = np.where(m == 8, e + 1, e)
    m = np.where(m == 8, 0, m)
    return (((e + 7).astype(np.int64) << 3) | m.astype(np.int64)).astype(np.uint8), (1 + m / 8) * 2.0**e


def fp4_records(n: int, dims: int, block: int, scale: str, seed: int = 0) -> bytes:
    """`n` synthetic records: e2m1 codes (2 per byte, low nibble first) then one scale
    byte per `block` values, e4m3 (`scale="e4m3"`) or ue8m0 (`"ue8m0"`)."""
    import numpy as np
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n, dims // block, block)) * rng.lognormal(0, 0.5, (n, dims // block, 1))
    amax = np.abs(x).max(-1, keepdims=True)
    if scale == "e4m3":
        codes_s, s = _e4m3(np.maximum(amax, 6 * 2.0**-9) / 6)
    else:
        e = np.ceil(np.log2(np.maximum(amax, 6 * 2.0**-126) / 6))
        codes_s, s = (e + 127).astype(np.uint8), 2.0**e
    grid = np.array(_E2M1)
    idx = np.abs(np.abs(x / s)[..., None] - grid).argmin(-1)
    nib = (idx | ((x < 0) & (idx > 0)) * 8).reshape(n, dims).astype(np.uint8)
    packed = nib[:, 0::2] | (nib[:, 1::2] << 4)
    return np.concatenate([packed, codes_s.reshape(n, -1)], axis=1).tobytes()


def store_throughput(chunks: list[KVChunk], tokens: list[int], *, chunk_tokens: int,
                     zstd_level: int, formula_bytes_per_token: float | None = None) -> dict:
    """Save all `chunks` (one save point each) into a fresh store, load them back; MB/s
    of payload, and stored KV bytes per token (blobs only, and the whole file)."""
    from .store import Store
    raw = sum(c.nbytes for c in chunks)
    with tempfile.TemporaryDirectory() as home, Store.open(Path(home), zstd_level=zstd_level) as st:
        st.create_session("bench", fingerprint="bench")
        t0 = time.perf_counter()
        pos = 0
        for ch in chunks:
            st.save_point("bench", new_tokens=tokens[pos : ch.end], kv_chunks=[ch],
                          fingerprint="bench", chunk_tokens=chunk_tokens)
            pos = ch.end
        save_s = time.perf_counter() - t0
        load_s = _best_s(lambda: st.load("bench", fingerprint="bench", chunk_tokens=chunk_tokens), 3)
        st.conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
        rep = st.storage()
    n = chunks[-1].end
    out = {"tokens": n, "raw_bytes": raw, "zstd_level": zstd_level,
           "save_MBps": round(raw / save_s / 1e6, 1), "load_MBps": round(raw / load_s / 1e6, 1),
           "raw_bytes_per_token": round(raw / n, 2),
           "stored_bytes_per_token": round(rep.kv_unique_bytes / n, 2),
           "file_bytes_per_token": round(rep.file_bytes / n, 2)}
    if formula_bytes_per_token:
        out["stored_vs_formula"] = round(rep.kv_unique_bytes / n / formula_bytes_per_token, 4)
        out["file_vs_formula"] = round(rep.file_bytes / n / formula_bytes_per_token, 4)
    return out


def v41_chunk(start: int, end: int, seed: int = 0) -> KVChunk:
    """A full-config V4.1 chunk (§5.1): main records and index keys of sources 2, 8, 14
    (ratio 2) and 20 (ratio 1), synthetic FP4 payloads."""
    blobs = {}
    for layer, ratio in ((2, 2), (8, 2), (14, 2), (20, 1)):
        n = (end - start) // ratio
        blobs[f"layers.{layer}.kv"] = fp4_records(n, 512, 16, "e4m3", seed + layer)
        blobs[f"layers.{layer}.index"] = fp4_records(n, 128, 32, "ue8m0", seed + 100 + layer)
    return KVChunk(start, end, blobs)
