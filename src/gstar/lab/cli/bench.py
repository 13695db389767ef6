"""``gstar bench``: gstar against its peers, same inputs, same process, checked before timed.

Suites (docs/design.md section 5): ``gpt-oss``, ``long``, ``fa``, ``mla``, ``stages``, ``varlen``, ``models``,
``gemma``, ``all``, ``decode``, ``fp8``, ``serving``; or one custom case per ``--seqlen`` from the shape flags.
Implementations: gstar, eager (Hugging Face GPT-OSS style), SDPA flash and cuDNN, compiled FlexAttention, and
FlashAttention-4 / fla / FlashInfer when importable; with a backward, also gstar with ``deterministic=False``
(``gstar-nondet``: dQ added up in any order where the Hopper backward serves the case); the ``varlen`` suite
compares gstar on packed documents with gstar on the same documents padded into a batch; the ``decode`` suite
(forward only) times decode steps against a cache, gstar's kvcache entry point beside its prefill kernel
(``gstar-prefill``), GPT-OSS heads and DeepSeek-V3's latent attention (one paged cache, values its first
lanes); the ``serving`` suite (forward only) times a GPT-OSS-20B server's mixed step, prefill chunks and decodes
packed into one call over paged caches, and its parts. Every row is checked against the
naive oracle with the correctness bar before it is timed; a peer that cannot express a case shows as
``n/a (reason)``. Times are of calls made from Python (host time included), or with ``--timing graph`` of
replays of each call captured in a CUDA graph (the kernels alone); the forward-only suites time graph replays
on a GPU unless ``--timing eager`` is given, since a decode step's kernels take less time than the host takes
to launch them. On a CPU-only machine gstar runs
its tiled PyTorch path (the suites at reduced shapes); kernel timings need a GPU. ``--table`` prints the
markdown tables of saved ``--json`` results instead of running anything.

This module is imported while the parser is built: it must not import triton or ``gstar.kernels``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys

from ..bench.cases import DTYPES, FORWARD_ONLY, MODES, SUITE_NAMES
from ..bench.peers import PEER_NAMES

_SHAPE_FLAGS = ("batch", "heads", "kv_heads", "seqlen", "head_dim", "value_dim", "window", "sink_tokens", "sinks",
                "causal", "dtype", "softcap", "chunk")


def _impl_list(text: str) -> list[str]:
    names = [n.strip() for n in text.split(",") if n.strip()]
    bad = [n for n in names if n not in PEER_NAMES]
    if bad:
        raise argparse.ArgumentTypeError(f"unknown implementation(s) {', '.join(bad)}; "
                                         f"choose from {', '.join(PEER_NAMES)}")
    return names


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags of ``gstar bench``."""
    parser.add_argument("--suite", choices=SUITE_NAMES, default="gpt-oss",
                        help="reference shapes of docs/design.md section 5 (default: gpt-oss); varlen: gstar on "
                             "16 packed documents (16384 tokens, GPT-OSS heads) against the same documents padded "
                             "into a batch; models: Gemma 2 layers with and without their logit soft-cap, a Llama "
                             "4 chunked layer beside a window as wide; gemma: Gemma 2 9B's causal and sliding "
                             "layers and Gemma 3 12B's sliding layer at 4k and 8k, no soft-cap; mla: DeepSeek-V3's "
                             "training shape at 4k and 8k; decode (forward only, graph-timed by default): GPT-OSS "
                             "decode steps against contiguous and paged caches, DeepSeek-V3 latent decode steps "
                             "against paged ones; fp8 (forward only): FP8 inputs beside bfloat16, "
                             "decode steps also against an FP8 cache under bfloat16 queries; serving (forward "
                             "only, graph-timed by default): a GPT-OSS-20B server's step of 4 prefill chunks and 60 "
                             "decodes over paged caches, and its parts; all: every suite but decode, fp8 and serving")
    parser.add_argument("--mode", choices=MODES, default="fwd",
                        help="time the forward, the backward alone, or both (default: fwd)")
    parser.add_argument("--timing", choices=("eager", "graph"),
                        help="eager: time each call made from Python, host time included (the default, but for "
                             "the forward-only suites on a GPU); graph (GPU): time replays of the call captured in "
                             "a CUDA graph, the kernels alone; an implementation that cannot be captured is n/a, and "
                             "PyTorch keeps a failed capture's memory, so later rows may find less free memory")
    parser.add_argument("--impls", type=_impl_list, default=list(PEER_NAMES), metavar="A,B,...",
                        help=f"comma-separated subset of: {', '.join(PEER_NAMES)} (default: all)")
    shape = parser.add_argument_group("custom shape (any of these replaces the suite by one case per --seqlen)")
    shape.add_argument("--batch", type=int, help="batch size (default 1)")
    shape.add_argument("--heads", type=int, help="query heads (default 16)")
    shape.add_argument("--kv-heads", type=int, help="key/value heads (default: --heads)")
    shape.add_argument("--seqlen", type=int, nargs="+", action="extend", metavar="N",
                       help="sequence length(s); repeat or list several (default 1024)")
    shape.add_argument("--head-dim", type=int, help="head dimension of queries and keys (default 64)")
    shape.add_argument("--value-dim", type=int, help="head dimension of values (default: --head-dim)")
    shape.add_argument("--window", type=int, nargs=2, metavar=("LEFT", "RIGHT"),
                       help="sliding window, inclusive, -1 = unbounded (GPT-OSS: 127 0)")
    shape.add_argument("--sink-tokens", type=int, help="first keys exempt from the window's left bound")
    shape.add_argument("--sinks", action="store_true", default=None, help="learned per-head sink logits")
    shape.add_argument("--causal", action="store_true", default=None, help="causal mask")
    shape.add_argument("--softcap", type=float, help="logit soft-cap (Gemma 2: 50)")
    shape.add_argument("--chunk", type=int, help="chunked attention's chunk of positions (Llama 4: 8192)")
    shape.add_argument("--dtype", choices=sorted(DTYPES), help="input dtype (default bfloat16; fp8: inputs "
                       "quantised per head, forward only)")
    out = parser.add_argument_group("output")
    out.add_argument("--json", metavar="FILE", help="write rows and environment as JSON")
    out.add_argument("--csv", metavar="FILE", help="write rows as CSV")
    out.add_argument("--plot", metavar="FILE.png", help="plot against sequence length (decode: time and floor per "
                     "case; needs matplotlib); with --table, plot the saved rows")
    out.add_argument("--plot-metric", choices=("tflops", "time"), default="tflops", help="y axis of --plot")
    out.add_argument("--roofline", metavar="FILE", help="roofline JSON of the card (default: the one "
                     "'gstar roofline' stored for this card, if any) for the memory / compute floor columns")
    out.add_argument("--table", nargs="+", metavar="FILE.json",
                     help="print the markdown tables (ms per case and implementation) of results saved with --json, "
                          "one per run (files of one suite, mode, timing and card, e.g. a run split by --impls, "
                          "make one table), and exit: nothing is run, no GPU needed")
    parser.add_argument("--seed", type=int, default=0, help="seed of the random inputs")


