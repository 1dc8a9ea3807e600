"""The image input path of DeepSeek-V4.1-Flash (ARCHITECTURE.md §2.12): bytes to a span
of embeddings the backbone reads in place of its image-placeholder tokens.

Reads in the order data flows:

1. ``decode_image`` — the one gate every image passes (``dsagent run --image``, the
   chat's ``/image``, tool results): untrusted bytes become an 8-bit RGB ``PIL.Image``
   or an :class:`ImageError` whose message says what to do. Transparent pixels are
   composited on white (the reference processors drop alpha, which turns transparent
   areas into whatever colour the encoder left there, often black); opaque images are
   unaffected. 16-bit and float images are scaled to 8 bits; animations keep frame 0;
   EXIF orientation is applied.
2. ``plan_image`` / ``preprocess`` — the resize plan of the reference processors:
   upscale to ``min_pixels``, round sides up to whole patches, shrink (closed form)
   until the span fits ``max_image_tokens``, aspect-fit bicubic resize, gray-127
   centred padding, normalise to [-1, 1], cut into row-major patches.
3. ``VisionTransformer`` (ViT with 2-D RoPE) and ``Aligner`` (3x3 pixel-unshuffle + MLP).
4. ``encode_image_span`` — the span [start, (image x n_llm_w, newline) x n_llm_h, end].

Module and parameter names are the checkpoint's (``vision.*``, ``aligner.*``,
``image_start/newline/end``) once attached to the Transformer under those attribute
names. Does not own: placeholder expansion in the token stream, ``bias_vl`` routing
and Engram dead positions (the Transformer's ``image_mask``), or image storage and
hashing into KV chain keys (``sessions``). Never imports ``dsagent``, ``sessions`` or
``tools``; ``model.model`` may import this file, so this file never imports it.
"""
from __future__ import annotations

import hashlib
import io
import math
import os
import warnings
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image, ImageOps, UnidentifiedImageError
from torch import nn

try:  # the optional extra `flash`: its kernel runs the ViT's attention on CUDA where it is installed
    from flash_attn import flash_attn_func
except (ImportError, OSError):  # not installed, or built against another torch
    flash_attn_func = None

from model.args import ConfigError, VisionArgs

FORMATS = ("PNG", "JPEG", "GIF", "WEBP", "BMP", "TIFF")  # decoders we let untrusted bytes reach
PAD_GRAY = 127  # padding colour of the reference processors
ALPHA_BACKGROUND = (255, 255, 255)  # what transparent pixels are composited on
MAX_SIDE = 32768  # longest side accepted by decode_image


class ImageError(ValueError):
    """An image that cannot be used; the message says why and what to do."""


def image_sha256(data: bytes) -> str:
    """The content key of an image: hex SHA-256 of its original bytes."""
    return hashlib.sha256(data).hexdigest()


# ----------------------------------------------------------------------------- decoding

def decode_image(data: bytes, *, max_bytes: int = 20_000_000, max_pixels: int = 50_000_000,
                 max_side: int = MAX_SIDE) -> Image.Image:
    """Untrusted bytes -> a fully decoded 8-bit RGB image, or ImageError.

    The limits are checked from the header before any pixel is decoded. PIL's own
    decompression-bomb guard (``Image.MAX_IMAGE_PIXELS``, left untouched) also refuses,
    so a ``max_pixels`` above it is capped there."""
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise ImageError(f"an image must be given as bytes, not {type(data).__name__}")
    if len(data) == 0:
        raise ImageError("the image is empty; attach a PNG, JPEG, GIF, WebP, BMP or TIFF file")
    if len(data) > max_bytes:
        raise ImageError(f"the image file is {len(data):,} bytes, over the {max_bytes:,}-byte limit; "
                         "send a smaller or more compressed file")
    img = _open_checked(bytes(data), max_pixels, max_side)
    try:
        img = ImageOps.exif_transpose(img)
    except (OSError, ValueError, SyntaxError) as e:
        raise ImageError(f"the image's EXIF orientation is corrupt ({e}); re-save the image") from None
    return to_rgb(img)


