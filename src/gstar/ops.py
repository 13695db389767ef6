"""gstar's PyTorch operators: the forward and backward passes of dense and packed attention.

``torch.ops.gstar.forward`` / ``backward`` take ``(B, H, N, D)`` batches, ``varlen_forward`` /
``varlen_backward`` packed ``(total, H, D)`` tensors with ``cu_seqlens``. Each forward op has an autograd
formula that calls its backward op, and every op has a fake implementation (shapes, dtypes and strides
only, no data read), so ``torch.compile`` traces through them without a graph break and AOTAutograd can
put the backward op in the backward graph. The public entry points (:mod:`gstar.api`) validate their
arguments and call :func:`attention` / :func:`varlen_attention`: these use the operators while
``torch.compile`` traces, and the operators' plain functions through an ``autograd.Function`` in eager mode
(the torch.library autograd dispatch costs about 45 us of host time per forward, more than a small
kernel's GPU time; ``scripts/dispatch-overhead``). Neither path checks its inputs again.

Why ``torch.library.custom_op`` and not ``triton_op``: the launch settings (tile tables, dK/dV split
plans, cached per shape on the host) and the CPU path (tiled PyTorch, which reads ``cu_seqlens`` on the
host) are Python that the compiler should not trace; an opaque operator keeps them out of the graph at
the cost of not letting Inductor fuse around the kernels, which it could not do inside an attention
kernel anyway.

Mask parameters travel as plain ints: ``left``, ``right`` (``-1`` = unbounded; causal is ``right = 0``)
and ``sink_tokens``; ``backend`` is ``"triton"`` or ``"torch"``.
"""

from __future__ import annotations

import functools

import torch

from .pattern import Pattern


@functools.cache  # imported on first use (the kernels import triton), then looked up for free
def _backend_fns(backend: str):
    """(forward, backward) of a backend; both take and return the tensors documented in each module."""
    if backend == "torch":
        from .reference import tiled_backward, tiled_forward
        return tiled_forward, tiled_backward
    from .kernels import attention_backward, attention_forward
    return attention_forward, attention_backward


def _stat(dtype: torch.dtype) -> torch.dtype:
    """dtype of LSE and of the sinks the backends take: float32, or float64 for float64 inputs."""
    return torch.promote_types(dtype, torch.float32)


def _heads_first(x: torch.Tensor) -> torch.Tensor:
    """(n, H, D) packed tensor -> (1, H, n, D) view (unit last stride kept, no copy)."""
    return x.transpose(0, 1).unsqueeze(0)


def _empty_result(q, sinks, lse_shape):
    """``(out, lse)`` when no row sees a key: zeros in q's layout, and ``-inf`` or the sink logit."""
    lse = torch.full(lse_shape, -torch.inf, dtype=_stat(q.dtype), device=q.device)
    if sinks is not None:  # heads are dim -2 of (B, Hq, Nq) and of packed (Hq, total_q)
        lse.copy_(sinks.view(-1, 1).expand(lse_shape))
    return torch.zeros_like(q), lse


def _no_sink_grad(q):
    return q.new_empty((0,), dtype=_stat(q.dtype))


# ---------------------------------------------------------------------------------------------- dense


def _forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sinks: torch.Tensor | None, left: int,
            right: int, sink_tokens: int, scale: float, backend: str) -> tuple[torch.Tensor, torch.Tensor]:
    """q: (B, Hq, Nq, D), k, v: (B, Hkv, Nk, D), sinks: (Hq,) any float dtype or None.
    Returns out (q's shape, dtype and layout) and lse (B, Hq, Nq) float32 (float64 for float64 inputs)."""
    B, Hq, Nq, _ = q.shape
    pattern = Pattern.make(Nq, k.shape[2], window=(left, right), sink_tokens=sink_tokens)
    if B * Nq == 0 or pattern.nk == 0:
        return _empty_result(q, sinks, (B, Hq, Nq))
    forward_fn, _ = _backend_fns(backend)
    return forward_fn(q, k, v, None if sinks is None else sinks.to(_stat(q.dtype)), pattern, scale)


forward = torch.library.custom_op("gstar::forward", _forward, mutates_args=())


@forward.register_fake
def _(q, k, v, sinks, left, right, sink_tokens, scale, backend):
    B, Hq, Nq, _ = q.shape
    return torch.empty_like(q), q.new_empty((B, Hq, Nq), dtype=_stat(q.dtype))