def _custom(args) -> bool:
    """Whether shape flags replace the suite."""
    return any(getattr(args, f) is not None for f in _SHAPE_FLAGS)


def timing_of(args, cuda: bool) -> str:
    """``--timing``, or its default: graph replays for the forward-only suites (decode, fp8, serving) on a GPU (a
    decode step's kernels take microseconds, less than the host needs to launch them, so eager calls would time
    the host), else eager."""
    if args.timing:
        return args.timing
    return "graph" if cuda and args.suite in FORWARD_ONLY and not _custom(args) else "eager"


def cases_from_args(args, device_type: str):
    """The cases to run: the custom shape when any shape flag is given, else the suite (shrunk on CPU)."""
    from ..bench import cases
    if _custom(args):
        dtype = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}.get(args.dtype, args.dtype)
        return cases.custom(args.seqlen or [1024], batch=args.batch or 1, heads=args.heads or 16,
                            kv_heads=args.kv_heads, head_dim=args.head_dim or 64, value_dim=args.value_dim,
                            causal=bool(args.causal),
                            window=tuple(args.window or (-1, -1)), sink_tokens=args.sink_tokens or 0,
                            sinks=bool(args.sinks), dtype=dtype or "bfloat16", softcap=args.softcap or 0.0,
                            chunk=args.chunk or 0)
    chosen = cases.suite(args.suite)
    return chosen if device_type == "cuda" else [cases.for_cpu(c) for c in chosen]


def _fmt(x, spec):
    return "-" if x is None else format(x, spec)


