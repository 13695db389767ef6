"""Random attention inputs in the layouts the kernels must accept, shared by the kernel tests."""

import torch


def make_qkv(B, Hq, Hkv, Nq, Nk, D, dtype, device=None, layout="bhnd", magnitude=1.0):
    """q: (B, Hq, Nq, D), k, v: (B, Hkv, Nk, D) in ``dtype`` (``device=None``: torch's default device).

    ``layout="bnhd"`` stores them as transposed (B, N, H, D) tensors; ``"packed"`` also slices k and v out
    of one (B, Nk, 2 * Hkv, D) buffer, as fused QKV projections do.
    """
    def rand(*shape):
        return (torch.randn(*shape, device=device) * magnitude).to(dtype)

    if layout == "bhnd":
        return rand(B, Hq, Nq, D), rand(B, Hkv, Nk, D), rand(B, Hkv, Nk, D)
    q = rand(B, Nq, Hq, D).transpose(1, 2)
    if layout == "bnhd":
        return q, rand(B, Nk, Hkv, D).transpose(1, 2), rand(B, Nk, Hkv, D).transpose(1, 2)
    kv = rand(B, Nk, 2 * Hkv, D)
    return q, kv[:, :, :Hkv].transpose(1, 2), kv[:, :, Hkv:].transpose(1, 2)
