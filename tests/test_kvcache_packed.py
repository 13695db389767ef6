"""flash_attention_with_kvcache with packed queries (``cu_seqlens_q``): a serving step's mix of prefill chunks,
speculative drafts and decode tokens, each sequence against its own cache, in one call.

Against float64 naive attention of each sequence's queries on its keys: ragged mixes of 0-, 1- and many-query
sequences (the many-query ones past the split-KV launch's few, so both launches run), contiguous and paged caches
(random block tables, -1 where no query reads), with and without appending, every pattern; the PyTorch path in
float64 (exact) and the Triton kernel under the interpreter in float32 (the float32 bar). Also the errors for
bad offsets, lengths past the capacity and tables out of range; on GPUs the 16-bit bar, a CUDA graph replayed
with a new mix, and one compiled kernel per launch across mixes.
"""

import pytest
import torch
from tiers import grid

import gstar
from gstar.lab.accuracy import relative_error
from gstar.pattern import Pattern, read_blocks

EXACT = 1e-12   # float64 on both sides: orders of summation differ, nothing else
FLOAT32 = 1e-4  # the float32 bar

PATTERNS = {  # id: (keywords, learned sinks)
    "causal": (dict(causal=True), False),
    "full": (dict(causal=False), False),
    "window-sink-tokens": (dict(causal=True, window=(6, 0), sink_tokens=2), False),
    "learned-sinks": (dict(causal=True), True),
    "window-sinks": (dict(causal=True, window=(9, 0)), True),
    "chunk-softcap": (dict(causal=True, chunk=20, softcap=1.5), False),
}
LAYOUTS = {"contiguous": (None,), "paged16": (16,), "paged32": (32,)}
# queries per sequence: none, one token, a few drafts, a prefill chunk longer than a split program's rows
MIXES = {"mixed": ((1, 0, 3, 19, 1),), "decode": ((1, 1, 1),), "prefill": ((0, 26),)}
LENGTHS = (37, 12, 0, 50, 61)  # keys before the step, one per sequence (cycled)


