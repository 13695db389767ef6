"""``gstar bench``: argument parsing, the FLOP count, the oracle, wrong peers, packed documents, the files it
writes and the markdown tables it prints."""

import csv
import dataclasses
import importlib
import itertools
import json
import sys

import pytest
import torch

from gstar import flash_attention_varlen, naive_attention
from gstar.lab.bench import cases, measure, report
from gstar.lab.bench.cases import Case, document_lengths, for_cpu, packed_case, suite
from gstar.lab.bench.peers import PEER_NAMES, Eager, Gstar, GstarNondeterministic, GstarPadded, Peer
from gstar.lab.bench.report import markdown_table
from gstar.lab.bench.runner import add_ratios, run_row
from gstar.lab.cli.bench import cases_from_args, timing_of
from gstar.lab.cli.main import build_parser, main


def parse(*argv):
    return build_parser().parse_args(["bench", *argv])


def test_defaults():
    args = parse()
    assert args.suite == "gpt-oss" and args.mode == "fwd" and args.impls == list(PEER_NAMES)
    assert args.timing is None and timing_of(args, cuda=True) == "eager"  # graph replays for decode only
    assert PEER_NAMES[0] == "gstar"
    assert cases_from_args(args, "cuda") == suite("gpt-oss")


@pytest.mark.parametrize("name", ["stages", "gpt-oss", "long", "fa", "mla", "varlen", "models", "gemma", "all"])
@pytest.mark.parametrize("mode", ["fwd", "bwd", "fwd+bwd"])
def test_suites_and_modes(name, mode):
    args = parse("--suite", name, "--mode", mode)
    assert args.suite == name and args.mode == mode
    assert cases_from_args(args, "cuda") == suite(name)


def test_bad_suite_mode_or_impl_is_a_usage_error():
    for argv in (["--suite", "huge"], ["--mode", "bwd-only"], ["--impls", "gstar,nope"], ["--window", "3"]):
        with pytest.raises(SystemExit):
            parse(*argv)


def test_impl_subset():
    assert parse("--impls", "gstar,flex").impls == ["gstar", "flex"]
    assert parse("--impls", "eager").impls == ["eager"]


def test_reference_suites_follow_the_design():
    gpt = suite("gpt-oss")
    assert {(c.batch, c.seqlen, c.heads, c.kv_heads, c.head_dim, c.dtype, c.sinks) for c in gpt} == \
        {(2, 4096, 64, 8, 64, "bfloat16", True)}
    assert {c.window for c in gpt} == {(-1, -1), (127, 0)} and all(c.causal for c in gpt)
    assert {c.seqlen for c in suite("long")} == {8192, 32768} and {c.batch for c in suite("long")} == {1}
    fa = suite("fa")
    assert {(c.batch, c.seqlen, c.heads, c.head_dim) for c in fa} == {(4, 8192, 16, 128)}
    assert {c.causal for c in fa} == {False, True}
    s7 = suite("stages")[-1]
    assert (s7.batch, s7.heads, s7.kv_heads, s7.seqlen, s7.head_dim, s7.window, s7.sink_tokens) == \
        (1, 16, 1, 4096, 16, (255, 0), 4)
    varlen = suite("varlen")
    assert {(c.heads, c.kv_heads, c.head_dim, c.dtype, c.sinks, c.causal) for c in varlen} == \
        {(64, 8, 64, "bfloat16", True, True)}
    assert {c.window for c in varlen} == {(-1, -1), (127, 0)}
    assert all(len(c.lengths) == 16 and c.tokens == 16384 and min(c.lengths) > 0 for c in varlen)
    mla = suite("mla")
    assert [(c.batch, c.seqlen, c.heads, c.kv_heads, c.head_dim, c.dv, c.causal) for c in mla] == \
        [(2, 4096, 128, 128, 192, 128, True), (1, 8192, 128, 128, 192, 128, True)]
    models = suite("models")
    gemma, llama = models[:4], models[4:]
    assert {(c.batch, c.seqlen, c.heads, c.kv_heads, c.head_dim, c.dtype, c.causal) for c in gemma} == \
        {(1, 8192, 16, 8, 256, "bfloat16", True)}
    assert [(c.window, c.softcap) for c in gemma] == [((-1, -1), 50.0), ((-1, -1), 0.0), ((4095, 0), 50.0),
                                                      ((4095, 0), 0.0)]
    assert {(c.batch, c.seqlen, c.heads, c.kv_heads, c.head_dim, c.dtype, c.causal, c.softcap) for c in llama} == \
        {(1, 16384, 40, 8, 128, "bfloat16", True, 0.0)}
    assert [(c.window, c.chunk) for c in llama] == [((-1, -1), 8192), ((8191, 0), 0)]
    assert not any(c.chunk for c in gemma) and not any(c.sinks or c.sink_tokens for c in models)
    # every case of the training suites once: the gemma suite's Gemma 2 rows at 8k are models' uncapped rows
    each = [c for n in ("gpt-oss", "long", "fa", "mla", "stages", "varlen", "models", "gemma") for c in suite(n)]
    twins = [c for c in suite("gemma") if dataclasses.replace(c, family="models") in models]
    assert [(c.seqlen, c.window) for c in twins] == [(8192, (-1, -1)), (8192, (4095, 0))]
    assert suite("all") == [c for c in each if c not in twins]


