"""flash_attention_with_kvcache against float64 naive attention on each sequence's keys.

Contiguous and paged caches (random block tables, block sizes 16, 32 and 48), ragged ``cache_seqlens``,
``Nq`` in {1, 3, 16}, every pattern, with and without appending, GQA groups of 2 and 3, forced splits 1..16;
the PyTorch path in float64 (exact) and the Triton kernel under the interpreter in float32 (the float32 bar).
Pages that no query sees are -1 in the block table: a read of one would fail. Also the in-place append, the
errors for bad input, and on GPUs a decode loop without recompiles and a CUDA graph replayed with new lengths.
"""

import pytest
import torch
from tiers import grid

import gstar
from gstar.lab.accuracy import relative_error
from gstar.kernels import card
from gstar.kernels.portable import decode
from gstar.pattern import SINK_LIMIT, Pattern, read_blocks

EXACT = 1e-12   # float64 on both sides: orders of summation differ, nothing else
FLOAT32 = 1e-4  # the float32 bar

PATTERNS = {  # id: (keywords, learned sinks)
    "causal": (dict(causal=True), False),
    "full": (dict(causal=False), False),
    "window": (dict(causal=True, window=(5, 0)), False),
    "sink-tokens": (dict(causal=True, window=(4, 0), sink_tokens=2), False),
    "learned-sinks": (dict(causal=True), True),
    "window-sinks": (dict(causal=True, window=(6, 0), sink_tokens=3), True),
    "chunk-softcap": (dict(causal=True, chunk=20, softcap=1.5), False),  # chunks end inside every sequence
    "chunk-sinks": (dict(causal=True, chunk=16, window=(9, 0), sink_tokens=2), True),
}
LAYOUTS = {"contiguous": (None,), "paged16": (16,), "paged32": (32,), "paged48": (48,)}
QUERIES = {"nq1": (1,), "nq3": (3,), "nq16": (16,)}


