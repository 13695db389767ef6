"""gstar's PyTorch operators: one forward and one backward for dense and packed attention.

``torch.ops.gstar.attention_forward`` and ``attention_backward`` take ``(B, H, N, D)`` batches, or packed
``(total, H, D)`` tensors when ``cu_seqlens_q`` / ``cu_seqlens_k`` are given; the backends see packed
tensors as heads-first ``(1, H, total, D)`` views with the offsets beside them. Each op has a fake
implementation (shapes, dtypes and strides, no data read), and the forward an autograd formula that calls
the backward op, so ``torch.compile`` traces through both without a graph break and AOTAutograd puts the
backward op in the backward graph.

The public entry points (:mod:`gstar.api`) validate their arguments and call :func:`attention`, which uses
the operator while ``torch.compile`` traces and the same functions through a plain ``autograd.Function``
in eager mode: the torch.library autograd dispatch costs more host time per call than a small kernel
takes on the GPU. Neither path checks its inputs again.

Why ``torch.library.custom_op`` and not ``triton_op``: the launch settings (tile tables, dK/dV split
plans, cached per shape on the host) and the CPU path (tiled PyTorch, which reads ``cu_seqlens`` on the
host) are Python that the compiler should not trace; an opaque operator keeps them out of the graph at
the cost of not letting Inductor fuse around the kernels, which it could not do inside an attention
kernel anyway.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch

from . import reference
from .buffers import empty_like, empty_packed_like, layout_like
from .pattern import Pattern, sink_gradient


class Inputs(NamedTuple):
    """The tensors of one attention call (docs/design.md sections 1 and 2)."""

    q: torch.Tensor                          # (B, Hq, Nq, D), or packed (total_q, Hq, D)
    k: torch.Tensor                          # (B, Hkv, Nk, D), or packed (total_k, Hkv, D)
    v: torch.Tensor                          # (B, Hkv, Nk, Dv), or packed (total_k, Hkv, Dv)
    sinks: torch.Tensor | None               # (Hq,) learned sink logits, any float dtype
    cu_seqlens_q: torch.Tensor | None        # (num_seqs + 1,) int32 when packed, else None
    cu_seqlens_k: torch.Tensor | None
    spans: torch.Tensor | None = None        # the keys' span bounds (B, Nk, 2), packed (total_k, 2), int32


class Options(NamedTuple):
    """The non-tensor arguments of one call, normalised by :mod:`gstar.api`."""

    pattern: Pattern                         # the rule; when packed, nq and nk are the longest sequences
    scale: float
    backend: str                             # "triton" or "torch"
    deterministic: bool = True               # False: the backward may add dQ up in any order (sm_90)
    softcap: float = 0.0                     # scores become softcap * tanh(scores / softcap); 0.0: none


# The operators' schema takes no tuples of mixed types: the fields of Inputs, then the pattern as one list of
# ints (Pattern.fields), the scale, the soft-cap, the backend and the determinism flag. _op_args and _named are
# the only code that knows these positions.
_OPTION_ARGS = "SymInt[] pattern, float scale, float softcap, str backend, bool deterministic"
_ARGS = (f"Tensor q, Tensor k, Tensor v, Tensor? sinks, Tensor? cu_seqlens_q, Tensor? cu_seqlens_k, Tensor? spans, "
         f"{_OPTION_ARGS}")


def _op_args(inputs: Inputs, options: Options) -> tuple:
    """Names to the operators' positional arguments."""
    return (*inputs, list(options.pattern.fields()), options.scale, options.softcap, options.backend,
            options.deterministic)


def _named(args: tuple) -> tuple[Inputs, Options]:
    """The operators' positional arguments to names (the inverse of :func:`_op_args`)."""
    q, k, v, sinks, cu_seqlens_q, cu_seqlens_k, spans, pattern, scale, softcap, backend, deterministic = args
    return (Inputs(q, k, v, sinks, cu_seqlens_q, cu_seqlens_k, spans),
            Options(Pattern.from_fields(pattern), scale, backend, deterministic, softcap))


