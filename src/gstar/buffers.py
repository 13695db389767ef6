"""Allocation of every output buffer (the kernels' and the PyTorch path's).

Every buffer a kernel writes is allocated here, so that tests can poison it: with ``GSTAR_POISON=1`` in
the environment (the test suite's ``conftest.py`` sets it) outputs start as NaN instead of uninitialised
memory, and any element a kernel forgets to write fails the comparison with the reference.
"""

import os

import torch

POISON = os.environ.get("GSTAR_POISON", "0") == "1"


def empty_like(t: torch.Tensor, dtype=None) -> torch.Tensor:
    """``torch.empty_like`` (keeps ``t``'s memory layout), NaN-filled under ``GSTAR_POISON=1``."""
    out = torch.empty_like(t, dtype=dtype)
    return out.fill_(float("nan")) if POISON else out


def empty(shape, *, dtype, device) -> torch.Tensor:
    """A fresh contiguous buffer, NaN-filled under ``GSTAR_POISON=1``."""
    out = torch.empty(shape, dtype=dtype, device=device)
    return out.fill_(float("nan")) if POISON else out


def empty_packed_like(t: torch.Tensor, dtype=None) -> torch.Tensor:
    """For a heads-first view ``t`` (1, H, N, D) of a packed (N, H, D) tensor: the same view of a fresh
    contiguous (N, H, D) buffer, whatever ``t``'s strides (packed outputs are always contiguous)."""
    _, H, N, D = t.shape
    return empty((N, H, D), dtype=dtype or t.dtype, device=t.device).transpose(0, 1).unsqueeze(0)
