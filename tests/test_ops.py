"""The torch.library operators of gstar.ops (``gstar::attention_forward`` and ``gstar::attention_backward``,
dense and packed): opcheck, and torch.compile(fullgraph=True) through them.

CPU runs the tiled PyTorch backend (and the Triton kernels under the interpreter); on a GPU the same tests
run the Triton kernels. The CPU compile tests use the ``aot_eager`` backend: it traces with Dynamo and
AOTAutograd exactly as Inductor would (graph breaks, fake tensors, the backward graph) without generating
C++; the GPU tier compiles with Inductor.
"""

import pytest
import torch

import gstar
from gstar import ops
from gstar.pattern import span_bounds

PATTERNS = {  # id: ((left, right, sink_tokens, chunk), softcap)
    "full": ((-1, -1, 0, 0), 0.0),
    "causal_window_sink_tokens_chunk_softcap": ((5, 0, 2, 7), 1.5),
    "two_sided": ((3, 4, 0, 0), 0.0),
}
# opcheck takes ~20 s a case on two CPU cores: the quick tier checks the case with every option on, the
# full suite (pytest --full) every pattern with and without sinks
QUICK_CASE = ("causal_window_sink_tokens_chunk_softcap", True)  # with spans too (test_opcheck_dense)
OPCHECK_CASES = [pytest.param(p, s, id=f"{p}-{'sinks' if s else 'nosinks'}",
                              marks=() if (p, s) == QUICK_CASE else pytest.mark.slow)
                 for p in PATTERNS for s in (False, True)]


def _backends(device):
    return ["torch", "triton"] if device == "cpu" else ["triton"]


def _dense(device, sinks):
    q = torch.randn(2, 4, 37, 24, device=device, requires_grad=True)
    k = torch.randn(2, 2, 29, 24, device=device, requires_grad=True)
    v = torch.randn(2, 2, 29, 24, device=device, requires_grad=True)
    s = torch.randn(4, device=device, requires_grad=True) if sinks else None
    return q, k, v, s


def _packed(device, sinks):
    lengths_q, lengths_k = [5, 0, 19, 1], [9, 2, 19, 0]
    q = torch.randn(sum(lengths_q), 4, 24, device=device, requires_grad=True)
    k = torch.randn(sum(lengths_k), 2, 24, device=device, requires_grad=True)
    v = torch.randn(sum(lengths_k), 2, 24, device=device, requires_grad=True)
    s = torch.randn(4, device=device, requires_grad=True) if sinks else None
    cu = [torch.tensor([0] + torch.tensor(n).cumsum(0).tolist(), dtype=torch.int32, device=device)
          for n in (lengths_q, lengths_k)]
    return q, k, v, s, cu[0], cu[1], max(lengths_q), max(lengths_k)


def _detached(*ts):
    return [None if t is None else t.detach() for t in ts]


def _options(pattern, q, k, backend, max_lengths=None) -> tuple:
    """The operators' non-tensor arguments: the pattern's fields (nq, nk, left, right, sink_tokens, chunk), scale,
    softcap, backend, deterministic."""
    bounds, softcap = PATTERNS[pattern]
    return ([*(max_lengths or (q.shape[2], k.shape[2])), *bounds], 0.3, softcap, backend, True)


def _opcheck(q, k, v, s, cu_q, cu_k, options, spans=None):
    """opcheck of the forward op, then of the backward op on its output, with and without dlse."""
    args = (q, k, v, s, cu_q, cu_k, spans, *options)
    torch.library.opcheck(ops.forward_op, args)
    out, lse = ops.forward_op(*args)
    for dlse in (None, torch.randn_like(lse)):
        torch.library.opcheck(ops.backward_op, (torch.randn_like(out), out.detach(), lse.detach(), dlse,
                                                *_detached(q, k, v, s), cu_q, cu_k, spans, *options))


@pytest.mark.parametrize("pattern,sinks", OPCHECK_CASES)
def test_opcheck_dense(pattern, sinks, device):
    for backend in _backends(device):
        q, k, v, s = _dense(device, sinks)
        spans = span_bounds(torch.randint(0, 3, (q.shape[0], k.shape[2]), device=device)) if sinks else None
        _opcheck(q, k, v, s, None, None, _options(pattern, q, k, backend), spans)


@pytest.mark.parametrize("pattern,sinks", OPCHECK_CASES)
def test_opcheck_varlen(pattern, sinks, device):
    for backend in _backends(device):
        q, k, v, s, cu_q, cu_k, max_q, max_k = _packed(device, sinks)
        _opcheck(q, k, v, s, cu_q, cu_k, _options(pattern, q, k, backend, (max_q, max_k)))


