"""``gstar bench --suite serving``: the mixed step's cases (counts, caches, labels), its floors against a brute
force count, the oracle of packed queries, every adapter that runs on a CPU checked against it on the suite
shrunk for a CPU, and the suite end to end. FA4 and FlashInfer run on a GPU only."""

import dataclasses
import importlib.util
import inspect
import json

import pytest
import torch

from gstar import naive_attention
from gstar.kvcache import flash_attention_with_kvcache
from gstar.lab.bench import cases, measure
from gstar.lab.bench.cases import (
    DECODE_PAGE,
    FORWARD_ONLY,
    SERVING_CHUNK,
    SERVING_CHUNKS,
    SERVING_DECODES,
    SERVING_DRAFTS,
    SERVING_LEAST,
    SERVING_MOST,
    Case,
    for_cpu,
    mixed_case,
    suite,
)
from gstar.lab.bench.peers import (
    FA4,
    FLASHINFER_NA,
    NO_PACKED_QUERIES,
    Eager,
    Fla,
    FlashInfer,
    Flex,
    Gstar,
    GstarPrefill,
    Peer,
    Sdpa,
)
from gstar.lab.bench.runner import run_row
from gstar.lab.cli.bench import _add_floors, timing_of
from gstar.lab.cli.main import build_parser, main
from gstar.pattern import Pattern, read_blocks

CPU = torch.device("cpu")
PACKED_QUERIES = "cu_seqlens_q" in inspect.signature(flash_attention_with_kvcache).parameters
needs_packed_queries = pytest.mark.skipif(not PACKED_QUERIES,
                                          reason="flash_attention_with_kvcache without cu_seqlens_q")


def parse(*argv):
    return build_parser().parse_args(["bench", *argv])


def test_serving_suite_follows_the_design():
    """GPT-OSS heads over pages of 64 keys, both layer patterns; per pattern the mixed step (4 chunks of 2048
    then 60 decodes), its chunks, its decodes and a speculative step of 4 queries on each of its caches."""
    rows = suite("serving")
    assert len(rows) == 8 and len({c.label for c in rows}) == 8
    assert all((c.heads, c.kv_heads, c.head_dim, c.dtype, c.sinks, c.causal, c.page_size, c.mixed) ==
               (64, 8, 64, "bfloat16", True, True, DECODE_PAGE, True) for c in rows)
    assert [c.window for c in rows] == [(-1, -1)] * 4 + [(127, 0)] * 4
    step, chunks, decodes, drafts = rows[:4]
    assert step.query_lengths == (SERVING_CHUNK,) * SERVING_CHUNKS + (1,) * SERVING_DECODES == (2048,) * 4 + (1,) * 60
    assert step.lengths == chunks.lengths + decodes.lengths == drafts.lengths and step.batch == 64
    assert chunks.query_lengths == (2048,) * 4 and decodes.query_lengths == (1,) * 60
    assert drafts.query_lengths == (SERVING_DRAFTS,) * 64 and SERVING_DRAFTS == 4
    assert all(SERVING_CHUNK <= n <= SERVING_MOST for n in chunks.lengths)
    assert all(SERVING_LEAST <= n <= SERVING_MOST == 32768 for n in decodes.lengths) and SERVING_LEAST == 1024
    assert len(set(step.lengths)) == 64 and step.seqlen == max(step.lengths)
    assert (step.queries, step.tokens, decodes.queries) == (2048, 4 * 2048 + 60, 1)
    assert step.label == f"B64 N{min(step.lengths)}..{max(step.lengths)} Nq4x2048+60x1 H64/8 D64 causal +sinks " \
                         "bf16 paged 64"
    assert rows[4].label.endswith("Nq4x2048+60x1 H64/8 D64 window (127,0) +sinks bf16 paged 64")
    assert suite("serving") == rows  # fixed: seeded lengths
    assert "serving" in FORWARD_ONLY and not any(c.mixed for c in suite("all"))
    assert parse("--suite", "serving").suite == "serving"
    assert timing_of(parse("--suite", "serving"), cuda=True) == "graph"


