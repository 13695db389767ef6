"""``gstar bench --suite fp8`` and ``--dtype fp8``: FP8 rows beside bfloat16 ones (decode steps also against an FP8
cache under bfloat16 queries), gstar checked against the oracle on the dequantised inputs, every other
implementation n/a, forward only."""

import dataclasses
import json

import pytest
import torch

from gstar.lab.bench import cases, measure
from gstar.lab.bench.cases import Case, for_cpu, suite
from gstar.lab.cli.main import main


def test_fp8_suite_pairs_each_case_with_bf16():
    fp8 = suite("fp8")
    layers, steps = [c for c in fp8 if not c.decode], [c for c in fp8 if c.decode]
    assert [c.dtype for c in layers] == ["bfloat16", "fp8"] * (len(layers) // 2)
    assert [c.dtype for c in steps] == ["bfloat16", "fp8", "fp8-cache"] * (len(steps) // 3)
    shapes = {(c.batch, c.heads, c.kv_heads, c.seqlen, c.head_dim, c.queries) for c in fp8}
    assert shapes == {(4, 16, 16, 8192, 128, 0), (2, 64, 8, 4096, 64, 0), (1, 64, 8, 131072, 64, 1),
                      (8, 64, 8, 32768, 64, 1), (64, 64, 8, 32768, 64, 1)}
    assert {c.page_size for c in steps if c.batch == 64} == {cases.DECODE_PAGE}  # the serving step, paged
    assert all(c.page_size == 0 for c in steps if c.batch < 64)
    assert all(c.fp8 == (c.dtype != "bfloat16") for c in fp8)
    assert all(for_cpu(c).dtype == c.dtype for c in fp8 if c.fp8)  # a CPU keeps FP8 (the PyTorch path)
    assert fp8[1].label.endswith("fp8") and steps[2].label.endswith("fp8 cache")


def test_fp8_cache_case():
    """An FP8 cache under bfloat16 queries: decode cases only; q bfloat16 without a descale, k and v FP8; its
    bytes count the queries at two bytes and the cache at one."""
    with pytest.raises(ValueError, match="is for decode cases"):
        Case("fp8", 1, 4, 2, 64, 16, dtype="fp8-cache")
    case = Case("fp8", 2, 4, 2, 40, 16, causal=True, queries=3, dtype="fp8-cache")
    inputs = measure.make_inputs(case, torch.device("cpu"))
    assert inputs["q"].dtype == torch.bfloat16 and inputs["q_descale"] is None
    assert inputs["k"].dtype == inputs["v"].dtype == torch.float8_e4m3fn
    deq = measure.dequantized(case, inputs)
    torch.testing.assert_close(deq["q"], inputs["q"].float(), rtol=0, atol=0)
    fp8 = dataclasses.replace(case, dtype="fp8")
    assert case.bytes_moved("fwd") - fp8.bytes_moved("fwd") == case.tokens * case.heads * case.head_dim


def test_fp8_inputs_dequantise_to_their_values():
    case = Case("fp8", 2, 4, 2, 33, 16, causal=True, dtype="fp8")
    inputs = measure.make_inputs(case, torch.device("cpu"))
    assert inputs["q"].dtype == torch.float8_e4m3fn and inputs["q_descale"].shape == (2, 2)
    assert inputs["k_descale"].shape == (2, 2) and inputs["v_descale"].shape == (2, 2)
    deq = measure.dequantized(case, inputs)
    for name, heads in (("q", 4), ("k", 2), ("v", 2)):
        scale = inputs[f"{name}_descale"].repeat_interleave(heads // 2, dim=1)[:, :, None, None]
        torch.testing.assert_close(deq[name], inputs[name].float() * scale)


def test_fp8_suite_runs(monkeypatch, tmp_path, capsys):
    small = [Case("fp8", 1, 64, 8, 512, 64, causal=True, window=w, sinks=True, dtype=d)
             for w in ((-1, -1), (127, 0)) for d in ("bfloat16", "fp8")]
    small += [Case("fp8", 2, 64, 8, 1024, 64, causal=True, sinks=True, queries=1, dtype=d)
              for d in ("fp8", "fp8-cache")]
    small += [Case("fp8", 3, 64, 8, 300, 64, causal=True, sinks=True, queries=1, lengths=(300, 65, 129),
                   page_size=cases.DECODE_PAGE, dtype=d) for d in ("fp8", "fp8-cache")]
    monkeypatch.setitem(cases.SUITES, "fp8", lambda: small)
    monkeypatch.setattr(measure, "CPU_BUDGET_S", 0.0)
    path = tmp_path / "fp8.json"
    assert main(["bench", "--suite", "fp8", "--impls", "gstar,gstar-prefill,eager", "--json", str(path)]) == 0
    rows = json.loads(path.read_text())["rows"]
    fp8 = [r for r in rows if r["case"]["dtype"] == "fp8"]
    assert [(r["impl"], r["status"]) for r in fp8 if r["impl"] != "eager"] == \
        [("gstar", "ok"), ("gstar", "ok"), ("gstar", "ok"), ("gstar-prefill", "ok"), ("gstar", "ok"),
         ("gstar-prefill", "n/a")]  # a paged cache: the KV-cache call only
    assert all(r["checks"] and all(c["ok"] for c in r["checks"]) for r in fp8 if r["status"] == "ok")
    assert {r["reason"] for r in fp8 if r["impl"] == "eager"} == {"no FP8 inputs"}
    cache = [r for r in rows if r["case"]["dtype"] == "fp8-cache"]  # bfloat16 queries: the KV-cache call only
    assert [(r["impl"], r["status"]) for r in cache] == \
        [("gstar", "ok"), ("gstar-prefill", "n/a"), ("eager", "n/a")] * 2  # contiguous, paged
    assert all(r["checks"] and all(c["ok"] for c in r["checks"]) for r in cache if r["status"] == "ok")
    assert main(["bench", "--suite", "fp8", "--mode", "fwd+bwd"]) == 2
    assert "forward only" in capsys.readouterr().err
    assert main(["bench", "--seqlen", "40", "--heads", "2", "--dtype", "fp8", "--mode", "fwd+bwd", "--impls",
                 "gstar", "--json", str(path)]) == 0
    assert json.loads(path.read_text())["rows"][0]["reason"] == "FP8 inputs are forward only"


def test_fp8_compute_floor_counts_the_fp8_rate():
    """An FP8 row's compute floor is the bfloat16 row's at twice the rate (FP8 tensor cores); memory floors
    follow the bytes (half for q, k, v)."""
    from gstar.lab.cli.bench import _add_floors
    card = {"matmul_tflops": 500.0, "memory_gbps": 3000.0}
    rows = {}
    for dtype in ("bfloat16", "fp8"):
        rows[dtype] = {"time_ms": 1.0}
        _add_floors(rows[dtype], Case("fp8", 4, 16, 16, 8192, 128, causal=True, dtype=dtype), "fwd", card)
    assert rows["fp8"]["compute_floor_ms"] == pytest.approx(rows["bfloat16"]["compute_floor_ms"] / 2)
    assert rows["fp8"]["memory_floor_ms"] < rows["bfloat16"]["memory_floor_ms"]
