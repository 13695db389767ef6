"""Benchmark cases: the suites of docs/design.md section 5, custom shapes, and the work each case represents.

A :class:`Case` is one attention problem (self-attention, ``Nq == Nk``): a batch of equal lengths, or packed
documents of several lengths (the ``varlen`` suite, docs/design.md section 2). Its FLOPs count only the visible
``(i, j)`` pairs of its pattern (forward: ``2 * B * Hq * (D + Dv) * pairs``, the products ``Q K^T`` and ``P V``;
the backward's five products take ``2 * (3 D + 2 Dv)`` per pair, 2.5x the forward when ``Dv = D``), so a
windowed kernel is not credited for work it rightly skips. ``bytes_moved`` is the least HBM traffic any implementation needs (read the inputs once,
write the outputs once): the memory floor of the roofline.
"""

from __future__ import annotations

import dataclasses
import itertools
import random
from dataclasses import dataclass

import torch

from ..pattern import Pattern

MODES = ("fwd", "bwd", "fwd+bwd")
# the products each mode runs per visible pair, as (multiples of D, multiples of Dv): the forward's Q K^T and
# P V; the backward's recomputed Q K^T, dO V^T, P^T dO, dS K and dS^T Q
_PRODUCTS = {"fwd": (1, 1), "bwd": (3, 2), "fwd+bwd": (4, 3)}
DTYPES = {"bfloat16": torch.bfloat16, "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16,
          "float32": torch.float32, "fp32": torch.float32}
_SHORT_DTYPE = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}


@dataclass(frozen=True)
class Case:
    """One benchmark problem: ``q (B, Hq, N, D)``, ``k (B, Hkv, N, D)``, ``v (B, Hkv, N, Dv)``, a pattern, a
    dtype; ``value_dim`` is Dv (None: D).

    A packed case (``lengths`` given) holds ``B = len(lengths)`` documents as ``q (total, Hq, D)``,
    ``k (total, Hkv, D)``, ``v (total, Hkv, Dv)``; ``seqlen`` is the longest document, the length of the
    padded batch.
    """

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
    lengths: tuple[int, ...] = ()
    value_dim: int | None = None

    def __post_init__(self):
        if self.lengths and (self.batch, self.seqlen) != (len(self.lengths), max(self.lengths)):
            raise ValueError(f"a packed case has batch = len(lengths) and seqlen = max(lengths), got batch "
                             f"{self.batch}, seqlen {self.seqlen} for lengths {self.lengths}")

    @property
    def packed(self) -> bool:
        return bool(self.lengths)

    @property
    def dv(self) -> int:
        """The value head dim Dv."""
        return self.value_dim or self.head_dim

    @property
    def tokens(self) -> int:
        """Query (and key) rows over the whole batch: the documents' total length for a packed case."""
        return sum(self.lengths) if self.packed else self.batch * self.seqlen

    def cu_seqlens(self, device) -> torch.Tensor:
        """``(B + 1,)`` int32 offsets of the documents of a packed case."""
        return torch.tensor([0, *itertools.accumulate(self.lengths)], dtype=torch.int32, device=device)

    def padding_mask(self, device) -> torch.Tensor:
        """``(B, N)`` bool, True at the real tokens of a packed case right-padded to its longest document."""
        lengths = torch.tensor(self.lengths, device=device)
        return torch.arange(self.seqlen, device=device)[None, :] < lengths[:, None]

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    def pattern_of(self, n: int) -> Pattern:
        """The case's pattern on ``n`` queries and keys."""
        return Pattern.make(n, n, causal=self.causal, window=self.window, sink_tokens=self.sink_tokens)

    @property
    def pattern(self) -> Pattern:
        return self.pattern_of(self.seqlen)

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
        dims = f"D{self.head_dim}" if self.dv == self.head_dim else f"D{self.head_dim}/{self.dv}"
        return f"{heads} {dims} {self.mask_label} {_SHORT_DTYPE[self.torch_dtype]}"

    @property
    def label(self) -> str:
        if self.packed:
            return f"{self.batch} docs T{self.tokens} N<={self.seqlen} {self.series}"
        return f"B{self.batch} N{self.seqlen} {self.series}"

    def visible_pairs(self) -> int:
        """Visible (query, key) pairs summed over batch (each document) and query heads."""
        if self.packed:
            return self.heads * sum(self.pattern_of(n).visible_pairs() for n in self.lengths)
        return self.batch * self.heads * self.pattern.visible_pairs()

    def flops(self, mode: str) -> float:
        """FLOPs of ``mode`` over the visible pairs only."""
        of_d, of_dv = _PRODUCTS[mode]
        return 2.0 * (of_d * self.head_dim + of_dv * self.dv) * self.visible_pairs()

    def bytes_moved(self, mode: str) -> int:
        """The least HBM traffic of ``mode``: each input read once, each output written once."""
        esize = torch.finfo(self.torch_dtype).bits // 8
        q_elems, o_elems = (self.tokens * self.heads * d for d in (self.head_dim, self.dv))
        k_elems, v_elems = (self.tokens * self.kv_heads * d for d in (self.head_dim, self.dv))
        rows = self.tokens * self.heads
        fwd = esize * (q_elems + k_elems + v_elems + o_elems) + 4 * rows     # q, k, v in; out, lse out
        bwd = esize * (2 * (q_elems + k_elems + v_elems) + 2 * o_elems) + 8 * rows  # q k v out dout lse in; dq dk dv
        return {"fwd": fwd, "bwd": bwd, "fwd+bwd": fwd + bwd}[mode]

    def as_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["window"] = list(self.window)
        d["lengths"] = list(self.lengths)
        d["label"] = self.label
        return d