def _open_checked(data: bytes, max_pixels: int, max_side: int) -> Image.Image:
    """Header, our own size limits (before any pixel is decoded), then a full load."""
    with warnings.catch_warnings():
        warnings.simplefilter("error", Image.DecompressionBombWarning)
        try:
            img = Image.open(io.BytesIO(data), formats=FORMATS)
            _check_size(img.size, max_pixels, max_side)
            img.seek(0)  # animations: the first frame only
            img.load()
        except ImageError:
            raise
        except (Image.DecompressionBombError, Image.DecompressionBombWarning):
            raise ImageError(_too_many_pixels(None, max_pixels)) from None
        except UnidentifiedImageError:
            raise ImageError("this is not an image (or not a supported format); attach a PNG, JPEG, "
                             "GIF, WebP, BMP or TIFF file") from None
        except (OSError, SyntaxError, ValueError, EOFError, IndexError, MemoryError) as e:
            raise ImageError(f"the image could not be decoded ({e}); it is truncated or corrupt — "
                             "re-save or re-download it") from None
    return img


def _check_size(size: tuple[int, int], max_pixels: int, max_side: int) -> None:
    w, h = size
    if w <= 0 or h <= 0:
        raise ImageError(f"the image has an empty size {w}x{h}")
    if max(w, h) > max_side:
        raise ImageError(f"the image is {w}x{h}; sides over {max_side} pixels are refused — scale it down")
    if w * h > max_pixels:
        raise ImageError(_too_many_pixels(size, max_pixels))


def _too_many_pixels(size: tuple[int, int] | None, max_pixels: int) -> str:
    what = f"{size[0]}x{size[1]} = {size[0] * size[1]:,} pixels" if size else "too many pixels"
    return (f"the image declares {what}, over the {max_pixels:,}-pixel limit (a decompression-bomb "
            "guard); scale it down")


def to_rgb(img: Image.Image) -> Image.Image:
    """Any decoded PIL mode -> 8-bit RGB: deep modes scaled, alpha composited on white."""
    try:
        if img.mode in ("I;16", "I;16L", "I;16B", "I;16N", "I", "F"):
            img = _deep_to_l(img)
        if img.mode == "P" or "transparency" in img.info:
            img = img.convert("RGBA")
        if img.mode in ("RGBA", "LA", "PA", "RGBa", "La"):
            img = _composite(img.convert("RGBA"))
        return img if img.mode == "RGB" else img.convert("RGB")
    except (ValueError, OSError) as e:
        raise ImageError(f"the image's colour mode {img.mode!r} cannot be converted to RGB ({e}); "
                         "re-save it as an RGB PNG or JPEG") from None


def _deep_to_l(img: Image.Image) -> Image.Image:
    """16/32-bit integer images are read as 16-bit (0..65535); float as 0..1 if it fits, else 0..255."""
    arr = np.nan_to_num(np.asarray(img, dtype=np.float64))
    if img.mode == "F":
        arr = arr * 255.0 if arr.size and arr.max() <= 1.0 else arr
    else:
        arr = arr / 257.0
    return Image.fromarray(np.clip(np.rint(arr), 0, 255).astype(np.uint8), "L")


def _composite(rgba: Image.Image) -> Image.Image:
    background = Image.new("RGBA", rgba.size, ALPHA_BACKGROUND + (255,))
    return Image.alpha_composite(background, rgba).convert("RGB")


# ----------------------------------------------------------------------------- plan

@dataclass(frozen=True)
class ImagePlan:
    """Where an image of a given size goes: its resized content inside a padded canvas of
    whole patches, the ViT patch grid, and the LLM token grid after the aligner."""

    width: int  # resized content (before padding)
    height: int
    canvas_width: int  # padded canvas, multiples of patch_size
    canvas_height: int
    left: int  # content offset inside the canvas
    top: int
    n_h: int  # ViT patch grid
    n_w: int
    n_llm_h: int  # LLM token grid = ceil(n_vit / downsample_ratio)
    n_llm_w: int
    stretched: bool  # max_wh_ratio squeeze: content fills the canvas, aspect not kept

    @property
    def n_patches(self) -> int:
        return self.n_h * self.n_w

    @property
    def n_tokens(self) -> int:
        """Span length: n_llm_h rows of (n_llm_w image tokens + newline), plus start and end."""
        return self.n_llm_h * (self.n_llm_w + 1) + 2


