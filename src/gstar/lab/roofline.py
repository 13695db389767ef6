"""The card's roofline: measured memory and matmul ceilings, stored as JSON for ``gstar bench``'s floor
columns (docs/design.md section 5).

``measure()`` times, on the current GPU, a device-to-device copy, the three primers (``vector_add`` and
``matrix_add`` in CUDA C++, ``weighted_row_sum`` in Triton) on buffers many times the L2 cache, and a
bfloat16 matmul through torch. Bandwidth is (bytes read + bytes written) / median time. ``save()`` and
``load()`` keep one JSON file per card under ``benchmarks/results/``; ``floors()`` turns a kernel's FLOPs and
bytes into the two lower bounds on its run time.

The JSON (``SCHEMA`` = 1)::

    {"schema": 1, "card": "NVIDIA H100 80GB HBM3", "card_slug": "nvidia-h100-80gb-hbm3",
     "driver": "580.159.04", "cuda": "13.0", "torch": "2.11.0+cu130", "triton": "3.6.0",
     "sm_count": 132, "l2_bytes": 52428800, "created": "2026-11-26T02:00:00+00:00",
     "dtype": "bfloat16", "buffer_bytes": 1073741824,
     "copy_gbps": 3000.0, "memory_gbps": 3050.0, "matmul_tflops": 790.0, "matmul_shape": [8192, 8192, 8192],
     "kernels": {"copy": {...}, "vector_add": {...}, "matrix_add": {...}, "weighted_row_sum": {...}}}

where each kernel entry is ``{"shape": [...], "bytes": int, "ms": float, "gbps": float, "pct_of_copy":
float}``. ``memory_gbps`` is the best streaming rate seen (the copy or any primer): the memory ceiling that
``floors()`` uses. Triton is imported only inside ``measure()``, so importing this module is cheap and
leaves ``TRITON_INTERPRET`` decisions to the caller.
"""

from __future__ import annotations

import datetime
import json
import math
import re
import shutil
import subprocess
from pathlib import Path

import torch

from .timing import gpu_median_ms

SCHEMA = 1
PRIMERS = ("vector_add", "matrix_add", "weighted_row_sum")
_ROW_LENGTH = 8192  # columns of the matrices the 2-D primers stream: long rows, 16-byte aligned


def results_dir() -> Path:
    """``benchmarks/results/`` of the source checkout gstar runs from, else of the working directory."""
    checkout = Path(__file__).resolve().parents[2]
    root = checkout if (checkout / "pyproject.toml").is_file() else Path.cwd()
    return root / "benchmarks" / "results"


def card_slug(name: str) -> str:
    """``"NVIDIA H100 80GB HBM3"`` -> ``"nvidia-h100-80gb-hbm3"``: the card part of the JSON file name."""
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")


def default_path(card: str, directory: str | Path | None = None) -> Path:
    """``<directory or results_dir()>/roofline-<card-slug>.json``."""
    return Path(directory or results_dir()) / f"roofline-{card_slug(card)}.json"


def _driver_version() -> str | None:
    try:
        import pynvml  # nvidia-ml-py, where installed

        pynvml.nvmlInit()
        version = pynvml.nvmlSystemGetDriverVersion()
        return version.decode() if isinstance(version, bytes) else version
    except Exception:  # noqa: BLE001 - any failure just means "ask nvidia-smi"
        pass
    if shutil.which("nvidia-smi") is None:
        return None
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=30, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    return out.splitlines()[0].strip() if out.strip() else None


def _median_ms(fn) -> float:
    return gpu_median_ms(fn, rep_ms=200)


def _entry(shape, bytes_moved: int, ms: float) -> dict:
    return {"shape": list(shape), "bytes": int(bytes_moved), "ms": ms, "gbps": bytes_moved / ms / 1e6}


