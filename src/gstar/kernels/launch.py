"""Kernel launches with less host time: Triton's own launch once per argument signature, then the
compiled kernel directly.

``kernel[grid](*args)`` costs about 30 us of Python on an H100 / H200 host for our ~50-argument kernels,
most of it Triton re-deriving, argument by argument, which compiled specialisation applies (dtype and
16-byte alignment of each pointer, whether each int is 1 or a multiple of 16) and looking it up; the
launch itself takes about 10 us (``scripts/profile-host``). At small shapes (the stage rows, a 128-key
window layer) the host is slower than the GPU, so these microseconds are the kernel's speed.

:func:`launch` keys a per-kernel cache on a *refinement* of Triton's specialisation: the exact value of
every int, the dtype and 16-byte alignment of every tensor, the type of every float, and every constexpr
and launch option. Two calls with equal keys therefore have equal Triton specialisations and run the same
compiled kernel, which the first call obtained through Triton's normal path. Anything else (a tensor
descriptor argument, a launch hook such as a profiler's, the interpreter) takes Triton's normal path
every time. Exact ints make a shape that changes every call (a decode loop's growing Nk) miss every time:
those calls pay Triton's normal launch plus the key (a few us), as before the cache. Triton settings
read at launch (``TRITON_DEBUG``, instrumentation) reach a cached shape only through a new process.
"""

from __future__ import annotations

import torch
from triton import knobs
from triton.runtime import driver
from triton.runtime.jit import JITFunction

# a key per distinct shape: a decode loop (Nk grows every step) would grow the cache without bound
_MAX_ENTRIES = 512


def _signature(args: tuple) -> tuple | None:
    """The cache key's share of the runtime arguments, or None if one is of a kind we don't key on."""
    key = []
    for a in args:
        kind = type(a)
        if kind is int or a is None:
            key.append(a)
        elif kind is float:
            key.append(float)
        elif kind is bool:
            key.append((bool, a))
        elif isinstance(a, torch.Tensor):
            key.append((a.dtype, a.data_ptr() % 16 == 0))
        else:
            return None
    return tuple(key)


def _hooked(hook) -> bool:
    """Whether a launch hook is set (triton 3.6 keeps an empty ``HookChain`` where older ones kept None)."""
    return hook is not None and bool(getattr(hook, "calls", True))


class _Compiled:
    """What a cache hit needs: the compiled kernel and the constexpr values that follow the runtime args."""

    __slots__ = ("kernel", "tail")

    def __init__(self, kernel, tail: tuple):
        self.kernel, self.tail = kernel, tail


_caches: dict = {}  # JITFunction -> {key: _Compiled}


def launch(fn, grid: tuple[int, int, int], *args, **kwargs) -> None:
    """``fn[grid](*args, **kwargs)`` on the device of the tensors in ``args``, through the cache above.

    fn: a ``@triton.jit`` function whose parameters are ``args`` (its runtime arguments, in order) followed
    by constexpr parameters, given in ``kwargs`` (with the launch options ``num_warps``, ``num_stages``) or
    left at their defaults; grid: three ints. Triton launches on the current CUDA device, which need not
    hold the tensors (a model spread over GPUs calls layer by layer without switching), so a launch for
    another device switches to it, as PyTorch's own operators do.
    """
    index = next(a for a in args if isinstance(a, torch.Tensor)).get_device()  # -1 on the CPU
    if index >= 0 and index != driver.active.get_current_device():
        with torch.cuda.device(index):
            _launch(fn, grid, index, args, kwargs)
    else:
        _launch(fn, grid, index, args, kwargs)


def _launch(fn, grid, device: int, args: tuple, kwargs: dict) -> None:
    signature = None
    if device >= 0 and isinstance(fn, JITFunction) and not (_hooked(knobs.runtime.launch_enter_hook)
                                                            or _hooked(knobs.runtime.launch_exit_hook)):
        signature = _signature(args)  # not under the interpreter, nor with a profiler's launch hooks
    if signature is None:
        fn[grid](*args, **kwargs)
        return
    key = (device, signature, *kwargs.items())
    cache = _caches.setdefault(fn, {})
    hit = cache.get(key)
    if hit is None:
        kernel = fn[grid](*args, **kwargs)
        defaults = fn.signature.parameters
        tail = tuple(kwargs[name] if name in kwargs else defaults[name].default
                     for name in fn.arg_names[len(args):])
        if len(cache) >= _MAX_ENTRIES:
            cache.clear()
        cache[key] = _Compiled(kernel, tail)
        return
    kernel = hit.kernel
    kernel.run(grid[0], grid[1], grid[2], driver.active.get_current_stream(device), kernel.function,
               kernel.packed_metadata, None, None, None, *args, *hit.tail)
