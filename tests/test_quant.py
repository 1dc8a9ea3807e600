"""Number formats of ``model.quant`` against an independent plain-Python reference.

The reference below is written from ARCHITECTURE.md §2.10 only (no torch casts): e2m1
rounding to nearest with ties to the even code, ue8m0 scales 2**ceil(log2(amax / max)),
e4m3 rounding (3 mantissa bits, subnormals below 2**-6, saturating at 448). The tests
check the exact bytes of the three KV layouts, ``unpack(pack(x)) == fake_quant(x)`` bit
for bit, and the checkpoint weight formats.
"""
from __future__ import annotations

import math
import struct

import pytest
import torch

from model import quant

E2M1_GRID = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]


# ----------------------------------------------------------------------------- reference

def f32(x: float) -> float:
    return struct.unpack("<f", struct.pack("<f", x))[0]


def ceil_log2(x: float) -> int:
    mantissa, exponent = math.frexp(x)  # x = mantissa * 2**exponent, 0.5 <= mantissa < 1
    return exponent - 1 if mantissa == 0.5 else exponent


def ue8m0_scale(amax: float, floor: float, top: float) -> float:
    return 2.0 ** ceil_log2(f32(max(amax, floor) / top))


def e2m1_code(v: float) -> int:
    """Code of the nearest grid value to the pre-clamped ``v``; ties go to the even code."""
    a = abs(v)
    best = min(range(8), key=lambda c: (abs(E2M1_GRID[c] - a), c % 2))
    return best | (8 if math.copysign(1.0, v) < 0 else 0)


def e4m3_value(x: float) -> float:
    """Round to e4m3fn (bias 7, 3 mantissa bits) nearest-even, saturating at 448."""
    a = abs(x)
    step = 2.0 ** (math.frexp(a)[1] - 1 - 3) if a >= 2.0 ** -6 else 2.0 ** -9
    q = min(round(a / step) * step, 448.0)  # round() is ties-to-even
    return math.copysign(q, x)


def e4m3_byte(x: float) -> int:
    q = e4m3_value(x)
    sign = 0x80 if math.copysign(1.0, q) < 0 else 0
    a = abs(q)
    if a < 2.0 ** -6:
        return sign | int(a / 2.0 ** -9)
    exponent = math.frexp(a)[1] - 1
    mantissa = int(a / 2.0 ** exponent * 8) - 8
    return sign | (exponent + 7) << 3 | mantissa


def ref_fp4_block(block: list[float], e4m3_scales: bool) -> tuple[list[int], float]:
    amax = max(abs(v) for v in block)
    if e4m3_scales:
        scale = e4m3_value(f32(max(amax, 6 * 2.0 ** -9) / 6))
    else:
        scale = ue8m0_scale(amax, 6 * 2.0 ** -126, 6.0)
    return [e2m1_code(max(-6.0, min(6.0, f32(v / scale)))) for v in block], scale


def ref_fp8_block(block: list[float]) -> tuple[list[int], float]:
    scale = ue8m0_scale(max(abs(v) for v in block), 1e-4, 448.0)
    return [e4m3_byte(max(-448.0, min(448.0, f32(v / scale)))) for v in block], scale


def ref_pack_window(row: list[float]) -> bytes:
    data, scales = [], []
    for i in range(0, len(row), 32):
        codes, scale = ref_fp8_block(row[i:i + 32])
        data += codes
        scales.append(ceil_log2(scale) + 127)
    return bytes(data + scales)


def _nibbles(codes: list[int]) -> list[int]:
    return [codes[i] | codes[i + 1] << 4 for i in range(0, len(codes), 2)]


def ref_pack_main(row: list[float]) -> bytes:
    codes, scales = [], []
    for i in range(0, len(row), 16):
        c, scale = ref_fp4_block(row[i:i + 16], e4m3_scales=True)
        codes += c
        scales.append(e4m3_byte(scale))
    return bytes(_nibbles(codes) + scales)


def ref_pack_index(row: list[float]) -> bytes:
    codes, scales = [], []
    for i in range(0, len(row), 32):
        c, scale = ref_fp4_block(row[i:i + 32], e4m3_scales=False)
        codes += c
        scales.append(ceil_log2(scale) + 127)
    return bytes(_nibbles(codes) + scales)


def ref_fake_fp4(row: list[float], block: int, e4m3_scales: bool) -> list[float]:
    out = []
    for i in range(0, len(row), block):
        codes, scale = ref_fp4_block(row[i:i + block], e4m3_scales)
        out += [math.copysign(E2M1_GRID[c & 7], -1.0 if c & 8 else 1.0) * scale for c in codes]
    return out


