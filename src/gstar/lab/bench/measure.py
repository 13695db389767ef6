"""Measurement shared by ``gstar check`` and ``gstar bench``: inputs, the oracle, the bar, time, memory.

- The oracle is :func:`gstar.reference.naive_attention`, run in pieces (batch elements, groups of kv
  heads and, for patterns with no key right of the diagonal, blocks of query rows) so that it fits in
  memory at the gpt-oss and long-context shapes; each piece is exact, so the result equals one big call.
  It takes the case's whole rule: pattern (chunk included), learned sinks and logit soft-cap.
- Time: :func:`gstar.lab.timing.gpu_median_ms` (median, the L2 flushed clean before each call) on a GPU; on a CPU
  the median of several wall-clock runs after a warm-up, contenders taking turns (:func:`race_ms`). CPU timings
  are indicative only.
- Peak memory: the bytes allocated at the peak of one call beyond what was allocated before it, plus the
  bytes of the inputs the call reads (so "inputs + everything the call needs"). On a GPU this comes from
  ``torch.cuda.max_memory_allocated``; on a CPU from the PyTorch profiler's allocation events (it sees
  PyTorch tensors only, not the NumPy buffers of the Triton interpreter).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import statistics
import sys
import time

import torch

from ..accuracy import Verdict, relative_error, verdict
from ...fp8 import dequantize, quantize_fp8
from ...reference import naive_attention
from ..timing import gpu_median_ms
from .cases import Case

FLOAT32_BAR = 1e-4  # docs/design.md section 4: float32 inputs must reach this relative error
MIN_PIECE_ROWS = 64  # the oracle's smallest piece of query rows


def make_inputs(case: Case, device, *, seed: int = 0) -> dict:
    """``q, k, v`` (and ``sinks``, ``dout``) for ``case``: standard normal, the same for every implementation.

    q: (B, Hq, N, D), k: (B, Hkv, N, D), v: (B, Hkv, N, Dv) in the case's dtype (FP8: quantised per head,
    with ``q_descale``, ``k_descale``, ``v_descale`` (B, Hkv) beside them); sinks: (Hq,) float32 or
    None; dout: (B, Hq, N, Dv), the upstream gradient of the backward modes. A packed case's tensors are
    (total, H, D or Dv) instead. A decode case's q and dout hold its Nq queries, k and v its cache (random
    past each sequence's length too, so that reading there shows); a paged one adds ``k_pages`` and
    ``v_pages``, the same cache as its pool (``Case.to_pages``). A latent case's v and v_pages are views of the
    first Dv lanes of k and k_pages (one cache, ``Case.latent``). A mixed step's q and dout are packed,
    ``(total_q, Hq, D)``, its cache as a decode case's.
    """
    g = torch.Generator(device=device).manual_seed(seed)
    rand = lambda *shape: torch.randn(*shape, generator=g, device=device, dtype=torch.float32)  # noqa: E731

    def tokens(heads, width, rows, packed=case.packed):  # (B, H, rows, width), or (total, H, width) packed
        shape = (case.tokens, heads) if packed else (case.batch, heads, rows)
        return rand(*shape, width).to(torch.float32 if case.fp8 else case.torch_dtype)  # FP8: quantised below
    nq, packed_q = case.queries or case.seqlen, case.packed or case.mixed
    inputs = {"q": tokens(case.heads, case.head_dim, nq, packed_q),
              "k": tokens(case.kv_heads, case.head_dim, case.seqlen)}
    inputs["v"] = inputs["k"][..., :case.dv] if case.latent else tokens(case.kv_heads, case.dv, case.seqlen)
    inputs.update(sinks=rand(case.heads) if case.sinks else None, dout=tokens(case.heads, case.dv, nq, packed_q))
    if case.fp8:  # each head at its own magnitude, quantised per head (queries per GQA group)
        for name, heads in (("q", case.heads), ("k", case.kv_heads), ("v", case.kv_heads)):
            x = inputs[name].float() * (rand(heads).abs() + 0.5).view(1, heads, 1, 1)
            if name == "q" and case.fp8_cache:  # bfloat16 queries, no descale
                inputs["q"], inputs["q_descale"] = x.to(torch.bfloat16), None
                continue
            inputs[name], inputs[f"{name}_descale"] = quantize_fp8(
                x, kv_heads=case.kv_heads if name == "q" else None)
    if case.paged:
        k_pages = case.to_pages(inputs["k"])
        inputs.update(k_pages=k_pages, v_pages=k_pages[..., :case.dv] if case.latent else case.to_pages(inputs["v"]))
    return inputs


def fp8_descales(inputs: dict) -> dict:
    """The descale keywords of an FP8 case's inputs."""
    return {name: inputs[name] for name in ("q_descale", "k_descale", "v_descale")}