def plan_image(width: int, height: int, vargs: VisionArgs) -> ImagePlan:
    """The resize plan for an original ``width`` x ``height`` image (§2.12)."""
    if width <= 0 or height <= 0:
        raise ImageError(f"cannot plan an image of size {width}x{height}")
    _check_vision_args(vargs)
    box_h, box_w = _plan_box(width, height, vargs)
    stretched = vargs.max_wh_ratio is not None and width >= vargs.max_wh_ratio * height
    fit_h, fit_w = (box_h, box_w) if stretched else _contain(height, width, box_h, box_w)
    p = vargs.patch_size
    n_llm_h, n_llm_w = _llm_grid(box_h, box_w, vargs)
    return ImagePlan(width=fit_w, height=fit_h, canvas_width=box_w, canvas_height=box_h,
                     left=round((box_w - fit_w) * 0.5), top=round((box_h - fit_h) * 0.5),
                     n_h=box_h // p, n_w=box_w // p, n_llm_h=n_llm_h, n_llm_w=n_llm_w, stretched=stretched)


def _check_vision_args(v: VisionArgs) -> None:
    if v.patch_size <= 0 or v.downsample_ratio <= 0 or v.min_pixels <= 0:
        raise ConfigError("vision_config: patch_size, downsample_ratio and min_pixels must be positive")
    if v.max_image_tokens < 4:
        raise ConfigError(f"vision_config field 'max_image_tokens': {v.max_image_tokens} < 4 cannot hold one row")
    if v.max_wh_ratio is not None and v.max_wh_ratio <= 0:
        raise ConfigError("vision_config field 'max_wh_ratio': must be positive or null")


def _llm_grid(box_h: int, box_w: int, v: VisionArgs) -> tuple[int, int]:
    p, r = v.patch_size, v.downsample_ratio
    return math.ceil((box_h // p) / r), math.ceil((box_w // p) / r)


def _span_tokens(box_h: int, box_w: int, v: VisionArgs) -> int:
    n_llm_h, n_llm_w = _llm_grid(box_h, box_w, v)
    return n_llm_h * (n_llm_w + 1) + 2


def _plan_box(width: float, height: float, v: VisionArgs) -> tuple[int, int]:
    """Canvas (h, w): ratio clamp, upscale to min_pixels, round up to patches, token cap."""
    if v.max_wh_ratio is not None and width > height * v.max_wh_ratio:
        width = height * v.max_wh_ratio
    if width * height < v.min_pixels:
        scale = (v.min_pixels / (width * height)) ** 0.5
        width, height = int(width * scale), int(height * scale)
    p = v.patch_size
    box_h, box_w = math.ceil(height / p) * p, math.ceil(width / p) * p
    if _span_tokens(box_h, box_w, v) > v.max_image_tokens:
        box_h, box_w = _shrink(height, width, v)
    if _span_tokens(box_h, box_w, v) > v.max_image_tokens:
        raise ImageError(f"no resize of a {width}x{height} image fits {v.max_image_tokens} image tokens")
    return box_h, box_w


def _shrink(height: float, width: float, v: VisionArgs) -> tuple[int, int]:
    """The reference's closed form: the largest aspect-keeping grid with
    n_llm_h * (n_llm_w + 1) + 2 <= max_image_tokens (one row or column at the extremes)."""
    ratio, cap, p = height / width, v.max_image_tokens, v.patch_size
    cell = p * v.downsample_ratio
    max_w = math.sqrt((cap - 2) / ratio + 0.25) - 0.5
    max_h = max_w * ratio
    if max_w < 1.0:
        return (cap - 2) // 2 * cell, cell
    if max_h < 1.0:
        return cell, (cap - 3) * cell
    beta = min(math.floor(max_w) * cell / width, math.floor(max_h) * cell / height)
    return math.floor(height * beta / p) * p, math.floor(width * beta / p) * p


def _contain(height: int, width: int, box_h: int, box_w: int) -> tuple[int, int]:
    """Aspect fit inside the box with PIL ``ImageOps.contain`` rounding; never a 0 side
    (a 10000:1 strip would otherwise round to nothing)."""
    if width / height > box_w / box_h:
        return max(1, round(height / width * box_w)), box_w
    if width / height < box_w / box_h:
        return box_h, max(1, round(width / height * box_h))
    return box_h, box_w


def preprocess(img: Image.Image, vargs: VisionArgs) -> tuple[torch.Tensor, ImagePlan]:
    """RGB image -> (patches [n_h*n_w, 3, p, p] float32 in [-1, 1], row-major; plan)."""
    img = img if img.mode == "RGB" else to_rgb(img)
    plan = plan_image(img.width, img.height, vargs)
    canvas = render(img, plan)
    x = torch.from_numpy(np.asarray(canvas, dtype=np.float32) / 255.0).permute(2, 0, 1)  # (3, H, W)
    x = (x - 0.5) / 0.5
    p = vargs.patch_size
    patches = x.reshape(3, plan.n_h, p, plan.n_w, p).permute(1, 3, 0, 2, 4)  # (n_h, n_w, 3, p, p)
    return patches.reshape(plan.n_patches, 3, p, p).contiguous(), plan


def render(img: Image.Image, plan: ImagePlan) -> Image.Image:
    """The padded canvas: bicubic aspect-fit resize, centred on gray 127."""
    size = (plan.canvas_width, plan.canvas_height)
    if plan.stretched:
        return img.resize(size, Image.Resampling.BICUBIC)
    content = img.resize((plan.width, plan.height), Image.Resampling.BICUBIC)
    canvas = Image.new("RGB", size, (PAD_GRAY,) * 3)
    canvas.paste(content, (plan.left, plan.top))
    return canvas


# ----------------------------------------------------------------------------- span layout

SLOT_START, SLOT_IMAGE, SLOT_NEWLINE, SLOT_END = "start", "image", "newline", "end"


def span_length(plan: ImagePlan) -> int:
    return plan.n_tokens


def expand_spans(seq: list, positions: list[int], lengths: list[int], fill) -> tuple[list, list[int]]:
    """``seq`` with the item at each of ``positions`` (image placeholders, ascending) replaced
    by ``lengths[i]`` copies of ``fill``; returns the new list and where each span starts."""
    out: list = []
    starts: list[int] = []
    last = 0
    for pos, n in zip(positions, lengths, strict=True):
        out += seq[last:pos]
        starts.append(len(out))
        out += [fill] * n
        last = pos + 1
    return out + list(seq[last:]), starts


def span_layout(plan: ImagePlan) -> list[str]:
    """Slot kinds of the span in order: start, rows of (image x n_llm_w, newline), end."""
    row = [SLOT_IMAGE] * plan.n_llm_w + [SLOT_NEWLINE]
    return [SLOT_START] + row * plan.n_llm_h + [SLOT_END]


# ----------------------------------------------------------------------------- ViT

class VisionRMSNorm(nn.Module):
    """The ViT's RMSNorm: fp32 weight, normalise and scale in fp32, one rounding at the end
    (the backbone's ``model.layer.RMSNorm`` rounds before scaling)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim, dtype=torch.float32))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return (self.weight.float() * h).to(x.dtype)


def vision_rope(n_h: int, n_w: int, head_dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [n_h*n_w, head_dim/2] of the 2-D RoPE: angles [row*f, col*f] over
    head_dim/4 frequencies of a head_dim/2-wide rope dim; patches in row-major order."""
    half = head_dim // 2
    inv_freq = 1.0 / (theta ** (torch.arange(0, half, 2, dtype=torch.float32) / half))
    rows = torch.arange(n_h, dtype=torch.float32).repeat_interleave(n_w)
    cols = torch.arange(n_w, dtype=torch.float32).repeat(n_h)
    angles = torch.cat([rows[:, None] * inv_freq, cols[:, None] * inv_freq], dim=-1)  # (N, half)
    return angles.cos(), angles.sin()


def apply_rope_2d(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half in fp32: channel i pairs with i + head_dim/2. x (N, H, hd); cos/sin (N, hd/2)."""
    x1, x2 = x.float().chunk(2, dim=-1)
    cos, sin = cos[:, None], sin[:, None]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)


class PatchEmbed(nn.Module):
    def __init__(self, vargs: VisionArgs):
        super().__init__()
        self.proj = nn.Linear(3 * vargs.patch_size ** 2, vargs.hidden_size)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        return self.proj(pixels.flatten(1))  # (N, 3*p*p) -> (N, C)


class VisionAttention(nn.Module):
    """Full bidirectional attention over the patches of one image, fused qkv with bias."""

    def __init__(self, vargs: VisionArgs):
        super().__init__()
        self.n_heads = vargs.num_attention_heads
        self.head_dim = vargs.hidden_size // vargs.num_attention_heads
        self.wqkv = nn.Linear(vargs.hidden_size, 3 * vargs.hidden_size)
        self.wo = nn.Linear(vargs.hidden_size, vargs.hidden_size)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        n = x.shape[0]
        q, k, v = self.wqkv(x).view(n, 3, self.n_heads, self.head_dim).unbind(1)  # each (N, H, hd)
        q, k = apply_rope_2d(q, cos, sin), apply_rope_2d(k, cos, sin)
        return self.wo(patch_attention(q, k, v).reshape(n, -1))


def patch_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Bidirectional softmax attention of one image's patches, (N, heads, hd) each, scale
    hd^-1/2: flash-attn's kernel where it is installed and takes the inputs (CUDA, fp16 /
    bf16, hd <= 256; ``DSAGENT_FLASH=0`` turns it off), else torch SDPA — the same function.
    (The text model's attention does not fit flash-attn: 512-dim heads and a sink logit.)"""
    if (flash_attn_func is not None and q.is_cuda and q.dtype in (torch.float16, torch.bfloat16)
            and q.shape[-1] <= 256 and os.environ.get("DSAGENT_FLASH", "1") != "0"):
        return flash_attn_func(q[None], k[None], v[None])[0]
    o = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1))
    return o.transpose(0, 1)


class VisionMLP(nn.Module):
    def __init__(self, vargs: VisionArgs):
        super().__init__()
        self.w1 = nn.Linear(vargs.hidden_size, 2 * vargs.intermediate_size, bias=False)
        self.w2 = nn.Linear(vargs.intermediate_size, vargs.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.w1(x).chunk(2, dim=-1)
        return self.w2(F.silu(gate) * up)


class VisionBlock(nn.Module):
    def __init__(self, vargs: VisionArgs):
        super().__init__()
        self.norm1 = VisionRMSNorm(vargs.hidden_size, vargs.rms_norm_eps)
        self.attn = VisionAttention(vargs)
        self.norm2 = VisionRMSNorm(vargs.hidden_size, vargs.rms_norm_eps)
        self.mlp = VisionMLP(vargs)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), cos, sin)
        return x + self.mlp(self.norm2(x))


class VisionTransformer(nn.Module):
    """Patches of one image (N = n_h*n_w, row-major) -> features (N, hidden_size)."""

    def __init__(self, vargs: VisionArgs):
        super().__init__()
        if vargs.hidden_size % vargs.num_attention_heads or (vargs.hidden_size // vargs.num_attention_heads) % 4:
            raise ConfigError("vision_config: hidden_size / num_attention_heads must be a multiple of 4 (2-D RoPE)")
        self.vargs = vargs
        self.patch_embed = PatchEmbed(vargs)
        self.blocks = nn.ModuleList([VisionBlock(vargs) for _ in range(vargs.num_hidden_layers)])
        self.norm = VisionRMSNorm(vargs.hidden_size, vargs.rms_norm_eps)

    def forward(self, pixels: torch.Tensor, n_h: int, n_w: int) -> torch.Tensor:
        assert pixels.shape[0] == n_h * n_w, (pixels.shape, n_h, n_w)
        x = self.patch_embed(pixels.to(self.patch_embed.proj.weight.dtype))
        head_dim = self.vargs.hidden_size // self.vargs.num_attention_heads
        cos, sin = (t.to(x.device) for t in vision_rope(n_h, n_w, head_dim, self.vargs.rope_theta))
        for block in self.blocks:
            x = block(x, cos, sin)
        return self.norm(x)


# ----------------------------------------------------------------------------- aligner

def pixel_unshuffle(x: torch.Tensor, n_h: int, n_w: int, r: int) -> torch.Tensor:
    """(n_h*n_w, C) row-major grid -> (ceil(n_h/r)*ceil(n_w/r), C*r*r), zero-padded to
    multiples of r; feature index = channel*r*r + ky*r + kx, cells in reading order."""
    grid = x.view(n_h, n_w, -1).permute(2, 0, 1)  # (C, n_h, n_w)
    grid = F.pad(grid, (0, -n_w % r, 0, -n_h % r))
    return F.unfold(grid.unsqueeze(0), r, stride=r).squeeze(0).transpose(0, 1)


class Aligner(nn.Module):
    """ViT features -> LLM embeddings: 3x3 pixel-unshuffle, w1 (bias) -> GELU -> w2 (bias)."""

    def __init__(self, vargs: VisionArgs, dim: int):
        super().__init__()
        self.ratio = vargs.downsample_ratio
        self.w1 = nn.Linear(vargs.hidden_size * self.ratio ** 2, dim)
        self.w2 = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor, n_h: int, n_w: int) -> torch.Tensor:
        x = pixel_unshuffle(x, n_h, n_w, self.ratio)  # (n_llm_h*n_llm_w, C*r*r)
        return self.w2(F.gelu(self.w1(x.to(self.w1.weight.dtype))))


# ----------------------------------------------------------------------------- span

def encode_image_span(vision: VisionTransformer, aligner: Aligner, image_start: torch.Tensor,
                      image_newline: torch.Tensor, image_end: torch.Tensor, pixels: torch.Tensor,
                      plan: ImagePlan) -> torch.Tensor:
    """The span's embeddings [n_tokens, dim] in reading order (see ``span_layout``)."""
    feats = vision(pixels, plan.n_h, plan.n_w)
    rows = aligner(feats, plan.n_h, plan.n_w)  # (n_llm_h*n_llm_w, D)
    dim = rows.shape[-1]
    grid = rows.view(plan.n_llm_h, plan.n_llm_w, dim)
    newline = image_newline.to(rows.dtype).expand(plan.n_llm_h, 1, dim)
    body = torch.cat([grid, newline], dim=1).reshape(-1, dim)
    return torch.cat([image_start.to(rows.dtype)[None], body, image_end.to(rows.dtype)[None]], dim=0)


def image_inputs(input_ids: torch.Tensor, image_token_id: int,
                 spans: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Scatter spans (each [n_tokens, D], in order of appearance, batch rows in order) onto
    the placeholder positions of ``input_ids`` [B, S]: (image_embeds [B, S, D], image_mask [B, S])."""
    mask = input_ids == image_token_id
    n_slots, n_span = int(mask.sum()), sum(s.shape[0] for s in spans)
    if n_slots != n_span:
        raise ImageError(f"the token stream has {n_slots} image slots but the images fill {n_span}; "
                         "expand each placeholder to span_length(plan) tokens")
    dim = spans[0].shape[-1] if spans else 1
    dtype = spans[0].dtype if spans else torch.float32
    embeds = torch.zeros(*input_ids.shape, dim, dtype=dtype, device=input_ids.device)
    if spans:
        embeds[mask] = torch.cat(spans).to(input_ids.device)
    return embeds, mask


# ----------------------------------------------------------------------------- census

def vision_shapes(vargs: VisionArgs, dim: int) -> dict[str, tuple[int, ...]]:
    """Official name -> shape of every vision tensor (ViT, aligner, span vectors)."""
    c, i, p2 = vargs.hidden_size, vargs.intermediate_size, 3 * vargs.patch_size ** 2
    a_in = c * vargs.downsample_ratio ** 2
    shapes = {"vision.patch_embed.proj.weight": (c, p2), "vision.patch_embed.proj.bias": (c,)}
    for b in range(vargs.num_hidden_layers):
        pre = f"vision.blocks.{b}."
        shapes.update({pre + "norm1.weight": (c,), pre + "attn.wqkv.weight": (3 * c, c),
                       pre + "attn.wqkv.bias": (3 * c,), pre + "attn.wo.weight": (c, c),
                       pre + "attn.wo.bias": (c,), pre + "norm2.weight": (c,),
                       pre + "mlp.w1.weight": (2 * i, c), pre + "mlp.w2.weight": (c, i)})
    shapes.update({"vision.norm.weight": (c,), "aligner.w1.weight": (dim, a_in), "aligner.w1.bias": (dim,),
                   "aligner.w2.weight": (dim, dim), "aligner.w2.bias": (dim,),
                   "image_start": (dim,), "image_end": (dim,), "image_newline": (dim,)})
    return shapes


def vision_param_count(vargs: VisionArgs, dim: int) -> int:
    return sum(math.prod(s) for s in vision_shapes(vargs, dim).values())
