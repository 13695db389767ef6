"""The Triton forward kernel against the naive oracle (docs/design.md section 4).

CPU tier (Triton interpreter): float32 with IEEE dots must reach relative error < 1e-4; float16 must stay
within 2x the naive float16 implementation's error. GPU tier (``@pytest.mark.gpu``): bfloat16 and float16
over the shapes of docs/design.md section 4, with the float32 naive implementation on the GPU as the oracle.
"""

import pytest
import torch
import triton

import gstar
from inputs import make_qkv
from tiers import grid
from gstar.lab.accuracy import relative_error, verdict
from gstar.kernels import attention_forward, card
from gstar.kernels.common.walk import tiles_fastest
from gstar.kernels.portable import forward as portable_forward
from gstar.kernels.portable.tiles import forward_config
from gstar.pattern import Pattern
from gstar.reference import naive_attention


def _run(q, k, v, sinks, causal, window, sink_tokens, scale, config=None):
    pattern = Pattern.make(q.shape[2], k.shape[2], causal=causal, window=window, sink_tokens=sink_tokens)
    out, lse = attention_forward(q, k, v, sinks, pattern, scale, config=config)
    return out, lse, pattern


def _oracle(q, k, v, sinks, causal, window, sink_tokens, scale, dtype):
    """naive_attention with every input cast to ``dtype`` (float64 on CPU, float32 on the GPU)."""
    return naive_attention(q.to(dtype), k.to(dtype), v.to(dtype), causal=causal, window=window,
                           sink_tokens=sink_tokens, sinks=None if sinks is None else sinks.to(dtype),
                           scale=scale)


def _check_empty_rows(out, lse, sinks, pattern):
    """Rows with no visible key: exactly 0 output, LSE -inf (or the sink logit); everything else finite."""
    empty = ~pattern.mask(out.device).any(dim=-1)  # (Nq,)
    assert torch.equal(out[:, :, empty], torch.zeros_like(out[:, :, empty]))
    assert torch.isfinite(out).all()
    if sinks is None:
        assert torch.isneginf(lse[:, :, empty]).all() and torch.isfinite(lse[:, :, ~empty]).all()
    else:
        assert torch.isfinite(lse).all()
        expected = sinks.view(1, -1, 1).expand_as(lse)[:, :, empty]
        torch.testing.assert_close(lse[:, :, empty], expected, rtol=1e-6, atol=1e-6)


def _check_fp32(q, k, v, sinks=None, causal=False, window=(-1, -1), sink_tokens=0, scale=None, config=None):
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    out, lse, pattern = _run(q, k, v, sinks, causal, window, sink_tokens, scale, config)
    ref_out, ref_lse = _oracle(q, k, v, sinks, causal, window, sink_tokens, scale, torch.float64)
    assert out.dtype == q.dtype and out.stride() == torch.empty_like(q).stride()
    assert lse.dtype == torch.float32 and lse.shape == q.shape[:3]
    assert relative_error(out, ref_out) < 1e-4
    assert relative_error(lse, ref_lse) < 1e-4
    _check_empty_rows(out, lse, sinks, pattern)


