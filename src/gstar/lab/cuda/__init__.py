"""The CUDA C++ primers: ``vector_add`` and ``matrix_add``, built on first use and cached.

Layout of this folder:

- ``vector_add.cu``, ``matrix_add.cu``: the kernels and their launchers, plain CUDA C++ over raw pointers
  (``primers.h``, ``chunks.cuh``); they compile standalone with ``nvcc``, without torch.
- ``binding.cpp``: the torch adapter (tensors to pointers, the current stream), compiled by
  ``torch.utils.cpp_extension.load`` together with the kernels on the first call.

The build lands in :func:`cache_dir` (``$GSTAR_CACHE_DIR``, else ``$XDG_CACHE_HOME/gstar`` or
``~/.cache/gstar``, one folder per torch and CUDA version) and is reused by later processes; ninja rebuilds
it when a source changes. Set ``GSTAR_VERBOSE_BUILD=1`` to see the compiler's output.
"""

from __future__ import annotations

import functools
import os
from pathlib import Path

import torch

from ... import buffers

SOURCE_DIR = Path(__file__).resolve().parent
KERNEL_SOURCES = ("vector_add.cu", "matrix_add.cu")  # standalone: no torch headers
_BINDING = "binding.cpp"
_FLOATS = (torch.float32, torch.float16, torch.bfloat16)


def cache_dir() -> Path:
    """Where the compiled extension lives: one folder per torch and CUDA version."""
    root = os.environ.get("GSTAR_CACHE_DIR")
    if root is None:
        root = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "gstar"
    tag = f"torch-{torch.__version__}-cuda-{torch.version.cuda}".replace("+", "_")
    return Path(root) / "cuda-primers" / tag


@functools.cache
def extension():
    """The compiled extension module (built on the first call, loaded from :func:`cache_dir` after)."""
    if not torch.cuda.is_available():
        raise RuntimeError("the CUDA primers need a CUDA device and a CUDA build of torch")
    from torch.utils.cpp_extension import load

    build = cache_dir()
    build.mkdir(parents=True, exist_ok=True)
    return load(
        name="gstar_cuda_primers",
        sources=[str(SOURCE_DIR / _BINDING)] + [str(SOURCE_DIR / s) for s in KERNEL_SOURCES],
        extra_include_paths=[str(SOURCE_DIR)],
        extra_cflags=["-O3"],
        extra_cuda_cflags=["-O3"],
        build_directory=str(build),
        verbose=os.environ.get("GSTAR_VERBOSE_BUILD") == "1",
    )


def _check(a, b, ndim: int) -> None:
    for name, t in (("a", a), ("b", b)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != ndim:
            raise ValueError(f"{name} must have {ndim} dim{'s' if ndim > 1 else ''}, got shape {tuple(t.shape)}")
    if a.shape != b.shape:
        raise ValueError(f"a and b must have the same shape, got a {tuple(a.shape)} and b {tuple(b.shape)}")
    if a.dtype not in _FLOATS:
        raise TypeError(f"a must be float32, float16 or bfloat16, got {a.dtype}")
    if b.dtype != a.dtype:
        raise TypeError(f"b must have a's dtype {a.dtype}, got {b.dtype}")
    if a.device.type != "cuda":
        raise ValueError(f"a must be a CUDA tensor, got device {a.device}")
    if b.device != a.device:
        raise ValueError(f"b must be on a's device {a.device}, got {b.device}")


def vector_add(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a + b`` for two 1-D CUDA tensors, computed by ``vector_add.cu``.

    Args:
        a, b: ``(n,)``, same dtype (float32, float16 or bfloat16) and device, any length and stride.

    Returns:
        ``(n,)`` contiguous, bitwise equal to torch's ``a + b`` (each sum in float32, rounded once).
    """
    _check(a, b, 1)
    out = buffers.empty(a.shape, dtype=a.dtype, device=a.device)                 # (n,)
    if out.numel():
        extension().vector_add(a, b, out)
    return out


def matrix_add(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a + b`` for two 2-D CUDA tensors, computed by ``matrix_add.cu``.

    Args:
        a, b: ``(m, n)``, same dtype (float32, float16 or bfloat16) and device, any shape and strides
            (rows whose starts are 16-byte aligned with unit column stride take the vectorised path).

    Returns:
        ``(m, n)`` contiguous, bitwise equal to torch's ``a + b``.
    """
    _check(a, b, 2)
    out = buffers.empty(a.shape, dtype=a.dtype, device=a.device)                 # (m, n)
    if out.numel():
        extension().matrix_add(a, b, out)
    return out


__all__ = ["vector_add", "matrix_add", "extension", "cache_dir", "KERNEL_SOURCES", "SOURCE_DIR"]
