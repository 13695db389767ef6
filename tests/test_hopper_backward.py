"""The fused Hopper backward (gstar.kernels.hopper_backward): one pass for dK, dV and dQ, dQ added up by the
copy engine. It takes full and causal attention, by default with each dQ tile's adds in a fixed order,
``deterministic=False`` in any order. Within the 3x gradient bar on
every pattern it accepts at odd lengths, GQA, strided inputs and an LSE gradient, bitwise reproducible where
ordered (GPU tier, Hopper only). Off the GPU the flag changes nothing. tests/test_kernel_sass.py compiles the
kernel for sm_90a on the CPU."""

import pytest
import torch

import gstar
from inputs import make_qkv
from gstar.kernels import attention_backward, card, dispatch
from gstar.kernels.sm90 import backward as hopper_backward
from gstar.pattern import Pattern, kv_blocks, q_blocks
from test_backward import _check_bar, _check_exact_zeros, _oracle, _oracle_by_kv_head, _sinks

HOPPER = torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9
hopper_only = pytest.mark.skipif(not HOPPER, reason="needs an sm_90 GPU (H100 / H200)")


def _serves(dtype, D, Dv, pattern, group):
    return dispatch.serves_sm90(dispatch.Call("backward", dtype, dtype, D, Dv, pattern, group))


@pytest.mark.parametrize("dtype,D,Dv,causal,window,group,expected", [
    (torch.bfloat16, 128, 128, True, (-1, -1), 1, True),
    (torch.float16, 128, 128, False, (-1, -1), 1, True),
    (torch.bfloat16, 128, 128, False, (-1, 0), 4, True),    # causal spelled as a window
    (torch.bfloat16, 128, 128, True, (127, 0), 1, False),   # a window layer
    (torch.bfloat16, 64, 64, True, (-1, -1), 8, True),      # GPT-OSS's full layers: causal GQA 8
    (torch.bfloat16, 64, 64, True, (-1, -1), 16, True),
    (torch.bfloat16, 64, 64, True, (-1, -1), 4, False),     # D 64 below its least group
    (torch.bfloat16, 64, 64, False, (-1, -1), 8, False),    # D 64 full attention
    (torch.bfloat16, 128, 128, False, (-1, 3), 1, False),   # a right bound past the diagonal
    (torch.bfloat16, 128, 64, True, (-1, -1), 1, False),    # Dv != D
    (torch.bfloat16, 96, 96, True, (-1, -1), 1, False),     # a head dim it was not built for
    (torch.float32, 128, 128, True, (-1, -1), 1, False),
])
def test_serves(dtype, D, Dv, causal, window, group, expected):
    """What the kernel was built for (the same with ordered dQ adds or without, with learned sinks or
    without)."""
    pattern = Pattern.make(300, 300, causal=causal, window=window)
    assert _serves(dtype, D, Dv, pattern, group) == expected