def _check_bar(q, k, v, sinks=None, causal=False, window=(-1, -1), sink_tokens=0, scale=None, config=None,
               oracle_dtype=torch.float64):
    """The 2x bar of docs/design.md section 4 for 16-bit inputs, on out and on the LSE."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    out, lse, pattern = _run(q, k, v, sinks, causal, window, sink_tokens, scale, config)
    ref_out, ref_lse = _oracle(q, k, v, sinks, causal, window, sink_tokens, scale, oracle_dtype)
    pt_out, pt_lse = _oracle(q, k, v, sinks, causal, window, sink_tokens, scale, q.dtype)
    for v_ in (verdict("out", out, ref_out, pt_out), verdict("lse", lse, ref_lse, pt_lse)):
        assert v_.ok, str(v_)
    _check_empty_rows(out, lse, sinks, pattern)


# ----------------------------------------------------------------------------------------------------
# First tier: the Triton interpreter on CPU-only machines (default tiles 16 x 16, so every shape spans several
# tiles); on a GPU machine the same cases run on the GPU with its tiles.

# (Nq, Nk, D, Hq, Hkv): unequal lengths both ways, non-power-of-two head dims, GQA 1 / 2 / 4 and MQA
SHAPES = [
    (17, 33, 16, 2, 2),
    (33, 17, 40, 4, 2),
    (1, 70, 64, 4, 1),
    (70, 1, 80, 2, 1),
    (113, 127, 16, 8, 2),
]
# (causal, window, sink_tokens): windows below, equal to and above the 16-key tile; sink tokens inside
# and beyond the window; a right bound only; a left bound only
PATTERNS = [
    (False, (-1, -1), 0),
    (True, (-1, -1), 0),
    (True, (3, 0), 0),
    (False, (15, 0), 0),
    (False, (40, 5), 1),
    (True, (3, 0), 20),
    (False, (-1, 3), 0),
    (False, (7, -1), 2),
]


@pytest.mark.parametrize("causal,window,sink_tokens,shape", grid(
    {f"{'causal' if c else 'nocausal'}-window{w[0]},{w[1]}-tokens{s}": (c, w, s) for c, w, s in PATTERNS}, {"x".join(map(str, s)): (s,) for s in SHAPES}))
def test_fp32_matches_oracle(shape, causal, window, sink_tokens, device):
    Nq, Nk, D, Hq, Hkv = shape
    q, k, v = make_qkv(1, Hq, Hkv, Nq, Nk, D, torch.float32, device=device)
    _check_fp32(q, k, v, causal=causal, window=window, sink_tokens=sink_tokens)


@pytest.mark.parametrize("D", [1, 3, 256])
def test_fp32_head_dim_extremes(D, device):
    """D is padded to a power of two of at least 16 with masked lanes, up to the largest supported, 256."""
    q, k, v = make_qkv(1, 2, 1, 20, 37, D, torch.float32, device=device)
    _check_fp32(q, k, v, causal=True, scale=0.7)


@pytest.mark.parametrize("sinks", [[0.3, -1.2, 2.0, 0.0], [20.0] * 4, [-20.0] * 4, [20.0, -20.0, 5.0, -5.0]],
                         ids=["mixed", "plus20", "minus20", "both"])
@pytest.mark.parametrize("causal,window,sink_tokens", [(True, (-1, -1), 0), (False, (4, 2), 3)])
def test_fp32_learned_sinks(sinks, causal, window, sink_tokens, device):
    q, k, v = make_qkv(2, 4, 2, 33, 47, 32, torch.float32, device=device)
    _check_fp32(q, k, v, sinks=torch.tensor(sinks, device=device), causal=causal, window=window, sink_tokens=sink_tokens)


@pytest.mark.parametrize("Nq,Nk,causal,window", [
    (70, 17, True, (-1, -1)),   # rows 0..52 sit before the first key
    (33, 17, False, (5, 2)),    # the right bound empties the first 14 rows
    (40, 40, False, (0, 0)),    # the diagonal alone
])
@pytest.mark.parametrize("with_sinks", [False, True])
def test_fp32_empty_rows(Nq, Nk, causal, window, with_sinks, device):
    q, k, v = make_qkv(1, 2, 1, Nq, Nk, 24, torch.float32, device=device)
    sinks = torch.tensor([2.5, -3.0], device=device) if with_sinks else None
    _check_fp32(q, k, v, sinks=sinks, causal=causal, window=window)


@pytest.mark.parametrize("layout", ["bnhd", "packed"])
@pytest.mark.parametrize("causal,window,sink_tokens", [(True, (-1, -1), 0), (False, (9, 0), 2)])
def test_fp32_strided_inputs(layout, causal, window, sink_tokens, device):
    q, k, v = make_qkv(2, 4, 2, 37, 29, 48, torch.float32, layout=layout, device=device)
    assert not q.is_contiguous() and not k.is_contiguous()
    out, _, _ = _run(q, k, v, None, causal, window, sink_tokens, 0.3)
    assert out.transpose(1, 2).is_contiguous()  # the output follows q's (B, N, H, D) storage
    _check_fp32(q, k, v, causal=causal, window=window, sink_tokens=sink_tokens, scale=0.3)


@pytest.mark.parametrize("block_m,block_n", [(32, 16), (16, 32), (32, 32)])
@pytest.mark.parametrize("causal,window,sink_tokens", [(True, (-1, -1), 0), (False, (20, 3), 5)])
def test_fp32_tiles(block_m, block_n, causal, window, sink_tokens, device):
    config = {"BLOCK_M": block_m, "BLOCK_N": block_n, "num_warps": 1, "num_stages": 1}
    q, k, v = make_qkv(1, 2, 1, 75, 90, 32, torch.float32, device=device)
    sinks = torch.tensor([0.7, -1.2], device=device)
    _check_fp32(q, k, v, sinks=sinks, causal=causal, window=window, sink_tokens=sink_tokens, config=config)


@pytest.mark.parametrize("shape,causal,window,sink_tokens,with_sinks", [
    ((17, 33, 16, 2, 2), False, (-1, -1), 0, False),
    ((33, 17, 40, 4, 1), True, (-1, -1), 0, True),
    ((113, 127, 64, 4, 2), True, (3, 0), 20, False),
    ((70, 70, 80, 2, 1), False, (15, 4), 1, True),
])
def test_fp16_within_bar(shape, causal, window, sink_tokens, with_sinks, device):
    Nq, Nk, D, Hq, Hkv = shape
    q, k, v = make_qkv(1, Hq, Hkv, Nq, Nk, D, torch.float16, device=device)
    sinks = torch.randn(Hq, device=device) * 3 if with_sinks else None
    _check_bar(q, k, v, sinks=sinks, causal=causal, window=window, sink_tokens=sink_tokens)


def test_public_entry_point(device):
    """gstar.flash_attention(backend="triton") reaches this kernel with normalised arguments."""
    q, k, v = make_qkv(2, 4, 2, 21, 30, 32, torch.float32, layout="bnhd", device=device)
    sinks = torch.randn(4, device=device)
    out, lse = gstar.flash_attention(q, k, v, window=(6, 1), sink_tokens=2, sinks=sinks, backend="triton",
                                     return_lse=True)
    ref_out, ref_lse = _oracle(q, k, v, sinks, False, (6, 1), 2, 32 ** -0.5, torch.float64)
    assert relative_error(out, ref_out) < 1e-4 and relative_error(lse, ref_lse) < 1e-4


def test_interpreter_config_is_small():
    cfg = forward_config(64, torch.float32, Pattern.make(100, 100), "cpu", group=4)
    assert set(cfg) == {"BLOCK_M", "BLOCK_N", "num_warps", "num_stages", "PACK_GQA", "FLAT", "HALVES"}
    assert cfg["BLOCK_M"] <= 32 and cfg["BLOCK_N"] <= 32


@pytest.mark.parametrize("D,nq,major,halves", [
    (128, 4096, 9, True), (96, 256, 9, True), (128, 255, 9, False), (128, 4096, 8, False), (64, 4096, 9, False),
])
def test_cuda_config_halves(D, nq, major, halves, monkeypatch):
    """HALVES (256-row tiles) only on Hopper and only where the queries fill such a tile."""
    monkeypatch.setattr(card, "capability_major", lambda device: major)
    cfg = forward_config(D, torch.bfloat16, Pattern.make(nq, 4096, causal=True), "cuda", group=8)
    assert cfg["HALVES"] == halves
    assert cfg["BLOCK_M"] <= nq or not halves
    windowed = forward_config(D, torch.bfloat16, Pattern.make(nq, 4096, causal=True, window=(127, 0)), "cuda")
    assert not windowed["HALVES"]  # narrow windows keep their short tiles


@pytest.mark.parametrize("D,group,tile", [
    (64, 8, (128, 32, 8)), (64, 4, (128, 32, 4)), (64, 2, (64, 64, 2)), (64, 1, (64, 64, 1)), (16, 8, (64, 64, 4)),
])
def test_cuda_config_narrow_window(D, group, tile, monkeypatch):
    """A narrow window at head dim 64 takes 128 x 32 tiles when at least 4 heads share them."""
    monkeypatch.setattr(card, "capability_major", lambda device: 9)
    cfg = forward_config(D, torch.bfloat16, Pattern.make(4096, 4096, causal=True, window=(127, 0)), "cuda",
                         group=group)
    assert (cfg["BLOCK_M"], cfg["BLOCK_N"], cfg["PACK_GQA"]) == tile and cfg["FLAT"]


@pytest.mark.parametrize("device_type", ["cpu", "cuda"])
@pytest.mark.parametrize("causal,window,tiles_fastest_rule", [
    (False, (-1, -1), True), (True, (-1, -1), False), (False, (127, 0), False), (False, (-1, 3), False),
    (False, (5, -1), False),
])
def test_grid_walks_tiles_fastest_without_mask_bounds(device_type, causal, window, tiles_fastest_rule,
                                                       monkeypatch):
    """Full attention walks one head's Q tiles side by side (they share its K/V in L2); any bound keeps heads
    fastest, with the longest causal tiles first. The host's grid follows the rule the kernel reads it by, on
    the interpreter as on the GPU."""
    monkeypatch.setattr(card, "capability_major", lambda device: 9)
    B, Hq, Hkv, N = 2, 16, 2, 4096
    pattern = Pattern.make(N, N, causal=causal, window=window)
    assert tiles_fastest(pattern.left >= 0, pattern.right >= 0) == tiles_fastest_rule
    for D in (16, 64, 128):
        shape, stride = (B, Hq, N, D), (Hq * N * D, N * D, D, 1)
        plan = portable_forward._plan(shape, stride, (B, Hkv, N, D), stride, (B, Hkv, N, D), stride, torch.bfloat16,
                                       torch.device(device_type), pattern, 0.1, 0.0, None, None, "tf32")
        options = dict(plan.options)
        n_tiles = triton.cdiv(N, options["BLOCK_M"] // options["PACK"])
        heads = Hq // options["PACK"]
        assert plan.grid == ((n_tiles, heads, B) if tiles_fastest_rule else (heads, n_tiles, B))


@pytest.mark.parametrize("nq", [1, 3, 33, 4096])
@pytest.mark.parametrize("group", [1, 2, 6, 8, 16])
@pytest.mark.parametrize("D,window", [(16, (-1, -1)), (64, (127, 0)), (128, (-1, -1)), (256, (-1, -1))])
def test_cuda_config_packs_whole_heads(nq, group, D, window, monkeypatch):
    """PACK_GQA divides the group and the tile; decode packs the whole group instead of computing dead rows."""
    monkeypatch.setattr(card, "capability_major", lambda device: 9)
    cfg = forward_config(D, torch.bfloat16, Pattern.make(nq, 4096, causal=True, window=window), "cuda", group=group)
    pack, block_m = cfg["PACK_GQA"], cfg["BLOCK_M"]
    assert group % pack == 0 and block_m % pack == 0 and block_m >= 16
    if nq == 1:
        assert pack == min(group & -group, 8)


# the kernel switches, each pair of them in all four combinations (a pairwise cover of the three)
SWITCHES = [dict(PACK_GQA=pack, FLAT=flat, HALVES=halves)
            for pack, flat, halves in ((1, False, False), (1, True, True), (4, False, True), (4, True, False))]


def _switch_id(c):
    return f"pack{c['PACK_GQA']}-flat{int(c['FLAT'])}-halves{int(c['HALVES'])}"


@pytest.mark.parametrize("switches,layout,causal,window,sink_tokens,with_sinks,scale", grid(
    {_switch_id(c): (c,) for c in SWITCHES}, {
        "zero_scale": ("bhnd", True, (-1, -1), 0, True, 0.0),  # uniform weights over the visible keys
        "negative_scale": ("packed", False, (9, 2), 3, False, -0.4),
        "no_bound": ("bnhd", False, (-1, -1), 0, True, None),  # Q tiles fastest in the grid
    }))
def test_fp32_switches(switches, layout, causal, window, sink_tokens, with_sinks, scale, device):
    """PACK_GQA 4 stacks 4 heads of 4 positions each into a 16-row tile, so tiles span heads and rows (and
    HALVES splits them, 2 heads per half)."""
    q, k, v = make_qkv(2, 8, 2, 37, 29, 40, torch.float32, layout=layout, device=device)
    sinks = torch.randn(8, device=device) if with_sinks else None
    config = dict(BLOCK_M=16, BLOCK_N=16, num_warps=4, num_stages=2, **switches)
    _check_fp32(q, k, v, sinks=sinks, causal=causal, window=window, sink_tokens=sink_tokens, scale=scale,
                config=config)


# ----------------------------------------------------------------------------------------------------
# GPU tier: bfloat16 / float16 against float32 naive attention on the GPU.

LENGTHS_GPU = [(1, 203), (17, 256), (113, 1024), (127, 127), (239, 256), (1023, 1024), (256, 17)]
HEAD_DIMS_GPU = [16, 32, 64, 80, 96, 128, 192, 256]
PATTERNS_GPU = [
    (False, (-1, -1), 0),
    (True, (-1, -1), 0),
    (True, (31, 0), 0),      # narrower than a tile
    (True, (63, 0), 4),      # a tile wide, sink tokens inside the reach of early rows
    (False, (200, 17), 300),  # wider than a tile, sink tokens beyond the window
    (False, (-1, 5), 0),
]


def _gpu_bar(dtype, Nq, Nk, D, Hq, Hkv, causal, window, sink_tokens, sinks_scale=None, B=2, magnitude=1.0,
             scale=None, layout="bhnd"):
    q, k, v = make_qkv(B, Hq, Hkv, Nq, Nk, D, dtype, device="cuda", layout=layout, magnitude=magnitude)
    sinks = None if sinks_scale is None else torch.randn(Hq, device="cuda").sign() * sinks_scale
    _check_bar(q, k, v, sinks=sinks, causal=causal, window=window, sink_tokens=sink_tokens, scale=scale,
               oracle_dtype=torch.float32)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("Nq,Nk", LENGTHS_GPU)
@pytest.mark.parametrize("causal,window,sink_tokens", PATTERNS_GPU)
def test_gpu_lengths_and_patterns(dtype, Nq, Nk, causal, window, sink_tokens):
    sinks_scale = 2.0 if dtype == torch.bfloat16 else None  # empty rows then end at sinks[h] or at -inf
    _gpu_bar(dtype, Nq, Nk, 64, 8, 2, causal, window, sink_tokens, sinks_scale=sinks_scale)


# every head dim compiles its own kernels: one pattern per dtype keeps the tier's compile time down
@pytest.mark.gpu
@pytest.mark.parametrize("D", HEAD_DIMS_GPU)
@pytest.mark.parametrize("dtype,causal,window,sink_tokens,with_sinks", [
    (torch.float16, True, (-1, -1), 0, False),
    (torch.bfloat16, False, (100, 3), 4, True),
])
def test_gpu_head_dims(D, dtype, causal, window, sink_tokens, with_sinks):
    _gpu_bar(dtype, 239, 1024, D, 4, 4, causal, window, sink_tokens, sinks_scale=1.0 if with_sinks else None)


@pytest.mark.gpu
@pytest.mark.parametrize("Hq,Hkv", [(8, 8), (8, 2), (8, 1), (16, 2)])
@pytest.mark.parametrize("D", [64, 128])
def test_gpu_gqa(Hq, Hkv, D):
    _gpu_bar(torch.bfloat16, 127, 203, D, Hq, Hkv, True, (-1, -1), 0, sinks_scale=1.0, layout="bnhd")


@pytest.mark.gpu
@pytest.mark.parametrize("sinks_scale", [20.0, 0.1])
@pytest.mark.parametrize("Nq,Nk,causal,window", [(1023, 1024, True, (127, 0)), (256, 17, True, (-1, -1)),
                                                  (300, 300, False, (0, 0))])
def test_gpu_sinks_and_empty_rows(sinks_scale, Nq, Nk, causal, window):
    _gpu_bar(torch.bfloat16, Nq, Nk, 64, 4, 1, causal, window, 0, sinks_scale=sinks_scale)


@pytest.mark.gpu
@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("scale_div", [30.0, 1.0])
def test_gpu_large_inputs_bf16(D, scale_div):
    """Inputs of magnitude 30: scores with std ~30 (scale / 30) and saturated ones (default scale)."""
    _gpu_bar(torch.bfloat16, 1023, 1024, D, 4, 2, True, (-1, -1), 0, sinks_scale=5.0, magnitude=30.0,
             scale=D ** -0.5 / scale_div)


@pytest.mark.gpu
@pytest.mark.parametrize("window", [(127, 0), (-1, 0)])
def test_gpu_gpt_oss_shape(window):
    _gpu_bar(torch.bfloat16, 4096, 4096, 64, 64, 8, True, window, 0, sinks_scale=1.0, B=2)


@pytest.mark.gpu
def test_gpu_stage7_shape():
    _gpu_bar(torch.bfloat16, 4096, 4096, 16, 16, 1, True, (255, 0), 4, B=1)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("D,Nq,Nk,Hq,Hkv,causal,window,sink_tokens,with_sinks", [
    (128, 300, 1000, 8, 2, True, (-1, -1), 0, True),    # a partial last tile, GQA packed into the halves
    (128, 1000, 300, 4, 4, False, (-1, -1), 0, False),  # more queries than keys: empty rows, no sinks
    (96, 777, 777, 16, 2, False, (300, 40), 5, True),   # padded head dim, a wide window and sink tokens
    (128, 513, 2048, 4, 1, False, (-1, 3), 0, False),   # right bound only, MQA
])
def test_gpu_halves(dtype, D, Nq, Nk, Hq, Hkv, causal, window, sink_tokens, with_sinks):
    """The HALVES tiles (256 rows) that D = 128 takes on Hopper, at shapes whose halves end mid-tile."""
    assert forward_config(D, dtype, Pattern.make(Nq, Nk, causal=causal, window=window), "cuda",
                          group=Hq // Hkv)["HALVES"] == (torch.cuda.get_device_capability()[0] >= 9)
    _gpu_bar(dtype, Nq, Nk, D, Hq, Hkv, causal, window, sink_tokens, sinks_scale=1.0 if with_sinks else None)


@pytest.mark.gpu
@pytest.mark.parametrize("tf32", [False, True])
def test_gpu_fp32(tf32, monkeypatch):
    monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", tf32)
    q, k, v = make_qkv(2, 8, 2, 239, 256, 96, torch.float32, device="cuda")
    if not tf32:
        _check_fp32(q, k, v, causal=True)
        return
    # TF32 rounds dot inputs to 10 mantissa bits, like float16: hold it to float16's bar
    out, _, _ = _run(q, k, v, None, True, (-1, -1), 0, 96 ** -0.5)
    ref_out, _ = _oracle(q, k, v, None, True, (-1, -1), 0, 96 ** -0.5, torch.float64)
    pt_out, _ = _oracle(q, k, v, None, True, (-1, -1), 0, 96 ** -0.5, torch.float16)
    v_ = verdict("out", out, ref_out, pt_out)
    assert v_.ok, str(v_)


@pytest.mark.gpu
@pytest.mark.parametrize("switches", SWITCHES, ids=_switch_id)
@pytest.mark.parametrize("D,layout,causal,window,sink_tokens,scale", [
    (64, "bhnd", True, (-1, -1), 0, None),
    (80, "packed", True, (127, 0), 4, -0.1),   # padded head dim, a negative scale
    (128, "bnhd", False, (-1, -1), 0, None),   # no mask bound: Q tiles fastest in the grid
])
def test_gpu_switches(switches, D, layout, causal, window, sink_tokens, scale):
    """The switch combinations on the GPU's own tiles."""
    q, k, v = make_qkv(2, 8, 2, 1023, 1024, D, torch.bfloat16, "cuda", layout=layout)
    sinks = torch.randn(8, device="cuda")
    config = dict(forward_config(D, q.dtype, Pattern.make(1023, 1024, causal=causal, window=window), "cuda",
                                 group=4), **switches)
    _check_bar(q, k, v, sinks=sinks, causal=causal, window=window, sink_tokens=sink_tokens, scale=scale,
               config=config, oracle_dtype=torch.float32)