def _table(rows, mode, timing, console):
    from rich.markup import escape
    from rich.table import Table
    has_floor = any(r.get("floor_pct") is not None for r in rows)
    mem_what = "fwd" if mode == "fwd" else "fwd+bwd"
    t = Table(title=f"gstar bench ({mode}{', CUDA graph replays' if timing == 'graph' else ''})", show_lines=False)
    for col, just in (("case", "left"), ("impl", "left"), ("status", "left"), ("ms (median)", "right"),
                      ("TFLOP/s", "right"), (f"peak MiB ({mem_what})", "right"), ("time / gstar", "right")):
        t.add_column(col, justify=just)
    if has_floor:
        for col in ("mem floor ms", "compute floor ms", "% of floor"):
            t.add_column(col, justify="right")
    last = None
    hidden = sorted({r["impl"] for r in rows if r["reason"] == "needs CUDA"})
    for r in rows:
        if r["impl"] in hidden:
            continue
        label = r["case"]["label"] if r["case"]["label"] != last else ""
        if label and last is not None:
            t.add_section()
        last = r["case"]["label"]
        status = r["status"] if not r["reason"] else f"{r['status']} ({r['reason']})"
        style = {"ok": None, "WRONG": "bold red", "error": "red", "OOM": "yellow"}.get(r["status"], "dim")
        cells = [escape(label), r["impl"], escape(status), _fmt(r["time_ms"], ".3f"), _fmt(r["tflops"], ".3g"),
                 _fmt(r["peak_mib"], ".1f"), _fmt(r["vs_gstar"], ".2f") + ("x" if r["vs_gstar"] else "")]
        if has_floor:
            cells += [_fmt(r.get("memory_floor_ms"), ".3g"), _fmt(r.get("compute_floor_ms"), ".3g"),
                      _fmt(r.get("floor_pct"), ".3g")]
        t.add_row(*cells, style=style)
    console.print(t)
    if hidden:
        console.print(f"n/a on this machine (needs CUDA): {', '.join(hidden)}")


def _add_floors(row: dict, case, mode: str, card: dict) -> None:
    """Memory and compute floors of the case on this card (its ``gstar roofline`` measurement) and the
    percentage of the nearer (larger) floor that the row's time reaches (100 = at the roofline). FP8 cases
    count their products at twice the measured bfloat16 matmul rate, the FP8 tensor cores' rate on sm_89 and
    sm_90 (an FP8 cache under bfloat16 queries at the bfloat16 rate)."""
    from ..roofline import floors
    flops = case.flops(mode) / (2 if case.fp8 and not case.fp8_cache else 1)
    f = floors(flops, case.bytes_moved(mode), card, ms=row["time_ms"])
    row.update(memory_floor_ms=f["memory_ms"], compute_floor_ms=f["compute_ms"], bound=f["bound"],
               floor_pct=f["pct_of_floor"])


def _print_tables(paths, plot_path: str | None = None) -> int:
    """``--table``: the markdown tables of saved results on stdout, files of one run split by ``--impls`` (the
    same suite, mode, timing and card) merged into one table; with ``--plot``, their rows plotted. 2 when a
    file cannot be read as bench results."""
    from rich.console import Console
    from rich.markup import escape

    from ..bench.report import markdown_table, merge_results, plot
    runs = []
    for path in paths:
        try:
            with open(path) as f:
                runs.append(json.load(f))
            runs = merge_results(runs)
        except (OSError, ValueError, KeyError, TypeError) as exc:
            Console(stderr=True, soft_wrap=True).print(f"[red]gstar bench --table: {escape(path)}: {escape(str(exc))}")
            return 2
    for data in runs:
        print(markdown_table(data))
    if plot_path:
        rows = [r for data in runs for r in data["rows"]]
        plot(plot_path, rows, runs[0]["environment"], runs[0]["mode"])
    return 0


