"""Block floating point, the low-precision number formats of V4.1: FP8 (e4m3) and FP4
(e2m1) values with one shared scale per block of channels, and their exact byte layouts.

Owns: e2m1 (FP4) rounding, power-of-two (ue8m0) and e4m3 block scales, the fake-quantisers
(the values a format holds, as floats), the three KV record layouts of ARCHITECTURE.md
§2.10 (FP8 window 528 B, FP4 main record 288 B, FP4 index key 68 B at the full size), and
the FP8 / FP4 weight formats of the checkpoint. Pure PyTorch: the twins of the pack
kernels (``model.kernels``), which build on this module. Does not own: how a cache holds
KV (``model.quant.KVFormat``), where records live (``model.cache``) or which tensors use
which format (``model.checkpoint``).

Invariant tested in ``tests/test_quant.py``: ``unpack_*(pack_*(x)) == fake_quant_*(x)``
bit for bit, so a cache that stores bytes computes exactly the trained function.
"""
from __future__ import annotations

import torch

FP8_MAX = 448.0
FP4_MAX = 6.0
WINDOW_BLOCK = 32  # FP8 window KV: one ue8m0 scale per 32 channels
RECORD_BLOCK = 16  # FP4 main record: one e4m3 scale per 16 channels
INDEX_BLOCK = 32  # FP4 index key: one ue8m0 scale per 32 channels

_E2M1_VALUES = torch.tensor(
    [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0]
)
# Round-to-nearest-even thresholds between grid points: a tie goes to the even code,
# so the ties at 0.75, 1.75 and 3.5 go up and those at 0.25, 1.25, 2.5 and 5.0 go down.
_E2M1_MIDPOINTS = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])
_E2M1_TIE_UP = torch.tensor([False, True, False, True, False, True, False])
_E2M1_THRESHOLDS = torch.where(_E2M1_TIE_UP, _E2M1_MIDPOINTS,
                               torch.nextafter(_E2M1_MIDPOINTS, _E2M1_MIDPOINTS + 1))
# every E4M3 byte's value, as the dtype's conversion gives it: decoding by this table is exact
# and, on a CPU, ~4x faster than the conversion (2026-12-07: 50 against 206 us for a 128 x 512 window)
_E4M3_VALUES = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
_ON_DEVICE: dict[tuple[str, torch.device], torch.Tensor] = {}


