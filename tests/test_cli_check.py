"""``gstar check``: argument parsing, the stage table, the JSON it writes, and its exit status.

The exit status is the autograder's whole point: a deliberately wrong implementation (wrong mask, wrong
scale, wrong gradient, or one that raises) must make it exit 1; a correct one must give 0.
"""

import json
import os

import pytest
import torch

from gstar import naive_attention
from gstar.api import flash_attention
from gstar.lab.check import runner
from gstar.lab.check.stages import STAGES, RowSumCase, parse_stage
from gstar.lab.cli.main import build_parser, main


def ignores_causal(q, k, v, *, causal, window, sink_tokens, sinks, scale=None):
    """Wrong on purpose: attends to the future."""
    return flash_attention(q, k, v, causal=False, window=(-1, -1), sink_tokens=0, sinks=sinks, backend="torch")


def wrong_scale(q, k, v, **kw):
    """Wrong on purpose: a 2% larger softmax scale, a small error the bar must still catch."""
    return flash_attention(q, k, v, scale=1.02 * q.shape[-1] ** -0.5, backend="torch", **kw)


def wrong_gradient(q, k, v, **kw):
    """Right output, wrong gradient: the value of the true attention, the gradient of a wrong-scale one."""
    right = flash_attention(q, k, v, backend="torch", **kw)
    wrong = flash_attention(q, k, v, scale=0.9 * q.shape[-1] ** -0.5, backend="torch", **kw)
    return right.detach() + (wrong - wrong.detach())


def raises(q, k, v, **kw):
    raise NotImplementedError("kernel not written yet")


def raises_with_brackets(q, k, v, **kw):
    raise NotImplementedError("needs an extra: pip install 'gstar[bench]'")


@pytest.mark.parametrize("text,number", [("3", 3), ("p3", 3), ("P7", 7), ("10", 10), ("p10", 10)])
def test_stage_spellings(text, number):
    assert parse_stage(text) == number
    assert build_parser().parse_args(["check", "--stage", text]).stage == [number]


@pytest.mark.parametrize("bad", ["0", "11", "p", "x3", "3.5"])
def test_bad_stage_is_a_usage_error(bad):
    with pytest.raises(SystemExit):
        build_parser().parse_args(["check", "--stage", bad])


def test_defaults_and_repeated_stages():
    args = build_parser().parse_args(["check"])
    assert args.stage is None and args.backend == "triton" and args.json is None and not args.no_bench
    args = build_parser().parse_args(["check", "--stage", "p3", "--stage", "9", "--backend", "torch"])
    assert args.stage == [3, 9] and args.backend == "torch"


def test_default_implementation_is_the_triton_kernels():
    for n in range(3, 11):
        impl = runner.default_impl(STAGES[n], "triton")
        assert impl.func is flash_attention and impl.keywords == {"backend": "triton"}


def test_stage_table():
    assert sorted(STAGES) == list(range(1, 11))
    for s in STAGES.values():
        assert s.gpu and s.cpu
        assert s.backward == (s.number >= 8)
    # the original autograder's shapes
    assert [(c.batch, c.heads, c.seqlen, c.head_dim) for c in STAGES[3].gpu] == \
        [(1, 8, 512, 16), (1, 8, 1024, 16), (1, 16, 2048, 16), (1, 16, 4096, 16)]
    for n in (7, 9):
        last = STAGES[n].gpu[-1]
        assert (last.batch, last.heads, last.kv_heads, last.seqlen, last.head_dim) == (1, 16, 1, 4096, 16)
        assert last.window == (255, 0) and last.sink_tokens == 4
    assert all(isinstance(c, RowSumCase) for c in STAGES[2].gpu + STAGES[2].cpu)
    gpt = STAGES[10].gpu
    assert all((c.heads, c.kv_heads, c.head_dim, c.seqlen, c.sinks) == (64, 8, 64, 4096, True) for c in gpt)
    assert {c.window for c in gpt} == {(-1, -1), (127, 0)} and {c.batch for c in gpt} == {1, 2}
    # the CPU shapes stay small enough for the interpreter
    for s in STAGES.values():
        for c in s.cpu:
            assert (c.rows if isinstance(c, RowSumCase) else c.seqlen) <= 160
            assert getattr(c, "dtype", "float32") in ("float16", "float32")


@pytest.mark.parametrize("stage,impl", [(4, ignores_causal), (3, wrong_scale), (8, wrong_gradient), (5, raises)])
def test_wrong_implementation_fails_its_stage(stage, impl):
    (result,) = runner.run_check([stage], impl=impl, device="cpu", bench=False)
    assert not result.passed
    assert any(not c.passed for c in result.cases)


def test_wrong_gradient_passes_forward_and_fails_on_a_gradient():
    (result,) = runner.run_check([8], impl=wrong_gradient, device="cpu", bench=False)
    for case in result.cases:
        verdicts = {v.name.split()[0]: v.ok for v in case.checks}
        assert verdicts["out"] and not all(verdicts[g] for g in ("dq", "dk", "dv"))


