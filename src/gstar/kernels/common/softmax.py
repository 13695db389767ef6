"""The online softmax every forward kernel runs, in base 2: a block's max is taken over raw scores and scaled once
per row, and ``exp2(s * qk_scale - m)`` is one FMA per score (``qk_scale = scale * log2(e) > 0``). A learned
sink starts a row's running max at its logit and its running sum at 1, so it costs nothing inside the loop."""

from __future__ import annotations

import math

import triton
import triton.language as tl

from ...pattern import SINK_LIMIT
from .rule import visible
from .sizes import pad_head_dim

LOG2E = tl.constexpr(math.log2(math.e))
LN2 = tl.constexpr(math.log(2.0))
_SINK_LIMIT = tl.constexpr(SINK_LIMIT)  # the cap of gstar.pattern, as the kernels read it


_TANH_SERIES = tl.constexpr(0.2)  # |x| below which tanh takes its series: 1 - 2 / (e^2x + 1) cancels there
_HALF_LN2 = tl.constexpr(0.5 * math.log(2.0))


@triton.jit
def softcapped(s, softcap, SOFTCAP: tl.constexpr):
    """Raw scores as the softmax takes them: under a logit soft-cap (Gemma 2's ``cap * tanh(scale s / cap)``),
    ``tanh(scale s / cap)``, the factor ``cap * log2(e)`` left to qk_scale, else ``s`` itself. ``softcap`` is
    ``2 log2(e) scale / cap`` (:func:`softcap_args`), so ``y = s * softcap`` is ``2x`` in base 2.

    tanh takes one exp2 and one fast division, ``1 - 2 / (2^y + 1)``, exact at both ends (+-1 where 2^y
    overflows or vanishes), and for ``|x| < 0.2``, where that difference loses the low bits, its series to
    x^7 (truncation below 6e-8 relative): within a few float32 ulps of tanh everywhere."""
    if SOFTCAP:
        y = s * softcap
        far = 1.0 - tl.fdiv(2.0, tl.math.exp2(y) + 1.0)
        x = y * _HALF_LN2
        x2 = x * x
        near = x * (1.0 + x2 * (-1.0 / 3.0 + x2 * (2.0 / 15.0 + x2 * (-17.0 / 315.0))))
        s = tl.where(tl.abs(x) < _TANH_SERIES, near, far)
    return s


def softcap_args(scale: float, softcap: float) -> dict:
    """The score factors a kernel takes, by name: ``qk_scale`` (``scale * log2(e)``, or ``cap * log2(e)`` under
    a soft-cap) and ``softcap`` (:func:`softcapped`'s factor; 0.0 without one)."""
    if softcap > 0:
        return {"qk_scale": softcap * LOG2E.value, "softcap": 2.0 * LOG2E.value * scale / softcap}
    return {"qk_scale": scale * LOG2E.value, "softcap": 0.0}


@triton.jit
def softmax_step(s, m_i, l_i, rows, cols, qk_scale, rule, MASKED: tl.constexpr, MAY_BE_EMPTY: tl.constexpr):
    """One KV block's online-softmax update of R rows: returns ``(p, alpha, m_i, l_i)``, ``p`` the block's
    float32 weights and ``alpha`` (R,) the factor that takes the accumulator to the new max, before
    ``acc = acc * alpha + p @ v``. Every forward kernel calls it (the Gluon ones too).

    s: (R, BLOCK_N) raw scores; m_i, l_i: (R,) float32 running max (base 2, scaled) and running sum; rows: (R,)
    query positions; cols: (BLOCK_N,) key indices; rule: the sequence's :class:`gstar.kernels.common.rule.Rule`.
    ``MASKED`` blocks evaluate :func:`gstar.kernels.common.rule.visible`; the others are whole blocks visible to
    every stored row. ``MAY_BE_EMPTY``: a row can still have ``m_i = -inf`` here (no learned sink), so masked
    blocks must shift such rows by 0.
    """
    if MASKED:
        s = tl.where(visible(rule, rows[:, None], cols[None, :]), s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1) * qk_scale)  # (R,); max commutes with a positive scale
    if MASKED and MAY_BE_EMPTY:
        # a row that has seen no key yet keeps m = -inf; shift it by 0 so exp2 gives 0, not NaN.
        # m_i itself stays -inf: a finite stand-in could sit far above later scores and flush them to 0
        shift = tl.where(m_new == float("-inf"), 0.0, m_new)
    else:
        shift = m_new  # a whole visible block, or a learned sink, gives every row a finite max
    alpha = tl.math.exp2(m_i - shift)  # (R,)
    p = tl.math.exp2(s * qk_scale - shift[:, None])  # (R, BLOCK_N): one FMA per score
    return p, alpha, m_new, l_i * alpha + tl.sum(p, 1)


@triton.jit
def sink_logit(Sinks, heads):
    """The learned sink logits of query heads ``heads`` (Sinks: (Hq,) float32), clamped to
    [-SINK_LIMIT, SINK_LIMIT] as every implementation clamps them (:data:`gstar.pattern.SINK_LIMIT`)."""
    return tl.minimum(tl.maximum(tl.load(Sinks + heads), -_SINK_LIMIT), _SINK_LIMIT)


@triton.jit
def sink_max(Sinks, heads):
    """The running max a row of query head ``heads`` starts from with learned sinks (Sinks: (Hq,) float32): its
    sink logit in base 2 (:func:`sink_logit`), with a running sum of 1
    (``exp2(m) * l = exp(sink)``)."""
    return sink_logit(Sinks, heads) * LOG2E


@triton.jit
def start_state(Sinks, heads, VALUE_DIM: tl.constexpr):
    """The softmax state of rows of query heads ``heads`` (R,) before any key: ``(acc, m_i, l_i)``, acc (R,
    DV_PAD) zeros; with learned sinks (Sinks: (Hq,) float32, else None) the sink is already in the sum."""
    R: tl.constexpr = heads.shape[0]
    acc = tl.zeros([R, pad_head_dim(VALUE_DIM)], dtype=tl.float32)
    if Sinks is not None:
        m_i = sink_max(Sinks, heads)  # (R,)
        l_i = tl.zeros([R], dtype=tl.float32) + 1.0
    else:
        m_i = tl.full([R], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([R], dtype=tl.float32)
    return acc, m_i, l_i


@triton.jit
def finish_state(acc, m_i, l_i):
    """``(out, lse)`` of rows' softmax state: out (R, DV_PAD) float32, the natural-log LSE (R,). Rows that saw
    no key (and no sink) have l = 0 and acc = 0: divided by 1, they give exact zeros and LSE -inf."""
    empty = l_i == 0.0
    l_safe = tl.where(empty, 1.0, l_i)
    return acc / l_safe[:, None], tl.where(empty, float("-inf"), (m_i + tl.math.log2(l_safe)) * LN2)
