"""Tile sizes and launch settings of the Triton kernels, in one small table per kernel.

Every kernel asks here and nowhere else, so that tuning touches only this file. The CUDA rows are chosen
for Hopper (H100: 228 KiB shared memory per SM): the Q tile stays resident and K/V tiles are pipelined
``num_stages`` deep, so the budget is roughly ``(BLOCK_M + 2 * num_stages * BLOCK_N) * D_PAD * bytes``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton

from ..pattern import Pattern

# (largest head dim, BLOCK_M, BLOCK_N, num_warps, num_stages); the first row whose head dim fits wins.
# D <= 128 rows are the fastest of a 28-config sweep (scripts/tune-forward, H200, see benchmarks/NOTES.md);
# the D = 256 row is checked by compiling for sm_90 only (no register spills).
_FORWARD_16BIT = (
    (64, 128, 64, 8, 3),
    (128, 128, 128, 8, 3),
    (256, 128, 32, 8, 2),
)
# A narrow window (GPT-OSS's 128-key layers) visits few KV blocks per Q tile: short Q tiles waste fewer
# masked keys at the band's edges and give the SMs more programs (gpt-oss window: 0.126 ms vs 0.177 ms).
_NARROW_WINDOW = 256
_FORWARD_NARROW_16BIT = (64, 64, 4, 2)  # BLOCK_M, BLOCK_N, num_warps, num_stages
# float32 tiles take twice the shared memory and registers (IEEE dots run on FMA units, not tensor cores)
_FORWARD_FP32 = (
    (64, 64, 32, 8, 2),
    (128, 64, 32, 8, 2),
    (256, 32, 32, 8, 2),
)
# Under the Triton interpreter (CPU tensors) small tiles make tests cover several blocks and stay fast.
_FORWARD_INTERPRETER = {"BLOCK_M": 16, "BLOCK_N": 16, "num_warps": 1, "num_stages": 1}


def forward_config(head_dim: int, dtype: torch.dtype, pattern: Pattern, device) -> dict:
    """Launch settings of the forward kernel: ``{"BLOCK_M", "BLOCK_N", "num_warps", "num_stages"}``.

    head_dim: D (1..256); dtype: q's dtype; pattern: the normalised attention pattern; device: q's device.
    """
    if torch.device(device).type != "cuda":
        return dict(_FORWARD_INTERPRETER)
    table = _FORWARD_FP32 if dtype == torch.float32 else _FORWARD_16BIT
    block_m, block_n, num_warps, num_stages = next(row[1:] for row in table if head_dim <= row[0])
    narrow = 0 <= pattern.left and 0 <= pattern.right and pattern.left + pattern.right + 1 <= _NARROW_WINDOW
    if narrow and dtype != torch.float32 and head_dim <= 128:
        block_m, block_n, num_warps, num_stages = _FORWARD_NARROW_16BIT
    if pattern.nq <= 64:
        block_m = min(block_m, 64)  # short queries (decode, chunked prefill): don't compute dead rows
    if 0 <= pattern.left and 0 <= pattern.right and pattern.left + pattern.right + 1 <= 64:
        block_n = min(block_n, 32)  # narrow windows: smaller KV blocks waste fewer masked keys
    if torch.cuda.get_device_capability(device)[0] < 9:
        num_stages = min(num_stages, 2)  # pre-Hopper parts have less shared memory per SM
    return {"BLOCK_M": block_m, "BLOCK_N": block_n, "num_warps": num_warps, "num_stages": num_stages}


def dot_precision(dtype: torch.dtype) -> str:
    """IEEE float32 dots unless the user allowed TF32 (DESIGN.md section 1); 16-bit inputs ignore it."""
    if dtype != torch.float32:
        return "tf32"
    matmul = torch.backends.cuda.matmul
    # PyTorch >= 2.9 has a newer switch; reading the legacy one after the new one was set raises
    precision = getattr(matmul, "fp32_precision", "none")
    allowed = matmul.allow_tf32 if precision == "none" else precision == "tf32"
    return "tf32" if allowed else "ieee"


def pad_head_dim(d: int) -> int:
    """The head dim the kernels compute with: the next power of two, at least 16 (tl.dot's minimum)."""
    return max(16, triton.next_power_of_2(d))


@dataclass(frozen=True)
class BackwardConfig:
    """Tiles of the two main kernels: ``_dkdv`` walks Q tiles of ``dkdv_m`` rows over a KV tile of
    ``dkdv_n`` keys; ``_dq`` walks KV blocks of ``dq_n`` keys over a Q tile of ``dq_m`` rows."""

    dkdv_m: int
    dkdv_n: int
    dq_m: int
    dq_n: int
    num_warps: int = 4
    num_stages: int = 1


def backward_config(head_dim: int, dtype: torch.dtype, pattern: Pattern, device) -> BackwardConfig:
    """Launch settings of the backward kernels (same arguments as ``configs.forward_config``).

    Chosen so that ptxas reports no register spills for sm_90 (the dK/dV accumulators and the resident
    Q/dO or K/V tiles all live in registers). Under the interpreter the tiles are small and unequal, so that the two block
    tables differ and tests span several tiles.
    """
    if torch.device(device).type != "cuda":
        return BackwardConfig(16, 32, 32, 16, num_warps=1)
    d_pad = pad_head_dim(head_dim)
    if dtype == torch.float32:  # IEEE dots run on FMA units and float32 tiles take twice the registers
        if d_pad > 128:
            return BackwardConfig(16, 16, 16, 16, num_warps=4, num_stages=1)
        return BackwardConfig(16, 32, 32, 16, num_warps=4, num_stages=1)
    if d_pad > 128:
        return BackwardConfig(16, 32, 32, 32, num_warps=4, num_stages=1)
    if d_pad == 128:
        return BackwardConfig(32, 64, 128, 32, num_warps=8, num_stages=2)
    if 0 <= pattern.left and 0 <= pattern.right and pattern.left + pattern.right + 1 <= 256:
        return BackwardConfig(64, 64, 64, 64, num_warps=4, num_stages=2)  # narrow band: less masked waste
    return BackwardConfig(64, 128, 128, 64, num_warps=8, num_stages=2)
