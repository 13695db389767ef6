"""Process pools for the context-parallel tests: ``P`` ranks started once, running one case at a time.

Starting processes (each imports torch) costs seconds on a two-core machine, so a :class:`Pool` keeps its
ranks alive across tests: :meth:`Pool.run` sends every rank the name of a case function of this module and
its keywords, and returns what each rank's call returned (or raised). Every wait has a timeout, so a rank
that hangs fails its test instead of blocking the suite, and the pool restarts for the next one.
"""

from __future__ import annotations

import datetime
import multiprocessing
import queue
import socket
import traceback
from pathlib import Path

import torch

CASE_TIMEOUT_S = 120
GLOO_TIMEOUT_S = 60  # a rank waiting on a peer that never sends raises after this


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _serve(rank: int, world: int, backend: str, port: int, inbox, outbox):
    import torch.distributed as dist
    torch.set_num_threads(1)
    if backend == "nccl":
        torch.cuda.set_device(rank)
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=GLOO_TIMEOUT_S))
    while (job := inbox.get()) is not None:
        name, kwargs = job
        try:
            outbox.put((rank, "ok", globals()[name](rank, world, **kwargs)))
        except Exception as err:  # noqa: BLE001  (the parent asserts on it)
            outbox.put((rank, "raised", (type(err).__name__, str(err), traceback.format_exc())))
    dist.destroy_process_group()


class Pool:
    """``world`` ranks in spawned processes: gloo on CPU, or NCCL with rank ``r`` on GPU ``r``."""

    def __init__(self, world: int, backend: str = "gloo"):
        self.world, self.backend = world, backend
        self.procs = []

    def _start(self):
        # fork: a forked rank starts in a fraction of a second, a spawned one re-imports torch (seconds per
        # rank on two cores); CUDA cannot be forked into, so GPU ranks are spawned
        ctx = multiprocessing.get_context("fork" if self.backend == "gloo" else "spawn")
        port = _free_port()
        self.inboxes = [ctx.Queue() for _ in range(self.world)]
        self.outbox = ctx.Queue()
        self.procs = [ctx.Process(target=_serve, args=(r, self.world, self.backend, port, self.inboxes[r], self.outbox), daemon=True)
                      for r in range(self.world)]
        for p in self.procs:
            p.start()

    def run(self, name: str, per_rank: list[dict] | None = None, **kwargs) -> list[tuple[str, object]]:
        """``(status, value)`` per rank of case ``name``: ``("ok", returned)`` or ``("raised", (type, message,
        traceback))``. ``per_rank`` gives each rank its own keywords (added to ``kwargs``)."""
        if not self.procs or not all(p.is_alive() for p in self.procs):
            self.close()
            self._start()
        for r, inbox in enumerate(self.inboxes):
            inbox.put((name, {**kwargs, **(per_rank[r] if per_rank else {})}))
        results = {}
        try:
            for _ in range(self.world):
                rank, status, value = self.outbox.get(timeout=CASE_TIMEOUT_S)
                results[rank] = (status, value)
        except queue.Empty:
            self.close()
            raise TimeoutError(f"{name} on {self.world} ranks: no answer within {CASE_TIMEOUT_S} s from ranks "
                               f"{sorted(set(range(self.world)) - set(results))}") from None
        return [results[r] for r in range(self.world)]

    def close(self):
        for p, inbox in zip(self.procs, getattr(self, "inboxes", [])):
            if p.is_alive():
                inbox.put(None)
        for p in self.procs:
            p.join(timeout=2)
            if p.is_alive():
                p.kill()
        self.procs = []


# ---------------------------------------------------------------------------------------------- cases
# Each takes (rank, world, **keywords) and runs on every rank of the pool.


