"""The warp-specialised sm_90 forward (gstar.kernels.sm90.forward): it meets the accuracy bar beside the portable
kernel on every pattern it accepts, at odd lengths, dense and packed, 16-bit and FP8 (the GPU tier, Hopper
only), and the dispatcher (gstar.kernels.dispatch) sends it the calls its tables give it and nothing else.
Gluon kernels have no interpreter: tests/test_kernel_sass.py compiles this one for sm_90a on the CPU."""

import pytest
import torch

import gstar
from inputs import make_qkv
from gstar.lab.accuracy import verdict
from gstar.fp8 import FP8
from gstar.kernels import attention_forward, card, dispatch
from gstar.kernels.sm90 import forward as sm90_forward
from gstar.pattern import Pattern
from gstar.reference import naive_attention

HOPPER = torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9
hopper_only = pytest.mark.skipif(not HOPPER, reason="needs an sm_90 GPU (H100 / H200)")


def _serves(dtype, D, Dv, pattern, packed=False):
    return dispatch.serves_sm90(dispatch.Call("forward", dtype, dtype, D, Dv, pattern, 1, packed))


@pytest.mark.parametrize("dtype,D,Dv,nq,causal,window,expected", [
    (torch.bfloat16, 128, 128, 256, True, (-1, -1), True),
    (torch.float16, 128, 128, 128, False, (-1, -1), True),
    (torch.bfloat16, 128, 128, 256, False, (-1, 0), True),     # causal spelled as a window
    (torch.bfloat16, 128, 128, 256, True, (127, 0), False),    # a window layer
    (torch.bfloat16, 128, 128, 256, False, (-1, 5), False),    # a right bound past the diagonal
    (torch.bfloat16, 128, 128, 127, True, (-1, -1), False),    # less than one Q tile
    (torch.bfloat16, 128, 64, 256, True, (-1, -1), False),     # Dv != D off the table
    (torch.bfloat16, 192, 128, 256, True, (-1, -1), True),     # latent attention's training dims
    (torch.bfloat16, 192, 192, 256, True, (-1, -1), False),
    (torch.bfloat16, 256, 256, 256, True, (-1, -1), True),     # Gemma's head dim
    (torch.bfloat16, 256, 256, 256, True, (127, 0), False),    # a narrow window: the portable kernel
    (torch.float32, 128, 128, 256, True, (-1, -1), False),
    (torch.bfloat16, 64, 64, dispatch.SM90_FORWARD[64, 64], True, (-1, -1), True),
    (torch.bfloat16, 64, 64, dispatch.SM90_FORWARD[64, 64] - 1, True, (-1, -1), False),  # below D 64's least length
    (torch.bfloat16, 64, 64, sm90_forward.block_m(64), False, (-1, -1), True),  # dense full attention walks from one tile
    (torch.bfloat16, 64, 64, sm90_forward.block_m(64) - 1, False, (-1, -1), False),  # (of 192 rows: three consumers)
    (torch.bfloat16, 96, 96, 8192, True, (-1, -1), False),     # a head dim off the table
    (FP8, 128, 128, 256, True, (-1, -1), (128, 128) in dispatch.SM90_FORWARD_FP8),
    (FP8, 64, 64, 256, False, (-1, -1), (64, 64) in dispatch.SM90_FORWARD_FP8),
    (FP8, 128, 128, 256, True, (127, 0), False),         # an FP8 window layer
    (FP8, 128, 64, 256, True, (-1, -1), False),
])
def test_serves(dtype, D, Dv, nq, causal, window, expected):
    pattern = Pattern.make(nq, 300, causal=causal, window=window)
    assert _serves(dtype, D, Dv, pattern) == expected


@pytest.mark.parametrize("D,Dv,window,packed,expected", [
    (256, 256, (4095, 0), False, True),     # Gemma 2's sliding layers at 8k
    (256, 256, (1023, 0), False, True),     # Gemma 3's
    (256, 256, (1022, 0), False, False),    # below the least width
    (128, 128, (1023, 0), False, True),
    (128, 128, (255, 0), False, False),
    (192, 128, (1023, 0), False, True),
    (64, 64, (4095, 0), False, False),      # D 64's windows: the portable kernel
    (256, 256, (1023, 0), True, False),     # packed windows: the portable kernel
    (256, 256, (1023, 5), False, False),    # a right bound past the diagonal
])
def test_serves_wide_windows(D, Dv, window, packed, expected):
    """The forward takes causal windows from dispatch.SM90_FORWARD_WINDOW's width on (a window of 1023 + 1 keys at
    1024), dense only; the backward never takes a window."""
    pattern = Pattern.make(8192, 8192, window=window)
    assert pattern.left == window[0]  # narrower than the keys: still a window
    assert _serves(torch.bfloat16, D, Dv, pattern, packed=packed) == expected
    backward = dispatch.Call("backward", torch.bfloat16, torch.bfloat16, D, Dv, pattern, 1)
    assert not dispatch.serves_sm90(backward)