def test_a_case_by_label():
    assert cases.labelled("D128 causal") == next(c for c in suite("fa") if c.causal)  # the first that matches
    assert cases.labelled("window (127,0)").window == (127, 0) and cases.labelled("window (127,0)").seqlen == 4096
    with pytest.raises(ValueError, match="no case label contains 'D 999'; labels: B2 N4096"):
        cases.labelled("D 999")
    assert cases.labelled("causal +softcap 50").label == "B1 N8192 H16/8 D256 causal +softcap 50 bf16"
    assert cases.labelled("D256 causal bf16").softcap == 0.0  # the same layer without the cap
    assert cases.labelled("window (4095,0) +softcap").softcap == 50.0
    assert cases.labelled("chunk 8192").label == "B1 N16384 H40/8 D128 causal chunk 8192 bf16"
    assert cases.labelled("H40/8 D128 window (8191,0)").chunk == 0


def test_cpu_shrinks_suites_but_keeps_gqa():
    for c in suite("all"):
        small = for_cpu(c)
        assert small.dtype == "float32" and small.seqlen <= c.seqlen and small.tokens <= c.tokens
        assert small.batch == (len(c.lengths) if c.packed else 1)
        assert small.heads % small.kv_heads == 0 and small.sinks == c.sinks and small.causal == c.causal
        assert small.softcap == c.softcap and small.chunk == c.chunk // 16  # as many chunks a (shorter) sequence
    assert cases_from_args(parse("--suite", "fa"), "cpu") == [for_cpu(c) for c in suite("fa")]


def test_custom_shape_flags():
    args = parse("--batch", "2", "--heads", "8", "--kv-heads", "2", "--seqlen", "128", "--seqlen", "256", "512",
                 "--head-dim", "32", "--window", "63", "0", "--sink-tokens", "4", "--sinks", "--causal",
                 "--dtype", "fp16")
    got = cases_from_args(args, "cpu")  # custom shapes are taken as given, even on CPU
    assert [c.seqlen for c in got] == [128, 256, 512]
    c = got[0]
    assert (c.family, c.batch, c.heads, c.kv_heads, c.head_dim, c.window, c.sink_tokens, c.sinks, c.causal,
            c.dtype) == ("custom", 2, 8, 2, 32, (63, 0), 4, True, True, "float16")
    one = cases_from_args(parse("--seqlen", "100"), "cuda")
    assert [(c.seqlen, c.heads, c.kv_heads, c.causal, c.window) for c in one] == [(100, 16, 16, False, (-1, -1))]


def test_custom_shape_rejects_bad_gqa():
    with pytest.raises(ValueError, match="multiple"):
        cases_from_args(parse("--heads", "6", "--kv-heads", "4"), "cpu")


PATTERNS = [dict(), dict(causal=True), dict(window=(5, 0)), dict(window=(3, 2)), dict(window=(-1, 4)),
            dict(window=(7, -1)), dict(causal=True, window=(16, 0), sink_tokens=4),
            dict(window=(0, 0), sink_tokens=40), dict(causal=True, window=(200, 0)),
            dict(causal=True, chunk=16), dict(chunk=7), dict(causal=True, window=(9, 0), chunk=16, sink_tokens=3),
            dict(window=(3, 2), chunk=5, sink_tokens=2), dict(chunk=500)]


@pytest.mark.parametrize("n", [1, 17, 64, 113])
@pytest.mark.parametrize("pattern", PATTERNS, ids=str)
def test_flops_count_the_visible_pairs(n, pattern):
    case = Case("t", batch=3, heads=4, kv_heads=2, seqlen=n, head_dim=32, **pattern)
    brute = sum(1 for i, j in itertools.product(range(n), range(n)) if bool(case.pattern.visible(i, j)))
    assert brute == int(case.pattern.mask().sum())
    assert case.visible_pairs() == 3 * 4 * brute
    assert case.flops("fwd") == 4 * 3 * 4 * 32 * brute
    assert case.flops("bwd") == 2.5 * case.flops("fwd") and case.flops("fwd+bwd") == 3.5 * case.flops("fwd")
    capped = dataclasses.replace(case, softcap=30.0)  # a soft-cap changes scores, not the pairs or the bytes
    assert capped.flops("fwd") == case.flops("fwd") and capped.bytes_moved("fwd") == case.bytes_moved("fwd")


def test_flops_with_narrower_values():
    """Per visible pair: Q K^T and P V forward (2 D + 2 Dv); recomputed Q K^T, dO V^T, P^T dO, dS K, dS^T Q
    backward (6 D + 4 Dv)."""
    case = Case("t", batch=1, heads=2, kv_heads=2, seqlen=17, head_dim=192, value_dim=128, causal=True)
    pairs = case.visible_pairs()
    assert case.flops("fwd") == (2 * 192 + 2 * 128) * pairs
    assert case.flops("bwd") == (6 * 192 + 4 * 128) * pairs
    assert case.flops("fwd+bwd") == case.flops("fwd") + case.flops("bwd")


