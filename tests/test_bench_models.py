"""``gstar bench --suite models``: logit soft-capping (Gemma 2) and chunked attention (Llama 4) in the bench:
the oracle and every adapter that runs on a CPU checked on cases with them (dense, packed, decode), the suite
end to end at reduced shapes, and each peer either expressing a rule or saying why it cannot. Compiled
FlexAttention, FA4 and fla run on a GPU only; the Flex adapter's block mask and soft-cap run uncompiled here."""

import dataclasses
import json

import pytest
import torch

from gstar import naive_attention
from gstar.lab.bench import cases, measure
from gstar.lab.bench.cases import Case, for_cpu, packed_case
from gstar.lab.bench.peers import (FA4, NO_CHUNK, NO_SOFTCAP, Eager, Fla, Gstar, GstarPadded, GstarPrefill, Sdpa,
                                   all_peers, flex_block_mask, flex_softcap, flex_with_sinks)
from gstar.lab.bench.runner import run_row
from gstar.lab.cli.main import main

CPU = torch.device("cpu")
# small cases with the models suite's rules; a cap of 5, not 50, so that leaving it out shows at these scores
DENSE = [Case("t", 1, 4, 2, 70, 16, causal=True, softcap=5.0, dtype="float32"),
         Case("t", 1, 4, 2, 70, 16, causal=True, chunk=24, dtype="float32"),
         Case("t", 1, 4, 2, 70, 16, causal=True, window=(9, 0), chunk=16, sink_tokens=2, softcap=3.0, sinks=True,
              dtype="float32"),
         Case("t", 1, 4, 2, 70, 16, chunk=16, softcap=2.0, dtype="float32")]
DECODE = Case("t", 2, 8, 2, 96, 16, causal=True, chunk=32, softcap=5.0, sinks=True, dtype="float32", queries=3,
              lengths=(96, 40))
PACKED = packed_case("t", (40, 7, 65), heads=4, kv_heads=2, head_dim=16, causal=True, chunk=16, softcap=4.0,
                     sinks=True, dtype="float32")


@pytest.fixture(autouse=True)
def _few_timed_runs(monkeypatch):
    monkeypatch.setattr(measure, "CPU_BUDGET_S", 0.0)  # the fewest timed runs: these tests check, not time


def _checked(peers, case, mode):
    inputs = measure.make_inputs(case, CPU)
    ref, pt = measure.references(case, inputs, grads=mode != "fwd")
    return {p.name: run_row(p, case, mode, inputs, ref, pt, CPU) for p in peers}


@pytest.mark.parametrize("mode", ["fwd", "fwd+bwd"])
@pytest.mark.parametrize("case", DENSE, ids=lambda c: c.label)
def test_gstar_and_eager_take_the_softcap_and_the_chunk(case, mode):
    """Against the oracle (which takes both rules), gstar and eager pass; eager without the soft-cap fails."""
    rows = _checked([Gstar(), Eager()], case, mode)
    for row in rows.values():
        assert row["status"] == "ok" and row["time_ms"] > 0, row

    class Uncapped(Eager):
        name = "uncapped"

        def build(self, case, device):
            return super().build(dataclasses.replace(case, softcap=0.0), device)
    if case.softcap and mode == "fwd":
        assert _checked([Uncapped()], case, mode)["uncapped"]["status"] == "WRONG"


def test_decode_and_packed_cases_take_them_too():
    """A decode step (chunks counted from each cache's first key, caches of unequal lengths) and packed
    documents (chunks from each document's start), against the per-cache and per-document oracles."""
    rows = _checked([Gstar(), GstarPrefill(), Eager()], DECODE, "fwd")
    assert rows["gstar"]["status"] == "ok" and rows["eager"]["status"] == "ok", rows
    assert rows["gstar-prefill"]["reason"] == "one key length for the whole batch"
    rows = _checked([Gstar(), GstarPadded()], PACKED, "fwd+bwd")
    assert all(r["status"] == "ok" for r in rows.values()), rows


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
@pytest.mark.parametrize("case", [DENSE[2], DENSE[3], DECODE], ids=lambda c: c.label)
def test_flex_mask_and_softcap_on_a_cpu(case):
    """The Flex adapter's block mask (the chunk through Pattern.visible) and soft-cap score_mod, uncompiled on a
    CPU, against the oracle; without the score_mod the same call misses the bar."""
    inputs = measure.make_inputs(case, CPU)
    ref, pt = measure.references(case, inputs, grads=False)
    flex, mask = flex_with_sinks(), flex_block_mask(case, CPU)
    with torch.no_grad():
        out = flex(inputs["q"], inputs["k"], inputs["v"], inputs["sinks"], mask, flex_softcap(case.softcap))
        uncapped = flex(inputs["q"], inputs["k"], inputs["v"], inputs["sinks"], mask)
    (check,) = measure.judge_all({"out": out}, ref, pt)
    assert check.ok, check
    assert not measure.judge_all({"out": uncapped}, ref, pt)[0].ok