def test_serving_suite_shrinks_for_a_cpu():
    """The first 8 sequences (4 chunks of 128 queries, then decodes), caches 1/16 as long but never shorter
    than their queries; 1 to 16 queries kept as they are."""
    for c in suite("serving"):
        small = for_cpu(c)
        assert small.mixed and small.paged and small.dtype == "float32" and small.heads == 8
        assert small.query_lengths == tuple(nq if nq <= 16 else nq // 16 for nq in c.query_lengths[:8])
        assert all(nq <= n <= small.seqlen for nq, n in zip(small.query_lengths, small.lengths))
        assert small.window == ((-1, -1) if c.window == (-1, -1) else (15, 0))
    assert for_cpu(suite("serving")[0]).query_lengths == (128,) * 4 + (1,) * 4


def test_a_mixed_step_is_checked_when_built():
    with pytest.raises(ValueError, match="query count per cache"):
        Case("t", 2, 4, 2, 64, 16, lengths=(64, 8), query_lengths=(1, 9), queries=9)  # 9 queries, 8 keys
    with pytest.raises(ValueError, match="query count per cache"):
        Case("t", 2, 4, 2, 64, 16, lengths=(64, 8), query_lengths=(4, 1), queries=1)  # queries not the longest
    c = mixed_case("t", (64, 8, 30), (4, 0, 30), heads=4, kv_heads=2, head_dim=16, causal=True, page_size=16)
    assert (c.batch, c.seqlen, c.queries, c.tokens, c.query_offsets()) == (3, 64, 30, 34, [0, 4, 4, 34])
    assert c.decode and not c.packed and Case.from_dict(c.as_dict()) == c


def _by_hand(case: Case) -> tuple[int, int]:
    """``(pairs, keys read)`` of a mixed step, brute force: each sequence's mask of its own queries and keys; the
    keys read are those some query sees inside the pages gstar's kernels read (every one of them lies there)."""
    pairs = keys = 0
    for n, nq in zip(case.lengths, case.query_lengths):
        p = Pattern.make(nq, n, causal=case.causal, window=case.window, sink_tokens=case.sink_tokens)
        seen = p.mask().any(0)                                           # (n,) keys some query sees
        pages = read_blocks(p, case.page_size) if nq else []
        in_pages = torch.zeros(n, dtype=torch.bool)
        for j in pages:
            in_pages[j * case.page_size:(j + 1) * case.page_size] = True
        assert not (seen & ~in_pages).any()
        pairs += int(p.mask().sum())
        keys += int((seen & in_pages).sum())
    return case.heads * pairs, keys


@pytest.mark.parametrize("pattern", [{"causal": True}, {"causal": True, "window": (5, 0)},
                                     {"causal": True, "window": (3, 0), "sink_tokens": 2}], ids=str)
def test_floors_of_a_tiny_mixed_step(pattern):
    """FLOPs over the visible pairs and bytes of the keys read (plus q, out and LSE) by brute force; the row's
    floors on a card of 100 TFLOP/s and 1000 GB/s are those counts over those rates."""
    case = mixed_case("t", (40, 17, 70, 5, 33), (16, 1, 0, 4, 1), heads=4, kv_heads=2, head_dim=16,
                      page_size=16, dtype="bfloat16", **pattern)
    pairs, keys = _by_hand(case)
    assert case.visible_pairs() == pairs and case.visible_keys() == keys
    assert case.flops("fwd") == 2 * (16 + 16) * pairs
    q_out_lse = 2 * 2 * case.tokens * 4 * 16 + 4 * case.tokens * 4
    assert case.bytes_moved("fwd") == 2 * 2 * keys * 2 * 16 + q_out_lse
    row = {"time_ms": 1.0}
    _add_floors(row, case, "fwd", {"matmul_tflops": 100.0, "memory_gbps": 1000.0})
    assert row["compute_floor_ms"] == pytest.approx(case.flops("fwd") / 100e9)
    assert row["memory_floor_ms"] == pytest.approx(case.bytes_moved("fwd") / 1000e6)
    assert row["bound"] == ("compute" if row["compute_floor_ms"] > row["memory_floor_ms"] else "memory")


def test_the_serving_floors():
    """The mixed step's full-causal layer is compute-bound on an H100 (its chunks' 2.7 TFLOPs), its window
    layer and the decodes alone memory-bound."""
    card = {"matmul_tflops": 700.0, "memory_gbps": 3000.0}
    step, _, decodes, _, window_step = suite("serving")[:5]
    floors = {}
    for c in (step, decodes, window_step):
        row = {"time_ms": 1.0}
        _add_floors(row, c, "fwd", card)
        floors[c.label] = row["bound"]
    assert list(floors.values()) == ["compute", "memory", "memory"]
    assert decodes.visible_keys() == sum(decodes.lengths)
    assert window_step.visible_keys() == sum(min(n, nq + 127) for n, nq in zip(step.lengths, step.query_lengths))


def test_oracle_of_packed_queries():
    """Each sequence's rows of the packed queries against its own keys, one naive call each; a sequence
    without queries adds no rows."""
    c = mixed_case("t", (50, 9, 30, 12), (7, 1, 0, 12), heads=8, kv_heads=4, head_dim=16, causal=True,
                   window=(6, 0), sinks=True, dtype="float32")
    inputs = measure.make_inputs(c, CPU)
    assert inputs["q"].shape == (20, 8, 16) and inputs["dout"].shape == (20, 8, 16)
    assert inputs["k"].shape == (4, 4, 50, 16)
    got = measure.naive_reference(c, inputs, torch.float64, grads=False)["out"]    # (total_q, Hq, Dv)
    starts = c.query_offsets()
    for b, n in enumerate(c.lengths):
        q = inputs["q"][starts[b]:starts[b + 1]].transpose(0, 1)[None].double()  # (1, Hq, nq, D)
        if not q.shape[2]:
            continue
        want, _ = naive_attention(q, inputs["k"][b:b + 1, :, :n].double(), inputs["v"][b:b + 1, :, :n].double(),
                                  causal=True, window=(6, 0), sinks=inputs["sinks"].double())
        torch.testing.assert_close(got[starts[b]:starts[b + 1]], want[0].transpose(0, 1), rtol=1e-12, atol=1e-12)


class _PerSequence(Peer):
    """gstar's kvcache entry point one sequence at a time (its (1, Hq, nq, D) queries), the step's pages as they
    are: what a mixed step computes, without packed queries."""

    name = "per-sequence"

    def build(self, case, device):
        starts, table, lengths = case.query_offsets(), case.block_table(device), case.cache_seqlens(device)
        kw = {"causal": case.causal, "window": case.window, "sink_tokens": case.sink_tokens}

        def fn(q, k, v, sinks):
            outs = [flash_attention_with_kvcache(q[starts[b]:starts[b + 1]].transpose(0, 1)[None], k, v,
                                                 cache_seqlens=lengths[b:b + 1], block_table=table[b:b + 1],
                                                 sinks=sinks, **kw)[0].transpose(0, 1)
                    for b in range(case.batch) if starts[b + 1] > starts[b]]
            return torch.cat(outs)                                       # (total_q, Hq, Dv)
        return fn


class _Shifted(_PerSequence):
    """Wrong on purpose: every sequence's queries one position early (its last key unseen)."""

    name = "shifted"

    def build(self, case, device):
        shorter = dataclasses.replace(case, lengths=tuple(max(nq, n - 1) for n, nq in
                                                          zip(case.lengths, case.query_lengths)))
        return super().build(shorter, device)


def _some(case: Case, keep) -> Case:
    """``case`` with only the sequences ``keep``."""
    lengths, counts = (tuple(t[i] for i in keep) for t in (case.lengths, case.query_lengths))
    return dataclasses.replace(case, batch=len(keep), seqlen=max(lengths), lengths=lengths, query_lengths=counts,
                               queries=max(counts))


# the mixed step shrunk for a CPU, full causal and window: its first chunk and three decodes (seconds a row)
SHRUNK = [_some(for_cpu(c), (0, 4, 5, 6)) for c in suite("serving")[::4]]


@pytest.mark.parametrize("case", SHRUNK, ids=lambda c: c.label)
def test_serving_rows_check_before_timing(case, monkeypatch):
    """On the shrunk mixed step: gstar (packed queries, once flash_attention_with_kvcache takes them), eager
    (each sequence on its gathered pages) and gstar one sequence at a time pass the bar; a peer off by one
    position is WRONG; the rest are n/a with their reason."""
    monkeypatch.setattr(measure, "CPU_BUDGET_S", 0.0)
    monkeypatch.setattr(measure, "CPU_RUNS", (2, 2))
    inputs = measure.make_inputs(case, CPU)
    ref, pt = measure.references(case, inputs, grads=False)
    assert ref["out"].shape == (case.tokens, case.heads, case.dv) and pt is None
    for peer in (Eager(), _PerSequence()) + ((Gstar(),) if PACKED_QUERIES else ()):
        row = run_row(peer, case, "fwd", inputs, ref, pt, CPU)
        assert row["status"] == "ok" and row["time_ms"] > 0, row
    assert run_row(_Shifted(), case, "fwd", inputs, ref, pt, CPU)["status"] == "WRONG"
    assert run_row(GstarPrefill(), case, "fwd", inputs, ref, pt, CPU)["reason"] == "no paged cache"
    for peer in (Flex(), FA4(), Fla(), Sdpa("flash")):
        assert run_row(peer, case, "fwd", inputs, ref, pt, CPU)["reason"] == "needs CUDA"
    if not _flashinfer():
        assert run_row(FlashInfer(), case, "fwd", inputs, ref, pt, CPU)["reason"] == FLASHINFER_NA
    assert run_row(Eager(), case, "fwd+bwd", inputs, ref, pt, CPU)["reason"] == "a decode step is forward only"


def _flashinfer() -> bool:
    return importlib.util.find_spec("flashinfer") is not None


def test_peers_say_why_they_cannot_run_a_mixed_step():
    paged = SHRUNK[0]
    contiguous = dataclasses.replace(paged, page_size=0)
    assert Flex().unsupported(paged, CPU, "fwd") == "no paged cache"
    assert Flex().unsupported(contiguous, CPU, "fwd") == NO_PACKED_QUERIES
    assert Fla().unsupported(paged, CPU, "fwd") == NO_PACKED_QUERIES
    assert Sdpa("cudnn").unsupported(paged, CPU, "fwd") == "no learned sinks"
    assert GstarPrefill().unsupported(contiguous, CPU, "fwd") == "one key length for the whole batch"
    assert Eager().unsupported(paged, CPU, "fwd") is None
    assert FlashInfer().unsupported(paged, CPU, "fwd") == "fp16/bf16 only"
    assert FlashInfer().applies(paged) and not FlashInfer().applies(suite("gpt-oss")[0])
    if not _flashinfer():
        assert FlashInfer().unavailable(CPU) == FLASHINFER_NA
        decode = for_cpu(suite("decode")[0])
        assert run_row(FlashInfer(), decode, "fwd", {}, {}, None, CPU)["reason"] == FLASHINFER_NA


def test_eager_weighs_the_largest_sequence(monkeypatch):
    """Eager runs a mixed step sequence by sequence: its memory is the largest sequence's, ~33 GiB for a chunk
    of 2048 queries on ~30k keys, which an 80 GB card runs but not twice over in a CUDA graph."""
    from gstar.lab.bench import peers
    monkeypatch.setattr(peers, "_free_bytes", lambda device: 75 << 30)
    step = suite("serving")[0]
    assert Eager().unsupported(step, CPU, "fwd") is None
    assert Eager().uncapturable(step, CPU, "fwd").startswith("OOM-risk: ~")


@needs_packed_queries
def test_serving_suite(monkeypatch, tmp_path, capsys):
    """``--suite serving`` end to end (on a CPU at reduced shapes, eager-timed): the gstar rows checked and
    timed, their cases saved with their query counts; only the forward mode."""
    small = [mixed_case("serving", (300, 1024, 17, 640), (256, 1, 1, 4), causal=True, window=w,
                        page_size=DECODE_PAGE, heads=64, kv_heads=8, head_dim=64, sinks=True)
             for w in ((-1, -1), (127, 0))]
    monkeypatch.setitem(cases.SUITES, "serving", lambda: small)
    monkeypatch.setattr(measure, "CPU_BUDGET_S", 0.0)
    path, csv = tmp_path / "serving.json", tmp_path / "serving.csv"
    assert main(["bench", "--suite", "serving", "--impls", "gstar,eager,fa4,flashinfer", "--json", str(path),
                 "--csv", str(csv)]) == 0
    data = json.loads(path.read_text())
    assert data["suite"] == "serving" and data["complete"]
    gstar = [r for r in data["rows"] if r["impl"] == "gstar"]
    assert len(gstar) == 2 and all(r["status"] == "ok" and r["time_ms"] > 0 for r in gstar), gstar
    cpu = not torch.cuda.is_available()
    assert Case.from_dict(gstar[0]["case"]) == (for_cpu(small[0]) if cpu else small[0])
    assert "query_lengths" in csv.read_text().splitlines()[0]
    assert main(["bench", "--suite", "serving", "--mode", "fwd+bwd"]) == 2
    assert "forward only" in capsys.readouterr().err