def test_bytes_moved_reads_inputs_and_writes_outputs_once():
    c = Case("t", 2, 8, 2, 100, 64, dtype="bfloat16")
    q, kv, rows = 2 * 8 * 100 * 64, 2 * 2 * 100 * 64, 2 * 8 * 100
    assert c.bytes_moved("fwd") == 2 * (2 * q + 2 * kv) + 4 * rows
    assert c.bytes_moved("fwd+bwd") == c.bytes_moved("fwd") + c.bytes_moved("bwd")
    wide = Case("t", 2, 8, 2, 100, 64, dtype="bfloat16", value_dim=32)
    q, k, v, o = 2 * 8 * 100 * 64, 2 * 2 * 100 * 64, 2 * 2 * 100 * 32, 2 * 8 * 100 * 32
    assert wide.bytes_moved("fwd") == 2 * (q + k + v + o) + 4 * rows
    assert wide.bytes_moved("bwd") == 2 * (2 * (q + k + v) + 2 * o) + 8 * rows


@pytest.mark.parametrize("pattern", [dict(causal=True, window=(9, 0), sink_tokens=3), dict(window=(6, 6)), dict(),
                                     dict(causal=True, chunk=8, sink_tokens=2, softcap=4.0), dict(chunk=8)], ids=str)
def test_oracle_in_pieces_equals_one_call(monkeypatch, pattern):
    """The oracle splits batch, kv heads and (right bound 0) query rows; pieces must add up exactly (a chunk
    makes rows depend on their position: no row pieces without a right bound of 0)."""
    case = Case("t", 2, 4, 2, 37, 16, sinks=True, dtype="float32", **pattern)
    inputs = measure.make_inputs(case, "cpu")
    monkeypatch.setattr(measure, "_budget", lambda device: 2 * 37 * 4 * 8 * 5)  # 5 rows per piece
    monkeypatch.setattr(measure, "MIN_PIECE_ROWS", 1)
    got = measure.naive_reference(case, inputs, torch.float64, grads=True)
    leaves = [inputs[n].double().requires_grad_() for n in ("q", "k", "v", "sinks")]
    out, _ = naive_attention(*leaves[:3], sinks=leaves[3], causal=case.causal, window=case.window,
                             sink_tokens=case.sink_tokens, softcap=case.softcap, chunk=case.chunk)
    grads = torch.autograd.grad(out, leaves, inputs["dout"].double())
    for name, want in zip(("out", "dq", "dk", "dv", "dsinks"), (out,) + grads):
        torch.testing.assert_close(got[name], want.detach(), rtol=1e-12, atol=1e-12)


def test_oracle_refuses_pieces_too_thin(monkeypatch, capsys):
    """Too little free memory for pieces of MIN_PIECE_ROWS rows: the oracle says so at once instead of taking
    hours, and the bench shows the case's rows as n/a and goes on to the next case."""
    case = Case("t", 1, 4, 2, 300, 16)
    monkeypatch.setattr(measure, "_budget", lambda device: 2 * 300 * 4 * 8 * 63)  # 63 rows per piece
    with pytest.raises(MemoryError, match="pieces of 64 rows, over its budget"):
        measure.naive_reference(case, measure.make_inputs(case, "cpu"), torch.float64, grads=False)
    argv = ["bench", "--heads", "4", "--kv-heads", "2", "--seqlen", "300", "40", "--head-dim", "16",
            "--impls", "gstar,eager", "--mode", "fwd"]
    assert main(argv) == 0
    progress = [line for line in capsys.readouterr().err.splitlines() if line.startswith("[")]
    assert all("n/a no reference: the oracle needs" in line for line in progress[:2]), progress
    assert all(" ok " in line for line in progress[2:]) and len(progress) == 4, progress


class _Wrong(Peer):
    """A fast wrong peer: the mask shifted by one key (a wrong alignment convention)."""

    name = "wrong"

    def build(self, case, device):
        shifted = case.pattern.mask(device).roll(1, dims=1)
        scale = case.head_dim ** -0.5
        return lambda q, k, v, sinks: torch.softmax(
            (q @ k.transpose(-1, -2) * scale).masked_fill(~shifted, float("-inf")), -1) @ v


@pytest.mark.parametrize("mode", ["fwd", "bwd", "fwd+bwd"])
def test_rows_check_before_timing(mode):
    case = Case("t", 1, 2, 2, 33, 16, causal=True, dtype="float32")
    inputs = measure.make_inputs(case, "cpu")
    ref, pt = measure.references(case, inputs, grads=mode != "fwd")
    dev = torch.device("cpu")
    rows = [run_row(p, case, mode, inputs, ref, pt, dev) for p in (Gstar(), Eager(), _Wrong())]
    add_ratios(rows)
    good, eager, wrong = rows
    assert good["status"] == "ok" and eager["status"] == "ok"
    assert wrong["status"] == "WRONG" and "out" in wrong["reason"] and wrong["time_ms"] > 0  # flagged, still timed
    assert good["vs_gstar"] == 1.0 and eager["vs_gstar"] > 0
    names = {c["name"].split()[0] for c in good["checks"]}
    assert names == ({"out"} if mode == "fwd" else {"out", "dq", "dk", "dv"})


