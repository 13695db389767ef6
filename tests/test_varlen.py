"""gstar.flash_attention_varlen and the packing helpers of gstar.varlen.

The contract: packed attention equals :func:`gstar.flash_attention` run on each sequence alone (output, LSE
and every gradient), so positions, causality, windows and sink tokens restart at each sequence, and no
sequence sees another's keys. CPU tier: the torch path must match bitwise, the Triton kernels (interpreter)
within float32 relative error 1e-4. GPU tier (marked ``gpu``): bfloat16 at gpt-oss heads within the
flash-attn bar of docs/design.md section 4.
"""

import random

import pytest
import torch

import gstar
from gstar.lab.accuracy import relative_error, verdict
from gstar.kernels import attention_backward, attention_forward
from gstar.kernels.portable.tiles import BackwardConfig
from gstar.pattern import Pattern
from gstar.reference import naive_attention, tiled_backward, tiled_forward
from tiers import grid


def _cu(lengths, device="cpu"):
    """(num_seqs + 1,) int32 offsets of ``lengths``."""
    offsets = [0]
    for n in lengths:
        offsets.append(offsets[-1] + n)
    return torch.tensor(offsets, dtype=torch.int32, device=device)


def _packed(lengths_q, lengths_k, Hq=4, Hkv=2, D=16, dtype=torch.float32, device="cpu", sinks=False):
    """Packed inputs: q (total_q, Hq, D), k, v (total_k, Hkv, D), sinks (Hq,) or None, dout and dlse."""
    tq, tk = sum(lengths_q), sum(lengths_k)
    return dict(q=torch.randn(tq, Hq, D, device=device).to(dtype),
                k=torch.randn(tk, Hkv, D, device=device).to(dtype),
                v=torch.randn(tk, Hkv, D, device=device).to(dtype),
                sinks=torch.randn(Hq, device=device) * 2 if sinks else None,
                cu_q=_cu(lengths_q, device), cu_k=_cu(lengths_k, device),
                max_q=max(lengths_q, default=0), max_k=max(lengths_k, default=0),
                dout=torch.randn(tq, Hq, D, device=device).to(dtype),
                dlse=torch.randn(Hq, tq, device=device))


def _varlen(p, backend, **kw):
    """flash_attention_varlen on leaf copies of ``p``: (out, lse, [dq, dk, dv(, dsinks)])."""
    leaves = [None if p[n] is None else p[n].detach().clone().requires_grad_() for n in ("q", "k", "v", "sinks")]
    q, k, v, sinks = leaves
    out, lse = gstar.flash_attention_varlen(q, k, v, p["cu_q"], p["cu_k"], p["max_q"], p["max_k"], sinks=sinks,
                                            return_lse=True, backend=backend, **kw)
    wrt = [t for t in leaves if t is not None]
    loss = (out * p["dout"]).sum() + (lse * p["dlse"]).sum()
    grads = torch.autograd.grad(loss, wrt, allow_unused=True) if loss.requires_grad else [None] * len(wrt)
    return out.detach(), lse.detach(), [torch.zeros_like(t) if g is None else g for t, g in zip(wrt, grads)]


