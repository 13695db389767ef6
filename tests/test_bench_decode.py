"""``gstar bench --suite decode``: the decode cases (shapes, pages, floors, FLOPs), the oracle of caches of
unequal lengths, every adapter that runs on a CPU checked against it, and the suite end to end at reduced
shapes. The FA4 and fla rows and compiled FlexAttention run on a GPU only (``test_gpu_decode_peers_agree_with_the_oracle``)."""

import dataclasses
import itertools
import json

import pytest
import torch

from gstar import naive_attention
from gstar.lab.bench import cases, measure
from gstar.lab.bench.cases import DECODE_PAGE, DECODE_SHAPES, Case, cache_lengths, for_cpu, suite
from gstar.lab.bench.peers import FA4, Eager, Flex, Fla, Gstar, GstarPrefill, Peer, Sdpa, flex_block_mask, flex_with_sinks
from gstar.lab.bench.report import markdown_table
from gstar.lab.bench.runner import run_row
from gstar.lab.cli.bench import timing_of
from gstar.lab.cli.main import build_parser, main
from gstar.pattern import Pattern

CPU = torch.device("cpu")
PATTERNS = [dict(causal=True), dict(causal=True, window=(5, 0)), dict(window=(3, 2)), dict(),
            dict(causal=True, window=(4, 0), sink_tokens=3), dict(window=(0, 0), sink_tokens=9)]


def parse(*argv):
    return build_parser().parse_args(["bench", *argv])


def test_decode_suite_follows_the_design():
    """The table's batch x cache lengths and GPT-OSS heads, both layer patterns, one query; each case again in
    pages of DECODE_PAGE keys; the GPT-OSS-20B step of 64 sequences of unequal lengths, in both layouts (the
    latent decode rows that follow them: tests/test_bench_latent.py)."""
    dec = [c for c in suite("decode") if not c.latent]
    assert suite("decode")[:len(dec)] == dec
    assert all((c.heads, c.kv_heads, c.head_dim, c.dtype, c.sinks, c.causal, c.queries) ==
               (64, 8, 64, "bfloat16", True, True, 1) for c in dec)
    contiguous = [c for c in dec if not c.paged]
    assert [c.page_size for c in dec if c.paged] == [DECODE_PAGE] * len(contiguous)
    assert [dataclasses.replace(c, page_size=0) for c in dec if c.paged] == contiguous
    table = [c for c in contiguous if not c.lengths]
    assert {(c.batch, c.seqlen) for c in table} == set(DECODE_SHAPES) == \
        {(1, 131072), (1, 8192), (8, 32768), (32, 4096)}
    assert sorted(c.window for c in table) == sorted([(-1, -1), (127, 0)] * 4)
    step = [c for c in contiguous if c.lengths]
    assert len(step) == 2 and {c.window for c in step} == {(-1, -1), (127, 0)}
    assert all(c.batch == 64 == len(c.lengths) and c.seqlen == 32768 and 1 <= min(c.lengths) for c in step)
    assert len(set(step[0].lengths)) > 1 and step[0].lengths == cache_lengths(64, 32768)
    assert not any(c.decode for c in suite("all"))  # forward only: run on its own


