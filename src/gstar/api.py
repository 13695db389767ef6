"""The public entry points: ``gstar.flash_attention``, ``gstar.flash_attention_varlen`` and
``gstar.tiled_attention``. Validation, normalisation and dispatch.

Every public argument is validated here and nowhere else (docs/design.md section 2); :mod:`gstar.ops`
receives tensors it can trust and :class:`gstar.ops.Options` built from a normalised
:class:`gstar.pattern.Pattern`.
"""

from __future__ import annotations

import functools
import importlib.metadata
import math
import numbers
import os

import torch

from . import fp8, ops
from .pattern import Pattern

_FLOATS = (torch.float16, torch.bfloat16, torch.float32)
_BACKENDS = ("auto", "triton", "torch")
MAX_HEAD_DIM = 1024  # the Triton kernels pad D and Dv to powers of two; 1024 holds latent attention's 576
MAX_SEQLEN = 2**30  # the kernels hold positions in int32: p(i) + right must not overflow
FAR = MAX_SEQLEN - 1  # a window bound that reaches every key of the longest sequence: wider ones are clamped


def _type_name(x) -> str:
    """``int``, ``list``, ..., or ``numpy.bool`` for types outside the builtins."""
    t = type(x)
    return t.__qualname__ if t.__module__ == "builtins" else f"{t.__module__}.{t.__qualname__}"


def _check_bool(name: str, x):
    if not isinstance(x, bool):
        raise TypeError(f"{name} must be a bool, got {_type_name(x)}")


def _check_tensor(name: str, t, ndim: int):
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {_type_name(t)}")
    if t.dim() != ndim:
        raise ValueError(f"{name} must have {ndim} dims, got shape {tuple(t.shape)}")


@functools.cache
def interpreter_problem() -> str | None:
    """Why the Triton interpreter (the kernels on CPU tensors) cannot run here, or None. It needs NumPy, and
    before triton 3.7 it fails on NumPy 2.4 and later (it converts 1-element arrays to Python scalars, which
    NumPy 2.4 refuses); gstar does not cap NumPy for every user because of that one pairing."""
    try:
        triton_version = importlib.metadata.version("triton")
    except importlib.metadata.PackageNotFoundError:
        return "the Triton interpreter needs triton: pip install triton"
    try:
        numpy_version = importlib.metadata.version("numpy")
    except importlib.metadata.PackageNotFoundError:
        return "the Triton interpreter needs numpy: pip install numpy"
    if _release(triton_version) < (3, 7) and _release(numpy_version) >= (2, 4):
        return (f"the Triton interpreter of triton {triton_version} fails on numpy {numpy_version}: install "
                f"'numpy<2.4' or triton >= 3.7 to run the Triton kernels on CPU tensors")
    return None


def _release(version: str) -> tuple[int, int]:
    """(major, minor) of a version string such as ``3.6.0`` or ``2.4.0rc1``."""
    major, minor = (version.split(".") + ["0"])[:2]
    return int(major), int("".join(c for c in minor if c.isdigit()) or 0)


def _resolve_backend(backend: str, device: torch.device, dtype: torch.dtype) -> str:
    if backend not in _BACKENDS:
        raise ValueError(f"backend must be one of {_BACKENDS}, got {backend!r}")
    if backend == "auto":
        backend = "triton" if device.type == "cuda" else "torch"
    if backend == "triton":
        if dtype not in _FLOATS + (torch.float8_e4m3fn,):
            raise TypeError(f"q, k, v must be float16, bfloat16, float32 or float8_e4m3fn for the Triton backend, "
                            f"got {dtype}")
        if device.type == "cpu":
            if dtype == torch.float8_e4m3fn:
                raise RuntimeError("FP8 on CPU tensors runs the PyTorch path on the dequantised inputs: "
                                   "backend='torch' (or 'auto')")
            if os.environ.get("TRITON_INTERPRET") != "1":
                raise RuntimeError("backend='triton' on CPU tensors needs the Triton interpreter: set "
                                   "TRITON_INTERPRET=1 before triton is imported, or use backend='torch'")
            problem = interpreter_problem()
            if problem:
                raise RuntimeError(problem)
        if device.type not in ("cpu", "cuda"):
            raise ValueError(f"backend='triton' needs CUDA (or CPU under the interpreter) tensors, got {device}")
    return backend