# ----------------------------------------------------------------------------- inputs

def _ties(dim: int) -> torch.Tensor:
    """Every e2m1 midpoint (±), placed in blocks whose amax makes the scale exactly 1."""
    mids = [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 0.0, 6.0]
    vals = [m * s for m in mids for s in (1.0, -1.0)]
    return torch.tensor((vals * dim)[:dim], dtype=torch.float32)


def _inputs(dim: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(dim)
    normal = torch.randn(4, dim, generator=g)
    return {
        "random": normal,
        "wide": normal * torch.logspace(-6, 6, dim).unsqueeze(0),
        "zero": torch.zeros(2, dim),
        "negzero": -torch.zeros(1, dim),
        "tiny": normal[:2] * 1e-30,
        "huge": normal[:2] * 1e30,
        "ties": _ties(dim).unsqueeze(0),
        "ties_scaled": _ties(dim).unsqueeze(0) * 2.0 ** -20,
    }


CASES = [(name, x) for name, x in _inputs(512).items()]


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.float().contiguous().view(torch.int32)


# ----------------------------------------------------------------------------- KV layouts

def test_record_sizes_at_full_width() -> None:
    assert quant.window_record_bytes(512) == 528
    assert quant.main_record_bytes(512) == 288
    assert quant.index_record_bytes(128) == 68


@pytest.mark.parametrize("name,x", CASES, ids=[c[0] for c in CASES])
def test_pack_window_bytes_match_reference(name: str, x: torch.Tensor) -> None:
    packed = quant.pack_window(x)
    assert packed.dtype == torch.uint8 and packed.shape == (x.shape[0], 528)
    for row, got in zip(x.tolist(), packed):
        assert bytes(got.tolist()) == ref_pack_window(row)


@pytest.mark.parametrize("name,x", CASES, ids=[c[0] for c in CASES])
def test_pack_main_bytes_match_reference(name: str, x: torch.Tensor) -> None:
    packed = quant.pack_main(x)
    assert packed.dtype == torch.uint8 and packed.shape == (x.shape[0], 288)
    for row, got in zip(x.tolist(), packed):
        assert bytes(got.tolist()) == ref_pack_main(row)


@pytest.mark.parametrize("name,x", CASES, ids=[c[0] for c in CASES])
def test_pack_index_bytes_match_reference(name: str, x: torch.Tensor) -> None:
    x = x[:, :128]
    packed = quant.pack_index(x)
    assert packed.dtype == torch.uint8 and packed.shape == (x.shape[0], 68)
    for row, got in zip(x.tolist(), packed):
        assert bytes(got.tolist()) == ref_pack_index(row)


def test_layout_positions() -> None:
    """Low nibble = even index; scales follow the data."""
    x = torch.zeros(512)
    x[0], x[1] = 6.0, -0.5  # block 0 amax 6 -> scale 1 (e4m3 and ue8m0 alike)
    packed = quant.pack_main(x)
    assert packed[0].item() == 0x7 | (0x9 << 4)
    assert packed[256].item() == 0x38  # e4m3 1.0: exponent 7, mantissa 0
    idx = quant.pack_index(x[:128])
    assert idx[0].item() == 0x97 and idx[64].item() == 127  # ue8m0 1.0 = 2**(127-127)
    win = quant.pack_window(x * 448 / 6)
    assert win[512].item() == 127 and win[0].item() == 0x7E  # 448 = 1.75 * 2**8


@pytest.mark.parametrize("name,x", CASES, ids=[c[0] for c in CASES])
def test_unpack_of_pack_is_fake_quant_bitwise(name: str, x: torch.Tensor) -> None:
    assert torch.equal(_bits(quant.unpack_window(quant.pack_window(x), 512)), _bits(quant.fake_quant_fp8(x, 32)))
    assert torch.equal(_bits(quant.unpack_main(quant.pack_main(x), 512)),
                       _bits(quant.fake_quant_fp4(x, 16, e4m3_scales=True)))
    k = x[:, :128]
    assert torch.equal(_bits(quant.unpack_index(quant.pack_index(k), 128)), _bits(quant.fake_quant_fp4(k, 32)))


@pytest.mark.parametrize("name,x", CASES, ids=[c[0] for c in CASES])
def test_fake_quant_fp4_values_match_reference(name: str, x: torch.Tensor) -> None:
    for e4m3 in (False, True):
        block = 16 if e4m3 else 32
        got = quant.fake_quant_fp4(x, block, e4m3_scales=e4m3)
        want = torch.tensor([ref_fake_fp4(row, block, e4m3) for row in x.tolist()])
        assert torch.equal(got, want)


def test_e2m1_ties_go_to_even_code() -> None:
    mids = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])
    assert quant.e2m1_decode(quant.e2m1_encode(mids)).tolist() == [0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0]
    assert quant.e2m1_decode(quant.e2m1_encode(-mids)).tolist() == [-0.0, -1.0, -1.0, -2.0, -2.0, -4.0, -4.0]


