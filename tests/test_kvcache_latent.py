"""flash_attention_with_kvcache on a latent cache: multi-head latent attention decoded with absorbed weights, every
query head of a kv head attending one cache whose first ``Dv`` lanes are also its values (``v_cache`` a view of
``k_cache[..., :Dv]``).

The decode kernel then holds the keys as two parts of powers of two (``576 = 512 + 64``; here ``48 = 32 + 16`` and
``80 = 64 + 16``), reads the values with the keys, and stacks up to 64 rows a program. Against float64 attention
of each sequence on its keys: the interpreter in float32 (CPU), contiguous and paged, with sinks and windows, one
query and a few; the compiled kernel in bfloat16 at DeepSeek-V3's 576 / 512 lanes on GPUs, within 2x PyTorch's
error in the same dtype. Also: a cache whose values are a copy, or a view at another offset, is not taken for
one.
"""

import pytest
import torch
from tiers import grid

import gstar
from gstar.kernels import dispatch
from gstar.kernels.portable import decode
from gstar.lab.accuracy import relative_error
from gstar.pattern import Pattern

FLOAT32 = 1e-4  # the float32 bar

PATTERNS = {  # id: (keywords, learned sinks)
    "causal": (dict(causal=True), False),
    "learned-sinks": (dict(causal=True), True),
    "window": (dict(causal=True, window=(40, 0)), True),
}
LAYOUTS = {"contiguous": (None,), "paged32": (32,)}
DIMS = {"48-32": ((48, 32),), "80-64": ((80, 64),)}
QUERIES = {"nq1": (1,), "nq3": (3,)}


