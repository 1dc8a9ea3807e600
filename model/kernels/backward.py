"""Closed-form backward passes for the per-token maps that training runs through
``model.kernels``: RoPE, RMSNorm and the mHC collapse / expand.

Each ``torch.autograd.Function`` here takes the forward as its first argument — the kernel
where it runs (CUDA with Triton), else the twin, called without autograd — and computes
its gradients in a handful of tensor operations. Autograd walking back through a twin
instead pays for every select, slice, cast and product the twin is spelt with (~2 launches
each way; on CUDA a training step is bound by launching them, not by the GPU), and a twin's
forward cannot be the kernel at all. Forward values are the kernel's or the twin's, unchanged;
gradients equal autograd's through the twin up to float rounding
(``tests/test_kernel_backward.py``). Does not own choosing kernel or twin
(``model.kernels``).
"""
from __future__ import annotations

import torch


class Rope(torch.autograd.Function):
    """y = rotate(x, cos, sin): a rotation of channel pairs, so dx = rotate(dy, cos, -sin)
    — the forward's own kernel (or twin) again; cos / sin take no gradient."""

    @staticmethod
    def forward(ctx, rotate, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        ctx.rotate = rotate
        ctx.save_for_backward(cos, sin)
        return rotate(x, cos, sin)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        cos, sin = ctx.saved_tensors
        return None, ctx.rotate(grad.contiguous(), cos, -sin), None, None


class RMSNorm(torch.autograd.Function):
    """y = weight · x̂ with x̂ = x · r, r = rsqrt(mean(x²) + eps) in fp32 (x̂ cast back to x's
    dtype): dx = r · (dx̂ − x̂ · mean(dx̂ · x̂)) with dx̂ = weight · dy, dweight = Σ dy · x̂."""

    @staticmethod
    def forward(ctx, norm, x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
        ctx.eps = eps
        ctx.save_for_backward(x, weight)
        return norm(x, weight, eps)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        x, weight = ctx.saved_tensors
        h = x.float()
        r = torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + ctx.eps)
        x_hat = h * r
        d_hat = (grad if weight is None else grad * weight).float()
        dx = (r * (d_hat - x_hat * (d_hat * x_hat).mean(-1, keepdim=True))).to(x.dtype)
        dweight = None
        if weight is not None and ctx.needs_input_grad[2]:
            dweight = (grad * x_hat.to(x.dtype)).reshape(-1, grad.shape[-1]).sum(0).to(weight.dtype)
        return None, dx, dweight, None


class HcCollapse(torch.autograd.Function):
    """out = Σ_k pre_k · streams_k (fp32, cast to the streams' dtype): dstreams_k = pre_k · dout,
    dpre_k = <streams_k, dout>."""

    @staticmethod
    def forward(ctx, collapse, streams: torch.Tensor, pre: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(streams, pre)
        return collapse(streams, pre)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        streams, pre = ctx.saved_tensors
        g = grad.float().unsqueeze(-2)  # [..., 1, D]
        dstreams = (pre.unsqueeze(-1) * g).to(streams.dtype) if ctx.needs_input_grad[1] else None
        dpre = (streams.float() * g).sum(-1).to(pre.dtype) if ctx.needs_input_grad[2] else None
        return None, dstreams, dpre


class HcExpand(torch.autograd.Function):
    """out_k = post_k · y + Σ_j comb_jk · residual_j (fp32, cast to the residual's dtype):
    dy = Σ_k post_k · dout_k, dpost_k = <y, dout_k>, dresidual_j = Σ_k comb_jk · dout_k,
    dcomb_jk = <residual_j, dout_k>."""

    @staticmethod
    def forward(ctx, expand, y: torch.Tensor, residual: torch.Tensor, post: torch.Tensor,
                comb: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(y, residual, post, comb)
        return expand(y, residual, post, comb)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        y, residual, post, comb = ctx.saved_tensors
        g = grad.float()  # [..., hc, D]
        need = ctx.needs_input_grad
        dy = (post.unsqueeze(-1) * g).sum(-2).to(y.dtype) if need[1] else None
        dresidual = torch.matmul(comb, g).to(residual.dtype) if need[2] else None
        dpost = (g * y.float().unsqueeze(-2)).sum(-1).to(post.dtype) if need[3] else None
        dcomb = torch.matmul(residual.float(), g.transpose(-1, -2)).to(comb.dtype) if need[4] else None
        return None, dy, dresidual, dpost, dcomb
