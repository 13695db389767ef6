"""The Triton backward (dQ, dK, dV, dsinks, and the LSE gradient) against naive attention's autograd.

CPU tier (Triton interpreter): float32 with IEEE dots must reach relative error < 1e-4 on every gradient;
float16 must stay within 3x the naive float16 implementation's error (docs/design.md section 4). The kernel is
fed (out, lse) from the float64 oracle, and separately run end to end behind the forward kernel through
``gstar.flash_attention(backend="triton")``. GPU tier (``@pytest.mark.gpu``): bfloat16/float16 at the
shapes of docs/design.md section 4 against float32 naive attention on the GPU (the stage-9 row takes the split
dK/dV path; another test forces splits and both loop forms), bitwise determinism over 20 calls (split and unsplit), and forward + backward peak memory
linear in N. The split dK/dV path (float32 partials summed in a fixed order) and the flat loops are forced
on CPU through ``BackwardConfig(head_splits=, q_chunk=, flat=)``.
"""

import dataclasses

import pytest
import torch

import gstar
from inputs import make_qkv
from gstar.lab.accuracy import relative_error, verdict
from gstar.kernels import attention_backward, card
from gstar.kernels.portable.tiles import BackwardConfig, backward_config
from gstar.kernels.portable.schedule import W_END, W_FULL_END, W_FULL_START, W_START, W_TILE, _auto_split, split_plan
from gstar.pattern import Pattern, q_block_table
from gstar.reference import naive_attention

GRADS = ("dq", "dk", "dv", "dsinks")


@pytest.fixture(autouse=True)
def _first_tier_device(request, device):
    """Unmarked tests make tensors on the default device: the GPU when there is one, else the CPU
    (where the Triton interpreter runs them)."""
    if "gpu" in request.keywords:
        yield
        return
    torch.set_default_device(device)
    yield
    torch.set_default_device("cpu")


