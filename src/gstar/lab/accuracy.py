"""The correctness bar of docs/design.md section 4, shared by the tests and ``gstar check``.

flash-attn's method: an implementation passes when its maximum error against a high-precision oracle is
at most ``factor`` times the error of the naive PyTorch implementation run in the same (low) dtype, plus
a small absolute slack. ``factor`` is 2 for outputs and 3 for gradients.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class Verdict:
    """One comparison: the measured error, the allowed error, and whether it passed."""

    name: str
    error: float
    allowed: float

    @property
    def ok(self) -> bool:
        return self.error <= self.allowed  # False for NaN errors, which is what we want

    def __str__(self) -> str:
        return f"{self.name}: err {self.error:.3g} <= {self.allowed:.3g}" if self.ok else \
            f"{self.name}: err {self.error:.3g} > {self.allowed:.3g} FAIL"


def max_error(x: torch.Tensor, ref: torch.Tensor) -> float:
    """max |x - ref| in float64, with inf matching inf of the same sign (an empty row's LSE) and NaN failing."""
    x, ref = x.double(), ref.to(x.device).double()
    same_inf = torch.isinf(x) & torch.isinf(ref) & (torch.sign(x) == torch.sign(ref))
    diff = torch.where(same_inf, torch.zeros_like(x), (x - ref).abs())
    if diff.numel() == 0:
        return 0.0
    if torch.isnan(diff).any():
        return float("nan")
    return float(diff.max())


def verdict(name: str, out: torch.Tensor, ref: torch.Tensor, out_pt: torch.Tensor, factor: float = 2.0,
            atol: float = 1e-5) -> Verdict:
    """``max|out - ref| <= factor * max|out_pt - ref| + atol``."""
    return Verdict(name, max_error(out, ref), factor * max_error(out_pt, ref) + atol)


def relative_error(x: torch.Tensor, ref: torch.Tensor) -> float:
    """``||x - ref|| / ||ref||`` over finite reference entries (the float32 bar: below 1e-4)."""
    x, ref = x.double(), ref.to(x.device).double()
    finite = torch.isfinite(ref)
    if torch.isnan(x[finite]).any() or (~torch.isfinite(x) & finite).any():
        return float("nan")
    num = (x[finite] - ref[finite]).norm()
    den = ref[finite].norm().clamp_min(1e-30)
    return float(num / den)