def test_packed_case_counts_each_document():
    lengths = (5, 17, 1, 40)
    c = packed_case("t", lengths, heads=4, kv_heads=2, head_dim=16, causal=True, window=(7, 0), sink_tokens=2)
    assert (c.batch, c.seqlen, c.tokens) == (4, 40, 63) and c.packed
    per_doc = [int(Case("t", 1, 4, 2, n, 16, causal=True, window=(7, 0), sink_tokens=2).pattern.mask().sum())
               for n in lengths]
    assert c.visible_pairs() == 4 * sum(per_doc)
    assert c.bytes_moved("fwd") == 2 * (2 * 63 * 4 * 16 + 2 * 63 * 2 * 16) + 4 * 63 * 4
    assert c.cu_seqlens("cpu").tolist() == [0, 5, 22, 23, 63]
    assert c.padding_mask("cpu").sum(1).tolist() == list(lengths)
    with pytest.raises(ValueError, match="packed case"):
        Case("t", 3, 4, 2, 40, 16, lengths=lengths)
    assert sum(document_lengths(1000, 7, seed=3)) == 1000 and len(document_lengths(1000, 7, seed=3)) == 7


@pytest.mark.parametrize("pattern", [dict(causal=True), dict(causal=True, window=(6, 0), sink_tokens=2)], ids=str)
def test_packed_oracle_equals_the_padded_batch(pattern):
    """The packed oracle against an independent route: right-pad the documents into a batch (exact for rows
    that see no key right of the diagonal), one naive_attention call, gradients of zero-padded dout."""
    c = packed_case("t", (9, 30, 1, 17), heads=4, kv_heads=2, head_dim=16, sinks=True, dtype="float32", **pattern)
    inputs = measure.make_inputs(c, "cpu")
    got = measure.naive_reference(c, inputs, torch.float64, grads=True)
    mask = c.padding_mask("cpu")                                                       # (B, N)
    padded = {}
    for name in ("q", "k", "v", "dout"):
        x = inputs[name].new_zeros(c.batch, c.seqlen, *inputs[name].shape[1:])         # (B, N, H, D)
        x[mask] = inputs[name]
        padded[name] = x.transpose(1, 2).double()                                     # (B, H, N, D)
    leaves = [padded[n].requires_grad_() for n in ("q", "k", "v")] + [inputs["sinks"].double().requires_grad_()]
    out, _ = naive_attention(*leaves[:3], sinks=leaves[3], **pattern)
    grads = torch.autograd.grad(out, leaves, padded["dout"])
    want = {"out": out.detach(), "dq": grads[0], "dk": grads[1], "dv": grads[2]}
    for name, x in want.items():
        torch.testing.assert_close(got[name], x.transpose(1, 2)[mask], rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(got["dsinks"], grads[3], rtol=1e-12, atol=1e-12)


class _Leaky(Gstar):
    """Wrong on purpose on packed documents: all tokens as one sequence, so documents see each other."""

    name = "leaky"

    def build(self, case, device):
        one = torch.tensor([0, case.tokens], dtype=torch.int32, device=device)
        kw = dict(causal=case.causal, window=case.window, sink_tokens=case.sink_tokens)
        return lambda q, k, v, sinks: flash_attention_varlen(q, k, v, one, one, case.tokens, case.tokens,
                                                             sinks=sinks, **kw)


@pytest.mark.parametrize("mode", ["fwd", "fwd+bwd"])
def test_packed_rows_check_before_timing(mode):
    """The varlen suite's rows: packed and padded gstar pass the bar on every tensor, in the packed layout;
    attention that lets documents see each other is WRONG."""
    c = packed_case("t", (13, 40, 2, 25), heads=4, kv_heads=2, head_dim=16, causal=True, window=(9, 0),
                    sinks=True, dtype="float32")
    inputs = measure.make_inputs(c, "cpu")
    ref, pt = measure.references(c, inputs, grads=mode != "fwd")
    dev = torch.device("cpu")
    peers = (Gstar(), GstarPadded(), _Leaky())
    assert [p.applies(c) for p in peers] == [True, True, True] and not Eager().applies(c)
    assert not GstarPadded().applies(suite("gpt-oss")[0])
    rows = [run_row(p, c, mode, inputs, ref, pt, dev) for p in peers]
    add_ratios(rows)
    packed, padded, leaky = rows
    assert packed["status"] == "ok" and padded["status"] == "ok", (packed, padded)
    assert leaky["status"] == "WRONG" and "out" in leaky["reason"]
    assert padded["vs_gstar"] > 0 and padded["peak_mib"] > packed["peak_mib"]  # the padding's memory shows
    names = {ch["name"].split()[0] for ch in packed["checks"]}
    assert names == ({"out"} if mode == "fwd" else {"out", "dq", "dk", "dv", "dsinks"})
    assert names == {ch["name"].split()[0] for ch in padded["checks"]}


def test_padded_rows_need_a_causal_pattern():
    c = packed_case("t", (8, 12), heads=2, kv_heads=2, head_dim=16, window=(3, 3))
    assert GstarPadded().unsupported(c, torch.device("cpu"), "fwd").startswith("right padding")


def test_graph_timing_needs_a_gpu(monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert main(["bench", "--timing", "graph", "--seqlen", "40"]) == 2
    assert "needs a GPU" in capsys.readouterr().err


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["fwd", "bwd", "fwd+bwd"])
def test_graph_timing(mode):
    """--timing graph: gstar and eager are checked (as ever), then timed as CUDA graph replays."""
    case = Case("t", 1, 4, 2, 300, 64, causal=True, window=(63, 0), sinks=True)
    inputs = measure.make_inputs(case, "cuda")
    ref, pt = measure.references(case, inputs, grads=mode != "fwd")
    for peer in (Gstar(), Eager()):
        row = run_row(peer, case, mode, inputs, ref, pt, torch.device("cuda"), "graph")
        assert row["status"] == "ok" and row["time_ms"] > 0, row


def test_a_failed_capture_is_flagged_once(monkeypatch, capsys):
    """A row that failed its CUDA graph capture gets a note (once) that later rows may lack memory."""
    from gstar.lab.bench import runner

    def fake_row(peer, case, mode, inputs, ref, pt, device, timing):
        return runner._row(peer, case, "n/a", f"{runner.NOT_CAPTURABLE}: capture failed")

    monkeypatch.setattr(runner, "run_row", fake_row)
    assert main(["bench", "--seqlen", "40", "48", "--heads", "2", "--head-dim", "16", "--impls", "gstar,eager"]) == 0
    assert capsys.readouterr().err.count("failed a CUDA graph capture") == 1


# A peer that reads a value on the host in its forward and in its backward (a sync each). Each mode runs in a
# process of its own: after a failed capture PyTorch's default CUDA generator refuses to draw numbers and the
# failed capture's memory is not returned, for the rest of the process (torch 2.11).
_UNCAPTURABLE = """
import sys
import torch
from gstar.lab.bench import measure
from gstar.lab.bench.cases import Case
from gstar.lab.bench.peers import Eager, Peer
from gstar.lab.bench.runner import run_row

def read(x):
    return x if torch.isfinite(x.sum()).item() else x

class Syncing(Peer):
    name = "syncing"
    def build(self, case, device):
        eager = Eager().build(case, device)
        def fn(q, k, v, sinks):
            out = read(eager(q, k, v, sinks))
            if out.requires_grad:
                out.register_hook(read)
            return out
        return fn

case, mode = Case("t", 1, 4, 2, 300, 64, causal=True), sys.argv[1]
inputs = measure.make_inputs(case, "cuda")
ref, pt = measure.references(case, inputs, grads=mode != "fwd")
row = run_row(Syncing(), case, mode, inputs, ref, pt, torch.device("cuda"), "graph")
print(row["status"], row["reason"])
"""


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["fwd", "bwd", "fwd+bwd"])
def test_graph_timing_reports_an_uncapturable_peer(mode):
    """A peer whose call cannot be captured is n/a with the reason, instead of an error."""
    import subprocess
    import sys

    result = subprocess.run([sys.executable, "-c", _UNCAPTURABLE, mode], capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.startswith("n/a not capturable in a CUDA graph"), result.stdout


def test_eager_is_skipped_when_it_would_not_fit():
    huge = Case("t", 64, 64, 8, 1 << 20, 64, causal=True)
    assert Eager().unsupported(huge, torch.device("cpu"), "fwd").startswith("OOM-risk")


def test_eager_declines_a_capture_it_would_not_fit(monkeypatch):
    """A capture needs about twice the eager call's memory (a failed one keeps it): the bar doubles."""
    from gstar.lab.bench import peers
    case = Case("t", 1, 4, 4, 1000, 16)
    need = (10 * 4 * 1000 * 1001 + 2 * 4 * 1000 * 32) * 2  # fwd+bwd bytes of the eager estimate: scores, repeated kv
    monkeypatch.setattr(peers, "_free_bytes", lambda device: int(need / 0.6) + 1)
    eager, device = Eager(), torch.device("cpu")
    assert eager.unsupported(case, device, "fwd+bwd") is None
    assert eager.uncapturable(case, device, "fwd+bwd").startswith("OOM-risk")
    row = run_row(eager, case, "fwd+bwd", {}, {}, None, device, "graph")
    assert row["status"] == "n/a" and row["reason"].endswith("in a CUDA graph")
    assert Gstar().uncapturable(case, device, "fwd+bwd") is None


def _require(module: str):
    """Import a library the test extra installs, or fail saying how to install it."""
    try:
        return importlib.import_module(module)
    except ImportError:
        pytest.fail(f"{module} is not installed; the tests need the test extra: pip install -e '.[test]'")


def test_json_csv_plot(tmp_path, capsys):
    _require("matplotlib")
    paths = {k: tmp_path / f"bench.{k}" for k in ("json", "csv", "png")}
    argv = ["bench", "--batch", "1", "--heads", "2", "--kv-heads", "1", "--seqlen", "40", "48", "--head-dim", "16",
            "--causal", "--window", "7", "0", "--sink-tokens", "2", "--sinks", "--dtype", "float32",
            "--mode", "fwd+bwd", "--impls", "gstar,eager,flex,sdpa-flash",
            "--json", str(paths["json"]), "--csv", str(paths["csv"]), "--plot", str(paths["png"])]
    assert main(argv) == 0
    data = json.loads(paths["json"].read_text())
    assert data["tool"] == "gstar bench" and data["mode"] == "fwd+bwd" and data["suite"] is None
    assert data["complete"] is True
    # stderr is no terminal here, as in a log: one progress line per row, in order
    progress = [line for line in capsys.readouterr().err.splitlines() if line.startswith("[")]
    assert [line.split("]")[0] for line in progress] == [f"[{i}/8" for i in range(1, 9)]
    assert "gstar ok" in progress[0] and "ms" in progress[0]
    env = data["environment"]
    for key in ("device", "card", "driver", "cuda", "torch", "triton", "python", "gstar", "peers", "date", "command"):
        assert key in env
    assert isinstance(env["torch"], str) and isinstance(env["peers"], dict)
    assert len(data["rows"]) == 2 * 4
    for r in data["rows"]:
        assert {"case", "series", "impl", "status", "reason", "time_ms", "tflops", "peak_mib", "vs_gstar",
                "checks"} <= set(r)
        assert r["case"]["seqlen"] in (40, 48) and r["case"]["window"] == [7, 0]
        if r["impl"] in ("gstar", "eager"):
            assert r["status"] == "ok" and r["time_ms"] > 0 and r["tflops"] > 0 and r["peak_mib"] > 0
            assert {c["name"].split()[0] for c in r["checks"]} == {"out", "dq", "dk", "dv", "dsinks"}
        elif not torch.cuda.is_available():
            assert r["status"] == "n/a" and r["reason"] == "needs CUDA" and r["time_ms"] is None
    if torch.cuda.is_available():
        sdpa = [r for r in data["rows"] if r["impl"] == "sdpa-flash"]
        assert all(r["status"] == "n/a" and r["reason"] == "no learned sinks" for r in sdpa)
    with open(paths["csv"]) as f:
        lines = list(csv.DictReader(f))
    assert len(lines) == len(data["rows"]) and {"impl", "time_ms", "card", "torch", "triton"} <= set(lines[0])
    assert paths["png"].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_run_cut_short_keeps_its_finished_cases(tmp_path, monkeypatch):
    """The JSON is rewritten after every case: a run stopped in its second case keeps the first's rows."""
    from gstar.lab.bench import runner
    real = runner.run_row

    def stop_at_48(peer, case, *args):
        if case.seqlen == 48:
            raise KeyboardInterrupt
        return real(peer, case, *args)

    monkeypatch.setattr(runner, "run_row", stop_at_48)
    path = tmp_path / "bench.json"
    with pytest.raises(KeyboardInterrupt):
        main(["bench", "--heads", "2", "--seqlen", "40", "48", "--head-dim", "16", "--impls", "gstar,eager",
              "--json", str(path)])
    data = json.loads(path.read_text())
    assert data["complete"] is False
    assert [(r["case"]["seqlen"], r["impl"], r["status"]) for r in data["rows"]] == [(40, "gstar", "ok"),
                                                                                    (40, "eager", "ok")]
    assert data["rows"][1]["vs_gstar"] > 0


def test_roofline_floors(tmp_path):
    card = tmp_path / "roofline.json"
    card.write_text(json.dumps({"schema": 1, "card": "test card", "matmul_tflops": 100.0, "memory_gbps": 1000.0}))
    out = tmp_path / "bench.json"
    assert main(["bench", "--seqlen", "32", "--heads", "2", "--head-dim", "16", "--causal", "--dtype", "float32",
                 "--impls", "gstar", "--roofline", str(card), "--json", str(out)]) == 0
    (row,) = json.loads(out.read_text())["rows"]
    c = Case("t", 1, 2, 2, 32, 16, causal=True, dtype="float32")
    assert row["compute_floor_ms"] == pytest.approx(c.flops("fwd") / 100e9)
    assert row["memory_floor_ms"] == pytest.approx(c.bytes_moved("fwd") / 1000e6)
    assert row["bound"] == "memory"
    assert row["floor_pct"] == pytest.approx(100 * row["memory_floor_ms"] / row["time_ms"])


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["fwd", pytest.param("fwd+bwd", marks=pytest.mark.slow)])
@pytest.mark.parametrize("shape", [["--causal", "--window", "63", "0", "--sinks"], ["--causal"], []], ids=str)
def test_gpu_peers_agree_with_the_oracle(tmp_path, mode, shape):
    """Every adapter's mask, GQA and sink conventions against the oracle: none may be WRONG."""
    out = tmp_path / "bench.json"
    assert main(["bench", "--seqlen", "256", "--heads", "4", "--kv-heads", "2", "--head-dim", "64", *shape,
                 "--mode", mode, "--json", str(out)]) == 0
    rows = {r["impl"]: r for r in json.loads(out.read_text())["rows"]}
    assert not [r for r in rows.values() if r["status"] == "WRONG"], rows
    for impl in ("gstar", "eager", "flex"):
        assert rows[impl]["status"] == "ok", rows[impl]
    if "--sinks" in shape:
        assert rows["sdpa-flash"]["status"] == "n/a" and rows["sdpa-cudnn"]["status"] == "n/a"
    else:
        assert rows["sdpa-flash"]["status"] == "ok", rows["sdpa-flash"]


