"""What the sm_90 Gluon kernels share: rings of shared-memory slots that a producer warp fills with the tensor
copy engine (TMA) and consumer warpgroups free, their ``ready`` / ``empty`` barriers, the copy engine's load,
store and reduce-add under the names of every verified Triton release, the host descriptors that feed it, and
the register operand of a warpgroup product."""

import functools

import torch
from triton._C.libtriton import ir
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language._core import builtin
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from ...fp8 import FP8

GL_DTYPES = {torch.bfloat16: gl.bfloat16, torch.float16: gl.float16}  # the 16-bit inputs
_GL_ALL = {**GL_DTYPES, FP8: gl.float8e4nv, torch.float32: gl.float32}  # every tile's element type

# the TMA copies under their names since Triton 3.7 (async_load / async_store) or before
tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared
tma_store = getattr(tma, "async_store", None) or tma.async_copy_shared_to_global


@builtin
def _tma_add_3_6(tensor_desc, coord, src, _semantic=None):
    """Adds the shared-memory tile ``src`` into the global tile at ``coord`` (a TMA reduce-add, asynchronous:
    ``tma.store_wait`` waits for it). Triton 3.7 names it ``tma.async_atomic_add``; 3.6 has the operation
    but no Gluon function for it."""
    coord = _semantic._convert_to_ir_values(coord, require_i64=False)
    _semantic.builder.create_async_tma_reduce(ir.DESCRIPTOR_REDUCE_KIND.ADD, tensor_desc.handle, coord,
                                              src.handle)


tma_add = getattr(tma, "async_atomic_add", None) or _tma_add_3_6
# the warpgroup-wide barrier (a named barrier inside a partition), renamed gl.barrier after 3.6
sync_warpgroup = getattr(gl, "thread_barrier", None) or gl.barrier


@gluon.jit
def ring_barriers(slots: gl.constexpr, consumers: gl.constexpr):
    """The initialised ``ready`` and ``empty`` barriers of a ring of ``slots`` slots: ``ready`` completes on
    the producer's expect and the copy's bytes, ``empty`` on one arrival per consumer warpgroup (``consumers``)."""
    ready = gl.allocate_shared_memory(gl.int64, [slots, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [slots, 1], mbarrier.MBarrierLayout())
    for slot in gl.static_range(slots):
        mbarrier.init(ready.index(slot), count=1)
        mbarrier.init(empty.index(slot), count=consumers)
    return ready, empty


@gluon.jit
def ring_load(desc, coord, ring, ready, empty, i, tail_desc=None, tail_coord=None, tail=None):
    """Copy the tile at ``coord`` into slot ``i % slots`` of ``ring`` (slots: its first dim) once every consumer
    has freed the slot (a fresh barrier counts as freed: the first wait is on phase 1), completing on the
    slot's ``ready`` barrier. ``tail_desc``: the tile's second part (a head dim held in two,
    :func:`gstar.kernels.common.sizes.head_parts`), from ``tail_coord`` into the same slot of ``tail``, on the same
    barrier."""
    slots: gl.constexpr = ring.shape[0]
    mbarrier.wait(empty.index(i % slots), ((i // slots) & 1) ^ 1)
    if tail_desc is None:
        mbarrier.expect(ready.index(i % slots), desc.block_type.nbytes)
    else:
        mbarrier.expect(ready.index(i % slots), desc.block_type.nbytes + tail_desc.block_type.nbytes)
        tma_load(tail_desc, tail_coord, ready.index(i % slots), tail.index(i % slots))
    tma_load(desc, coord, ready.index(i % slots), ring.index(i % slots))


@gluon.jit
def operand(p, acc, dtype: gl.constexpr):
    """P as the register A operand (rows, BLOCK_N) in ``dtype`` of a product into ``acc``: from the words of
    :func:`gstar.kernels.sm90.forward._carry`, or from float32 (FP8's P, the backward's operands)."""
    if p.dtype == gl.int32:  # each word's halves, joined back: the same registers
        lo, hi = gl.inline_asm_elementwise("mov.b32 {$0, $1}, $2;", "=h,=h,r", [p], dtype=(dtype.value, dtype.value),
                                           is_pure=True, pack=1)
        p = gl.join(lo, hi).reshape([p.shape[0], 2 * p.shape[1]])  # (rows, BLOCK_N)
    return gl.convert_layout(p.to(dtype), gl.DotOperandLayout(operand_index=0, parent=acc.type.layout, k_width=2))


@functools.lru_cache(maxsize=None)
def _swizzle(rows: int, width: int, dtype: torch.dtype):
    """The shared-memory layout of a (1, 1, rows, width) tile that wgmma or a TMA copy reads (asked once per
    shape; FP8 for FP8 inputs, float32 for a float32 output and the backward's dQ tiles)."""
    return gl.NVMMASharedLayout.get_default_for([1, 1, rows, width], _GL_ALL[dtype])


def descriptor(t: torch.Tensor, rows: int, width: int | None = None) -> TensorDescriptor:
    """A descriptor over ``t`` (B, H, N, D) moving (1, 1, rows, width) tiles (default: all D lanes), swizzled
    for wgmma."""
    width = width or t.shape[3]
    return TensorDescriptor(t, list(t.shape), list(t.stride()), [1, 1, rows, width], _swizzle(rows, width, t.dtype))