def make_case(*, block_size, nq, dims, pattern, learned_sinks, heads=(16, 1), lengths=(37, 130, 5), dtype=torch.float32,
              device="cpu", seed=0):
    """Random queries and one latent cache per kv head: ``(q, k_cache, v_cache, kwargs, keys, values)``, the last
    two each sequence's keys and values (float64) for the oracle."""
    g = torch.Generator().manual_seed(seed)
    (Hq, Hkv), (D, Dv), B = heads, dims, len(lengths)
    capacity = max(lengths) + 7

    def rand(*shape):
        return torch.randn(*shape, generator=g, dtype=torch.float64)

    keys = [rand(1, Hkv, n, D) for n in lengths]
    q = rand(B, Hq, nq, D).to(dtype).to(device)
    if block_size is None:
        k_cache = rand(B, Hkv, capacity, D)
        for b, n in enumerate(lengths):
            k_cache[b, :, :n] = keys[b][0]
        table = None
    else:
        blocks = -(-capacity // block_size)
        k_cache = rand(B * blocks + 2, block_size, Hkv, D)
        table = torch.randperm(B * blocks + 2, generator=g)[:B * blocks].view(B, blocks).int()
        for b, n in enumerate(lengths):
            rows = keys[b][0].transpose(0, 1)                                      # (n, Hkv, D)
            for j in range(-(-n // block_size)):
                part = rows[j * block_size:(j + 1) * block_size]
                k_cache[table[b, j], :part.shape[0]] = part
        table = table.to(device)
    k_cache = k_cache.to(dtype).to(device)
    keys = [kk.to(dtype).double() for kk in keys]  # as the cache holds them
    kwargs = dict(cache_seqlens=torch.tensor(lengths, dtype=torch.int32, device=device), block_table=table,
                  sinks=rand(Hq).float().to(device) if learned_sinks else None, **pattern)
    return q, k_cache, k_cache[..., :Dv], kwargs, keys, [kk[..., :Dv] for kk in keys]


def oracle(q, keys, values, kwargs):
    """float64 attention of each sequence's queries (its last positions) on its keys."""
    rule = {k: kwargs[k] for k in ("causal", "window") if k in kwargs}
    outs, lses = zip(*[gstar.naive_attention(q[b:b + 1].double(), kk, vv, sinks=kwargs["sinks"],
                                             **rule) for b, (kk, vv) in enumerate(zip(keys, values))])
    return torch.cat(outs), torch.cat(lses)


@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU tier: the interpreter on CPU tensors")
@pytest.mark.parametrize("layout, dims, pattern, learned_sinks, nq", grid(LAYOUTS, DIMS, PATTERNS, QUERIES))
def test_triton_kernel(layout, dims, pattern, learned_sinks, nq):
    q, k_cache, v_cache, kwargs, keys, values = make_case(block_size=layout, nq=nq, dims=dims, pattern=pattern,
                                                          learned_sinks=learned_sinks)
    out, lse = gstar.flash_attention_with_kvcache(q, k_cache, v_cache, return_lse=True, backend="triton", **kwargs)
    ref_out, ref_lse = oracle(q, keys, values, kwargs)
    assert relative_error(out, ref_out) < FLOAT32
    assert relative_error(lse, ref_lse) < FLOAT32


def test_values_in_keys_only_for_a_view_of_the_keys():
    k = torch.randn(5, 16, 1, 48)
    assert dispatch.values_in_keys(k, k[..., :32])
    assert not dispatch.values_in_keys(k, k[..., :32].clone())  # a copy: another storage
    assert not dispatch.values_in_keys(k, k[..., 16:])  # the keys' last lanes: another offset
    assert not dispatch.values_in_keys(k, k[..., :32].to(torch.float16))


@pytest.mark.parametrize("D, Dv, shared, fp8, tail", [
    (576, 512, True, False, 64), (48, 32, True, False, 16),
    (576, 512, False, False, 0),  # values a cache of their own: read as before
    (576, 512, True, True, 0),  # FP8 caches keep one padded part
    (64, 64, True, False, 0), (96, 32, True, False, 0)])  # one part; a head part wider than the values
def test_latent_tiles_only_for_a_latent_cache(D, Dv, shared, fp8, tail):
    plan = decode.plan.__wrapped__(B=2, Hq=128, Hkv=1, nq=1, D=D, Dv=Dv, paged=True, block_size=64,
                                   pattern=Pattern.make(1, 4096, causal=True), device=torch.device("cpu"),
                                   precision="ieee", num_splits=None, fp8=fp8, values_in_keys=shared)
    options = dict(plan.options)
    assert options["HEAD_TAIL"] == tail
    assert options["VALUES_IN_KEYS"] == (tail > 0)
    width = decode.pad_head_dim(D) + decode.pad_head_dim(Dv)
    assert options["BLOCK_R"] == (decode.LATENT_ROWS if tail else decode.stacked_rows(128, width))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("layout, nq", [(None, 1), (64, 1), (64, 2)], ids=["contiguous", "paged64", "paged64-nq2"])
@pytest.mark.parametrize("learned_sinks", [False, True], ids=["plain", "sinks"])
def test_gpu_latent_within_bar(layout, nq, learned_sinks):
    """DeepSeek-V3's shape: 128 heads on one 576-lane cache, values its first 512, bfloat16, ragged lengths."""
    from gstar.lab.accuracy import verdict

    q, k_cache, v_cache, kwargs, keys, values = make_case(
        block_size=layout, nq=nq, dims=(576, 512), pattern=dict(causal=True), learned_sinks=learned_sinks,
        heads=(128, 1), lengths=(1537, 3, 4100), dtype=torch.bfloat16, device="cuda")
    out, lse = gstar.flash_attention_with_kvcache(q, k_cache, v_cache, return_lse=True, **kwargs)
    ref_out, ref_lse = oracle(q, [kk.cuda() for kk in keys], [vv.cuda() for vv in values], kwargs)
    pt = torch.cat([gstar.naive_attention(q[b:b + 1], kk.cuda().bfloat16(), vv.cuda().bfloat16(),
                                          sinks=kwargs["sinks"], causal=True)[0]
                    for b, (kk, vv) in enumerate(zip(keys, values))])  # PyTorch in the same dtype
    check = verdict("out", out, ref_out, pt)
    assert check.ok, check
    assert relative_error(lse, ref_lse) < FLOAT32