def test_models_suite_end_to_end(monkeypatch, tmp_path):
    """``--suite models`` (small cases of its shapes' rules; on a CPU reduced again, the GPU peers n/a): the
    gstar and eager rows checked and timed, the rows' cases read back from the JSON as they were."""
    small = [Case("models", 1, 16, 8, 1024, 32, causal=True, window=w, softcap=cap)
             for w in ((-1, -1), (255, 0)) for cap in (5.0, 0.0)]
    small += [Case("models", 1, 40, 8, 2048, 32, causal=True, chunk=512),
              Case("models", 1, 40, 8, 2048, 32, causal=True, window=(511, 0))]
    monkeypatch.setitem(cases.SUITES, "models", lambda: small)
    path = tmp_path / "models.json"
    impls = "gstar,eager,flex,sdpa-flash,fa4,fla"
    assert main(["bench", "--suite", "models", "--mode", "fwd+bwd", "--impls", impls, "--json", str(path)]) == 0
    cpu = not torch.cuda.is_available()
    data = json.loads(path.read_text())
    assert data["suite"] == "models" and data["complete"]
    rows = data["rows"]
    ran = [for_cpu(c) for c in small] if cpu else small
    assert [Case.from_dict(r["case"]) for r in rows[::6]] == ran  # as_dict round trip
    assert [r["case"]["label"] for r in rows[::6]] == [c.label for c in ran]
    assert ran[0].label.endswith("causal +softcap 5 fp32" if cpu else "causal +softcap 5 bf16")
    assert ran[4].label.endswith("causal chunk 32 fp32" if cpu else "causal chunk 512 bf16")
    for r in rows:
        if r["impl"] in ("gstar", "eager"):
            assert r["status"] == "ok" and r["time_ms"] > 0, r
            assert {c["name"].split()[0] for c in r["checks"]} == {"out", "dq", "dk", "dv"}
        elif cpu:
            assert r["status"] == "n/a" and r["reason"] == "needs CUDA", r
    if not cpu:
        assert all(r["status"] == "ok" for r in rows if r["impl"] == "flex"), rows
        sdpa = [r["reason"] for r in rows if r["impl"] == "sdpa-flash"]
        assert sdpa[0] == NO_SOFTCAP and sdpa[4] == NO_CHUNK


def _fa4(q, k, v, softmax_scale=None, causal=False, window_size=(None, None), learnable_sink=None, softcap=0.0,
         num_splits=1, pack_gqa=None, seqused_k=None, page_table=None):
    """FA4's flash_attn_func as far as its signature goes (no flash_attn on a CPU)."""
    _fa4.kwargs = dict(softmax_scale=softmax_scale, causal=causal, window_size=window_size, softcap=softcap)
    return q.new_zeros(q.shape[:-1] + v.shape[-1:]), None


def _fa4_no_softcap(q, k, v, softmax_scale=None, causal=False, window_size=(None, None), learnable_sink=None):
    """An FA4 from before ``softcap``."""


def _fla(q, k, v, g=None, scale=None, window_size=None, cu_seqlens=None, *, sink_bias=None, **kwargs):
    """fla's parallel_attn (and, for a decode case, its decoding kernel) as far as the signatures go."""


