"""The oracle and the CPU path.

:func:`naive_attention` materialises the whole score matrix: it is the oracle every test compares against,
written to be read in one screen. :func:`tiled_forward` and :func:`tiled_backward` are FlashAttention in
plain PyTorch (Q and KV tiles, online softmax, a backward that recomputes probabilities from the saved
LSE): the backend that ``gstar.flash_attention`` runs on CPU tensors (``gstar.tiled_attention``), with
memory linear in the sequence length. This module imports neither the API nor the kernels.
"""

from __future__ import annotations

import math

import torch

from .buffers import empty_packed_like, layout_like
from .pattern import Pattern, capped_sinks, cdiv, kv_block_table, span_bounds


def naive_attention(q, k, v, *, causal=False, window=(-1, -1), sink_tokens=0, sinks=None, scale=None, softcap=0.0,
                    chunk=0, spans=None):
    """Attention by the definition of docs/design.md section 1, through the whole ``(Nq, Nk)`` score matrix:
    the oracle. Returns ``(out, lse)``.

    q: (B, Hq, Nq, D), k: (B, Hkv, Nk, D), v: (B, Hkv, Nk, Dv) with ``Hq % Hkv == 0``; sinks: (Hq,) or None.
    The keywords mean what they mean in :func:`gstar.flash_attention`: query ``i`` sits at
    ``p(i) = i + Nk - Nq`` and sees key ``j`` when ``j <= p(i)`` (causal), ``p(i) - left <= j <= p(i) + right``
    (window, ``-1`` unbounded) and ``j // chunk == p(i) // chunk`` (chunk, ``0`` none) with ``j < sink_tokens``
    exempt from the left bounds; the scores ``s = scale * q . k`` become ``softcap * tanh(s / softcap)`` (softcap,
    ``0.0`` none); ``sinks`` join every row's softmax denominator (clamped to +-:data:`gstar.pattern.SINK_LIMIT`);
    scale defaults to ``D ** -0.5``; ``spans`` (B, Nk): the keys' span ids (:func:`gstar.pattern.span_bounds`),
    a query seeing every key of its position's span.

    Matmuls run in the input dtype (this is "PyTorch's own error" of the correctness bar), softmax
    statistics in float32 (float64 for float64 inputs). out: (B, Hq, Nq, Dv) in the input dtype, zeros
    where a row sees no key; lse: (B, Hq, Nq) float32 (float64 for float64 inputs). Arguments are not
    validated, and memory grows as Nq * Nk: for tests and small inputs.
    """
    B, Hq, Nq, D = q.shape
    Hkv, Nk = k.shape[1], k.shape[2]
    scale = D ** -0.5 if scale is None else scale
    stat = torch.promote_types(q.dtype, torch.float32)
    spans = None if spans is None else span_bounds(spans)                           # (B, Nk, 2)
    visible = Pattern.make(Nq, Nk, causal=causal, window=window, sink_tokens=sink_tokens, chunk=chunk).mask(
        q.device, spans=spans)                                         # (Nq, Nk), or (B, Nq, Nk) with spans
    if spans is not None:
        visible = visible[:, None]                                     # (B, 1, Nq, Nk)
    k = k.repeat_interleave(Hq // Hkv, dim=1)                          # (B, Hq, Nk, D)
    v = v.repeat_interleave(Hq // Hkv, dim=1)                          # (B, Hq, Nk, Dv)
    s = (q @ k.transpose(-1, -2)).to(stat) * scale                     # (B, Hq, Nq, Nk)
    if softcap:
        s = softcap * torch.tanh(s / softcap)
    s = s.masked_fill(~visible, -math.inf)
    if sinks is not None:
        sink_col = capped_sinks(sinks.to(stat)).view(1, Hq, 1, 1).expand(B, Hq, Nq, 1)
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


TILE = 64  # rows and keys per tile of the PyTorch path; memory is O(TILE * N), never O(N^2)
GPU_TILE = 256  # on a GPU each tile step is a few kernel launches: larger tiles mean fewer of them


def _default_tile(t: torch.Tensor) -> int:
    return GPU_TILE if t.is_cuda else TILE


def _tiles(pattern: Pattern, tile: int, spans: torch.Tensor | None = None):
    """Yield ``(row_start, [(key_block, masked), ...])`` per Q tile, from the pattern's block table, widened by the
    span of the tile's last row in any sequence of the batch (``spans``: (B, Nk, 2), read here), which lifts the
    right bound."""
    bounds = None if spans is None else spans.tolist()
    for t, (sink_end, band_start, full_start, full_end, band_end) in enumerate(
            kv_block_table(pattern, tile, tile).tolist()):
        blocks = {b: True for b in range(sink_end)}
        blocks.update((b, not full_start <= b < full_end) for b in range(band_start, band_end))
        pmax = min((t + 1) * tile, pattern.nq) - 1 + pattern.offset
        if bounds is not None and pattern.right >= 0 and 0 <= pmax:  # masked blocks for the keys spans add
            for first, end in (seq[pmax] for seq in bounds):
                for b in range(first // tile, cdiv(end, tile) if end > first else 0):
                    blocks.setdefault(b, True)
        yield t * tile, sorted(blocks.items())


def _scores(pattern, q_t, k, r0, b, masked, scale, softcap, tile, spans=None):
    """Scores of one (Q tile, KV block) pair, scaled and soft-capped, -inf where the rule hides a key.

    q_t: (B, Hkv, G, bm, D) in the statistics dtype; spans: None or the keys' span bounds (B, Nk, 2); returns the
    scores (B, Hkv, G, bm, bn), the key slice, and the soft-cap's derivative ``1 - tanh^2`` beside the scores
    (None without one).
    """
    keys = slice(b * tile, min((b + 1) * tile, pattern.nk))
    s = q_t @ k[:, :, None, keys].to(q_t.dtype).transpose(-1, -2) * scale   # (B, Hkv, G, bm, bn)
    slope = None
    if softcap:
        t = torch.tanh(s / softcap)
        s, slope = softcap * t, 1 - t * t
    if masked:
        rows = torch.arange(r0, r0 + q_t.shape[3], device=q_t.device)[:, None]
        cols = torch.arange(keys.start, keys.stop, device=q_t.device)[None, :]
        visible = pattern.visible(rows, cols, spans=spans)                  # (bm, bn), or (B, bm, bn)
        s = s.masked_fill(~(visible if spans is None else visible[:, None, None]), -math.inf)
    return s, keys, slope


def _sequences(cu_seqlens, pattern: Pattern):
    """``(query rows, key rows, pattern)`` of each packed sequence; reads ``cu_seqlens`` on the host (a sequence's
    span bounds are ``spans[key rows]``, already relative to its start)."""
    cu_q, cu_k = (c.tolist() for c in cu_seqlens)
    for s in range(len(cu_q) - 1):
        rows, keys = slice(cu_q[s], cu_q[s + 1]), slice(cu_k[s], cu_k[s + 1])
        yield rows, keys, pattern.resized(rows.stop - rows.start, keys.stop - keys.start)


def tiled_forward(q, k, v, sinks, pattern: Pattern, scale: float, tile: int | None = None, *, softcap: float = 0.0,
                  cu_seqlens=None, spans=None):
    """Online-softmax forward over tiles. Shapes as in :func:`gstar.kernels.attention_forward`.

    q: (B, Hq, Nq, D), k: (B, Hkv, Nk, D), v: (B, Hkv, Nk, Dv), sinks: None or (Hq,). Returns out
    (B, Hq, Nq, Dv) (q's dtype and layout) and lse (B, Hq, Nq) in float32 (float64 for float64 inputs).
    ``softcap``: the scores' soft-cap (0.0: none); ``spans``: None or the keys' span bounds, (B, Nk, 2) (packed:
    (total_k, 2)).
    With ``cu_seqlens`` (packed heads-first views, B = 1) each sequence runs on its own and out is a view
    of a contiguous packed tensor.
    """
    B, Hq, Nq, D = q.shape
    Dv = v.shape[-1]
    if cu_seqlens is not None:
        out = empty_packed_like(q, width=Dv)
        lse = torch.empty((1, Hq, Nq), dtype=torch.promote_types(q.dtype, torch.float32), device=q.device)
        for rows, keys, p in _sequences(cu_seqlens, pattern):
            out[:, :, rows], lse[:, :, rows] = tiled_forward(
                q[:, :, rows], k[:, :, keys], v[:, :, keys], sinks, p, scale, tile, softcap=softcap,
                spans=None if spans is None else spans[None, keys])
        return out, lse
    Hkv = k.shape[1]
    tile = tile or _default_tile(q)
    stat = torch.promote_types(q.dtype, torch.float32)
    out = layout_like(q, width=Dv)                                          # (B, Hq, Nq, Dv)
    lse = torch.empty((B, Hq, Nq), dtype=stat, device=q.device)
    for r0, blocks in _tiles(pattern, tile, spans):
        rows = slice(r0, min(r0 + tile, Nq))
        q_t = q[:, :, rows].unflatten(1, (Hkv, -1)).to(stat)                # (B, Hkv, G, bm, D)
        m = torch.full(q_t.shape[:-1], -math.inf, dtype=stat, device=q.device)  # (B, Hkv, G, bm)
        den = torch.zeros_like(m)
        if sinks is not None:  # the sink is a key with logit sinks[h] and no value
            m = m.clone().copy_(capped_sinks(sinks.to(stat)).view(1, Hkv, -1, 1).expand_as(m))
            den.fill_(1.0)
        acc = q_t.new_zeros((*q_t.shape[:-1], Dv))                           # (B, Hkv, G, bm, Dv)
        for b, masked in blocks:
            s, keys, _ = _scores(pattern, q_t, k, r0, b, masked, scale, softcap, tile, spans)
            m_new = torch.maximum(m, s.amax(dim=-1))
            m_safe = torch.where(torch.isinf(m_new), torch.zeros_like(m_new), m_new)  # rows still empty
            alpha = torch.exp(m - m_safe)
            p = torch.exp(s - m_safe[..., None])                            # (B, Hkv, G, bm, bn)
            den = den * alpha + p.sum(dim=-1)
            acc = acc * alpha[..., None] + p @ v[:, :, None, keys].to(stat)
            m = m_new
        nonempty = den > 0
        safe_den = torch.where(nonempty, den, torch.ones_like(den))
        out[:, :, rows] = (acc / safe_den[..., None]).flatten(1, 2).to(q.dtype)
        lse[:, :, rows] = torch.where(nonempty, m + torch.log(safe_den), -math.inf).flatten(1, 2)
    return out, lse


def tiled_backward(dout, q, k, v, out, lse, dlse, sinks, pattern: Pattern, scale: float,
                   tile: int | None = None, *, softcap: float = 0.0, cu_seqlens=None, deterministic: bool = True,
                   spans=None):
    """Backward that recomputes probabilities tile by tile from ``lse``. Returns (dq, dk, dv, dsinks).
    Always deterministic (``deterministic`` is accepted for the Triton backward's signature).

    dout, out: (B, Hq, Nq, Dv); the other tensors as in :func:`tiled_forward`. dK/dV are accumulated per kv
    head (summed over its query-head group) in (B, Hkv, Nk, D) and (B, Hkv, Nk, Dv) buffers.
    Gradients keep their input's layout (packed ones, with ``cu_seqlens``, are views of contiguous tensors).
    """
    B, Hq, Nq, D = q.shape
    if cu_seqlens is not None:
        grads = [empty_packed_like(t).zero_() for t in (q, k, v)]
        dsinks = None if sinks is None else torch.zeros_like(sinks)
        for rows, keys, p in _sequences(cu_seqlens, pattern):
            g = tiled_backward(dout[:, :, rows], q[:, :, rows], k[:, :, keys], v[:, :, keys], out[:, :, rows],
                               lse[:, :, rows], None if dlse is None else dlse[:, :, rows], sinks, p, scale, tile,
                               softcap=softcap, spans=None if spans is None else spans[None, keys])
            for grad, part, index in zip(grads, g, (rows, keys, keys)):
                grad[:, :, index] += part
            if sinks is not None:
                dsinks += g[3]
        return (*grads, dsinks)
    Hkv = k.shape[1]
    tile = tile or _default_tile(q)
    stat = torch.promote_types(q.dtype, torch.float32)
    delta = (dout.to(stat) * out.to(stat)).sum(dim=-1)                      # (B, Hq, Nq)
    if dlse is not None:
        delta = delta - dlse.to(stat)
    lse_safe = torch.where(torch.isinf(lse), math.inf, lse).to(stat)        # empty rows: P = exp(-inf) = 0
    dq = torch.empty_like(q)
    dk = torch.zeros(k.shape, dtype=stat, device=k.device)                  # (B, Hkv, Nk, D)
    dv = torch.zeros(v.shape, dtype=stat, device=v.device)                  # (B, Hkv, Nk, Dv)
    # dsinks take delta as rowsum(P * dP) - dLSE, as the kernels do: the same value without O's rounding
    pdp = torch.zeros_like(delta)                                           # (B, Hq, Nq)
    for r0, blocks in _tiles(pattern, tile, spans):
        rows = slice(r0, min(r0 + tile, Nq))
        q_t = q[:, :, rows].unflatten(1, (Hkv, -1)).to(stat)                # (B, Hkv, G, bm, D)
        do_t = dout[:, :, rows].unflatten(1, (Hkv, -1)).to(stat)            # (B, Hkv, G, bm, Dv)
        lse_t = lse_safe[:, :, rows].unflatten(1, (Hkv, -1))[..., None]     # (B, Hkv, G, bm, 1)
        delta_t = delta[:, :, rows].unflatten(1, (Hkv, -1))[..., None]
        dq_t = torch.zeros_like(q_t)
        pdp_t = pdp[:, :, rows].unflatten(1, (Hkv, -1))                     # (B, Hkv, G, bm), a view
        for b, masked in blocks:
            s, keys, slope = _scores(pattern, q_t, k, r0, b, masked, scale, softcap, tile, spans)
            p = torch.exp(s - lse_t)                                         # (B, Hkv, G, bm, bn)
            dv[:, :, keys] += torch.einsum("bhgmn,bhgmd->bhnd", p, do_t)
            dp = do_t @ v[:, :, None, keys].to(stat).transpose(-1, -2)
            ds = p * (dp - delta_t)
            pdp_t += (p * dp).sum(dim=-1)
            if slope is not None:  # through the soft-cap: d(cap tanh(s / cap)) = (1 - tanh^2) ds
                ds = ds * slope
            dq_t += ds @ k[:, :, None, keys].to(stat) * scale
            dk[:, :, keys] += torch.einsum("bhgmn,bhgmd->bhnd", ds, q_t) * scale
        dq[:, :, rows] = dq_t.flatten(1, 2).to(q.dtype)
    dsinks = None
    if sinks is not None:
        exact = pdp if dlse is None else pdp - dlse.to(stat)
        dsinks = -(torch.exp(capped_sinks(sinks.to(stat)).view(1, Hq, 1) - lse.to(stat)) * exact).sum(dim=(0, 2))
    return dq, _in_layout_of(k, dk), _in_layout_of(v, dv), dsinks


def _in_layout_of(t: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """The contiguous accumulator ``x`` in ``t``'s dtype and memory layout (what the fake implementations of
    gstar.ops promise); a dtype cast only when ``t`` is contiguous too."""
    return x.to(t.dtype) if x.stride() == t.stride() else torch.empty_like(t).copy_(x)

