"""Kernel launches with less host time: Triton's own launch once per argument signature, then the
compiled kernel directly.

``kernel[grid](*args)`` costs about 30 us of Python on an H100 / H200 host for our ~40-argument kernels,
most of it Triton re-deriving, argument by argument, which compiled specialisation applies (dtype and
16-byte alignment of each pointer; whether each int is 1 or a multiple of 16, and its width) and looking
it up; the launch itself takes about 10 us (``scripts/profile-host``). At small shapes (the stage rows, a
128-key window layer) the host is slower than the GPU, so these microseconds are the kernel's speed.

:func:`launch` takes a kernel's runtime arguments by name (a plan keeps those fixed per shape, the call adds the
tensors and what else changes) and its constexprs with the launch options (a tuple made once per shape by
:func:`constexprs`). It orders them by the kernel's parameters (pointer parameters first, then the runtime
scalars, then the constexprs, as every kernel of gstar declares them) and keeps two maps per kernel, both keyed on
a *refinement* of Triton's specialisation: the dtype and 16-byte alignment of every tensor, every constexpr and
launch option, and the scalars either exactly (the first map: the cheapest key, a tuple hashed as it comes) or by
class (the second: each int equal to 1, a multiple of 16 or neither, and 32-bit, 64-bit or wider; each float by
its type; a tuple of strides element by element). Calls with equal keys have equal Triton specialisations and run
the same compiled kernel, which the first such call obtained through Triton's normal path; the scalars themselves
are passed at every launch. A repeated shape hits the first map; a shape that changes every call (a decode loop's
growing Nk and the strides of its growing K/V cache) misses it and hits the second. Anything else (a tensor
descriptor argument, a launch hook such as a profiler's, the interpreter) takes Triton's normal path every time.
Triton settings read at launch (``TRITON_DEBUG``, instrumentation) reach a cached kernel only through a new
process.

The direct launch replays the call that Triton's own launch makes to a compiled kernel (``kernel.run`` with
its ``function`` and ``packed_metadata``, the constexprs found through ``fn.signature`` and
``fn.arg_names``): internals that no Triton release promises to keep. They are checked once per process, at
the first GPU launch (:func:`_replay_supported`: Triton's ``JITFunction.run`` still makes that call, and the
objects have those attributes); where they differ every launch takes Triton's public ``fn[grid](...)``.
"""

from __future__ import annotations

import inspect
import operator

import torch
from triton import knobs
from triton.runtime import driver
from triton.runtime.jit import JITFunction

# exact keys: one per distinct shape, so a decode loop (Nk grows every step) would grow that map without
# bound; the class map has one entry per compiled kernel
_MAX_ENTRIES = 512
_I32, _I64 = 1 << 31, 1 << 63
# the call to the compiled kernel in Triton's JITFunction.run that _launch replays (whitespace collapsed)
_TRITON_CALL = ("kernel.run(grid_0, grid_1, grid_2, stream, kernel.function, kernel.packed_metadata, "
                "launch_metadata, knobs.runtime.launch_enter_hook, knobs.runtime.launch_exit_hook, "
                "*bound_args.values())")
_replay: bool | None = None  # whether _launch may call compiled kernels directly (decided at the first one)


def constexprs(**kwargs) -> tuple:
    """A launch's constexprs and launch options (``num_warps``, ``num_stages``) as :func:`launch` takes
    them: a hashable tuple, built once per shape by the caller's plan rather than at every launch."""
    return tuple(kwargs.items())


def _tensor_key(tensors: tuple) -> tuple | None:
    """The cache key's share of the pointer arguments, or None if one is not a tensor (a descriptor)."""
    key = []
    for t in tensors:
        if t is None:
            key.append(None)
        elif isinstance(t, torch.Tensor):
            key.append((t.dtype, t.data_ptr() % 16 == 0))
        else:
            return None
    return tuple(key)


def _classes(scalars: tuple) -> tuple | None:
    """``scalars`` as far as Triton's specialisation tells them apart: each int as 1 (Triton makes it a
    constant), a multiple of 16 (an alignment hint) or neither, plus its width; floats and bools by type;
    a tuple (a tensor's strides) element by element. None if one is of another kind (those take Triton's
    own path)."""
    key = []
    for a in scalars:
        kind = type(a)
        if kind is int:
            key.append((1 if a == 1 else 16 if a % 16 == 0 else 0)
                       + (0 if -_I32 <= a < _I32 else 100 if -_I64 <= a < _I64 else 200))
        elif kind is float or kind is bool:
            key.append(kind)
        elif kind is tuple:
            inner = _classes(a)
            if inner is None:
                return None
            key.append(inner)
        else:
            return None
    return tuple(key)


def _replay_supported(fn, kernel) -> bool:
    """Whether the direct launch can replay Triton's own for ``kernel``, the compiled form of ``fn``: Triton
    launches it with the call in _TRITON_CALL, and the attributes that call and the constexpr lookup read
    exist."""
    try:
        source = " ".join(inspect.getsource(JITFunction.run).split())
    except (OSError, TypeError):  # no source to read (a frozen or compiled install)
        return False
    return (_TRITON_CALL in source and all(hasattr(kernel, a) for a in ("run", "function", "packed_metadata"))
            and hasattr(fn, "arg_names") and hasattr(getattr(fn, "signature", None), "parameters")
            and hasattr(driver.active, "get_current_stream"))