def make_case(*, block_size, nq, pattern, learned_sinks, append, heads=(4, 2), lengths=(37, 0, 61), dim=8,
              value_dim=8, dtype=torch.float64, device="cpu", seed=0):
    """Random inputs: a cache holding ``lengths`` keys per sequence (before appending ``nq`` more when
    ``append``), contiguous (``block_size`` None) or paged with shuffled pages and -1 for pages no query
    sees; returns the call's arguments and each sequence's full keys and values for the oracle."""
    g = torch.Generator().manual_seed(seed)
    Hq, Hkv = heads
    B = len(lengths)
    added = nq if append else 0
    lengths = [max(n, 0 if append else nq) for n in lengths]
    total = [n + added for n in lengths]

    def rand(*shape):
        return torch.randn(*shape, generator=g, dtype=torch.float64).to(dtype).to(device)

    keys = [rand(1, Hkv, n, dim) for n in total]
    values = [rand(1, Hkv, n, value_dim) for n in total]
    q = rand(B, Hq, nq, dim)
    capacity = max(total) + 5
    args = dict(cache_seqlens=torch.tensor(lengths, dtype=torch.int32, device=device))
    if append:
        args["k"] = torch.cat([kk[:, :, -nq:] for kk in keys])
        args["v"] = torch.cat([vv[:, :, -nq:] for vv in values])
    if block_size is None:
        k_cache, v_cache = rand(B, Hkv, capacity, dim), rand(B, Hkv, capacity, value_dim)
        for b, n in enumerate(lengths):
            k_cache[b, :, :n] = keys[b][0, :, :n]
            v_cache[b, :, :n] = values[b][0, :, :n]
    else:
        blocks = -(-capacity // block_size)
        pool = B * blocks + 3
        k_cache, v_cache = rand(pool, block_size, Hkv, dim), rand(pool, block_size, Hkv, value_dim)
        pages = torch.randperm(pool, generator=g)[:B * blocks].view(B, blocks).int()
        table = torch.full_like(pages, -1)
        for b in range(B):
            rule = {k: x for k, x in pattern.items() if k != "softcap"}
            seen = read_blocks(Pattern.make(nq, total[b], **rule), block_size)
            table[b, seen] = pages[b, seen]
            for j in range(blocks):  # every block the sequence fills, visible or not, is written
                lo, hi = j * block_size, min((j + 1) * block_size, lengths[b])
                if lo < hi:
                    k_cache[pages[b, j], :hi - lo] = keys[b][0, :, lo:hi].transpose(0, 1)
                    v_cache[pages[b, j], :hi - lo] = values[b][0, :, lo:hi].transpose(0, 1)
        # appended keys go to the blocks they land in: those are visible (the queries see themselves)
        args["block_table"] = table.to(device)
    sinks = rand(Hq) * 2 if learned_sinks else None
    return q, k_cache, v_cache, dict(args, sinks=sinks, **pattern), keys, values


def oracle(q, keys, values, pattern, sinks):
    """Float64 naive attention of each sequence's queries against its keys, and the LSE."""
    outs, lses = [], []
    for b, (kk, vv) in enumerate(zip(keys, values)):
        out, lse = gstar.naive_attention(q[b:b + 1].double(), kk.double(), vv.double(),
                                         sinks=None if sinks is None else sinks.double(), **pattern)
        outs.append(out)
        lses.append(lse)
    return torch.cat(outs), torch.cat(lses)


def _pattern_of(kwargs):
    return {k: kwargs[k] for k in ("causal", "window", "sink_tokens", "chunk", "softcap") if k in kwargs}


@pytest.mark.parametrize("layout, nq, pattern, learned_sinks, append", grid(
    LAYOUTS, QUERIES, PATTERNS, {"read": (False,), "append": (True,)}))
def test_torch_path(layout, nq, pattern, learned_sinks, append):
    q, k_cache, v_cache, kwargs, keys, values = make_case(block_size=layout, nq=nq, pattern=pattern,
                                                          learned_sinks=learned_sinks, append=append)
    out, lse = gstar.flash_attention_with_kvcache(q, k_cache, v_cache, return_lse=True, backend="torch", **kwargs)
    ref_out, ref_lse = oracle(q, keys, values, _pattern_of(kwargs), kwargs["sinks"])
    assert relative_error(out, ref_out) <= EXACT
    assert relative_error(lse, ref_lse) <= EXACT


# the interpreter is slow: each split count comes with one query count (uneven shares, one program per block)
SPLITS = {"nq1-split1": (1, 1), "nq3-split5": (3, 5), "nq16-split16": (16, 16)}


@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU tier: the interpreter (GPUs run test_gpu_*)")
@pytest.mark.parametrize("layout, pattern, learned_sinks, nq, splits", grid(LAYOUTS, PATTERNS, SPLITS))
def test_triton_kernel(layout, pattern, learned_sinks, nq, splits):
    """float32 under the interpreter, appending (the queries' own keys land in the cache first)."""
    q, k_cache, v_cache, kwargs, keys, values = make_case(block_size=layout, nq=nq, pattern=pattern,
                                                          learned_sinks=learned_sinks, append=True,
                                                          dtype=torch.float32, heads=(6, 2))
    out, lse = gstar.flash_attention_with_kvcache(q, k_cache, v_cache, return_lse=True, backend="triton",
                                                  num_splits=splits, **kwargs)
    ref_out, ref_lse = oracle(q, keys, values, _pattern_of(kwargs), kwargs["sinks"])
    assert relative_error(out, ref_out) < FLOAT32
    assert relative_error(lse, ref_lse) < FLOAT32


# one split of a contiguous cache (tiles of 64 keys here): masked blocks (the sink-token block, the band's first
# block, the last block) and whole blocks between, or whole blocks only (128 keys), or one masked block only (37)
LONG_SPLITS = {"causal": ((64 * 3 + 5, 128, 37), dict(causal=True)),
               "sinks-window": ((64 * 5 + 7, 128, 37), dict(causal=True, window=(150, 0), sink_tokens=3))}


@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU tier: the interpreter (GPUs run test_gpu_*)")
@pytest.mark.parametrize("lengths, pattern", LONG_SPLITS.values(), ids=list(LONG_SPLITS))
def test_triton_kernel_whole_and_masked_loops(lengths, pattern):
    """One split per sequence walking the masked, the whole and the masked loop, or only some of them."""
    q, k_cache, v_cache, kwargs, keys, values = make_case(block_size=None, nq=1, pattern=pattern, learned_sinks=True,
                                                          append=False, dtype=torch.float32, lengths=lengths)
    out, lse = gstar.flash_attention_with_kvcache(q, k_cache, v_cache, return_lse=True, backend="triton",
                                                  num_splits=1, **kwargs)
    ref_out, ref_lse = oracle(q, keys, values, _pattern_of(kwargs), kwargs["sinks"])
    assert relative_error(out, ref_out) < FLOAT32
    assert relative_error(lse, ref_lse) < FLOAT32


GPU_SPLITS = {"nq1-auto": (1, None), "nq1-split3": (1, 3), "nq3-split7": (3, 7), "nq16-split16": (16, 16)}


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("layout, pattern, learned_sinks, nq, splits, dtype", grid(
    LAYOUTS, PATTERNS, GPU_SPLITS, {"bf16": (torch.bfloat16,), "fp16": (torch.float16,)}))
def test_gpu_triton_kernel(layout, pattern, learned_sinks, nq, splits, dtype):
    """The compiled kernel on the grid, appending, longer ragged caches: output within 2x PyTorch's error in
    the same dtype, the LSE within the float32 bar."""
    from gstar.lab.accuracy import verdict

    q, k_cache, v_cache, kwargs, keys, values = make_case(
        block_size=layout, nq=nq, pattern=pattern, learned_sinks=learned_sinks, append=True, dtype=dtype,
        heads=(6, 2), lengths=(437, 0, 1061), dim=64, value_dim=64, device="cuda")
    out, lse = gstar.flash_attention_with_kvcache(q, k_cache, v_cache, return_lse=True, num_splits=splits,
                                                  **kwargs)
    ref_out, ref_lse = oracle(q, keys, values, _pattern_of(kwargs), kwargs["sinks"])
    pt = torch.cat([gstar.naive_attention(q[b:b + 1], kk, vv, sinks=kwargs["sinks"], **_pattern_of(kwargs))[0]
                    for b, (kk, vv) in enumerate(zip(keys, values))])  # PyTorch in the same dtype
    check = verdict("out", out, ref_out, pt)
    assert check.ok, check
    assert relative_error(lse, ref_lse) < FLOAT32


@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU tier: the interpreter on CPU tensors")
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=["fp16", "fp32"])
def test_triton_value_dim_and_row_tiles(dtype):
    """A value head dim other than q's, and more stacked rows (group x queries) than one tile holds."""
    q, k_cache, v_cache, kwargs, keys, values = make_case(
        block_size=16, nq=40, pattern=dict(causal=True), learned_sinks=True, append=True, heads=(8, 2),
        lengths=(23, 70), dim=16, value_dim=24, dtype=dtype)
    out = gstar.flash_attention_with_kvcache(q, k_cache, v_cache, backend="triton", num_splits=3, **kwargs)
    ref, _ = oracle(q, keys, values, _pattern_of(kwargs), kwargs["sinks"])
    bar = FLOAT32 if dtype == torch.float32 else 2e-3
    assert relative_error(out, ref) < bar