def _sinks(kind, Hq, device=None):
    """None, or (Hq,) float32 learned sink logits: "mixed" small values, "pm20" alternating +-20."""
    if kind is None:
        return None
    if kind == "pm20":
        return torch.tensor([20.0, -20.0] * (Hq // 2) + [20.0] * (Hq % 2), device=device)
    return torch.randn(Hq, device=device) * 3


def _oracle(q, k, v, sinks, dout, dlse, pattern_args, scale, dtype):
    """naive_attention in ``dtype`` and its autograd gradients: ``(out, lse, (dq, dk, dv, dsinks))``.

    dout: (B, Hq, Nq, D) gradient of out; dlse: None or (B, Hq, Nq) gradient of the LSE.
    """
    leaves = [t.detach().to(dtype).requires_grad_() for t in (q, k, v)]
    stat = torch.promote_types(dtype, torch.float32)
    sk = None if sinks is None else sinks.detach().to(stat).requires_grad_()
    out, lse = naive_attention(*leaves, sinks=sk, scale=scale, **pattern_args)
    outputs, grads = [out], [dout.to(dtype)]
    if dlse is not None:
        outputs.append(lse)
        grads.append(dlse.to(lse.dtype))
    inputs = leaves + ([sk] if sk is not None else [])
    g = torch.autograd.grad(outputs, inputs, grads)
    return out.detach(), lse.detach(), (*g[:3], g[3] if sk is not None else None)


def _backward(q, k, v, sinks, dout, dlse, pattern_args, scale, config=None):
    """attention_backward on (out, lse) of the float64 oracle; out is cast to (and laid out like) q."""
    Nq, Nk = q.shape[2], k.shape[2]
    ref_out, ref_lse, ref = _oracle(q, k, v, sinks, dout, dlse, pattern_args, scale, torch.float64)
    out = torch.empty_like(q).copy_(ref_out)
    pattern = Pattern.make(Nq, Nk, **pattern_args)
    grads = attention_backward(dout, q, k, v, out, ref_lse.float(), dlse, sinks, pattern, scale, config=config)
    return grads, ref, pattern


def _check_exact_zeros(grads, pattern):
    """Rows that see no key get dq exactly 0, keys no row sees get dk = dv = 0, and nothing is NaN."""
    dq, dk, dv, dsinks = grads
    mask = pattern.mask(dq.device)                                            # (Nq, Nk)
    empty_rows, unseen_keys = ~mask.any(dim=1), ~mask.any(dim=0)
    for g in (dq, dk, dv) + (() if dsinks is None else (dsinks,)):
        assert torch.isfinite(g).all()
    assert not dq[:, :, empty_rows].any()
    assert not dk[:, :, unseen_keys].any() and not dv[:, :, unseen_keys].any()


def _check_fp32(grads, ref):
    for name, g, r in zip(GRADS, grads, ref):
        assert (g is None) == (r is None), name
        if g is not None:
            err = relative_error(g, r)
            assert err < 1e-4, f"{name}: relative error {err:.3g}"


def _check_bar(grads, ref, pt):
    """The 3x gradient bar of docs/design.md section 4."""
    for name, g, r, p in zip(GRADS, grads, ref, pt):
        if g is not None:
            v = verdict(name, g, r, p, factor=3.0)
            assert v.ok, str(v)


# ----------------------------------------------------------------------------------------------------
# CPU tier: Triton interpreter, tiles 16/32 (backward_config's CPU row) so every shape spans several.

# (B, Hq, Hkv, Nq, Nk, D, pattern, learned sinks, use the LSE gradient)
CASES = [
    ("plain", 1, 2, 2, 17, 33, 16, dict(), None, False),
    ("causal_nq_gt_nk", 1, 4, 2, 33, 17, 40, dict(causal=True), None, True),        # rows 0..15 empty
    ("causal_mqa_sinks20", 2, 4, 1, 70, 70, 64, dict(causal=True), "pm20", False),
    ("window_lt_tile", 1, 4, 1, 113, 70, 16, dict(window=(5, 0), sink_tokens=3), None, True),
    ("window_gt_tile", 1, 4, 4, 70, 113, 40, dict(window=(40, 5), sink_tokens=20), "mixed", True),
    ("gqa4_unseen_keys", 1, 8, 2, 17, 70, 16, dict(causal=True, window=(3, 0)), None, False),
    ("right_bound_empty", 1, 2, 1, 33, 17, 24, dict(window=(5, 2)), "mixed", True),  # empty rows, sinks
    ("diagonal_sinks", 1, 2, 1, 40, 40, 16, dict(window=(0, 0)), "mixed", False),  # without sinks dq = 0
    ("one_query", 1, 2, 2, 1, 70, 64, dict(causal=True, window=(15, 0), sink_tokens=2), "mixed", True),
    ("one_key", 1, 2, 1, 70, 1, 16, dict(), None, True),
    ("right_only", 1, 2, 1, 33, 47, 16, dict(window=(-1, 3)), None, False),
    ("left_only_sink_tokens", 1, 2, 1, 33, 47, 16, dict(window=(7, -1), sink_tokens=2), None, True),
]


def _case_inputs(case, dtype, layout="bhnd"):
    _, B, Hq, Hkv, Nq, Nk, D, pattern_args, sinks_kind, use_dlse = case
    q, k, v = make_qkv(B, Hq, Hkv, Nq, Nk, D, dtype, layout=layout)
    dout = torch.randn(B, Hq, Nq, D).to(dtype)
    dlse = torch.randn(B, Hq, Nq) if use_dlse else None
    return q, k, v, _sinks(sinks_kind, Hq), dout, dlse, pattern_args, D ** -0.5


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_fp32_matches_oracle(case):
    q, k, v, sinks, dout, dlse, pattern_args, scale = _case_inputs(case, torch.float32)
    grads, ref, pattern = _backward(q, k, v, sinks, dout, dlse, pattern_args, scale)
    assert [g.dtype for g in grads[:3]] == [torch.float32] * 3
    assert grads[3] is None or (grads[3].dtype == torch.float32 and grads[3].shape == (q.shape[1],))
    _check_fp32(grads, ref)
    _check_exact_zeros(grads, pattern)


@pytest.mark.parametrize("config", [BackwardConfig(32, 16, 16, 32), BackwardConfig(16, 16, 16, 16),
                                    BackwardConfig(32, 64, 64, 32)], ids=["32x16", "16x16", "32x64"])
@pytest.mark.parametrize("case", [CASES[2], CASES[4]], ids=[CASES[2][0], CASES[4][0]])
def test_fp32_other_tiles(case, config):
    q, k, v, sinks, dout, dlse, pattern_args, scale = _case_inputs(case, torch.float32)
    grads, ref, pattern = _backward(q, k, v, sinks, dout, dlse, pattern_args, scale, config=config)
    _check_fp32(grads, ref)
    _check_exact_zeros(grads, pattern)


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_fp32_tma_loads(case):
    """Tiles read through tensor descriptors: zero fill past Nq / Nk and past the head dim replaces masks."""
    q, k, v, sinks, dout, dlse, pattern_args, scale = _case_inputs(case, torch.float32, layout="bnhd")
    config = BackwardConfig(16, 32, 32, 16, dkdv_warps=1, dq_warps=1, dkdv_tma=True, dq_tma=True)
    grads, ref, pattern = _backward(q, k, v, sinks, dout, dlse, pattern_args, scale, config=config)
    _check_fp32(grads, ref)
    _check_exact_zeros(grads, pattern)


# dQ tiles holding several query heads of a GQA group: (case, dq_pack, flat loops)
PACK_CASES = [
    (CASES[1], 2, False),  # Nq > Nk: the first tiles' rows are all empty; LSE gradient
    (CASES[2], 4, False),  # MQA group 4 with +-20 sinks: one dsinks share per head of the tile; 70 rows end mid-tile
    (CASES[3], 4, True),   # MQA window with sink tokens, flat loops, 8 positions per head
    (CASES[5], 4, False),  # GQA 4 (two kv heads: the second tile of heads reads the other K/V)
    (CASES[6], 2, True),   # GQA 2, rows with no key, mixed sinks, LSE gradient, flat loops
]


@pytest.mark.parametrize("case,pack,flat", PACK_CASES, ids=[f"{c[0][0]}-pack{c[1]}" for c in PACK_CASES])
def test_fp32_packed_dq(case, pack, flat):
    q, k, v, sinks, dout, dlse, pattern_args, scale = _case_inputs(case, torch.float32)
    config = BackwardConfig(16, 32, 32, 16, dkdv_warps=1, dq_warps=1, flat=flat, dq_pack=pack)
    grads, ref, pattern = _backward(q, k, v, sinks, dout, dlse, pattern_args, scale, config=config)
    _check_fp32(grads, ref)
    _check_exact_zeros(grads, pattern)


@pytest.mark.parametrize("case", [CASES[1], CASES[3], CASES[4], CASES[6]],
                         ids=[CASES[i][0] for i in (1, 3, 4, 6)])
def test_fp16_within_bar(case):
    q, k, v, sinks, dout, dlse, pattern_args, scale = _case_inputs(case, torch.float16)
    grads, ref, pattern = _backward(q, k, v, sinks, dout, dlse, pattern_args, scale)
    assert [g.dtype for g in grads[:3]] == [torch.float16] * 3
    _, _, pt = _oracle(q, k, v, sinks, dout, dlse, pattern_args, scale, torch.float16)
    _check_bar(grads, ref, pt)
    _check_exact_zeros(grads, pattern)


@pytest.mark.parametrize("layout,dlse_dtype", [("bnhd", torch.float32), ("packed", torch.float16)])
def test_fp32_strided_inputs(layout, dlse_dtype):
    """Transposed / packed q, k, v, dout, out and a strided dLSE of another dtype are read in place;
    the gradients follow the layouts of q, k, v."""
    B, Hq, Hkv, Nq, Nk, D = 2, 4, 2, 37, 29, 48
    q, k, v = make_qkv(B, Hq, Hkv, Nq, Nk, D, torch.float32, layout=layout)
    dout = torch.randn(B, Nq, Hq, D).transpose(1, 2)
    dlse = torch.randn(B, Hq, Nq, 3).to(dlse_dtype)[..., 1]
    sinks = _sinks("mixed", Hq)
    pattern_args = dict(window=(9, 0), sink_tokens=2)
    grads, ref, pattern = _backward(q, k, v, sinks, dout, dlse, pattern_args, 0.3)
    for g, t in zip(grads[:3], (q, k, v)):
        assert g.stride() == torch.empty_like(t).stride()
    assert grads[0].transpose(1, 2).is_contiguous()
    _check_fp32(grads, ref)
    _check_exact_zeros(grads, pattern)


# Split dK/dV (partials summed in a fixed order) and the flat loops, forced through the config:
# (case, head_splits, q_chunk, flat)
SPLIT_CASES = [
    (CASES[2], 4, 1, False),  # MQA, group of 4 split per head, causal: the first KV tiles cut into 1-tile items
    (CASES[3], 2, 2, False),  # MQA window with 3 sink tokens: the sink tile is seen by every Q tile
    (CASES[3], 2, 3, True),   # the same, flat loops over (head, Q tile) pairs and (sink, band) KV blocks
    (CASES[4], 1, 1, False),  # no head split, Q ranges cut (window, 20 sink tokens over two KV tiles)
    (CASES[4], 1, 0, True),   # flat, no split (q_chunk 0 on CPU: whole ranges)
    (CASES[5], 4, 3, False),  # GQA 4, keys no row sees (their items are empty and must still give zeros)
    (CASES[1], 2, 1, True),   # Nq > Nk, empty rows, LSE gradient
]


@pytest.mark.parametrize("case,head_splits,q_chunk,flat", SPLIT_CASES,
                         ids=[f"{c[0][0]}-h{c[1]}-c{c[2]}{'-flat' if c[3] else ''}" for c in SPLIT_CASES])
def test_fp32_split_dkdv(case, head_splits, q_chunk, flat):
    q, k, v, sinks, dout, dlse, pattern_args, scale = _case_inputs(case, torch.float32)
    config = BackwardConfig(16, 16, 32, 16, head_splits=head_splits, q_chunk=q_chunk, flat=flat)
    grads, ref, pattern = _backward(q, k, v, sinks, dout, dlse, pattern_args, scale, config=config)
    _check_fp32(grads, ref)
    _check_exact_zeros(grads, pattern)


def test_fp16_split_dkdv_within_bar():
    q, k, v, sinks, dout, dlse, pattern_args, scale = _case_inputs(CASES[3], torch.float16)
    config = BackwardConfig(16, 16, 32, 16, head_splits=4, q_chunk=2, flat=True)
    grads, ref, pattern = _backward(q, k, v, sinks, dout, dlse, pattern_args, scale, config=config)
    assert [g.dtype for g in grads[:3]] == [torch.float16] * 3
    _, _, pt = _oracle(q, k, v, sinks, dout, dlse, pattern_args, scale, torch.float16)
    _check_bar(grads, ref, pt)


def test_split_plan_items_cover_each_tile():
    """Every KV tile's Q range is cut into consecutive items of at most q_chunk tiles, in order, and the
    unmasked part of each item is the tile's unmasked part clipped to it."""
    pattern = Pattern.make(113, 70, window=(5, 0), sink_tokens=3)
    table = q_block_table(pattern, 16, 16).tolist()
    head_splits, work, first = split_plan(pattern, 16, 16, 4, 1, "cpu", head_splits=2, q_chunk=2)
    work, first = work.tolist(), first.tolist()
    assert head_splits == 2 and first[0] == 0 and first[-1] == len(work) and len(first) == len(table) + 1
    for t, (start, full_start, full_end, end) in enumerate(table):
        items = work[first[t]:first[t + 1]]
        assert [i[W_TILE] for i in items] == [t] * len(items)
        assert items[0][W_START] == start and items[-1][W_END] == end
        for a, b in zip(items, items[1:]):
            assert a[W_END] == b[W_START]
        for i in items:
            lo, hi = i[W_START], i[W_END]
            assert hi - lo <= 2
            assert i[W_FULL_START] == min(max(full_start, lo), hi) and i[W_FULL_END] == min(max(full_end, lo), hi)


def test_split_plan_defaults():
    """On CPU nothing is split; on a 132-SM card the stage-9 shapes are spread over >= 2 waves, the
    gpt-oss causal group is split in two (measured faster), its 128-key window and FlashAttention's
    full MHA shape, whose grids are already large, are not split."""
    stage9 = Pattern.make(4096, 4096, causal=True, window=(255, 0), sink_tokens=4)
    assert split_plan(stage9, 64, 64, 16, 1, "cpu")[0] == 1
    for pattern in (stage9, Pattern.make(4096, 4096, causal=True, window=(255, 0))):
        counts = [r[3] - r[0] for r in q_block_table(pattern, 64, 64).tolist()]
        head_splits, chunk = _auto_split(counts, 16, 1, 132)
        items = sum(max(1, -(-c // chunk)) for c in counts)
        assert head_splits * items >= 2 * 132
        steps = 16 // head_splits * min(chunk, max(counts))
        assert steps * 2 * 132 <= 4 * sum(counts) * 16  # the longest program: at most ~2x a fair share
    gptoss = Pattern.make(4096, 4096, causal=True)
    assert _auto_split([r[3] - r[0] for r in q_block_table(gptoss, 64, 64).tolist()], 8, 16, 132) == (2, 64)
    window = Pattern.make(4096, 4096, causal=True, window=(127, 0))
    assert _auto_split([r[3] - r[0] for r in q_block_table(window, 64, 64).tolist()], 8, 16, 132)[0] == 1
    fa = Pattern.make(8192, 8192)
    assert _auto_split([r[3] - r[0] for r in q_block_table(fa, 64, 128).tolist()], 1, 64, 132) == (1, 128)


@pytest.mark.parametrize("case,config", [(CASES[4], None),
                                         (CASES[2], BackwardConfig(16, 16, 32, 16, head_splits=2, q_chunk=1))],
                         ids=["default", "split"])
def test_repeatable_bits(case, config):
    q, k, v, sinks, dout, dlse, pattern_args, scale = _case_inputs(case, torch.float32)
    first, _, _ = _backward(q, k, v, sinks, dout, dlse, pattern_args, scale, config=config)
    again, _, _ = _backward(q, k, v, sinks, dout, dlse, pattern_args, scale, config=config)
    assert all(torch.equal(a, b) for a, b in zip(first, again))


def test_empty_inputs():
    q, k, v = make_qkv(1, 2, 1, 0, 5, 16, torch.float32)
    sinks = torch.zeros(2)
    lse = torch.empty(1, 2, 0)
    out = torch.empty_like(q)
    dq, dk, dv, dsinks = attention_backward(out, q, k, v, out, lse, None, sinks, Pattern.make(0, 5), 0.25)
    assert dq.shape == q.shape and not dk.any() and not dv.any() and not dsinks.any()


def test_interpreter_config_is_small():
    cfg = backward_config(64, torch.float32, Pattern.make(100, 100), "cpu")
    assert max(cfg.dkdv_m, cfg.dkdv_n, cfg.dq_m, cfg.dq_n) <= 32


@pytest.mark.parametrize("capability,D,pattern_args,batch_heads,expected", [
    ((9, 0), 64, dict(causal=True), 2 * 64, (True, True)),          # gpt-oss causal: work 1.4e11
    ((9, 0), 128, dict(causal=True), 2 * 64, (False, True)),        # dK/dV at D = 128 measured slower
    ((9, 0), 64, dict(causal=True, window=(127, 0)), 2 * 64, (False, False)),  # narrow window
    ((9, 0), 16, dict(causal=True), 16, (False, False)),            # stage shape: work 4.3e9, host-bound
    ((8, 0), 64, dict(causal=True), 2 * 64, (False, False)),        # no copy engine before Hopper
])
def test_cuda_config_descriptor_rule(capability, D, pattern_args, batch_heads, expected, monkeypatch):
    monkeypatch.setattr(card, "capability_major", lambda device: capability[0])
    cfg = backward_config(D, torch.bfloat16, Pattern.make(4096, 4096, **pattern_args), "cuda",
                          batch_heads=batch_heads)
    assert (cfg.dkdv_tma, cfg.dq_tma) == expected


@pytest.mark.parametrize("D,group,pattern_args,expected", [
    (64, 8, dict(causal=True, window=(127, 0)), (64, 32, 4)),   # gpt-oss window: 16 positions of 4 heads
    (64, 4, dict(causal=True, window=(127, 0)), (64, 32, 4)),
    (48, 8, dict(window=(100, 20)), (64, 32, 4)),               # padded head dim, band of 121 keys
    (64, 2, dict(causal=True, window=(127, 0)), (64, 64, 1)),   # too few heads to pack
    (64, 8, dict(causal=True), (128, 64, 1)),                   # causal: even or slower packed
    (16, 16, dict(causal=True, window=(255, 0)), (64, 64, 1)),  # head dim 16: not measured faster
    (64, 8, dict(causal=True, window=(511, 0)), (128, 64, 1)),  # a wider band is not narrow
])
def test_cuda_config_packed_dq_rule(D, group, pattern_args, expected, monkeypatch):
    monkeypatch.setattr(card, "capability_major", lambda device: 9)
    cfg = backward_config(D, torch.bfloat16, Pattern.make(4096, 4096, **pattern_args), "cuda", batch_heads=64,
                          group=group)
    assert (cfg.dq_m, cfg.dq_n, cfg.dq_pack) == expected


def _end_to_end(q, k, v, sinks, dout, dlse, pattern_args, scale):
    """Gradients of ``out . dout + lse . dlse`` through gstar.flash_attention(backend="triton")."""
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]  # same storage: strided layouts survive
    sk = None if sinks is None else sinks.detach().requires_grad_()
    out, lse = gstar.flash_attention(*leaves, sinks=sk, scale=scale, backend="triton", return_lse=True,
                                     **pattern_args)
    outputs, grads = [out], [dout]
    if dlse is not None:
        outputs.append(lse)
        grads.append(dlse)
    inputs = leaves + ([sk] if sk is not None else [])
    g = torch.autograd.grad(outputs, inputs, grads)
    return (*g[:3], g[3] if sk is not None else None)


@pytest.mark.parametrize("case,layout", [(CASES[1], "bhnd"), (CASES[4], "packed"), (CASES[6], "bnhd")],
                         ids=[CASES[1][0], CASES[4][0], CASES[6][0]])
def test_end_to_end_fp32(case, layout):
    q, k, v, sinks, dout, dlse, pattern_args, scale = _case_inputs(case, torch.float32, layout)
    grads = _end_to_end(q, k, v, sinks, dout, dlse, pattern_args, scale)
    _, _, ref = _oracle(q, k, v, sinks, dout, dlse, pattern_args, scale, torch.float64)
    _check_fp32(grads, ref)
    _check_exact_zeros(grads, Pattern.make(q.shape[2], k.shape[2], **pattern_args))


def test_end_to_end_stride_zero_grads():
    """``out.sum() + lse.sum()`` hands the backward expanded (all strides 0) gradients."""
    q, k, v, sinks, _, _, pattern_args, scale = _case_inputs(CASES[4], torch.float32)
    leaves = [t.detach().requires_grad_() for t in (q, k, v, sinks)]
    out, lse = gstar.flash_attention(*leaves[:3], sinks=leaves[3], scale=scale, backend="triton",
                                     return_lse=True, **pattern_args)
    grads = torch.autograd.grad(out.sum() + lse.sum(), leaves)
    dout, dlse = torch.ones_like(out), torch.ones_like(lse)
    _, _, ref = _oracle(q, k, v, sinks, dout, dlse, pattern_args, scale, torch.float64)
    _check_fp32(grads, ref)


def test_end_to_end_fp16_within_bar():
    q, k, v, sinks, dout, dlse, pattern_args, scale = _case_inputs(CASES[3], torch.float16, "bnhd")
    grads = _end_to_end(q, k, v, sinks, dout, dlse, pattern_args, scale)
    _, _, ref = _oracle(q, k, v, sinks, dout, dlse, pattern_args, scale, torch.float64)
    _, _, pt = _oracle(q, k, v, sinks, dout, dlse, pattern_args, scale, torch.float16)
    _check_bar(grads, ref, pt)


# ----------------------------------------------------------------------------------------------------
# GPU tier: bfloat16 / float16 end to end against float32 naive attention on the GPU.

def _oracle_by_kv_head(q, k, v, sinks, dout, dlse, pattern_args, scale, dtype):
    """:func:`_oracle` one kv head (and its query-head group) at a time, so that the (Nq, Nk) score
    matrices of the big shapes fit in memory. Returns the gradients only."""
    Hq, Hkv = q.shape[1], k.shape[1]
    G = Hq // Hkv
    parts = []
    for h in range(Hkv):
        heads = slice(h * G, (h + 1) * G)
        parts.append(_oracle(q[:, heads], k[:, h:h + 1], v[:, h:h + 1],
                             None if sinks is None else sinks[heads], dout[:, heads],
                             None if dlse is None else dlse[:, heads], pattern_args, scale, dtype)[2])
    cat = [torch.cat([p[i] for p in parts], dim=1) for i in range(3)]
    return (*cat, None if sinks is None else torch.cat([p[3] for p in parts]))


# (name, dtype, B, Hq, Hkv, Nq, Nk, D, pattern, learned-sink magnitude or 0, use the LSE gradient)
GPU_CASES = [
    ("stage9", torch.bfloat16, 1, 16, 1, 4096, 4096, 16, dict(window=(255, 0), sink_tokens=4), 0, False),
    ("gptoss_window", torch.bfloat16, 2, 64, 8, 4096, 4096, 64, dict(window=(127, 0)), 20, False),
    ("gptoss_causal", torch.float16, 2, 64, 8, 4096, 4096, 64, dict(causal=True), 20, True),
    ("d80_plain", torch.float16, 2, 8, 8, 113, 203, 80, dict(), 0, True),
    ("d128_causal_gqa4", torch.bfloat16, 2, 8, 2, 1023, 1024, 128, dict(causal=True), 5, False),
    ("d192_window31", torch.bfloat16, 1, 8, 1, 239, 256, 192, dict(causal=True, window=(31, 0), sink_tokens=4),
     0, True),
    ("d256_wide_sinks", torch.float16, 1, 8, 8, 1023, 1024, 256, dict(window=(200, 17), sink_tokens=300), 20,
     False),
    ("d96_nq_gt_nk", torch.bfloat16, 1, 8, 4, 256, 17, 96, dict(causal=True), 0, True),
    ("d32_right_only", torch.float16, 2, 8, 1, 127, 127, 32, dict(window=(-1, 5)), 0, False),
    ("d64_window63_gqa8", torch.bfloat16, 1, 8, 1, 17, 256, 64, dict(causal=True, window=(63, 0), sink_tokens=4),
     3, True),
]


def _check_end_to_end_bar(case, device):
    """One GPU_CASES row end to end against the float32 oracle on ``device``, with the 3x bar."""
    _, dtype, B, Hq, Hkv, Nq, Nk, D, pattern_args, sink_mag, use_dlse = case
    q, k, v = make_qkv(B, Hq, Hkv, Nq, Nk, D, dtype, device=device)
    sinks = (torch.rand(Hq, device=device) * 2 - 1) * sink_mag if sink_mag else None
    dout = torch.randn(B, Hq, Nq, D, device=device).to(dtype)
    dlse = torch.randn(B, Hq, Nq, device=device) if use_dlse else None
    scale = D ** -0.5
    grads = _end_to_end(q, k, v, sinks, dout, dlse, pattern_args, scale)
    ref = _oracle_by_kv_head(q, k, v, sinks, dout, dlse, pattern_args, scale, torch.float32)
    pt = _oracle_by_kv_head(q, k, v, sinks, dout, dlse, pattern_args, scale, dtype)
    _check_bar(grads, ref, pt)
    _check_exact_zeros(grads, Pattern.make(Nq, Nk, **pattern_args))


@pytest.mark.gpu
@pytest.mark.parametrize("case", GPU_CASES, ids=[c[0] for c in GPU_CASES])
def test_gpu_within_bar(case):
    _check_end_to_end_bar(case, "cuda")


def _check_config_on_gpu(Hkv, pattern_args, use_dlse, **changes):
    """bfloat16 (1, 8, Hkv, 1000, 64) with learned sinks, through attention_backward with backward_config's
    settings replaced by ``changes``, against the float32 oracle (the 3x bar) and the exact zeros."""
    B, Hq, N, D = 1, 8, 1000, 64
    q, k, v = make_qkv(B, Hq, Hkv, N, N, D, torch.bfloat16, device="cuda")
    sinks = (torch.rand(Hq, device="cuda") * 2 - 1) * 5
    dout = torch.randn(B, Hq, N, D, device="cuda").to(torch.bfloat16)
    dlse = torch.randn(B, Hq, N, device="cuda") if use_dlse else None
    pattern, scale = Pattern.make(N, N, **pattern_args), D ** -0.5
    cfg = dataclasses.replace(backward_config(D, torch.bfloat16, pattern, "cuda"), **changes)
    out, lse = gstar.flash_attention(q, k, v, sinks=sinks, scale=scale, backend="triton", return_lse=True,
                                     **pattern_args)
    grads = attention_backward(dout, q, k, v, out, lse, dlse, sinks, pattern, scale, config=cfg)
    ref = _oracle_by_kv_head(q, k, v, sinks, dout, dlse, pattern_args, scale, torch.float32)
    pt = _oracle_by_kv_head(q, k, v, sinks, dout, dlse, pattern_args, scale, torch.bfloat16)
    _check_bar(grads, ref, pt)
    _check_exact_zeros(grads, pattern)


@pytest.mark.gpu
@pytest.mark.parametrize("flat", [False, True], ids=["ranged", "flat"])
@pytest.mark.parametrize("pattern_args", [dict(causal=True), dict(causal=True, window=(200, 0), sink_tokens=4)],
                         ids=["causal", "window_sink_tokens"])
def test_gpu_forced_split_within_bar(pattern_args, flat):
    """The split dK/dV path (head and Q-range splits, float32 partials) on compiled kernels."""
    _check_config_on_gpu(2, pattern_args, False, head_splits=2, q_chunk=3, flat=flat)


@pytest.mark.gpu
@pytest.mark.parametrize("tma", [False, True], ids=["pointers", "descriptors"])
@pytest.mark.parametrize("pack", [2, 8])
def test_gpu_packed_dq_within_bar(pack, tma):
    """dQ tiles of several GQA heads on compiled kernels: a ragged length, learned sinks (one share per head
    of a tile), the LSE gradient, K/V through pointers and through descriptors."""
    _check_config_on_gpu(1, dict(causal=True, window=(127, 0)), True, dq_m=64, dq_n=32, dq_pack=pack, dq_tma=tma)


DESCRIPTOR_CASES = [GPU_CASES[i] for i in (3, 4, 7, 8, 9)]


@pytest.mark.gpu
@pytest.mark.parametrize("case", DESCRIPTOR_CASES, ids=[c[0] for c in DESCRIPTOR_CASES])
def test_gpu_descriptor_loads_within_bar(case):
    """Tensor-descriptor loads forced on at shapes below their work threshold: padded head dims, ragged
    lengths, empty rows, a narrow window's flat loops, in "bnhd" layout (strided heads)."""
    _, dtype, B, Hq, Hkv, Nq, Nk, D, pattern_args, sink_mag, use_dlse = case
    q, k, v = make_qkv(B, Hq, Hkv, Nq, Nk, D, dtype, device="cuda", layout="bnhd")
    sinks = (torch.rand(Hq, device="cuda") * 2 - 1) * sink_mag if sink_mag else None
    dout = torch.randn(B, Hq, Nq, D, device="cuda").to(dtype)
    dlse = torch.randn(B, Hq, Nq, device="cuda") if use_dlse else None
    pattern, scale = Pattern.make(Nq, Nk, **pattern_args), D ** -0.5
    pointers = dataclasses.replace(backward_config(D, dtype, pattern, "cuda"), dkdv_tma=False, dq_tma=False)
    out, lse = gstar.flash_attention(q, k, v, sinks=sinks, scale=scale, backend="triton", return_lse=True,
                                     **pattern_args)
    grads = attention_backward(dout, q, k, v, out, lse, dlse, sinks, pattern, scale,
                               config=dataclasses.replace(pointers, dkdv_tma=True, dq_tma=True))
    ref = _oracle_by_kv_head(q, k, v, sinks, dout, dlse, pattern_args, scale, torch.float32)
    pt = _oracle_by_kv_head(q, k, v, sinks, dout, dlse, pattern_args, scale, dtype)
    _check_bar((*grads[:3], None), ref, pt)
    _check_exact_zeros(grads, pattern)
    # dsinks comes from the row statistics, which no descriptor touches: the same bits as the pointer path
    # (its own bar is test_gpu_within_bar's)
    if sinks is not None:
        base = attention_backward(dout, q, k, v, out, lse, dlse, sinks, pattern, scale, config=pointers)
        assert torch.equal(grads[3], base[3])


@pytest.mark.gpu
@pytest.mark.parametrize("D", [64, 128, pytest.param(256, marks=pytest.mark.slow)])
def test_gpu_fp32_ieee(D):
    """float32 inputs on the GPU use IEEE dots (TF32 off by default): relative error < 1e-4."""
    assert not torch.backends.cuda.matmul.allow_tf32
    q, k, v = make_qkv(2, 4, 2, 300, 333, D, torch.float32, device="cuda")
    sinks = _sinks("mixed", 4, device="cuda")
    dout = torch.randn(2, 4, 300, D, device="cuda")
    dlse = torch.randn(2, 4, 300, device="cuda")
    pattern_args = dict(window=(70, 3), sink_tokens=5)
    grads = _end_to_end(q, k, v, sinks, dout, dlse, pattern_args, D ** -0.5)
    _, _, ref = _oracle(q, k, v, sinks, dout, dlse, pattern_args, D ** -0.5, torch.float64)
    _check_fp32(grads, ref)


@pytest.mark.gpu
@pytest.mark.parametrize("shape", [(2, 64, 8, 64, dict(window=(127, 0)), True),
                                   (1, 16, 1, 16, dict(causal=True, window=(255, 0), sink_tokens=4), False)],
                         ids=["gptoss_window", "stage9_split"])
def test_gpu_bitwise_deterministic(shape):
    """20 calls give the same bits; stage 9 (one kv head, sink tokens) takes the split dK/dV path."""
    B, Hq, Hkv, D, pattern_args, learned_sinks = shape
    N = 4096
    q, k, v = make_qkv(B, Hq, Hkv, N, N, D, torch.bfloat16, device="cuda")
    sinks = (torch.rand(Hq, device="cuda") * 2 - 1) * 20 if learned_sinks else None
    dout = torch.randn(B, Hq, N, D, device="cuda").to(torch.bfloat16)
    dlse = torch.randn(B, Hq, N, device="cuda")
    pattern = Pattern.make(N, N, **pattern_args)
    if not learned_sinks:
        cfg = backward_config(D, torch.bfloat16, pattern, "cuda")
        head_splits, work, first = split_plan(pattern, cfg.dkdv_m, cfg.dkdv_n, Hq // Hkv, Hkv * B, "cuda")
        assert head_splits > 1 or work.shape[0] > first.shape[0] - 1
    out, lse = gstar.flash_attention(q, k, v, sinks=sinks, backend="triton", return_lse=True, **pattern_args)
    first = attention_backward(dout, q, k, v, out, lse, dlse, sinks, pattern, D ** -0.5)
    for _ in range(19):
        again = attention_backward(dout, q, k, v, out, lse, dlse, sinks, pattern, D ** -0.5)
        assert all((a is None and b is None) or torch.equal(a, b) for a, b in zip(first, again))


def _peak_fwd_bwd_bytes(N, D=64):
    """Peak memory of one causal forward + backward at one head, above what its inputs already hold."""
    q, k, v = (torch.randn(1, 1, N, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
               for _ in range(3))
    dout = torch.randn(1, 1, N, D, device="cuda", dtype=torch.bfloat16)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    out = gstar.flash_attention(q, k, v, causal=True, backend="triton")
    out.backward(dout)
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - base


@pytest.mark.gpu
@pytest.mark.slow
def test_gpu_memory_linear_in_n():
    _peak_fwd_bwd_bytes(1024)  # compile outside the measurement
    small, large = _peak_fwd_bwd_bytes(8192), _peak_fwd_bwd_bytes(16384)
    assert large / small < 2.5, (small, large)
    assert large < 64 * 2**20  # a 16384 x 16384 float32 score matrix alone would be 1 GiB