def test_cli_exit_status_1_on_a_wrong_implementation(tmp_path):
    out = tmp_path / "check.json"
    status = main(["check", "--stage", "4", "--impl", f"{__name__}:ignores_causal", "--no-bench", "--json", str(out)])
    assert status == 1
    data = json.loads(out.read_text())
    assert data["passed"] is False and data["stages"][0]["passed"] is False


def test_cli_prints_messages_verbatim_and_names_failed_stages(capsys):
    """A case's error goes through rich unaltered (``[bench]`` is no style tag); the summary counts stages."""
    assert main(["check", "--stage", "3", "--impl", f"{__name__}:raises_with_brackets", "--no-bench"]) == 1
    out = capsys.readouterr().out
    assert "pip install 'gstar[bench]'" in out and "FAILED: stage 3\n" in out


def test_help_is_plain_text_and_counts_ten_stages(capsys):
    with pytest.raises(SystemExit):
        main(["--help"])
    out = capsys.readouterr().out
    assert "``" not in out and "ten stages" in out and "nine" not in out


def test_cli_exit_status_0_and_json_schema(tmp_path, capsys):
    out = tmp_path / "check.json"
    assert main(["check", "--stage", "p4", "--stage", "10", "--backend", "torch", "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "All 2 stages passed." in printed
    if not torch.cuda.is_available():
        assert "CPU timings are indicative only" in printed
    data = json.loads(out.read_text())
    assert data["tool"] == "gstar check" and data["passed"] is True
    assert data["device"] in ("cpu", "cuda") and isinstance(data["interpreter"], bool)
    for key in ("card", "torch", "triton", "date", "command"):
        assert key in data["environment"]
    assert [s["stage"] for s in data["stages"]] == [4, 10]
    for s in data["stages"]:
        assert isinstance(s["title"], str) and s["passed"] is True
        assert len(s["cases"]) == len(STAGES[s["stage"]].cases(data["device"]))
        for c in s["cases"]:
            assert c["passed"] is True and c["error"] is None and isinstance(c["label"], str)
            assert {"batch", "heads", "kv_heads", "seqlen", "head_dim", "window", "dtype"} <= set(c["shape"])
            for v in c["checks"]:
                assert isinstance(v["error"], float) and isinstance(v["allowed"], float) and v["ok"] is True
        names = {v["name"].split()[0] for c in s["cases"] for v in c["checks"]}
        assert names == ({"out"} if s["stage"] == 4 else {"out", "dq", "dk", "dv", "dsinks"})
        b = s["benchmark"]
        assert b["mode"] == ("fwd" if s["stage"] == 4 else "fwd+bwd")
        assert b["impl_ms"] > 0 and b["naive_ms"] > 0 and b["speedup"] > 0
        assert b["impl_peak_mib"] > 0 and b["memory_ratio"] > 0  # the tiled PyTorch path: measurable on CPU


@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU behaviour")
def test_cpu_races_pytorch_stages_and_not_interpreted_ones():
    """On a CPU, stage 1 (PyTorch) races naive PyTorch; stage 2 (the Triton interpreter) is checked only."""
    tiled, rowsum = runner.run_check([1, 2], device="cpu")
    assert tiled.passed and rowsum.passed
    b = tiled.bench
    assert b["impl_ms"] > 0 and b["naive_ms"] > 0 and b["speedup"] == pytest.approx(b["naive_ms"] / b["impl_ms"])
    assert b["impl_peak_mib"] > 0 and b["note"] is None
    assert rowsum.bench["note"] == runner.INTERPRETER_NOTE and rowsum.bench["impl_ms"] is None


def test_naive_attention_as_impl_passes_the_tiled_stage():
    """Any callable with flash_attention's keywords can be checked; one returning (out, lse) works too."""
    (result,) = runner.run_check([1], impl=naive_attention, device="cpu", bench=False)
    assert result.passed


def test_cli_reports_a_bad_impl_spec():
    assert main(["check", "--stage", "3", "--impl", "gstar.api"]) == 2


def test_check_on_cpu_sets_the_interpreter(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    if torch.cuda.is_available():
        pytest.skip("the interpreter is for CPU-only machines")
    main(["check", "--stage", "1", "--no-bench"])
    assert os.environ["TRITON_INTERPRET"] == "1"


@pytest.mark.gpu
@pytest.mark.slow
def test_gpu_check_passes_every_stage(tmp_path):
    out = tmp_path / "check.json"
    assert main(["check", "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    assert data["device"] == "cuda" and not data["interpreter"]
    for s in data["stages"]:
        b = s["benchmark"]
        assert b["impl_ms"] > 0 and b["impl_peak_mib"] > 0