def test_append_writes_only_its_positions():
    q, k_cache, v_cache, kwargs, keys, _ = make_case(block_size=16, nq=3, pattern=dict(causal=True),
                                                     learned_sinks=False, append=True)
    before_k, before_v = k_cache.clone(), v_cache.clone()
    gstar.flash_attention_with_kvcache(q, k_cache, v_cache, backend="torch", **kwargs)
    table, lengths = kwargs["block_table"], kwargs["cache_seqlens"].tolist()
    changed = (k_cache != before_k).any(dim=(2, 3)) | (v_cache != before_v).any(dim=(2, 3))   # (pages, rows)
    expected = torch.zeros_like(changed)
    for b, n in enumerate(lengths):
        for i in range(3):
            page, row = table[b, (n + i) // 16], (n + i) % 16
            expected[page, row] = True
            assert torch.equal(k_cache[page, row], keys[b][0, :, n + i])
    assert torch.equal(changed, expected)


def _case(**overrides):
    q, k_cache, v_cache, kwargs, _, _ = make_case(block_size=16, nq=1, pattern=dict(causal=True),
                                                  learned_sinks=False, append=False)
    kwargs.update(overrides)
    return q, k_cache, v_cache, kwargs


@pytest.mark.parametrize("layout", [None, 16], ids=["contiguous", "paged16"])
def test_compiled_step_matches_eager(layout):
    """torch.compile(fullgraph=True) traces a decode step (the append in place, the attention as the
    ``gstar::decode`` operator, opcheck'd): the same output, LSE and cache as the eager call."""
    from gstar.kvcache import Cache, decode_op

    q, k_cache, v_cache, kwargs, _, _ = make_case(block_size=layout, nq=3, pattern=dict(causal=True, window=(6, 0),
                                                  sink_tokens=3), learned_sinks=True, append=True,
                                                  dtype=torch.float32)
    caches = [(k_cache.clone(), v_cache.clone()) for _ in range(2)]

    def step(q, kc, vc):
        return gstar.flash_attention_with_kvcache(q, kc, vc, return_lse=True, num_splits=2, **kwargs)

    torch._dynamo.reset()
    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")(q, *caches[0])
    eager = step(q, *caches[1])
    for got, want in zip((*compiled, *caches[0]), (*eager, *caches[1])):
        assert torch.equal(got, want)
    capacity = Cache(*caches[1], kwargs.get("block_table")).capacity
    pattern = Pattern.make(3, capacity, causal=True, window=(6, 0), sink_tokens=3)
    torch.library.opcheck(decode_op, (q, *caches[1], kwargs.get("block_table"), kwargs["cache_seqlens"], None,
                                      kwargs["sinks"], 3, list(pattern.fields()), 0.35, 0.0, 2, "torch", None, None))


def test_bad_input():
    q, k_cache, v_cache, kwargs = _case()
    table = kwargs["block_table"].clone()
    table[0, 0] = 10_000
    with pytest.raises(ValueError, match=r"block_table\[0, 0\] = 10000 is outside"):
        gstar.flash_attention_with_kvcache(q, k_cache, v_cache, **dict(kwargs, block_table=table))
    capacity = table.shape[1] * 16
    with pytest.raises(ValueError, match="outside the cache's capacity"):
        gstar.flash_attention_with_kvcache(q, k_cache, v_cache, **dict(
            kwargs, cache_seqlens=torch.tensor([capacity + 1, 1, 1], dtype=torch.int32)))
    with pytest.raises(ValueError, match="multiple of 16"):
        gstar.flash_attention_with_kvcache(q, k_cache[:, :8], v_cache[:, :8], **kwargs)
    with pytest.raises(TypeError, match="share a dtype"):
        gstar.flash_attention_with_kvcache(q, k_cache.float(), v_cache.float(), **kwargs)
    with pytest.raises(TypeError, match="cache_seqlens must have dtype torch.int32"):
        gstar.flash_attention_with_kvcache(q, k_cache, v_cache, **dict(kwargs, cache_seqlens=kwargs["cache_seqlens"].long()))
    with pytest.raises(ValueError, match="pass both or neither"):
        gstar.flash_attention_with_kvcache(q, k_cache, v_cache, k=q[:, :2], **kwargs)
    without = {k: v for k, v in kwargs.items() if k != "cache_seqlens"}
    with pytest.raises(ValueError, match="appending k, v needs cache_seqlens"):
        gstar.flash_attention_with_kvcache(q, k_cache, v_cache, k=q[:, :2], v=q[:, :2], **without)
    with pytest.raises(ValueError, match="contiguous cache is"):
        gstar.flash_attention_with_kvcache(q, k_cache, v_cache, cache_seqlens=kwargs["cache_seqlens"])
    with pytest.raises(ValueError, match="num_splits must be >= 1"):
        gstar.flash_attention_with_kvcache(q, k_cache, v_cache, num_splits=0, **kwargs)
    with pytest.raises(RuntimeError, match="forward only"):
        gstar.flash_attention_with_kvcache(q.clone().requires_grad_(), k_cache, v_cache, **kwargs)


def test_unchecked_values_are_trusted():
    """check_values=False skips the host checks (no sync): a good cache gives the same result."""
    q, k_cache, v_cache, kwargs = _case()
    checked = gstar.flash_attention_with_kvcache(q, k_cache, v_cache, backend="torch", **kwargs)
    trusted = gstar.flash_attention_with_kvcache(q, k_cache, v_cache, backend="torch", check_values=False, **kwargs)
    assert torch.equal(checked, trusted)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("layout", ["contiguous", "paged"])
def test_gpu_decode_loop_within_bar_without_recompiles(layout):
    """bf16 GPT-OSS heads, one token a step for 64 steps from ragged lengths: every step within 2x the error
    of PyTorch's bf16 attention against float32, and one compiled kernel for the whole loop."""
    from gstar.lab.accuracy import verdict
    from gstar.kernels.portable.decode import _decode

    torch.manual_seed(0)
    B, Hq, Hkv, D, bs = 3, 64, 8, 64, 16
    lengths = torch.tensor([100, 1000, 3000], dtype=torch.int32, device="cuda")
    capacity = 3200
    sinks = torch.randn(Hq, device="cuda")
    full_k = torch.randn(B, Hkv, capacity, D, device="cuda")
    full_v = torch.randn(B, Hkv, capacity, D, device="cuda")
    if layout == "contiguous":
        k_cache, v_cache, table = full_k.bfloat16(), full_v.bfloat16(), None
    else:
        blocks = capacity // bs
        perm = torch.randperm(B * blocks, device="cuda")
        table = perm.view(B, blocks).int()
        k_cache = torch.empty(B * blocks, bs, Hkv, D, device="cuda", dtype=torch.bfloat16)
        v_cache = torch.empty_like(k_cache)
        k_cache[perm] = full_k.bfloat16().view(B, Hkv, blocks, bs, D).permute(0, 2, 3, 1, 4).reshape(-1, bs, Hkv, D)
        v_cache[perm] = full_v.bfloat16().view(B, Hkv, blocks, bs, D).permute(0, 2, 3, 1, 4).reshape(-1, bs, Hkv, D)
    compiled = None
    for step in range(64):
        n = lengths + step
        q = torch.randn(B, Hq, 1, D, device="cuda")
        out = gstar.flash_attention_with_kvcache(q.bfloat16(), k_cache, v_cache, cache_seqlens=n, block_table=table,
                                                 sinks=sinks, check_values=False)
        if step % 16 == 0:
            for b in range(B):
                kk, vv = full_k[b:b + 1, :, :int(n[b])], full_v[b:b + 1, :, :int(n[b])]
                ref, _ = gstar.naive_attention(q[b:b + 1], kk.bfloat16().float(), vv.bfloat16().float(),
                                               sinks=sinks, causal=True)
                pt, _ = gstar.naive_attention(q[b:b + 1].bfloat16(), kk.bfloat16(), vv.bfloat16(), sinks=sinks,
                                              causal=True)
                check = verdict("out", out[b:b + 1], ref, pt)
                assert check.ok, check
        kernels = len(_decode.device_caches[torch.cuda.current_device()][0])  # compiled variants
        compiled = kernels if compiled is None else compiled
        assert kernels == compiled, "the decode loop recompiled"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_gpu_cuda_graph_replays_with_new_lengths():
    """A decode step captured once, replayed with other cache_seqlens (copied into the captured tensor):
    each replay equals an eager call at those lengths."""
    torch.manual_seed(0)
    B, Hq, Hkv, D, bs, blocks = 2, 16, 4, 64, 32, 64
    k_cache = torch.randn(B * blocks, bs, Hkv, D, device="cuda", dtype=torch.bfloat16)
    v_cache = torch.randn_like(k_cache)
    table = torch.randperm(B * blocks, device="cuda").view(B, blocks).int()
    q = torch.randn(B, Hq, 1, D, device="cuda", dtype=torch.bfloat16)
    lengths = torch.tensor([50, 60], dtype=torch.int32, device="cuda")

    def step():
        return gstar.flash_attention_with_kvcache(q, k_cache, v_cache, cache_seqlens=lengths, block_table=table,
                                                  window=(127, 0))

    step()  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    for new in ([50, 60], [500, 1900], [1, 2047]):
        lengths.copy_(torch.tensor(new, dtype=torch.int32))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, step())