def test_plot_without_matplotlib_names_the_extra(monkeypatch, tmp_path, capsys):
    """The install hint survives rich's markup: ``[bench]`` is printed, not eaten as a style tag."""
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib raises ImportError
    assert main(["bench", "--seqlen", "40", "--heads", "2", "--plot", str(tmp_path / "p.png")]) == 2
    assert "pip install 'gstar[bench]'" in capsys.readouterr().err


def test_varlen_suite(monkeypatch, tmp_path, capsys):
    """``--suite varlen``: packed and padded gstar rows, checked, in the JSON like any suite; on a CPU the suite
    is reduced (and says so), a custom shape is not (and does not)."""
    small = [packed_case("varlen", document_lengths(16 * 48, 4), causal=True, window=w, heads=16, kv_heads=8,
                         head_dim=16, sinks=True) for w in ((-1, -1), (31, 0))]
    monkeypatch.setitem(cases.SUITES, "varlen", lambda: small)
    path = tmp_path / "varlen.json"
    assert main(["bench", "--suite", "varlen", "--mode", "fwd+bwd", "--json", str(path)]) == 0
    cpu = not torch.cuda.is_available()
    assert ("at reduced shapes" in capsys.readouterr().err) == cpu
    data = json.loads(path.read_text())
    assert data["suite"] == "varlen" and data["complete"] is True
    rows = data["rows"]
    assert [r["impl"] for r in rows] == ["gstar", "gstar-padded"] * 2
    assert all(r["status"] == "ok" and r["time_ms"] > 0 for r in rows), rows
    want = for_cpu(small[0]) if cpu else small[0]  # on a CPU each document 1/16 as long
    assert all(r["case"]["lengths"] == list(want.lengths) for r in rows)
    assert {ch["name"].split()[0] for ch in rows[1]["checks"]} == {"out", "dq", "dk", "dv", "dsinks"}
    assert main(["bench", "--seqlen", "40", "--heads", "2", "--head-dim", "16", "--impls", "gstar"]) == 0
    assert "reduced" not in capsys.readouterr().err


