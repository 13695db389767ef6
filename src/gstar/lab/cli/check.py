"""``gstar check``: the autograder's ten stages, on a GPU or, reduced, on any CPU.

Stages 1-9 build up to the Triton backward with windows and sink tokens; stage 10 is GPT-OSS. Each stage
prints one line per case (pass or fail, the shape, the measured error against the bar of docs/design.md
section 4), then a short race of its last case against naive PyTorch: time, peak memory, "N.NNx faster",
"N.NNx less memory". On a CPU the stages the Triton interpreter runs are checked, not raced, and the races
that remain are indicative only. Exit status 0 only when every case passed. The stage table (what each
stage checks, at which shapes on GPU and CPU) is in :mod:`gstar.lab.check.stages`.

This module is imported while the parser is built: it must not import triton or ``gstar.kernels``.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import os

from ..check.stages import STAGES, parse_stage


def _stage(text: str) -> int:
    try:
        return parse_stage(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags of ``gstar check``."""
    parser.add_argument("--stage", type=_stage, action="append", metavar="N",
                        help=f"run only this stage: 1..{len(STAGES)} or p1..p{len(STAGES)} (repeatable)")
    parser.add_argument("--json", metavar="FILE", help="write every case's verdicts and the benchmarks as JSON")
    parser.add_argument("--backend", choices=("triton", "torch"), default="triton",
                        help="backend of gstar.flash_attention for stages 3-10 (default: the Triton kernels)")
    parser.add_argument("--impl", metavar="MODULE:FUNCTION",
                        help="check another attention implementation with gstar.flash_attention's keywords "
                             "(stages 1 and 3-10)")
    parser.add_argument("--no-bench", action="store_true", help="correctness only, skip the speed race")
    parser.add_argument("--seed", type=int, default=0, help="seed of the random inputs")


def _load_impl(spec: str):
    module, _, name = spec.partition(":")
    if not name:
        raise ValueError(f"--impl must look like module:function, got {spec!r}")
    return getattr(importlib.import_module(module), name)


def _bench_line(b: dict) -> str:
    if b["note"]:
        return f"  benchmark {b['shape']} ({b['mode']}): {b['note']}"
    mem = lambda x: "memory n/a" if x is None else f"{x:,.1f} MiB"  # noqa: E731
    line = (f"  benchmark {b['shape']} ({b['mode']}): {b['impl']} {b['impl_ms']:.3f} ms, {mem(b['impl_peak_mib'])} | "
            f"naive PyTorch {b['naive_ms']:.3f} ms, {mem(b['naive_peak_mib'])}\n"
            f"  -> {_times(b['speedup'], 'faster', 'slower')}")
    if b["memory_ratio"] is not None:
        line += f", {_times(b['memory_ratio'], 'less memory', 'more memory')}"
    return line


def _stages(numbers) -> str:
    """``stage 3`` or ``stages 3, 5``."""
    return ("stage " if len(numbers) == 1 else "stages ") + ", ".join(str(n) for n in numbers)


def _times(ratio: float, better: str, worse: str) -> str:
    return f"{ratio:.2f}x {better}" if ratio >= 1 else f"{1 / ratio:.2f}x {worse}"


def _payload(results, env, device_type, interpreter) -> dict:
    return {
        "tool": "gstar check", "environment": env, "device": device_type, "interpreter": interpreter,
        "passed": all(r.passed for r in results),
        "stages": [{
            "stage": r.number, "title": r.title, "passed": r.passed, "benchmark": r.bench,
            "cases": [{"label": c.label, "shape": c.shape, "passed": c.passed, "error": c.error,
                       "checks": [{"name": v.name, "error": v.error, "allowed": v.allowed, "ok": v.ok}
                                  for v in c.checks]} for c in r.cases],
        } for r in results],
    }


def run(args) -> int:
    """Run the stages; 0 when every case passed, 1 otherwise."""
    import torch
    cuda = torch.cuda.is_available()
    if not cuda:
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before anything imports triton
    from rich.console import Console
    from rich.markup import escape
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from ..bench.measure import one_cpu_thread
    from ..bench.report import environment
    from ..check.runner import run_check

    console = Console(soft_wrap=True)
    device = "cuda" if cuda else "cpu"
    stages = sorted(set(args.stage)) if args.stage else sorted(STAGES)
    try:
        impl = _load_impl(args.impl) if args.impl else None
    except (ValueError, ImportError, AttributeError) as exc:
        console.print(f"[red]gstar check: cannot load --impl: {escape(str(exc))}")
        return 2
    if not cuda:
        from ...checks import interpreter_problem
        problem = interpreter_problem()
        if problem:
            console.print(f"[red]gstar check: {escape(problem)}")
            return 2
    env = environment(torch.device(device))
    if cuda:
        from ...kernels.dispatch import sitting_out
        console.print(f"gstar check on {escape(env['card'])} (torch {env['torch']}, triton {env['triton']})")
        if note := sitting_out(torch.device(device)):
            console.print(f"[yellow]{escape(note)}")
    else:
        kernels = args.backend == "triton" and impl is None
        console.print("[yellow]No GPU: reduced shapes (float16/float32). "
                      + ("The Triton kernels run" if kernels else "Stage 2 (Triton) runs")
                      + " under the Triton interpreter, which is no speed measurement: checked, not raced"
                      + (" (--backend torch races gstar's PyTorch path instead)" if kernels else "")
                      + ". CPU timings are indicative only.")
    total = sum(len(STAGES[s].cases(device)) for s in stages)
    with contextlib.nullcontext() if cuda else one_cpu_thread(), \
            Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                     console=console, transient=True) as progress:
        task = progress.add_task("stage", total=total)

        def on_case(stage, res):
            mark = "[green]PASS[/]" if res.passed else "[bold red]FAIL[/]"
            detail = res.error or "; ".join(str(v) for v in res.checks)
            progress.console.print(f"  {mark} P{stage.number} {escape(res.label)}  {escape(detail)}", highlight=False)
            progress.advance(task)

        def on_stage(r):
            verdict = "[green]passed[/]" if r.passed else "[bold red]FAILED[/]"
            if r.bench:
                progress.console.print(_bench_line(r.bench), highlight=False, markup=False)
            elif not r.passed:
                progress.console.print("  benchmark skipped: the stage failed", highlight=False)
            progress.console.print(f"Stage {r.number} ({escape(r.title)}): {verdict}\n", highlight=False)

        results = []
        for s in stages:
            progress.console.print(f"[bold]Stage {s}: {escape(STAGES[s].title)}", highlight=False)
            progress.update(task, description=f"stage {s}")
            results += run_check([s], impl=impl, backend=args.backend, device=device, bench=not args.no_bench,
                                 seed=args.seed, on_case=on_case, on_stage=on_stage)
    failed = [r.number for r in results if not r.passed]
    if failed:
        console.print(f"[bold red]FAILED: {_stages(failed)}")
    elif len(results) == 1:
        console.print(f"[bold green]Stage {results[0].number} passed.")
    else:
        console.print(f"[bold green]All {len(results)} stages passed.")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(_payload(results, env, device, not cuda), f, indent=2)
            f.write("\n")
    return 0 if not failed else 1
