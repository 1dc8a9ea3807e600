"""The image input path (model.vision): decoding untrusted bytes, the resize plan, the ViT,
the aligner, the span layout and its embeddings, and one tiny-model check that an
image reaches the backbone's output. Every image is drawn with pillow in the test; no
files, no downloads. (There are no vision golden vectors in ../shared/golden/ yet.)
"""
from __future__ import annotations

import io
import math
import struct
import zlib

import numpy as np
import pytest
import torch
from PIL import Image
from torch import nn

from model.args import ConfigError, ModelArgs, VisionArgs
from model.vision import (
    Aligner,
    ImageError,
    ImagePlan,
    VisionTransformer,
    apply_rope_2d,
    decode_image,
    encode_image_span,
    image_inputs,
    image_sha256,
    pixel_unshuffle,
    plan_image,
    preprocess,
    render,
    span_layout,
    span_length,
    vision_param_count,
    vision_rope,
    vision_shapes,
)

TINY = ModelArgs.preset("tiny").vision
FULL = VisionArgs()
TINY_DIM = ModelArgs.preset("tiny").hidden_size


def encode(img: Image.Image, fmt: str = "PNG", **kw) -> bytes:
    buf = io.BytesIO()
    img.save(buf, fmt, **kw)
    return buf.getvalue()


def noise(w: int, h: int, seed: int = 0, mode: str = "RGB") -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (h, w, len(mode)), dtype=np.uint8).squeeze(), mode)


# ----------------------------------------------------------------------------- plan

@pytest.mark.parametrize("w,h,canvas,tokens", [
    (544, 544, (546, 546), 184),  # exactly min_pixels: sides rounded up to 14
    (1024, 1024, (1036, 1036), 652),
    (2048, 2048, (1302, 1302), 994),  # capped: closed-form shrink
    (640, 480, (644, 490), 206),
    (4000, 400, (4004, 406), 972),  # 10:1
])
def test_plan_full_config_hand_computed(w, h, canvas, tokens):
    plan = plan_image(w, h, FULL)
    assert (plan.canvas_width, plan.canvas_height) == canvas
    assert plan.n_tokens == span_length(plan) == tokens


def test_plan_letterbox_offsets():
    plan = plan_image(640, 480, FULL)
    assert (plan.width, plan.height, plan.left, plan.top) == (644, 483, 0, 4)


SHAPES = [(1, 1), (10, 10), (13, 7), (126, 126), (127, 125), (300, 200), (544, 544), (1000, 100),
          (100, 1000), (10000, 1), (1, 10000), (5000, 4000), (100000, 1000), (1000, 100000),
          (4096, 2160), (42, 42 * 30)]