def _on(name: str, table: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``table`` on ``device``, copied there once: a CUDA graph capture may not copy from
    the host, so the eager warm-up before it leaves the copy here for the capture to reuse."""
    key = (name, device)
    if key not in _ON_DEVICE:
        _ON_DEVICE[key] = table.to(device)
    return _ON_DEVICE[key]


# ----------------------------------------------------------------------------- scalars

def pow2_ceil(t: torch.Tensor) -> torch.Tensor:
    """2**ceil(log2(t)) for positive fp32 ``t``, read off the IEEE-754 bits (exact)."""
    bits = t.float().contiguous().view(torch.int32)
    exponent = (bits >> 23) & 0xFF
    k = exponent - 127 + ((bits & 0x7FFFFF) != 0).to(torch.int32)
    return torch.exp2(k.float())


def ue8m0_encode(scale: torch.Tensor) -> torch.Tensor:
    """Power-of-two fp32 scales -> E8M0 exponent bytes (value = 2**(byte - 127))."""
    return ((scale.float().contiguous().view(torch.int32) >> 23) & 0xFF).to(torch.uint8)


def ue8m0_decode(codes: torch.Tensor) -> torch.Tensor:
    return torch.exp2(codes.float() - 127.0)


def e2m1_encode(q: torch.Tensor) -> torch.Tensor:
    """Pre-clamped fp32 values -> 4-bit codes (uint8, sign in bit 3), nearest-even."""
    thresholds = _on("e2m1_thresholds", _E2M1_THRESHOLDS, q.device)
    codes = (q.abs().unsqueeze(-1) >= thresholds).sum(-1).to(torch.uint8)
    return codes | (torch.signbit(q).to(torch.uint8) << 3)


def e2m1_decode(codes: torch.Tensor) -> torch.Tensor:
    return _looked_up("e2m1_values", _E2M1_VALUES, codes)


def e4m3_decode(codes: torch.Tensor) -> torch.Tensor:
    """uint8 E4M3 bytes -> their fp32 values (``_E4M3_VALUES``)."""
    return _looked_up("e4m3_values", _E4M3_VALUES, codes)


def _looked_up(name: str, table: torch.Tensor, codes: torch.Tensor) -> torch.Tensor:
    """``table[codes]`` for uint8 codes of any shape, by an int32 index_select (a long index
    is a conversion more)."""
    return _on(name, table, codes.device).index_select(0, codes.reshape(-1).int()).view(codes.shape)


def pack_nibbles(codes: torch.Tensor) -> torch.Tensor:
    """[..., 2n] codes -> [..., n] bytes, the even index in the low nibble."""
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


def unpack_nibbles(packed: torch.Tensor) -> torch.Tensor:
    low, high = packed & 0x0F, packed >> 4
    return torch.stack([low, high], dim=-1).flatten(-2)


# ----------------------------------------------------------------------------- block quantisers

def _blocks(x: torch.Tensor, block: int) -> torch.Tensor:
    n = x.shape[-1]
    assert n % block == 0, f"last dim {n} is not a multiple of the block size {block}"
    return x.float().reshape(*x.shape[:-1], n // block, block)


def _fp8_parts(x: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    blocks = _blocks(x, block)
    scale = pow2_ceil(blocks.abs().amax(-1).clamp_min(1e-4) * (1.0 / FP8_MAX))
    q = (blocks / scale.unsqueeze(-1)).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q, scale


def _fp4_parts(x: torch.Tensor, block: int, e4m3_scales: bool) -> tuple[torch.Tensor, torch.Tensor]:
    blocks = _blocks(x, block)
    amax = blocks.abs().amax(-1)
    if e4m3_scales:
        scale = (amax.clamp_min(FP4_MAX * 2.0**-9) / FP4_MAX).to(torch.float8_e4m3fn).float()
    else:
        scale = pow2_ceil(amax.clamp_min(FP4_MAX * 2.0**-126) * (1.0 / FP4_MAX))
    codes = e2m1_encode((blocks / scale.unsqueeze(-1)).clamp(-FP4_MAX, FP4_MAX))
    return codes, scale


def fake_quant_fp8(x: torch.Tensor, block: int = WINDOW_BLOCK) -> torch.Tensor:
    """FP8 e4m3 with one power-of-two scale per ``block`` channels, dequantised."""
    q, scale = _fp8_parts(x, block)
    return (q.float() * scale.unsqueeze(-1)).reshape(x.shape).to(x.dtype)


def fake_quant_fp4(x: torch.Tensor, block: int, e4m3_scales: bool = False) -> torch.Tensor:
    """FP4 e2m1 with one scale per ``block`` channels (ue8m0, or e4m3 when asked), dequantised."""
    codes, scale = _fp4_parts(x, block, e4m3_scales)
    return (e2m1_decode(codes) * scale.unsqueeze(-1)).reshape(x.shape).to(x.dtype)


# ----------------------------------------------------------------------------- KV byte layouts

def pow2_blocks(dim: int, block: int) -> bool:
    """Whether a row of ``dim`` channels is a power-of-two number of ``block``-blocks: what
    the pack kernels take (their block loop is one ``tl.arange``)."""
    return dim % block == 0 and (dim // block) & (dim // block - 1) == 0


def window_record_bytes(dim: int) -> int:
    return dim + dim // WINDOW_BLOCK


def main_record_bytes(dim: int) -> int:
    return dim // 2 + dim // RECORD_BLOCK


def index_record_bytes(dim: int) -> int:
    return dim // 2 + dim // INDEX_BLOCK


def pack_window(x: torch.Tensor) -> torch.Tensor:
    """[..., D] -> uint8 [..., D + D/32]: e4m3 data, then one ue8m0 byte per 32 channels."""
    q, scale = _fp8_parts(x, WINDOW_BLOCK)
    data = q.reshape(*x.shape[:-1], -1).view(torch.uint8)
    return torch.cat([data, ue8m0_encode(scale)], dim=-1)


def unpack_window(b: torch.Tensor, dim: int) -> torch.Tensor:
    data = e4m3_decode(b[..., :dim])
    scale = ue8m0_decode(b[..., dim:])
    return (data.reshape(*b.shape[:-1], -1, WINDOW_BLOCK) * scale.unsqueeze(-1)).reshape(*b.shape[:-1], dim)


def pack_main(x: torch.Tensor) -> torch.Tensor:
    """[..., D] -> uint8 [..., D/2 + D/16]: e2m1 pairs, then one e4m3 scale byte per 16."""
    codes, scale = _fp4_parts(x, RECORD_BLOCK, e4m3_scales=True)
    data = pack_nibbles(codes.reshape(*x.shape[:-1], -1))
    scale_bytes = scale.to(torch.float8_e4m3fn).view(torch.uint8)
    return torch.cat([data, scale_bytes], dim=-1)


def unpack_main(b: torch.Tensor, dim: int) -> torch.Tensor:
    values = e2m1_decode(unpack_nibbles(b[..., : dim // 2]))
    scale = e4m3_decode(b[..., dim // 2 :])
    return (values.reshape(*b.shape[:-1], -1, RECORD_BLOCK) * scale.unsqueeze(-1)).reshape(*b.shape[:-1], dim)


def pack_index(x: torch.Tensor) -> torch.Tensor:
    """[..., d] -> uint8 [..., d/2 + d/32]: e2m1 pairs, then one ue8m0 byte per 32."""
    codes, scale = _fp4_parts(x, INDEX_BLOCK, e4m3_scales=False)
    data = pack_nibbles(codes.reshape(*x.shape[:-1], -1))
    return torch.cat([data, ue8m0_encode(scale)], dim=-1)


def unpack_index(b: torch.Tensor, dim: int) -> torch.Tensor:
    values = e2m1_decode(unpack_nibbles(b[..., : dim // 2]))
    scale = ue8m0_decode(b[..., dim // 2 :])
    return (values.reshape(*b.shape[:-1], -1, INDEX_BLOCK) * scale.unsqueeze(-1)).reshape(*b.shape[:-1], dim)


# ----------------------------------------------------------------------------- weight formats

def quantize_fp8_weight(w: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """[out, in] -> (float8_e4m3fn [out, in], float8_e8m0fnu [ceil(out/B), ceil(in/B)])."""
    q, scale = _fp8_tiles(w, (block, block))
    return q.to(torch.float8_e4m3fn), ue8m0_encode(scale).view(torch.float8_e8m0fnu)


def _fp8_tile_view(w: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Scaled (not yet rounded) values of the zero-padded ``w`` [..., out, in] as tiles
    [..., To, bo, Ti, bi], and the power-of-two tile scales [..., To, 1, Ti, 1] (the padding
    never raises a tile's amax)."""
    (out_f, in_f), (bo, bi) = w.shape[-2:], block
    pad = torch.nn.functional.pad(w.float(), (0, -in_f % bi, 0, -out_f % bo))
    tiles = pad.view(*pad.shape[:-2], pad.shape[-2] // bo, bo, pad.shape[-1] // bi, bi)
    scale = pow2_ceil(tiles.abs().amax(dim=(-3, -1), keepdim=True).clamp_min(1e-4) / FP8_MAX)
    return (tiles / scale).clamp(-FP8_MAX, FP8_MAX), scale


def _untile(tiles: torch.Tensor, shape: torch.Size) -> torch.Tensor:
    rows = tiles.shape[-4] * tiles.shape[-3]
    return tiles.reshape(*tiles.shape[:-4], rows, -1)[..., : shape[-2], : shape[-1]]


def _fp8_tiles(w: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Scaled (not yet rounded) values [out, in] and the power-of-two tile scales."""
    q, scale = _fp8_tile_view(w, block)
    return _untile(q, w.shape), scale[..., 0, :, 0]


def fake_quant_fp8_weight(w: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """FP8 weight(s) [..., out, in] with one power-of-two scale per (rows, cols) tile,
    dequantised on ``w``'s device (the scales broadcast over their tiles)."""
    q, scale = _fp8_tile_view(w, block)
    return _untile(q.to(torch.float8_e4m3fn).float() * scale, w.shape).to(w.dtype)


def fp8_block_from_shapes(shape: tuple, scale_shape: tuple) -> tuple[int, int]:
    """The power-of-two block (rows, cols) whose ceil-division of ``shape`` gives ``scale_shape``."""
    def fit(n: int, blocks: int) -> int:
        for b in (2 ** k for k in range(16)):
            if -(-n // b) == blocks:
                return b
        raise ValueError(f"no power-of-two block turns {n} into {blocks} scale blocks")
    return fit(shape[0], scale_shape[0]), fit(shape[1], scale_shape[1])


def dequantize_fp8_weight(q: torch.Tensor, scale: torch.Tensor, block: tuple[int, int] | None = None) -> torch.Tensor:
    """Inverse of :func:`quantize_fp8_weight`; the block size is read from the shapes if not given."""
    out_f, in_f = q.shape
    bo, bi = block or fp8_block_from_shapes(tuple(q.shape), tuple(scale.shape))
    s = ue8m0_decode(scale.view(torch.uint8))
    s = s.repeat_interleave(bo, 0)[:out_f].repeat_interleave(bi, 1)[:, :in_f]
    return q.float() * s


def quantize_fp4_weight(w: torch.Tensor, block: int = 32) -> tuple[torch.Tensor, torch.Tensor]:
    """[out, in] -> (int8 [out, in/2] packed e2m1, float8_e8m0fnu [out, in/block])."""
    codes, scale = _fp4_parts(w, block, e4m3_scales=False)
    packed = pack_nibbles(codes.reshape(w.shape[0], -1))
    return packed.view(torch.int8), ue8m0_encode(scale).view(torch.float8_e8m0fnu)


def dequantize_fp4_weight(packed: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    values = e2m1_decode(unpack_nibbles(packed.view(torch.uint8)))
    block = values.shape[-1] // scale.shape[-1]
    s = ue8m0_decode(scale.view(torch.uint8))
    return (values.reshape(*values.shape[:-1], -1, block) * s.unsqueeze(-1)).reshape(values.shape)
