"""One row of ``gstar bench``: check an implementation against the oracle with the bar of docs/design.md
section 4, then time it and weigh it (section 5).

Each row's status is ``ok``, ``WRONG`` (it ran but missed the bar; still timed, so a fast wrong peer is
visible as such), ``n/a`` (the peer cannot express the case, with the reason), ``OOM`` or ``error``.
"""

from __future__ import annotations

import functools

import torch

from ...varlen import pad
from .cases import Case
from .measure import captured, fp8_descales, is_oom, judge_all, nbytes, peak_bytes, time_ms
from .peers import Peer

_NO_KERNEL = ("no available kernel", "no viable backend", "not supported", "unsupported")


def _layout(layout: str, case: Case, device: torch.device):
    """``(leaf, view, back)`` of a peer's input layout: ``leaf(t)`` makes, from an input in the case's layout,
    the tensor the peer's gradients are taken for; ``view(leaf)`` is what the peer receives, ``(B, H, N, D)``;
    ``back(x)`` brings a tensor shaped like the views (the output, a gradient's view) to the case's layout.
    """
    if layout == "bnhd":  # (B, N, H, D) memory seen as (B, H, N, D)
        return (lambda t: t.transpose(1, 2).contiguous()), (lambda t: t.transpose(1, 2)), (lambda x: x)
    if layout == "padded":  # a packed case's (total, H, D) tokens right-padded to (B, N, H, D), seen as (B, H, N, D)
        mask = case.padding_mask(device)                                  # (B, N)
        index = mask.flatten().nonzero().squeeze(1)                       # (total,)
        return ((lambda t: pad(t, index, case.batch, case.seqlen)), (lambda t: t.transpose(1, 2)),
                (lambda x: x.transpose(1, 2)[mask]))
    return (lambda t: t.detach()), (lambda t: t), (lambda x: x)  # the case's own layout


def _leaves(inputs: dict, layout, grads: bool, paged: bool = False, packed_queries: bool = False):
    """``(leaves, views, dout_view)``: tensors gradients are taken for (q, k, v in the peer's layout, then
    ``sinks`` if any), the views the implementation receives, and the upstream gradient as a view. A paged
    cache's pools (``k_pages``, ``v_pages``) take the place of k and v as they are, in every peer's layout; so
    do a mixed step's packed queries and upstream gradient, ``(total_q, Hq, D)`` (flash-attn's varlen layout).
    """
    leaf, view, _ = layout
    q_leaf, q_view = ((lambda t: t.detach()), (lambda t: t)) if packed_queries else (leaf, view)
    leaves = [q_leaf(inputs["q"]).requires_grad_(grads)]
    views = [q_view(leaves[0])]
    for name in ("k", "v"):
        t = inputs[f"{name}_pages"] if paged else leaf(inputs[name]).requires_grad_(grads)
        leaves.append(t)
        views.append(t if paged else view(t))
    sinks = inputs["sinks"]
    if sinks is not None:
        sinks = sinks.clone().requires_grad_(grads)
        leaves.append(sinks)
    return leaves, views + [sinks], q_view(q_leaf(inputs["dout"]))


def _row(peer: Peer, case: Case, status: str, reason: str | None = None, **measured) -> dict:
    row = {"case": case.as_dict(), "series": case.series, "impl": peer.name, "status": status, "reason": reason,
           "time_ms": None, "tflops": None, "peak_mib": None, "vs_gstar": None, "checks": []}
    row.update(measured)
    return row


def first_line(exc: BaseException, width: int) -> str:
    """An exception's first line, at most ``width`` characters (its type's name if it has no message)."""
    text = str(exc).strip()
    return text.splitlines()[0][:width] if text else type(exc).__name__


def not_measured(peer: Peer, case: Case, reason: str) -> dict:
    """The n/a row of ``peer`` on ``case`` when nothing could be measured (e.g. the case has no oracle)."""
    return _row(peer, case, "n/a", reason)


def _timed(fn, device: torch.device, timing: str, stream: torch.cuda.Stream | None = None) -> float:
    """Median ms of ``fn()`` called from Python (``eager``), or of replays of its CUDA graph (``graph``),
    captured on ``stream`` (see :func:`captured`)."""
    if timing == "eager":
        return time_ms(fn, device)
    try:
        graph, _ = captured(fn, device, stream)
    except Exception as exc:
        raise _NotCapturable(first_line(exc, 120))
    t = time_ms(graph.replay, device)
    del graph
    return t


