"""FP8 attention: float8_e4m3fn inputs with descales, forward only.

The scores are ``(q * q_descale) . (k * k_descale)`` and the output ``P (v * v_descale)``, as if the inputs had
been dequantised. Descales follow FlashAttention-3: float32, one per (sequence, kv head), ``(B, Hkv)``, or any
shape that broadcasts to it (a scalar for per-tensor scaling); the query heads of a GQA group share their kv
head's ``q_descale``. :func:`quantize_fp8` makes them.

On CUDA (compute capability 8.9 and newer) the forward kernels run ``Q K^T`` on the FP8 tensor cores and the
descales fold into the softmax's score factor and the finished output; ``P V`` runs in bfloat16 (V widened in one
streaming pass before the launch), because P quantised to FP8's 3 bits of mantissa misses the accuracy bar
(docs/design.md section 4) that bfloat16's 8 keep. The decode kernel widens a cache's values to float16 in
registers and runs ``P V`` in float16, and under 16-bit queries its keys and ``Q K^T`` too (bfloat16 queries
scaled by a power of two into float16's range). The PyTorch path (CPU, ``backend="torch"``) runs on the
dequantised inputs in the output dtype.
"""

from __future__ import annotations

import torch

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0  # the largest finite e4m3fn value
AMAX_FLOOR = 2.0 ** -100  # an all-zero group's stand-in magnitude: its descale and 1 / descale stay finite
OUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def quantize_fp8(x: torch.Tensor, *, per: str = "head", kv_heads: int | None = None,
                 cu_seqlens: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(x_fp8, descale)``: ``x`` scaled so that its largest magnitude per scaling group is e4m3's largest
    (448), rounded to ``torch.float8_e4m3fn``, and the float32 ``descale`` that undoes the scaling
    (``x ~ x_fp8 * descale``).

    per="head": one descale per (sequence, head) of ``x`` (B, H, N, D) -> (B, H); of packed ``x`` (total, H, D)
        with ``cu_seqlens`` (num_seqs + 1,) -> (num_seqs, H). ``kv_heads``: for queries, one descale per GQA
        group of ``H // kv_heads`` heads -> (B or num_seqs, kv_heads), the shape attention takes.
    per="tensor": one descale for the whole tensor (any layout, a paged cache included), a 0-d tensor.
    """
    if not isinstance(x, torch.Tensor) or not x.is_floating_point() or x.dtype == FP8:
        raise TypeError(f"x must be a floating-point tensor other than FP8, got {getattr(x, 'dtype', type(x))}")
    if per == "tensor":
        amax = x.detach().abs().amax().float()
    elif per == "head":
        amax = _head_amax(x, cu_seqlens)                                                  # (B or S, H)
        if kv_heads is not None:
            if not isinstance(kv_heads, int) or kv_heads < 1 or amax.shape[1] % kv_heads:
                raise ValueError(f"kv_heads must be a positive int dividing the heads ({amax.shape[1]}), got "
                                 f"{kv_heads!r}")
            amax = amax.view(amax.shape[0], kv_heads, -1).amax(-1)                         # (B or S, Hkv)
    else:
        raise ValueError(f"per must be 'head' or 'tensor', got {per!r}")
    descale = amax.clamp_min(AMAX_FLOOR) / FP8_MAX
    factor = (1.0 / descale)
    if per == "head":
        factor = expand(factor, x.shape[1], cu_seqlens, x)
    x_fp8 = (x.float() * factor).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return x_fp8, descale


def _head_amax(x: torch.Tensor, cu_seqlens) -> torch.Tensor:
    if cu_seqlens is None:
        if x.dim() != 4:
            raise ValueError(f"per='head' takes x (B, H, N, D), or (total, H, D) with cu_seqlens; got shape "
                             f"{tuple(x.shape)} (use per='tensor' for other layouts)")
        return x.detach().abs().amax(dim=(2, 3)).float()                                  # (B, H)
    if x.dim() != 3:
        raise ValueError(f"with cu_seqlens, x must be packed (total, H, D), got shape {tuple(x.shape)}")
    seq = _sequence_of_rows(cu_seqlens, x.shape[0])                                       # (total,)
    rows = x.detach().abs().amax(-1).float()                                              # (total, H)
    amax = rows.new_zeros((cu_seqlens.shape[0] - 1, x.shape[1]))                         # |x| >= 0
    return amax.scatter_reduce_(0, seq[:, None].expand_as(rows), rows, "amax")            # (S, H)


def _sequence_of_rows(cu_seqlens: torch.Tensor, total: int) -> torch.Tensor:
    """The sequence each packed row belongs to, (total,) int64, computed on the device (no sync)."""
    rows = torch.arange(total, device=cu_seqlens.device)
    return torch.searchsorted(cu_seqlens[1:].long(), rows, right=True)


def expand(descale: torch.Tensor, heads: int, cu_seqlens, like: torch.Tensor) -> torch.Tensor:
    """A (B or S, Hkv or H) descale broadcast against ``like``: (B, H, 1, 1) for a dense (B, H, N, D) tensor,
    (total, H, 1) for a packed one (``cu_seqlens`` given); each kv head's value repeated over its group."""
    descale = descale.repeat_interleave(heads // descale.shape[1], dim=1)                 # (B or S, H)
    if cu_seqlens is None:
        return descale[:, :, None, None]
    return descale[_sequence_of_rows(cu_seqlens, like.shape[0])][:, :, None]


def dequantize(x: torch.Tensor, descale: torch.Tensor | None, cu_seqlens, dtype: torch.dtype) -> torch.Tensor:
    """``x * descale`` in ``dtype`` (descale None: 1): the inputs the PyTorch path attends to."""
    if descale is None:
        return x.to(dtype)
    return (x.float() * expand(descale, x.shape[1 if cu_seqlens is not None else 1], cu_seqlens, x)).to(dtype)


def check(q, k, v, *, q_descale, k_descale, v_descale, out_dtype, sinks, scale, batch: int, kv_heads: int,
          backend: str, check_values: bool = True) -> tuple[tuple, torch.dtype] | None:
    """The FP8 arguments of an attention call: None when k is not FP8 (then descales and out_dtype must be None
    too); else (q FP8, or 16-bit against an FP8 cache) ``(descales, out_dtype)``, descales the tuple of q's, k's
    and v's descales as the kernels take them: each None (one: not given, or a 16-bit q's) or a float32 view
    broadcast to (batch, kv_heads) on q's device (no copy, so a call launches nothing of its own for them).
    Their values are checked positive and finite (one sync) unless ``check_values`` is False, torch.compile
    traces or a CUDA graph is being captured."""
    descales = {"q_descale": q_descale, "k_descale": k_descale, "v_descale": v_descale}
    if k.dtype != FP8:
        given = [name for name, d in descales.items() if d is not None] + (["out_dtype"] if out_dtype else [])
        if given:
            raise ValueError(f"{', '.join(given)} apply to FP8 inputs (torch.float8_e4m3fn); k is {k.dtype}")
        return None
    if q.dtype != FP8 and q_descale is not None:
        raise ValueError(f"q_descale applies to FP8 queries; q is {q.dtype}")
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (q, k, v, sinks)):
        raise RuntimeError("FP8 attention is forward only: call it under torch.no_grad() (or detach the "
                           "sinks); its backward is not implemented")
    if scale <= 0:
        raise ValueError(f"FP8 attention takes a positive scale, got {scale}")
    if backend == "triton":
        if q.device.type != "cuda" or torch.cuda.get_device_capability(q.device) < (8, 9):
            raise RuntimeError("FP8 attention on the Triton backend needs a CUDA GPU of compute capability 8.9 or "
                               "newer; backend='torch' runs it on the dequantised inputs")
        if q.dtype == FP8 and q.shape[-1] <= 16:
            raise ValueError(f"FP8 attention on the Triton backend needs a head dim above 16 (FP8 tensor cores "
                             f"reduce 32 lanes at a time), got {q.shape[-1]}")
    out_dtype = out_dtype or (torch.bfloat16 if q.dtype == FP8 else q.dtype)
    if out_dtype not in OUT_DTYPES:
        raise TypeError(f"out_dtype must be one of {OUT_DTYPES}, got {out_dtype}")
    views = []
    for name, d in descales.items():
        if d is None:
            views.append(None)
            continue
        if not isinstance(d, torch.Tensor) or not d.is_floating_point() or d.device != q.device:
            raise TypeError(f"{name} must be a float tensor on {q.device}, got "
                            f"{getattr(d, 'dtype', type(d).__name__)} on {getattr(d, 'device', '-')}")
        try:
            views.append(d.float().expand(batch, kv_heads))                               # (batch, Hkv)
        except RuntimeError:
            raise ValueError(f"{name} must broadcast to ({batch}, {kv_heads}) (sequences, kv heads), got shape "
                             f"{tuple(d.shape)}") from None
    given = [(name, d) for name, d in zip(descales, views) if d is not None]
    # neither a graph being compiled nor a CUDA graph capture can read values on the host (compiling asks
    # first: Dynamo cannot trace the capture query)
    if given and check_values and not torch.compiler.is_compiling() and not (
            q.device.type == "cuda" and torch.cuda.is_current_stream_capturing()):
        stacked = torch.stack([d for _, d in given])                                      # (given, batch, Hkv)
        good = ((stacked > 0) & stacked.isfinite()).flatten(1).all(1).tolist()  # one sync for all of them
        bad = [name for (name, _), ok in zip(given, good) if not ok]
        if bad:
            raise ValueError(f"{', '.join(bad)} must be positive and finite")
    return tuple(views), out_dtype