def _bench_json(rows, **env):
    return {"tool": "gstar bench", "suite": "fa", "mode": "fwd", "complete": True,
            "environment": dict({"card": "NVIDIA H100", "torch": "2.11", "triton": "3.6", "timing": "eager"}, **env),
            "rows": rows}


def _json_row(label, impl, status, ms=None):
    return {"case": {"label": label}, "impl": impl, "status": status, "time_ms": ms}


def test_markdown_table():
    data = _bench_json([_json_row("B1 N64", "gstar", "ok", 0.1234), _json_row("B1 N64", "eager", "WRONG", 2.0),
                        _json_row("B1 N128", "gstar", "ok", 0.5), _json_row("B1 N128", "eager", "OOM"),
                        _json_row("B1 N128", "flex", "n/a")], timing="graph")
    lines = markdown_table(data).splitlines()
    assert lines[0] == "fwd, CUDA graph replays, ms (median), NVIDIA H100, torch 2.11, triton 3.6:"
    assert lines[2:] == ["| case | gstar | eager | flex |", "|---|---|---|---|",
                         "| B1 N64 | 0.123 | 2.000 (wrong) | - |", "| B1 N128 | 0.500 | n/a | n/a |"]
    assert "cut short" in markdown_table(dict(data, complete=False)).splitlines()[0]


