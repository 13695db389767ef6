"""gstar.distributed against gstar on the whole sequence: 2 and 4 gloo ranks on CPU, 2 NCCL ranks on GPUs.

Every pattern the exchanges distinguish (full causal and bidirectional through the ring; causal windows
narrower and wider than a shard, with and without sink tokens, through the halo exchange; learned sinks;
GQA, a value head dim other than q's) under both layouts, at odd chunk lengths: out, LSE, dq, dk, dv of each shard and dsinks summed over
ranks, in float64, equal to the whole sequence's to rounding. Also the bytes each exchange moves, the errors
for bad input, the Hugging Face context manager (examples/context_parallel_train.py's loop) and the
benchmark script at a tiny size. Ranks live in pools started once per world size (tests/distributed_pool.py).
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from distributed_pool import Pool
from tiers import grid

import gstar.distributed as gd

ROOT = Path(__file__).resolve().parents[1]
EXACT = 1e-12  # relative error, float64 on both sides: the orders of summation differ, nothing else


@pytest.fixture(scope="module")
def pools():
    started = {}

    def get(world: int, backend: str = "gloo") -> Pool:
        if (world, backend) not in started:
            started[world, backend] = Pool(world, backend)
        return started[world, backend]

    yield get
    for pool in started.values():
        pool.close()


def _values(results):
    for rank, (status, value) in enumerate(results):
        assert status == "ok", f"rank {rank} raised {value[0]}: {value[1]}\n{value[2]}"
    return [value for _, value in results]


PATTERNS = {  # id: (keywords, learned sinks)
    "causal": (dict(causal=True), False),
    "full": (dict(), False),
    "window": (dict(causal=True, window=(4, 0)), False),
    "wide-window": (dict(causal=True, window=(13, 0)), False),     # wider than a chunk: halos from 2+ ranks
    "sink-tokens": (dict(causal=True, window=(4, 0), sink_tokens=3), False),
    "learned-sinks": (dict(causal=True), True),
    "window-sinks": (dict(window=(6, 0), sink_tokens=2), True),
    "softcap": (dict(causal=True, softcap=1.5), False),                  # through the ring
    "window-softcap": (dict(causal=True, window=(5, 0), softcap=0.7), True),  # through the halo exchange
}


@pytest.mark.parametrize("world, layout, n_local, pattern, learned_sinks, heads, value_dim", grid(
    {"2ranks": (2,), "4ranks": (4,)},
    {"contiguous": ("contiguous", 7), "zigzag": ("zigzag", 10)},   # zigzag: chunks of 5
    PATTERNS,
    {"gqa": ((4, 2), 8), "mha": ((2, 2), 8), "mqa-dv12": ((3, 1), 12)}))   # value head dim 12, q/k 8
def test_matches_whole_sequence(pools, world, layout, n_local, pattern, learned_sinks, heads, value_dim):
    for rank, result in enumerate(_values(pools(world).run(
            "attention", layout=layout, n_local=n_local, heads=heads, value_dim=value_dim, pattern=pattern,
            learned_sinks=learned_sinks))):
        for name, error in result["errors"].items():
            assert error <= EXACT, f"rank {rank}: {name} error {error:.3g}"


@pytest.mark.parametrize("world", [2, 4], ids=["2ranks", "4ranks"])
@pytest.mark.parametrize("pattern, learned_sinks", [PATTERNS[p] for p in ("window", "sink-tokens", "window-sinks")],
                         ids=["window", "sink-tokens", "window-sinks"])
def test_zigzag_batch_of_one(pools, world, pattern, learned_sinks):
    """Batch 1 under zigzag: a rank's two chunks run their own calls, and their halo calls, as one call each
    over a batch-of-two view (separate calls where the chunks' patterns differ: rank 0's first chunk holds
    the sink tokens and has no halo); as exact."""
    for rank, result in enumerate(_values(pools(world).run(
            "attention", layout="zigzag", n_local=10, heads=(4, 2), batch=1, pattern=pattern,
            learned_sinks=learned_sinks))):
        for name, error in result["errors"].items():
            assert error <= EXACT, f"rank {rank}: {name} error {error:.3g}"


@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU tier: the interpreter (GPUs run test_two_gpus)")
@pytest.mark.parametrize("layout, pattern, learned_sinks", [
    ("zigzag", dict(causal=True), True), ("contiguous", dict(causal=True, window=(5, 0), sink_tokens=2), True),
    ("zigzag", dict(causal=True, window=(5, 0)), True)],
    ids=["ring", "halo", "halo-zigzag"])
def test_triton_kernels(pools, layout, pattern, learned_sinks):
    """The exchanges feed the Triton kernels (here under the interpreter) their strided slices: float32
    against the float64 whole sequence, within the float32 bar (relative error below 1e-4)."""
    for rank, result in enumerate(_values(pools(2).run(
            "attention", layout=layout, n_local=16, heads=(2, 1), head_dim=16, value_dim=16, batch=1,
            pattern=pattern, learned_sinks=learned_sinks, dtype="float32", backend="triton"))):
        for name, error in result["errors"].items():
            assert error < 1e-4, f"rank {rank}: {name} error {error:.3g}"


def _kv_bytes(rows, batch=2, kv_heads=2, head_dim=8, itemsize=8):
    """Bytes of ``rows`` keys and their values (float64 K and V)."""
    return rows * batch * kv_heads * 2 * head_dim * itemsize


def test_window_moves_only_the_halo(pools):
    """Contiguous shards, window (3, 0): rank 0 sends its last 3 keys forward (the backward keeps them) and
    rank 1 returns their gradients; nothing else moves."""
    results = _values(pools(2).run("attention", layout="contiguous", n_local=8, heads=(4, 2),
                                   pattern=dict(causal=True, window=(3, 0)), learned_sinks=False))
    assert [(r["sent_forward"], r["sent_backward"]) for r in results] == [(_kv_bytes(3), 0), (0, _kv_bytes(3))]


def test_sink_tokens_are_sent_once(pools):
    """Four contiguous ranks, window (2, 0), 3 sink tokens: rank 0 sends its 2-key halo plus the sinks to
    rank 1 and the sinks alone to ranks 2 and 3; ranks 1 and 2 send their halos."""
    results = _values(pools(4).run("attention", layout="contiguous", n_local=8, heads=(4, 2),
                                   pattern=dict(causal=True, window=(2, 0), sink_tokens=3), learned_sinks=False))
    assert [r["sent_forward"] for r in results] == [_kv_bytes(2 + 3 + 3 + 3), _kv_bytes(2), _kv_bytes(2), 0]


def test_ring_traffic(pools):
    """Full causal over 2 ranks: each rank's K/V go round once per pass, and the backward's dK/dV
    accumulators (float32, here float64) make P hops home."""
    results = _values(pools(2).run("attention", layout="zigzag", n_local=8, heads=(4, 2),
                                   pattern=dict(causal=True), learned_sinks=False))
    assert [(r["sent_forward"], r["sent_backward"]) for r in results] == [(_kv_bytes(8), 3 * _kv_bytes(8))] * 2


ERRORS = {  # id: (keywords of every rank, per-rank keywords, exception, words of its message)
    "layout": (dict(layout="diagonal"), None, ValueError, "layout must be one of"),
    "zigzag-odd": (dict(layout="zigzag", n_local=7), None, ValueError, "must be even"),
    "unequal-shards": (dict(layout="contiguous"), [dict(n_local=8), dict(n_local=6)], ValueError,
                       "disagree on local sequence length: [8.0, 6.0]"),
    "mismatched-window": (dict(causal=True), [dict(window=(3, 0)), dict(window=(4, 0))], ValueError,
                          "disagree on window left"),
    "mismatched-layout": ({}, [dict(layout="zigzag"), dict(layout="contiguous")], ValueError,
                          "disagree on layout: ['zigzag', 'contiguous']"),
    "right-window": (dict(window=(2, 3)), None, ValueError, "causal sliding windows (left, 0)"),
    "cross-attention": (dict(q_len=4), None, ValueError, "the same tokens"),
}


@pytest.mark.parametrize("name", ERRORS)
def test_bad_input_raises_on_every_rank(pools, name):
    keywords, per_rank, exc, words = ERRORS[name]
    for status, value in pools(2).run("call", per_rank=per_rank, **keywords):
        assert status == "raised" and value[0] == exc.__name__ and words in value[1], value


def test_shard_sequence_needs_equal_parts(pools):
    for status, value in pools(2).run("shard", length=10, layout="zigzag"):
        assert status == "raised" and "must be a multiple of 4" in value[1], value
    assert [v for _, v in pools(2).run("shard", length=12, layout="zigzag")] == [(1, 6), (1, 6)]


def test_needs_an_initialised_group():
    q = torch.randn(1, 2, 4, 8)
    with pytest.raises(RuntimeError, match="init_process_group"):
        gd.context_parallel_attention(q, q, q, causal=True)


@pytest.mark.parametrize("world, layout, seqlen", [
    (2, "zigzag", 32), pytest.param(4, "contiguous", 40, marks=pytest.mark.slow)])
def test_transformers_context_manager(pools, world, layout, seqlen):
    """A tiny GPT-OSS (sliding window and full causal layers, learned sinks) trained for 2 steps under
    ``context_parallel``: loss and every gradient as the unsharded model's on the whole sequence."""
    for report in _values(pools(world).run("train_example", steps=2, seqlen=seqlen, layout=layout)):
        for row in report:
            assert row["loss_error"] < 1e-4 and row["grad_error"] < 1e-4 and not row["missing_grads"], row