def _check_group(q, k, v, fp8_cache: bool = False) -> tuple[int, int]:
    """Checks shared by every layout with heads on dim 1 and the head dim last; returns ``(Hq, D)``.
    ``fp8_cache``: 16-bit queries may attend FP8 keys and values (a KV cache)."""
    Hq, Hkv, D = q.shape[1], k.shape[1], q.shape[-1]
    if D == 0:
        raise ValueError(f"q head dim (q.shape[-1]) must be >= 1, got 0 (q shape {tuple(q.shape)})")
    if Hkv == 0 or Hq % Hkv != 0:
        raise ValueError(f"query heads ({Hq}) must be a multiple of kv heads ({Hkv})")
    if k.shape[-1] != D:
        raise ValueError(f"k head dim must equal q head dim {D}, got {k.shape[-1]}")
    if v.shape[-1] == 0:
        raise ValueError(f"v head dim (v.shape[-1]) must be >= 1, got 0 (v shape {tuple(v.shape)})")
    mixed = fp8_cache and k.dtype == torch.float8_e4m3fn and q.dtype in (torch.float16, torch.bfloat16)
    if not (k.dtype == v.dtype and (q.dtype == k.dtype or mixed)):
        raise TypeError(f"q, k, v must share a dtype (or k, v be float8_e4m3fn under 16-bit queries, in a KV "
                        f"cache), got {q.dtype}, {k.dtype}, {v.dtype}")
    if q.dtype not in _FLOATS + (torch.float64, torch.float8_e4m3fn):
        raise TypeError(f"q, k, v must be float16, bfloat16, float32 or float8_e4m3fn, got {q.dtype}")
    if not (q.device == k.device == v.device):
        raise ValueError(f"q, k, v must be on one device, got {q.device}, {k.device}, {v.device}")
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.numel() and t.stride(-1) != 1:
            raise ValueError(f"{name} must have unit stride on its last dim, got strides {t.stride()}")
    return Hq, D


def _check_options(q, Hq: int, D: int, Dv: int, *, causal, window, sink_tokens, sinks, scale, backend, return_lse):
    """Validate the keyword arguments every entry point shares.

    Returns ``(window, sink_tokens, scale, backend)`` as plain ints, a float and a resolved backend name.
    """
    backend = _resolve_backend(backend, q.device, q.dtype)
    if backend == "triton":
        for name, d in (("q", D), ("v", Dv)):
            if not 1 <= d <= MAX_HEAD_DIM:
                raise ValueError(f"{name} head dim must be between 1 and {MAX_HEAD_DIM} for the Triton backend, "
                                 f"got {d}")
    _check_bool("causal", causal)
    _check_bool("return_lse", return_lse)
    if (not isinstance(window, (tuple, list)) or len(window) != 2
            or not all(isinstance(w, numbers.Integral) and not isinstance(w, bool) for w in window)):
        raise TypeError(f"window must be a (left, right) pair of ints, got {window!r}")
    if any(w < -1 for w in window):
        raise ValueError(f"window bounds must be >= 0 or -1 (unbounded), got {tuple(window)}")
    if not isinstance(sink_tokens, numbers.Integral) or isinstance(sink_tokens, bool):
        raise TypeError(f"sink_tokens must be an int, got {_type_name(sink_tokens)}")
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
    elif not isinstance(scale, numbers.Real) or isinstance(scale, bool) or not _finite(scale):
        raise TypeError(f"scale must be a finite float or None, got {scale!r}")
    return (min(int(window[0]), FAR), min(int(window[1]), FAR)), int(sink_tokens), float(scale), backend


def _finite(x: numbers.Real) -> bool:
    try:
        return math.isfinite(x)
    except OverflowError:  # an int beyond float's range
        return False


