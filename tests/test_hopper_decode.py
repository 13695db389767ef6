"""The Gluon decode kernel for FP8 caches (gstar.kernels.sm90.decode): which calls the dispatcher gives it and the
plan that takes it (on CPU, the GPU's facts stood in), and on the GPU tier both decode kernels on every pattern it accepts,
FP8 and bfloat16 queries, one and two queries, ragged lengths, within the bar of the float64 oracle.
"""

import pytest
import torch

import gstar
from gstar.lab.accuracy import verdict
from gstar.kernels import card, dispatch
from gstar.kernels.common import split
from gstar.kernels.portable import decode
from gstar.kernels.sm90 import decode as hopper_decode
from gstar.pattern import Pattern

F8 = torch.float8_e4m3fn
gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (GPU tier)")


def _meta(*shape, dtype=F8):
    return torch.empty(*shape, dtype=dtype, device="meta")


@pytest.mark.parametrize("q_dtype, cache, dim, stacked, paged, expected", [
    (F8, "contiguous", 64, 8, False, True),
    (torch.bfloat16, "contiguous", 64, 16, False, True),
    (torch.float16, "contiguous", 64, 16, False, True),
    (torch.float32, "contiguous", 64, 8, False, False),   # float32 queries: the portable kernel
    (F8, "contiguous", 64, 32, False, False),              # more rows than one mma.sync tile
    (F8, "contiguous", 128, 8, False, False),              # head dim 128 spills
    (F8, "bf16", 64, 8, False, False),                     # a 16-bit cache
    (F8, "heads-inner", 64, 8, False, False),              # keys not in consecutive rows
    (F8, "paged 64", 64, 8, True, True),                   # pages of whole tiles
    (F8, "paged 16", 64, 8, True, False),                  # a tile would straddle pages
    (F8, "paged, heads apart", 64, 8, True, False),        # a page's rows not consecutive
])
def test_serves(q_dtype, cache, dim, stacked, paged, expected):
    q = _meta(2, 16, 1, dim, dtype=q_dtype)
    if cache == "heads-inner":  # (B, N, Hkv, D) seen as (B, Hkv, N, D)
        k = v = _meta(2, 1000, 2, dim).transpose(1, 2)
    elif cache.startswith("paged"):  # (pages, page, Hkv, D)
        k = v = (_meta(30, 2, 64, dim).transpose(1, 2) if "apart" in cache
                 else _meta(30, int(cache.split()[1]), 2, dim))
    else:
        k = v = _meta(2, 2, 1000, dim, dtype=torch.bfloat16 if cache == "bf16" else F8)
    assert _takes(q, k, v, paged, stacked) is expected


def _takes(q, k, v, paged, stacked):
    """Whether the dispatcher gives the Gluon kernel such a call on an sm_90 GPU (a cache long enough): its
    tables, and a cache laid out as its word loads read it."""
    call = dispatch.Call("decode", q.dtype, k.dtype, q.shape[-1], v.shape[-1], Pattern.make(1, 1 << 20), stacked,
                         paged=paged)
    return dispatch.serves_sm90(call) and hopper_decode.fits(k, v, paged)


def test_not_served_off_the_gpu():
    call = dispatch.Call("decode", torch.bfloat16, F8, 64, 64, Pattern.make(1, 1 << 20), 8)
    assert dispatch.serves_sm90(call) and dispatch.family(call, torch.device("cpu")) == dispatch.PORTABLE


def _plan(monkeypatch, capacity, window=(-1, -1), B=1, num_splits=None, major=9, registers=True, page=0):
    """The plan of a decode step of GPT-OSS heads on an sm_``major`` GPU of 132 SMs under a verified Triton;
    ``registers``: the cache laid out as the Gluon kernel reads it."""
    monkeypatch.setattr(card, "sm_count", lambda device: 132)
    monkeypatch.setattr(card, "capability_major", lambda device: major)
    monkeypatch.setattr(dispatch, "VERIFIED", True)
    call = dispatch.Call("decode", torch.bfloat16, F8, 64, 64, Pattern.make(1, capacity, causal=True, window=window),
                         8, paged=page > 0)
    for cached in (decode.plan, hopper_decode.plan):  # plans of the real card, none left made on a stand-in
        cached.cache_clear()
    try:
        with monkeypatch.context() as m:
            m.setattr(hopper_decode, "fits", lambda *args: registers)
            plan, = dispatch.decode_plans(call, torch.device("cuda"), (None, None), B, 8, page, num_splits)
            return plan
    finally:
        for cached in (decode.plan, hopper_decode.plan):
            cached.cache_clear()


