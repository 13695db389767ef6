"""Conversions between padded batches and the packed layout of :func:`gstar.flash_attention_varlen`.

Two ways data arrives for packed attention:

- a padded batch ``(B, N, ...)`` with a ``(B, N)`` 0/1 attention mask (left or right padding):
  :func:`cu_seqlens_from_mask` gives ``cu_seqlens`` and the ``indices`` of the real tokens, :func:`unpad`
  packs, and :func:`pad` scatters results back (zeros at padding);
- rows that already hold several documents, whose position ids restart at 0 for each document:
  :func:`cu_seqlens_from_position_ids`.

Every function validates its input and returns the maximum length as a Python int. These are
preprocessing steps: on CUDA each reads a few numbers back to the host (a device sync).
"""

from __future__ import annotations

import numbers

import torch


def _check_tensor(name: str, t, ndims: tuple[int, ...]):
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dim() not in ndims:
        wanted = " or ".join(str(n) for n in ndims)
        raise ValueError(f"{name} must have {wanted} dims, got shape {tuple(t.shape)}")


def _cumulative(lengths: torch.Tensor) -> torch.Tensor:
    """(num_seqs,) lengths -> (num_seqs + 1,) int32 offsets starting at 0."""
    zero = torch.zeros(1, dtype=torch.int32, device=lengths.device)
    return torch.cat([zero, lengths.cumsum(dim=0, dtype=torch.int32)])


def cu_seqlens_from_mask(attention_mask: torch.Tensor) -> tuple[torch.Tensor, int, torch.Tensor]:
    """Packing plan of a padded batch.

    Args:
        attention_mask: ``(B, N)`` with 1 (or True) at real tokens and 0 at padding; each row's real tokens
            must be one contiguous run (left or right padding; an all-padding row is a zero-length sequence).

    Returns:
        ``(cu_seqlens, max_seqlen, indices)``: ``cu_seqlens`` ``(B + 1,)`` int32 on the mask's device,
        ``max_seqlen`` the longest row as an int, and ``indices`` ``(total,)`` int64, the positions of the real
        tokens in the flattened ``(B * N)`` batch in row-major order (for :func:`unpad` and :func:`pad`).
    """
    _check_tensor("attention_mask", attention_mask, (2,))
    if attention_mask.is_complex():
        raise TypeError(f"attention_mask must be bool, integer or float, got {attention_mask.dtype}")
    m = attention_mask if attention_mask.dtype == torch.bool else attention_mask != 0
    B = m.shape[0]
    # a run of 1s starts where a 1 follows a 0 (or the row's start): more than one start means a hole
    starts = m.clone()
    starts[:, 1:] &= ~m[:, :-1]
    lengths = m.sum(dim=1, dtype=torch.int32)                                 # (B,)
    facts = torch.stack([
        ((attention_mask != 0) & (attention_mask != 1)).any().int(),
        (starts.sum(dim=1) > 1).any().int(),
        lengths.max().int() if B else torch.zeros((), dtype=torch.int32, device=m.device),
    ]).tolist()  # every check read back at once: one sync
    if facts[0]:
        raise ValueError("attention_mask must hold only 0 and 1")
    if facts[1]:
        row = int(torch.nonzero(starts.sum(dim=1) > 1)[0])
        raise ValueError(f"attention_mask must hold one contiguous run of 1s per row (left or right padding), "
                         f"row {row} has more")
    indices = torch.nonzero(m.flatten()).flatten()                           # (total,) int64
    return _cumulative(lengths), int(facts[2]), indices


def _check_indices(indices, device: torch.device):
    _check_tensor("indices", indices, (1,))
    if indices.dtype != torch.int64:
        raise TypeError(f"indices must have dtype torch.int64 (from cu_seqlens_from_mask), got {indices.dtype}")
    if indices.device != device:
        raise ValueError(f"indices must be on x's device {device}, got {indices.device}")


def unpad(x: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
    """Pack the real tokens of a padded batch: ``(B, N, ...)`` -> ``(total, ...)``, differentiable in ``x``.

    ``indices`` comes from :func:`cu_seqlens_from_mask` on the batch's ``(B, N)`` mask.
    """
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"x must be a torch.Tensor, got {type(x).__name__}")
    if x.dim() < 2:
        raise ValueError(f"x must have at least 2 dims (B, N, ...), got shape {tuple(x.shape)}")
    _check_indices(indices, x.device)
    return x.flatten(0, 1).index_select(0, indices)


def pad(x: torch.Tensor, indices: torch.Tensor, batch: int, seqlen: int) -> torch.Tensor:
    """Inverse of :func:`unpad`: ``(total, ...)`` -> ``(batch, seqlen, ...)`` with zeros at padding.

    Differentiable in ``x``. ``indices`` ``(total,)`` int64 from :func:`cu_seqlens_from_mask`.
    """
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"x must be a torch.Tensor, got {type(x).__name__}")
    if x.dim() < 1:
        raise ValueError(f"x must have at least 1 dim (total, ...), got shape {tuple(x.shape)}")
    _check_indices(indices, x.device)
    for name, n in (("batch", batch), ("seqlen", seqlen)):
        if not isinstance(n, numbers.Integral) or isinstance(n, bool) or n < 0:
            raise ValueError(f"{name} must be an int >= 0, got {n!r}")
    if indices.shape[0] != x.shape[0]:
        raise ValueError(f"indices must have one entry per row of x ({x.shape[0]}), got {indices.shape[0]}")
    out = x.new_zeros((batch * seqlen,) + tuple(x.shape[1:]))
    return out.index_copy(0, indices, x).unflatten(0, (batch, seqlen))


def cu_seqlens_from_position_ids(position_ids: torch.Tensor) -> tuple[torch.Tensor, int]:
    """Document boundaries of packed rows whose position ids restart at 0 for each document.

    Args:
        position_ids: ``(total,)`` or ``(1, total)`` integer ids, e.g. ``[0, 1, 2, 0, 0, 1]`` for documents
            of lengths 3, 1 and 2. Inside a document each id is the previous plus one.

    Returns:
        ``(cu_seqlens, max_seqlen)``: ``(num_docs + 1,)`` int32 on the ids' device and the longest document.
    """
    _check_tensor("position_ids", position_ids, (1, 2))
    if position_ids.dim() == 2 and position_ids.shape[0] != 1:
        raise ValueError(f"position_ids must be (total,) or (1, total), got shape {tuple(position_ids.shape)}")
    if position_ids.is_floating_point() or position_ids.is_complex() or position_ids.dtype == torch.bool:
        raise TypeError(f"position_ids must be an integer tensor, got {position_ids.dtype}")
    pos = position_ids.flatten()
    if pos.numel() == 0:
        return torch.zeros(1, dtype=torch.int32, device=pos.device), 0
    ok = (pos[1:] == 0) | (pos[1:] == pos[:-1] + 1)
    first, bad, top = torch.stack([pos[0].long(), (~ok).sum(), pos.max().long()]).tolist()
    if first != 0:
        raise ValueError(f"position_ids must start at 0, got {first}")
    if bad:
        raise ValueError("position_ids must restart at 0 for each document and grow by 1 inside it")
    starts = torch.nonzero(pos == 0).flatten()                                # (num_docs,)
    ends = torch.cat([starts[1:], starts.new_full((1,), pos.numel())])
    return _cumulative(ends - starts), int(top) + 1  # ids count up from 0 inside each document