@pytest.mark.parametrize("nq,nk", [(300, 300), (1000, 999), (4097, 4097), (777, 300), (129, 128), (64, 1)])
@pytest.mark.parametrize("causal", [True, False])
def test_ordered_counts(nq, nk, causal):
    """What the ordered adds rely on, in the rule's own terms (gstar.pattern): the KV tiles whose programs add
    into Q tile m are exactly tiles 0 .. last(m), the last that m sees (the kernel's ``_last_tile``, from
    kv_range, which tests/test_ranges.py checks against kv_blocks), so the count for tile j reaches
    last(m) - j; and where the writer counts late (causal), in the order it waits for (descending tiles)
    each program reaches the tile at least two of its steps after the one before it."""
    pattern = Pattern.make(nq, nk, causal=causal)
    rows, keys = hopper_backward.ROWS.value, hopper_backward.BLOCK_N.value
    n_tiles = -(-nk // keys)
    first = [q_blocks(pattern, j * keys, rows, keys)[0] for j in range(n_tiles)]
    for m in range(-(-nq // rows)):
        adders = [j for j in range(n_tiles) if q_blocks(pattern, j * keys, rows, keys)[0] <= m
                  < q_blocks(pattern, j * keys, rows, keys)[3]]
        last = kv_blocks(pattern, m * rows, rows, keys)[4] - 1
        assert adders == list(range(last + 1))
        if hopper_backward.count_late(pattern):
            for j in adders[:-1]:  # steps from each program's first Q tile to m
                assert m - first[j] >= m - first[j + 1] + 2


@pytest.mark.parametrize("nq,nk,causal,expected", [(300, 300, True, True), (301, 300, True, True),
                                                   (4000, 129, True, True), (300, 301, True, False),
                                                   (1, 4000, True, False), (300, 300, False, False)])
def test_count_late(nq, nk, causal, expected):
    """Counting one add late waits for nothing only when each KV tile's first Q tile lies past the one
    before: causal with no more keys than queries (test_ordered_counts checks the two steps)."""
    assert hopper_backward.count_late(Pattern.make(nq, nk, causal=causal)) == expected


def test_every_served_head_dim_has_a_program_cost():
    """The ordered split weighs a program's fixed cost by head dim: every head dim the kernel serves needs one
    (else a KeyError at call time)."""
    assert {(d, d) for d in hopper_backward.PROGRAM_STEPS} == dispatch.SM90_BACKWARD.keys()


@pytest.mark.parametrize("batch,heads,group,nq,head_dim,expected", [
    (2, 64, 8, 4096, 64, 1),      # GPT-OSS at 4k: c / 2h + h SMs / (B Hq) = 3.03 against 3.06 for two heads
    (1, 64, 8, 32768, 64, 1),     # and at 32k, where the whole group's tail cost 12%
    (8, 64, 8, 2048, 64, 2),
    (2, 64, 8, 4096, 128, 2),     # head dim 128's programs cost more: fewer of them
    (4, 64, 8, 4096, 128, 4),     # the model's one miss: two heads measured 4.5% faster
    (1, 32, 4, 32768, 128, 1),
    (1, 16, 1, 100, 128, 1),      # no group to split
])
def test_heads_per_program_ordered(batch, heads, group, nq, head_dim, expected, monkeypatch):
    """Ordered adds (the grid launched shortest program first): the divisor of the group that minimises a
    program's fixed cost against the grid's tail, whatever the length (132 SMs)."""
    monkeypatch.setattr(card, "sm_count", lambda device: 132)
    for n in (nq, 4 * nq + 1):
        assert hopper_backward.heads_per_program(batch, heads, group, n, head_dim, causal=True, ordered=True,
                                                 device="cuda") == expected


@pytest.mark.parametrize("batch,heads,group,nq,causal,expected", [
    (2, 64, 8, 4096, True, 2),     # GQA 8 at 4k: the whole group would leave a tail of half the grid
    (1, 64, 8, 4096, True, 1),
    (4, 64, 8, 4096, True, 4),     # the largest divisor under the bound
    (8, 64, 8, 32768, True, 8),    # long enough for the whole group
    (2, 48, 6, 8192, True, 3),
    (1, 16, 1, 100, True, 1),      # no group to split
    (1, 64, 8, 4096, False, 8),    # full attention: programs alike
])
def test_heads_per_program_unordered(batch, heads, group, nq, causal, expected, monkeypatch):
    """Unordered adds (the longest program first): the largest divisor of the group whose longest program
    stays under a quarter of an SM's share (132 SMs); the whole group for full attention, ordered or not."""
    monkeypatch.setattr(card, "sm_count", lambda device: 132)
    assert hopper_backward.heads_per_program(batch, heads, group, nq, 128, causal=causal, ordered=False,
                                             device="cuda") == expected
    if not causal:
        assert hopper_backward.heads_per_program(batch, heads, group, nq, 64, causal=causal, ordered=True,
                                                 device="cuda") == group


@pytest.mark.parametrize("B,Hkv,Nk,parts,dtype", [(2, 3, 300, 4, torch.float16), (1, 2, 128, 2, torch.float32),
                                                    (1, 1, 129, 1, torch.float16)])
def test_sum_parts(B, Hkv, Nk, parts, dtype):
    """The split group's dK, dV: what the kernel's programs store through :func:`_partials`' strides (part p,
    batch, head, row) is what :func:`_sum_parts` adds up, part by part in order, rows past Nk left out; one
    part stores into dk, dv themselves. Run with the Triton interpreter on the CPU."""
    D, n_tiles = 128, -(-Nk // 128)
    dk, dv = (torch.full((B, Hkv, Nk, D), float("nan"), dtype=dtype) for _ in "kv")
    pk, pv, stride_pk, stride_pv = hopper_backward._partials(dk, dv, parts, n_tiles)
    if parts == 1:
        assert pk is dk and pv is dv and stride_pk == (0, *dk.stride()[:3])
        return
    sums = []
    for p, stride in ((pk, stride_pk), (pv, stride_pv)):
        p.fill_(float("nan"))  # rows past Nk stay unwritten, as the kernel leaves them
        values = torch.randn(parts, B, Hkv, Nk, D)
        torch.as_strided(p, values.shape, (*stride, 1)).copy_(values)  # the kernel's stores
        total = values[0].clone()
        for part in values[1:]:
            total += part
        sums.append(total.to(dtype))
    hopper_backward._sum_parts(pk, pv, dk, dv, parts=parts)
    assert torch.equal(dk, sums[0]) and torch.equal(dv, sums[1])


def test_flag_changes_nothing_off_hopper():
    """On the CPU both settings run the deterministic kernels: bitwise equal gradients; a non-bool raises."""
    q, k, v = (t.requires_grad_() for t in make_qkv(1, 4, 2, 37, 29, 16, torch.float32))
    grads = []
    for deterministic in (True, False):
        out = gstar.flash_attention(q, k, v, causal=True, deterministic=deterministic)
        grads.append(torch.autograd.grad(out, (q, k, v), torch.ones_like(out)))
    for a, b in zip(*grads):
        assert torch.equal(a, b)
    with pytest.raises(TypeError, match="deterministic must be a bool"):
        gstar.flash_attention(q, k, v, deterministic=0)


@pytest.mark.gpu
@hopper_only
@pytest.mark.parametrize("D,group", [(128, 1), (128, 8), (64, 8)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("Nq,Nk", [(128, 128), (1000, 1000), (777, 300), (300, 777), (65, 4097)])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("sinks,deterministic", [(None, False), (None, True), ("mixed", True)])
def test_gpu_within_bar(D, dtype, Nq, Nk, causal, group, sinks, deterministic, monkeypatch):
    """Full and causal attention at odd lengths (Nq > Nk leaves causal rows without keys, Nq < Nk keys no
    row sees), MHA and GQA 8 (a program walks several query heads: both warpgroups' turns at dQ cross head
    boundaries), learned sinks or none, (B, N, H, D) strides, an LSE gradient: the 3x bar (dsinks included),
    exact zeros, and the fused kernel is the one that ran where it serves the call (else the two-kernel
    backward: D 64 full attention here; test_serves holds the rest of the rule)."""
    calls = []
    monkeypatch.setattr(hopper_backward, "backward", lambda *a: calls.append(1) or fused(*a))
    q, k, v = make_qkv(2, 8, 8 // group, Nq, Nk, D, dtype, device="cuda", layout="bnhd")
    dout = torch.randn(2, 8, Nq, D, device="cuda").to(dtype)
    dlse = torch.randn(2, 8, Nq, device="cuda")
    sinks = _sinks(sinks, 8, device="cuda")
    pattern_args, scale = dict(causal=causal), D ** -0.5
    ref_out, ref_lse, ref = _oracle(q, k, v, sinks, dout, dlse, pattern_args, scale, torch.float64)
    _, _, pt = _oracle(q, k, v, sinks, dout, dlse, pattern_args, scale, dtype)
    out = torch.empty_like(q).copy_(ref_out)
    pattern = Pattern.make(Nq, Nk, causal=causal)
    grads = attention_backward(dout, q, k, v, out, ref_lse.float(), dlse, sinks, pattern, scale,
                               deterministic=deterministic)
    assert calls == [1] * (_serves(dtype, D, D, pattern, group) and dispatch.VERIFIED)
    _check_bar(grads, ref, pt)
    _check_exact_zeros(grads, pattern)
    if deterministic:
        again = attention_backward(dout, q, k, v, out, ref_lse.float(), dlse, sinks, pattern, scale)
        for a, b in zip(grads, again):
            assert (a is None and b is None) or torch.equal(a, b)


@pytest.mark.gpu
@hopper_only
@pytest.mark.parametrize("N,H,group,heads,causal", [(4999, 16, 8, 8, True), (4999, 16, 8, 2, True),
                                                    (17001, 2, 2, 1, True), (4999, 16, 8, 8, False),
                                                    (17001, 2, 2, 1, False)])
def test_gpu_ordered_adds(N, H, group, heads, causal, monkeypatch):
    """The ordered dQ: many KV tiles add into each dQ tile (4999: 40 tiles; 17001: 133 tiles, more than an
    H100 / H200 has SMs, so a tile's programs cannot all be resident at once and must not wait on one not
    yet launched), GQA 8 walked by one program or by four (each with two heads, dK and dV summed from four
    parts) and GQA 2 by two, causal (adds counted late) and full (counted at once): within the bar, and
    bitwise equal over five runs."""
    calls = []
    monkeypatch.setattr(hopper_backward, "backward", lambda *a: calls.append(1) or fused(*a))
    monkeypatch.setattr(hopper_backward, "heads_per_program", lambda *a, **kw: heads)
    D, dtype, scale = 128, torch.bfloat16, 128 ** -0.5
    q, k, v = make_qkv(1, H, H // group, N, N, D, dtype, device="cuda")
    dout = torch.randn_like(q)
    pattern = Pattern.make(N, N, causal=causal)
    ref_out, ref_lse, _ = _oracle(q, k, v, None, dout, None, dict(causal=causal), scale, torch.float32)
    out = ref_out.to(dtype)
    runs = [attention_backward(dout, q, k, v, out, ref_lse.float(), None, None, pattern, scale)
            for _ in range(5)]
    assert calls == [1] * 5
    for grads in runs[1:]:
        for a, b in zip(grads[:3], runs[0][:3]):
            assert torch.equal(a, b)
    ref = _oracle_by_kv_head(q, k, v, None, dout, None, dict(causal=causal), scale, torch.float64)
    pt = _oracle_by_kv_head(q, k, v, None, dout, None, dict(causal=causal), scale, dtype)
    _check_bar(runs[0], ref, pt)


@pytest.mark.gpu
@hopper_only
def test_gpu_through_the_api(monkeypatch):
    """``flash_attention`` reaches the fused kernel through autograd both ways on a causal call, and the
    unordered adds agree with the ordered ones up to rounding."""
    calls = []
    monkeypatch.setattr(hopper_backward, "backward", lambda *a: calls.append(1) or fused(*a))
    q, k, v = (t.requires_grad_() for t in make_qkv(1, 8, 8, 1000, 1000, 128, torch.bfloat16, device="cuda"))
    dout = torch.randn_like(q)
    grads = []
    for deterministic in (True, False):
        out = gstar.flash_attention(q, k, v, causal=True, deterministic=deterministic)
        grads.append(torch.autograd.grad(out, (q, k, v), dout))
    assert calls == [1, 1]
    for a, b in zip(*grads):
        assert (a.float() - b.float()).abs().max() <= 0.02 * a.float().abs().max()


fused = hopper_backward.backward