def _per_sequence(p, backend, **kw):
    """flash_attention on each sequence alone, with its own gradients, stitched together in packed order."""
    cq, ck = p["cu_q"].tolist(), p["cu_k"].tolist()
    outs, lses, dqs, dks, dvs = [], [], [], [], []
    dsinks = None if p["sinks"] is None else torch.zeros_like(p["sinks"])

    def leaf(x, a, b):  # (1, H, n, D) view of the packed storage, a leaf of its own
        return x.detach()[a:b].transpose(0, 1).unsqueeze(0).requires_grad_()

    for s in range(len(cq) - 1):
        q, k, v = leaf(p["q"], cq[s], cq[s + 1]), leaf(p["k"], ck[s], ck[s + 1]), leaf(p["v"], ck[s], ck[s + 1])
        sinks = None if p["sinks"] is None else p["sinks"].detach().clone().requires_grad_()
        out, lse = gstar.flash_attention(q, k, v, sinks=sinks, return_lse=True, backend=backend, **kw)
        dout = p["dout"][cq[s]:cq[s + 1]].transpose(0, 1).unsqueeze(0)
        dlse = p["dlse"][:, cq[s]:cq[s + 1]].unsqueeze(0)
        wrt = [t for t in (q, k, v, sinks) if t is not None]
        loss = (out * dout).sum() + (lse * dlse).sum()
        grads = torch.autograd.grad(loss, wrt, allow_unused=True) if loss.requires_grad else [None] * len(wrt)
        grads = [torch.zeros_like(t) if g is None else g for t, g in zip(wrt, grads)]
        outs.append(out.detach()[0].transpose(0, 1))
        lses.append(lse.detach()[0])
        dqs.append(grads[0][0].transpose(0, 1))
        dks.append(grads[1][0].transpose(0, 1))
        dvs.append(grads[2][0].transpose(0, 1))
        if sinks is not None:
            dsinks = dsinks + grads[3]
    q, k = p["q"], p["k"]
    cat = lambda xs, like: torch.cat(xs) if xs else torch.zeros_like(like)  # noqa: E731
    lse = torch.cat(lses, dim=1) if lses else torch.empty(q.shape[1], 0, device=q.device)
    grads = [cat(dqs, q), cat(dks, k), cat(dvs, k)]
    return cat(outs, q), lse, grads + ([] if dsinks is None else [dsinks])


LENGTHS = {
    # name: (query lengths, key lengths) per sequence
    "mixed": ([7, 0, 19, 1, 33], [7, 0, 19, 1, 33]),
    "nq_ne_nk": ([3, 5, 1, 0, 12, 6], [8, 5, 4, 2, 12, 2]),
    "short_next_to_long": ([1, 2, 1, 3, 1, 1, 70, 2, 1, 1], [1, 2, 1, 3, 1, 1, 70, 2, 1, 1]),
    "keys_missing": ([4, 3, 2], [0, 5, 0]),
    "all_empty": ([0, 0], [0, 0]),
}
PATTERNS = {
    "full": dict(),
    "causal": dict(causal=True),
    "window_sink_tokens": dict(window=(3, 0), sink_tokens=2),  # windows and sink tokens at document edges
    "window_both_sides": dict(window=(2, 1), sink_tokens=1),
    "causal_window": dict(causal=True, window=(4, 9)),
    "causal_chunk": dict(causal=True, chunk=6),  # chunks count from each document's start
    "softcap_chunk_window": dict(softcap=1.5, chunk=5, window=(3, 0), sink_tokens=1, scale=0.9),
}


@pytest.mark.parametrize("sinks", [False, True], ids=["nosinks", "sinks"])
@pytest.mark.parametrize("pattern", PATTERNS, ids=list(PATTERNS))
@pytest.mark.parametrize("lengths", LENGTHS, ids=list(LENGTHS))
def test_torch_path_equals_per_sequence_bitwise(lengths, pattern, sinks):
    p = _packed(*LENGTHS[lengths], sinks=sinks)
    out, lse, grads = _varlen(p, "torch", **PATTERNS[pattern])
    ref_out, ref_lse, ref_grads = _per_sequence(p, "torch", **PATTERNS[pattern])
    assert out.shape == p["q"].shape and out.dtype == p["q"].dtype and out.is_contiguous()
    assert lse.shape == (p["q"].shape[1], p["q"].shape[0]) and lse.dtype == torch.float32
    assert torch.equal(out, ref_out) and torch.equal(lse, ref_lse)
    for name, g, r in zip(("dq", "dk", "dv"), grads, ref_grads):
        assert torch.equal(g, r), name
    if sinks:  # summed over sequences: only the order of the additions may differ
        torch.testing.assert_close(grads[3], ref_grads[3], rtol=1e-6, atol=1e-6)