@pytest.mark.parametrize("paged, cache_dtype, nq, dim, capped", [
    (True, torch.bfloat16, 1, 64, True), (True, torch.bfloat16, 2, 64, True),  # 8 or 16 stacked rows
    (True, torch.bfloat16, 4, 64, False), (True, torch.bfloat16, 1, 128, False),  # 64 registers would spill
    (False, torch.bfloat16, 1, 64, False), (True, torch.float8_e4m3fn, 1, 64, False)])
def test_paged_register_cap_only_where_it_fits(monkeypatch, paged, cache_dtype, nq, dim, capped):
    """The Hopper decode plan caps registers for a paged 16-bit cache with 16 rows of narrow heads and no other
    (compiled for sm_90a, 64 registers spill at 32 rows or at head dim 128)."""
    monkeypatch.setattr(card, "capability_major", lambda device: 9)
    plan = decode.plan.__wrapped__(
        B=2, Hq=16, Hkv=2, nq=nq, D=dim, Dv=dim, paged=paged, block_size=64 if paged else 0,
        pattern=Pattern.make(nq, 4096, causal=True), device=torch.device("cuda"), precision="tf32", num_splits=4,
        fp8=cache_dtype == torch.float8_e4m3fn)
    assert dict(plan.options).get("maxnreg") == (decode.PAGED_REGISTERS if capped else None)