def check_plan(plan: ImagePlan, w: int, h: int, v: VisionArgs) -> None:
    p, r = v.patch_size, v.downsample_ratio
    assert plan.canvas_width % p == 0 and plan.canvas_height % p == 0
    assert (plan.n_w, plan.n_h) == (plan.canvas_width // p, plan.canvas_height // p)
    assert (plan.n_llm_h, plan.n_llm_w) == (math.ceil(plan.n_h / r), math.ceil(plan.n_w / r))
    assert plan.n_tokens == plan.n_llm_h * (plan.n_llm_w + 1) + 2 <= v.max_image_tokens
    assert 1 <= plan.width <= plan.canvas_width and 1 <= plan.height <= plan.canvas_height
    assert plan.width == plan.canvas_width or plan.height == plan.canvas_height  # aspect fit touches a side
    assert plan.left == round((plan.canvas_width - plan.width) / 2)
    assert plan.top == round((plan.canvas_height - plan.height) / 2)
    if not plan.stretched and min(plan.width, plan.height) > 20:  # aspect kept to within the 1-px rounding
        assert abs(plan.width / plan.height - w / h) <= (w / h) * (1.0 / min(plan.width, plan.height)) + 1e-9


@pytest.mark.parametrize("v", [TINY, FULL], ids=["tiny", "v41-flash"])
@pytest.mark.parametrize("w,h", SHAPES)
def test_plan_grid_against_formula(v, w, h):
    plan = plan_image(w, h, v)
    check_plan(plan, w, h, v)
    layout = span_layout(plan)
    assert len(layout) == plan.n_tokens
    assert layout[0] == "start" and layout[-1] == "end"
    assert layout.count("newline") == plan.n_llm_h and layout.count("image") == plan.n_llm_h * plan.n_llm_w


@pytest.mark.parametrize("w,h", [(1, 1), (10, 10), (126, 126), (60, 30)])
def test_small_images_are_upscaled_to_min_pixels(w, h):
    plan = plan_image(w, h, TINY)
    assert plan.canvas_width * plan.canvas_height >= TINY.min_pixels * 0.95
    assert plan_image(126, 126, TINY).n_tokens == 3 * 4 + 2  # exactly min: 9x9 patches -> 3x3 tokens


def test_token_cap_binds_for_huge_images():
    for v in (TINY, FULL):
        plans = [plan_image(w, h, v) for w, h in [(20000, 20000), (30000, 7000), (7000, 30000)]]
        assert all(p.n_tokens <= v.max_image_tokens for p in plans)
        assert max(p.n_tokens for p in plans) > v.max_image_tokens * 0.8  # the cap is used, not wasted


def test_max_wh_ratio_stretches_very_wide_images():
    v = VisionArgs(max_wh_ratio=8)
    plan = plan_image(2000, 100, v)
    assert plan.stretched and (plan.width, plan.height) == (plan.canvas_width, plan.canvas_height)
    check_plan(plan, 800, 100, v)
    assert abs(plan.canvas_width / plan.canvas_height - 8) < 8 * v.patch_size / plan.canvas_height  # clamped
    assert not plan_image(700, 100, v).stretched


def test_bad_plan_inputs():
    with pytest.raises(ImageError):
        plan_image(0, 10, TINY)
    with pytest.raises(ConfigError, match="max_image_tokens"):
        plan_image(10, 10, VisionArgs(max_image_tokens=3))


# ----------------------------------------------------------------------------- preprocess

def test_preprocess_patches_are_the_canvas_row_major():
    img = noise(200, 90, seed=1)
    pixels, plan = preprocess(img, TINY)
    p = TINY.patch_size
    assert pixels.shape == (plan.n_h * plan.n_w, 3, p, p) and pixels.dtype == torch.float32
    canvas = np.asarray(render(img, plan), dtype=np.float32) / 255.0 * 2 - 1  # (H, W, 3)
    for k in (0, 1, plan.n_w, plan.n_h * plan.n_w - 1):
        i, j = divmod(k, plan.n_w)
        want = canvas[i * p:(i + 1) * p, j * p:(j + 1) * p].transpose(2, 0, 1)
        assert np.allclose(pixels[k].numpy(), want, atol=1e-6)
    assert pixels.min() >= -1 and pixels.max() <= 1


def test_preprocess_pads_with_gray_127():
    pixels, plan = preprocess(Image.new("RGB", (400, 100), (255, 0, 0)), TINY)
    assert plan.top > 0
    gray = (127 / 255 - 0.5) / 0.5
    assert torch.allclose(pixels[0, :, 0, 0], torch.full((3,), gray))  # top-left corner is padding
    mid = (plan.n_h // 2) * plan.n_w + plan.n_w // 2
    assert torch.allclose(pixels[mid, :, 7, 7], torch.tensor([1.0, -1.0, -1.0]), atol=0.02)


# ----------------------------------------------------------------------------- decoding

def png_claiming(width: int, height: int) -> bytes:
    """A PNG header that declares a huge size over one byte of data (a decompression bomb)."""
    def chunk(kind: bytes, body: bytes) -> bytes:
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))
    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(b"\0")) + chunk(b"IEND", b"")


@pytest.mark.parametrize("data,match", [
    (b"", "empty"),
    (b"hello, this is a text file\n" * 10, "not an image"),
    (b"%PDF-1.4\n" + b"0" * 200, "not an image"),
    (png_claiming(100_000, 100_000), "pixel"),
    (png_claiming(60_000, 60_000), "pixel"),
])
def test_refused_bytes(data, match):
    with pytest.raises(ImageError, match=match):
        decode_image(data)