def test_torch_path_matches_oracle():
    """The per-sequence definition itself, checked once against naive_attention in float64."""
    lengths_q, lengths_k = LENGTHS["nq_ne_nk"]
    p = _packed(lengths_q, lengths_k, dtype=torch.float64, sinks=True)
    out, lse = gstar.flash_attention_varlen(p["q"], p["k"], p["v"], p["cu_q"], p["cu_k"], p["max_q"], p["max_k"],
                                            window=(2, 0), sink_tokens=1, sinks=p["sinks"], return_lse=True)
    cq, ck = p["cu_q"].tolist(), p["cu_k"].tolist()
    for s in range(len(lengths_q)):
        def bhnd(x, c):
            return x[c[s]:c[s + 1]].transpose(0, 1).unsqueeze(0)
        ref, ref_lse = naive_attention(bhnd(p["q"], cq), bhnd(p["k"], ck), bhnd(p["v"], ck), window=(2, 0),
                                       sink_tokens=1, sinks=p["sinks"].double())
        torch.testing.assert_close(out[cq[s]:cq[s + 1]], ref[0].transpose(0, 1), rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(lse[:, cq[s]:cq[s + 1]], ref_lse[0], rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("lengths,pattern,sinks", grid({n: (n,) for n in LENGTHS}, {n: (n,) for n in PATTERNS},
                                                     {"nosinks": (False,), "sinks": (True,)}))
def test_triton_equals_per_sequence(lengths, pattern, sinks, device):
    """One launch per pass over every sequence equals one dense call per sequence (GQA 2, padded D)."""
    p = _packed(*LENGTHS[lengths], Hq=4, Hkv=2, D=24, sinks=sinks, device=device)
    out, lse, grads = _varlen(p, "triton", **PATTERNS[pattern])
    ref_out, ref_lse, ref_grads = _per_sequence(p, "triton", **PATTERNS[pattern])
    assert out.shape == p["q"].shape and out.is_contiguous() and lse.shape == (4, p["q"].shape[0])
    names = ("out", "lse", "dq", "dk", "dv", "dsinks")
    for name, x, r in zip(names, [out, lse] + grads, [ref_out, ref_lse] + ref_grads):
        assert relative_error(x, r) < 1e-4, name
        assert torch.equal(torch.isneginf(x), torch.isneginf(r)), name  # empty rows stay -inf, nothing else


KERNEL_SWITCHES = {  # forward switches, backward config, (window, sink tokens, scale)
    "pack_gqa": (dict(PACK_GQA=2), BackwardConfig(16, 32, 32, 16, dkdv_warps=1, dq_warps=1, dq_pack=2),
                 ((6, 2), 3, 0.3)),
    "flat": (dict(FLAT=True), BackwardConfig(32, 16, 16, 32, dkdv_warps=1, dq_warps=1, flat=True), ((6, 2), 3, 0.3)),
    # no mask bound: the forward walks Q tiles fastest; a negative scale
    "tiles_fastest": (dict(), BackwardConfig(16, 16, 16, 16), ((-1, -1), 0, -0.3)),
}


@pytest.mark.parametrize("switches", KERNEL_SWITCHES, ids=list(KERNEL_SWITCHES))
def test_packed_kernel_switches_equal_torch_path(switches, device):
    """The packed kernels with each forward switch, grid order and backward loop form, against the packed
    torch path."""
    forward_switches, backward_config, (window, sink_tokens, scale) = KERNEL_SWITCHES[switches]
    p = _packed([5, 0, 37, 1, 20], [9, 3, 37, 0, 20], Hq=4, Hkv=2, D=24, sinks=True, device=device)
    pattern = Pattern.make(p["max_q"], p["max_k"], window=window, sink_tokens=sink_tokens)
    cu = (p["cu_q"], p["cu_k"])
    q, k, v, dout = (x.transpose(0, 1).unsqueeze(0) for x in (p["q"], p["k"], p["v"], p["dout"]))
    config = dict(BLOCK_M=32, BLOCK_N=16, num_warps=1, num_stages=1, **forward_switches)
    out, lse = attention_forward(q, k, v, p["sinks"], pattern, scale, config=config, cu_seqlens=cu)
    ref_out, ref_lse = tiled_forward(q, k, v, p["sinks"], pattern, scale, cu_seqlens=cu)
    assert relative_error(out, ref_out) < 1e-5 and relative_error(lse, ref_lse) < 1e-5
    dlse = p["dlse"][None]
    grads = attention_backward(dout, q, k, v, out, lse, dlse, p["sinks"], pattern, scale, config=backward_config,
                               cu_seqlens=cu)
    ref_grads = tiled_backward(dout, q, k, v, ref_out, ref_lse, dlse, p["sinks"], pattern, scale, cu_seqlens=cu)
    for name, g, r in zip(("dq", "dk", "dv", "dsinks"), grads, ref_grads):
        assert relative_error(g, r) < 1e-4, name


def _document_redrawn(p, s):
    """A copy of ``p`` with every token (q, k, v) of sequence ``s`` redrawn."""
    p = dict(p)
    cq, ck = p["cu_q"].tolist(), p["cu_k"].tolist()
    for name, c in (("q", cq), ("k", ck), ("v", ck)):
        p[name] = p[name].clone()
        p[name][c[s]:c[s + 1]] = torch.randn_like(p[name][c[s]:c[s + 1]])
    return p


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_no_cross_document_leak(backend, device):
    """Redrawing one document leaves every other document's output, LSE and gradients bitwise unchanged."""
    lengths = [9, 1, 14, 0, 6]
    dev = device if backend == "triton" else "cpu"
    p = _packed(lengths, lengths, Hq=2, Hkv=1, sinks=True, device=dev)
    kw = dict(window=(4, 0), sink_tokens=1)  # a window that would reach into the previous document
    base = _varlen(p, backend, **kw)
    cu = p["cu_q"].tolist()
    for s in (0, 2):
        changed = _varlen(_document_redrawn(p, s), backend, **kw)
        keep = torch.ones(sum(lengths), dtype=torch.bool, device=dev)
        keep[cu[s]:cu[s + 1]] = False
        assert torch.equal(base[0][keep], changed[0][keep])
        assert torch.equal(base[1][:, keep], changed[1][:, keep])
        for g, h in zip(base[2][:3], changed[2][:3]):
            assert torch.equal(g[keep], h[keep])
        assert not torch.equal(base[0][~keep], changed[0][~keep])  # the redrawn document did change


def test_fused_qkv_views():
    """q, k, v sliced out of one fused (total, Hq + 2 Hkv, D) projection give the contiguous-input result."""
    cu = _cu([5, 12, 1])
    qkv = torch.randn(18, 8, 16)
    q, k, v = qkv[:, :4], qkv[:, 4:6], qkv[:, 6:]
    out = gstar.flash_attention_varlen(q, k, v, cu, cu, 12, 12, causal=True)
    ref = gstar.flash_attention_varlen(q.contiguous(), k.contiguous(), v.contiguous(), cu, cu, 12, 12, causal=True)
    torch.testing.assert_close(out, ref, rtol=1e-6, atol=1e-6)


def test_padded_batch_round_trip_equals_dense_causal():
    """Right-padded batch -> unpad -> varlen -> pad equals dense causal attention at the real tokens."""
    lengths = [6, 1, 0, 11]
    B, N, H, D = len(lengths), 11, 2, 8
    mask = torch.arange(N)[None, :] < torch.tensor(lengths)[:, None]          # (B, N)
    x = torch.randn(B, N, 3, H, D)                                            # fused q, k, v
    cu, max_len, idx = gstar.cu_seqlens_from_mask(mask)
    q, k, v = gstar.unpad(x, idx).unbind(1)                                   # (total, H, D) each
    out = gstar.pad(gstar.flash_attention_varlen(q, k, v, cu, cu, max_len, max_len, causal=True), idx, B, N)
    dense = gstar.flash_attention(*(t.transpose(1, 2) for t in x.unbind(2)), causal=True).transpose(1, 2)
    torch.testing.assert_close(out[mask], dense[mask], rtol=1e-6, atol=1e-6)
    assert torch.equal(out[~mask], torch.zeros_like(out[~mask]))


@pytest.mark.parametrize("side", ["right", "left"])
def test_mask_helpers_round_trip(side):
    lengths = torch.tensor([3, 0, 1, 7, 5])
    B, N = 5, 7
    ar = torch.arange(N)[None, :]
    mask = (ar < lengths[:, None]) if side == "right" else (ar >= N - lengths[:, None])
    for m in (mask, mask.int(), mask.float()):
        cu, max_len, idx = gstar.cu_seqlens_from_mask(m)
        assert cu.dtype == torch.int32 and cu.tolist() == [0, 3, 3, 4, 11, 16] and max_len == 7
        assert idx.dtype == torch.int64 and torch.equal(idx, torch.nonzero(mask.flatten()).flatten())
    x = torch.randn(B, N, 2, 3, requires_grad=True)
    packed = gstar.unpad(x, idx)
    assert packed.shape == (16, 2, 3)
    back = gstar.pad(packed, idx, B, N)
    assert torch.equal(back[mask], x[mask]) and torch.equal(back[~mask], torch.zeros_like(back[~mask]))
    back.sum().backward()  # both directions are differentiable
    assert torch.equal(x.grad, mask[:, :, None, None].float().expand_as(x))


def test_mask_helpers_edge_cases():
    cu, max_len, idx = gstar.cu_seqlens_from_mask(torch.zeros(3, 4, dtype=torch.bool))
    assert cu.tolist() == [0, 0, 0, 0] and max_len == 0 and idx.numel() == 0
    assert torch.equal(gstar.pad(gstar.unpad(torch.randn(3, 4, 2), idx), idx, 3, 4), torch.zeros(3, 4, 2))
    cu, max_len, idx = gstar.cu_seqlens_from_mask(torch.zeros(0, 4))
    assert cu.tolist() == [0] and max_len == 0 and idx.numel() == 0


@pytest.mark.parametrize("shape", ["flat", "row"])
def test_position_ids(shape):
    pos = torch.tensor([0, 1, 2, 0, 0, 1, 0, 1, 2, 3, 0])                     # documents 3, 1, 2, 4, 1
    cu, max_len = gstar.cu_seqlens_from_position_ids(pos.int() if shape == "flat" else pos[None])
    assert cu.dtype == torch.int32 and cu.tolist() == [0, 3, 4, 6, 10, 11] and max_len == 4
    cu, max_len = gstar.cu_seqlens_from_position_ids(torch.zeros(5, dtype=torch.int64))  # five length-1 docs
    assert cu.tolist() == [0, 1, 2, 3, 4, 5] and max_len == 1
    cu, max_len = gstar.cu_seqlens_from_position_ids(torch.zeros(1, 0, dtype=torch.int32))
    assert cu.tolist() == [0] and max_len == 0


def test_position_ids_packing_equals_per_document():
    """Documents packed in one row by position ids attend like separate sequences (length-1 docs included)."""
    cu, max_len = gstar.cu_seqlens_from_position_ids(torch.tensor([[0, 1, 2, 3, 0, 0, 1, 2, 0]]))
    p = _packed([4, 1, 3, 1], [4, 1, 3, 1], sinks=True)
    assert torch.equal(cu, p["cu_q"]) and max_len == p["max_q"]
    out, lse, _ = _varlen(p, "torch", causal=True)
    ref_out, ref_lse, _ = _per_sequence(p, "torch", causal=True)
    assert torch.equal(out, ref_out) and torch.equal(lse, ref_lse)


HELPER_ERRORS = [
    (lambda: gstar.cu_seqlens_from_mask(torch.ones(4)), ValueError, "attention_mask must have 2 dims"),
    (lambda: gstar.cu_seqlens_from_mask([[1, 0]]), TypeError, "attention_mask must be a torch.Tensor"),
    (lambda: gstar.cu_seqlens_from_mask(torch.tensor([[1, 2]])), ValueError, "only 0 and 1"),
    (lambda: gstar.cu_seqlens_from_mask(torch.tensor([[1, 0, 1]])), ValueError, "one contiguous run"),
    (lambda: gstar.unpad(torch.randn(4), torch.arange(2)), ValueError, "x must have at least 2 dims"),
    (lambda: gstar.unpad(torch.randn(2, 4), torch.arange(2).int()), TypeError, "indices must have dtype"),
    (lambda: gstar.pad(torch.randn(3, 2), torch.arange(2), 1, 4), ValueError, "one entry per row of x"),
    (lambda: gstar.pad(torch.randn(2, 2), torch.arange(2), -1, 4), ValueError, "batch must be an int >= 0"),
    (lambda: gstar.cu_seqlens_from_position_ids(torch.zeros(2, 3, dtype=torch.int64)), ValueError, "(1, total)"),
    (lambda: gstar.cu_seqlens_from_position_ids(torch.zeros(3)), TypeError, "integer tensor"),
    (lambda: gstar.cu_seqlens_from_position_ids(torch.tensor([1, 2, 0])), ValueError, "start at 0"),
    (lambda: gstar.cu_seqlens_from_position_ids(torch.tensor([0, 1, 3, 0])), ValueError, "grow by 1"),
]


@pytest.mark.parametrize("call,exc,text", HELPER_ERRORS, ids=[e[2] for e in HELPER_ERRORS])
def test_helper_errors(call, exc, text):
    with pytest.raises(exc) as info:
        call()
    assert text in str(info.value), str(info.value)


def _good_args():
    return dict(q=torch.randn(9, 4, 8), k=torch.randn(12, 2, 8), v=torch.randn(12, 2, 8),
                cu_seqlens_q=_cu([4, 5]), cu_seqlens_k=_cu([6, 6]), max_seqlen_q=5, max_seqlen_k=6)


BAD = [
    # (description, replaced arguments, exception type, text the message must contain)
    ("q rank", dict(q=torch.randn(1, 9, 4, 8)), ValueError, "q must have 3 dims"),
    ("k not a tensor", dict(k=[[0.0]]), TypeError, "k must be a torch.Tensor"),
    ("k/v mismatch", dict(v=torch.randn(11, 2, 8)), ValueError, "k and v must have the same (total_k, heads)"),
    ("Hq % Hkv", dict(k=torch.randn(12, 3, 8), v=torch.randn(12, 3, 8)), ValueError, "multiple of kv heads"),
    ("head dim", dict(k=torch.randn(12, 2, 4)), ValueError, "k head dim"),
    ("dtype mismatch", dict(k=torch.randn(12, 2, 8).half()), TypeError, "share a dtype"),
    ("integer dtype", dict(q=torch.zeros(9, 4, 8, dtype=torch.int32), k=torch.zeros(12, 2, 8, dtype=torch.int32),
                           v=torch.zeros(12, 2, 8, dtype=torch.int32)), TypeError, "float16, bfloat16"),
    ("strided last dim", dict(q=torch.randn(9, 4, 16)[..., ::2]), ValueError, "unit stride"),
    ("cu not a tensor", dict(cu_seqlens_q=[0, 4, 9]), TypeError, "cu_seqlens_q must be a torch.Tensor"),
    ("cu rank", dict(cu_seqlens_k=_cu([6, 6])[None]), ValueError, "cu_seqlens_k must have 1 dims"),
    ("cu dtype", dict(cu_seqlens_q=_cu([4, 5]).long()), TypeError, "cu_seqlens_q must have dtype torch.int32"),
    ("cu device", dict(cu_seqlens_k=_cu([6, 6]).to("meta")), ValueError, "cu_seqlens_k must be on q's device"),
    ("cu empty", dict(cu_seqlens_q=_cu([])[:0], cu_seqlens_k=_cu([])[:0]), ValueError, "num_seqs + 1 >= 1"),
    ("cu lengths differ", dict(cu_seqlens_k=_cu([6, 3, 3])), ValueError,
     "cu_seqlens_q and cu_seqlens_k must have the same length (num_seqs + 1), got 3 and 4"),
    ("cu first", dict(cu_seqlens_q=torch.tensor([1, 4, 9], dtype=torch.int32)), ValueError,
     "cu_seqlens_q must start at 0, got 1"),
    ("cu decreasing", dict(cu_seqlens_k=torch.tensor([0, 13, 12], dtype=torch.int32)), ValueError,
     "cu_seqlens_k must be non-decreasing, got 13 then 12"),
    ("cu last q", dict(cu_seqlens_q=torch.tensor([0, 4, 8], dtype=torch.int32)), ValueError,
     "cu_seqlens_q must end at total_q (q.shape[0]) = 9, got 8"),
    ("cu last k", dict(cu_seqlens_k=torch.tensor([0, 6, 13], dtype=torch.int32), max_seqlen_k=7), ValueError,
     "cu_seqlens_k must end at total_k (k.shape[0]) = 12, got 13"),
    ("max_seqlen_q small", dict(max_seqlen_q=4), ValueError,
     "max_seqlen_q must be >= the longest sequence in cu_seqlens_q (5), got 4"),
    ("max_seqlen_k small", dict(max_seqlen_k=5), ValueError, "max_seqlen_k must be >= the longest"),
    ("max_seqlen type", dict(max_seqlen_q=5.0), TypeError, "max_seqlen_q must be an int"),
    ("max_seqlen bool", dict(max_seqlen_k=True), TypeError, "max_seqlen_k must be an int"),
    ("max_seqlen negative", dict(max_seqlen_q=-1), ValueError, "max_seqlen_q must be >= 0"),
    ("window", dict(window=(1.5, 0)), TypeError, "window must be a (left, right)"),
    ("sink_tokens", dict(sink_tokens=-2), ValueError, "sink_tokens must be >= 0"),
    ("sinks shape", dict(sinks=torch.zeros(2)), ValueError, "sinks must have shape (4,)"),
    ("scale", dict(scale="1"), TypeError, "scale must be a finite float"),
    ("causal", dict(causal=1), TypeError, "causal must be a bool"),
    ("backend", dict(backend="cuda"), ValueError, "backend must be one of"),
]


@pytest.mark.parametrize("name,change,exc,text", BAD, ids=[b[0] for b in BAD])
def test_bad_input_raises_clear_error(name, change, exc, text):
    args = _good_args()
    args.update(change)
    with pytest.raises(exc) as info:
        gstar.flash_attention_varlen(**args)
    assert text in str(info.value), str(info.value)


def test_unchecked_offsets_skip_only_the_value_check():
    """check_cu_seqlens=False gives the same result on valid offsets, still checks dtype / device / shape,
    and no longer reads the values (which check_cu_seqlens_values still rejects)."""
    args = _good_args()
    unchecked = gstar.flash_attention_varlen(**args, check_cu_seqlens=False)
    assert torch.equal(unchecked, gstar.flash_attention_varlen(**args))
    with pytest.raises(TypeError, match="cu_seqlens_q must have dtype torch.int32"):
        gstar.flash_attention_varlen(**{**args, "cu_seqlens_q": _cu([4, 5]).long()}, check_cu_seqlens=False)
    short = torch.tensor([0, 4, 8], dtype=torch.int32)
    with pytest.raises(ValueError, match="cu_seqlens_q must end at total_q"):
        gstar.check_cu_seqlens_values(short, args["cu_seqlens_k"], 9, 12, 5, 6)


def test_larger_max_seqlen_is_accepted():
    args = _good_args()
    exact = gstar.flash_attention_varlen(**args)
    args.update(max_seqlen_q=100, max_seqlen_k=100)
    assert torch.equal(gstar.flash_attention_varlen(**args), exact)


def _random_lengths(total, parts, seed):
    rng = random.Random(seed)
    cuts = sorted(rng.sample(range(1, total), parts - 1))
    return [b - a for a, b in zip([0] + cuts, cuts + [total])]


def _check_within_bar(lengths, Hq, Hkv, D, dtype, device, backend, **kw):
    """varlen and per-sequence flash_attention, document by document, within the flash-attn bar of a
    float32 oracle (naive_attention in ``dtype`` sets the allowed error); dsinks summed over documents."""
    p = _packed(lengths, lengths, Hq=Hq, Hkv=Hkv, D=D, dtype=dtype, device=device, sinks=True)
    out, lse, grads = _varlen(p, backend, **kw)
    flash_out, flash_lse, flash_grads = _per_sequence(p, backend, **kw)
    results = {"varlen": [out, lse] + grads, "per-sequence": [flash_out, flash_lse] + flash_grads}
    cu = p["cu_q"].tolist()
    ds_ref = ds_pt = 0
    for s in range(len(lengths)):
        rows = slice(cu[s], cu[s + 1])
        one = dict(p, q=p["q"][rows], k=p["k"][rows], v=p["v"][rows], dout=p["dout"][rows], dlse=p["dlse"][:, rows])
        ref, pt = _naive_one(one, torch.float32, **kw), _naive_one(one, dtype, **kw)
        ds_ref, ds_pt = ds_ref + ref[5], ds_pt + pt[5]
        for label, xs in results.items():
            for i, name in enumerate(("out", "lse", "dq", "dk", "dv")):
                x = xs[i][:, rows] if name == "lse" else xs[i][rows]
                v = verdict(f"{label} doc {s} {name}", x, ref[i], pt[i], factor=2.0 if i < 2 else 3.0)
                assert v.ok, str(v)
    for label, xs in results.items():
        v = verdict(f"{label} dsinks", xs[5], ds_ref, ds_pt, factor=3.0)
        assert v.ok, str(v)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_torch_path_low_precision_within_bar(dtype):
    _check_within_bar([17, 1, 0, 40, 5], 4, 2, 16, dtype, "cpu", "torch", window=(7, 0), sink_tokens=2)
    _check_within_bar([17, 1, 0, 40, 5], 4, 2, 16, dtype, "cpu", "torch", causal=True, chunk=8, softcap=2.0)


@pytest.mark.gpu
def test_gpu_gpt_oss_packed_within_bar():
    """bf16, Hq=64, Hkv=8, D=64, 16 documents of random lengths summing to 16384 tokens, window (127, 0),
    learned sinks (the gpt-oss training shape)."""
    _check_within_bar(_random_lengths(16384, 16, seed=0), 64, 8, 64, torch.bfloat16, "cuda", "auto",
                      window=(127, 0))


def _naive_one(p, dtype, **kw):
    """naive_attention of one packed sequence in ``dtype``, one kv head group at a time (memory):
    ``[out, lse, dq, dk, dv, dsinks]`` in packed layouts ((n, H, D), (Hq, n), (Hq,))."""
    Hq, Hkv = p["q"].shape[1], p["k"].shape[1]
    G = Hq // Hkv
    parts = []
    for g in range(Hkv):
        heads = slice(g * G, (g + 1) * G)
        leaves = [x.detach()[:, hs].to(dtype).transpose(0, 1).unsqueeze(0).requires_grad_()
                  for x, hs in ((p["q"], heads), (p["k"], slice(g, g + 1)), (p["v"], slice(g, g + 1)))]
        sinks = p["sinks"].detach()[heads].clone().requires_grad_()  # float32 in both: the parameter's dtype
        out, lse = naive_attention(*leaves, sinks=sinks, **kw)                  # (1, G, n, D), (1, G, n)
        dout = p["dout"][:, heads].to(dtype).transpose(0, 1).unsqueeze(0)
        loss = (out * dout).sum() + (lse * p["dlse"][heads].unsqueeze(0)).sum()
        grads = torch.autograd.grad(loss, leaves + [sinks])
        parts.append([out.detach(), lse.detach()] + list(grads))
    packed = lambda i: torch.cat([x[i] for x in parts], dim=1)[0].transpose(0, 1)  # noqa: E731
    return [packed(0), torch.cat([x[1] for x in parts], dim=1)[0], packed(2), packed(3), packed(4),
            torch.cat([x[5] for x in parts])]
