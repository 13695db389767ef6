"""GPU timing for ``gstar bench``, ``gstar check`` and the roofline: the median of many timed calls, each after an
L2 flush that leaves the cache clean.

``triton.testing.do_bench`` flushes by zeroing a 256 MB buffer, which leaves the whole L2 (50 MB on an H100 or
H200) dirty: the timed call then pays for writing those lines back as its own reads evict them, about 5 us on
an H200, a tenth of a long decode step.
Here the flush reads the buffer instead, so each call starts from a cold L2 holding no one's writes. The rest
follows ``do_bench``: five calls estimate the time, then warm-up calls for ``warmup_ms`` and timed calls for
``rep_ms``, each between CUDA events.
"""

from __future__ import annotations

import statistics

import torch

FLUSH_BYTES = 256 << 20  # several times any L2 cache


def gpu_median_ms(fn, *, warmup_ms: float = 25, rep_ms: float = 100) -> float:
    """Median milliseconds of ``fn()`` on the current CUDA device, the L2 flushed clean before each call."""
    flush_buffer = torch.empty(FLUSH_BYTES // 8, dtype=torch.int64, device="cuda")

    def flush():
        flush_buffer.sum()  # reads every line: a clean L2, the writes of earlier calls written back here

    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(5):
        flush()
        fn()
    end.record()
    torch.cuda.synchronize()
    estimate_ms = start.elapsed_time(end) / 5  # the flushes included, as in do_bench
    for _ in range(max(1, int(warmup_ms / estimate_ms))):
        fn()
    runs = max(1, int(rep_ms / estimate_ms))
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(runs)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(runs)]
    for s, e in zip(starts, ends):
        flush()
        s.record()
        fn()
        e.record()
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in zip(starts, ends))