def test_table_option_reads_saved_results(tmp_path, capsys):
    paths = [tmp_path / "a.json", tmp_path / "b.json"]
    paths[0].write_text(json.dumps(_bench_json([_json_row("B1 N64", "gstar", "ok", 1.0)])))
    paths[1].write_text(json.dumps(_bench_json([_json_row("B2 N64", "gstar", "ok", 2.0)], card="NVIDIA H200")))
    assert main(["bench", "--table", *map(str, paths)]) == 0
    out = capsys.readouterr().out
    assert "| B1 N64 | 1.000 |" in out and "| B2 N64 | 2.000 |" in out and "NVIDIA H200" in out
    (tmp_path / "bad.json").write_text("{not json")
    assert main(["bench", "--table", str(tmp_path / "bad.json")]) == 2
    assert "bad.json" in capsys.readouterr().err


def test_table_merges_a_run_split_by_impls(tmp_path, capsys):
    """Files of one suite, mode, timing and card make one table (columns in file order), and --plot with
    --table draws their rows; another card stays a table of its own."""
    _require("matplotlib")
    def row(impl, ms):
        return dict(_json_row("B1 N64", impl, "ok", ms), case={"label": "B1 N64", "seqlen": 64}, series="B1",
                    tflops=1.0 / ms)

    paths = [tmp_path / f"{n}.json" for n in "abc"]
    paths[0].write_text(json.dumps(_bench_json([row("gstar", 1.0)], peers={})))
    paths[1].write_text(json.dumps(_bench_json([row("fa4", 3.0)], peers={"fa4": "4.0"})))
    paths[2].write_text(json.dumps(_bench_json([row("flex", 2.0)], card="NVIDIA H200")))
    png = tmp_path / "p.png"
    assert main(["bench", "--table", *map(str, paths), "--plot", str(png)]) == 0
    out = capsys.readouterr().out
    assert "| B1 N64 | 1.000 | 3.000 |" in out and "| B1 N64 | 2.000 |" in out
    assert out.count("| case |") == 2
    assert png.stat().st_size > 0