def _backward(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
             lse: torch.Tensor, dlse: torch.Tensor | None, sinks: torch.Tensor | None, left: int, right: int,
             sink_tokens: int, scale: float, backend: str
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients of :func:`forward`: dq, dk, dv in the layout of q, k, v, and dsinks (Hq,) in LSE's dtype
    ((0,) without sinks). dout: unit last stride; dlse: (B, Hq, Nq) or None."""
    pattern = Pattern.make(q.shape[2], k.shape[2], window=(left, right), sink_tokens=sink_tokens)
    _, backward_fn = _backend_fns(backend)
    stat_sinks = None if sinks is None else sinks.to(_stat(q.dtype))
    dq, dk, dv, dsinks = backward_fn(dout, q, k, v, out, lse, dlse, stat_sinks, pattern, scale)
    return dq, dk, dv, _no_sink_grad(q) if dsinks is None else dsinks


backward = torch.library.custom_op("gstar::backward", _backward, mutates_args=())


@backward.register_fake
def _(dout, q, k, v, out, lse, dlse, sinks, left, right, sink_tokens, scale, backend):
    dsinks = _no_sink_grad(q) if sinks is None else q.new_empty(sinks.shape, dtype=_stat(q.dtype))
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v), dsinks


# --------------------------------------------------------------------------------------------- packed


def _varlen_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor,
                   cu_seqlens_k: torch.Tensor, max_seqlen_q: int, max_seqlen_k: int, sinks: torch.Tensor | None,
                   left: int, right: int, sink_tokens: int, scale: float, backend: str
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """q: (total_q, Hq, D), k, v: (total_k, Hkv, D), cu_seqlens_*: (num_seqs + 1,) int32.
    Returns out (total_q, Hq, D) contiguous and lse (Hq, total_q) float32 (float64 for float64 inputs)."""
    Hq = q.shape[1]
    if q.shape[0] == 0 or k.shape[0] == 0 or cu_seqlens_q.shape[0] < 2:
        out, lse = _empty_result(q, sinks, (Hq, q.shape[0]))
        return out.contiguous(), lse
    pattern = Pattern.make(max_seqlen_q, max_seqlen_k, window=(left, right), sink_tokens=sink_tokens)
    forward_fn, _ = _backend_fns(backend)
    out, lse = forward_fn(_heads_first(q), _heads_first(k), _heads_first(v),
                          None if sinks is None else sinks.to(_stat(q.dtype)), pattern, scale,
                          cu_seqlens=(cu_seqlens_q, cu_seqlens_k))     # (1, Hq, total_q, D), (1, Hq, total_q)
    return out[0].transpose(0, 1), lse[0]


varlen_forward = torch.library.custom_op("gstar::varlen_forward", _varlen_forward, mutates_args=())


@varlen_forward.register_fake
def _(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, sinks, left, right, sink_tokens, scale,
      backend):
    return q.new_empty(q.shape), q.new_empty((q.shape[1], q.shape[0]), dtype=_stat(q.dtype))


def _varlen_backward(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                    lse: torch.Tensor, dlse: torch.Tensor | None, cu_seqlens_q: torch.Tensor,
                    cu_seqlens_k: torch.Tensor, max_seqlen_q: int, max_seqlen_k: int, sinks: torch.Tensor | None,
                    left: int, right: int, sink_tokens: int, scale: float, backend: str
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients of :func:`varlen_forward`: dq, dk, dv contiguous packed, dsinks as in :func:`backward`."""
    pattern = Pattern.make(max_seqlen_q, max_seqlen_k, window=(left, right), sink_tokens=sink_tokens)
    _, backward_fn = _backend_fns(backend)
    stat_sinks = None if sinks is None else sinks.to(_stat(q.dtype))
    dq, dk, dv, dsinks = backward_fn(
        _heads_first(dout), _heads_first(q), _heads_first(k), _heads_first(v), _heads_first(out), lse[None],
        None if dlse is None else dlse[None], stat_sinks, pattern, scale, cu_seqlens=(cu_seqlens_q, cu_seqlens_k))
    grads = [g[0].transpose(0, 1) for g in (dq, dk, dv)]               # (total, H, D) each
    return (*grads, _no_sink_grad(q) if dsinks is None else dsinks)


varlen_backward = torch.library.custom_op("gstar::varlen_backward", _varlen_backward, mutates_args=())


@varlen_backward.register_fake
def _(dout, q, k, v, out, lse, dlse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, sinks, left, right,
      sink_tokens, scale, backend):
    dsinks = _no_sink_grad(q) if sinks is None else q.new_empty(sinks.shape, dtype=_stat(q.dtype))
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape), dsinks


