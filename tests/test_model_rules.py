"""The rules of Gemma 2, Gemma 3 and Llama 4: logit soft-capping (``softcap``), chunked local attention
(``chunk``) and bidirectional spans (``spans``), alone and with every other rule, against the float64 oracle:
dense calls on the PyTorch path and the kernels (the interpreter on CPU) under the correctness bar in float32 and
float16 at odd lengths, gradients included; packed spans against each sequence alone; the kernels' loop forms and
splits; FP8 inputs; properties of each rule; and the errors for bad values. Packed batches, KV caches and context
parallelism take softcap and chunk through their own tests' pattern tables (test_varlen, test_kvcache,
test_distributed).
"""

import math

import pytest
import torch
from tiers import grid

import gstar
from gstar.kernels.dispatch import attention_backward, attention_forward
from gstar.kernels.portable.tiles import BackwardConfig
from gstar.lab.accuracy import relative_error, verdict
from gstar.pattern import Pattern, span_bounds
from gstar.reference import tiled_backward, tiled_forward


def _span_ids(batch, n, seed=0):
    """(batch, n) span ids: an image-like span of a few tokens, a prefix, neighbouring spans of other ids."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.zeros(batch, n, dtype=torch.long)
    for b in range(batch):
        a = int(torch.randint(0, max(n // 2, 1), (1,), generator=g))
        ids[b, a:a + n // 3] = 1
        ids[b, a + n // 3:a + n // 3 + 5] = 2   # right after span 1: another span
    ids[0, :4] = 7                               # a prefix (prefix-LM)
    return ids


RULES = {  # id: (keywords, learned sinks); "spans": True draws span ids for the case's keys
    "softcap": (dict(softcap=2.5), False),
    "softcap-causal-sinks": (dict(causal=True, softcap=0.8), True),
    "chunk-causal": (dict(causal=True, chunk=8), False),
    "chunk-bidirectional": (dict(chunk=11), False),
    "chunk-window-sink-tokens": (dict(causal=True, chunk=9, window=(5, 0), sink_tokens=3), True),
    "all": (dict(causal=True, chunk=13, window=(20, 0), sink_tokens=2, softcap=1.7, scale=0.6), True),
    "spans-causal": (dict(causal=True, spans=True), False),
    "spans-window-sinks": (dict(causal=True, window=(4, 0), sink_tokens=1, spans=True), True),
    "spans-chunk-softcap": (dict(causal=True, chunk=10, softcap=1.1, spans=True), True),
}
SHAPES = {  # id: (B, Hq, Hkv, Nq, Nk, D, Dv)
    "gqa-odd": (2, 4, 2, 37, 45, 24, 24),
    "decode-like": (1, 6, 2, 5, 53, 16, 8),
    "mqa-square": (1, 3, 1, 29, 29, 8, 12),
}
DTYPES = {"float32": (torch.float32,), "float16": (torch.float16,)}


def _inputs(shape, dtype, learned_sinks, device, seed=0):
    B, Hq, Hkv, Nq, Nk, D, Dv = shape
    g = torch.Generator().manual_seed(seed)

    def rand(*s, scale=1.0):
        return (torch.randn(*s, generator=g, dtype=torch.float64) * scale).to(device)

    # scores of a few units: soft-caps of 0.8 .. 2.5 bend them, and their derivative is far from 1
    q, k, v = rand(B, Hq, Nq, D, scale=1.5), rand(B, Hkv, Nk, D, scale=1.5), rand(B, Hkv, Nk, Dv)
    sinks = rand(Hq) if learned_sinks else None
    return (q, k, v), sinks, rand(B, Hq, Nq, Dv), rand(B, Hq, Nq)


def _run(fn, qkv, sinks, dout, dlse, dtype, **kw):
    """``[out, lse, dq, dk, dv(, dsinks)]`` of ``fn`` on the inputs cast to ``dtype`` (sinks stay float32)."""
    leaves = [t.to(dtype).requires_grad_() for t in qkv]
    if sinks is not None:
        leaves.append(sinks.float().requires_grad_())
    out, lse = fn(*leaves[:3], sinks=leaves[3] if sinks is not None else None, **kw)
    grads = torch.autograd.grad((out * dout.to(out.dtype)).sum() + (lse * dlse.to(lse.dtype)).sum(), leaves)
    return [out.detach(), lse.detach(), *grads]


def _oracle(*leaves, sinks=None, **kw):
    return gstar.naive_attention(*leaves, sinks=sinks, **kw)


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("rule, shape, dtype", grid(*({i: (i,) for i in axis} for axis in (RULES, SHAPES)), DTYPES))
def test_dense_within_bar(rule, shape, dtype, backend, device):
    """out, LSE and every gradient within the bar of docs/design.md section 4 (2x PyTorch's own error in the
    same dtype, 3x for gradients) against the float64 oracle."""
    kw, learned_sinks = RULES[rule]
    dev = device if backend == "triton" else "cpu"
    qkv, sinks, dout, dlse = _inputs(SHAPES[shape], torch.float64, learned_sinks, dev)
    if kw.get("spans"):
        kw = dict(kw, spans=_span_ids(qkv[1].shape[0], qkv[1].shape[2]).to(dev))
    ref = _run(_oracle, qkv, sinks, dout, dlse, torch.float64, **kw)
    pt = _run(_oracle, qkv, sinks, dout, dlse, dtype, **kw)

    def flash(*leaves, **kwargs):
        return gstar.flash_attention(*leaves, return_lse=True, backend=backend, **kwargs)

    got = _run(flash, qkv, sinks, dout, dlse, dtype, **kw)
    for i, name in enumerate(["out", "lse", "dq", "dk", "dv", "dsinks"][:len(got)]):
        v = verdict(f"{rule} {name}", got[i], ref[i], pt[i], factor=2.0 if i < 2 else 3.0)
        assert v.ok, str(v)


# the kernels' loop forms and work splits, each against the PyTorch path on the same pattern (float32, the
# interpreter's tiles of 16): a chunk of 24 keys starts and ends inside tiles, one of 32 on their edges
SWITCHES = {
    "segments": (dict(), BackwardConfig(16, 16, 16, 16)),
    "flat-pack": (dict(FLAT=True, PACK_GQA=2), BackwardConfig(16, 32, 32, 16, dq_pack=2, flat=True)),
    "split-items": (dict(), BackwardConfig(16, 16, 16, 16, head_splits=2, q_chunk=2)),
}
PATTERNS = {  # id: (rule, softcap, spans)
    "chunk24-causal": (dict(causal=True, chunk=24), 0.0, False),
    "chunk32-window-sink-tokens": (dict(window=(40, 3), sink_tokens=5, chunk=32), 1.3, False),
    "spans-window": (dict(causal=True, window=(9, 0)), 0.0, True),
}


@pytest.mark.parametrize("switches, pattern", grid(*({i: (i,) for i in axis} for axis in (SWITCHES, PATTERNS))))
def test_kernel_loops_and_splits(switches, pattern, device):
    forward_config, backward_config = SWITCHES[switches]
    rule, softcap, has_spans = PATTERNS[pattern]
    B, Hq, Hkv, Nq, Nk, D = 1, 4, 2, 77, 83, 16
    qkv, sinks, dout, dlse = _inputs((B, Hq, Hkv, Nq, Nk, D, D), torch.float32, True, device)
    q, k, v = (t.float() for t in qkv)
    sinks, dout, dlse = sinks.float(), dout.float(), dlse.float()
    p = Pattern.make(Nq, Nk, **rule)
    spans = span_bounds(_span_ids(B, Nk)).to(device) if has_spans else None               # (B, Nk, 2)
    config = dict(BLOCK_M=32, BLOCK_N=16, num_warps=1, num_stages=1, **forward_config)
    kw = dict(softcap=softcap, spans=spans)
    out, lse = attention_forward(q, k, v, sinks, p, 0.4, config=config, **kw)
    ref_out, ref_lse = tiled_forward(q, k, v, sinks, p, 0.4, **kw)
    assert relative_error(out, ref_out) < 1e-5 and relative_error(lse, ref_lse) < 1e-5
    grads = attention_backward(dout, q, k, v, out, lse, dlse, sinks, p, 0.4, config=backward_config, **kw)
    ref_grads = tiled_backward(dout, q, k, v, ref_out, ref_lse, dlse, sinks, p, 0.4, **kw)
    for name, g, r in zip(("dq", "dk", "dv", "dsinks"), grads, ref_grads):
        assert relative_error(g, r) < 1e-4, name


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_chunk_past_the_keys_is_no_chunk(backend, device):
    """A chunk holding every position changes nothing, bit for bit; sink tokens then need no left bound."""
    dev = device if backend == "triton" else "cpu"
    q, k, v = (torch.randn(1, 2, n, 16, device=dev) for n in (19, 23, 23))
    plain = gstar.flash_attention(q, k, v, causal=True, backend=backend)
    assert torch.equal(gstar.flash_attention(q, k, v, causal=True, chunk=23, backend=backend), plain)
    assert torch.equal(gstar.flash_attention(q, k, v, causal=True, chunk=10**12, sink_tokens=4, backend=backend),
                       plain)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_chunks_are_independent(backend, device):
    """Causal chunked self-attention over two whole chunks is the two chunks attended to on their own."""
    dev = device if backend == "triton" else "cpu"
    q, k, v = (torch.randn(1, 2, 40, 16, device=dev) for _ in range(3))
    both = gstar.flash_attention(q, k, v, causal=True, chunk=20, backend=backend)
    for c in (slice(0, 20), slice(20, 40)):
        alone = gstar.flash_attention(q[:, :, c], k[:, :, c], v[:, :, c], causal=True, backend=backend)
        torch.testing.assert_close(both[:, :, c], alone, rtol=1e-5, atol=1e-6)


def test_rows_before_the_keys_see_no_chunk():
    """With Nq > Nk the first rows sit at negative positions, before every key: under a chunk they see none
    (zeros, LSE -inf), as without one under a causal mask."""
    q, k, v = torch.randn(1, 1, 7, 8), torch.randn(1, 1, 4, 8), torch.randn(1, 1, 4, 8)
    out, lse = gstar.flash_attention(q, k, v, chunk=3, return_lse=True, backend="torch")
    assert torch.equal(out[:, :, :3], torch.zeros_like(out[:, :, :3])) and torch.isneginf(lse[:, :, :3]).all()
    assert torch.isfinite(lse[:, :, 3:]).all()


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_softcap_bounds_every_score(backend, device):
    """Under a soft-cap every score lies in (-cap, cap): with huge raw scores a row's LSE stays within
    log(keys) of the cap, and a cap far above the scores changes them by at most its relative bend."""
    dev = device if backend == "triton" else "cpu"
    q, k, v = (torch.randn(1, 2, 21, 16, device=dev) * 30 for _ in range(3))
    _, lse = gstar.flash_attention(q, k, v, softcap=3.0, return_lse=True, backend=backend)
    assert (lse <= 3.0 + math.log(21) + 1e-4).all() and (lse >= -3.0).all()
    small = [t / 30 for t in (q, k, v)]
    plain = gstar.flash_attention(*small, backend=backend)
    torch.testing.assert_close(gstar.flash_attention(*small, softcap=1e4, backend=backend), plain, rtol=1e-4,
                               atol=1e-5)


def test_softcap_gradient_matches_finite_differences():
    q, k, v = (torch.randn(1, 2, 5, 4, dtype=torch.float64, requires_grad=True) for _ in range(3))
    assert torch.autograd.gradcheck(lambda *t: gstar.tiled_attention(*t, causal=True, chunk=3, softcap=0.9),
                                    (q, k, v))


@pytest.mark.gpu
def test_gpu_fp8_softcap_matches_dequantized():
    """FP8 inputs under a soft-cap: the descales scale the raw scores inside the tanh (the kernels fold them into
    the cap's factor), as the dequantised inputs on the PyTorch path do."""
    x = [torch.randn(1, 2, n, 32, device="cuda") for n in (19, 25, 25)]
    (q, qd), (k, kd), (v, vd) = (gstar.quantize_fp8(t * 4) for t in x)
    kw = dict(causal=True, softcap=1.2, chunk=10, q_descale=qd, k_descale=kd, v_descale=vd, out_dtype=torch.float32)
    out = gstar.flash_attention(q, k, v, backend="triton", **kw)
    ref = gstar.flash_attention(q, k, v, backend="torch", **kw)
    assert relative_error(out, ref) < 1e-2  # P V in bfloat16 on the kernel's side


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_packed_spans_equal_each_sequence(backend, device):
    """Packed sequences with span ids per packed key (a span may not run into the next sequence: its ids are cut
    there) give each sequence's result alone, out, LSE and gradients."""
    dev = device if backend == "triton" else "cpu"
    lengths = [19, 0, 33, 1, 12]
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device=dev)
    total = sum(lengths)
    ids = torch.zeros(total, dtype=torch.long)
    ids[3:11], ids[15:24], ids[30:40], ids[52:60] = 1, 2, 2, 3   # 15:24 crosses the first sequence's end
    ids = ids.to(dev)
    q, k, v = (torch.randn(total, h, 16, device=dev, requires_grad=True) for h in (4, 2, 2))
    kw = dict(causal=True, window=(5, 0), softcap=3.0, backend=backend)
    out, lse = gstar.flash_attention_varlen(q, k, v, cu, cu, max(lengths), max(lengths), spans=ids, return_lse=True,
                                            **kw)
    dout = torch.randn_like(out)
    grads = torch.autograd.grad((out * dout).sum() + lse.sum(), (q, k, v))
    c = cu.tolist()
    for s in range(len(lengths)):
        r = slice(c[s], c[s + 1])
        if c[s] == c[s + 1]:
            continue
        one = [t.detach()[r].transpose(0, 1)[None].requires_grad_() for t in (q, k, v)]  # (1, H, n, D)
        o1, l1 = gstar.flash_attention(*one, spans=ids[r][None], return_lse=True, **kw)
        g1 = torch.autograd.grad((o1 * dout[r].transpose(0, 1)[None]).sum() + l1.sum(), one)
        torch.testing.assert_close(out[r], o1[0].transpose(0, 1), rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(lse[:, r], l1[0], rtol=1e-5, atol=1e-6)
        for g, want in zip(grads, g1):
            torch.testing.assert_close(g[r], want[0].transpose(0, 1), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_prefix_span_is_bidirectional_prefix(backend, device):
    """A prefix-LM: one span over the first P positions under a causal mask. The prefix's rows equal bidirectional
    attention over the prefix alone; the rows after it are plain causal rows."""
    dev = device if backend == "triton" else "cpu"
    P, N = 13, 40
    q, k, v = (torch.randn(1, 2, N, 16, device=dev) for _ in range(3))
    ids = torch.zeros(1, N, dtype=torch.long, device=dev)
    ids[:, :P] = 1
    out = gstar.flash_attention(q, k, v, causal=True, spans=ids, backend=backend)
    prefix = gstar.flash_attention(q[:, :, :P], k[:, :, :P], v[:, :, :P], backend=backend)
    torch.testing.assert_close(out[:, :, :P], prefix, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(out[:, :, P:], gstar.flash_attention(q, k, v, causal=True, backend=backend)[:, :, P:],
                               rtol=1e-5, atol=1e-6)


def test_span_bounds_cut_runs_and_sequences():
    ids = torch.tensor([[0, 1, 1, 1, 0, 2, 2, 1, 1, 1]])
    assert span_bounds(ids).tolist() == [[[0, 0], [1, 4], [1, 4], [1, 4], [4, 4], [5, 7], [5, 7], [7, 10], [7, 10],
                                          [7, 10]]]
    cu = torch.tensor([0, 4, 4, 10, 10], dtype=torch.int32)    # empty sequences, the last one at the end
    packed = torch.tensor([0, 1, 1, 1, 1, 1, 2, 2, 0, 3])
    assert span_bounds(packed, cu).tolist() == [[0, 0], [1, 4], [1, 4], [1, 4], [0, 2], [0, 2], [2, 4], [2, 4],
                                                [4, 4], [5, 6]]


BAD = [  # keyword, value, exception, text
    ("softcap", -1.0, ValueError, "softcap must be a finite float >= 0"),
    ("softcap", float("nan"), ValueError, "softcap must be a finite float >= 0"),
    ("softcap", float("inf"), ValueError, "softcap must be a finite float >= 0"),
    ("softcap", True, TypeError, "softcap must be a float"),
    ("softcap", "50", TypeError, "softcap must be a float"),
    ("softcap", 1e-320, ValueError, "scale / softcap overflows"),
    ("chunk", -1, ValueError, "chunk must be >= 0"),
    ("chunk", 8.0, TypeError, "chunk must be an int"),
    ("chunk", True, TypeError, "chunk must be an int"),
]


@pytest.mark.parametrize("entry, spans, exc, text", [
    ("dense", torch.zeros(1, 4, dtype=torch.long), ValueError, r"spans must be \(B, Nk\) = \(1, 5\)"),
    ("dense", torch.zeros(1, 5), TypeError, "spans must be an integer or bool tensor"),
    ("dense", [0, 1, 1, 0, 0], TypeError, "spans must be a torch.Tensor"),
    ("varlen", torch.zeros(1, 5, dtype=torch.long), ValueError, "spans must have 1 dims"),
    ("varlen", torch.zeros(4, dtype=torch.long), ValueError, r"spans must be \(total_k,\) = \(5,\)"),
])
def test_bad_spans_raise_clear_errors(entry, spans, exc, text):
    q, k, v = torch.randn(1, 2, 5, 8), torch.randn(1, 2, 5, 8), torch.randn(1, 2, 5, 8)
    with pytest.raises(exc, match=text):
        if entry == "dense":
            gstar.flash_attention(q, k, v, spans=spans)
        else:
            cu = torch.tensor([0, 5], dtype=torch.int32)
            gstar.flash_attention_varlen(q[0].transpose(0, 1), k[0].transpose(0, 1), v[0].transpose(0, 1), cu, cu,
                                         5, 5, spans=spans)


@pytest.mark.parametrize("entry", ["dense", "varlen", "kvcache"])
@pytest.mark.parametrize("name, value, exc, text", BAD, ids=[f"{b[0]}={b[1]!r}" for b in BAD])
def test_bad_values_raise_clear_errors(entry, name, value, exc, text):
    q, k, v = torch.randn(1, 2, 5, 8), torch.randn(1, 2, 5, 8), torch.randn(1, 2, 5, 8)
    with pytest.raises(exc, match=text):
        if entry == "dense":
            gstar.flash_attention(q, k, v, **{name: value})
        elif entry == "varlen":
            cu = torch.tensor([0, 5], dtype=torch.int32)
            gstar.flash_attention_varlen(q[0].transpose(0, 1), k[0].transpose(0, 1), v[0].transpose(0, 1), cu, cu,
                                         5, 5, **{name: value})
        else:
            gstar.flash_attention_with_kvcache(q[:, :, :1], k, v, **{name: value})
