"""Run the stages of ``gstar check``: judge every case against the oracle with the bar of docs/design.md
section 4, then race naive PyTorch.

The implementation under test is a parameter: ``run_check(stages, impl=...)`` takes any callable with
``gstar.flash_attention``'s keywords (returning ``out`` or ``(out, lse)``) for the attention stages, so a
test can hand it a deliberately wrong one and see the stage fail. Without it, stage 1 checks
``gstar.tiled_attention``, stage 2 ``gstar.lab.primers.weighted_row_sum``, and stages 3-10
``gstar.flash_attention(..., backend=backend)`` (the Triton kernels by default).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

import torch

from ..accuracy import Verdict
from ..bench.cases import Case
from ..bench.measure import is_oom, judge, judge_all, make_inputs, nbytes, peak_bytes, race_ms, references
from ...reference import naive_attention
from .stages import STAGES, RowSumCase, Stage


@dataclass
class CaseResult:
    """One case of a stage: its shape, the verdicts of every compared tensor, or the error it raised."""

    label: str
    shape: dict
    checks: list[Verdict] = field(default_factory=list)
    error: str | None = None

    @property
    def passed(self) -> bool:
        return self.error is None and bool(self.checks) and all(c.ok for c in self.checks)


@dataclass
class StageResult:
    """One stage: its cases and the benchmark of its last case against naive PyTorch."""

    number: int
    title: str
    cases: list[CaseResult] = field(default_factory=list)
    bench: dict | None = None

    @property
    def passed(self) -> bool:
        return all(c.passed for c in self.cases)


def case_label(case) -> str:
    """A case in words: ``(B=1, Hq=16, Hkv=2, N=4096, D=16) causal bfloat16``, ``(rows=70, cols=96) float32``."""
    if isinstance(case, RowSumCase):
        return case.label
    heads = f"H={case.heads}" if case.heads == case.kv_heads else f"Hq={case.heads}, Hkv={case.kv_heads}"
    return f"(B={case.batch}, {heads}, N={case.seqlen}, D={case.head_dim}) {case.mask_label} {case.dtype}"


def default_impl(stage: Stage, backend: str):
    """The implementation a stage checks when none is given."""
    if stage.kind == "rowsum":
        from ..primers import weighted_row_sum
        return weighted_row_sum
    if stage.kind == "tiled":
        from ...api import tiled_attention
        return tiled_attention
    from ...api import flash_attention
    return functools.partial(flash_attention, backend=backend)


def _attention_call(impl, case: Case, inputs: dict, grads: bool):
    leaves = [inputs[n].clone().requires_grad_(grads) for n in ("q", "k", "v")]
    sinks = None if inputs["sinks"] is None else inputs["sinks"].clone().requires_grad_(grads)
    if sinks is not None:
        leaves.append(sinks)

    def forward():
        res = impl(*leaves[:3], causal=case.causal, window=case.window, sink_tokens=case.sink_tokens, sinks=sinks)
        return res[0] if isinstance(res, tuple) else res
    return forward, leaves


def _check_attention(impl, stage: Stage, case: Case, device, seed: int) -> list[Verdict]:
    inputs = make_inputs(case, device, seed=seed)
    ref, pt = references(case, inputs, grads=stage.backward)
    forward, leaves = _attention_call(impl, case, inputs, stage.backward)
    with torch.enable_grad() if stage.backward else torch.no_grad():
        out = forward()
    got = {"out": out.detach()}
    if stage.backward:
        got.update(zip(("dq", "dk", "dv", "dsinks"), torch.autograd.grad(out, leaves, inputs["dout"])))
    return judge_all(got, ref, pt)


def _rowsum_inputs(case: RowSumCase, device, seed: int):
    g = torch.Generator(device=device).manual_seed(seed)
    x = torch.randn(case.rows, case.cols, generator=g, device=device)   # (rows, cols)
    w = torch.randn(case.cols, generator=g, device=device)              # (cols,)
    return x, w


def _check_rowsum(impl, case: RowSumCase, device, seed: int) -> list[Verdict]:
    x, w = _rowsum_inputs(case, device, seed)
    return [judge("out", impl(x, w), x.double() @ w.double(), None)]


def check_case(impl, stage: Stage, case, device, seed: int = 0) -> CaseResult:
    """Run one case; an exception (a missing kernel, a crash) fails the case with its message."""
    shape = vars(case).copy() if isinstance(case, RowSumCase) else case.as_dict()
    res = CaseResult(case_label(case), shape)
    try:
        if stage.kind == "rowsum":
            res.checks = _check_rowsum(impl, case, device, seed)
        else:
            res.checks = _check_attention(impl, stage, case, device, seed)
    except Exception as exc:  # a failing implementation is a failed case, not a crashed autograder
        res.error = f"{type(exc).__name__}: {str(exc).strip().splitlines()[0] if str(exc).strip() else ''}"
    return res


INTERPRETER_NOTE = "not raced: the Triton interpreter is no speed measurement"


def _race_entry(stage: Stage, device, name: str, note: str | None = None) -> dict:
    """A stage's benchmark entry with nothing measured yet."""
    return {"shape": case_label(stage.cases(device.type)[-1]), "mode": "fwd+bwd" if stage.backward else "fwd",
            "impl": name, "impl_ms": None, "naive_ms": None, "impl_peak_mib": None, "naive_peak_mib": None,
            "speedup": None, "memory_ratio": None, "note": note}