def make_case(*, counts, block_size, pattern, learned_sinks, append, heads=(4, 2), dim=8, value_dim=8,
              dtype=torch.float64, device="cpu", seed=0, lengths=LENGTHS):
    """Random packed inputs: sequence ``b`` holds ``lengths[b]`` keys (at least its query count when reading
    only) and brings ``counts[b]`` queries (appending their keys too when ``append``); a contiguous cache
    (``block_size`` None) or a paged one with shuffled pages and -1 for pages no query sees. Returns q, the
    caches, the call's keywords and each sequence's queries, keys and values for the oracle."""
    g = torch.Generator().manual_seed(seed)
    Hq, Hkv = heads
    B = len(counts)

    def rand(*shape):
        return torch.randn(*shape, generator=g, dtype=torch.float64).to(dtype).to(device)

    held = [max(lengths[b % len(lengths)], 0 if append else counts[b]) for b in range(B)]
    total = [n + (c if append else 0) for n, c in zip(held, counts)]
    keys = [rand(1, Hkv, n, dim) for n in total]
    values = [rand(1, Hkv, n, value_dim) for n in total]
    queries = [rand(1, Hq, c, dim) for c in counts]
    q = torch.cat([x[0].transpose(0, 1) for x in queries])                      # (total_q, Hq, D)
    cu = torch.tensor([0] + torch.tensor(counts).cumsum(0).tolist(), dtype=torch.int32, device=device)
    capacity = max(total) + 5
    args = dict(cache_seqlens=torch.tensor(held, dtype=torch.int32, device=device), cu_seqlens_q=cu,
                max_seqlen_q=max(counts))
    if append:  # the new keys: each sequence's last counts[b]
        args["k"] = torch.cat([kk[0, :, n:].transpose(0, 1) for kk, n in zip(keys, held)])   # (total_q, Hkv, D)
        args["v"] = torch.cat([vv[0, :, n:].transpose(0, 1) for vv, n in zip(values, held)])
    if block_size is None:
        k_cache, v_cache = rand(B, Hkv, capacity, dim), rand(B, Hkv, capacity, value_dim)
        for b, n in enumerate(held):
            k_cache[b, :, :n] = keys[b][0, :, :n]
            v_cache[b, :, :n] = values[b][0, :, :n]
    else:
        blocks = -(-capacity // block_size)
        pool = B * blocks + 3
        k_cache, v_cache = rand(pool, block_size, Hkv, dim), rand(pool, block_size, Hkv, value_dim)
        pages = torch.randperm(pool, generator=g)[:B * blocks].view(B, blocks).int()
        table = torch.full_like(pages, -1)
        rule = {k: x for k, x in pattern.items() if k != "softcap"}
        for b in range(B):
            if counts[b]:
                seen = read_blocks(Pattern.make(counts[b], total[b], **rule), block_size)
                table[b, seen] = pages[b, seen]
            for j in range(blocks):  # every block the sequence fills, visible or not, is written
                lo, hi = j * block_size, min((j + 1) * block_size, held[b])
                if lo < hi:
                    k_cache[pages[b, j], :hi - lo] = keys[b][0, :, lo:hi].transpose(0, 1)
                    v_cache[pages[b, j], :hi - lo] = values[b][0, :, lo:hi].transpose(0, 1)
        args["block_table"] = table.to(device)
    sinks = rand(Hq) * 2 if learned_sinks else None
    return q, k_cache, v_cache, dict(args, sinks=sinks, **pattern), (queries, keys, values)


def oracle(sequences, pattern, sinks, dtype=torch.float64):
    """Naive attention of each sequence's queries against its keys (float64 unless ``dtype``), packed:
    ``(total_q, Hq, Dv)`` and the LSE ``(Hq, total_q)``."""
    outs, lses = [], []
    for qq, kk, vv in zip(*sequences):
        if qq.shape[2] == 0:
            continue
        out, lse = gstar.naive_attention(qq.to(dtype), kk.to(dtype), vv.to(dtype),
                                         sinks=None if sinks is None else sinks.to(dtype), **pattern)
        outs.append(out[0].transpose(0, 1))
        lses.append(lse[0])
    return torch.cat(outs), torch.cat(lses, dim=1)


def _pattern_of(kwargs):
    return {k: kwargs[k] for k in ("causal", "window", "sink_tokens", "chunk", "softcap") if k in kwargs}


@pytest.mark.parametrize("layout, counts, pattern, learned_sinks, append", grid(
    LAYOUTS, MIXES, PATTERNS, {"read": (False,), "append": (True,)}))
def test_torch_path(layout, counts, pattern, learned_sinks, append):
    q, k_cache, v_cache, kwargs, sequences = make_case(counts=counts, block_size=layout, pattern=pattern,
                                                       learned_sinks=learned_sinks, append=append)
    out, lse = gstar.flash_attention_with_kvcache(q, k_cache, v_cache, return_lse=True, backend="torch", **kwargs)
    ref_out, ref_lse = oracle(sequences, _pattern_of(kwargs), kwargs["sinks"])
    assert out.shape == q.shape[:2] + (v_cache.shape[-1],) and lse.shape == (q.shape[1], q.shape[0])
    assert relative_error(out, ref_out) <= EXACT
    assert relative_error(lse, ref_lse) <= EXACT


@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU tier: the interpreter (GPUs run test_gpu_*)")
@pytest.mark.parametrize("layout, counts, pattern, learned_sinks, splits", grid(
    LAYOUTS, MIXES, PATTERNS, {"auto": (None,), "split1": (1,), "split5": (5,)}))
def test_triton_kernel(layout, counts, pattern, learned_sinks, splits):
    """float32 under the interpreter, appending: both launches (split-KV for the few-query sequences, tiles of
    consecutive queries for the long ones) over one batch."""
    q, k_cache, v_cache, kwargs, sequences = make_case(counts=counts, block_size=layout, pattern=pattern,
                                                       learned_sinks=learned_sinks, append=True,
                                                       dtype=torch.float32)
    out, lse = gstar.flash_attention_with_kvcache(q, k_cache, v_cache, return_lse=True, backend="triton",
                                                  num_splits=splits, **kwargs)
    ref_out, ref_lse = oracle(sequences, _pattern_of(kwargs), kwargs["sinks"])
    assert relative_error(out, ref_out) < FLOAT32
    assert relative_error(lse, ref_lse) < FLOAT32


@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU tier: the interpreter on CPU tensors")
@pytest.mark.parametrize("heads", [(3, 3), (6, 2), (16, 2)], ids=["mha", "group3", "group8"])
def test_triton_groups_and_value_dim(heads):
    """GQA groups that do not divide a program's rows (a tile's queries start mid-group) and one past it (16
    query heads: a tile of few queries), a value head dim other than q's."""
    q, k_cache, v_cache, kwargs, sequences = make_case(counts=(2, 13, 0, 1), block_size=16,
                                                       pattern=dict(causal=True, window=(11, 0)),
                                                       learned_sinks=True, append=True, heads=heads,
                                                       value_dim=12, dtype=torch.float32)
    out, lse = gstar.flash_attention_with_kvcache(q, k_cache, v_cache, return_lse=True, backend="triton", **kwargs)
    ref_out, ref_lse = oracle(sequences, _pattern_of(kwargs), kwargs["sinks"])
    assert relative_error(out, ref_out) < FLOAT32
    assert relative_error(lse, ref_lse) < FLOAT32


@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU tier: the interpreter on CPU tensors")
@pytest.mark.parametrize("heads", [(6, 2), (6, 3)], ids=["group3", "group2"])
def test_triton_long_sequences_find_their_slots(heads):
    """Several long sequences of several tiles each between query-less ones: every tile of the long launch's
    grid finds its sequence (the slots' bisection), none is walked twice or skipped."""
    q, k_cache, v_cache, kwargs, sequences = make_case(counts=(0, 30, 0, 0, 17, 6, 0, 41), block_size=16,
                                                       pattern=dict(causal=True), learned_sinks=False,
                                                       append=True, heads=heads, dtype=torch.float32)
    out, lse = gstar.flash_attention_with_kvcache(q, k_cache, v_cache, return_lse=True, backend="triton", **kwargs)
    ref_out, ref_lse = oracle(sequences, _pattern_of(kwargs), kwargs["sinks"])
    assert relative_error(out, ref_out) < FLOAT32
    assert relative_error(lse, ref_lse) < FLOAT32


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_larger_max_seqlen_q_changes_nothing(backend, device):
    """max_seqlen_q is a bound (the launch's size): a looser one gives the same result, bit for bit."""
    q, k_cache, v_cache, kwargs, _ = make_case(counts=(1, 0, 7), block_size=16, pattern=dict(causal=True),
                                               learned_sinks=True, append=False, dtype=torch.float32,
                                               device=device)
    tight = gstar.flash_attention_with_kvcache(q, k_cache, v_cache, backend=backend, **kwargs)
    loose = gstar.flash_attention_with_kvcache(q, k_cache, v_cache, backend=backend, **{**kwargs,
                                                                                      "max_seqlen_q": 40})
    assert torch.equal(tight, loose)


def test_append_writes_each_sequence_at_its_length():
    """The appended keys land at cache_seqlens[b] + i of their own sequence, nowhere else."""
    q, k_cache, v_cache, kwargs, (_, keys, values) = make_case(counts=(2, 0, 3), block_size=None,
                                                               pattern=dict(causal=True), learned_sinks=False,
                                                               append=True)
    before = k_cache.clone()
    gstar.flash_attention_with_kvcache(q, k_cache, v_cache, backend="torch", **kwargs)
    for b, n in enumerate(kwargs["cache_seqlens"].tolist()):
        end = keys[b].shape[2]
        assert torch.equal(k_cache[b, :, :end], keys[b][0])
        assert torch.equal(v_cache[b, :, :end], values[b][0])
        assert torch.equal(k_cache[b, :, end:], before[b, :, end:])


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_no_queries(backend, device):
    """A step with no query at all returns empty tensors and appends nothing."""
    q, k_cache, v_cache, kwargs, _ = make_case(counts=(0, 0), block_size=16, pattern=dict(causal=True),
                                               learned_sinks=False, append=True, dtype=torch.float32,
                                               device=device)
    before = k_cache.clone()
    out, lse = gstar.flash_attention_with_kvcache(q, k_cache, v_cache, return_lse=True, backend=backend,
                                                  **{**kwargs, "max_seqlen_q": 0})
    assert out.shape == (0, 4, 8) and lse.shape == (4, 0) and torch.equal(k_cache, before)


def _bad_case():
    return make_case(counts=(1, 4), block_size=16, pattern=dict(causal=True), learned_sinks=False, append=True)


@pytest.mark.parametrize("change, error, match", [
    (lambda a: a.update(cu_seqlens_q=a["cu_seqlens_q"].long()), TypeError, r"cu_seqlens_q must have dtype torch.int32"),
    (lambda a: a.update(cu_seqlens_q=a["cu_seqlens_q"] + 1), ValueError, r"cu_seqlens_q must start at 0"),
    (lambda a: a.update(cu_seqlens_q=torch.tensor([0, 4, 1], dtype=torch.int32)), ValueError,
     r"cu_seqlens_q must be non-decreasing"),
    (lambda a: a.update(cu_seqlens_q=torch.tensor([0, 1, 4], dtype=torch.int32)), ValueError,
     r"cu_seqlens_q must end at total_q \(q.shape\[0\]\) = 5"),
    (lambda a: a.update(max_seqlen_q=3), ValueError, r"max_seqlen_q must be >= the longest sequence"),
    (lambda a: a.pop("max_seqlen_q"), ValueError, r"packed queries \(cu_seqlens_q\) need max_seqlen_q"),
    (lambda a: a.update(max_seqlen_q=0), ValueError, r"max_seqlen_q must be >= 1"),
    (lambda a: a.update(max_seqlen_q=2.0), TypeError, r"max_seqlen_q must be an int"),
    (lambda a: a.pop("cu_seqlens_q"), ValueError, r"max_seqlen_q goes with cu_seqlens_q"),
    (lambda a: a.update(cache_seqlens=None, k=None, v=None), ValueError, r"packed queries \(cu_seqlens_q\) need "
     r"cache_seqlens"),
    (lambda a: a.update(cache_seqlens=torch.tensor([1, 2, 3], dtype=torch.int32)), ValueError,
     r"cache_seqlens must have one entry per sequence of cu_seqlens_q's sequences \(2\)"),
    (lambda a: a.update(block_table=a["block_table"][:1]), ValueError, r"block_table must have one entry per sequence"),
    (lambda a: a.update(k=a["k"][None]), ValueError, r"k must have 3 dims"),
    (lambda a: a.update(v=a["v"][:4]), ValueError, r"v must be \(5, 2, 8\) \(total_q, Hkv, head dim of the cache\)"),
    (lambda a: a.update(cache_seqlens=torch.tensor([37, 60], dtype=torch.int32)), ValueError,
     r"cache_seqlens\[1\] = 60 \+ 4 appended is outside the cache's capacity of 48 keys"),
    (lambda a: a["block_table"].__setitem__((1, 0), 1000), ValueError,
     r"block_table\[1, 0\] = 1000 is outside the cache's 9 blocks \(sequence 1 reads that block\)"),
])
def test_bad_input_is_named(change, error, match):
    q, k_cache, v_cache, kwargs, _ = _bad_case()
    change(kwargs)
    with pytest.raises(error, match=match):
        gstar.flash_attention_with_kvcache(q, k_cache, v_cache, backend="torch", **kwargs)


def test_dense_q_with_packed_offsets_is_named():
    """A 4-D q beside cu_seqlens_q: the packed layout is (total_q, Hq, D)."""
    q, k_cache, v_cache, kwargs, _ = _bad_case()
    with pytest.raises(ValueError, match=r"q must have 3 dims"):
        gstar.flash_attention_with_kvcache(q[None], k_cache, v_cache, **kwargs)


@pytest.mark.parametrize("q_fp8", [False, True], ids=["bf16-queries", "fp8-queries"])
def test_fp8_cache(q_fp8, device):
    """An FP8 contiguous cache (one descale per sequence and kv head), queries bfloat16 or FP8 (packed descales
    per sequence): within 2x PyTorch's bfloat16 error on the dequantised inputs. On CPU the PyTorch path."""
    from gstar.lab.accuracy import verdict

    _, k_cache, v_cache, kwargs, (queries, _, _) = make_case(counts=(1, 0, 9, 2), block_size=None,
                                                             pattern=dict(causal=True, window=(20, 0)),
                                                             learned_sinks=True, append=False, dtype=torch.float32,
                                                             heads=(4, 2), dim=32, value_dim=32)
    k8, kd = gstar.quantize_fp8(k_cache)                                          # (B, Hkv, cap, D), (B, Hkv)
    v8, vd = gstar.quantize_fp8(v_cache)
    q = torch.cat([x[0].transpose(0, 1) for x in queries])                        # (total_q, Hq, D)
    qd = None
    if q_fp8:
        q, qd = gstar.quantize_fp8(q, kv_heads=2, cu_seqlens=kwargs["cu_seqlens_q"])
    else:
        q = q.bfloat16()
    to = lambda t: t.to(device) if isinstance(t, torch.Tensor) else t  # noqa: E731 - the call's tensors
    with torch.no_grad():
        out = gstar.flash_attention_with_kvcache(to(q), to(k8), to(v8), q_descale=to(qd), k_descale=to(kd),
                                                 v_descale=to(vd), **{k: to(x) for k, x in kwargs.items()})
    assert out.dtype == torch.bfloat16
    deq_k, deq_v = (t.double() * d.double()[:, :, None, None] for t, d in ((k8, kd), (v8, vd)))
    cu, lengths = kwargs["cu_seqlens_q"].tolist(), kwargs["cache_seqlens"].tolist()
    deq_q = q.double() if qd is None else torch.cat([
        q[cu[b]:cu[b + 1]].double() * qd[b].double().repeat_interleave(2)[None, :, None] for b in range(len(lengths))])
    sequences = ([deq_q[cu[b]:cu[b + 1]].transpose(0, 1)[None] for b in range(len(lengths))],
                 [deq_k[b:b + 1, :, :n] for b, n in enumerate(lengths)],
                 [deq_v[b:b + 1, :, :n] for b, n in enumerate(lengths)])
    ref, _ = oracle(sequences, _pattern_of(kwargs), kwargs["sinks"])
    pt, _ = oracle(sequences, _pattern_of(kwargs), kwargs["sinks"], dtype=torch.bfloat16)
    check = verdict("out", out.cpu(), ref, pt)
    assert check.ok, check


GPU_MIXES = {"serving": ((1, 0, 1, 300, 4, 1, 77),), "decode": ((1,) * 9,)}


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("layout, counts, pattern, learned_sinks, dtype", grid(
    {"contiguous": (None,), "paged64": (64,)}, GPU_MIXES, PATTERNS,
    {"bf16": (torch.bfloat16,), "fp16": (torch.float16,)}))
def test_gpu_packed_within_bar(layout, counts, pattern, learned_sinks, dtype):
    """The compiled kernels on a serving mix (GPT-OSS heads, longer ragged caches), appending: output within 2x
    PyTorch's error in the same dtype, the LSE within the float32 bar."""
    from gstar.lab.accuracy import verdict

    q, k_cache, v_cache, kwargs, sequences = make_case(
        counts=counts, block_size=layout, pattern=pattern, learned_sinks=learned_sinks, append=True, dtype=dtype,
        heads=(64, 8), dim=64, value_dim=64, device="cuda", lengths=(437, 0, 1061, 2000, 90, 3000, 700))
    out, lse = gstar.flash_attention_with_kvcache(q, k_cache, v_cache, return_lse=True, **kwargs)
    ref_out, ref_lse = oracle(sequences, _pattern_of(kwargs), kwargs["sinks"])
    pt, _ = oracle(sequences, _pattern_of(kwargs), kwargs["sinks"], dtype=dtype)  # PyTorch in the same dtype
    check = verdict("out", out, ref_out, pt)
    assert check.ok, check
    assert relative_error(lse, ref_lse) < FLOAT32


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_gpu_cuda_graph_replays_a_new_mix_without_recompiles():
    """A step captured once with max_seqlen_q = 64, replayed with other query counts and lengths (copied into
    the captured tensors): each replay equals an eager call on that mix, and no launch compiled anew."""
    from gstar.kernels.portable.decode import _decode

    torch.manual_seed(0)
    B, Hq, Hkv, D, bs, blocks, total = 4, 16, 4, 64, 64, 64, 80
    k_cache = torch.randn(B * blocks, bs, Hkv, D, device="cuda", dtype=torch.bfloat16)
    v_cache = torch.randn_like(k_cache)
    table = torch.randperm(B * blocks, device="cuda").view(B, blocks).int()
    q = torch.randn(total, Hq, D, device="cuda", dtype=torch.bfloat16)
    cu = torch.zeros(B + 1, dtype=torch.int32, device="cuda")
    lengths = torch.zeros(B, dtype=torch.int32, device="cuda")

    def set_mix(counts, new):
        cu.copy_(torch.tensor([0] + torch.tensor(counts).cumsum(0).tolist(), dtype=torch.int32))
        lengths.copy_(torch.tensor(new, dtype=torch.int32))

    def step():  # q keeps its rows (the LSE's stride, total_q, is specialised on); rows past cu's end stay unset
        return gstar.flash_attention_with_kvcache(q, k_cache, v_cache, cache_seqlens=lengths,
                                                  block_table=table, cu_seqlens_q=cu, max_seqlen_q=64,
                                                  window=(127, 0), check_values=False)

    set_mix([1, 64, 1, 14], [50, 60, 3000, 7])
    step()  # compile outside the capture
    compiled = len(_decode.device_caches[torch.cuda.current_device()][0])  # compiled variants
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    for counts, new in (([1, 64, 1, 14], [50, 60, 3000, 7]), ([4, 4, 4, 68 - 12], [500, 1900, 1, 2047]),
                        ([0, 0, 1, 63], [0, 0, 4000, 10])):
        set_mix(counts, new)
        graph.replay()
        torch.cuda.synchronize()
        eager = step()
        assert torch.equal(out[:sum(counts)], eager[:sum(counts)])
    assert len(_decode.device_caches[torch.cuda.current_device()][0]) == compiled, "a new mix recompiled"