def normalize(q, k, v, *, causal, window, sink_tokens, sinks, scale, backend, return_lse) -> ops.Options:
    """Validate every argument of :func:`flash_attention` (docs/design.md section 2)."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        _check_tensor(name, t, 4)
    B = q.shape[0]
    if k.shape[0] != B or v.shape[0] != B:
        raise ValueError(f"batch sizes differ: q {B}, k {k.shape[0]}, v {v.shape[0]}")
    if k.shape[1] != v.shape[1] or k.shape[2] != v.shape[2]:
        raise ValueError(f"k and v must have the same (heads, seqlen): k {tuple(k.shape)}, v {tuple(v.shape)}")
    Hq, D = _check_group(q, k, v)
    window, sink_tokens, scale, backend = _check_options(
        q, Hq, D, v.shape[-1], causal=causal, window=window, sink_tokens=sink_tokens, sinks=sinks, scale=scale,
        backend=backend, return_lse=return_lse)
    pattern = Pattern.make(q.shape[2], k.shape[2], causal=causal, window=window, sink_tokens=sink_tokens)
    return ops.Options(pattern, scale, backend)


def flash_attention(q, k, v, *, causal=False, window=(-1, -1), sink_tokens=0, sinks=None, scale=None,
                    return_lse=False, backend="auto", q_descale=None, k_descale=None, v_descale=None,
                    out_dtype=None, deterministic=True):
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
        sink_tokens: the first ``S`` keys ignore the window's left bound (StreamingLLM).
        sinks: ``(Hq,)`` learned sink logits (GPT-OSS ``s_aux``), any float dtype, added to each row's
            softmax denominator as ``exp(sinks[h])`` (not scaled). Gradients flow to them, in their dtype.
        scale: multiplies ``q . k``; default ``D ** -0.5``.
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

    Nq = 3, Nk = 5, ``causal=True`` (``1`` = visible), and with ``window=(1, 0), sink_tokens=1``::

        causal       window (1, 0) + 1 sink token
        1 1 1 . .    1 1 1 . .
        1 1 1 1 .    1 . 1 1 .
        1 1 1 1 1    1 . . 1 1

    Rows with no visible key return zeros. Returns ``out`` ``(B, Hq, Nq, Dv)`` in q's dtype and memory
    layout, or ``(out, lse)`` with ``return_lse=True``. Bad arguments raise ``ValueError`` or ``TypeError``
    naming the argument.
    """
    options = normalize(q, k, v, causal=causal, window=window, sink_tokens=sink_tokens, sinks=sinks,
                        scale=scale, backend=backend, return_lse=return_lse)
    _check_bool("deterministic", deterministic)
    options = options._replace(deterministic=deterministic)
    quantized = fp8.check(q, k, v, q_descale=q_descale, k_descale=k_descale, v_descale=v_descale,
                          out_dtype=out_dtype, sinks=sinks, scale=options.scale, batch=q.shape[0],
                          kv_heads=k.shape[1], backend=options.backend)
    if quantized:
        out, lse = ops.attention_fp8(q, k, v, sinks, options, *quantized)
    else:
        out, lse = ops.attention(q, k, v, sinks, options)
    return (out, lse) if return_lse else out


def tiled_attention(q, k, v, *, causal=False, window=(-1, -1), sink_tokens=0, sinks=None, scale=None,
                    return_lse=False):
    """FlashAttention in plain PyTorch: ``flash_attention(..., backend="torch")``.

    Same arguments, shapes, rule and autograd as :func:`flash_attention`, on any device; also accepts
    float64 (for ``torch.autograd.gradcheck``). Never builds an Nq x Nk matrix: peak memory is linear in N.
    """
    return flash_attention(q, k, v, causal=causal, window=window, sink_tokens=sink_tokens, sinks=sinks,
                           scale=scale, return_lse=return_lse, backend="torch")


def _capturing(device: torch.device) -> bool:
    """Whether a CUDA graph is being captured on the current stream: a capture cannot read data on the host."""
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


def _check_cu_seqlens(name: str, cu, device: torch.device):
    _check_tensor(name, cu, 1)
    if cu.dtype != torch.int32:
        raise TypeError(f"{name} must have dtype torch.int32, got {cu.dtype}")
    if cu.device != device:
        raise ValueError(f"{name} must be on q's device {device}, got {cu.device}")
    if cu.shape[0] == 0:
        raise ValueError(f"{name} must have num_seqs + 1 >= 1 elements, got shape {tuple(cu.shape)}")


def _check_offsets(name: str, offsets: list[int], total_name: str, total: int, max_name: str, max_seqlen: int):
    """The values of one cumulative-length list: 0 first, non-decreasing, ``total`` last, gaps <= max_seqlen."""
    if offsets[0] != 0:
        raise ValueError(f"{name} must start at 0, got {offsets[0]}")
    lengths = [b - a for a, b in zip(offsets, offsets[1:])]
    for i, n in enumerate(lengths):
        if n < 0:
            raise ValueError(f"{name} must be non-decreasing, got {offsets[i]} then {offsets[i + 1]} "
                             f"at index {i + 1}")
    if offsets[-1] != total:
        raise ValueError(f"{name} must end at {total_name} = {total}, got {offsets[-1]}")
    longest = max(lengths, default=0)
    if longest > max_seqlen:
        raise ValueError(f"{max_name} must be >= the longest sequence in {name} ({longest}), got {max_seqlen}")