def run(args) -> int:
    """Run the benchmark (or print --table); exit status 1 when gstar itself (packed or padded) is WRONG or
    fails on some case, 2 for a usage error, else 0."""
    if args.table:
        return _print_tables(args.table, args.plot)
    import torch
    cuda = torch.cuda.is_available()
    if not cuda:
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before anything imports triton
    from rich.console import Console
    from rich.markup import escape
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from ..bench import peers as peer_mod
    from ..bench import report
    from ..bench.measure import make_inputs, one_cpu_thread, references
    from ..bench.runner import NOT_CAPTURABLE, add_ratios, first_line, not_measured, run_row

    console = Console(stderr=True, soft_wrap=True)
    device = torch.device("cuda" if cuda else "cpu")
    reduced = not cuda and not _custom(args)  # the suite shrunk for a CPU (bench.cases.for_cpu)
    timing = timing_of(args, cuda)
    if timing == "graph" and not cuda:
        console.print("[red]gstar bench: --timing graph replays CUDA graphs and needs a GPU")
        return 2
    if args.suite in FORWARD_ONLY and not _custom(args) and args.mode != "fwd":
        console.print(f"[red]gstar bench: the {args.suite} suite is forward only (decode steps and FP8 inputs have "
                      "no backward): --mode fwd")
        return 2
    try:
        cases = cases_from_args(args, device.type)
    except ValueError as exc:
        console.print(f"[red]gstar bench: {escape(str(exc))}")
        return 2
    if args.plot:
        try:
            import matplotlib  # noqa: F401 - fail before the run, not after it
        except ImportError:
            console.print("[red]gstar bench: --plot needs matplotlib: " + escape("pip install 'gstar[bench]'"))
            return 2
    chosen = [p for p in peer_mod.all_peers() if p.name in args.impls]
    env = report.environment(device, modules=[p.module for p in chosen])
    env["timing"] = timing
    if cuda:
        console.print(escape(f"gstar bench on {env['card']} (driver {env['driver']}, CUDA {env['cuda']}, "
                             f"torch {env['torch']}, triton {env['triton']})"))
        from ...kernels.dispatch import sitting_out
        if note := sitting_out(device):
            console.print(f"[yellow]{escape(note)}")
    else:
        shapes = ", the suite at reduced shapes" if reduced else ""
        console.print(f"[yellow]No GPU: gstar runs its tiled PyTorch path{shapes}. CPU timings are indicative "
                      "only; kernel timings need a GPU.")
    from ..roofline import load
    card = load(args.roofline) if args.roofline else (load() if cuda else None)
    if cuda and card is None:
        console.print("no roofline stored for this card (run 'gstar roofline'): floors not shown")
    rows, warned = [], False

    def save_json(complete: bool) -> None:
        # also after every case, so that a run cut short (a time limit, Ctrl-C) keeps what it measured
        add_ratios(rows)
        report.write_json(args.json, {
            "tool": "gstar bench", "suite": None if rows and rows[0]["case"]["family"] == "custom" else args.suite,
            "mode": args.mode, "complete": complete, "environment": env, "roofline": card, "rows": rows})

    total = sum(p.applies(case) for case in cases for p in chosen)
    with one_cpu_thread() if reduced else contextlib.nullcontext(), \
            Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                     console=console, transient=True) as progress:
        task = progress.add_task("bench", total=total)
        for case in cases:
            progress.update(task, description=f"{case.label}: reference")
            inputs = make_inputs(case, device, seed=args.seed)
            try:
                ref, pt = references(case, inputs, grads=args.mode != "fwd")
                missing = None
            except Exception as exc:  # e.g. too little free memory for the oracle: the case's rows say why
                ref = pt = None
                missing = f"no reference: {first_line(exc, 160)}"
            for peer in (p for p in chosen if p.applies(case)):
                progress.update(task, description=f"{case.label}: {peer.name}")
                row = (not_measured(peer, case, missing) if missing
                       else run_row(peer, case, args.mode, inputs, ref, pt, device, timing))
                if card and row["time_ms"]:
                    _add_floors(row, case, args.mode, card)
                rows.append(row)
                progress.advance(task)
                if (row["reason"] or "").startswith(NOT_CAPTURABLE) and not warned:
                    warned = True
                    console.print(f"[yellow]{peer.name} failed a CUDA graph capture: in torch 2.11 a failed "
                                  "capture can keep GPU memory for the rest of the process, so later rows may "
                                  "run out of memory; time it in a 'gstar bench --impls' call of its own")
                if not console.is_terminal:  # logs get a line per row where the live bar cannot draw
                    done = f"{row['time_ms']:.3f} ms" if row["time_ms"] else row["reason"] or ""
                    console.print(f"[{len(rows)}/{total}] {case.label}: {peer.name} "
                                  f"{row['status']} {done}", highlight=False, markup=False)
            del inputs, ref, pt
            if args.json:
                save_json(complete=False)
    add_ratios(rows)
    _table(rows, args.mode, timing, Console(width=None if sys.stdout.isatty() else 200))
    if args.json:
        save_json(complete=True)
    if args.csv:
        report.write_csv(args.csv, rows, env, args.mode)
    if args.plot:
        report.plot(args.plot, rows, env, args.mode, args.plot_metric)
    ours = {p.name for p in chosen if isinstance(p, peer_mod.Gstar)}
    bad = [r for r in rows if r["impl"] in ours and r["status"] in ("WRONG", "error")]
    return 1 if bad else 0
