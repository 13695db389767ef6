"""Validation of every public argument (docs/design.md section 2), shared by the entry points of
:mod:`gstar.api`, :mod:`gstar.kvcache` and :mod:`gstar.distributed`: each check raises ``TypeError`` or
``ValueError`` naming the argument, the expected and the actual value. Nothing here reads a tensor's values
except :func:`check_cu_seqlens_values`, which says so.
"""

from __future__ import annotations

import functools
import importlib.metadata
import math
import numbers
import os
from typing import NamedTuple

import torch

from .pattern import Pattern

_FLOATS = (torch.float16, torch.bfloat16, torch.float32)
_BACKENDS = ("auto", "triton", "torch")
MAX_HEAD_DIM = 1024  # the Triton kernels pad D and Dv to powers of two; 1024 holds latent attention's 576
MAX_SEQLEN = 2**30  # the kernels hold positions in int32: p(i) + right must not overflow
FAR = MAX_SEQLEN - 1  # a window bound that reaches every key of the longest sequence: wider ones are clamped


def type_name(x) -> str:
    """``int``, ``list``, ..., or ``numpy.bool`` for types outside the builtins."""
    t = type(x)
    return t.__qualname__ if t.__module__ == "builtins" else f"{t.__module__}.{t.__qualname__}"


def check_bool(name: str, x):
    if not isinstance(x, bool):
        raise TypeError(f"{name} must be a bool, got {type_name(x)}")


def check_tensor(name: str, t, ndim: int):
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type_name(t)}")
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


def resolve_backend(backend: str, device: torch.device, dtype: torch.dtype) -> str:
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


def check_group(q, k, v, fp8_cache: bool = False, names: tuple[str, str, str] = ("q", "k", "v")) -> tuple[int, int]:
    """Checks shared by every layout with heads on dim 1 and the head dim last; returns ``(Hq, D)``.
    ``fp8_cache``: 16-bit queries may attend FP8 keys and values (a KV cache); ``names``: the arguments the
    messages name (a cache's are ``q, k_cache, v_cache``)."""
    qn, kn, vn = names
    Hq, Hkv, D = q.shape[1], k.shape[1], q.shape[-1]
    if D == 0:
        raise ValueError(f"q head dim (q.shape[-1]) must be >= 1, got 0 (q shape {tuple(q.shape)})")
    if Hkv == 0 or Hq % Hkv != 0:
        raise ValueError(f"query heads ({Hq}) must be a multiple of kv heads ({Hkv})")
    if k.shape[-1] != D:
        raise ValueError(f"{kn} head dim must equal {qn} head dim {D}, got {k.shape[-1]}")
    if v.shape[-1] == 0:
        raise ValueError(f"{vn} head dim ({vn}.shape[-1]) must be >= 1, got 0 ({vn} shape {tuple(v.shape)})")
    mixed = fp8_cache and k.dtype == torch.float8_e4m3fn and q.dtype in (torch.float16, torch.bfloat16)
    if not (k.dtype == v.dtype and (q.dtype == k.dtype or mixed)):
        raise TypeError(f"{qn}, {kn}, {vn} must share a dtype (or {kn}, {vn} be float8_e4m3fn under 16-bit queries, "
                        f"in a KV cache), got {q.dtype}, {k.dtype}, {v.dtype}")
    if q.dtype not in _FLOATS + (torch.float64, torch.float8_e4m3fn):
        raise TypeError(f"{qn}, {kn}, {vn} must be float16, bfloat16, float32 or float8_e4m3fn, got {q.dtype}")
    if not (q.device == k.device == v.device):
        raise ValueError(f"{qn}, {kn}, {vn} must be on one device, got {q.device}, {k.device}, {v.device}")
    for name, t in zip(names, (q, k, v)):
        if t.numel() and t.stride(-1) != 1:
            raise ValueError(f"{name} must have unit stride on its last dim, got strides {t.stride()}")
    return Hq, D


class Keywords(NamedTuple):
    """The keyword arguments every entry point shares, validated and normalised (:func:`check_options`)."""

    causal: bool
    window: tuple[int, int]  # (left, right), -1 = unbounded, clamped to FAR
    sink_tokens: int
    chunk: int               # 0 = none
    scale: float
    softcap: float           # 0.0 = none
    backend: str             # "triton" or "torch"

    def pattern(self, nq, nk) -> Pattern:
        """The rule over ``nq`` queries and ``nk`` keys."""
        return Pattern.make(nq, nk, causal=self.causal, window=self.window, sink_tokens=self.sink_tokens,
                            chunk=self.chunk)