@pytest.mark.parametrize("capacity, window, B, kernel, splits", [
    (131072, (-1, -1), 1, "gluon", 132 * 12 // 8),         # one wave: twelve programs an SM
    (32768, (-1, -1), 8, "gluon", 132 * 12 // 64),
    (16384, (-1, -1), 1, "gluon", 16384 // 32 // 4),       # four tiles a split at least
    (32768, (-1, -1), 64, "gluon", 132 * 12 // 512 * 3),  # a wave's splits of 10,923 keys: three waves of them
    (16384, (-1, -1), 256, "gluon", 4),                    # more pairs than one wave: splits of SPLIT_KEYS
    (8192, (-1, -1), 1, "triton", None),                   # below SM90_DECODE_KEYS: the portable kernel
    (131072, (127, 0), 1, "triton", None),                 # a window shows a few blocks
])
def test_plan_takes_the_kernel_from_min_keys(monkeypatch, capacity, window, B, kernel, splits):
    plan = _plan(monkeypatch, capacity, window, B)
    assert (plan.kernel is hopper_decode._decode_sm90) == (kernel == "gluon")
    if splits is not None:
        assert plan.splits == splits and plan.grid == (splits, 8, B)
        assert dict(plan.options)["num_warps"] == 1


@pytest.mark.parametrize("major, registers, early", [(9, True, True), (9, False, True), (8, False, False)])
def test_plan_launches_the_combine_early_from_sm90(monkeypatch, major, registers, early):
    """From sm_90 the combine is a programmatic dependent of the decode kernel (launch_pdl, and its programs
    wait for the decode kernel's writes); before, an ordinary launch with no wait compiled in."""
    plan = _plan(monkeypatch, 131072, major=major, registers=registers)
    assert plan.splits > 1 and (plan.kernel is hopper_decode._decode_sm90) == registers
    combine = dict(plan.merge)
    assert combine["PDL"] is early and combine["launch_pdl"] is early
    if plan.kernel is decode._decode:  # the portable kernel lets the combine launch only where it is early
        assert dict(plan.options)["PDL"] is early


@pytest.mark.parametrize("page, key_words", [(0, 64 // 4), (64, 8 * 64 // 4), (256, 8 * 64 // 4)])
def test_plan_walks_contiguous_and_paged_caches(monkeypatch, page, key_words):
    """The Gluon kernel's key rows lie D bytes apart in a contiguous cache, Hkv D in a paged one (a page's rows
    hold every head); PAGE is the page size, 0 for a contiguous cache."""
    options = dict(_plan(monkeypatch, 131072, page=page).options)
    assert options["KEY_WORDS"] == key_words and options["PAGE"] == page


@pytest.mark.parametrize("capacity, B, page, num_splits, lines", [
    (32768, 8, 64, None, True),      # splits of 1,365 keys: whole L2 lines
    (32768, 64, 64, None, True),     # 3,641
    (131072, 1, 64, None, False),    # 662: short walks keep their 64-byte fetches
    (16384, 4, 64, None, False),     # 334
    (32768, 8, 0, None, False),      # a contiguous cache's lines are the program's own
    (3008, 3, 64, 1, True),          # the GPU test's one split over a paged cache (MIN_KEYS 0 there)
    (3008, 3, 64, 3, False),         # its three
])
def test_plan_fetches_whole_lines_on_long_paged_walks(monkeypatch, capacity, B, page, num_splits, lines):
    monkeypatch.setattr(dispatch, "SM90_DECODE_KEYS", 0)
    plan = _plan(monkeypatch, capacity, B=B, page=page, num_splits=num_splits)
    assert plan.kernel is hopper_decode._decode_sm90 and dict(plan.options)["LINES"] is lines


def test_plan_keeps_num_splits(monkeypatch):
    plan = _plan(monkeypatch, 65536, num_splits=7)
    assert plan.kernel is hopper_decode._decode_sm90 and plan.splits == 7


PATTERNS = {  # id: (keywords, learned sinks)
    "full": (dict(causal=False), False),
    "causal-sinks": (dict(causal=True), True),
    "window-sinks": (dict(causal=True, window=(9, 0)), True),
    "window-sink-tokens": (dict(causal=False, window=(700, 3), sink_tokens=2), False),
}


def _dequantized(x8, descale, group=1):
    return x8.double() * descale.double().repeat_interleave(group, dim=1)[:, :, None, None]


def _paged(x, page, order):
    """Contiguous x (B, Hkv, N, D) as pages (B N / page, page, Hkv, D): block j of sequence b in page
    ``order[b * N / page + j]``."""
    B, Hkv, N, D = x.shape
    blocks = x.permute(0, 2, 1, 3).reshape(B * N // page, page, Hkv, D)
    pages = blocks.new_empty(blocks.shape)  # contiguous pages, whatever the view above
    pages[order] = blocks
    return pages


def _queries(q, q_fp8, Hkv):
    """q (float32) as the call takes it, FP8 with its (B, Hkv) descale or bfloat16 with None."""
    return gstar.quantize_fp8(q, kv_heads=Hkv) if q_fp8 else (q.bfloat16(), None)


def _run(q, k8, v8, lengths, descales, pattern, sinks, num_splits, kernel, monkeypatch, **extra):
    """The call's output through ``kernel`` ("gluon": every cache length, MIN_KEYS set to 0; "triton": the
    Gluon kernel refused: the cache taken as one it cannot read), and the kernels it launched. ``extra``: more keywords of the call (the keys and
    values it appends, a block table)."""
    launched = []
    real = split.launch
    with monkeypatch.context() as m:
        m.setattr(split, "launch", lambda fn, *a: launched.append(fn) or real(fn, *a))
        m.setattr(dispatch, "SM90_DECODE_KEYS", 0)
        if kernel == "triton":
            m.setattr(hopper_decode, "fits", lambda *a: False)
        with torch.no_grad():
            out = gstar.flash_attention_with_kvcache(q, k8, v8, cache_seqlens=lengths, sinks=sinks,
                                                     num_splits=num_splits, **descales, **pattern, **extra)
    return out, launched


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("pattern_id", list(PATTERNS))
@pytest.mark.parametrize("q_fp8", [True, False], ids=["fp8-queries", "bf16-queries"])
# one split walks the whole paged cache (3,008 keys): the whole-line loads (hopper_decode.lines); the others do not
@pytest.mark.parametrize("nq, num_splits", [(1, None), (2, 3), (1, 1)])
@pytest.mark.parametrize("page", [0, 64], ids=["contiguous", "paged-64"])
def test_gpu_both_kernels_within_bar(pattern_id, q_fp8, nq, num_splits, page, monkeypatch):
    g = torch.Generator().manual_seed(6)
    B, Hq, Hkv, D, capacity = 3, 16, 2, 64, 3008 if page else 3001
    lengths = torch.tensor([nq, 777, 3001], dtype=torch.int32, device="cuda")
    k8, kd = gstar.quantize_fp8(torch.randn(B, Hkv, capacity, D, generator=g).cuda())
    v8, vd = gstar.quantize_fp8(torch.randn(B, Hkv, capacity, D, generator=g).cuda())
    q, qd = _queries(torch.randn(B, Hq, nq, D, generator=g).cuda(), q_fp8, Hkv)
    pattern, learned = PATTERNS[pattern_id]
    sinks = (torch.randn(Hq, generator=g) * 2).cuda() if learned else None
    descales = dict(q_descale=qd, k_descale=kd, v_descale=vd)
    k_cache, v_cache, paged = k8, v8, {}
    if page:  # the same keys in shuffled pages
        order = torch.randperm(B * capacity // page, generator=g).cuda()
        k_cache, v_cache = _paged(k8, page, order), _paged(v8, page, order)
        paged = dict(block_table=order.view(B, -1).int())
    outs = {}
    for kernel in ("gluon", "triton"):
        outs[kernel], launched = _run(q, k_cache, v_cache, lengths, descales, pattern, sinks, num_splits, kernel,
                                      monkeypatch, **paged)
        assert (hopper_decode._decode_sm90 in launched) == (kernel == "gluon"), launched
    for b in range(B):
        n = int(lengths[b])
        q_b = _dequantized(q[b:b + 1], qd[b:b + 1], Hq // Hkv) if q_fp8 else q[b:b + 1].double()
        k_b, v_b = _dequantized(k8[b:b + 1, :, :n], kd[b:b + 1]), _dequantized(v8[b:b + 1, :, :n], vd[b:b + 1])
        ref, _ = gstar.naive_attention(q_b, k_b, v_b, sinks=None if sinks is None else sinks.double(), **pattern)
        pt, _ = gstar.naive_attention(*(t.bfloat16() for t in (q_b, k_b, v_b)), sinks=sinks, **pattern)
        for kernel, out in outs.items():
            check = verdict(f"{kernel} sequence {b}", out[b:b + 1], ref, pt)
            assert check.ok, check


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("q_fp8", [True, False], ids=["fp8-queries", "bf16-queries"])
def test_gpu_appended_keys_through_both_kernels(q_fp8, monkeypatch):
    """Keys and values appended by the call (``k=``, ``v=``) are attended to by both kernels: the queries sit
    after each sequence's cached keys, the cache holds the new rows afterwards."""
    g = torch.Generator().manual_seed(8)
    B, Hq, Hkv, D, capacity, nq = 2, 16, 2, 64, 2500, 2  # 16 stacked rows: one tile of the Gluon kernel
    lengths = torch.tensor([5, 2001], dtype=torch.int32, device="cuda")
    k8, kd = gstar.quantize_fp8(torch.randn(B, Hkv, capacity, D, generator=g).cuda())
    v8, vd = gstar.quantize_fp8(torch.randn(B, Hkv, capacity, D, generator=g).cuda())
    k_new = (torch.randn(B, Hkv, nq, D, generator=g).cuda() / kd[:, :, None, None]).clamp(-448, 448).to(F8)
    v_new = (torch.randn(B, Hkv, nq, D, generator=g).cuda() / vd[:, :, None, None]).clamp(-448, 448).to(F8)
    q, qd = _queries(torch.randn(B, Hq, nq, D, generator=g).cuda(), q_fp8, Hkv)
    sinks = torch.randn(Hq, generator=g).cuda()
    descales = dict(q_descale=qd, k_descale=kd, v_descale=vd)
    outs = {}
    for kernel in ("gluon", "triton"):
        k_cache, v_cache = k8.clone(), v8.clone()
        outs[kernel], launched = _run(q, k_cache, v_cache, lengths, descales, dict(causal=True), sinks, None, kernel,
                                      monkeypatch, k=k_new, v=v_new)
        assert (hopper_decode._decode_sm90 in launched) == (kernel == "gluon"), launched
        for b in range(B):
            n = int(lengths[b])
            assert torch.equal(k_cache[b, :, n:n + nq].view(torch.uint8), k_new[b].view(torch.uint8))
            assert torch.equal(v_cache[b, :, n:n + nq].view(torch.uint8), v_new[b].view(torch.uint8))
    for b in range(B):
        n = int(lengths[b]) + nq
        keys = torch.cat([k8[b:b + 1, :, :n - nq], k_new[b:b + 1]], dim=2)
        values = torch.cat([v8[b:b + 1, :, :n - nq], v_new[b:b + 1]], dim=2)
        q_b = _dequantized(q[b:b + 1], qd[b:b + 1], Hq // Hkv) if q_fp8 else q[b:b + 1].double()
        k_b, v_b = _dequantized(keys, kd[b:b + 1]), _dequantized(values, vd[b:b + 1])
        ref, _ = gstar.naive_attention(q_b, k_b, v_b, sinks=sinks.double(), causal=True)
        pt, _ = gstar.naive_attention(*(t.bfloat16() for t in (q_b, k_b, v_b)), sinks=sinks, causal=True)
        for kernel, out in outs.items():
            check = verdict(f"{kernel} sequence {b}", out[b:b + 1], ref, pt)
            assert check.ok, check


@pytest.mark.gpu
@gpu
def test_gpu_long_cache_takes_the_gluon_kernel(monkeypatch):
    """A cache past MIN_KEYS takes the Gluon kernel by itself (no setting changed), ragged lengths within it."""
    g = torch.Generator().manual_seed(7)
    B, Hq, Hkv, D, capacity = 2, 64, 8, 64, dispatch.SM90_DECODE_KEYS + 35
    lengths = torch.tensor([9000, capacity], dtype=torch.int32, device="cuda")
    k8, kd = gstar.quantize_fp8(torch.randn(B, Hkv, capacity, D, generator=g).cuda())
    v8, vd = gstar.quantize_fp8(torch.randn(B, Hkv, capacity, D, generator=g).cuda())
    q = torch.randn(B, Hq, 1, D, generator=g).bfloat16().cuda()
    sinks = torch.randn(Hq, generator=g).cuda()
    launched = []
    real = split.launch
    monkeypatch.setattr(split, "launch", lambda fn, *a: launched.append(fn) or real(fn, *a))
    with torch.no_grad():
        out = gstar.flash_attention_with_kvcache(q, k8, v8, cache_seqlens=lengths, sinks=sinks, k_descale=kd,
                                                 v_descale=vd)
    assert hopper_decode._decode_sm90 in launched
    for b in range(B):
        n = int(lengths[b])
        k_b, v_b = _dequantized(k8[b:b + 1, :, :n], kd[b:b + 1]), _dequantized(v8[b:b + 1, :, :n], vd[b:b + 1])
        ref, _ = gstar.naive_attention(q[b:b + 1].double(), k_b, v_b, sinks=sinks.double(), causal=True)
        pt, _ = gstar.naive_attention(q[b:b + 1], k_b.bfloat16(), v_b.bfloat16(), sinks=sinks, causal=True)
        check = verdict(f"sequence {b}", out[b:b + 1], ref, pt)
        assert check.ok, check
