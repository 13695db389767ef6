"""Tensor descriptors (Hopper's TMA copy engine) for the kernels' dense ``(B, H, N, D)`` operands.

A descriptor load moves a whole tile in one instruction issued by one thread and zero-fills what lies past
the tensor's edges (keys past ``Nk``, head-dim lanes past ``D``), so the kernel spends no registers or
instructions on addresses and masks. The copy engine needs a 16-byte-aligned base, a unit last stride and
16-byte multiples for the other strides; operands that miss any of these (odd head dims in a ``(B, N, H, D)``
layout, broadcast heads with stride 0) keep the pointer path.
"""

from __future__ import annotations

import torch
from triton.tools.tensor_descriptor import TensorDescriptor


def supported(*tensors: torch.Tensor) -> bool:
    """Whether every one of these 4-d tensors can be read through a descriptor."""
    for t in tensors:
        if t.data_ptr() % 16 or t.stride(-1) != 1 or 0 in t.shape:
            return False
        if any(s <= 0 or s * t.element_size() % 16 for s in t.stride()[:-1]):
            return False
    return True


def tiles(t: torch.Tensor, block: tuple[int, int, int, int]) -> TensorDescriptor:
    """A descriptor over ``t`` (B, H, N, D) that moves ``block`` = (1, heads, rows, D_PAD) tiles."""
    return TensorDescriptor(t, list(t.shape), list(t.stride()), list(block))