def test_window_wider_than_the_keys_is_causal():
    """A left bound that hides no key is dropped (Pattern.make), so such a window takes the causal layer's kernel."""
    pattern = Pattern.make(4096, 4096, window=(4095, 0))
    assert pattern == Pattern.make(4096, 4096, causal=True)
    assert _serves(torch.bfloat16, 256, 256, pattern)


@pytest.mark.parametrize("nq,causal,expected", [
    (128, False, False),                        # packed full attention keeps the per-item grid's table
    (dispatch.SM90_FORWARD[64, 64], False, True),
    (dispatch.SM90_FORWARD[64, 64] - 1, True, False),    # causal: the same table, packed or not
])
def test_serves_packed(nq, causal, expected):
    pattern = Pattern.make(nq, nq, causal=causal)
    assert _serves(torch.bfloat16, 64, 64, pattern, packed=True) == expected


def test_not_supported_off_the_gpu():
    call = dispatch.Call("forward", torch.bfloat16, torch.bfloat16, 128, 128, Pattern.make(256, 256, causal=True), 1)
    assert dispatch.serves_sm90(call) and dispatch.family(call, torch.device("cpu")) == dispatch.PORTABLE


def test_sitting_out_says_why(monkeypatch):
    """On an sm_90 GPU under a Triton release outside dispatch.RELEASES, `gstar check` and `gstar bench` say that
    the Gluon kernels sit out and name the verified releases; on a verified release, another card or the CPU
    they say nothing."""
    cuda = torch.device("cuda")
    monkeypatch.setattr(card, "capability_major", lambda device: 9)
    monkeypatch.setattr(dispatch, "VERIFIED", False)
    note = dispatch.sitting_out(cuda)
    assert "portable kernels run" in note and all(r.rstrip(".") in note for r in dispatch.RELEASES), note
    assert dispatch.sitting_out(torch.device("cpu")) is None
    monkeypatch.setattr(dispatch, "VERIFIED", True)
    assert dispatch.sitting_out(cuda) is None
    monkeypatch.setattr(dispatch, "VERIFIED", False)
    monkeypatch.setattr(card, "capability_major", lambda device: 8)
    assert dispatch.sitting_out(cuda) is None


def _oracle(q, k, v, sinks, pattern, dtype):
    return naive_attention(q.to(dtype), k.to(dtype), v.to(dtype), window=(pattern.left, pattern.right),
                           sink_tokens=pattern.sink_tokens, sinks=None if sinks is None else sinks.to(dtype),
                           scale=q.shape[-1] ** -0.5)


def _check(out, lse, q, k, v, sinks, pattern, low=None):
    """The 2x bar against PyTorch in ``low`` (default: q's dtype), on out and LSE, with a float32 oracle; empty
    rows' outputs exact zeros, their LSE -inf or (learned sinks) the sink to a float32 rounding: the kernel
    carries the sink in base 2, ``sink * log2(e)``, and takes it back to natural log. FP8: q, k, v are the
    dequantised inputs (float64) and ``low`` bfloat16."""
    ref_out, ref_lse = _oracle(q, k, v, sinks, pattern, torch.float32)
    pt_out, pt_lse = _oracle(q, k, v, sinks, pattern, low or q.dtype)
    for v_ in (verdict("out", out, ref_out, pt_out), verdict("lse", lse, ref_lse, pt_lse)):
        assert v_.ok, str(v_)
    empty = ~pattern.mask(q.device).any(dim=-1)  # (Nq,) rows with no key: Nq > Nk under a causal mask
    assert torch.equal(out[:, :, empty], torch.zeros_like(out[:, :, empty]))
    expected = torch.full_like(lse, float("-inf")) if sinks is None else sinks.view(1, -1, 1).expand_as(lse)
    torch.testing.assert_close(lse[:, :, empty], expected[:, :, empty], rtol=2 ** -21, atol=0)