def test_decode_suite_shrinks_for_a_cpu():
    for c in suite("decode"):
        small = for_cpu(c)
        assert (small.queries, small.page_size, small.sinks, small.causal) == (c.queries, c.page_size, c.sinks,
                                                                              c.causal)
        assert small.dtype == "float32" and small.heads % small.kv_heads == 0 and small.seqlen <= c.seqlen // 16
        if c.lengths:
            assert small.lengths == tuple(max(1, n // 16) for n in c.lengths[:8]) and small.batch == 8
        else:
            assert small.batch == 1 and not small.lengths
    assert parse("--suite", "decode").suite == "decode"


def test_decode_floor_is_the_visible_cache():
    """bytes_moved of a decode step: every key and value some query sees, read once (the floors at
    4.8 TB/s), the queries, outputs and LSE; FLOPs over the visible pairs alone."""
    q_out_lse = 2 * (2 * 64 * 64) + 4 * 64  # one query per head: q and out in bf16, lse in float32
    floors = {(1, 131072): 0.056, (1, 8192): 0.0035, (8, 32768): 0.112, (32, 4096): 0.056}
    for c in suite("decode"):
        if c.lengths or c.latent:
            continue
        keys = c.seqlen if c.window == (-1, -1) else 128
        assert c.visible_keys() == c.batch * keys
        assert c.bytes_moved("fwd") == c.batch * (2 * 2 * 8 * keys * 64 + q_out_lse)
        assert c.flops("fwd") == 4 * c.batch * 64 * 64 * keys
        if c.window == (-1, -1):
            assert c.bytes_moved("fwd") / 4.8e9 == pytest.approx(floors[(c.batch, c.seqlen)], rel=0.01)
    step, window_step = (c for c in suite("decode") if c.lengths and not c.paged)
    assert step.visible_keys() == sum(step.lengths)
    assert window_step.visible_keys() == sum(min(n, 128) for n in step.lengths)
    assert step.bytes_moved("fwd") == 2 * 2 * 8 * 64 * sum(step.lengths) + 64 * q_out_lse


@pytest.mark.parametrize("nq", [1, 3, 16])
@pytest.mark.parametrize("pattern", PATTERNS, ids=str)
def test_decode_counts_against_the_mask(nq, pattern):
    """Pairs and keys read, brute force over each sequence's mask, for equal and unequal cache lengths."""
    lengths = (40, 17, 3)
    for c in (Case("t", 2, 4, 2, 40, 16, queries=nq, **pattern),
              Case("t", 3, 4, 2, 48, 16, queries=nq, lengths=lengths, **pattern)):
        masks = [Pattern.make(nq, n, **pattern).mask() for n in (c.lengths or (c.seqlen,) * c.batch)]
        assert c.visible_pairs() == 4 * sum(int(m.sum()) for m in masks)
        assert c.visible_keys() == sum(int(m.any(0).sum()) for m in masks)
        assert c.flops("fwd") == 4 * 16 * c.visible_pairs()
        assert c.bytes_moved("fwd") == 2 * (2 * c.batch * nq * 4 * 16 + 2 * c.visible_keys() * 2 * 16) \
            + 4 * c.batch * nq * 4


@pytest.mark.parametrize("pattern", PATTERNS, ids=str)
def test_visible_with_lengths_on_the_device(pattern):
    """Pattern.visible with a tensor of key counts: each sequence's rule on its own length."""
    p = Pattern.make(3, 30, **pattern)
    lengths = torch.tensor([30, 7, 1, 12])
    got = p.visible(torch.arange(3)[:, None], torch.arange(30)[None, :], nk=lengths.view(-1, 1, 1))
    for b, n in enumerate(lengths.tolist()):
        want = torch.zeros(3, 30, dtype=torch.bool)
        want[:, :n] = Pattern.make(3, n, **pattern).mask()
        assert torch.equal(got[b], want), (b, n)


def test_block_table_and_pages():
    """Every block of every sequence has a page of its own, shuffled; a page holds its block's keys."""
    c = Case("t", 3, 4, 2, 100, 16, causal=True, queries=1, page_size=32)
    table = c.block_table(CPU)
    assert table.shape == (3, 4) and table.dtype == torch.int32
    assert sorted(table.flatten().tolist()) == list(range(12)) and table.flatten().tolist() != list(range(12))
    assert torch.equal(table, c.block_table(CPU))  # every peer builds the same table
    x = torch.randn(3, 2, 100, 16)
    pool = c.to_pages(x)
    assert pool.shape == (12, 32, 2, 16)
    for b, j in itertools.product(range(3), range(4)):
        keys = x[b, :, j * 32:(j + 1) * 32].transpose(0, 1)                # (<=32, Hkv, D)
        assert torch.equal(pool[table[b, j], :keys.shape[0]], keys)


def test_oracle_of_unequal_caches(monkeypatch):
    """Each sequence against its own keys, equal to one naive call per sequence, also in pieces of kv heads."""
    c = Case("t", 3, 8, 4, 50, 16, causal=True, window=(6, 0), sinks=True, dtype="float32", queries=2,
             lengths=(50, 9, 2))
    inputs = measure.make_inputs(c, CPU)
    assert inputs["q"].shape == (3, 8, 2, 16) and inputs["k"].shape == (3, 4, 50, 16)
    for budget in (None, 2 * 8 * 50 * 32 + 2 * 50 * 32 * 8):  # all heads at once; one kv head per piece
        if budget:
            monkeypatch.setattr(measure, "_budget", lambda device: budget)
            monkeypatch.setattr(measure, "MIN_PIECE_ROWS", 1)
        got = measure.naive_reference(c, inputs, torch.float64, grads=False)["out"]
        for b, n in enumerate(c.lengths):
            want, _ = naive_attention(inputs["q"][b:b + 1].double(), inputs["k"][b:b + 1, :, :n].double(),
                                      inputs["v"][b:b + 1, :, :n].double(),
                                      causal=True, window=(6, 0), sinks=inputs["sinks"].double())
            torch.testing.assert_close(got[b:b + 1], want, rtol=1e-12, atol=1e-12)
    with pytest.raises(ValueError, match="forward only"):
        measure.naive_reference(c, inputs, torch.float64, grads=True)


class _AllKeys(Peer):
    """Wrong on purpose: attends the whole cache, past each sequence's length."""

    name = "all-keys"

    def unsupported(self, case, device, mode):
        return "no paged cache" if case.paged else None

    def build(self, case, device):
        kw = dict(causal=case.causal, window=case.window, sink_tokens=case.sink_tokens)
        return lambda q, k, v, sinks: naive_attention(q, k, v, sinks=sinks, **kw)[0]


DECODE_CASES = [
    Case("t", 2, 8, 2, 96, 16, causal=True, sinks=True, dtype="float32", queries=1),
    Case("t", 2, 8, 2, 96, 16, causal=True, window=(15, 0), sinks=True, dtype="float32", queries=1),
    Case("t", 2, 8, 2, 96, 16, causal=True, window=(7, 0), sink_tokens=4, sinks=True, dtype="float32", queries=3),
    Case("t", 3, 8, 2, 96, 16, causal=True, sinks=True, dtype="float32", queries=1, page_size=16),
    Case("t", 3, 8, 2, 96, 16, causal=True, window=(15, 0), sinks=True, dtype="float32", queries=1,
         lengths=(96, 20, 1)),
    Case("t", 3, 8, 2, 96, 16, causal=True, sinks=True, dtype="float32", queries=1, lengths=(96, 20, 1),
         page_size=32),
]


@pytest.mark.parametrize("case", DECODE_CASES, ids=lambda c: c.label)
def test_decode_rows_check_before_timing(case):
    """gstar (kvcache entry point), gstar-prefill and eager against the oracle on a CPU, or n/a with the
    reason; a peer that reads past the cache lengths is WRONG; the GPU-only peers say so."""
    inputs = measure.make_inputs(case, CPU)
    ref, pt = measure.references(case, inputs, grads=False)
    peers = [Gstar(), GstarPrefill(), Eager(), _AllKeys()]
    assert all(p.applies(case) for p in peers)
    rows = {p.name: run_row(p, case, "fwd", inputs, ref, pt, CPU) for p in peers}
    assert rows["gstar"]["status"] == "ok" and rows["gstar"]["time_ms"] > 0, rows["gstar"]
    dense = not case.paged and not case.lengths
    assert rows["gstar-prefill"]["status"] == ("ok" if dense else "n/a"), rows["gstar-prefill"]
    assert rows["eager"]["status"] == ("n/a" if case.paged else "ok"), rows["eager"]
    if not case.paged:
        assert rows["all-keys"]["status"] == ("WRONG" if case.lengths else "ok"), rows["all-keys"]
    for peer in (Flex(), FA4(), Fla(), Sdpa("flash")):
        assert run_row(peer, case, "fwd", inputs, ref, pt, CPU)["reason"] == "needs CUDA"
    assert run_row(Gstar(), case, "fwd+bwd", inputs, ref, pt, CPU)["reason"] == "a decode step is forward only"


def test_peers_say_why_they_cannot_run_a_decode_case():
    paged, ragged, drafts = DECODE_CASES[3], DECODE_CASES[4], DECODE_CASES[2]
    assert GstarPrefill().unsupported(paged, CPU, "fwd") == "no paged cache"
    assert GstarPrefill().unsupported(ragged, CPU, "fwd") == "one key length for the whole batch"
    assert Flex().unsupported(paged, CPU, "fwd") == "no paged cache" and Flex().unsupported(ragged, CPU, "fwd") is None
    assert Sdpa("cudnn").unsupported(paged, CPU, "fwd") == "no learned sinks"
    no_sinks = Case("t", 2, 8, 2, 96, 16, causal=True, queries=3)
    assert Sdpa("cudnn").unsupported(no_sinks, CPU, "fwd") == "is_causal aligns queries top-left"
    assert Sdpa("cudnn").unsupported(Case("t", 2, 8, 2, 96, 16, causal=True, queries=1), CPU, "fwd") is None
    assert not GstarPrefill().applies(suite("gpt-oss")[0]) and GstarPrefill().applies(drafts)


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
@pytest.mark.parametrize("case", [DECODE_CASES[1], DECODE_CASES[2], DECODE_CASES[4]], ids=lambda c: c.label)
def test_flex_mask_and_sinks_on_a_cpu(case):
    """The Flex adapter's block mask (one per sequence for unequal lengths) and its LSE fix-up for learned
    sinks, uncompiled on a CPU, against the oracle."""
    inputs = measure.make_inputs(case, CPU)
    ref, pt = measure.references(case, inputs, grads=False)
    with torch.no_grad():
        out = flex_with_sinks()(inputs["q"], inputs["k"], inputs["v"], inputs["sinks"], flex_block_mask(case, CPU))
    (check,) = measure.judge_all({"out": out}, ref, pt)
    assert check.ok, check


def test_eager_counts_its_repeated_cache(monkeypatch):
    """Eager repeats K and V for every query head: 32 GiB for the GPT-OSS-20B step, which an 80 GB card runs
    eagerly but not twice over in a CUDA graph."""
    from gstar.lab.bench import peers
    step = next(c for c in suite("decode") if c.lengths and not c.paged and c.window == (-1, -1))
    monkeypatch.setattr(peers, "_free_bytes", lambda device: 75 << 30)
    assert Eager().unsupported(step, CPU, "fwd") is None
    assert Eager().uncapturable(step, CPU, "fwd") == "OOM-risk: ~67 GiB in a CUDA graph"


def test_decode_timing_defaults_to_graph_replays_on_a_gpu():
    assert timing_of(parse("--suite", "decode"), cuda=True) == "graph"
    assert timing_of(parse("--suite", "decode"), cuda=False) == "eager"
    assert timing_of(parse("--suite", "decode", "--timing", "eager"), cuda=True) == "eager"
    assert timing_of(parse("--suite", "gpt-oss"), cuda=True) == "eager"
    assert timing_of(parse("--suite", "decode", "--seqlen", "64"), cuda=True) == "eager"  # a custom shape


def test_decode_suite(monkeypatch, tmp_path, capsys):
    """``--suite decode`` end to end (on a CPU at reduced shapes, eager-timed, the GPU peers n/a; on a GPU
    graph-timed): the gstar rows checked and timed; only the forward mode."""
    small = [Case("decode", 1, 64, 8, 512, 64, causal=True, window=w, sinks=True, queries=1, page_size=p)
             for w in ((-1, -1), (127, 0)) for p in (0, DECODE_PAGE)]
    small += [Case("decode", 4, 64, 8, 1024, 64, causal=True, sinks=True, queries=1, lengths=(1024, 300, 17, 640))]
    monkeypatch.setitem(cases.SUITES, "decode", lambda: small)
    monkeypatch.setattr(measure, "CPU_BUDGET_S", 0.0)
    path = tmp_path / "decode.json"
    assert main(["bench", "--suite", "decode", "--json", str(path)]) == 0
    cpu = not torch.cuda.is_available()
    data = json.loads(path.read_text())
    assert data["suite"] == "decode" and data["complete"]
    assert data["environment"]["timing"] == ("eager" if cpu else "graph")
    rows = data["rows"]
    assert len(rows) == len(small) * 9  # every implementation but gstar-padded and gstar-nondet (no decode rows)
    gstar = [r for r in rows if r["impl"] == "gstar"]
    assert len(gstar) == len(small) and all(r["status"] == "ok" and r["time_ms"] > 0 for r in gstar), gstar
    assert all(r["case"]["queries"] == 1 and r["case"]["heads"] == (8 if cpu else 64) for r in gstar)
    prefill = [r["status"] for r in rows if r["impl"] == "gstar-prefill"]
    assert prefill == ["ok", "n/a", "ok", "n/a", "n/a"]
    if cpu:
        assert all(r["reason"] == "needs CUDA" for r in rows if r["impl"] in ("flex", "fa4", "fla", "sdpa-flash"))
    assert main(["bench", "--suite", "decode", "--mode", "fwd+bwd"]) == 2
    assert "forward only" in capsys.readouterr().err


def test_markdown_table_prints_the_floor():
    row = {"case": {"label": "B1 N8192"}, "impl": "gstar", "status": "ok", "time_ms": 0.01,
           "memory_floor_ms": 0.0035, "compute_floor_ms": 0.0001, "bound": "memory"}
    data = {"mode": "fwd", "rows": [row, dict(row, impl="flex", status="n/a", time_ms=None)],
            "environment": {"card": "NVIDIA H200", "torch": "2.11", "triton": "3.6", "timing": "graph"}}
    lines = markdown_table(data).splitlines()
    assert lines[2:] == ["| case | gstar | flex | floor |", "|---|---|---|---|",
                         "| B1 N8192 | 0.010 | n/a | 0.0035 (memory) |"]


def test_decode_plot_draws_time_per_case(tmp_path):
    """Decode rows plot as bars per case with the memory floor (their batches differ, so no length axis)."""
    pytest.importorskip("matplotlib")
    from gstar.lab.bench.report import plot
    row = {"case": {"label": "B1 N8192", "family": "decode", "seqlen": 8192}, "series": "s", "impl": "gstar",
           "status": "ok", "time_ms": 0.01, "tflops": 1.0, "memory_floor_ms": 0.0035}
    rows = [row, dict(row, impl="flex", time_ms=0.02), dict(row, case=dict(row["case"], label="B8 N64"))]
    png = tmp_path / "decode.png"
    plot(str(png), rows, {"card": "NVIDIA H200", "torch": "2.11", "triton": "3.6", "timing": "graph"}, "fwd")
    assert png.stat().st_size > 0


@pytest.mark.gpu
@pytest.mark.parametrize("timing", ["graph", "eager"])
def test_gpu_decode_peers_agree_with_the_oracle(monkeypatch, tmp_path, timing):
    """Every decode adapter (gstar, gstar-prefill, FA4, fla, Flex, eager) against the oracle on small GPT-OSS
    decode steps, contiguous, paged and of unequal lengths: none WRONG; gstar and Flex run wherever they apply."""
    small = [Case("decode", 2, 64, 8, 2048, 64, causal=True, window=w, sinks=True, queries=1, page_size=p)
             for w in ((-1, -1), (127, 0)) for p in (0, DECODE_PAGE)]
    small += [Case("decode", 4, 64, 8, 4096, 64, causal=True, window=w, sinks=True, queries=1,
                   lengths=(4096, 300, 17, 2100)) for w in ((-1, -1), (127, 0))]
    monkeypatch.setitem(cases.SUITES, "decode", lambda: small)
    out = tmp_path / "decode.json"
    assert main(["bench", "--suite", "decode", "--timing", timing, "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert not [r for r in rows if r["status"] in ("WRONG", "error")], rows
    assert all(r["status"] == "ok" for r in rows if r["impl"] == "gstar")
    assert all(r["status"] == "ok" for r in rows if r["impl"] == "flex" and not r["case"]["page_size"])
