"""``gstar.flash_attention``: validation, normalisation, dispatch, and the autograd entry.

Every public entry point validates here and nowhere else; backends receive tensors they can trust and a
normalised :class:`gstar.pattern.Pattern`.
"""

from __future__ import annotations

import math
import numbers
import os

import torch

from .pattern import Pattern

_FLOATS = (torch.float16, torch.bfloat16, torch.float32)
_BACKENDS = ("auto", "triton", "torch")
MAX_HEAD_DIM = 256  # the Triton kernels pad D to a power of two and keep a (BLOCK_M, D) tile in registers


def _backend_fns(backend: str):
    """(forward, backward) of a backend; both take and return the tensors documented in each module."""
    if backend == "torch":
        from .reference import tiled_backward, tiled_forward
        return tiled_forward, tiled_backward
    from .kernels.backward import attention_backward
    from .kernels.forward import attention_forward
    return attention_forward, attention_backward


class _Attention(torch.autograd.Function):
    """Forward saves (q, k, v, out, lse); backward recomputes probabilities from lse (no N x N buffer)."""

    @staticmethod
    def forward(ctx, q, k, v, sinks, pattern, scale, backend):
        forward_fn, _ = _backend_fns(backend)
        # kernels take float32 sinks; the torch path keeps float64 so that gradcheck sees full precision
        stat = torch.float32 if backend == "triton" else torch.promote_types(q.dtype, torch.float32)
        sinks32 = None if sinks is None else sinks.detach().to(stat)          # (Hq,)
        out, lse = forward_fn(q, k, v, sinks32, pattern, scale)               # (B,Hq,Nq,D), (B,Hq,Nq)
        ctx.save_for_backward(q, k, v, out, lse, sinks32)
        ctx.pattern, ctx.scale, ctx.backend = pattern, scale, backend
        ctx.sinks_dtype = None if sinks is None else sinks.dtype
        ctx.set_materialize_grads(False)
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        q, k, v, out, lse, sinks32 = ctx.saved_tensors
        _, backward_fn = _backend_fns(ctx.backend)
        if dout is None:
            dout = torch.zeros_like(out)
        elif dout.stride(-1) != 1:  # e.g. the stride-0 gradient of out.sum()
            dout = dout.contiguous()
        dq, dk, dv, dsinks = backward_fn(dout, q, k, v, out, lse, dlse, sinks32, ctx.pattern, ctx.scale)
        if dsinks is not None:
            dsinks = dsinks.to(ctx.sinks_dtype)
        return dq, dk, dv, dsinks, None, None, None


def _check_tensor(name: str, t, ndim: int):
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dim() != ndim:
        raise ValueError(f"{name} must have {ndim} dims, got shape {tuple(t.shape)}")


def _resolve_backend(backend: str, device: torch.device, dtype: torch.dtype) -> str:
    if backend not in _BACKENDS:
        raise ValueError(f"backend must be one of {_BACKENDS}, got {backend!r}")
    if backend == "auto":
        backend = "triton" if device.type == "cuda" else "torch"
    if backend == "triton":
        if dtype not in _FLOATS:
            raise TypeError(f"q, k, v must be float16, bfloat16 or float32 for the Triton backend, got {dtype}")
        if device.type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
            raise RuntimeError("backend='triton' on CPU tensors needs the Triton interpreter: set "
                               "TRITON_INTERPRET=1 before triton is imported, or use backend='torch'")
        if device.type not in ("cpu", "cuda"):
            raise ValueError(f"backend='triton' needs CUDA (or CPU under the interpreter) tensors, got {device}")
    return backend


