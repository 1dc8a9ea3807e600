"""An mHC site's input left for its reader's launch to make (a fused decode step's site
kernel with its dots beside, ``model.kernels.hc_site``).

Its own module so that the kernels that read one (``model.kernels.matvec``,
``model.kernels.moe``) need not import the package that launches them. Does not own the
site kernel (``model.kernels.streams``) nor the collapse itself (``model.kernels.hc_collapse``,
handed in).
"""
from __future__ import annotations

import torch


class Collapsed:
    """An mHC site's input before its norm, not yet made (:func:`hc_site` where the site's
    launches run beside, ``streams.DOTS_BESIDE``): the site's streams [..., hc, D] — first
    expanded by the site before's y [..., D], post [..., hc] and comb [..., hc, hc] where it
    has one — collapsed by ``pre`` [..., hc]. Its reader's launch makes it at the channels it
    reads (:func:`gemv`'s and :func:`moe_decode`'s kernels, with their ``norm``: the same
    products, sums and roundings as the site's own launch, so the same bits); any other
    reader takes :meth:`value`. ``expanded``: the streams the side stream's dots launch
    writes (what :meth:`value` collapses, once joined). Seen as a tensor of x's shape, dtype
    and device (:meth:`reshape` regroups its leading dims)."""

    def __init__(self, streams: torch.Tensor, pre: torch.Tensor, y: torch.Tensor | None, post: torch.Tensor | None,
                 comb: torch.Tensor | None, expanded: torch.Tensor, collapse):
        """``collapse``: the collapse that joins the side stream first (``model.kernels.hc_collapse``)."""
        self.streams, self.pre, self.y, self.post, self.comb, self.expanded = streams, pre, y, post, comb, expanded
        self.collapse = collapse
        self.shape = streams.shape[:-2] + streams.shape[-1:]

    dtype = property(lambda self: self.streams.dtype)
    device = property(lambda self: self.streams.device)
    is_cuda = property(lambda self: self.streams.is_cuda)

    def numel(self) -> int:
        return self.streams.numel() // self.streams.shape[-2]

    def reshape(self, *shape) -> "Collapsed":
        """The same input seen as ``shape`` (its last dim D; -1 allowed once)."""
        out = Collapsed(self.streams, self.pre, self.y, self.post, self.comb, self.expanded, self.collapse)
        out.shape = torch.Size(torch.empty(self.shape, device="meta").reshape(*shape).shape)
        assert out.shape[-1] == self.shape[-1], (shape, self.shape)
        return out

    def launch_args(self) -> tuple[torch.Tensor, dict]:
        """(rows [N, D]: a view of x's shape alone, neither read nor written; a reader kernel's
        arguments: the streams, pre, y, post, comb — y, post, comb the streams where there is no
        expand, unread then — and ``COLLAPSE_IN`` / ``C_EXPAND`` / ``C_HC``)."""
        s, expand = self.streams, self.y is not None
        y, post, comb = (self.y, self.post, self.comb) if expand else (s, s, s)
        rows = s.reshape(-1, s.shape[-2], s.shape[-1])[:, 0]
        return rows, dict(cs_ptr=s, cpre_ptr=self.pre, cy_ptr=y, cpost_ptr=post, ccomb_ptr=comb,
                          COLLAPSE_IN=True, C_EXPAND=expand, C_HC=s.shape[-2])

    def value(self) -> torch.Tensor:
        """x made: the expanded streams collapsed by pre (``collapse``, which joins the side
        stream first): the bits a reader's launch makes."""
        return self.collapse(self.expanded, self.pre).view(self.shape)