def check_int(name: str, x, least: int) -> int:
    if not isinstance(x, numbers.Integral) or isinstance(x, bool):
        raise TypeError(f"{name} must be an int, got {type_name(x)}")
    if x < least:
        raise ValueError(f"{name} must be >= {least}, got {x}")
    return int(x)


def check_options(q, Hq: int, D: int, Dv: int, *, causal, window, sink_tokens, sinks, scale, backend, return_lse,
                  softcap=0.0, chunk=0) -> Keywords:
    """Validate the keyword arguments every entry point shares; returns them as :class:`Keywords`."""
    backend = resolve_backend(backend, q.device, q.dtype)
    if backend == "triton":
        for name, d in (("q", D), ("v", Dv)):
            if not 1 <= d <= MAX_HEAD_DIM:
                raise ValueError(f"{name} head dim must be between 1 and {MAX_HEAD_DIM} for the Triton backend, "
                                 f"got {d}")
    check_bool("causal", causal)
    check_bool("return_lse", return_lse)
    if (not isinstance(window, (tuple, list)) or len(window) != 2
            or not all(isinstance(w, numbers.Integral) and not isinstance(w, bool) for w in window)):
        raise TypeError(f"window must be a (left, right) pair of ints, got {window!r}")
    if any(w < -1 for w in window):
        raise ValueError(f"window bounds must be >= 0 or -1 (unbounded), got {tuple(window)}")
    sink_tokens = check_int("sink_tokens", sink_tokens, 0)
    chunk = min(check_int("chunk", chunk, 0), FAR)  # a chunk past every sequence hides nothing
    if sinks is not None:
        check_tensor("sinks", sinks, 1)
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
    if not isinstance(softcap, numbers.Real) or isinstance(softcap, bool):
        raise TypeError(f"softcap must be a float (0.0: none), got {type_name(softcap)}")
    if not 0 <= softcap < math.inf:  # NaN fails too (comparisons: a traced value may be symbolic)
        raise ValueError(f"softcap must be a finite float >= 0 (0.0: none), got {softcap!r}")
    scale = float(scale)
    if softcap and not abs(scale / softcap) < math.inf:
        raise ValueError(f"softcap = {softcap!r} is too small for scale {scale!r}: scale / softcap overflows")
    return Keywords(causal, (min(int(window[0]), FAR), min(int(window[1]), FAR)), sink_tokens, chunk, scale,
                    float(softcap), backend)


def check_spans(spans, shape: tuple, name_of_shape: str, device: torch.device):
    """Span ids: None, or an integer tensor of ``shape`` (one id per key position) on ``device``."""
    if spans is None:
        return
    check_tensor("spans", spans, len(shape))
    if spans.dtype.is_floating_point or spans.dtype.is_complex:
        raise TypeError(f"spans must be an integer or bool tensor of span ids, got {spans.dtype}")
    if tuple(spans.shape) != tuple(shape):
        raise ValueError(f"spans must be {name_of_shape} = {tuple(shape)} (one id per key position), got "
                         f"{tuple(spans.shape)}")
    if spans.device != device:
        raise ValueError(f"spans must be on q's device {device}, got {spans.device}")


def _finite(x: numbers.Real) -> bool:
    try:
        return math.isfinite(x)
    except OverflowError:  # an int beyond float's range
        return False




def capturing(device: torch.device) -> bool:
    """Whether a CUDA graph is being captured on the current stream: a capture cannot read data on the host."""
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


def check_cu_seqlens(name: str, cu, device: torch.device):
    check_tensor(name, cu, 1)
    if cu.dtype != torch.int32:
        raise TypeError(f"{name} must have dtype torch.int32, got {cu.dtype}")
    if cu.device != device:
        raise ValueError(f"{name} must be on q's device {device}, got {cu.device}")
    if cu.shape[0] == 0:
        raise ValueError(f"{name} must have num_seqs + 1 >= 1 elements, got shape {tuple(cu.shape)}")


def check_offsets(name: str, offsets: list[int], total_name: str, total: int, max_name: str, max_seqlen: int):
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
        check_tensor(name, cu, 1)
    offsets_q, offsets_k = torch.stack((cu_seqlens_q, cu_seqlens_k)).tolist()
    check_offsets("cu_seqlens_q", offsets_q, "total_q (q.shape[0])", total_q, "max_seqlen_q", max_seqlen_q)
    check_offsets("cu_seqlens_k", offsets_k, "total_k (k.shape[0])", total_k, "max_seqlen_k", max_seqlen_k)