def check_cu_seqlens_values(cu_seqlens_q, cu_seqlens_k, total_q: int, total_k: int, max_seqlen_q: int,
                            max_seqlen_k: int):
    """The checks of :func:`flash_attention_varlen` on the values of ``cu_seqlens`` (0 first, non-decreasing,
    the total last, no sequence longer than its ``max_seqlen``): one device-to-host copy of both (a sync on
    CUDA). ``ValueError`` naming the first offending entry."""
    for name, cu in (("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k)):
        _check_tensor(name, cu, 1)
    offsets_q, offsets_k = torch.stack((cu_seqlens_q, cu_seqlens_k)).tolist()
    _check_offsets("cu_seqlens_q", offsets_q, "total_q (q.shape[0])", total_q, "max_seqlen_q", max_seqlen_q)
    _check_offsets("cu_seqlens_k", offsets_k, "total_k (k.shape[0])", total_k, "max_seqlen_k", max_seqlen_k)


def normalize_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, *, causal, window,
                     sink_tokens, sinks, scale, backend, return_lse, check_cu_seqlens) -> ops.Options:
    """Validate every argument of :func:`flash_attention_varlen`.

    Returns the options with the pattern built on the longest lengths. The values of
    ``cu_seqlens`` are checked on the host (one device-to-host copy of both, a sync on CUDA) unless
    ``check_cu_seqlens`` is False, ``torch.compile`` traces or a CUDA graph is being captured, where they
    are data the graph cannot read: then only their dtype, device and shape are checked.
    """
    for name, t in (("q", q), ("k", k), ("v", v)):
        _check_tensor(name, t, 3)
    if k.shape[:2] != v.shape[:2]:
        raise ValueError(f"k and v must have the same (total_k, heads): k {tuple(k.shape)}, v {tuple(v.shape)}")
    Hq, D = _check_group(q, k, v)
    for name, cu in (("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k)):
        _check_cu_seqlens(name, cu, q.device)
    if cu_seqlens_q.shape != cu_seqlens_k.shape:
        raise ValueError(f"cu_seqlens_q and cu_seqlens_k must have the same length (num_seqs + 1), got "
                         f"{cu_seqlens_q.shape[0]} and {cu_seqlens_k.shape[0]}")
    for name, m in (("max_seqlen_q", max_seqlen_q), ("max_seqlen_k", max_seqlen_k)):
        if not isinstance(m, (numbers.Integral, torch.SymInt)) or isinstance(m, bool):
            raise TypeError(f"{name} must be an int, got {_type_name(m)}")
        if m < 0:
            raise ValueError(f"{name} must be >= 0, got {m}")
        if m > MAX_SEQLEN:
            raise ValueError(f"{name} must be <= {MAX_SEQLEN} (positions are int32 in the kernels), got {m}")
    window, sink_tokens, scale, backend = _check_options(
        q, Hq, D, v.shape[-1], causal=causal, window=window, sink_tokens=sink_tokens, sinks=sinks, scale=scale,
        backend=backend, return_lse=return_lse)
    _check_bool("check_cu_seqlens", check_cu_seqlens)
    if check_cu_seqlens and not (torch.compiler.is_compiling() or _capturing(q.device)):
        check_cu_seqlens_values(cu_seqlens_q, cu_seqlens_k, q.shape[0], k.shape[0], max_seqlen_q, max_seqlen_k)
    lengths = [m if isinstance(m, torch.SymInt) else int(m) for m in (max_seqlen_q, max_seqlen_k)]
    pattern = Pattern.make(*lengths, causal=causal, window=window, sink_tokens=sink_tokens)
    return ops.Options(pattern, scale, backend)


def flash_attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, *, causal=False,
                           window=(-1, -1), sink_tokens=0, sinks=None, scale=None, return_lse=False,
                           backend="auto", check_cu_seqlens=True, q_descale=None, k_descale=None, v_descale=None,
                           out_dtype=None):
    """Attention over packed variable-length sequences (the flash-attn varlen convention).

    Sequence ``s`` is query rows ``cu_seqlens_q[s]:cu_seqlens_q[s + 1]`` of ``q`` and key rows
    ``cu_seqlens_k[s]:cu_seqlens_k[s + 1]`` of ``k`` and ``v``; it never sees another sequence's keys.
    The result equals :func:`flash_attention` run on each sequence alone: positions, causality, the window
    and sink tokens all count from the sequence's own start, with ``Nq != Nk`` per sequence allowed
    (bottom-right alignment: query row ``i`` of a sequence sits at ``p(i) = i + Nk_s - Nq_s``). Key ``j``
    of the same sequence is visible to query ``i`` when every switched-on condition holds::

        causal:        j <= p(i)
        window (l, r): p(i) - l <= j <= p(i) + r      (causal forces r = 0; -1 = unbounded)
        sink_tokens S: j < S lifts the left bound only

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
        causal, window, sink_tokens, sinks, scale, backend: as in :func:`flash_attention`; ``sinks`` is
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
        check_cu_seqlens=check_cu_seqlens)
    quantized = fp8.check(q, k, v, q_descale=q_descale, k_descale=k_descale, v_descale=v_descale,
                          out_dtype=out_dtype, sinks=sinks, scale=options.scale, batch=cu_seqlens_q.shape[0] - 1,
                          kv_heads=k.shape[1], backend=options.backend)
    if quantized:
        out, lse = ops.attention_fp8(q, k, v, sinks, options, *quantized, cu_seqlens_q, cu_seqlens_k)
    else:
        out, lse = ops.attention(q, k, v, sinks, options, cu_seqlens_q, cu_seqlens_k)
    return (out, lse) if return_lse else out