# ------------------------------------------------------------------------------------------- autograd


def _save(ctx, inputs, output, varlen: bool, backward_fn):
    """Keep what the backward needs: the forward's inputs (tensors saved, the rest as attributes), and
    the backward to call (the operator inside a traced graph, its plain function in eager mode)."""
    tensors = [t for t in inputs if isinstance(t, torch.Tensor)]
    ctx.save_for_backward(*tensors, *output)
    ctx.non_tensors = [a for a in inputs if not isinstance(a, torch.Tensor)]
    ctx.varlen, ctx.backward_fn = varlen, backward_fn
    ctx.has_sinks = inputs[7 if varlen else 3] is not None
    # a forward that returned only out (or only lse) gets None, not zeros, for the other's gradient
    ctx.set_materialize_grads(False)


def _gradients(ctx, dout, dlse):
    """(dq, dk, dv, dsinks) from the saved forward and the gradients of (out, lse)."""
    saved = list(ctx.saved_tensors)
    out, lse = saved[-2:]
    sinks = saved[-3] if ctx.has_sinks else None
    if dout is None:
        dout = torch.zeros_like(out)
    elif dout.stride(-1) != 1:  # e.g. the stride-0 gradient of out.sum()
        dout = dout.contiguous()
    left, right, sink_tokens, scale, backend = ctx.non_tensors[-5:]
    if ctx.varlen:
        q, k, v, cu_q, cu_k = saved[:5]
        max_q, max_k = ctx.non_tensors[:2]
        dq, dk, dv, dsinks = ctx.backward_fn(dout, q, k, v, out, lse, dlse, cu_q, cu_k, max_q, max_k, sinks,
                                             left, right, sink_tokens, scale, backend)
    else:
        q, k, v = saved[:3]
        dq, dk, dv, dsinks = ctx.backward_fn(dout, q, k, v, out, lse, dlse, sinks, left, right, sink_tokens,
                                             scale, backend)
    dsinks = None if sinks is None else dsinks.to(sinks.dtype)
    return dq, dk, dv, dsinks


def _dense_grads(ctx, dout, dlse):
    dq, dk, dv, dsinks = _gradients(ctx, dout, dlse)
    return dq, dk, dv, dsinks, None, None, None, None, None


def _varlen_grads(ctx, dout, dlse):
    dq, dk, dv, dsinks = _gradients(ctx, dout, dlse)
    return dq, dk, dv, None, None, None, None, dsinks, None, None, None, None, None


forward.register_autograd(_dense_grads, setup_context=lambda ctx, inputs, output: _save(
    ctx, inputs, output, False, backward))
varlen_forward.register_autograd(_varlen_grads, setup_context=lambda ctx, inputs, output: _save(
    ctx, inputs, output, True, varlen_backward))


class _Eager(torch.autograd.Function):
    """Eager-mode autograd around the plain functions (``varlen`` picks the packed pair): the same formula
    as the operators' without the torch.library dispatch, which costs more host time per call than a small
    kernel takes on the GPU."""

    @staticmethod
    def forward(ctx, varlen, *inputs):
        output = (_varlen_forward if varlen else _forward)(*inputs)
        _save(ctx, inputs, output, varlen, _varlen_backward if varlen else _backward)
        return output

    @staticmethod
    def backward(ctx, dout, dlse):
        return (None, *(_varlen_grads if ctx.varlen else _dense_grads)(ctx, dout, dlse))


def attention(q, k, v, sinks, left: int, right: int, sink_tokens: int, scale: float, backend: str):
    """``(out, lse)`` of dense attention, differentiable: the ``gstar::forward`` operator while
    ``torch.compile`` traces, the same functions through a plain ``autograd.Function`` otherwise."""
    if torch.compiler.is_compiling():
        return forward(q, k, v, sinks, left, right, sink_tokens, scale, backend)
    return _Eager.apply(False, q, k, v, sinks, left, right, sink_tokens, scale, backend)


def varlen_attention(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q: int, max_seqlen_k: int, sinks, left: int,
                     right: int, sink_tokens: int, scale: float, backend: str):
    """``(out, lse)`` of packed attention, as :func:`attention` (operator ``gstar::varlen_forward``)."""
    args = (q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, sinks, left, right, sink_tokens, scale,
            backend)
    if torch.compiler.is_compiling():
        return varlen_forward(*args)
    return _Eager.apply(True, *args)
