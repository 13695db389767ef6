"""CUDA graph capture (GPU tier): once a shape has run, gstar's forward and backward launch nothing a capture
forbids (no host sync, no host-to-device copy: the per-layout plans and their tile tables are cached), so a
captured step replays with new data and gives bitwise what eager calls give. This is how small, host-bound
shapes get rid of the host time (``torch.cuda.graphs``, or ``torch.compile(mode="reduce-overhead")``).
"""

import pytest
import torch

import gstar
from gstar.lab.bench import measure

pytestmark = pytest.mark.gpu


def _replays_like_eager(inputs, step, stream=None):
    """Capture ``step`` (on ``stream``), then twice: new values into ``inputs``, replay, compare with an eager
    call."""
    graph, captured = measure.captured(step, torch.device("cuda"), stream)
    for _ in range(2):
        with torch.no_grad():
            for t in inputs:
                t.copy_(torch.randn_like(t))
        graph.replay()
        for c, e in zip(captured, step()):
            assert torch.equal(c, e)


@pytest.mark.parametrize("layout,kwargs", [
    ("bhnd", dict(causal=True, window=(63, 0))),                    # narrow window: flat loops
    ("bnhd", dict(causal=True, sink_tokens=4, window=(100, 0))),
    ("bhnd", dict(causal=True)),                                    # split dK/dV with partial sums
])
def test_captured_forward_backward(layout, kwargs):
    B, Hq, Hkv, N, D = 1, 8, 2, 333, 64
    shape = (lambda h: (B, h, N, D)) if layout == "bhnd" else (lambda h: (B, N, h, D))
    q, k, v = (torch.randn(shape(h), device="cuda", dtype=torch.bfloat16) for h in (Hq, Hkv, Hkv))
    if layout == "bnhd":
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    sinks = torch.randn(Hq, device="cuda", requires_grad=True)
    dout = torch.randn(B, Hq, N, D, device="cuda", dtype=torch.bfloat16)

    def step():
        out = gstar.flash_attention(q, k, v, sinks=sinks, **kwargs)
        return (out, *torch.autograd.grad(out, (q, k, v, sinks), dout))

    _replays_like_eager((q, k, v, sinks, dout), step)


def test_captured_backward_alone():
    """A backward captured without its forward (``gstar bench --mode bwd --timing graph``): autograd runs the
    backward on the forward's stream, so the forward runs on the capture stream first; the replays must then
    rewrite the gradients for new upstream values (kernels left outside the capture would not)."""
    q, k, v = (torch.randn(1, h, 333, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
               for h in (8, 2, 2))
    sinks = torch.randn(8, device="cuda", requires_grad=True)
    dout = torch.randn(1, 8, 333, 64, device="cuda", dtype=torch.bfloat16)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        out = gstar.flash_attention(q, k, v, sinks=sinks, causal=True, window=(63, 0))

    def step():
        return torch.autograd.grad(out, (q, k, v, sinks), dout, retain_graph=True)

    _replays_like_eager((dout,), step, stream)


def test_captured_decode_forward():
    """Inference: a no-grad forward of one query against a cache (the decode step a serving loop captures)."""
    q = torch.randn(2, 16, 1, 64, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(2, 4, 700, 64, device="cuda", dtype=torch.bfloat16) for _ in range(2))

    def step():
        with torch.no_grad():
            return (gstar.flash_attention(q, k, v, causal=True, window=(127, 0)),)

    _replays_like_eager((q, k, v), step)


def test_captured_varlen_skips_the_host_check():
    """The varlen entry checks cu_seqlens on the host in eager mode; while a stream captures it cannot (a
    capture forbids the sync), so it trusts them, as inside torch.compile."""
    lengths = [5, 0, 70, 1, 33]
    cu = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32, device="cuda")
    total = sum(lengths)
    q = torch.randn(total, 4, 32, device="cuda", dtype=torch.float16, requires_grad=True)
    k, v = (torch.randn(total, 2, 32, device="cuda", dtype=torch.float16, requires_grad=True) for _ in range(2))
    dout = torch.randn(total, 4, 32, device="cuda", dtype=torch.float16)

    def step():
        out = gstar.flash_attention_varlen(q, k, v, cu, cu, max(lengths), max(lengths), causal=True)
        return (out, *torch.autograd.grad(out, (q, k, v), dout))

    _replays_like_eager((q, k, v, dout), step)


def test_compile_reduce_overhead():
    """torch.compile's CUDA graphs (mode="reduce-overhead") take gstar's operators without skipping the
    graph, and give the eager gradients."""
    from torch._dynamo.utils import counters

    def loss(q, k, v, sinks):
        return gstar.flash_attention(q, k, v, sinks=sinks, causal=True, window=(31, 0)).float().square().sum()

    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(loss, mode="reduce-overhead", fullgraph=True)
    q, k, v = (torch.randn(1, h, 200, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
               for h in (4, 2, 2))
    sinks = torch.randn(4, device="cuda", requires_grad=True)
    want = torch.autograd.grad(loss(q, k, v, sinks), (q, k, v, sinks))
    for _ in range(3):  # warm-up runs, then recorded and replayed graphs
        got = torch.autograd.grad(compiled(q, k, v, sinks), (q, k, v, sinks))
        for g, w in zip(got, want):
            torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)
    assert not counters["inductor"]["cudagraph_skips"], dict(counters["inductor"])