@functools.cache  # imported on first use (the kernels import triton), then looked up for free
def _backend_fns(backend: str):
    """(forward, backward) of a backend; both take the (B, H, N, D) tensors and the keywords of
    :func:`gstar.kernels.attention_forward` / :func:`gstar.kernels.attention_backward`."""
    if backend == "torch":
        return reference.tiled_forward, reference.tiled_backward
    from .kernels import attention_backward, attention_forward
    return attention_forward, attention_backward


def stat_dtype(dtype: torch.dtype) -> torch.dtype:
    """dtype of LSE and of the sinks the backends take: float32, or float64 for float64 inputs."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def _stat_sinks(sinks: torch.Tensor | None, q: torch.Tensor) -> torch.Tensor | None:
    return None if sinks is None else sinks.to(stat_dtype(q.dtype))


def _heads_first(x: torch.Tensor) -> torch.Tensor:
    """(n, H, D) packed tensor -> (1, H, n, D) view (unit last stride kept, no copy)."""
    return x.transpose(0, 1).unsqueeze(0)


def _packed(x: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`_heads_first`: (1, H, n, D) -> (n, H, D) view."""
    return x[0].transpose(0, 1)


def _empty_result(q: torch.Tensor, width: int, sinks: torch.Tensor | None, packed: bool, out_dtype=None):
    """``(out, lse)`` of a heads-first q when no row sees a key: zeros ``width`` (Dv) columns wide (in
    ``out_dtype``, default q's), and ``-inf`` or the sink logit."""
    B, Hq, Nq, _ = q.shape
    out = (empty_packed_like if packed else empty_like)(q, dtype=out_dtype, width=width).zero_()  # (B, Hq, Nq, Dv)
    lse = torch.full((B, Hq, Nq), -torch.inf, dtype=stat_dtype(q.dtype), device=q.device)
    if sinks is not None:
        lse.copy_(sinks.view(1, Hq, 1).expand(B, Hq, Nq))
    return out, lse


def run_forward(inputs: Inputs, options: Options, descale: tuple | None = None,
                out_dtype: torch.dtype | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns out, q's shape with v's head dim Dv and q's dtype (dense: q's memory layout; packed:
    contiguous), and lse, (B, Hq, Nq) or packed (Hq, total_q), float32 (float64 for float64 inputs).
    FP8 inputs (forward only): ``descale`` the descales of q, k and v, each None or (B or num_seqs, Hkv)
    float32 (:func:`gstar.fp8.check`), and out in ``out_dtype``; the PyTorch path runs on the dequantised inputs."""
    q, k, v, sinks, cu_q, cu_k, spans = inputs
    fp8_kernel = {}
    if descale is not None:
        if options.backend == "torch":
            from .fp8 import dequantize
            q, k, v = (dequantize(t, d, cu, out_dtype)
                       for t, d, cu in zip((q, k, v), descale, (cu_q, cu_k, cu_k)))
        else:
            fp8_kernel = dict(descale=descale, out_dtype=out_dtype)
    packed = cu_q is not None
    if packed:
        q, k, v = (_heads_first(t) for t in (q, k, v))                              # (1, H, total, D)
    if q.shape[0] * q.shape[2] == 0 or k.shape[2] == 0 or (packed and cu_q.shape[0] < 2):
        out, lse = _empty_result(q, v.shape[-1], sinks, packed, out_dtype)
    else:
        forward_fn, _ = _backend_fns(options.backend)
        out, lse = forward_fn(q, k, v, _stat_sinks(sinks, q), options.pattern, options.scale,
                              softcap=options.softcap, cu_seqlens=(cu_q, cu_k) if packed else None, spans=spans,
                              **fp8_kernel)
    return (_packed(out), lse[0]) if packed else (out, lse)


def run_backward(dout: torch.Tensor, out: torch.Tensor, lse: torch.Tensor, dlse: torch.Tensor | None,
                 inputs: Inputs, options: Options):
    """Gradients ``(dq, dk, dv, dsinks)`` of :func:`run_forward` for the upstream ``dout`` (out's shape, unit
    last stride) and ``dlse`` (lse's shape, or None): dq, dk, dv in the layouts of q, k, v (packed:
    contiguous), dsinks ``(Hq,)`` float32 (float64 for float64 inputs), None without sinks."""
    q, k, v, sinks, cu_q, cu_k, spans = inputs
    packed = cu_q is not None
    if packed:
        dout, q, k, v, out = (_heads_first(t) for t in (dout, q, k, v, out))        # (1, H, total, D or Dv)
        lse, dlse = lse[None], None if dlse is None else dlse[None]                   # (1, Hq, total_q)
    _, backward_fn = _backend_fns(options.backend)
    dq, dk, dv, dsinks = backward_fn(dout, q, k, v, out, lse, dlse, _stat_sinks(sinks, q), options.pattern,
                                     options.scale, softcap=options.softcap,
                                     cu_seqlens=(cu_q, cu_k) if packed else None,
                                     deterministic=options.deterministic, spans=spans)
    if packed:
        dq, dk, dv = (_packed(g) for g in (dq, dk, dv))
    return dq, dk, dv, dsinks


# ------------------------------------------------------------------------------------------ operators


def _no_sink_grad(q: torch.Tensor) -> torch.Tensor:
    """The backward op's dsinks without sinks: a schema returns tensors, so (0,) stands for None."""
    return q.new_empty((0,), dtype=stat_dtype(q.dtype))