def test_fake_outputs_match_real_layouts(device):
    """The fake implementations promise the real outputs' shapes, dtypes and strides: dense outputs follow
    q's (transposed) layout, packed ones are contiguous even for strided inputs."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    q, k, v = (torch.randn(2, 29, h, 24, device=device).transpose(1, 2) for h in (4, 2, 2))
    s = torch.randn(4, device=device, dtype=torch.bfloat16)
    qp, kp, vp, _, cu_q, cu_k, max_q, max_k = _packed(device, False)
    kp, vp = (torch.cat([t, t], dim=1)[:, ::2] for t in (kp.detach(), vp.detach()))  # strided heads
    cases = [((q, k, v, s, None, None, None), _options("full", q, k, backend))
             for backend in _backends(device)]
    cases += [((qp.detach(), kp, vp, s, cu_q, cu_k, None), _options("full", qp, kp, backend, (max_q, max_k)))
              for backend in _backends(device)]
    for tensors, options in cases:
        real = ops.forward_op(*tensors, *options)
        grads = ops.backward_op(torch.randn_like(real[0]), *real, None, *tensors, *options)
        with FakeTensorMode(allow_non_fake_inputs=True) as mode:
            fake_in = [None if t is None else mode.from_tensor(t) for t in tensors]
            fake = ops.forward_op(*fake_in, *options)
            fake_grads = ops.backward_op(mode.from_tensor(real[0]), *(mode.from_tensor(t) for t in real), None,
                                         *fake_in, *options)
        for r, f in zip((*real, *grads), (*fake, *fake_grads)):
            assert (r.shape, r.dtype, r.stride()) == (f.shape, f.dtype, f.stride())


def _compile(fn, device, dynamic):
    backend = "inductor" if device == "cuda" else "aot_eager"
    torch._dynamo.reset()
    return torch.compile(fn, fullgraph=True, dynamic=dynamic, backend=backend)


def _dense_step(q, k, v, sinks, dout):
    out, lse = gstar.flash_attention(q, k, v, causal=True, window=(6, 0), sink_tokens=1, sinks=sinks, chunk=9,
                                     softcap=2.0, return_lse=True)
    return (out * dout).sum() + lse.square().sum()


def _varlen_step(q, k, v, sinks, dout, cu_q, cu_k, max_q, max_k):
    out, lse = gstar.flash_attention_varlen(q, k, v, cu_q, cu_k, max_q, max_k, window=(4, 1), sinks=sinks,
                                            return_lse=True)
    return (out * dout).sum() + lse.square().sum()


def _grads(fn, leaves, *rest):
    loss = fn(*leaves, *rest)
    return [loss.detach()] + list(torch.autograd.grad(loss, leaves))


def _assert_same(compiled, eager, device):
    for c, e in zip(compiled, eager):
        if device == "cpu":  # aot_eager runs the very same ops
            assert torch.equal(c, e)
        else:  # Inductor may fuse the loss's elementwise work differently
            torch.testing.assert_close(c, e, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "dynamic"])
def test_compile_fullgraph_dense(dynamic, device):
    """No graph break, forward and backward, and the compiled gradients equal eager ones, for two lengths."""
    compiled = _compile(_dense_step, device, dynamic)
    for n in (37, 50):
        q, k, v, s = (torch.randn(1, 4, n, 16, device=device), torch.randn(1, 2, n, 16, device=device),
                      torch.randn(1, 2, n, 16, device=device), torch.randn(4, device=device))
        leaves = [t.requires_grad_() for t in (q, k, v, s)]
        dout = torch.randn(1, 4, n, 16, device=device)
        _assert_same(_grads(compiled, leaves, dout), _grads(_dense_step, leaves, dout), device)


@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "dynamic"])
def test_compile_fullgraph_varlen(dynamic, device):
    compiled = _compile(_varlen_step, device, dynamic)
    for lengths in ([5, 0, 19, 1], [7, 30, 2, 11]):
        cu = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32, device=device)
        total = sum(lengths)
        leaves = [torch.randn(total, 4, 16, device=device), torch.randn(total, 2, 16, device=device),
                  torch.randn(total, 2, 16, device=device), torch.randn(4, device=device)]
        leaves = [t.requires_grad_() for t in leaves]
        rest = (torch.randn(total, 4, 16, device=device), cu, cu, max(lengths), max(lengths))
        _assert_same(_grads(compiled, leaves, *rest), _grads(_varlen_step, leaves, *rest), device)


def test_compiled_varlen_trusts_cu_seqlens_but_eager_checks_them():
    """Eager calls read and check cu_seqlens on the host; a compiled graph cannot read data, so it skips
    the value checks (shapes are still checked)."""
    q, k, v, s, cu_q, cu_k, max_q, max_k = _packed("cpu", False)
    with pytest.raises(ValueError, match="max_seqlen_q must be >= the longest"):
        gstar.flash_attention_varlen(q, k, v, cu_q, cu_k, max_q - 1, max_k)
    compiled = _compile(lambda *a: gstar.flash_attention_varlen(*a, causal=True), "cpu", False)
    with pytest.raises(Exception, match="cu_seqlens_q must have dtype torch.int32"):
        compiled(q, k, v, cu_q.long(), cu_k, max_q, max_k)
    torch.testing.assert_close(compiled(q, k, v, cu_q, cu_k, max_q, max_k),
                               gstar.flash_attention_varlen(q, k, v, cu_q, cu_k, max_q, max_k, causal=True))