def test_the_decode_tables_give_every_code_the_conversions_value() -> None:
    """``e4m3_decode`` / ``e2m1_decode`` read values from a table: every E4M3 byte's is the dtype
    conversion's to the bit (NaN where it is NaN), every e2m1 code's the grid's, in any shape
    and from a non-contiguous slice (the unpackers read the bytes that way)."""
    from model.blockfp import _E2M1_VALUES, e2m1_decode, e4m3_decode

    codes = torch.arange(256, dtype=torch.uint8)
    want = codes.view(torch.float8_e4m3fn).float()
    got = e4m3_decode(codes)
    assert torch.equal(got.isnan(), want.isnan()) and int(want.isnan().sum()) == 2
    ok = ~want.isnan()
    assert torch.equal(got[ok].view(torch.int32), want[ok].view(torch.int32))  # -0.0 kept
    rows = torch.cat([codes.view(8, 32), codes.view(8, 32)], 1)[:, 16:48]  # a slice, not contiguous
    assert torch.equal(e4m3_decode(rows).nan_to_num(), rows.contiguous().view(torch.float8_e4m3fn).float().nan_to_num())
    nibbles = torch.arange(16, dtype=torch.uint8).repeat(3).view(2, 3, 8)
    assert torch.equal(e2m1_decode(nibbles).view(torch.int32), _E2M1_VALUES[nibbles.long()].view(torch.int32))


def test_pow2_ceil_is_exact() -> None:
    x = torch.tensor([1.0, 1.5, 2.0, 2.0 ** -126, 3.0 * 2.0 ** 100, torch.nextafter(torch.tensor(4.0),
                                                                                   torch.tensor(5.0)).item()])
    assert quant.pow2_ceil(x).tolist() == [2.0 ** ceil_log2(v) for v in x.tolist()]


# ----------------------------------------------------------------------------- weight formats

def _ref_fp8_weight(w: torch.Tensor, block: int) -> torch.Tensor:
    out = torch.empty_like(w)
    for r in range(0, w.shape[0], block):
        for c in range(0, w.shape[1], block):
            tile = w[r:r + block, c:c + block]
            scale = ue8m0_scale(tile.abs().max().item(), 1e-4, 448.0)
            vals = [e4m3_value(max(-448.0, min(448.0, f32(v / scale)))) * scale for v in tile.flatten().tolist()]
            out[r:r + block, c:c + block] = torch.tensor(vals).view(tile.shape)
    return out


def test_fp8_weight_round_trip_matches_reference() -> None:
    w = torch.randn(40, 70, generator=torch.Generator().manual_seed(1)) * 0.05  # not a multiple of 32
    q, scale = quant.quantize_fp8_weight(w, 32)
    assert q.dtype == torch.float8_e4m3fn and q.shape == (40, 70)
    assert scale.dtype == torch.float8_e8m0fnu and scale.shape == (2, 3)
    deq = quant.dequantize_fp8_weight(q, scale)
    assert torch.equal(deq, _ref_fp8_weight(w, 32))
    q2, scale2 = quant.quantize_fp8_weight(deq, 32)  # quantising a quantised weight changes nothing
    assert torch.equal(q2.view(torch.uint8), q.view(torch.uint8)) and torch.equal(scale2.view(torch.uint8),
                                                                                 scale.view(torch.uint8))


def test_fp4_weight_round_trip_matches_reference() -> None:
    w = torch.randn(6, 64, generator=torch.Generator().manual_seed(2))
    w[0, :32] = _ties(32)
    packed, scale = quant.quantize_fp4_weight(w, 32)
    assert packed.dtype == torch.int8 and packed.shape == (6, 32)
    assert scale.dtype == torch.float8_e8m0fnu and scale.shape == (6, 2)
    for row, got in zip(w.tolist(), packed.view(torch.uint8)):
        assert bytes(got.tolist()) == ref_pack_index(row)[:32]
    deq = quant.dequantize_fp4_weight(packed, scale)
    assert torch.equal(deq, torch.tensor([ref_fake_fp4(row, 32, False) for row in w.tolist()]))
    assert torch.equal(deq, quant.fake_quant_fp4(w, 32))