def _forward_op(*args):
    return run_forward(*_named(args))


def _backward_op(dout, out, lse, dlse, *args):
    inputs, options = _named(args)
    dq, dk, dv, dsinks = run_backward(dout, out, lse, dlse, inputs, options)
    return dq, dk, dv, _no_sink_grad(inputs.q) if dsinks is None else dsinks


forward_op = torch.library.custom_op("gstar::attention_forward", _forward_op, mutates_args=(),
                                     schema=f"({_ARGS}) -> (Tensor, Tensor)")
backward_op = torch.library.custom_op(
    "gstar::attention_backward", _backward_op, mutates_args=(),
    schema=f"(Tensor dout, Tensor out, Tensor lse, Tensor? dlse, {_ARGS}) -> (Tensor, Tensor, Tensor, Tensor)")


def _fp8_forward_op(*args):
    *args, descale, out_dtype = args
    return run_forward(*_named(tuple(args)), tuple(descale), out_dtype)


# FP8 inputs: forward only (no autograd formula), the descales and the output dtype after the common arguments
fp8_forward_op = torch.library.custom_op(
    "gstar::attention_forward_fp8", _fp8_forward_op, mutates_args=(),
    schema=f"({_ARGS}, Tensor?[] descale, ScalarType out_dtype) -> (Tensor, Tensor)")


def _fake_forward(inputs: Inputs, out_dtype=None):
    """The shapes, dtypes and strides of :func:`run_forward`'s ``(out, lse)``, nothing computed."""
    q, Dv, stats = inputs.q, inputs.v.shape[-1], stat_dtype(inputs.q.dtype)
    if inputs.cu_seqlens_q is None:
        B, Hq, Nq, _ = q.shape
        return layout_like(q, dtype=out_dtype, width=Dv), q.new_empty((B, Hq, Nq), dtype=stats)
    return q.new_empty((*q.shape[:-1], Dv), dtype=out_dtype), q.new_empty((q.shape[1], q.shape[0]), dtype=stats)


@fp8_forward_op.register_fake
def _(*args):
    *args, _, out_dtype = args
    return _fake_forward(_named(tuple(args))[0], out_dtype)


@forward_op.register_fake
def _(*args):
    return _fake_forward(_named(args)[0])


@backward_op.register_fake
def _(dout, out, lse, dlse, *args):
    inputs, _ = _named(args)
    q, sinks = inputs.q, inputs.sinks
    if inputs.cu_seqlens_q is None:
        grads = [torch.empty_like(t) for t in (q, inputs.k, inputs.v)]
    else:  # packed gradients are contiguous
        grads = [t.new_empty(t.shape) for t in (q, inputs.k, inputs.v)]
    dsinks = _no_sink_grad(q) if sinks is None else q.new_empty(sinks.shape, dtype=stat_dtype(q.dtype))
    return (*grads, dsinks)