BF16 = dict(dtype="bfloat16")
SOFTCAP = Case("t", 1, 8, 4, 256, 64, causal=True, softcap=50.0, **BF16)
CHUNK = Case("t", 1, 8, 4, 256, 64, causal=True, chunk=128, **BF16)
DECODE_SOFTCAP = Case("t", 2, 8, 4, 256, 64, causal=True, softcap=50.0, queries=1, **BF16)
DECODE_CHUNK = Case("t", 2, 8, 4, 256, 64, causal=True, chunk=128, queries=1, **BF16)
PACKED_CHUNK = packed_case("t", (100, 156), heads=8, kv_heads=4, head_dim=64, causal=True, chunk=64, softcap=50.0,
                           **BF16)
# peer -> (reason on a soft-capped case, reason on a chunked case): None where it expresses the rule
EXPECTED = {"gstar": (None, None), "gstar-padded": (None, None), "gstar-prefill": (None, None),
            "gstar-nondet": (None, None), "eager": (None, None), "flex": (None, None),
            "sdpa-flash": (NO_SOFTCAP, NO_CHUNK), "sdpa-cudnn": (NO_SOFTCAP, NO_CHUNK),
            "fa4": (None, NO_CHUNK + " (only as a CuTe DSL mask_mod)"), "fla": (NO_SOFTCAP, NO_CHUNK),
            "flashinfer": (None, NO_CHUNK)}


def test_every_peer_expresses_softcap_and_chunk_or_says_why_not(monkeypatch):
    """Each adapter of all_peers() on soft-capped and chunked cases (dense, decode, packed where it applies):
    it runs them or gives the reason; FA4 and fla through their signatures, as on a GPU."""
    monkeypatch.setattr(FA4, "_entry", lambda self, case: _fa4)
    monkeypatch.setattr(Fla, "_fn", lambda self: _fla)
    monkeypatch.setattr(Fla, "_decoding", lambda self: _fla)
    assert {p.name for p in all_peers()} == set(EXPECTED)
    for peer in all_peers():
        capped, chunked = EXPECTED[peer.name]
        mode = "fwd" if peer.name != "gstar-nondet" else "fwd+bwd"  # gstar-nondet has no forward of its own
        checked = [(c, capped) for c in (SOFTCAP, DECODE_SOFTCAP)] + [(c, chunked) for c in (CHUNK, DECODE_CHUNK)]
        checked.append((PACKED_CHUNK, capped or chunked))  # both rules (gstar and gstar-padded only)
        runs = [(case, want) for case, want in checked if peer.applies(case)]
        assert runs, peer.name
        for case, want in runs:
            assert peer.unsupported(case, CPU, mode) == want, (peer.name, case.label)
    monkeypatch.setattr(FA4, "_entry", lambda self, case: _fa4_no_softcap)
    assert FA4().unsupported(SOFTCAP, CPU, "fwd") == NO_SOFTCAP
    assert Sdpa("flash").unsupported(Case("t", 1, 8, 4, 256, 64, causal=True, **BF16), CPU, "fwd") is None


def test_fa4_gets_the_softcap():
    """FA4's build passes the case's soft-cap as ``softcap`` (and none without one)."""
    fa4 = FA4()
    fa4._entry = lambda case: _fa4
    q = torch.zeros(1, 8, 16, 64)
    kv = torch.zeros(1, 4, 16, 64)
    for cap in (50.0, 0.0):
        fa4.build(Case("t", 1, 8, 4, 16, 64, causal=True, softcap=cap, **BF16), CPU)(q, kv, kv, None)
        assert _fa4.kwargs["softcap"] == cap and _fa4.kwargs["causal"]


def test_the_oracle_takes_the_softcap_and_the_chunk():
    """naive_reference is naive_attention with the case's rules (not the same call without them)."""
    case = DENSE[2]
    inputs = measure.make_inputs(case, CPU)
    got = measure.naive_reference(case, inputs, torch.float64, grads=False)["out"]
    kw = dict(causal=True, window=case.window, sink_tokens=case.sink_tokens, sinks=inputs["sinks"].double())
    q, k, v = (inputs[n].double() for n in ("q", "k", "v"))
    want, _ = naive_attention(q, k, v, softcap=case.softcap, chunk=case.chunk, **kw)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    assert not torch.allclose(got, naive_attention(q, k, v, **kw)[0])
