"""Per-layout launch plans (``_plan`` of gstar.kernels.portable.forward and .backward): a plan is
derived once per layout and reused, and layouts that differ in anything the launch depends on never share
one.

One shape runs through a sequence of calls that each change one thing (strides, scale, learned sinks, an
LSE gradient, the window, the dtype): every float32 call's outputs and gradients must match the float64
oracle, and a call served from the caches must give bitwise what the same call gives with plans derived afresh. Runs
on the interpreter (CPU) and on the GPU, where the launch cache also serves the repeats.
"""

import pytest
import torch

import gstar
from gstar.lab.accuracy import relative_error
from gstar.kernels.portable import backward as portable_backward
from gstar.kernels.portable import forward as portable_forward
from gstar.reference import naive_attention
from inputs import make_qkv

B, Hq, Hkv, N, D = 1, 4, 2, 37, 24


def _run(device, dtype=torch.float32, layout="bhnd", scale=None, sinks=False, lse_grad=False, window=(-1, -1)):
    """``(got, want)``: gstar's (out, lse, dq, dk, dv[, dsinks]) and the float64 oracle's."""
    torch.manual_seed(0)
    q, k, v = make_qkv(B, Hq, Hkv, N, N, D, dtype, device, layout)
    s = torch.randn(Hq, device=device) * 2 if sinks else None
    dout = torch.randn(B, Hq, N, D, device=device).to(dtype)
    dlse = torch.randn(B, Hq, N, device=device) if lse_grad else None
    results = []
    for impl, cast in (("gstar", None), ("oracle", torch.float64)):
        leaves = [(t if cast is None else t.to(cast)).detach().requires_grad_() for t in (q, k, v)]
        if s is not None:
            leaves.append((s if cast is None else s.double()).detach().requires_grad_())
        kwargs = dict(causal=True, window=window, sinks=leaves[3] if sinks else None, scale=scale)
        if impl == "gstar":
            out, lse = gstar.flash_attention(*leaves[:3], backend="triton", return_lse=True, **kwargs)
        else:
            out, lse = naive_attention(*leaves[:3], **kwargs)
        outputs, grads = [out], [dout.to(out.dtype)]
        if dlse is not None:
            outputs.append(lse)
            grads.append(dlse.to(lse.dtype))
        results.append((out, lse, *torch.autograd.grad(outputs, leaves, grads)))
    return results


CHANGES = [dict(), dict(layout="bnhd"), dict(scale=0.3), dict(sinks=True), dict(sinks=True, lse_grad=True),
           dict(window=(5, 0)), dict(layout="packed", window=(5, 0), sinks=True)]


def test_calls_that_differ_in_one_thing_each_match_the_oracle(device):
    first = None
    for change in CHANGES:
        got, want = _run(device, **change)
        for name, g, w in zip(("out", "lse", "dq", "dk", "dv", "dsinks"), got, want):
            assert relative_error(g, w) < 1e-4, (change, name)
        first = first or got
    again, _ = _run(device)
    for a, b in zip(first, again):
        assert torch.equal(a, b)


def test_a_repeated_layout_reuses_its_plans(device):
    _run(device, sinks=True)
    hits = portable_forward._plan.cache_info().hits, portable_backward._plan.cache_info().hits
    _run(device, sinks=True)
    assert portable_forward._plan.cache_info().hits == hits[0] + 1
    assert portable_backward._plan.cache_info().hits == hits[1] + 1


@pytest.mark.slow
def test_cached_plans_give_what_fresh_ones_give(device):
    """Each call again, served from the plan caches, against the same call with empty caches (a plan of its
    own, derived afresh): bitwise equal. Two layouts sharing a key would fail here."""
    changes = CHANGES + [dict(dtype=torch.float16), dict(dtype=torch.float16, layout="bnhd", sinks=True)]
    for change in changes:
        _run(device, **change)
    cached = [_run(device, **change)[0] for change in changes]
    for change, got in zip(changes, cached):
        portable_forward._plan.cache_clear()
        portable_backward._plan.cache_clear()
        fresh, _ = _run(device, **change)
        for a, b in zip(got, fresh):
            assert torch.equal(a, b), change
