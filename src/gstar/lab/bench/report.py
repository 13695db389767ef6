"""Where results go: the machine's description (the card and versions that docs/design.md section 5 asks
every result to carry), JSON, CSV, the plot against sequence length, and the markdown table of a saved JSON
(``gstar bench --table``)."""

from __future__ import annotations

import csv
import datetime
import importlib.metadata as md
import json
import platform
import shlex
import subprocess
import sys

import torch


def _dist_version(module: str) -> str | None:
    """Version of the installed distribution that provides top-level ``module`` (None if not installed)."""
    for dist in md.packages_distributions().get(module, []) or [module]:
        try:
            return md.version(dist)
        except md.PackageNotFoundError:
            continue
    return None


def _driver() -> str | None:
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip().splitlines()[0] if out.returncode == 0 and out.stdout.strip() else None


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _command() -> str:
    """This process's command line, as ``gstar ...`` when it is the gstar console script or its module."""
    if sys.argv and sys.argv[0].endswith(("gstar", "main.py", "__main__.py")):
        return shlex.join(["gstar"] + sys.argv[1:])
    return shlex.join(sys.argv)


def environment(device: torch.device, modules=()) -> dict:
    """Card, driver, CUDA, torch, triton and peer versions, the date and the command line of this run."""
    from ... import __version__
    cuda = device.type == "cuda"
    return {
        "device": device.type,
        "card": torch.cuda.get_device_name(device) if cuda else _cpu_name(),
        "driver": _driver() if cuda else None,
        "cuda": torch.version.cuda if cuda else None,
        "torch": torch.__version__,
        "triton": _dist_version("triton"),
        "python": platform.python_version(),
        "gstar": __version__,
        "peers": {m: _dist_version(m) for m in modules if m not in ("torch", "gstar")},
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": _command(),
    }


def write_json(path: str, payload: dict) -> None:
    with open(path, "w") as f:
        json.dump(payload, f, indent=2)
        f.write("\n")


CSV_CASE_FIELDS = ("family", "batch", "heads", "kv_heads", "seqlen", "head_dim", "value_dim", "causal", "window_left",
                   "window_right", "sink_tokens", "sinks", "dtype", "lengths", "queries", "page_size", "softcap",
                   "chunk", "query_lengths", "latent")
CSV_ROW_FIELDS = ("impl", "status", "reason", "time_ms", "tflops", "peak_mib", "vs_gstar", "max_error",
                  "memory_floor_ms", "compute_floor_ms", "bound", "floor_pct")
CSV_ENV_FIELDS = ("card", "driver", "cuda", "torch", "triton", "timing", "date", "command")


def write_csv(path: str, rows: list[dict], env: dict, mode: str) -> None:
    """One line per (case, implementation), with the environment repeated on each line."""
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(CSV_CASE_FIELDS + ("mode",) + CSV_ROW_FIELDS + CSV_ENV_FIELDS)
        for r in rows:
            c = dict(r["case"], window_left=r["case"]["window"][0], window_right=r["case"]["window"][1])
            errors = [ch["error"] for ch in r["checks"]]
            row = dict(r, max_error=max(errors) if errors else None)
            w.writerow([c.get(k) for k in CSV_CASE_FIELDS] + [mode] + [row.get(k) for k in CSV_ROW_FIELDS]
                       + [env.get(k) for k in CSV_ENV_FIELDS])


def merge_results(runs: list[dict]) -> list[dict]:
    """Saved results with the runs of one suite, mode, timing and card merged (their rows in order, the
    peers' versions joined): a run split by ``--impls`` over several processes reads as one."""
    merged: dict[tuple, dict] = {}
    for data in runs:
        env = data["environment"]
        key = (data.get("suite"), data["mode"], env.get("timing"), env.get("card"), env.get("torch"))
        if key not in merged:
            merged[key] = dict(data, rows=list(data["rows"]), environment=dict(env, peers=dict(env.get("peers", {}))))
            continue
        into = merged[key]
        into["rows"] += data["rows"]
        into["environment"]["peers"].update(env.get("peers", {}))
        into["complete"] = into.get("complete", True) and data.get("complete", True)
    return list(merged.values())


def _plot_series(row: dict) -> str:
    """The subplot of a row: its case's series, packed documents apart from dense batches of the same heads
    (a packed case's length is its longest document's)."""
    case = row["case"]
    return ("packed " if case.get("lengths") and not case.get("queries") else "") + row["series"]