def normalize(q, k, v, *, causal, window, sink_tokens, sinks, scale, backend):
    """Validate every argument (DESIGN.md section 2) and return ``(pattern, scale, backend)``."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        _check_tensor(name, t, 4)
    B, Hq, Nq, D = q.shape
    if k.shape[0] != B or v.shape[0] != B:
        raise ValueError(f"batch sizes differ: q {B}, k {k.shape[0]}, v {v.shape[0]}")
    if k.shape[1] != v.shape[1] or k.shape[2] != v.shape[2]:
        raise ValueError(f"k and v must have the same (heads, seqlen): k {tuple(k.shape)}, v {tuple(v.shape)}")
    Hkv, Nk = k.shape[1], k.shape[2]
    if Hkv == 0 or Hq % Hkv != 0:
        raise ValueError(f"query heads ({Hq}) must be a multiple of kv heads ({Hkv})")
    if k.shape[3] != D:
        raise ValueError(f"k head dim must equal q head dim {D}, got {k.shape[3]}")
    if v.shape[3] != D:
        raise ValueError(f"v head dim must equal q head dim {D} (Dv != D is not supported), got {v.shape[3]}")
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(f"q, k, v must share a dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if q.dtype not in _FLOATS + (torch.float64,):
        raise TypeError(f"q, k, v must be float16, bfloat16 or float32, got {q.dtype}")
    if not (q.device == k.device == v.device):
        raise ValueError(f"q, k, v must be on one device, got {q.device}, {k.device}, {v.device}")
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.numel() and t.stride(-1) != 1:
            raise ValueError(f"{name} must have unit stride on its last dim, got strides {t.stride()}")
    backend = _resolve_backend(backend, q.device, q.dtype)
    if backend == "triton" and not 1 <= D <= MAX_HEAD_DIM:
        raise ValueError(f"head dim must be between 1 and {MAX_HEAD_DIM} for the Triton backend, got {D}")
    if not isinstance(causal, bool):
        raise TypeError(f"causal must be a bool, got {type(causal).__name__}")
    if (not isinstance(window, (tuple, list)) or len(window) != 2
            or not all(isinstance(w, numbers.Integral) and not isinstance(w, bool) for w in window)):
        raise TypeError(f"window must be a (left, right) pair of ints, got {window!r}")
    if any(w < -1 for w in window):
        raise ValueError(f"window bounds must be >= 0 or -1 (unbounded), got {tuple(window)}")
    if not isinstance(sink_tokens, numbers.Integral) or isinstance(sink_tokens, bool):
        raise TypeError(f"sink_tokens must be an int, got {type(sink_tokens).__name__}")
    if sink_tokens < 0:
        raise ValueError(f"sink_tokens must be >= 0, got {sink_tokens}")
    if sinks is not None:
        _check_tensor("sinks", sinks, 1)
        if sinks.shape[0] != Hq:
            raise ValueError(f"sinks must have shape ({Hq},) (one logit per query head), got {tuple(sinks.shape)}")
        if not sinks.is_floating_point():
            raise TypeError(f"sinks must be a floating-point tensor, got {sinks.dtype}")
        if sinks.device != q.device:
            raise ValueError(f"sinks must be on {q.device}, got {sinks.device}")
    if scale is None:
        scale = D ** -0.5
    elif not isinstance(scale, numbers.Real) or isinstance(scale, bool) or not math.isfinite(scale):
        raise TypeError(f"scale must be a finite float or None, got {scale!r}")
    pattern = Pattern.make(Nq, Nk, causal=causal, window=(int(window[0]), int(window[1])),
                           sink_tokens=int(sink_tokens))
    return pattern, float(scale), backend


def flash_attention(q, k, v, *, causal=False, window=(-1, -1), sink_tokens=0, sinks=None, scale=None,
                    return_lse=False, backend="auto"):
    """Exact attention, memory-efficient, differentiable in q, k, v, sinks and the returned LSE.

    Args:
        q: ``(B, Hq, Nq, D)``; k: ``(B, Hkv, Nk, D)``; v: ``(B, Hkv, Nk, D)``. float16, bfloat16 or
            float32 (float64 too with ``backend="torch"``); any strides with a unit last stride.
            ``Hq % Hkv == 0``: query head ``h`` reads kv head ``h // (Hq // Hkv)`` (GQA/MQA).
        causal: key ``j`` visible to query ``i`` only if ``j <= p(i)``, with ``p(i) = i + Nk - Nq``
            (bottom-right alignment). Same as ``window=(left, 0)``.
        window: ``(left, right)``, inclusive, ``-1`` = unbounded: ``p(i) - left <= j <= p(i) + right``.
            Hugging Face ``sliding_window=W`` is ``window=(W - 1, 0)``.
        sink_tokens: the first ``S`` keys ignore the window's left bound (StreamingLLM).
        sinks: ``(Hq,)`` learned sink logits (GPT-OSS ``s_aux``), added to each row's softmax denominator
            as ``exp(sinks[h])`` (not scaled). Gradients flow to them.
        scale: multiplies ``q . k``; default ``D ** -0.5``.
        return_lse: also return the natural-log logsumexp of each row, ``(B, Hq, Nq)`` float32, sink term
            included; ``-inf`` (or ``sinks[h]``) for rows that see no key.
        backend: ``"auto"`` (Triton on CUDA, tiled PyTorch on CPU), ``"triton"`` or ``"torch"``.

    Nq = 3, Nk = 5, ``causal=True`` (``1`` = visible), and with ``window=(1, 0), sink_tokens=1``::

        causal       window (1, 0) + 1 sink token
        1 1 1 . .    1 1 1 . .
        1 1 1 1 .    1 . 1 1 .
        1 1 1 1 1    1 . . 1 1

    Rows with no visible key return zeros. Returns ``out`` ``(B, Hq, Nq, D)`` in q's dtype and memory
    layout, or ``(out, lse)`` with ``return_lse=True``.
    """
    pattern, scale, backend = normalize(q, k, v, causal=causal, window=window, sink_tokens=sink_tokens,
                                        sinks=sinks, scale=scale, backend=backend)
    B, Hq, Nq, _ = q.shape
    if B == 0 or Nq == 0 or pattern.nk == 0:
        out = torch.zeros_like(q)
        if sinks is None:
            lse = torch.full((B, Hq, Nq), -math.inf, device=q.device)
        else:
            lse = sinks.float().view(1, Hq, 1).expand(B, Hq, Nq)
        return (out, lse) if return_lse else out
    out, lse = _Attention.apply(q, k, v, sinks, pattern, scale, backend)
    return (out, lse) if return_lse else out