HEAD_DIMS = sorted(sm90_forward.TILES)  # every (D, Dv) the kernel has tiles for


@pytest.mark.gpu
@hopper_only
@pytest.mark.parametrize("D,Dv", HEAD_DIMS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("Nq,Nk", [(128, 128), (1000, 1000), (777, 300), (300, 777), (129, 4097)])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("with_sinks", [False, True])
def test_gpu_both_kernels_within_bar(D, Dv, dtype, Nq, Nk, causal, with_sinks):
    """Every pattern the Hopper kernel accepts (full, causal; learned sinks; GQA; (B, N, H, D) strides) at
    odd lengths and every head-dim pair it has tiles for (D 192 in two parts, D 256 in blocks of 64 keys): the
    Hopper kernel and the portable one (``config={}`` keeps it) each within the bar."""
    q, k, _ = make_qkv(2, 8, 2, Nq, Nk, D, dtype, device="cuda", layout="bnhd")
    v = make_qkv(2, 8, 2, Nq, Nk, Dv, dtype, device="cuda", layout="bnhd")[2]
    sinks = torch.randn(8, device="cuda") if with_sinks else None
    pattern = Pattern.make(Nq, Nk, causal=causal)
    out = q.new_full((*q.shape[:3], Dv), float("nan"))
    lse = torch.full(q.shape[:3], float("nan"), device="cuda")
    sm90_forward.forward(q, k, v, sinks, out, lse, pattern, D ** -0.5)
    _check(out, lse, q, k, v, sinks, pattern)
    _check(*attention_forward(q, k, v, sinks, pattern, D ** -0.5, config={}), q, k, v, sinks, pattern)


@pytest.mark.gpu
@hopper_only
@pytest.mark.parametrize("D,Dv", HEAD_DIMS)
@pytest.mark.parametrize("Nq,Nk", [(1000, 1000), (777, 300), (129, 4097)])
@pytest.mark.parametrize("window,sink_tokens", [((33, 0), 0), ((300, 0), 4), ((1023, 0), 0)])
@pytest.mark.parametrize("with_sinks", [False, True])
def test_gpu_windows_within_bar(D, Dv, Nq, Nk, window, sink_tokens, with_sinks):
    """Causal windows (narrower than a block, wider than a tile, with sink tokens) on the Hopper kernel at every
    head-dim pair: within the bar."""
    q, k, _ = make_qkv(2, 8, 2, Nq, Nk, D, torch.bfloat16, device="cuda", layout="bnhd")
    v = make_qkv(2, 8, 2, Nq, Nk, Dv, torch.bfloat16, device="cuda", layout="bnhd")[2]
    sinks = torch.randn(8, device="cuda") if with_sinks else None
    pattern = Pattern.make(Nq, Nk, window=window, sink_tokens=sink_tokens)
    out = q.new_full((*q.shape[:3], Dv), float("nan"))
    lse = torch.full(q.shape[:3], float("nan"), device="cuda")
    sm90_forward.forward(q, k, v, sinks, out, lse, pattern, D ** -0.5)
    _check(out, lse, q, k, v, sinks, pattern)


@pytest.mark.gpu
@hopper_only
@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("Nq,Nk", [(1000, 1000), (129, 4097)])
@pytest.mark.parametrize("with_sinks", [False, True])
@pytest.mark.parametrize("programs", [1, 3])
def test_gpu_walk_over_many_rounds(D, Nq, Nk, with_sinks, programs, monkeypatch):
    """Dense full attention walks its items: on a card of 1 or 3 SMs every program takes many items (the Q
    ring's slots and phases, the deferred output stores), and the output is bitwise the one of a walk over
    the card's SMs (each item's arithmetic is the same), within the bar."""
    q, k, v = make_qkv(2, 8, 2, Nq, Nk, D, torch.bfloat16, device="cuda", layout="bnhd")
    sinks = torch.randn(8, device="cuda") if with_sinks else None
    pattern = Pattern.make(Nq, Nk)
    full = [torch.full_like(q, float("nan")), torch.full(q.shape[:3], float("nan"), device="cuda")]
    sm90_forward.forward(q, k, v, sinks, *full, pattern, D ** -0.5)
    monkeypatch.setattr(card, "sm_count", lambda device: programs)
    few = [torch.full_like(q, float("nan")), torch.full(q.shape[:3], float("nan"), device="cuda")]
    sm90_forward.forward(q, k, v, sinks, *few, pattern, D ** -0.5)
    assert torch.equal(few[0], full[0]) and torch.equal(few[1], full[1])
    _check(*few, q, k, v, sinks, pattern)


@pytest.mark.gpu
@hopper_only
@pytest.mark.parametrize("D,Dv,fp8", [(D, Dv, False) for D, Dv in HEAD_DIMS] + [(64, 64, True), (128, 128, True)])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("with_sinks", [False, True])
def test_gpu_packed_sequences(D, Dv, fp8, causal, with_sinks):
    """Packed sequences of odd, unequal lengths (a longest one of 300 rows, one shorter than a tile, Nq != Nk
    both ways), bfloat16 or FP8 (descales per sequence and kv head): each sequence within the bar against its
    own oracle, for both kernels; no row of one sequence written by another's tile (the output starts as
    NaN)."""
    lengths_q, lengths_k = [300, 77, 129, 1], [300, 200, 64, 129]
    cu_q = torch.tensor([0, *torch.tensor(lengths_q).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    cu_k = torch.tensor([0, *torch.tensor(lengths_k).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    q = torch.randn(sum(lengths_q), 8, D, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(sum(lengths_k), 2, d, device="cuda", dtype=torch.bfloat16) for d in (D, Dv))
    values, fp8_args, low = (q, k, v), {}, None  # values: what the oracle attends to
    if fp8:
        (q, qd), (k, kd), (v, vd) = (gstar.quantize_fp8(x, cu_seqlens=cu, kv_heads=2)
                                     for x, cu in ((q, cu_q), (k, cu_k), (v, cu_k)))
        seq_q, seq_k = (torch.repeat_interleave(torch.tensor(n, device="cuda")) for n in (lengths_q, lengths_k))
        values = (q.double() * qd.double().repeat_interleave(4, 1)[seq_q][:, :, None],
                  k.double() * kd.double()[seq_k][:, :, None], v.double() * vd.double()[seq_k][:, :, None])
        fp8_args, low = dict(descale=(qd, kd, vd)), torch.bfloat16
    sinks = torch.randn(8, device="cuda") if with_sinks else None
    view = lambda t: t.transpose(0, 1).unsqueeze(0)  # noqa: E731 - (1, H, total, D), as ops passes them
    pattern = Pattern.make(max(lengths_q), max(lengths_k), causal=causal)
    out = torch.full((1, 8, q.shape[0], Dv), float("nan"), device="cuda", dtype=torch.bfloat16)
    lse = torch.full((1, 8, q.shape[0]), float("nan"), device="cuda")
    v_kernel = v.bfloat16() if fp8 else v  # FP8 calls hand the kernel V widened to bfloat16
    sm90_forward.forward(view(q), view(k), view(v_kernel), sinks, out, lse, pattern, D ** -0.5, (cu_q, cu_k), **fp8_args)
    portable = attention_forward(view(q), view(k), view(v), sinks, pattern, D ** -0.5, config={},
                                 cu_seqlens=(cu_q, cu_k), out_dtype=low, **fp8_args)
    q, k, v = map(view, values)
    for s, (nq, nk) in enumerate(zip(lengths_q, lengths_k)):
        rows, keys = slice(cu_q[s], cu_q[s] + nq), slice(cu_k[s], cu_k[s] + nk)
        seq = Pattern.make(nq, nk, causal=causal)
        args = (q[:, :, rows], k[:, :, keys], v[:, :, keys], sinks, seq)
        _check(out[:, :, rows], lse[:, :, rows], *args, low=low)
        _check(portable[0][:, :, rows], portable[1][:, :, rows], *args, low=low)


@pytest.mark.gpu
@hopper_only
@pytest.mark.parametrize("D,Nq,causal,window,dtype,expected", [
    (128, 1000, True, (-1, -1), torch.bfloat16, True),
    (128, 1000, False, (-1, -1), torch.float16, True),
    (128, 1000, False, (127, 0), torch.bfloat16, False),  # window layers: the portable kernel
    (128, 100, True, (-1, -1), torch.bfloat16, False),   # less than one full Q tile
    (64, 1000, True, (-1, -1), torch.bfloat16, False),    # D 64 below its least query length
    (64, dispatch.SM90_FORWARD[64, 64], True, (-1, -1), torch.bfloat16, True),
    (64, 1000, False, (-1, -1), torch.bfloat16, True),    # dense full attention at D 64: the walk
    (128, 1000, True, (-1, -1), torch.float32, False),
])
def test_gpu_dispatch(D, Nq, causal, window, dtype, expected, monkeypatch):
    """attention_forward takes the sm_90 kernel exactly where the dispatcher's tables say."""
    calls = []
    monkeypatch.setattr(sm90_forward, "forward", lambda *a: calls.append(a) or hopper_forward(*a))
    q, k, v = make_qkv(1, 4, 2, Nq, Nq, D, dtype, device="cuda")
    attention_forward(q, k, v, None, Pattern.make(Nq, Nq, causal=causal, window=window), D ** -0.5)
    assert bool(calls) == (expected and dispatch.VERIFIED)  # other Triton releases keep the portable kernel


hopper_forward = sm90_forward.forward


def _fp8(q, k, v):
    """FP8 q, k, v (each kv head's group scaled alike), their (B, Hkv) descales as the kernels take them,
    and the dequantised float64 values they stand for."""
    group = q.shape[1] // k.shape[1]
    (q8, qd), (k8, kd), (v8, vd) = gstar.quantize_fp8(q, kv_heads=k.shape[1]), *map(gstar.quantize_fp8, (k, v))
    deq = [x.double() * d.double().repeat_interleave(g, 1)[:, :, None, None]
           for x, d, g in ((q8, qd, group), (k8, kd, 1), (v8, vd, 1))]
    return (q8, k8, v8), (qd, kd, vd), deq


@pytest.mark.gpu
@hopper_only
@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("Nq,Nk", [(1000, 1000), (777, 300), (129, 4097)])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("with_sinks", [False, True])
def test_gpu_fp8_both_kernels_within_bar(D, Nq, Nk, causal, with_sinks):
    """FP8 q, k, v with their descales, every pattern the Hopper kernel accepts at odd lengths ((B, N, H, D)
    strides, GQA): the Hopper kernel and the portable one each within the FP8 bar (PyTorch in bfloat16 on the
    dequantised inputs); the output starts as NaN."""
    qkv, descale, deq = _fp8(*make_qkv(2, 8, 2, Nq, Nk, D, torch.float32, device="cuda", layout="bnhd"))
    sinks = torch.randn(8, device="cuda") if with_sinks else None
    pattern = Pattern.make(Nq, Nk, causal=causal)
    out = torch.full(qkv[0].shape, float("nan"), device="cuda", dtype=torch.bfloat16)
    lse = torch.full(out.shape[:3], float("nan"), device="cuda")
    sm90_forward.forward(*qkv[:2], qkv[2].bfloat16(), sinks, out, lse, pattern, D ** -0.5, descale=descale)
    _check(out, lse, *deq, sinks, pattern, low=torch.bfloat16)
    portable = attention_forward(*qkv, sinks, pattern, D ** -0.5, config={}, descale=descale,
                                 out_dtype=torch.bfloat16)
    _check(*portable, *deq, sinks, pattern, low=torch.bfloat16)


@pytest.mark.gpu
@hopper_only
@pytest.mark.parametrize("D,out_dtype", [(128, torch.bfloat16), (64, torch.float16), (128, torch.float32)])
def test_gpu_fp8_dispatch(D, out_dtype, monkeypatch):
    """An FP8 call of a served kind takes the Hopper kernel on sm_90 (any output dtype), and its result is
    the portable kernel's to within the bar."""
    calls = []
    monkeypatch.setattr(sm90_forward, "forward", lambda *a: calls.append(a) or hopper_forward(*a))
    qkv, descale, deq = _fp8(*make_qkv(1, 4, 2, 1000, 1000, D, torch.float32, device="cuda"))
    pattern = Pattern.make(1000, 1000, causal=True)
    out, lse = attention_forward(*qkv, None, pattern, D ** -0.5, descale=descale, out_dtype=out_dtype)
    assert bool(calls) == ((D, D) in dispatch.SM90_FORWARD_FP8 and dispatch.VERIFIED) and out.dtype == out_dtype
    _check(out.float(), lse, *deq, None, pattern, low=torch.bfloat16)