def _hooked(hook) -> bool:
    """Whether a launch hook is set (triton 3.6 keeps an empty ``HookChain`` where older ones kept None)."""
    return hook is not None and bool(getattr(hook, "calls", True))


class _Compiled:
    """What a cache hit needs: the compiled kernel and the constexpr values that follow the runtime args."""

    __slots__ = ("kernel", "tail")

    def __init__(self, kernel, tail: tuple):
        self.kernel, self.tail = kernel, tail


class _KernelCache:
    """One kernel's compiled kernels: ``exact`` maps keys with exact scalars, ``by_class`` keys with scalar
    classes; both to :class:`_Compiled` (an exact entry shares the object of its class entry). ``names``: its
    runtime parameters in order, of which the first ``pointers`` take tensors (learnt at its first launch)."""

    __slots__ = ("exact", "by_class", "names", "values", "pointers")

    def __init__(self, fn, args: dict):
        self.exact, self.by_class = {}, {}
        parameters = inspect.signature(getattr(fn, "fn", fn)).parameters  # the interpreter's kernels too
        self.names = tuple(n for n, p in parameters.items() if "constexpr" not in str(p.annotation))
        self.values = operator.itemgetter(*self.names)  # a call's values in the kernel's order, in one C call
        self.pointers = next((i for i, n in enumerate(self.names) if not _is_pointer(args[n])), len(self.names))


def _is_pointer(x) -> bool:
    """Whether a value is a pointer argument: a tensor, a tensor descriptor, or None (an absent tensor)."""
    return x is None or isinstance(x, torch.Tensor) or hasattr(x, "base")


_caches: dict = {}  # JITFunction -> _KernelCache


def launch(fn, grid: tuple[int, int, int], args: dict, options: tuple) -> None:
    """``fn[grid](**args, **dict(options))`` on the device of the tensors in ``args``, through the cache above.

    fn: a ``@triton.jit`` function whose parameters are its pointer arguments (torch tensors, None, or tensor
    descriptors), then its runtime scalars (ints, floats, tuples of them), then constexpr parameters; args: every
    runtime parameter by name; options: its constexprs (from :func:`constexprs`, with the launch options), or
    left at their defaults; grid: three ints. Each scalar keeps its type from call to call (the exact map
    compares values, and ``2 == 2.0``): pass floats as floats even when they are whole. Triton launches on the
    current CUDA device, which need not hold the tensors (a model spread over GPUs calls layer by layer without
    switching), so a launch for another device switches to it, as PyTorch's own operators do.
    """
    cache = _caches.get(fn)
    if cache is None:
        cache = _caches[fn] = _KernelCache(fn, args)
    values = cache.values(args)
    tensors, scalars = values[:cache.pointers], values[cache.pointers:]
    first = next(t for t in tensors if t is not None)
    index = (first if isinstance(first, torch.Tensor) else first.base).get_device()  # -1 on the CPU
    if index >= 0 and index != torch.cuda.current_device():
        with torch.cuda.device(index):
            _launch(fn, cache, grid, index, tensors, scalars, options)
    else:
        _launch(fn, cache, grid, index, tensors, scalars, options)


def _launch(fn, cache: _KernelCache, grid, device: int, tensors: tuple, scalars: tuple, options: tuple) -> None:
    global _replay
    signature = None
    if device >= 0 and _replay is not False and isinstance(fn, JITFunction) and not (
            _hooked(knobs.runtime.launch_enter_hook) or _hooked(knobs.runtime.launch_exit_hook)):
        signature = _tensor_key(tensors)  # not under the interpreter, nor with a profiler's launch hooks
    if signature is None:
        fn[grid](*tensors, *scalars, **dict(options))
        return
    key = (device, signature, scalars, options)
    hit = cache.exact.get(key)
    if hit is None:
        classes = _classes(scalars)
        if classes is None:
            fn[grid](*tensors, *scalars, **dict(options))
            return
        class_key = (device, signature, classes, options)
        hit = cache.by_class.get(class_key)
        launched = hit is None
        if launched:
            kwargs = dict(options)
            kernel = fn[grid](*tensors, *scalars, **kwargs)
            if _replay is None:
                _replay = _replay_supported(fn, kernel)
            if not _replay:
                return
            defaults = fn.signature.parameters
            tail = tuple(kwargs[name] if name in kwargs else defaults[name].default
                         for name in fn.arg_names[len(tensors) + len(scalars):])
            hit = cache.by_class[class_key] = _Compiled(kernel, tail)
        if len(cache.exact) >= _MAX_ENTRIES:
            cache.exact.clear()
        cache.exact[key] = hit
        if launched:
            return
    kernel = hit.kernel
    kernel.run(grid[0], grid[1], grid[2], driver.active.get_current_stream(device), kernel.function,
               kernel.packed_metadata, None, None, None, *tensors, *scalars, *hit.tail)