def test_nondeterministic_row_asks_for_the_flag(monkeypatch):
    """``gstar-nondet`` is gstar's call with ``deterministic=False`` (``gstar`` keeps the default), on dense cases
    with a backward only."""
    import gstar.api
    flags = []
    real = gstar.api.flash_attention
    monkeypatch.setattr(gstar.api, "flash_attention",
                        lambda *a, deterministic, **kw: flags.append(deterministic) or real(*a, **kw))
    case = cases.custom([40], batch=1, heads=2, kv_heads=1, head_dim=16, causal=True, dtype="float32")[0]
    q, k, v = (torch.randn(1, h, 40, 16) for h in (2, 1, 1))
    for peer in (Gstar(), GstarNondeterministic()):
        peer.build(case, torch.device("cpu"))(q, k, v, None)
    assert flags == [True, False]
    nondet = GstarNondeterministic()
    assert nondet.unsupported(case, torch.device("cpu"), "fwd") and not nondet.unsupported(case, None, "fwd+bwd")
    assert not nondet.applies(packed_case("varlen", (5, 7), heads=2, kv_heads=1, head_dim=16))


def test_plot_keeps_packed_documents_apart(monkeypatch, tmp_path):
    """A packed case (documents of several lengths) and a dense batch of the same heads and pattern share a
    series name but not a line: each gets its own subplot."""
    _require("matplotlib")
    titles = []
    monkeypatch.setattr(report, "_save", lambda plt, fig, *a: titles.extend(ax.get_title() for ax in fig.axes
                                                                            if ax.get_title()))
    dense = dict(_json_row("B2 N4096", "gstar", "ok", 1.0), case={"label": "B2 N4096", "seqlen": 4096},
                 series="H8 D64 causal bf16", tflops=1.0)
    packed = dict(dense, case={"label": "16 docs", "seqlen": 4042, "lengths": [4042, 12]}, tflops=2.0)
    report.plot(str(tmp_path / "p.png"), [dense, packed], {"card": "c", "torch": "t", "triton": "t"}, "fwd")
    assert titles == ["H8 D64 causal bf16", "packed H8 D64 causal bf16"]


def test_plot_colours_follow_the_implementation(monkeypatch, tmp_path):
    """An implementation keeps its colour in every subplot, whichever implementations the subplot has."""
    _require("matplotlib")
    colours = {}
    monkeypatch.setattr(report, "_save", lambda plt, fig, *a: [
        colours.setdefault(line.get_label(), set()).add(line.get_color()) for ax in fig.axes for line in ax.lines])
    row = lambda impl, series: dict(_json_row("B2 N4096", impl, "ok", 1.0), series=series, tflops=1.0,  # noqa: E731
                                    case={"label": "B2 N4096", "seqlen": 4096})
    rows = [row("flex", "H8 D64 causal bf16"), row("gstar", "H8 D64 causal bf16"), row("gstar", "H8 D128 full bf16")]
    report.plot(str(tmp_path / "p.png"), rows, {"card": "c", "torch": "t", "triton": "t"}, "fwd")
    assert colours == {"flex": {"C0"}, "gstar": {"C1"}}


def test_cpu_race_warms_up_and_takes_turns():
    calls = []
    first = lambda: calls.append("a")  # noqa: E731
    second = lambda: calls.append("b")  # noqa: E731
    a, b = measure.race_ms([first, second], torch.device("cpu"))
    assert a >= 0 and b >= 0
    runs = len(calls) // 2 - 1
    assert calls[:2] == ["a", "b"] and calls[2:] == ["a", "b"] * runs  # warm-up, then turns
    assert measure.CPU_RUNS[0] <= runs <= measure.CPU_RUNS[1]


def test_one_cpu_thread_restores_the_thread_count():
    before = torch.get_num_threads()
    with measure.one_cpu_thread():
        assert torch.get_num_threads() == 1
    assert torch.get_num_threads() == before
