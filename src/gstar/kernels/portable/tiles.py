"""Tile sizes and launch settings of the portable kernels, in one small table per kernel.

Every kernel asks here and nowhere else, so that tuning touches only this file. The rows are the fastest of
``scripts/tune-forward`` and ``scripts/tune-backward``'s sweeps on an H100 / H200 (benchmarks/NOTES.md keeps
each sweep); the comments give each row's reason. The CUDA rows are chosen
for Hopper (H100: 228 KiB shared memory per SM): the Q tile stays resident and K/V tiles are pipelined
``num_stages`` deep, so the budget is roughly ``(BLOCK_M + 2 * num_stages * BLOCK_N) * D_PAD * bytes``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ...pattern import Pattern
from ..common.sizes import next_power_of_2, pad_head_dim
from .. import card

# (largest width, BLOCK_M, BLOCK_N, num_warps, num_stages, HALVES); the first row whose width fits wins,
# where a call's width is the mean of its padded head dims D and Dv (:func:`width`), D itself when they
# are equal. The D = 256 row is checked by compiling for sm_90 only (no register spills). Wider heads (latent decoding's
# 576 / 512) take short tiles that keep the (BLOCK_M, Dv) accumulator and the Q tile on chip: serving
# shapes, where K/V traffic sets the time.
_FORWARD_16BIT = (
    (64, 128, 64, 4, 3, False),
    (128, 256, 64, 8, 4, True),
    (192, 128, 64, 8, 3, False),
    (256, 128, 32, 8, 2, False),
    (512, 64, 32, 4, 2, False),
    (1024, 32, 16, 4, 2, False),
)
# HALVES needs Hopper's asynchronous MMA to overlap anything, and 256-row tiles waste most of their rows on
# short queries: there the D <= 128 row before HALVES (the fastest then) stands in.
_FORWARD_WITHOUT_HALVES = (128, 128, 8, 3)
# A narrow window (GPT-OSS's 128-key layers) visits few KV blocks per Q tile: short Q tiles waste fewer
# masked keys at the band's edges and give the SMs more programs.
_NARROW_WINDOW = 256
_FORWARD_NARROW_16BIT = (64, 64, 4, 2)  # BLOCK_M, BLOCK_N, num_warps, num_stages
# With GQA heads to pack (at least _NARROW_MIN_PACK), 128-row tiles of 32-key blocks do better at head dim
# 64: each program covers 32 or 16 positions of 4 or 8 heads, so the band it walks is as narrow as a short
# tile's while half as many programs start, and 32-key blocks waste fewer masked keys at its edges (other head
# dims, not measured, keep the row above).
_FORWARD_NARROW_PACKED = (128, 32, 4, 3)
_NARROW_MIN_PACK = 4

# float32 tiles take twice the shared memory and registers (IEEE dots run on FMA units, not tensor cores)
_FORWARD_FP32 = (
    (64, 64, 32, 8, 2, False),
    (128, 64, 32, 8, 2, False),
    (256, 32, 32, 8, 2, False),
    (1024, 16, 16, 4, 1, False),
)
# Under the Triton interpreter (CPU tensors) small tiles make tests cover several blocks and stay fast.
_FORWARD_INTERPRETER = {"BLOCK_M": 16, "BLOCK_N": 16, "num_warps": 1, "num_stages": 1, "HALVES": False}
# Kernel switches (scripts/tune-forward times each). PACK_GQA: query
# heads of one GQA group per tile, so each K/V block is loaded once for the whole pack; each head keeps at
# least _PACK_MIN_ROWS positions of the tile. FLAT (narrow windows only): one masked loop over the band
# instead of three short ones, each of which fills and drains the software pipeline. HALVES (a column of the
# tables): two softmax states per tile, so that one half's softmax overlaps the other half's products.
_FORWARD_PACK_GQA = 8
_PACK_MIN_ROWS = 16
_FORWARD_FLAT_NARROW = True


def _band_width(pattern: Pattern) -> int | None:
    """Keys a row's band spans at most: the window's ``left + right + 1``, or its chunk's if narrower; None when
    neither bounds it."""
    band = None if pattern.left < 0 or pattern.right < 0 else pattern.left + pattern.right + 1
    if pattern.chunk:
        band = min(band or pattern.chunk, pattern.chunk)
    return band


def width(head_dim: int, value_dim: int | None = None) -> int:
    """The head width the tile tables are keyed by: the mean of the padded D and Dv (D's padded width when
    they are equal). The Q tile and the K stages hold D lanes, the V stages and the accumulators Dv, so the
    mean tracks the shared memory and registers a tile needs."""
    return (pad_head_dim(head_dim) + pad_head_dim(value_dim or head_dim)) // 2


def forward_config(head_dim: int, dtype: torch.dtype, pattern: Pattern, device, group: int = 1,
                   value_dim: int | None = None) -> dict:
    """Launch settings of the forward kernel.

    head_dim: D (1..1024); dtype: q's dtype; pattern: the normalised attention pattern; device: q's device;
    group: Hq // Hkv; value_dim: Dv (default D). Returns ``{"BLOCK_M", "BLOCK_N", "num_warps", "num_stages"}``
    (BLOCK_M counts tile rows over all packed heads) plus the kernel switches ``"PACK_GQA"`` (query heads per
    tile, a power of two dividing ``group``), ``"FLAT"`` and ``"HALVES"`` (bool).
    """
    if torch.device(device).type != "cuda":
        return dict(_FORWARD_INTERPRETER, PACK_GQA=1, FLAT=False)
    head_dim = width(head_dim, value_dim)
    table = _FORWARD_FP32 if dtype == torch.float32 else _FORWARD_16BIT
    block_m, block_n, num_warps, num_stages, halves = next(row[1:] for row in table if head_dim <= row[0])
    band = _band_width(pattern)
    narrow = band is not None and band <= _NARROW_WINDOW
    major = card.capability_major(torch.device(device))
    # a head's rows of a tile need not outnumber the queries: decode (Nq = 1) packs a whole group
    min_rows = min(_PACK_MIN_ROWS, next_power_of_2(pattern.nq))
    if halves and (major < 9 or pattern.nq < block_m):
        (block_m, block_n, num_warps, num_stages), halves = _FORWARD_WITHOUT_HALVES, False
    if narrow and dtype != torch.float32 and head_dim <= 128:
        packed = 32 < head_dim <= 64 and _pack(group, _FORWARD_NARROW_PACKED[0], min_rows) >= _NARROW_MIN_PACK
        (block_m, block_n, num_warps, num_stages), halves = (
            _FORWARD_NARROW_PACKED if packed else _FORWARD_NARROW_16BIT), False
    if pattern.nq <= 64:
        block_m = min(block_m, 64)  # short queries (decode, chunked prefill): don't compute dead rows
    if band is not None and band <= 64:
        block_n = min(block_n, 32)  # narrow windows: smaller KV blocks waste fewer masked keys
    if major < 9:
        num_stages = min(num_stages, 2)  # pre-Hopper parts have less shared memory per SM
    pack = _pack(group, block_m, min_rows)
    if pattern.nq < _PACK_MIN_ROWS:
        block_m = max(16, min(block_m, pack * min_rows))  # tl.dot needs 16 rows
    return {"BLOCK_M": block_m, "BLOCK_N": block_n, "num_warps": num_warps, "num_stages": num_stages,
            "PACK_GQA": pack, "FLAT": narrow and _FORWARD_FLAT_NARROW, "HALVES": halves}


def _pack(group: int, block_m: int, min_rows: int) -> int:
    """Query heads of a GQA group per tile of ``block_m`` rows: the largest power of two up to
    _FORWARD_PACK_GQA that divides ``group`` and leaves each head at least ``min_rows`` rows."""
    pack = 1
    while pack * 2 <= _FORWARD_PACK_GQA and group % (pack * 2) == 0 and block_m // (pack * 2) >= min_rows:
        pack *= 2
    return pack


def dot_precision(dtype: torch.dtype) -> str:
    """IEEE float32 dots unless the user allowed TF32 (docs/design.md section 1); 16-bit inputs ignore it."""
    if dtype != torch.float32:
        return "tf32"
    matmul = torch.backends.cuda.matmul
    # PyTorch >= 2.9 has a newer switch; reading the legacy one once the new one is set raises
    precision = getattr(matmul, "fp32_precision", "none")
    allowed = matmul.allow_tf32 if precision == "none" else precision == "tf32"
    return "tf32" if allowed else "ieee"


@dataclass(frozen=True)
class BackwardConfig:
    """Tiles and launch settings of the two main backward kernels.

    ``_dkdv`` walks Q tiles of ``dkdv_m`` rows over a KV tile of ``dkdv_n`` keys (``dkdv_warps`` warps,
    ``dkdv_stages`` pipeline stages); ``_dq`` walks KV blocks of ``dq_n`` keys over a Q tile of ``dq_m`` rows.
    ``head_splits`` (a divisor of the GQA group) and ``q_chunk`` (Q tiles per dK/dV program) split the dK/dV
    work over more programs whose float32 partial sums are added in a fixed order; 0 lets
    :func:`gstar.kernels.portable.schedule.split_plan` choose from the SM count (1 and unbounded when the grid is
    already large). ``flat`` runs each program's tiles as one pipelined loop with every tile masked,
    instead of one loop per (head, masked / unmasked range): narrow windows have few tiles per range, and
    short loops spend most of their time filling and draining the pipeline. ``dkdv_tma`` and ``dq_tma``
    move the tiles that each step loads (dK/dV: Q and dO; dQ: K and V) through tensor descriptors
    (:mod:`gstar.kernels.common.descriptors`) where the operands allow it. ``dq_pack`` stacks that many query
    heads of a GQA group in a dQ tile (``dq_m // dq_pack`` positions each), as the forward's ``PACK_GQA``;
    like it, a request: it shrinks to the largest power of two dividing the group. ``dq_registers`` caps the
    dQ kernel's registers per thread (0: the compiler's choice).
    """

    dkdv_m: int
    dkdv_n: int
    dq_m: int
    dq_n: int
    dkdv_warps: int = 4
    dkdv_stages: int = 1
    dq_warps: int = 4
    dq_stages: int = 1
    head_splits: int = 0
    q_chunk: int = 0
    flat: bool = False
    dkdv_tma: bool = False
    dq_tma: bool = False
    dq_pack: int = 1
    dq_registers: int = 0


# 16-bit rows: (largest padded head dim, narrow band only, dkdv (m, n, warps, stages, tma),
# dq (m, n, warps, stages, tma));
# the first row that matches wins. dK/dV keep two (dkdv_n, D_PAD) float32 accumulators and the K/V tile of
# a program resident, so the key tile is as long as registers allow and the Q tile short; dQ is the mirror
# image. Hopper's wgmma gives each warpgroup (4 warps) 64 rows of a product, so 8 warps want 128-row
# tiles (dkdv_n = 128, dq_m = 128): with 64 rows Triton lays the scores out over both warpgroups twice.
# At D = 128 the 64x128 dK/dV tile spills a little (scripts/kernel-sass) and still beats the spill-free
# 32x128; D <= 64 takes three dK/dV stages. TMA: descriptor loads of the per-step tiles make dQ faster at
# every head dim and dK/dV at D <= 64, and dK/dV at D = 128 slower. Triton encodes the descriptors in Python
# at every launch, more host time than the narrow window's kernels gain, so narrow windows keep pointers, and
# so do backward passes under _DESCRIPTOR_MIN_WORK (B * Hq * Nq * keys per row (the window's width, or Nk) *
# D_PAD): their GPU work is too short for the host to stay ahead of it. The float32 rows are for accuracy,
# not speed, and keep the pointer path, as does the D = 256 row (its tiles the fastest of ten on the Gemma rows;
# its descriptors not timed).
_DESCRIPTOR_MIN_WORK = 10 ** 10
_BACKWARD_16BIT = (
    (64, True, (64, 64, 4, 3, False), (64, 64, 4, 2, False)),   # narrow window: a KV tile is seen by few Q tiles
    (64, False, (64, 64, 4, 3, True), (128, 64, 8, 2, True)),
    (128, False, (64, 128, 8, 3, False), (128, 64, 8, 3, True)),
    (192, False, (32, 128, 8, 2, False), (128, 64, 8, 2, True)),  # latent attention's D 192 / Dv 128
    (256, False, (32, 64, 8, 2, False), (64, 64, 8, 2, False)),   # Gemma: 0.54-0.56x the 16 x 32 tiles' time
    (1024, False, (16, 16, 4, 1, False), (16, 16, 4, 1, False)),  # latent attention's widths: correct, not fast
)
# Narrow windows at head dim 64 with GQA heads to pack: dQ tiles of 16 positions of 4 heads over 32-key
# blocks, as the forward's packed tiles (each program's band spans 143 keys instead of 191); 8 heads per
# tile, 128-row tiles and causal patterns are slower or even.
_DQ_NARROW_PACKED = (64, 32, 4, 2, False)
_DQ_NARROW_PACK = 4
# dQ's 8-warp tiles at head dim <= 64 fit two programs per SM (65,536 registers) at up to 128 registers a
# thread; learned sinks' P * dP row sums take the compiler to 134, and one program an SM; capped at 128 it
# spills nothing.
_DQ_TWO_PROGRAMS = 128


def backward_config(head_dim: int, dtype: torch.dtype, pattern: Pattern, device, batch_heads: int = 1,
                    group: int = 1, value_dim: int | None = None) -> BackwardConfig:
    """Launch settings of the backward kernels (same arguments as :func:`forward_config`, and
    ``batch_heads`` = B * Hq, which with the pattern sizes the work for the descriptor switches).

    Under the interpreter the tiles are small and unequal, so that the two block tables differ and tests
    span several tiles; the dK/dV split is left to :func:`gstar.kernels.portable.schedule.split_plan` (which does not
    split on CPU: tests force it through ``head_splits`` / ``q_chunk``).
    """
    if torch.device(device).type != "cuda":
        return BackwardConfig(16, 32, 32, 16, dkdv_warps=1, dq_warps=1)
    head_dim = d_pad = width(head_dim, value_dim)
    if dtype == torch.float32:  # IEEE dots run on FMA units and float32 tiles take twice the registers
        if d_pad > 128:
            return BackwardConfig(16, 16, 16, 16)
        return BackwardConfig(16, 32, 32, 16)
    band = _band_width(pattern)
    narrow = band is not None and band <= _NARROW_WINDOW
    dkdv, dq = next((r[2], r[3]) for r in _BACKWARD_16BIT if d_pad <= r[0] and (narrow or not r[1]))
    dq_pack = 1
    if narrow and 32 < head_dim <= 64 and group % _DQ_NARROW_PACK == 0:
        dq, dq_pack = _DQ_NARROW_PACKED, _DQ_NARROW_PACK
    work = batch_heads * pattern.nq * min(pattern.nk, (band or pattern.nk) + pattern.sink_tokens) * d_pad
    # descriptors need Hopper's copy engine, and enough work to hide their host cost
    tma = card.capability_major(torch.device(device)) >= 9 and work >= _DESCRIPTOR_MIN_WORK
    return BackwardConfig(dkdv[0], dkdv[1], dq[0], dq[1], dkdv_warps=dkdv[2], dkdv_stages=dkdv[3],
                          dq_warps=dq[2], dq_stages=dq[3], flat=narrow, dkdv_tma=dkdv[4] and tma,
                          dq_tma=dq[4] and tma, dq_pack=dq_pack,
                          dq_registers=_DQ_TWO_PROGRAMS if d_pad <= 64 and dq[2] == 8 else 0)