def test_truncated_png_is_refused():
    data = encode(noise(64, 64))
    with pytest.raises(ImageError, match="truncated or corrupt"):
        decode_image(data[: len(data) // 2])


def test_truncated_jpeg_is_refused():
    data = encode(noise(64, 64), "JPEG")
    with pytest.raises(ImageError, match="truncated or corrupt"):
        decode_image(data[: len(data) // 2])


def test_size_limits_are_explicit():
    data = encode(noise(100, 100))
    assert decode_image(data).size == (100, 100)
    with pytest.raises(ImageError, match="10,000 pixels"):
        decode_image(data, max_pixels=5000)
    with pytest.raises(ImageError, match="byte limit"):
        decode_image(data, max_bytes=100)
    with pytest.raises(ImageError, match="sides over"):
        decode_image(encode(Image.new("L", (40000, 1))))


def test_unsupported_format_is_refused():
    with pytest.raises(ImageError, match="supported format"):
        decode_image(encode(noise(8, 8), "PPM"))


def test_animated_gif_keeps_the_first_frame():
    frames = [Image.new("RGB", (16, 16), c) for c in ((255, 0, 0), (0, 0, 255))]
    buf = io.BytesIO()
    frames[0].save(buf, "GIF", save_all=True, append_images=frames[1:], duration=50, loop=0)
    img = decode_image(buf.getvalue())
    assert img.mode == "RGB" and img.getpixel((8, 8)) == (255, 0, 0)


def test_cmyk_jpeg_becomes_rgb():
    img = decode_image(encode(Image.new("CMYK", (32, 32), (0, 255, 255, 0)), "JPEG", quality=95))
    r, g, b = img.getpixel((16, 16))
    assert img.mode == "RGB" and r > 200 and g < 60 and b < 60


def test_alpha_is_composited_on_white():
    rgba = Image.new("RGBA", (8, 8), (0, 0, 0, 0))
    rgba.putpixel((0, 0), (255, 0, 0, 255))
    rgba.putpixel((1, 0), (0, 0, 0, 128))
    img = decode_image(encode(rgba))
    assert img.mode == "RGB"
    assert img.getpixel((5, 5)) == (255, 255, 255) and img.getpixel((0, 0)) == (255, 0, 0)
    assert all(120 <= c <= 135 for c in img.getpixel((1, 0)))
    la = decode_image(encode(Image.new("LA", (4, 4), (0, 0))))
    assert la.getpixel((0, 0)) == (255, 255, 255)


def test_16_bit_gray_is_scaled_not_clipped():
    arr = np.array([[0, 257 * 128, 65535]], dtype=np.uint16)
    data = encode(Image.fromarray(arr))
    assert Image.open(io.BytesIO(data)).mode.startswith("I")
    img = decode_image(data)
    assert [img.getpixel((x, 0)) for x in range(3)] == [(0, 0, 0), (128, 128, 128), (255, 255, 255)]


def test_float_tiff_is_scaled():
    data = encode(Image.fromarray(np.array([[0.0, 0.5, 1.0]], dtype=np.float32), "F"), "TIFF")
    img = decode_image(data)
    assert [img.getpixel((x, 0))[0] for x in range(3)] == [0, 128, 255]


def test_palette_and_bilevel_become_rgb():
    pal = Image.new("P", (4, 4))
    pal.putpalette([0, 0, 0, 10, 200, 30] + [0] * 762)
    pal.putpixel((1, 1), 1)
    img = decode_image(encode(pal))
    assert img.mode == "RGB" and img.getpixel((1, 1)) == (10, 200, 30) and img.getpixel((0, 0)) == (0, 0, 0)
    trans = decode_image(encode(pal, transparency=0))
    assert trans.getpixel((0, 0)) == (255, 255, 255) and trans.getpixel((1, 1)) == (10, 200, 30)
    assert decode_image(encode(Image.new("1", (4, 4), 1))).getpixel((0, 0)) == (255, 255, 255)


def test_exif_orientation_is_applied():
    exif = Image.Exif()
    exif[0x0112] = 6  # rotate 90 degrees clockwise to display
    data = encode(Image.new("RGB", (40, 20), (0, 128, 0)), "JPEG", exif=exif.tobytes())
    assert decode_image(data).size == (20, 40)


def test_formats_round_trip_and_hash():
    img = noise(30, 20, seed=3)
    for fmt in ("PNG", "JPEG", "GIF", "WEBP", "BMP", "TIFF"):
        out = decode_image(encode(img, fmt))
        assert out.mode == "RGB" and out.size == (30, 20), fmt
    assert image_sha256(b"abc") == "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"


# ----------------------------------------------------------------------------- ViT and aligner

@pytest.fixture(scope="module")
def tower():
    torch.manual_seed(0)
    holder = nn.Module()
    holder.vision = VisionTransformer(TINY)
    holder.aligner = Aligner(TINY, TINY_DIM)
    for name in ("image_start", "image_end", "image_newline"):
        setattr(holder, name, nn.Parameter(torch.randn(TINY_DIM)))
    return holder.eval()


@pytest.mark.parametrize("n_h,n_w", [(9, 9), (3, 3), (4, 7), (1, 10), (10, 2)])
def test_vit_and_aligner_shapes(tower, n_h, n_w):
    p = TINY.patch_size
    with torch.no_grad():
        feats = tower.vision(torch.randn(n_h * n_w, 3, p, p), n_h, n_w)
        rows = tower.aligner(feats, n_h, n_w)
    assert feats.shape == (n_h * n_w, TINY.hidden_size) and torch.isfinite(feats).all()
    assert rows.shape == (math.ceil(n_h / 3) * math.ceil(n_w / 3), TINY_DIM)


def test_pixel_unshuffle_feature_order():
    n_h, n_w, c_dim, r = 4, 5, 2, 3
    x = torch.tensor([[1000.0 * c + 10 * i + j + 1 for c in range(c_dim)] for i in range(n_h) for j in range(n_w)])
    out = pixel_unshuffle(x, n_h, n_w, r)
    assert out.shape == (2 * 2, c_dim * 9)
    for cy in range(2):
        for cx in range(2):
            for c in range(c_dim):
                for ky in range(r):
                    for kx in range(r):
                        i, j = cy * r + ky, cx * r + kx
                        want = 1000.0 * c + 10 * i + j + 1 if i < n_h and j < n_w else 0.0
                        assert out[cy * 2 + cx, c * 9 + ky * 3 + kx] == want


def test_rope_is_a_rotation_and_relative():
    head_dim, n_h, n_w = 16, 6, 7
    cos, sin = vision_rope(n_h, n_w, head_dim, 10000.0)
    assert cos.shape == (n_h * n_w, head_dim // 2)
    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(1, 1, head_dim, generator=g), torch.randn(1, 1, head_dim, generator=g)

    def at(v, i, j):
        n = i * n_w + j
        return apply_rope_2d(v, cos[n:n + 1], sin[n:n + 1])[0, 0]

    assert torch.allclose(at(q, 3, 5).norm(), q.norm(), atol=1e-5)
    assert torch.allclose(at(q, 0, 0), q[0, 0])  # position (0, 0) is the identity
    base = at(q, 1, 2) @ at(k, 3, 1)
    assert torch.allclose(base, at(q, 3, 5) @ at(k, 5, 4), atol=1e-4)  # both shifted by (2, 3)
    assert not torch.allclose(base, at(q, 1, 2) @ at(k, 1, 3), atol=1e-3)
    row_only, col_only = at(q, 2, 0) @ at(k, 0, 0), at(q, 0, 2) @ at(k, 0, 0)
    assert not torch.allclose(row_only, col_only, atol=1e-3)  # rows and columns rotate different slots


def test_span_embedding_layout(tower):
    pixels, plan = preprocess(noise(250, 130, seed=2), TINY)
    with torch.no_grad():
        span = encode_image_span(tower.vision, tower.aligner, tower.image_start, tower.image_newline,
                                 tower.image_end, pixels, plan)
        rows = tower.aligner(tower.vision(pixels, plan.n_h, plan.n_w), plan.n_h, plan.n_w)
    assert span.shape == (plan.n_tokens, TINY_DIM)
    image_row = 0
    for slot, kind in enumerate(span_layout(plan)):
        if kind == "image":
            assert torch.equal(span[slot], rows[image_row])
            image_row += 1
        else:
            assert torch.equal(span[slot], getattr(tower, f"image_{kind}").detach())
    assert image_row == plan.n_llm_h * plan.n_llm_w


def test_state_dict_names_match_the_checkpoint(tower):
    got = {k: tuple(v.shape) for k, v in tower.state_dict().items()}
    assert got == vision_shapes(TINY, TINY_DIM)
    assert sum(p.numel() for p in tower.parameters()) == vision_param_count(TINY, TINY_DIM)


def test_v41_flash_vision_census():
    with torch.device("meta"):
        vit, aligner = VisionTransformer(FULL), Aligner(FULL, 5120)
    counted = sum(p.numel() for p in [*vit.parameters(), *aligner.parameters()]) + 3 * 5120
    assert counted == vision_param_count(FULL, 5120)
    assert 0.45e9 < counted < 0.55e9  # "vision ~0.5B" (ARCHITECTURE.md §5.3)
    shapes = vision_shapes(FULL, 5120)
    assert shapes["vision.patch_embed.proj.weight"] == (1024, 588)
    assert shapes["aligner.w1.weight"] == (5120, 9216)
    assert shapes["vision.blocks.31.mlp.w1.weight"] == (5632, 1024)


# ----------------------------------------------------------------------------- into the backbone

def test_image_inputs_scatter_and_count_check():
    ids = torch.tensor([[5, 9, 9, 9, 6, 9, 9]])
    a, b = torch.ones(3, 4), torch.full((2, 4), 2.0)
    embeds, mask = image_inputs(ids, 9, [a, b])
    assert mask.tolist() == [[False, True, True, True, False, True, True]]
    assert embeds[0, 1:4].eq(1).all() and embeds[0, 5:].eq(2).all() and embeds[0, 0].eq(0).all()
    with pytest.raises(ImageError, match="image slots"):
        image_inputs(ids, 9, [a])


def test_an_image_changes_the_model_output(tower):
    from model.loading import build, stand_in_token_map

    args = ModelArgs.preset("tiny")
    model = build(args, seed=0).eval()
    model.bind_token_map(stand_in_token_map(args))
    spans = []
    for seed in (1, 2):
        pixels, plan = preprocess(noise(126, 126, seed=seed), TINY)
        with torch.no_grad():
            spans.append(encode_image_span(tower.vision, tower.aligner, tower.image_start,
                                           tower.image_newline, tower.image_end, pixels, plan))
    ids = torch.tensor([[0, 17, 33] + [args.image_token_id] * plan.n_tokens + [44, 55]])
    outs = []
    with torch.no_grad():
        for span in (spans[0], spans[1], spans[0]):
            embeds, mask = image_inputs(ids, args.image_token_id, [span])
            outs.append(model(ids, image_embeds=embeds, image_mask=mask))
    assert torch.equal(outs[0], outs[2])  # deterministic
    # causal: text before the image is unchanged up to float noise (row blocking of the matmuls)
    assert (outs[0][:, :3] - outs[1][:, :3]).abs().max() < 1e-3
    assert not torch.allclose(outs[0][:, -1], outs[1][:, -1])  # the image reaches later tokens


def test_patch_attention_is_softmax_attention_over_every_patch():
    """The ViT's attention (the SDPA fallback here) is plain bidirectional softmax attention
    per head with scale hd^-1/2, on (patches, heads, hd) tensors."""
    from model.vision import patch_attention

    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(7, 3, 16, generator=g, dtype=torch.float64) for _ in range(3))
    want = torch.einsum("hnm,mhd->nhd", (torch.einsum("nhd,mhd->hnm", q, k) / 4).softmax(-1), v)
    torch.testing.assert_close(patch_attention(q, k, v), want)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_flash_attn_patch_attention_matches_sdpa(monkeypatch):
    """flash-attn's kernel, where installed, gives the SDPA fallback's result (bf16)."""
    import model.vision as vision

    if vision.flash_attn_func is None:
        pytest.skip("flash-attn is not installed")
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(300, 16, 64, generator=g, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    flash = vision.patch_attention(q, k, v)
    monkeypatch.setenv("DSAGENT_FLASH", "0")
    torch.testing.assert_close(flash, vision.patch_attention(q, k, v), rtol=2e-2, atol=2e-2)


def test_a_bf16_model_encodes_an_image() -> None:
    """Loaded in bf16 (as on CUDA), the tower's and aligner's Linear biases follow the model's
    dtype (only the router's biases stay fp32), so a picture encodes."""
    from model.loading import build

    model = build(ModelArgs.preset("tiny"), seed=0, dtype=torch.bfloat16).eval()
    span = model.encode_image(noise(40, 30))
    assert span.dtype == torch.bfloat16 and torch.isfinite(span.float()).all()
