"""``gstar roofline``: measure this GPU's memory and matmul ceilings and store them for ``gstar bench``
(docs/design.md section 5).

Times a device-to-device copy, the three primers (``vector_add``, ``matrix_add`` in CUDA C++,
``weighted_row_sum`` in Triton) on 1 GiB buffers and a bfloat16 8192^3 matmul, prints a table and writes
``benchmarks/results/roofline-<card>.json`` (see :mod:`gstar.lab.roofline` for the format).

Without a CUDA device it says that a GPU is required and exits with status 1: nothing was measured.
"""

from __future__ import annotations

import argparse
from pathlib import Path

_DTYPES = ("bfloat16", "float16", "float32")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of ``gstar roofline``."""
    parser.add_argument("--json", type=Path, default=None, metavar="FILE",
                        help="where to write the results (default: benchmarks/results/roofline-<card>.json)")
    parser.add_argument("--no-save", action="store_true", help="print the table only")
    parser.add_argument("--gib", type=float, default=1.0,
                        help="size of each streamed input buffer in GiB; keep it many times the L2 cache "
                             "(default: 1)")
    parser.add_argument("--dtype", choices=_DTYPES, default="bfloat16",
                        help="element type of the streamed buffers (default: bfloat16)")
    parser.add_argument("--matmul-n", type=int, default=8192,
                        help="the matmul is (n, n) @ (n, n) in bfloat16 (default: 8192)")


def _table(result: dict):
    from rich.table import Table

    table = Table(title=f"roofline of {result['card']} (driver {result['driver']}, torch {result['torch']}, "
                        f"triton {result['triton']})")
    for column in ("kernel", "shape", "dtype", "MiB moved", "median ms", "GB/s", "% of copy"):
        table.add_column(column, justify="left" if column in ("kernel", "shape", "dtype") else "right")
    for name, entry in result["kernels"].items():
        table.add_row(name, "x".join(map(str, entry["shape"])), result["dtype"],
                      f"{entry['bytes'] / 2**20:,.0f}", f"{entry['ms']:.3f}", f"{entry['gbps']:,.0f}",
                      f"{entry['pct_of_copy']:.1f}")
    m, n, k = result["matmul_shape"]
    table.add_row("matmul", f"{m}x{n}x{k}", "bfloat16", "", "", f"{result['matmul_tflops']:,.0f} TFLOP/s", "")
    return table


def run(args: argparse.Namespace) -> int:
    """Measure, print, save. Returns 0, or 1 without a GPU (nothing measured), 2 for bad options."""
    import torch
    from rich.console import Console

    console, errors = Console(), Console(stderr=True)
    if not torch.cuda.is_available():
        errors.print("[red]gstar roofline: a CUDA GPU is required, and torch sees none "
                      "(torch.cuda.is_available() is False): nothing measured.")
        return 1
    if args.gib <= 0 or args.matmul_n <= 0:
        errors.print("[red]gstar roofline: --gib and --matmul-n must be positive[/red]")
        return 2
    from .. import roofline

    with console.status("measuring") as status:
        result = roofline.measure(buffer_bytes=int(args.gib * 2**30), dtype=getattr(torch, args.dtype),
                                  matmul_n=args.matmul_n, progress=lambda name: status.update(f"timing {name}"))
    console.print(_table(result))
    console.print(f"memory ceiling {result['memory_gbps']:,.0f} GB/s, matmul ceiling "
                  f"{result['matmul_tflops']:,.0f} TFLOP/s")
    if not args.no_save:
        console.print(f"wrote {roofline.save(result, args.json)}")
    return 0