_GPT_OSS = dict(heads=64, kv_heads=8, head_dim=64, sinks=True, dtype="bfloat16")
_STAGES = dict(batch=1, heads=16, seqlen=4096, head_dim=16, dtype="bfloat16")


def _gpt_oss(family: str, batch: int, seqlen: int) -> list[Case]:
    # GPT-OSS alternates full-causal layers and sliding layers of 128 keys, both with learned sinks.
    return [Case(family, batch, seqlen=seqlen, causal=True, **_GPT_OSS),
            Case(family, batch, seqlen=seqlen, causal=True, window=(127, 0), **_GPT_OSS)]


def packed_case(family: str, lengths, **kw) -> Case:
    """A packed case of documents of the given lengths."""
    lengths = tuple(lengths)
    return Case(family, len(lengths), seqlen=max(lengths), lengths=lengths, **kw)


def document_lengths(total: int, docs: int, seed: int = 0) -> tuple[int, ...]:
    """``docs`` random positive lengths summing to ``total`` (cuts drawn without repeats, seeded)."""
    cuts = sorted(random.Random(seed).sample(range(1, total), docs - 1))
    return tuple(b - a for a, b in zip([0] + cuts, cuts + [total]))


SUITES = {
    "gpt-oss": lambda: _gpt_oss("gpt-oss", 2, 4096),
    "long": lambda: _gpt_oss("long", 1, 8192) + _gpt_oss("long", 1, 32768),
    "fa": lambda: [Case("fa", 4, 16, 16, 8192, 128, causal=c) for c in (False, True)],
    # multi-head latent attention's training shape (DeepSeek-V3): queries and keys 192 wide, values 128
    "mla": lambda: [Case("mla", 2, 128, 128, 4096, 192, causal=True, value_dim=128)],
    "stages": lambda: [
        Case("stages", kv_heads=16, **_STAGES),                                        # stage 3
        Case("stages", kv_heads=16, causal=True, **_STAGES),                           # stage 4
        Case("stages", kv_heads=2, causal=True, **_STAGES),                            # stage 5
        Case("stages", kv_heads=1, causal=True, window=(255, 0), **_STAGES),           # stage 6
        Case("stages", kv_heads=1, causal=True, window=(255, 0), sink_tokens=4, **_STAGES),  # stage 7
    ],
    # the gpt-oss patterns on 16 documents of random lengths, 16384 tokens: packed against padded
    "varlen": lambda: [packed_case("varlen", document_lengths(16384, 16), causal=True, window=w, **_GPT_OSS)
                       for w in ((-1, -1), (127, 0))],
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
    """A GPU suite case shrunk for a CPU: batch 1 (a packed case keeps its documents, each 1/16 as long),
    heads / 8, length / 16, window / 8, float32.

    The group size ``Hq / Hkv`` is kept where the shrunk head count allows it; the point on a CPU is the
    tiled PyTorch path against eager attention at shapes a laptop finishes in seconds.
    """
    heads = max(1, case.heads // 8)
    kv_heads = max(1, heads // max(1, case.heads // case.kv_heads))
    left, right = case.window
    shrink = lambda w: w if w < 0 else max(0, (w + 1) // 8 - 1)  # noqa: E731 - keeps W keys -> W/8 keys
    if case.packed:
        lengths = tuple(max(1, n // 16) for n in case.lengths)
        rows = dict(batch=len(lengths), seqlen=max(lengths), lengths=lengths)
    else:
        rows = dict(batch=1, seqlen=max(64, case.seqlen // 16))
    return dataclasses.replace(case, heads=heads, kv_heads=kv_heads, window=(shrink(left), shrink(right)),
                               dtype="float32", **rows)


def custom(seqlens, *, batch=1, heads=16, kv_heads=None, head_dim=64, value_dim=None, causal=False,
           window=(-1, -1), sink_tokens=0, sinks=False, dtype="bfloat16") -> list[Case]:
    """One ``custom`` case per sequence length, from the shape flags of ``gstar bench``."""
    kv_heads = heads if kv_heads is None else kv_heads
    if heads % kv_heads:
        raise ValueError(f"--heads ({heads}) must be a multiple of --kv-heads ({kv_heads})")
    return [Case("custom", batch, heads, kv_heads, n, head_dim, causal=causal, window=tuple(window),
                 sink_tokens=sink_tokens, sinks=sinks, dtype=dtype, value_dim=value_dim) for n in seqlens]
