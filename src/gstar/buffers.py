"""Allocation of every output buffer (the kernels' and the PyTorch path's).

Every buffer a kernel writes is allocated here, so that tests can poison it: with ``GSTAR_POISON=1`` in
the environment (the test suite's ``conftest.py`` sets it) outputs start as NaN instead of uninitialised
memory, and any element a kernel forgets to write fails the comparison with the reference.
"""

import os

import torch

POISON = os.environ.get("GSTAR_POISON", "0") == "1"


def empty_like(t: torch.Tensor, dtype=None, width: int | None = None) -> torch.Tensor:
    """``torch.empty_like`` (keeps ``t``'s memory layout), NaN-filled under ``GSTAR_POISON=1``; with ``width``,
    that many columns in the last dim (the output of values narrower or wider than the queries)."""
    out = layout_like(t, dtype, width)
    return out.fill_(float("nan")) if POISON else out


def layout_like(t: torch.Tensor, dtype=None, width: int | None = None) -> torch.Tensor:
    """An uninitialised tensor shaped like ``t`` but ``width`` columns wide (default: ``t``'s), whose dims lie
    in memory in ``t``'s order with a unit last stride: ``torch.empty_like`` when the width is ``t``'s. The
    operators' fake implementations call it too, so that compiled graphs see the strides eager mode gives."""
    if width is None or width == t.shape[-1]:
        return torch.empty_like(t, dtype=dtype)
    # the dim order torch.empty_like would give (t's own, or row-major where t is not dense), outermost first
    # (ties keep the dim order); the last dim stays innermost whatever its stride
    strides = torch.empty_like(t, device="meta").stride()
    outer = sorted(range(t.dim() - 1), key=lambda d: -strides[d])
    return torch.empty_permuted((*t.shape[:-1], width), (*outer, t.dim() - 1), dtype=dtype or t.dtype,
                                device=t.device)


def empty(shape, *, dtype, device) -> torch.Tensor:
    """A fresh contiguous buffer, NaN-filled under ``GSTAR_POISON=1``."""
    out = torch.empty(shape, dtype=dtype, device=device)
    return out.fill_(float("nan")) if POISON else out


def empty_packed_like(t: torch.Tensor, dtype=None, width: int | None = None) -> torch.Tensor:
    """For a heads-first view ``t`` (1, H, N, D) of a packed (N, H, D) tensor: the same view of a fresh
    contiguous (N, H, width) buffer (width defaults to D), whatever ``t``'s strides (packed outputs are
    always contiguous)."""
    _, H, N, D = t.shape
    return empty((N, H, width or D), dtype=dtype or t.dtype, device=t.device).transpose(0, 1).unsqueeze(0)
