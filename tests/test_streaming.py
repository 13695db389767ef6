"""gstar.streaming.StreamingCache: step by step through its pages, far past them, the outputs are the oracle's
on the whole sequence with the same pattern; the pages in use stay within the pool, which they fill once warm;
freed pages are never read (they hold NaN between steps); examples/streaming_generate.py runs at constant
memory."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import gstar
from gstar.lab.accuracy import verdict
from gstar.streaming import StreamingCache


def _stream(cache, q, k, v, steps, sinks, backend, num_splits):
    """Feed ``q``, ``k``, ``v`` (B, H, N, D) through ``cache`` in steps of the sizes ``steps``, layer ``l`` with
    values ``v * 2**l`` (its output must be layer 0's times ``2**l``, exactly); layer 0's outputs (B, Hq, N, Dv),
    the pages in use after each step and how often the band moved down."""
    outs, in_use, moves, start, kernel_start = [], [], 0, 0, 0
    for n in steps:
        assert cache.step(n) == start
        moves += int(cache.cache_seqlens[0]) < kernel_start
        kernel_start = int(cache.cache_seqlens[0])
        cache.k[:, cache.free] = float("nan")  # a freed page that is still read shows in the output
        cache.v[:, cache.free] = float("nan")
        part = slice(start, start + n)
        layers = [cache.attend(layer, q[:, :, part], k[:, :, part], v[:, :, part] * 2**layer, sinks=sinks,
                               backend=backend, num_splits=num_splits, check_values=True)
                  for layer in range(cache.k.shape[0])]
        assert all(torch.equal(out, layers[0] * 2**layer) for layer, out in enumerate(layers))
        outs.append(layers[0])
        in_use.append(cache.pages_in_use)
        start += n
    return torch.cat(outs, dim=2), in_use, moves


def _check(backend, dtype, *, layers, B, Hq, Hkv, D, Dv, S, W, bs, steps, learned, num_splits=None):
    N = sum(steps)
    q = torch.randn(B, Hq, N, D, dtype=dtype)
    k = torch.randn(B, Hkv, N, D, dtype=dtype)
    v = torch.randn(B, Hkv, N, Dv, dtype=dtype)
    sinks = torch.randn(Hq) if learned else None
    cache = StreamingCache(layers=layers, batch=B, kv_heads=Hkv, head_dim=D, value_dim=Dv, sink_tokens=S, window=W,
                           block_size=bs, max_new=max(steps), dtype=dtype)
    with torch.no_grad():
        out, in_use, moves = _stream(cache, q, k, v, steps, sinks, backend, num_splits)
    assert moves >= 2 and N > cache.width * bs  # pages recycled, positions rebased
    rule = dict(causal=True, window=(W - 1, 0), sink_tokens=S)
    ref, _ = gstar.naive_attention(q.double(), k.double(), v.double(), sinks=sinks, **rule)
    own, _ = gstar.naive_attention(q, k, v, sinks=sinks, **rule)
    result = verdict("out", out, ref, own)
    assert result.ok, result
    # the band's block count moves with its alignment: the pool holds the most it reaches, and no more
    assert max(in_use) == max(in_use[len(in_use) // 2:]) == cache.pages, in_use


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("S,W,bs,steps", [
    (4, 40, 16, [1] * 110),                   # the last sink-token block also holds window keys early on
    (0, 17, 16, [1] * 70),                    # a plain sliding window
    (32, 33, 32, [5, 1, 3, 2, 5, 4] * 10),    # whole sink-token blocks, steps of a few tokens
])
def test_torch_path_matches_oracle(dtype, S, W, bs, steps):
    _check("torch", dtype, layers=2, B=2, Hq=4, Hkv=2, D=16, Dv=16, S=S, W=W, bs=bs, steps=steps, learned=S != 32)


@pytest.mark.parametrize("S,W,steps,num_splits", [
    (3, 10, [1, 3] * 18, 2),   # split-KV: the learned sink joins once, in the combine
    (16, 20, [4, 3] * 13, None),
])
def test_triton_kernel_matches_oracle(S, W, steps, num_splits):
    """The decode kernel under the Triton interpreter (tests/conftest.py), tiny shapes, learned sinks."""
    _check("triton", torch.float32, layers=1, B=2, Hq=2, Hkv=1, D=16, Dv=8, S=S, W=W, bs=16, steps=steps,
           learned=True, num_splits=num_splits)


def test_step_bookkeeping():
    """Steady state: exactly the pages one step sees, positions handed out in order, bad input refused."""
    cache = StreamingCache(layers=1, batch=3, kv_heads=1, head_dim=16, sink_tokens=20, window=33, block_size=16)
    assert cache.width == 2 + 3 and cache.pages == 15
    starts = [cache.step() for _ in range(500)]
    assert starts == list(range(500)) and cache.length == 500
    assert cache.pages_in_use == cache.pages - len(cache.free) and len(set(cache.free)) == len(cache.free)
    live = cache.block_table[cache.block_table >= 0]
    assert len(live) == cache.pages_in_use and len(set(live.tolist())) == len(live)
    assert int(cache.cache_seqlens[0]) < cache.width * cache.block_size
    with pytest.raises(ValueError, match="max_new"):
        cache.step(2)
    with pytest.raises(ValueError, match="new tokens"):
        cache.attend(0, torch.zeros(3, 1, 2, 16), torch.zeros(3, 1, 2, 16), torch.zeros(3, 1, 2, 16))
    with pytest.raises(ValueError, match="multiple of 16"):
        StreamingCache(layers=1, batch=1, kv_heads=1, head_dim=16, sink_tokens=0, window=8, block_size=24)
    with pytest.raises(ValueError, match="window"):
        StreamingCache(layers=1, batch=1, kv_heads=1, head_dim=16, sink_tokens=0, window=0)


@pytest.mark.gpu
def test_captured_step_replays_past_the_pool():
    """A CUDA graph of one decode step's attention replays step after step (``step`` edits the block table
    and lengths in place, outside the graph), matching the oracle far past the pool."""
    B, Hq, Hkv, D, S, W, N = 2, 8, 2, 64, 4, 64, 400
    q, k, v = (torch.randn(B, h, N, D, device="cuda", dtype=torch.bfloat16) for h in (Hq, Hkv, Hkv))
    sinks = torch.randn(Hq, device="cuda")
    cache = StreamingCache(layers=1, batch=B, kv_heads=Hkv, head_dim=D, sink_tokens=S, window=W,
                           dtype=torch.bfloat16, device="cuda")
    step_q, step_k, step_v = (torch.empty_like(t[:, :, :1]) for t in (q, k, v))  # (B, H, 1, D) static inputs
    graph, outs = None, []
    with torch.no_grad():
        for t in range(N):
            cache.step(1)
            for static, full in ((step_q, q), (step_k, k), (step_v, v)):
                static.copy_(full[:, :, t:t + 1])
            if t < 2:  # eager: the kernels compile
                outs.append(cache.attend(0, step_q, step_k, step_v, sinks=sinks))
                continue
            if graph is None:
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph):
                    captured = cache.attend(0, step_q, step_k, step_v, sinks=sinks)
            graph.replay()
            outs.append(captured.clone())
    assert N > 3 * cache.width * cache.block_size
    rule = dict(causal=True, window=(W - 1, 0), sink_tokens=S)
    ref, _ = gstar.naive_attention(q.double(), k.double(), v.double(), sinks=sinks, **rule)
    own, _ = gstar.naive_attention(q, k, v, sinks=sinks, **rule)
    result = verdict("out", torch.cat(outs, dim=2), ref, own)
    assert result.ok, result


@pytest.mark.slow
def test_streaming_example_runs_at_constant_memory():
    """examples/streaming_generate.py generates several times its keys' budget, within its pool of pages."""
    script = Path(__file__).resolve().parents[1] / "examples" / "streaming_generate.py"
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="")
    result = subprocess.run([sys.executable, str(script), "--tokens", "300", "--every", "50"],
                            capture_output=True, text=True, timeout=300, env=env)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    budget = int(lines[0].split(" keys (")[1].split()[0]) * int(lines[0].split(" pages of ")[1].split()[0])
    reports = [line.split() for line in lines if line.startswith("tokens ")]
    pools = {fields[fields.index("pages") + 1].split("/")[1] for fields in reports}
    assert len(reports) == 6 and int(reports[-1][3].replace(",", "")) > 2 * budget, result.stdout
    assert pools == {lines[0].split(" pages of ")[0].split()[-1]}, result.stdout
