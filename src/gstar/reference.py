"""Ground truth and the CPU path (stage 1 of the nine-stage path).

``naive_attention`` materialises the whole score matrix: it is the oracle every test compares against,
written to be read in one screen. ``tiled_attention`` is FlashAttention in plain PyTorch (Q and KV tiles,
online softmax, a backward that recomputes probabilities from the saved LSE): the implementation that
``gstar.flash_attention`` runs on CPU tensors, with memory linear in the sequence length.
"""

from __future__ import annotations

import math

import torch

from .pattern import Pattern, kv_block_table, q_block_table


def naive_attention(q, k, v, *, causal=False, window=(-1, -1), sink_tokens=0, sinks=None, scale=None):
    """Attention by the definition of DESIGN.md section 1. Returns ``(out, lse)``.

    q: (B, Hq, Nq, D), k: (B, Hkv, Nk, D), v: (B, Hkv, Nk, Dv), sinks: (Hq,) or None.
    Matmuls run in the input dtype (this is "PyTorch's own error" of the correctness bar), softmax
    statistics in float32 (float64 for float64 inputs). out: (B, Hq, Nq, Dv), lse: (B, Hq, Nq) float32.
    """
    B, Hq, Nq, D = q.shape
    Hkv, Nk = k.shape[1], k.shape[2]
    scale = D ** -0.5 if scale is None else scale
    stat = torch.promote_types(q.dtype, torch.float32)
    visible = Pattern.make(Nq, Nk, causal=causal, window=window, sink_tokens=sink_tokens).mask(q.device)
    k = k.repeat_interleave(Hq // Hkv, dim=1)                          # (B, Hq, Nk, D)
    v = v.repeat_interleave(Hq // Hkv, dim=1)                          # (B, Hq, Nk, Dv)
    s = (q @ k.transpose(-1, -2)).to(stat) * scale                     # (B, Hq, Nq, Nk)
    s = s.masked_fill(~visible, -math.inf)
    if sinks is not None:
        sink_col = sinks.to(stat).view(1, Hq, 1, 1).expand(B, Hq, Nq, 1)
        s = torch.cat([s, sink_col], dim=-1)                           # (B, Hq, Nq, Nk + 1)
    m = s.amax(dim=-1, keepdim=True).detach()                          # (B, Hq, Nq, 1)
    m = torch.where(torch.isinf(m), torch.zeros_like(m), m)           # empty rows: avoid -inf - -inf
    e = torch.exp(s - m)
    den = e.sum(dim=-1, keepdim=True)                                  # (B, Hq, Nq, 1)
    nonempty = den > 0
    p = e[..., :Nk] / torch.where(nonempty, den, torch.ones_like(den))
    lse = torch.where(nonempty, m + torch.log(torch.where(nonempty, den, torch.ones_like(den))), -math.inf)
    out = p.to(v.dtype) @ v                                            # (B, Hq, Nq, Dv)
    return out, lse.squeeze(-1).to(torch.promote_types(stat, torch.float32))
