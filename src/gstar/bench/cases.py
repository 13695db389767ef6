"""Benchmark cases: the suites of docs/design.md section 5, custom shapes, and the work each case represents.

A :class:`Case` is one attention problem (self-attention, ``Nq == Nk``). Its FLOPs count only the visible
``(i, j)`` pairs of its pattern (``4 * B * Hq * D * pairs`` forward: two matmuls of ``2 * D`` FLOPs per pair;
the backward does five such matmuls, 2.5x the forward), so a windowed kernel is not credited for work it
rightly skips. ``bytes_moved`` is the least HBM traffic any implementation needs (read the inputs once,
write the outputs once): the memory floor of the roofline.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from ..pattern import Pattern

MODES = ("fwd", "bwd", "fwd+bwd")
FLOP_FACTOR = {"fwd": 1.0, "bwd": 2.5, "fwd+bwd": 3.5}
DTYPES = {"bfloat16": torch.bfloat16, "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16,
          "float32": torch.float32, "fp32": torch.float32}
_SHORT_DTYPE = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}


@dataclass(frozen=True)
class Case:
    """One benchmark problem: ``q (B, Hq, N, D)``, ``k, v (B, Hkv, N, D)``, a pattern, a dtype."""

    family: str
    batch: int
    heads: int
    kv_heads: int
    seqlen: int
    head_dim: int
    causal: bool = False
    window: tuple[int, int] = (-1, -1)
    sink_tokens: int = 0
    sinks: bool = False
    dtype: str = "bfloat16"

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    @property
    def pattern(self) -> Pattern:
        return Pattern.make(self.seqlen, self.seqlen, causal=self.causal, window=self.window,
                            sink_tokens=self.sink_tokens)

    @property
    def mask_label(self) -> str:
        """The pattern in words: ``causal``, ``window (127,0) +4 sink tokens``, ``full`` ... and ``+sinks``."""
        p = self.pattern
        if p.left >= 0 or p.right > 0:
            words = f"window ({p.left},{p.right})"
        else:
            words = "causal" if p.right == 0 else "full"
        if p.sink_tokens:
            words += f" +{p.sink_tokens} sink tokens"
        if self.sinks:
            words += " +sinks"
        return words

    @property
    def series(self) -> str:
        """Everything but batch and length: the line a case belongs to in a plot against sequence length."""
        heads = f"H{self.heads}" if self.kv_heads == self.heads else f"H{self.heads}/{self.kv_heads}"
        return f"{heads} D{self.head_dim} {self.mask_label} {_SHORT_DTYPE[self.torch_dtype]}"

    @property
    def label(self) -> str:
        return f"B{self.batch} N{self.seqlen} {self.series}"

    def visible_pairs(self) -> int:
        """Visible (query, key) pairs summed over batch and query heads."""
        return self.batch * self.heads * self.pattern.visible_pairs()

    def flops(self, mode: str) -> float:
        """FLOPs of ``mode`` over the visible pairs only."""
        return 4.0 * self.head_dim * self.visible_pairs() * FLOP_FACTOR[mode]

    def bytes_moved(self, mode: str) -> int:
        """The least HBM traffic of ``mode``: each input read once, each output written once."""
        esize = torch.finfo(self.torch_dtype).bits // 8
        q_elems = self.batch * self.heads * self.seqlen * self.head_dim
        kv_elems = self.batch * self.kv_heads * self.seqlen * self.head_dim
        rows = self.batch * self.heads * self.seqlen
        fwd = esize * (2 * q_elems + 2 * kv_elems) + 4 * rows           # q, k, v in; out, lse out
        bwd = esize * (4 * q_elems + 4 * kv_elems) + 8 * rows           # q k v out dout lse in; dq dk dv out
        return {"fwd": fwd, "bwd": bwd, "fwd+bwd": fwd + bwd}[mode]

    def as_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["window"] = list(self.window)
        d["label"] = self.label
        return d


_GPT_OSS = dict(heads=64, kv_heads=8, head_dim=64, sinks=True, dtype="bfloat16")
_STAGES = dict(batch=1, heads=16, seqlen=4096, head_dim=16, dtype="bfloat16")


def _gpt_oss(family: str, batch: int, seqlen: int) -> list[Case]:
    # GPT-OSS alternates full-causal layers and sliding layers of 128 keys, both with learned sinks.
    return [Case(family, batch, seqlen=seqlen, causal=True, **_GPT_OSS),
            Case(family, batch, seqlen=seqlen, causal=True, window=(127, 0), **_GPT_OSS)]


SUITES = {
    "gpt-oss": lambda: _gpt_oss("gpt-oss", 2, 4096),
    "long": lambda: _gpt_oss("long", 1, 8192) + _gpt_oss("long", 1, 32768),
    "fa": lambda: [Case("fa", 4, 16, 16, 8192, 128, causal=c) for c in (False, True)],
    "stages": lambda: [
        Case("stages", kv_heads=16, **_STAGES),                                        # stage 3
        Case("stages", kv_heads=16, causal=True, **_STAGES),                           # stage 4
        Case("stages", kv_heads=2, causal=True, **_STAGES),                            # stage 5
        Case("stages", kv_heads=1, causal=True, window=(255, 0), **_STAGES),           # stage 6
        Case("stages", kv_heads=1, causal=True, window=(255, 0), sink_tokens=4, **_STAGES),  # stage 7
    ],
}
SUITE_NAMES = tuple(SUITES) + ("all",)


def suite(name: str) -> list[Case]:
    """The cases of a suite of docs/design.md section 5 (``all``: every suite in order)."""
    if name == "all":
        return [c for build in SUITES.values() for c in build()]
    if name not in SUITES:
        raise ValueError(f"unknown suite {name!r}; choose from {', '.join(SUITE_NAMES)}")
    return SUITES[name]()


def for_cpu(case: Case) -> Case:
    """A GPU suite case shrunk for a CPU: batch 1, heads / 8, length / 16, window / 8, float32.

    The group size ``Hq / Hkv`` is kept where the shrunk head count allows it; the point on a CPU is the
    tiled PyTorch path against eager attention at shapes a laptop finishes in seconds.
    """
    heads = max(1, case.heads // 8)
    kv_heads = max(1, heads // max(1, case.heads // case.kv_heads))
    left, right = case.window
    shrink = lambda w: w if w < 0 else max(0, (w + 1) // 8 - 1)  # noqa: E731 - keeps W keys -> W/8 keys
    return dataclasses.replace(case, batch=1, heads=heads, kv_heads=kv_heads, seqlen=max(64, case.seqlen // 16),
                               window=(shrink(left), shrink(right)), dtype="float32")


def custom(seqlens, *, batch=1, heads=16, kv_heads=None, head_dim=64, causal=False, window=(-1, -1),
           sink_tokens=0, sinks=False, dtype="bfloat16") -> list[Case]:
    """One ``custom`` case per sequence length, from the shape flags of ``gstar bench``."""
    kv_heads = heads if kv_heads is None else kv_heads
    if heads % kv_heads:
        raise ValueError(f"--heads ({heads}) must be a multiple of --kv-heads ({kv_heads})")
    return [Case("custom", batch, heads, kv_heads, n, head_dim, causal=causal, window=tuple(window),
                 sink_tokens=sink_tokens, sinks=sinks, dtype=dtype) for n in seqlens]