@pytest.mark.parametrize("backend, splits", [("torch", None), ("triton", 1), ("triton", 3)])
def test_infinite_sinks(backend, splits, device):
    """Sinks of +inf and -inf (clamped to +-SINK_LIMIT, docs/design.md section 1) in a decode step: the +inf head's
    rows are zeros with the LSE at the cap, the -inf head's those of no sink, in the kernel and in the merge of
    its splits (on CPU the interpreter runs the kernels)."""
    q, k_cache, v_cache, kwargs, keys, values = make_case(block_size=16, nq=2, pattern=dict(causal=True),
                                                          learned_sinks=True, append=False, dtype=torch.float32,
                                                          heads=(4, 2), device=device)
    kwargs["sinks"][0], kwargs["sinks"][2] = float("inf"), float("-inf")
    out, lse = gstar.flash_attention_with_kvcache(q, k_cache, v_cache, return_lse=True, backend=backend,
                                                  num_splits=splits, **kwargs)
    ref_out, ref_lse = oracle(q, keys, values, _pattern_of(kwargs), kwargs["sinks"])
    assert torch.equal(out[:, 0], torch.zeros_like(out[:, 0])) and torch.all(lse[:, 0] == SINK_LIMIT)
    assert relative_error(out, ref_out) < FLOAT32 and relative_error(lse, ref_lse) < FLOAT32


def test_cache_errors_name_the_cache():
    """A cache of another dtype, device or head dim is named as the call names it: k_cache, v_cache."""
    q, k_cache, v_cache, kwargs = _case()
    with pytest.raises(TypeError, match=r"q, k_cache, v_cache must share a dtype"):
        gstar.flash_attention_with_kvcache(q, k_cache.half(), v_cache.half(), **kwargs)
    with pytest.raises(ValueError, match=r"k_cache head dim must equal q head dim"):
        gstar.flash_attention_with_kvcache(q, k_cache[..., :4], v_cache, **kwargs)