NOT_CAPTURABLE = "not capturable in a CUDA graph"  # the reason's start in an n/a row


class _NotCapturable(Exception):
    """The implementation's call cannot be captured in a CUDA graph (``--timing graph``)."""


def run_row(peer: Peer, case: Case, mode: str, inputs: dict, ref: dict, pt: dict | None,
            device: torch.device, timing: str = "eager") -> dict:
    """Check ``peer`` on ``case`` against ``ref`` (with the bar's baseline ``pt``), then time it in ``mode``:
    ``timing="eager"`` calls it from Python, ``"graph"`` (CUDA only) replays it from a CUDA graph, so that
    host time drops out (an implementation that cannot be captured shows as n/a)."""
    reason = (("a decode step is forward only" if case.decode and mode != "fwd" else None)
              or ("FP8 inputs are forward only" if case.fp8 and mode != "fwd" else None)
              or ("no FP8 inputs" if case.fp8 and not peer.fp8 else None)
              or peer.unavailable(device) or peer.unsupported(case, device, mode)
              or (peer.uncapturable(case, device, mode) if timing == "graph" else None))
    if reason:
        return _row(peer, case, "n/a", reason)
    grads = mode != "fwd"
    try:
        fn = peer.build(case, device)
        if case.fp8:
            fn = functools.partial(fn, **fp8_descales(inputs))
        layout = _layout(peer.layout, case, device)
        view, back = layout[1], layout[2]
        leaves, views, dout_view = _leaves(inputs, layout, grads, case.paged, case.mixed)

        def forward():
            return fn(*views)

        def forward_backward():
            return torch.autograd.grad(forward(), leaves, dout_view)

        def forward_only():
            with torch.no_grad():
                return forward()

        if grads:  # one forward with autograd serves both checks (one compilation for compiled peers)
            out = forward()
            got = {"out": back(out.detach())}
            names = ("dq", "dk", "dv", "dsinks")
            got.update({n: back(view(g)) if n != "dsinks" else g
                        for n, g in zip(names, torch.autograd.grad(out, leaves, dout_view))})
            del out
        else:
            got = {"out": back(forward_only())}
        checks = judge_all(got, ref, pt)
        del got
        held = nbytes(*leaves) + (nbytes(dout_view) if grads else 0)
        peak = peak_bytes(forward_backward if grads else forward_only, device, held)
        if mode == "bwd":
            # a captured backward needs its forward on the capture stream (autograd's stream rule)
            stream = torch.cuda.Stream(device) if timing == "graph" else None
            if stream is not None:
                stream.wait_stream(torch.cuda.current_stream(device))
            with torch.cuda.stream(stream):
                out = forward()
            t = _timed(lambda: torch.autograd.grad(out, leaves, dout_view, retain_graph=True), device, timing,
                       stream)
            del out
        else:
            t = _timed(forward_backward if grads else forward_only, device, timing)
    except _NotCapturable as exc:
        return _row(peer, case, "n/a", f"{NOT_CAPTURABLE}: {exc}")
    except Exception as exc:  # a row's failure is a result, not a crash of the whole benchmark
        msg = first_line(exc, 160)
        if is_oom(exc):
            return _row(peer, case, "OOM", msg)
        if peer.guarded:
            return _row(peer, case, "n/a", msg)
        if any(s in msg.lower() for s in _NO_KERNEL):
            return _row(peer, case, "n/a", msg.split(". ")[0])
        return _row(peer, case, "error", f"{type(exc).__name__}: {msg}")
    finally:
        if device.type == "cuda":
            torch.cuda.empty_cache()
    status = "ok" if all(c.ok for c in checks) else "WRONG"
    return _row(peer, case, status, None if status == "ok" else "; ".join(str(c) for c in checks if not c.ok),
                time_ms=t, tflops=case.flops(mode) / (t * 1e-3) / 1e12, peak_mib=peak / 2**20,
                checks=[{"name": c.name, "error": c.error, "allowed": c.allowed, "ok": c.ok} for c in checks])


def add_ratios(rows: list[dict]) -> None:
    """``vs_gstar``: each row's time divided by gstar's on the same case (> 1: slower than gstar)."""
    base = {r["case"]["label"]: r["time_ms"] for r in rows if r["impl"] == "gstar" and r["time_ms"]}
    for r in rows:
        b = base.get(r["case"]["label"])
        r["vs_gstar"] = r["time_ms"] / b if b and r["time_ms"] else None