def plot(path: str, rows: list[dict], env: dict, mode: str, metric: str = "tflops") -> None:
    """TFLOP/s (or time) against sequence length, one subplot per case series, one line per implementation
    in the same colour in every subplot; decode and serving steps (whose cases differ in batch as well as
    length) as time per case beside its floor."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if rows and all(r["case"].get("family") in ("decode", "serving") for r in rows):
        return _plot_decode(plt, path, rows, env, rows[0]["case"]["family"])
    key = "tflops" if metric == "tflops" else "time_ms"
    series = list(dict.fromkeys(_plot_series(r) for r in rows))
    impls = list(dict.fromkeys(r["impl"] for r in rows))
    cols = min(3, max(1, len(series)))
    nrows = -(-len(series) // cols)
    fig, axes = plt.subplots(nrows, cols, figsize=(5.5 * cols, 4 * nrows), squeeze=False)
    for ax, name in zip(axes.flat, series):
        by_impl: dict[str, list] = {}
        for r in rows:
            if _plot_series(r) == name and r[key] is not None:
                by_impl.setdefault(r["impl"], []).append((r["case"]["seqlen"], r[key], r["status"]))
        for impl, pts in by_impl.items():
            pts.sort()
            wrong = any(s == "WRONG" for _, _, s in pts)
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="x" if wrong else "o",
                    color=f"C{impls.index(impl) % 10}", linestyle=":" if wrong else "-",
                    label=impl + (" (WRONG)" if wrong else ""))
        ax.set_xscale("log", base=2)
        ax.set_ylim(bottom=0)
        ax.set_title(name, fontsize=9)
        ax.set_xlabel("sequence length")
        ax.set_ylabel("TFLOP/s (visible pairs)" if key == "tflops" else "median time (ms)")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    for ax in list(axes.flat)[len(series):]:
        ax.axis("off")
    _save(plt, fig, path, env, mode)


def _plot_decode(plt, path: str, rows: list[dict], env: dict, what: str = "decode") -> None:
    """One group of bars per case (time, log scale), one bar per implementation, the case's floor a line: the
    larger of memory and compute where the run knew both, else the memory floor."""
    cases = list(dict.fromkeys(r["case"]["label"] for r in rows))
    impls = list(dict.fromkeys(r["impl"] for r in rows))
    at = {(r["case"]["label"], r["impl"]): r for r in rows}
    fig, ax = plt.subplots(figsize=(max(8.0, 0.7 * len(cases)), 7))
    width = 0.8 / len(impls)
    for k, impl in enumerate(impls):
        xs, ys = [], []
        for i, case in enumerate(cases):
            r = at.get((case, impl))
            if r is not None and r["status"] == "ok" and r["time_ms"]:
                xs.append(i - 0.4 + (k + 0.5) * width)
                ys.append(r["time_ms"])
        ax.bar(xs, ys, width, label=impl)
    for i, case in enumerate(cases):
        floor = next((max(r["memory_floor_ms"], r.get("compute_floor_ms") or 0) for r in rows
                      if r["case"]["label"] == case and r.get("memory_floor_ms")), None)
        if floor:
            ax.hlines(floor, i - 0.45, i + 0.45, colors="black", linewidth=1.5, label="floor" if i == 0 else None)
    ax.set_yscale("log")
    ax.set_xticks(range(len(cases)))
    ax.set_xticklabels(cases, rotation=60, ha="right", fontsize=7)
    ax.set_ylabel("time (ms, log scale)")
    ax.grid(True, axis="y", alpha=0.3)
    ax.legend(fontsize=8)
    _save(plt, fig, path, env, what)


def _save(plt, fig, path: str, env: dict, what: str) -> None:
    """Title the figure with the run (what, timing, card, versions) and write it."""
    graphs = ", CUDA graph replays" if env.get("timing") == "graph" else ""
    fig.suptitle(f"gstar bench, {what}{graphs}: {env['card']} (torch {env['torch']}, triton {env['triton']})",
                 fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _cell(row: dict | None) -> str:
    if row is None:
        return "-"
    if row["status"] not in ("ok", "WRONG"):
        return "n/a"
    return f"{row['time_ms']:.3f}" + (" (wrong)" if row["status"] == "WRONG" else "")


def _floor(rows: dict) -> str:
    """The case's floor on the run's card (the larger of memory and compute) and which one it is, or ``-``."""
    for r in rows.values():
        if r.get("memory_floor_ms") is not None:
            return f"{max(r['memory_floor_ms'], r['compute_floor_ms']):.3g} ({r['bound']})"
    return "-"


def markdown_table(data: dict) -> str:
    """The markdown table of a ``gstar bench --json`` file: a line naming the mode, the timing, the card and
    the versions, then one row per case and one column per implementation (median ms; ``(wrong)`` for a row
    that missed the correctness bar, ``n/a`` for one not measured, ``-`` for one not run), and a last column
    with the case's floor when the run knew the card's roofline."""
    env = data["environment"]
    impls = list(dict.fromkeys(r["impl"] for r in data["rows"]))
    cases: dict[str, dict] = {}
    for r in data["rows"]:
        cases.setdefault(r["case"]["label"], {})[r["impl"]] = r
    floors = any(r.get("memory_floor_ms") is not None for r in data["rows"])
    graphs = ", CUDA graph replays" if env.get("timing") == "graph" else ""
    partial = " (a run cut short)" if data.get("complete") is False else ""
    columns = impls + (["floor"] if floors else [])
    lines = [f"{data['mode']}{graphs}, ms (median), {env.get('card')}, torch {env.get('torch')}, "
             f"triton {env.get('triton')}{partial}:", "",
             "| case | " + " | ".join(columns) + " |", "|---" * (len(columns) + 1) + "|"]
    for label, rows in cases.items():
        cells = [_cell(rows.get(i)) for i in impls] + ([_floor(rows)] if floors else [])
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"
