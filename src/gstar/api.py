"""The public entry points: ``gstar.flash_attention``, ``gstar.flash_attention_varlen`` and
``gstar.tiled_attention``: validation (:mod:`gstar.checks`), normalisation into a
:class:`gstar.pattern.Pattern` and dispatch to :mod:`gstar.ops`, which receives tensors it can trust.
"""

from __future__ import annotations

import numbers

import torch

from . import checks, fp8, ops
from .checks import check_cu_seqlens_values  # public: gstar.check_cu_seqlens_values
from .pattern import span_bounds

__all__ = ["check_cu_seqlens_values", "flash_attention", "flash_attention_varlen", "normalize", "normalize_varlen",
           "tiled_attention"]


def normalize(q, k, v, *, causal, window, sink_tokens, sinks, scale, backend, return_lse, softcap=0.0,
              chunk=0) -> ops.Options:
    """Validate every argument of :func:`flash_attention` (docs/design.md section 2)."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        checks.check_tensor(name, t, 4)
    B = q.shape[0]
    if k.shape[0] != B or v.shape[0] != B:
        raise ValueError(f"batch sizes differ: q {B}, k {k.shape[0]}, v {v.shape[0]}")
    if k.shape[1] != v.shape[1] or k.shape[2] != v.shape[2]:
        raise ValueError(f"k and v must have the same (heads, seqlen): k {tuple(k.shape)}, v {tuple(v.shape)}")
    Hq, D = checks.check_group(q, k, v)
    kw = checks.check_options(
        q, Hq, D, v.shape[-1], causal=causal, window=window, sink_tokens=sink_tokens, sinks=sinks, scale=scale,
        backend=backend, return_lse=return_lse, softcap=softcap, chunk=chunk)
    return ops.Options(kw.pattern(q.shape[2], k.shape[2]), kw.scale, kw.backend, softcap=kw.softcap)


def flash_attention(q, k, v, *, causal=False, window=(-1, -1), sink_tokens=0, sinks=None, scale=None,
                    softcap=0.0, chunk=0, spans=None, return_lse=False, backend="auto", q_descale=None,
                    k_descale=None, v_descale=None, out_dtype=None, deterministic=True):
    """Exact attention, memory-efficient, differentiable in q, k, v, sinks and the returned LSE.

    Args:
        q: ``(B, Hq, Nq, D)``; k: ``(B, Hkv, Nk, D)``; v: ``(B, Hkv, Nk, Dv)``, ``Dv`` independent of ``D``
            (the Triton kernels take both from 1 to 1024). float16, bfloat16 or float32 (float64 too with
            ``backend="torch"``); any strides with a unit last stride.
            ``Hq % Hkv == 0``: query head ``h`` reads kv head ``h // (Hq // Hkv)`` (GQA/MQA).
        causal: key ``j`` visible to query ``i`` only if ``j <= p(i)``, with ``p(i) = i + Nk - Nq``
            (bottom-right alignment): it sets the window's right bound to 0.
        window: ``(left, right)``, inclusive, ``-1`` = unbounded: ``p(i) - left <= j <= p(i) + right``.
            Hugging Face ``sliding_window=W`` is ``window=(W - 1, 0)``.
        sink_tokens: the first ``S`` keys ignore the left bounds, the window's and the chunk's (StreamingLLM).
        chunk: chunked local attention (Llama 4's ``attention_chunk_size``), ``0`` = none: key ``j`` visible
            only if ``j // chunk == p(i) // chunk``, the query's own chunk of positions, with every other
            condition still applying (a causal chunked layer: ``causal=True, chunk=C``).
        spans: bidirectional spans (Gemma 3's image tokens, a prefix-LM's prefix), ``(B, Nk)`` integer ids per
            key position: a maximal run of positions holding one nonzero id is a span (``0``: in no span; HF's
            ``token_type_ids`` for image tokens are such ids), whose keys escape the right bound (causality) of
            its queries, query ``i`` belonging to the span of position ``p(i)``: under a causal mask a span is
            all-to-all; the left bounds (window, chunk) still apply, as in Gemma 3's sliding layers. Ids per position rather than a list of
            ranges: they convert to each position's span bounds on the device (no sync), which the kernels read
            in two loads per tile, and spans can neither overlap nor leave the sequence.
        sinks: ``(Hq,)`` learned sink logits (GPT-OSS ``s_aux``), any float dtype, added to each row's
            softmax denominator as ``exp(sinks[h])`` (not scaled). Gradients flow to them, in their dtype.
        scale: multiplies ``q . k``; default ``D ** -0.5``.
        softcap: logit soft-capping (Gemma 2's ``attn_logit_softcapping``), ``0.0`` = none: the scores
            ``s = scale * q . k`` become ``softcap * tanh(s / softcap)`` before the mask and the softmax;
            gradients carry tanh's derivative. Learned sinks are not capped.
        return_lse: also return the natural-log logsumexp of each row, ``(B, Hq, Nq)`` float32, sink term
            included; ``-inf`` (or ``sinks[h]``) for rows that see no key.
        backend: ``"auto"`` (Triton on CUDA, tiled PyTorch on CPU), ``"triton"`` or ``"torch"``.
        q_descale, k_descale, v_descale: FP8 inputs only (q, k, v all ``torch.float8_e4m3fn``, forward only):
            float32 ``(B, Hkv)`` (or broadcastable, e.g. a scalar) factors that dequantise them, the scores
            being ``(q * q_descale) . (k * k_descale)`` and the output ``P (v * v_descale)``; a query head
            takes its kv head's ``q_descale``. Default 1. :func:`gstar.quantize_fp8` makes them
            (:mod:`gstar.fp8` says how the kernel uses them).
        out_dtype: the output's dtype for FP8 inputs (bfloat16, float16 or float32; default bfloat16).
        deterministic: the backward's gradients are bitwise reproducible from run to run (the default). An
            H100 / H200 runs a fused backward for 16-bit calls at head dim 128 (q, k and v; full and causal
            attention) and at head dim 64 (causal, GQA groups of 8 or more: GPT-OSS's full layers), learned
            sinks or not: five matmuls per tile pair instead of seven, dQ added up across key tiles in float32
            by the copy engine. By default it adds into each dQ tile in a fixed
            order; with ``False`` in any order, slightly faster, so dQ's last bits vary between runs (within
            the same accuracy bar). Everywhere else the flag changes nothing.

    Nq = 3, Nk = 5, ``causal=True`` (``1`` = visible), with ``window=(1, 0), sink_tokens=1``, and with
    ``chunk=2`` (chunks of positions 0-1, 2-3, 4)::

        causal       window (1, 0) + 1 sink token    chunk 2
        1 1 1 . .    1 1 1 . .                       . . 1 . .
        1 1 1 1 .    1 . 1 1 .                       . . 1 1 .
        1 1 1 1 1    1 . . 1 1                       . . . . 1

    Rows with no visible key return zeros. Returns ``out`` ``(B, Hq, Nq, Dv)`` in q's dtype and memory
    layout, or ``(out, lse)`` with ``return_lse=True``. Bad arguments raise ``ValueError`` or ``TypeError``
    naming the argument.
    """
    options = normalize(q, k, v, causal=causal, window=window, sink_tokens=sink_tokens, sinks=sinks,
                        scale=scale, backend=backend, return_lse=return_lse, softcap=softcap, chunk=chunk)
    checks.check_spans(spans, (q.shape[0], k.shape[2]), "(B, Nk)", q.device)
    bounds = None if spans is None else span_bounds(spans)                        # (B, Nk, 2)
    checks.check_bool("deterministic", deterministic)
    options = options._replace(deterministic=deterministic)
    quantized = fp8.check(q, k, v, q_descale=q_descale, k_descale=k_descale, v_descale=v_descale,
                          out_dtype=out_dtype, sinks=sinks, scale=options.scale, batch=q.shape[0],
                          kv_heads=k.shape[1], backend=options.backend)
    if quantized:
        out, lse = ops.attention_fp8(q, k, v, sinks, options, *quantized, spans=bounds)
    else:
        out, lse = ops.attention(q, k, v, sinks, options, spans=bounds)
    return (out, lse) if return_lse else out


def tiled_attention(q, k, v, *, causal=False, window=(-1, -1), sink_tokens=0, sinks=None, scale=None,
                    softcap=0.0, chunk=0, spans=None, return_lse=False):
    """FlashAttention in plain PyTorch: ``flash_attention(..., backend="torch")``.

    Same arguments, shapes, rule and autograd as :func:`flash_attention`, on any device; also accepts
    float64 (for ``torch.autograd.gradcheck``). Never builds an Nq x Nk matrix: peak memory is linear in N.
    """
    return flash_attention(q, k, v, causal=causal, window=window, sink_tokens=sink_tokens, sinks=sinks,
                           scale=scale, softcap=softcap, chunk=chunk, spans=spans, return_lse=return_lse,
                           backend="torch")


def normalize_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, *, causal, window,
                     sink_tokens, sinks, scale, backend, return_lse, check_cu_seqlens, softcap=0.0,
                     chunk=0) -> ops.Options:
    """Validate every argument of :func:`flash_attention_varlen`.

    Returns the options with the pattern built on the longest lengths. The values of
    ``cu_seqlens`` are checked on the host (one device-to-host copy of both, a sync on CUDA) unless
    ``check_cu_seqlens`` is False, ``torch.compile`` traces or a CUDA graph is being captured, where they
    are data the graph cannot read: then only their dtype, device and shape are checked.
    """
    for name, t in (("q", q), ("k", k), ("v", v)):
        checks.check_tensor(name, t, 3)
    if k.shape[:2] != v.shape[:2]:
        raise ValueError(f"k and v must have the same (total_k, heads): k {tuple(k.shape)}, v {tuple(v.shape)}")
    Hq, D = checks.check_group(q, k, v)
    for name, cu in (("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k)):
        checks.check_cu_seqlens(name, cu, q.device)
    if cu_seqlens_q.shape != cu_seqlens_k.shape:
        raise ValueError(f"cu_seqlens_q and cu_seqlens_k must have the same length (num_seqs + 1), got "
                         f"{cu_seqlens_q.shape[0]} and {cu_seqlens_k.shape[0]}")
    for name, m in (("max_seqlen_q", max_seqlen_q), ("max_seqlen_k", max_seqlen_k)):
        if not isinstance(m, (numbers.Integral, torch.SymInt)) or isinstance(m, bool):
            raise TypeError(f"{name} must be an int, got {checks.type_name(m)}")
        if m < 0:
            raise ValueError(f"{name} must be >= 0, got {m}")
        if m > checks.MAX_SEQLEN:
            raise ValueError(f"{name} must be <= {checks.MAX_SEQLEN} (positions are int32 in the kernels), got {m}")
    kw = checks.check_options(
        q, Hq, D, v.shape[-1], causal=causal, window=window, sink_tokens=sink_tokens, sinks=sinks, scale=scale,
        backend=backend, return_lse=return_lse, softcap=softcap, chunk=chunk)
    checks.check_bool("check_cu_seqlens", check_cu_seqlens)
    if check_cu_seqlens and not (torch.compiler.is_compiling() or checks.capturing(q.device)):
        checks.check_cu_seqlens_values(cu_seqlens_q, cu_seqlens_k, q.shape[0], k.shape[0], max_seqlen_q, max_seqlen_k)
    lengths = [m if isinstance(m, torch.SymInt) else int(m) for m in (max_seqlen_q, max_seqlen_k)]
    return ops.Options(kw.pattern(*lengths), kw.scale, kw.backend, softcap=kw.softcap)


def flash_attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, *, causal=False,
                           window=(-1, -1), sink_tokens=0, sinks=None, scale=None, softcap=0.0, chunk=0,
                           spans=None, return_lse=False, backend="auto", check_cu_seqlens=True, q_descale=None,
                           k_descale=None, v_descale=None, out_dtype=None):
    """Attention over packed variable-length sequences (the flash-attn varlen convention).

    Sequence ``s`` is query rows ``cu_seqlens_q[s]:cu_seqlens_q[s + 1]`` of ``q`` and key rows
    ``cu_seqlens_k[s]:cu_seqlens_k[s + 1]`` of ``k`` and ``v``; it never sees another sequence's keys.
    The result equals :func:`flash_attention` run on each sequence alone: positions, causality, the window
    and sink tokens all count from the sequence's own start, with ``Nq != Nk`` per sequence allowed
    (bottom-right alignment: query row ``i`` of a sequence sits at ``p(i) = i + Nk_s - Nq_s``). Key ``j``
    of the same sequence is visible to query ``i`` when every switched-on condition holds::

        causal:        j <= p(i)
        window (l, r): p(i) - l <= j <= p(i) + r      (causal forces r = 0; -1 = unbounded)
        sink_tokens S: j < S lifts the left bounds only (the window's, the chunk's)
        chunk C:       j // C == p(i) // C

    Packed rows and keys for ``cu_seqlens_q = cu_seqlens_k = [0, 3, 5]``, ``causal=True`` (``1`` = visible)::

        sequence 0   1 . . . .
                     1 1 . . .
                     1 1 1 . .
        sequence 1   . . . 1 .
                     . . . 1 1

    Args:
        q: ``(total_q, Hq, D)``; k: ``(total_k, Hkv, D)``; v: ``(total_k, Hkv, Dv)``, ``Hq % Hkv == 0``
            (GQA/MQA). float16, bfloat16 or float32 (float64 too with ``backend="torch"``), unit stride on
            the last dim.
        cu_seqlens_q, cu_seqlens_k: ``(num_seqs + 1,)`` int32 on q's device: 0 first, non-decreasing,
            ``total_q`` / ``total_k`` last. Zero-length sequences are allowed.
        max_seqlen_q, max_seqlen_k: ints at least the longest query / key sequence.
        causal, window, sink_tokens, chunk, sinks, scale, softcap, backend: as in :func:`flash_attention`
            (positions and chunks count from each sequence's start); ``spans`` is ``(total_k,)``, one id per packed
            key, no span crossing a sequence's end; ``sinks`` is
            ``(Hq,)`` and joins every row's softmax denominator in every sequence.
        return_lse: also return the LSE as ``(Hq, total_q)`` float32 (heads first, flash-attn's varlen
            convention, not ``(total_q, Hq)``); ``-inf`` (or ``sinks[h]``) for rows that see no key.
        check_cu_seqlens: check the values of ``cu_seqlens`` on the host (one device sync on CUDA). Pass
            False only for offsets you built or already checked (e.g. once per batch with
            :func:`gstar.check_cu_seqlens_values`, then for every layer): the kernels trust them, and
            bad offsets read and write out of bounds.
        q_descale, k_descale, v_descale, out_dtype: FP8 inputs, as in :func:`flash_attention`, with one
            descale per (sequence, kv head): ``(num_seqs, Hkv)`` or broadcastable.

    Returns ``out`` ``(total_q, Hq, Dv)`` contiguous in q's dtype, or ``(out, lse)``. Differentiable in q,
    k, v, sinks and the LSE. One kernel launch per pass covers every sequence (the Triton kernels read
    ``cu_seqlens`` on the device). Outside ``torch.compile`` and CUDA graph capture the values of
    ``cu_seqlens`` are checked on the host first (one device sync on CUDA) unless
    ``check_cu_seqlens=False``; inside a compiled or captured graph they are trusted. Bad arguments raise
    ``ValueError`` or ``TypeError`` naming the argument.
    """
    options = normalize_varlen(
        q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal=causal, window=window,
        sink_tokens=sink_tokens, sinks=sinks, scale=scale, backend=backend, return_lse=return_lse,
        check_cu_seqlens=check_cu_seqlens, softcap=softcap, chunk=chunk)
    checks.check_spans(spans, (k.shape[0],), "(total_k,)", q.device)
    bounds = None if spans is None else span_bounds(spans, cu_seqlens_k)         # (total_k, 2)
    quantized = fp8.check(q, k, v, q_descale=q_descale, k_descale=k_descale, v_descale=v_descale,
                          out_dtype=out_dtype, sinks=sinks, scale=options.scale, batch=cu_seqlens_q.shape[0] - 1,
                          kv_heads=k.shape[1], backend=options.backend)
    if quantized:
        out, lse = ops.attention_fp8(q, k, v, sinks, options, *quantized, cu_seqlens_q, cu_seqlens_k, spans=bounds)
    else:
        out, lse = ops.attention(q, k, v, sinks, options, cu_seqlens_q, cu_seqlens_k, spans=bounds)
    return (out, lse) if return_lse else out