def not_raced(stage: Stage, device, name: str) -> dict:
    """The benchmark entry of a stage whose implementation runs under the Triton interpreter (CPU)."""
    return _race_entry(stage, device, name, INTERPRETER_NOTE)


def bench_stage(impl, stage: Stage, device, *, name: str = "gstar", seed: int = 0) -> dict:
    """Time and peak memory of the stage's last case against naive PyTorch in the same dtype.

    Forward only for stages 1-7, forward + backward for stages 8-10. Both contenders are timed by
    :func:`gstar.lab.bench.measure.race_ms` (on a CPU: warm-up, then the median of runs taken in turns).
    """
    case = stage.cases(device.type)[-1]
    res = _race_entry(stage, device, name)
    if stage.kind == "rowsum":
        x, w = _rowsum_inputs(case, device, seed)
        held = nbytes(x, w)
        ours, naive = (lambda: impl(x, w)), (lambda: (x * w).sum(-1))
    else:
        inputs = make_inputs(case, device, seed=seed)
        fns = []
        for f in (impl, naive_attention):
            forward, leaves = _attention_call(f, case, inputs, stage.backward)
            if stage.backward:
                fns.append(lambda forward=forward, leaves=leaves:
                           torch.autograd.grad(forward(), leaves, inputs["dout"]))
            else:
                fns.append(lambda forward=forward: torch.no_grad()(forward)())
        ours, naive = fns
        held = nbytes(inputs["q"], inputs["k"], inputs["v"], inputs["sinks"])
        held += nbytes(inputs["dout"]) if stage.backward else 0
    try:
        res["impl_ms"], res["naive_ms"] = race_ms([ours, naive], device)
        res["impl_peak_mib"], res["naive_peak_mib"] = (peak_bytes(f, device, held) / 2**20 for f in (ours, naive))
    except Exception as exc:
        if not is_oom(exc):
            raise
        res["note"] = "out of memory"
        return res
    finally:
        if device.type == "cuda":
            torch.cuda.empty_cache()
    res["speedup"] = res["naive_ms"] / res["impl_ms"]
    res["memory_ratio"] = res["naive_peak_mib"] / res["impl_peak_mib"]
    return res


def run_check(stages=None, *, impl=None, backend: str = "triton", device=None, bench: bool = True,
              seed: int = 0, on_case=None, on_stage=None) -> list[StageResult]:
    """Run ``stages`` (numbers; default all ten) and return one :class:`StageResult` each.

    impl: a callable with ``gstar.flash_attention``'s keywords used for every attention stage (1, 3-10)
        instead of the defaults (stage 2 always checks the Triton row sum).
    backend: the ``gstar.flash_attention`` backend of stages 3-10 ("triton", or "torch" for the tiled path).
    device: "cuda" or "cpu"; default CUDA when available (on CPU, ``TRITON_INTERPRET=1`` must already be set
        for the Triton stages).
    on_case(stage, CaseResult) and on_stage(StageResult) are called as results arrive (progress display).
    """
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    results = []
    for number in stages or sorted(STAGES):
        stage = STAGES[number]
        result = StageResult(number, stage.title)
        try:
            fn = impl if (impl is not None and stage.kind != "rowsum") else default_impl(stage, backend)
        except ImportError as exc:
            fn, missing = None, f"implementation not available: {exc}"
        for case in stage.cases(device.type):
            res = check_case(fn, stage, case, device, seed) if fn else CaseResult(case_label(case), {}, error=missing)
            result.cases.append(res)
            if on_case:
                on_case(stage, res)
        if bench and result.passed:
            custom = impl is not None and stage.kind != "rowsum"
            pure_torch = stage.kind == "tiled" or (stage.kind == "kernel" and backend == "torch") or custom
            name = getattr(impl, "__name__", "impl") if custom else "gstar"
            if device.type == "cpu" and not pure_torch:
                result.bench = not_raced(stage, device, name)
            else:
                result.bench = bench_stage(fn, stage, device, name=name, seed=seed)
        if on_stage:
            on_stage(result)
        results.append(result)
    return results