def measure(*, buffer_bytes: int = 1 << 30, dtype: torch.dtype = torch.bfloat16, matmul_n: int = 8192,
            device: int | str | torch.device | None = None, progress=None) -> dict:
    """Measure the roofline of one CUDA device and return it as the JSON-ready dict described above.

    Args:
        buffer_bytes: size of each input buffer (the copy's source, each operand of the adds, the row sum's
            matrix). Keep it many times the L2 cache (50 MB on an H100): the default is 1 GiB.
        dtype: element type of the streamed buffers (bandwidth barely depends on it).
        matmul_n: the matmul is ``(n, n) @ (n, n)`` in bfloat16; its rate is ``2 n^3 / median time``.
        device: the CUDA device (default: the current one).
        progress: optional ``callable(str)`` told which measurement starts.

    Raises ``RuntimeError`` without a CUDA device. Each measurement frees its buffers before the next. The
    primers allocate their outputs through ``gstar.buffers``: run without ``GSTAR_POISON=1``, or
    the NaN fill is timed too.
    """
    if not torch.cuda.is_available():
        raise RuntimeError("measuring the roofline needs a CUDA device")
    import triton

    from .cuda import matrix_add, vector_add
    from .primers import weighted_row_sum

    device = torch.device("cuda", torch.cuda.current_device()) if device is None else torch.device(device)
    say = progress or (lambda _msg: None)
    props = torch.cuda.get_device_properties(device)
    elem = torch.empty((), dtype=dtype).element_size()
    n = buffer_bytes // elem
    rows = max(1, n // _ROW_LENGTH)
    kernels = {}
    with torch.cuda.device(device):
        say("copy")
        src = torch.randn(n, device=device).to(dtype)
        dst = torch.empty_like(src)
        kernels["copy"] = _entry(src.shape, 2 * n * elem, _median_ms(lambda: dst.copy_(src)))
        del dst

        say("vector_add")
        other = torch.randn(n, device=device).to(dtype)
        kernels["vector_add"] = _entry(src.shape, 3 * n * elem, _median_ms(lambda: vector_add(src, other)))

        say("matrix_add")
        a = src[: rows * _ROW_LENGTH].view(rows, _ROW_LENGTH)
        b = other[: rows * _ROW_LENGTH].view(rows, _ROW_LENGTH)
        kernels["matrix_add"] = _entry(a.shape, 3 * a.numel() * elem, _median_ms(lambda: matrix_add(a, b)))
        del other, b

        say("weighted_row_sum")
        w = torch.randn(_ROW_LENGTH, device=device).to(dtype)
        kernels["weighted_row_sum"] = _entry(a.shape, (a.numel() + _ROW_LENGTH + rows) * elem,
                                             _median_ms(lambda: weighted_row_sum(a, w)))
        del a, w, src
        torch.cuda.empty_cache()

        say("matmul")
        x = torch.randn(matmul_n, matmul_n, device=device, dtype=torch.bfloat16)
        y = torch.randn(matmul_n, matmul_n, device=device, dtype=torch.bfloat16)
        matmul_ms = _median_ms(lambda: x @ y)
        del x, y
        torch.cuda.empty_cache()

    copy_gbps = kernels["copy"]["gbps"]
    for entry in kernels.values():
        entry["pct_of_copy"] = 100.0 * entry["gbps"] / copy_gbps
    return {
        "schema": SCHEMA,
        "card": props.name,
        "card_slug": card_slug(props.name),
        "driver": _driver_version(),
        "cuda": torch.version.cuda,
        "torch": torch.__version__,
        "triton": triton.__version__,
        "sm_count": props.multi_processor_count,
        "l2_bytes": getattr(props, "L2_cache_size", None),
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "dtype": str(dtype).removeprefix("torch."),
        "buffer_bytes": n * elem,
        "copy_gbps": copy_gbps,
        "memory_gbps": max(e["gbps"] for e in kernels.values()),
        "matmul_tflops": 2 * matmul_n ** 3 / matmul_ms / 1e9,
        "matmul_shape": [matmul_n, matmul_n, matmul_n],
        "kernels": kernels,
    }


def save(result: dict, path: str | Path | None = None) -> Path:
    """Write ``result`` as indented JSON to ``path`` (default :func:`default_path` of its card); returns it."""
    path = Path(path) if path is not None else default_path(result["card"])
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=2, sort_keys=True) + "\n")
    return path


def load(path: str | Path | None = None, *, card: str | None = None,
         directory: str | Path | None = None) -> dict | None:
    """A stored roofline, or None.

    With ``path``: that file (``FileNotFoundError`` if missing). Otherwise the newest (by its ``created``
    field) ``roofline-*.json`` in ``directory`` (default :func:`results_dir`) whose
    ``card`` equals ``card`` (default: the current CUDA device's name). Returns None when nothing matches,
    or when no card is given and there is no CUDA device. Files of another schema are ignored.
    """
    if path is not None:
        return json.loads(Path(path).read_text())
    if card is None:
        if not torch.cuda.is_available():
            return None
        card = torch.cuda.get_device_name()
    best = None
    for candidate in Path(directory or results_dir()).glob("roofline-*.json"):
        try:
            data = json.loads(candidate.read_text())
        except (OSError, ValueError):
            continue
        if not isinstance(data, dict) or data.get("schema") != SCHEMA or data.get("card") != card:
            continue
        if best is None or str(data.get("created", "")) > str(best.get("created", "")):
            best = data
    return best


def floors(flops: float, bytes_moved: float, roofline: dict, ms: float | None = None) -> dict:
    """The two lower bounds on a kernel's time on the card of ``roofline``, and which one binds.

    Args:
        flops: floating-point operations the kernel must do (matmul FLOPs: ``2 * m * n * k``).
        bytes_moved: bytes it must read from and write to device memory at least once.
        roofline: a dict from :func:`measure` / :func:`load` (uses ``matmul_tflops`` and ``memory_gbps``,
            falling back to ``copy_gbps``).
        ms: the kernel's measured time, if known.

    Returns:
        ``{"compute_ms": flops / matmul rate, "memory_ms": bytes / memory rate, "floor_ms": the larger,
        "bound": "compute" or "memory" (the larger one: the ceiling the kernel is nearer to),
        "pct_of_floor": 100 * floor_ms / ms}`` (the last only when ``ms`` is given; 100 = at the roofline).

    Example: 1e12 FLOPs and 1e9 bytes on a card of 800 TFLOP/s and 3000 GB/s give compute 1.25 ms,
    memory 0.333 ms, so the floor is 1.25 ms, compute-bound; a kernel taking 2.5 ms reaches 50%.
    """
    tflops = float(roofline["matmul_tflops"])
    gbps = float(roofline.get("memory_gbps") or roofline["copy_gbps"])
    if not (tflops > 0 and gbps > 0):
        raise ValueError(f"roofline rates must be positive, got {tflops} TFLOP/s and {gbps} GB/s")
    if flops < 0 or bytes_moved < 0:
        raise ValueError(f"flops and bytes_moved must be >= 0, got {flops} and {bytes_moved}")
    compute_ms = flops / (tflops * 1e9)
    memory_ms = bytes_moved / (gbps * 1e6)
    result = {"compute_ms": compute_ms, "memory_ms": memory_ms, "floor_ms": max(compute_ms, memory_ms),
              "bound": "compute" if compute_ms >= memory_ms else "memory"}
    if ms is not None:
        result["pct_of_floor"] = 100.0 * result["floor_ms"] / ms if ms > 0 else math.nan
    return result