def _torchrun(args, timeout=600):
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"), CUDA_VISIBLE_DEVICES="")
    return subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", *args],
                          capture_output=True, text=True, timeout=timeout, env=env, cwd=ROOT, check=False)


@pytest.mark.slow
def test_example_under_torchrun():
    result = _torchrun(["examples/context_parallel_train.py", "--steps", "2"])
    assert result.returncode == 0, result.stdout + result.stderr
    assert "match the whole-sequence run" in result.stdout


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices")
@pytest.mark.parametrize("layout", ["zigzag", "contiguous"])
@pytest.mark.parametrize("pattern", [dict(causal=True), dict(causal=True, window=(127, 0), sink_tokens=4)],
                         ids=["causal", "window"])
def test_two_gpus(pools, layout, pattern):
    """2 NCCL ranks, bfloat16, Triton kernels, learned sinks: the correctness bar against float32 naive
    attention on the whole sequence (2x PyTorch's bfloat16 error for out, 3x for gradients)."""
    for rank, checks in enumerate(_values(pools(2, "nccl").run("attention_gpu", layout=layout, n_local=1024,
                                                              pattern=pattern))):
        for name, error, allowed in checks:
            assert error <= allowed, f"rank {rank}: {name} error {error:.3g} > {allowed:.3g}"


def test_benchmark_script_runs_on_cpu(tmp_path):
    """scripts/bench-cp under torchrun with 2 gloo ranks at a tiny size: every gstar row is timed and agrees
    with the one-device run, the window rows send only halos, and the JSON carries the world size."""
    out = tmp_path / "cp.json"
    result = _torchrun(["scripts/bench-cp", "--seqlen", "128", "--heads", "4", "--kv-heads", "2", "--head-dim", "8",
                        "--window", "5", "--warmup", "0", "--iters", "1", "--json", str(out)])
    assert result.returncode == 0, result.stdout + result.stderr
    data = json.loads(out.read_text())
    assert data["environment"]["world_size"] == 2
    rows = [r for r in data["rows"] if r["impl"].startswith("gstar")]
    assert len(rows) == 7 and all(r["time_ms"] > 0 for r in rows)
    shard_kv = 64 * 2 * 2 * 8 * 4  # bytes of one rank's K and V: 64 tokens, 2 kv heads, head dim 8, float32
    for r in rows:
        if r["impl"] == "gstar, context parallel":
            assert r["max_error"] < 1e-4, r
            moved = max(r["sent_bytes"])
            assert moved < shard_kv if "window" in r else moved >= 2 * shard_kv, r  # halos, or the ring