# ------------------------------------------------------------------------------------------- autograd


def _save(ctx, inputs: Inputs, options: Options, output, backward):
    """Keep what the backward needs: the forward's tensors and output, its options, and the backward to
    call (the operator inside a traced graph, the plain function in eager mode)."""
    ctx.save_for_backward(*inputs, *output)
    ctx.options, ctx.backward = options, backward
    # a forward that returned only out (or only lse) gets None, not zeros, for the other's gradient
    ctx.set_materialize_grads(False)


def _gradients(ctx, dout, dlse) -> Inputs:
    """The gradient of each forward input, by name, from the gradients of ``(out, lse)``."""
    *tensors, out, lse = ctx.saved_tensors
    inputs = Inputs._make(tensors)
    if dout is None:
        dout = torch.zeros_like(out)
    elif dout.stride(-1) != 1:  # e.g. the stride-0 gradient of out.sum()
        dout = dout.contiguous()
    dq, dk, dv, dsinks = ctx.backward(dout, out, lse, dlse, inputs, ctx.options)
    sinks = inputs.sinks
    return Inputs(q=dq, k=dk, v=dv, sinks=None if sinks is None else sink_gradient(sinks, dsinks).to(sinks.dtype),
                  cu_seqlens_q=None, cu_seqlens_k=None, spans=None)


def _backward_through_op(dout, out, lse, dlse, inputs: Inputs, options: Options):
    return backward_op(dout, out, lse, dlse, *_op_args(inputs, options))


def _op_gradients(ctx, dout, dlse):
    """One gradient per operator argument: the tensors' by name, None for each of _OPTION_ARGS."""
    return (*_gradients(ctx, dout, dlse), *[None] * len(_OPTION_ARGS.split(", ")))


forward_op.register_autograd(_op_gradients, setup_context=lambda ctx, inputs, output: _save(
    ctx, *_named(inputs), output, _backward_through_op))


class _Eager(torch.autograd.Function):
    """Eager-mode autograd around the plain functions: the operators' formula without the torch.library
    dispatch, which costs more host time per call than a small kernel takes on the GPU."""

    @staticmethod
    def forward(ctx, q, k, v, sinks, cu_seqlens_q, cu_seqlens_k, spans, options: Options):
        inputs = Inputs(q, k, v, sinks, cu_seqlens_q, cu_seqlens_k, spans)
        output = run_forward(inputs, options)
        _save(ctx, inputs, options, output, run_backward)
        return output

    @staticmethod
    def backward(ctx, dout, dlse):
        return (*_gradients(ctx, dout, dlse), None)  # None: options


def attention_fp8(q, k, v, sinks, options: Options, descale, out_dtype, cu_seqlens_q=None, cu_seqlens_k=None,
                  spans=None):
    """``(out, lse)`` of validated FP8 inputs (forward only): the ``gstar::attention_forward_fp8`` operator
    while ``torch.compile`` traces, :func:`run_forward` otherwise."""
    inputs = Inputs(q, k, v, sinks, cu_seqlens_q, cu_seqlens_k, spans)
    if torch.compiler.is_compiling():
        return fp8_forward_op(*_op_args(inputs, options), descale, out_dtype)
    return run_forward(inputs, options, descale, out_dtype)


def attention(q, k, v, sinks, options: Options, cu_seqlens_q=None, cu_seqlens_k=None, spans=None):
    """``(out, lse)`` of validated inputs, differentiable in q, k, v, sinks and lse (shapes as in
    :class:`Inputs` and :func:`run_forward`; ``spans``: span bounds, :func:`gstar.pattern.span_bounds`): the
    ``gstar::attention_forward`` operator while
    ``torch.compile`` traces, the same functions through a plain ``autograd.Function`` otherwise."""
    if torch.compiler.is_compiling():
        return forward_op(*_op_args(Inputs(q, k, v, sinks, cu_seqlens_q, cu_seqlens_k, spans), options))
    return _Eager.apply(q, k, v, sinks, cu_seqlens_q, cu_seqlens_k, spans, options)