@pytest.mark.gpu
@pytest.mark.slow
def test_gpu_beyond_int32_offsets():
    """MQA k/v of more than 2^31 elements each; the window reaches keys past element 2^31 of the buffer."""
    D, Nq, window, sink_tokens = 128, 256, (255, 0), 4
    Nk = 2 ** 31 // D + 1024
    if torch.cuda.get_device_properties(0).total_memory < 16 * 2 ** 30:
        pytest.skip("needs ~9 GiB of GPU memory")
    k = torch.randn(1, 1, Nk, D, device="cuda", dtype=torch.bfloat16)
    v = torch.randn_like(k)
    tail = Nk - Nq - window[0]  # the first key that row 0's window reaches
    q = torch.randn(1, 2, Nq, D, device="cuda", dtype=torch.bfloat16)
    out, lse, _ = _run(q, k, v, None, True, window, sink_tokens, D ** -0.5)
    # the same problem on the visible keys alone: the sink tokens, then the window band
    k_sub = torch.cat([k[:, :, :sink_tokens], k[:, :, tail:]], dim=2)
    v_sub = torch.cat([v[:, :, :sink_tokens], v[:, :, tail:]], dim=2)
    ref_out, ref_lse = _oracle(q, k_sub, v_sub, None, True, window, sink_tokens, D ** -0.5, torch.float32)
    pt_out, pt_lse = _oracle(q, k_sub, v_sub, None, True, window, sink_tokens, D ** -0.5, torch.bfloat16)
    for v_ in (verdict("out", out, ref_out, pt_out), verdict("lse", lse, ref_lse, pt_lse)):
        assert v_.ok, str(v_)