def dequantized(case: Case, inputs: dict) -> dict:
    """An FP8 case's inputs as float32 values (``x * descale``; bfloat16 queries as they are), what the references
    attend to."""
    return dict(inputs, **{name: inputs[name].float() if inputs[f"{name}_descale"] is None else
                           dequantize(inputs[name], inputs[f"{name}_descale"], None, torch.float32)
                           for name in ("q", "k", "v")})


_BUDGET_RULE = "a quarter of the free GPU memory, at most 4 GiB; 512 MiB on CPU"


def _budget(device: torch.device) -> int:
    """Bytes the oracle may hold at once: _BUDGET_RULE."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return min(4 << 30, free // 4)
    return 512 << 20


def naive_reference(case: Case, inputs: dict, dtype: torch.dtype, *, grads: bool) -> dict:
    """``naive_attention`` of ``inputs`` computed in ``dtype``: ``out`` and, with ``grads``, ``dq dk dv``
    (and ``dsinks``) for the upstream gradient ``inputs["dout"]``. Results keep ``dtype`` and the layout of
    the inputs. The case's soft-cap and chunk go to every call (a packed case's chunks count from each
    document's start, a decode case's from its cache's first key, as in gstar's entry points).
    """
    if case.packed:
        res = _per_document(case, inputs, dtype, grads)
    elif case.decode and case.lengths:
        res = _per_cache(case, inputs, dtype, grads)
    else:
        res = _dense(case, inputs, dtype, grads)
    return {name: x.to(dtype) for name, x in res.items()}


def _dense(case: Case, inputs: dict, dtype: torch.dtype, grads: bool) -> dict:
    """:func:`naive_reference` of a batch of equal lengths, in pieces; ``dk dv dsinks`` stay in the float32 (or
    wider) sums they are accumulated in."""
    q, k, v, sinks, dout = (inputs[n] for n in ("q", "k", "v", "sinks", "dout"))
    B, Hq, Nq, D = q.shape
    Hkv, Nk = k.shape[1], k.shape[2]
    group = Hq // Hkv
    p = case.pattern
    # ~8 float32 buffers of Nk keys per (row, head) while the score matrix and its gradient are alive; per kv
    # head its keys and values repeated for the group in the oracle's dtype (what a decode step's few rows need)
    row_bytes = group * Nk * 4 * 8
    copy_bytes = Nk * (D + v.shape[-1]) * dtype.itemsize  # one query head's copy of its kv head's keys and values
    head_bytes = row_bytes * Nq + group * copy_bytes
    budget, min_rows = _budget(q.device), min(MIN_PIECE_ROWS, Nq)
    rows_fit = budget // row_bytes
    if rows_fit < min_rows:  # thinner pieces take hours (one autograd call each)
        raise MemoryError(f"the oracle needs {min_rows * row_bytes / 2**30:.2f} GiB for pieces of {min_rows} "
                          f"rows, over its budget of {budget / 2**30:.2f} GiB ({_BUDGET_RULE})")
    kv_step = max(1, min(Hkv, budget // head_bytes))
    # A block of rows is exact with the keys up to its last row's position when no key lies right of p(i)
    # (right bound 0: the piece's bottom-right alignment keeps every row's position, so its chunk too), or with
    # all keys when nothing depends on position (no bound, no chunk); other patterns take all rows in one piece.
    prefix = p.right == 0
    rowwise = prefix or (p.left < 0 and p.right < 0 and not p.chunk)
    row_step = min(Nq, rows_fit) if (kv_step == 1 and rowwise) else Nq
    # a group whose copies of its keys and values alone overflow the budget (a hundred query heads on one long kv
    # head: latent decoding) is cut into pieces of its query heads
    heads_step = group * kv_step if group * copy_bytes <= budget else \
        max(1, min(group, budget // (copy_bytes + row_step * row_bytes // group)))
    acc = torch.promote_types(dtype, torch.float32)  # dk, dv, dsinks sum over pieces
    out = torch.empty(B, Hq, Nq, v.shape[-1], dtype=dtype, device=q.device)                  # (B, Hq, Nq, Dv)
    if grads:
        dq = torch.empty(q.shape, dtype=dtype, device=q.device)
        dk = torch.zeros(k.shape, dtype=acc, device=q.device)
        dv = torch.zeros(v.shape, dtype=acc, device=q.device)
        dsinks = None if sinks is None else torch.zeros(Hq, dtype=acc, device=q.device)
    for b in range(B):
        for g0 in range(0, Hkv, kv_step):
            g1 = min(Hkv, g0 + kv_step)
            for h0 in range(g0 * group, g1 * group, heads_step):
                h1 = min(g1 * group, h0 + heads_step)
                for r0 in range(0, Nq, row_step):
                    r1 = min(Nq, r0 + row_step)
                    ke = Nk - Nq + r1 if prefix else Nk  # keys [0, ke) hold every key rows r0..r1 see
                    piece = [q[b:b + 1, h0:h1, r0:r1], k[b:b + 1, g0:g1, :ke], v[b:b + 1, g0:g1, :ke]]
                    piece = [t.detach().to(dtype).requires_grad_(grads) for t in piece]
                    sk = None if sinks is None else sinks[h0:h1].detach().to(dtype).requires_grad_(grads)
                    with torch.enable_grad() if grads else torch.no_grad():
                        o, _ = naive_attention(*piece, causal=case.causal, window=case.window,
                                               sink_tokens=case.sink_tokens, sinks=sk, softcap=case.softcap,
                                               chunk=case.chunk)
                    out[b:b + 1, h0:h1, r0:r1] = o.detach()
                    if grads:
                        wrt = piece + ([sk] if sk is not None else [])
                        gs = torch.autograd.grad(o, wrt, dout[b:b + 1, h0:h1, r0:r1].to(dtype))
                        dq[b:b + 1, h0:h1, r0:r1] = gs[0]
                        dk[b:b + 1, g0:g1, :ke] += gs[1]
                        dv[b:b + 1, g0:g1, :ke] += gs[2]
                        if sk is not None:
                            dsinks[h0:h1] += gs[3]
                    del piece, sk, o
    if not grads:
        return {"out": out}
    res = {"out": out, "dq": dq, "dk": dk, "dv": dv}
    if dsinks is not None:
        res["dsinks"] = dsinks
    return res


def _per_document(case: Case, inputs: dict, dtype: torch.dtype, grads: bool) -> dict:
    """:func:`naive_reference` of a packed case: each document as a batch of one (docs/design.md section 2),
    ``dsinks`` summed over the documents in its accumulation dtype."""
    pieces, dsinks, start = {}, 0, 0
    for n in case.lengths:
        doc = dataclasses.replace(case, batch=1, seqlen=n, lengths=())
        rows = slice(start, start + n)
        dense = {name: inputs[name][rows].transpose(0, 1)[None] for name in ("q", "k", "v", "dout")}  # (1, H, n, D)
        for name, x in _dense(doc, dict(dense, sinks=inputs["sinks"]), dtype, grads).items():
            if name == "dsinks":
                dsinks = dsinks + x
            else:
                pieces.setdefault(name, []).append(x[0].transpose(0, 1))               # (n, H, D)
        start += n
    res = {name: torch.cat(xs) for name, xs in pieces.items()}                          # (total, H, D)
    if grads and inputs["sinks"] is not None:
        res["dsinks"] = dsinks
    return res


def _per_cache(case: Case, inputs: dict, dtype: torch.dtype, grads: bool) -> dict:
    """:func:`naive_reference` of a decode case whose sequences hold caches of different lengths: each
    sequence against its own keys (forward only); a mixed step's sequences each with its own queries, the
    output packed as its queries are."""
    if grads:
        raise ValueError("a decode step is forward only")
    outs, starts = [], case.query_offsets()
    for b, (n, nq) in enumerate(zip(case.lengths, case.query_counts)):
        if nq == 0:  # a sequence of a mixed step with no query this step
            continue
        one = dataclasses.replace(case, batch=1, seqlen=n, lengths=(), query_lengths=(), queries=nq)
        if case.mixed:  # rows starts[b] .. starts[b + 1] of the packed queries as a batch of one
            piece = {name: inputs[name][starts[b]:starts[b + 1]].transpose(0, 1)[None]
                     for name in ("q", "dout")}                                      # (1, Hq, nq, D)
        else:
            piece = {name: inputs[name][b:b + 1] for name in ("q", "dout")}
        piece.update({name: inputs[name][b:b + 1, :, :n] for name in ("k", "v")})   # (1, Hkv, n, D)
        out = _dense(one, dict(piece, sinks=inputs["sinks"]), dtype, False)["out"]  # (1, Hq, nq, Dv)
        outs.append(out[0].transpose(0, 1) if case.mixed else out)                  # (nq, Hq, Dv) packed
    return {"out": torch.cat(outs)}                              # (B, Hq, Nq, Dv), or (total_q, Hq, Dv)


def oracle_dtype(device: torch.device) -> torch.dtype:
    """docs/design.md section 4: float64 on a CPU, float32 on a GPU."""
    return torch.float64 if device.type == "cpu" else torch.float32


def references(case: Case, inputs: dict, *, grads: bool) -> tuple[dict, dict | None]:
    """``(oracle, pytorch)``: the high-precision oracle and naive PyTorch in the input dtype (the bar's
    baseline; ``None`` for float32 inputs, whose bar is a relative error); for FP8 inputs both on the
    dequantised inputs, PyTorch in bfloat16.
    """
    device = inputs["q"].device
    if case.fp8:  # the bar's baseline: the FP8-rounded inputs in bfloat16 arithmetic
        inputs = dequantized(case, inputs)
        return naive_reference(case, inputs, oracle_dtype(device), grads=grads), \
            naive_reference(case, inputs, torch.bfloat16, grads=grads)
    ref = naive_reference(case, inputs, oracle_dtype(device), grads=grads)
    pt = None if case.torch_dtype == torch.float32 else naive_reference(case, inputs, case.torch_dtype, grads=grads)
    return ref, pt


def judge(name: str, x: torch.Tensor, ref: torch.Tensor, pt: torch.Tensor | None) -> Verdict:
    """The bar of docs/design.md section 4 for one tensor: 2x PyTorch's error for ``out``, 3x for gradients;
    relative error < 1e-4 when there is no low-precision baseline (float32 inputs).
    """
    if pt is None:
        return Verdict(f"{name} (rel)", relative_error(x, ref), FLOAT32_BAR)
    return verdict(name, x, ref, pt, factor=2.0 if name == "out" else 3.0)


def judge_all(got: dict, ref: dict, pt: dict | None) -> list[Verdict]:
    """:func:`judge` for every tensor in ``got`` (``out``, ``dq`` ...), against the same keys of ``ref``."""
    return [judge(name, x, ref[name], None if pt is None else pt[name]) for name, x in got.items()]


CPU_RUNS = (5, 100)  # fewest and most timed runs of each function on a CPU
CPU_BUDGET_S = 1.0  # a CPU race stops after this many seconds once it has the fewest runs


def race_ms(fns, device: torch.device) -> list[float]:
    """Median milliseconds of each ``fn()`` in ``fns``: :func:`gstar.lab.timing.gpu_median_ms` on a GPU.

    On a CPU every function runs once to warm up (allocator, first-call dispatch), then the functions take
    turns, one run each per round, for ``CPU_RUNS[0]`` rounds and more while ``CPU_BUDGET_S`` lasts (at most
    ``CPU_RUNS[1]``): a load that comes and goes on a shared machine slows every contender alike.
    """
    if device.type == "cuda":
        return [gpu_median_ms(fn) for fn in fns]
    for fn in fns:
        fn()
    runs = [[] for _ in fns]
    start = time.perf_counter()
    while len(runs[0]) < CPU_RUNS[0] or (len(runs[0]) < CPU_RUNS[1] and time.perf_counter() - start < CPU_BUDGET_S):
        for fn, times in zip(fns, runs):
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return [statistics.median(times) for times in runs]


def time_ms(fn, device: torch.device) -> float:
    """Median milliseconds of ``fn()`` (:func:`race_ms` of one function)."""
    return race_ms([fn], device)[0]


@contextlib.contextmanager
def one_cpu_thread():
    """PyTorch on one CPU thread for the block: at small shapes (the CPU stages of ``gstar check``, the reduced
    suites of ``gstar bench``) a second thread only adds waiting, and on a busy machine, waiting for a thread
    that is not running, many times slower and erratic timings."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def captured(fn, device: torch.device, stream: torch.cuda.Stream | None = None) -> tuple:
    """``(graph, outputs)``: ``fn()`` captured in a CUDA graph on ``stream`` (a new side stream by default),
    after two warm-up calls on it (compilation, caches, the allocator: capture forbids host syncs and
    host-to-device copies), and what the captured call returned: static tensors that each
    ``graph.replay()`` rewrites, with no host work. The graph keeps its memory until it is dropped. Raises
    whatever the capture raises for an implementation that cannot be captured.

    Autograd runs a backward op on the stream its forward ran on, so a backward captured without its
    forward needs that forward to have run on ``stream``: then its kernels land on the capturing stream.
    """
    side = stream or torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        for _ in range(2):
            fn()
    torch.cuda.current_stream(device).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=side, capture_error_mode="thread_local"):
        outputs = fn()
    return graph, outputs