def attention(rank, world, *, layout, n_local, heads, pattern, learned_sinks, batch=2, head_dim=8, value_dim=8,
              seed=0, dtype="float64", backend="auto"):
    """context_parallel_attention in ``dtype`` on ``backend`` against gstar on the whole sequence in float64
    (the same seeded tensors on every rank): the relative errors of out, LSE, dq, dk, dv (this rank's shard)
    and dsinks (summed over ranks), of the gathered output, and the bytes sent by the forward and the
    backward."""
    import torch.distributed as dist

    import gstar
    import gstar.distributed as gd
    from gstar.lab.accuracy import relative_error

    Hq, Hkv = heads
    n = n_local * world
    g = torch.Generator().manual_seed(seed)

    def rand(*shape):
        return torch.randn(*shape, generator=g, dtype=torch.float64)

    q, k, v = rand(batch, Hq, n, head_dim), rand(batch, Hkv, n, head_dim), rand(batch, Hkv, n, value_dim)
    sinks = rand(Hq) * 2 if learned_sinks else None
    dout, dlse = rand(batch, Hq, n, value_dim), rand(batch, Hq, n)
    whole = [t.clone().requires_grad_() for t in (q, k, v)] + ([sinks.clone().requires_grad_()] if learned_sinks else [])
    out, lse = gstar.flash_attention(*whole[:3], sinks=whole[3] if learned_sinks else None, return_lse=True, **pattern)
    ref = [out, lse, *torch.autograd.grad((out, lse), whole, (dout, dlse))]

    def shard(t):
        return gd.shard_sequence(t.detach(), None, layout, dim=2)

    cast = getattr(torch, dtype)
    mine = [shard(t).to(cast).requires_grad_() for t in (q, k, v)]
    mine += [sinks.to(cast).requires_grad_()] if learned_sinks else []
    gd.reset_traffic()
    o, lse_o = gd.context_parallel_attention(*mine[:3], sinks=mine[3] if learned_sinks else None, layout=layout,
                                             return_lse=True, backend=backend, **pattern)
    sent_forward = gd.traffic().sent
    gd.reset_traffic()
    grads = torch.autograd.grad((o, lse_o), mine, (shard(dout).to(cast), shard(dlse).to(cast)))
    sent_backward = gd.traffic().sent
    errors = {"out": relative_error(o.detach(), shard(ref[0])), "lse": relative_error(lse_o.detach(), shard(ref[1]))}
    for name, got, want in zip(("dq", "dk", "dv"), grads, ref[2:5]):
        errors[name] = relative_error(got, shard(want))
    if learned_sinks:
        dsinks = grads[3].clone()
        dist.all_reduce(dsinks)
        errors["dsinks"] = relative_error(dsinks, ref[5])
    errors["gathered out"] = relative_error(gd.gather_sequence(o.detach(), None, layout, dim=2), ref[0].detach())
    return {"errors": errors, "sent_forward": sent_forward, "sent_backward": sent_backward}


def call(rank, world, *, n_local=8, heads=(2, 2), q_len=None, **keywords):
    """context_parallel_attention on random float64 shards with ``keywords`` (for the error cases)."""
    import gstar.distributed as gd

    q = torch.randn(1, heads[0], n_local if q_len is None else q_len, 4, dtype=torch.float64)
    k, v = (torch.randn(1, heads[1], n_local, 4, dtype=torch.float64) for _ in range(2))
    return tuple(gd.context_parallel_attention(q, k, v, **keywords).shape)


def shard(rank, world, *, length, layout):
    import gstar.distributed as gd
    return tuple(gd.shard_sequence(torch.zeros(1, length), None, layout, dim=1).shape)


def train_example(rank, world, **keywords):
    """examples/context_parallel_train.py's train(): per step, the losses and the largest gradient error."""
    import importlib.util
    path = Path(__file__).resolve().parents[1] / "examples" / "context_parallel_train.py"
    spec = importlib.util.spec_from_file_location("context_parallel_train", path)
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    return example.train(log=lambda *a: None, **keywords)


def attention_gpu(rank, world, *, layout, n_local, pattern, seed=0):
    """bfloat16 context_parallel_attention on the rank's GPU (Triton kernels) against float32 naive attention
    on the whole sequence, with the correctness bar of gstar.lab.accuracy: (name, error, allowed) per output and
    gradient of this rank's shard (dsinks summed over ranks)."""
    import torch.distributed as dist

    import gstar.distributed as gd
    from gstar.lab.accuracy import verdict
    from gstar.reference import naive_attention

    B, Hq, Hkv, D = 1, 8, 2, 64
    n = n_local * world
    g = torch.Generator(device="cuda").manual_seed(seed)
    q, k, v = (torch.randn(B, h, n, D, device="cuda", generator=g) for h in (Hq, Hkv, Hkv))
    sinks = torch.randn(Hq, device="cuda", generator=g)
    dout = torch.randn(B, Hq, n, D, device="cuda", generator=g)

    def naive(dtype):
        leaves = [t.to(dtype).requires_grad_() for t in (q, k, v)] + [sinks.clone().requires_grad_()]
        out, _ = naive_attention(*leaves[:3], sinks=leaves[3], **pattern)
        return [out, *torch.autograd.grad(out, leaves, dout.to(dtype))]

    ref, pt = naive(torch.float32), naive(torch.bfloat16)

    def shard(t):
        return gd.shard_sequence(t.detach(), None, layout, dim=2)

    mine = [shard(t.bfloat16()).requires_grad_() for t in (q, k, v)] + [sinks.clone().requires_grad_()]
    out = gd.context_parallel_attention(*mine[:3], sinks=mine[3], layout=layout, **pattern)
    got = [out, *torch.autograd.grad(out, mine, shard(dout.bfloat16()))]
    dist.all_reduce(got[4])
    checks = []
    for i, name in enumerate(("out", "dq", "dk", "dv", "dsinks")):
        cut = (lambda t: t) if name == "dsinks" else shard
        vd = verdict(name, got[i], cut(ref[i]), cut(pt[i]), factor=2.0 if name == "out" else 3.0)
        checks.append((vd.name, vd.error, vd.allowed))
    return checks