@contextlib.contextmanager
def _quiet_fd2():
    """Silence file descriptor 2: the profiler's C++ backend logs start/stop lines there."""
    sys.stderr.flush()
    saved, devnull = os.dup(2), os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 2)
    try:
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(devnull)


def _cpu_extra_bytes(fn) -> int:
    from torch.profiler import ProfilerActivity, profile
    with _quiet_fd2(), profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    events = sorted((e for e in prof.events() if e.self_cpu_memory_usage), key=lambda e: e.time_range.start)
    live = peak = 0
    for e in events:
        live += e.self_cpu_memory_usage
        peak = max(peak, live)
    return peak


def peak_bytes(fn, device: torch.device, held: int) -> int:
    """Peak bytes of one ``fn()`` call: what it allocates at its peak beyond the live memory before it,
    plus ``held`` (the bytes of the inputs it reads).
    """
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        base = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        fn()
        torch.cuda.synchronize(device)
        return torch.cuda.max_memory_allocated(device) - base + held
    return _cpu_extra_bytes(fn) + held


def nbytes(*tensors) -> int:
    """Total bytes of the tensors given (``None`` entries count 0), tensors of one storage (a latent cache's
    values, a view of its keys) counted once, as the largest of them."""
    held: dict[int, int] = {}
    for t in tensors:
        if t is not None:
            where = t.untyped_storage().data_ptr()
            held[where] = max(held.get(where, 0), t.numel() * t.element_size())
    return sum(held.values())


def is_oom(exc: BaseException) -> bool:
    """Out of memory on a GPU (or the CPU allocator's equivalent)."""
    return isinstance(exc, torch.OutOfMemoryError) or "out of memory" in str(exc).lower()
