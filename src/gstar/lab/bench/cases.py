"""Benchmark cases: the suites of docs/design.md section 5, custom shapes, and the work each case represents.

A :class:`Case` is one attention problem: self-attention (``Nq == Nk``) over a batch of equal lengths or over
packed documents of several lengths (the ``varlen`` suite, docs/design.md section 2), or a decode step (the
``decode`` suite): ``Nq`` new queries against a cache of keys, contiguous or paged, every sequence as long as
the cache or each its own length; or a server's mixed step (the ``serving`` suite): prefill chunks and decodes
side by side, each sequence its own count of queries, packed in flash-attn's varlen layout. Its FLOPs count
only the visible ``(i, j)`` pairs of its pattern (forward: ``2 * B * Hq * (D + Dv) * pairs``, the products
``Q K^T`` and ``P V``; the backward's five products take ``2 * (3 D + 2 Dv)`` per pair, 2.5x the forward when
``Dv = D``), so a windowed kernel is not credited for work it rightly skips. ``bytes_moved`` is the least HBM
traffic any implementation needs (read the queries and every key and value some query sees once, write the
outputs once): the memory floor of the roofline. A decode step's floor is its visible keys and values: the
whole cache for a full-causal layer, the window's keys for a sliding one; a mixed step's each sequence's
visible keys (a chunk's window spans its queries and the window before them). A latent cache (``Case.latent``:
multi-head latent attention, whose values are the first ``Dv`` lanes of its keys) is read once, ``D`` lanes a key.
"""

from __future__ import annotations

import dataclasses
import itertools
import random
from dataclasses import dataclass

import torch

from ...pattern import Pattern, cdiv

MODES = ("fwd", "bwd", "fwd+bwd")
# the products each mode runs per visible pair, as (multiples of D, multiples of Dv): the forward's Q K^T and
# P V; the backward's recomputed Q K^T, dO V^T, P^T dO, dS K and dS^T Q
_PRODUCTS = {"fwd": (1, 1), "bwd": (3, 2), "fwd+bwd": (4, 3)}
DTYPES = {"bfloat16": torch.bfloat16, "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16,
          "float32": torch.float32, "fp32": torch.float32, "float8_e4m3fn": torch.float8_e4m3fn,
          "fp8": torch.float8_e4m3fn}
_SHORT_DTYPE = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32", torch.float8_e4m3fn: "fp8"}
FP8_CACHE = "fp8-cache"  # a decode case's dtype: an FP8 cache under bfloat16 queries (the common serving case)


@dataclass(frozen=True)
class Case:
    """One benchmark problem: ``q (B, Hq, N, D)``, ``k (B, Hkv, N, D)``, ``v (B, Hkv, N, Dv)``, a pattern, a
    dtype; ``value_dim`` is Dv (None: D).

    A packed case (``lengths`` given) holds ``B = len(lengths)`` documents as ``q (total, Hq, D)``,
    ``k (total, Hkv, D)``, ``v (total, Hkv, Dv)``; ``seqlen`` is the longest document, the length of the
    padded batch.

    A decode case (``queries = Nq > 0``) is ``q (B, Hq, Nq, D)`` against a cache ``k (B, Hkv, N, D)``,
    ``v (B, Hkv, N, Dv)`` of ``N = seqlen`` keys, the queries the last ``Nq`` positions (the step's own keys
    already in the cache). With ``lengths`` sequence ``b`` holds only the first ``lengths[b]`` keys of its
    cache; with ``page_size`` the cache is paged, blocks of that many keys in pages of one pool
    (:meth:`block_table`, :meth:`to_pages`).

    A mixed step (``query_lengths`` given, the ``serving`` suite; :func:`mixed_case`) is a decode case whose
    sequence ``b`` has its own ``query_lengths[b]`` queries (0 allowed), the last positions of its
    ``lengths[b]`` keys, packed as ``q (total_q, Hq, D)`` (rows :meth:`query_offsets` ``[b] .. [b + 1]``);
    ``queries`` is the longest count (the kernel grid's ``max_seqlen_q``).

    ``chunk`` (Llama 4's chunked attention, 0: none) is part of the pattern, like the window: a query sees only
    keys of its own chunk of ``chunk`` positions. ``softcap`` (Gemma 2's logit soft-capping, 0.0: none) is not:
    it changes the scores (``softcap * tanh(s / softcap)``), not which keys are seen, so it leaves the FLOP count
    and the memory floor alone (tanh is no matmul FLOP).

    ``latent`` (a decode case with ``Dv <= D``, 16-bit or float32 inputs): multi-head latent attention decoded
    with absorbed weights, whose values are the first ``Dv`` lanes of the keys' cache: ``v = k[..., :Dv]``, and
    paged ``v_pages = k_pages[..., :Dv]``, views of one cache (measure.make_inputs), which every peer receives as
    it is. The memory floor reads that cache once, ``D`` lanes a key, and no value lane beside it.
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
    queries: int = 0
    page_size: int = 0
    softcap: float = 0.0
    chunk: int = 0
    query_lengths: tuple[int, ...] = ()
    latent: bool = False

    def __post_init__(self):
        if self.decode and self.lengths and (self.batch != len(self.lengths) or max(self.lengths) > self.seqlen):
            raise ValueError(f"a decode case has batch = len(lengths) and lengths within its cache of seqlen keys, "
                             f"got batch {self.batch}, seqlen {self.seqlen} for lengths {self.lengths}")
        if self.packed and (self.batch, self.seqlen) != (len(self.lengths), max(self.lengths)):
            raise ValueError(f"a packed case has batch = len(lengths) and seqlen = max(lengths), got batch "
                             f"{self.batch}, seqlen {self.seqlen} for lengths {self.lengths}")
        if self.mixed and not self._counts_fit():
            raise ValueError(f"a mixed step has a query count per cache length, each within its cache, queries = "
                             f"the longest count (>= 1) and 16-bit or float32 inputs, got query_lengths "
                             f"{self.query_lengths}, lengths {self.lengths}, queries {self.queries}, {self.dtype}")
        if self.page_size and not self.decode:
            raise ValueError("only a decode case (queries > 0) reads a paged cache")
        if self.fp8_cache and not self.decode:
            raise ValueError(f"dtype {FP8_CACHE!r} (an FP8 cache under bfloat16 queries) is for decode cases "
                             f"(queries > 0)")
        if self.latent and not (self.decode and self.dv <= self.head_dim and not self.fp8):
            raise ValueError(f"a latent cache (values the first Dv lanes of the keys) is for decode cases with Dv <= "
                             f"D and 16-bit or float32 inputs (FP8 quantises keys and values apart), got queries "
                             f"{self.queries}, D {self.head_dim}, Dv {self.dv}, {self.dtype}")

    def _counts_fit(self) -> bool:
        """A mixed step's query counts: one per cache, each within its cache, the longest ``queries`` (>= 1);
        16-bit or float32 inputs."""
        counts = self.query_lengths
        return (len(counts) == len(self.lengths) and 1 <= self.queries == max(counts) and not self.fp8
                and all(nq <= n for nq, n in zip(counts, self.lengths)))

    @property
    def decode(self) -> bool:
        """A decode step: ``queries`` new queries against a cache."""
        return self.queries > 0

    @property
    def packed(self) -> bool:
        return bool(self.lengths) and not self.decode

    @property
    def mixed(self) -> bool:
        """A mixed step: a query count per sequence, the queries packed ``(total_q, Hq, D)``."""
        return bool(self.query_lengths)

    @property
    def query_counts(self) -> tuple[int, ...]:
        """The queries of each sequence of a decode case: ``query_lengths``, or ``Nq`` each."""
        return self.query_lengths or (self.queries,) * self.batch

    def query_offsets(self) -> list[int]:
        """``B + 1`` offsets of each sequence's rows in a mixed step's packed queries."""
        return [0, *itertools.accumulate(self.query_lengths)]

    def cu_seqlens_q(self, device) -> torch.Tensor:
        """``(B + 1,)`` int32 :meth:`query_offsets` on ``device``: a mixed step's ``cu_seqlens_q``."""
        return torch.tensor(self.query_offsets(), dtype=torch.int32, device=device)

    @property
    def paged(self) -> bool:
        return self.page_size > 0

    @property
    def dv(self) -> int:
        """The value head dim Dv."""
        return self.value_dim or self.head_dim

    @property
    def tokens(self) -> int:
        """Query rows over the whole batch: the documents' total length for a packed case, ``B * Nq`` for a
        decode case, the counts' sum for a mixed step (self-attention has as many key rows)."""
        if self.mixed:
            return sum(self.query_lengths)
        if self.decode:
            return self.batch * self.queries
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
        """The dtype of k and v (and of q, except under an FP8 cache's bfloat16 queries)."""
        return torch.float8_e4m3fn if self.fp8_cache else DTYPES[self.dtype]

    @property
    def fp8(self) -> bool:
        """FP8 inputs (forward only): q, k, v quantised per head, their descales beside them (make_inputs); with
        :attr:`fp8_cache` only k and v."""
        return self.torch_dtype == torch.float8_e4m3fn

    @property
    def fp8_cache(self) -> bool:
        """A decode case's FP8 cache under bfloat16 queries (``dtype="fp8-cache"``)."""
        return self.dtype == FP8_CACHE

    def pattern_of(self, n: int, nq: int | None = None) -> Pattern:
        """The case's pattern on ``n`` keys: as many queries (self-attention), the decode step's ``Nq``, or
        ``nq`` (a sequence of a mixed step)."""
        nq = (self.queries or n) if nq is None else nq
        return Pattern.make(nq, n, causal=self.causal, window=self.window,
                            sink_tokens=self.sink_tokens, chunk=self.chunk)

    @property
    def pattern(self) -> Pattern:
        return self.pattern_of(self.seqlen)

    @property
    def mask_label(self) -> str:
        """The pattern in words, and the scores' soft-cap: ``causal``, ``window (127,0) +4 sink tokens``,
        ``causal chunk 8192``, ``full`` ... then ``+sinks`` and ``+softcap 50``."""
        p = self.pattern
        if p.left >= 0 or p.right > 0:
            words = f"window ({p.left},{p.right})"
        else:
            words = "causal" if p.right == 0 else "full"
        if p.chunk:
            words += f" chunk {p.chunk}"
        if p.sink_tokens:
            words += f" +{p.sink_tokens} sink tokens"
        if self.sinks:
            words += " +sinks"
        if self.softcap:
            words += f" +softcap {self.softcap:g}"
        return words

    @property
    def series(self) -> str:
        """Everything but batch and length: the line a case belongs to in a plot against sequence length."""
        heads = f"H{self.heads}" if self.kv_heads == self.heads else f"H{self.heads}/{self.kv_heads}"
        dims = f"D{self.head_dim}" if self.dv == self.head_dim else f"D{self.head_dim}/{self.dv}"
        dims += " latent" if self.latent else ""
        words = f"{heads} {dims} {self.mask_label} {'fp8 cache' if self.fp8_cache else _SHORT_DTYPE[self.torch_dtype]}"
        if self.decode:
            counts = _counts(self.query_lengths) if self.mixed else self.queries
            words = f"Nq{counts} " + words + (f" paged {self.page_size}" if self.paged else "")
        return words

    @property
    def label(self) -> str:
        if self.packed:
            return f"{self.batch} docs T{self.tokens} N<={self.seqlen} {self.series}"
        if self.decode and self.lengths:
            return f"B{self.batch} N{min(self.lengths)}..{max(self.lengths)} {self.series}"
        return f"B{self.batch} N{self.seqlen} {self.series}"

    def _summed(self, count) -> int:
        """``count(pattern)`` summed over the sequences of the batch (each with its own length and, in a mixed
        step, its own queries, if any)."""
        if self.mixed:  # a sequence without queries this step reads nothing
            return sum(count(self.pattern_of(n, nq)) for n, nq in zip(self.lengths, self.query_lengths) if nq)
        if self.lengths:
            return sum(count(self.pattern_of(n)) for n in self.lengths)
        return self.batch * count(self.pattern)

    def visible_pairs(self) -> int:
        """Visible (query, key) pairs summed over batch (each document or cache) and query heads."""
        return self.heads * self._summed(Pattern.visible_pairs)

    def visible_keys(self) -> int:
        """Keys some query sees, summed over the batch: every key for self-attention; a decode step's cache
        reads (the whole cache of a full-causal layer, the window's keys of a sliding one)."""
        return self._summed(Pattern.visible_keys)

    def flops(self, mode: str) -> float:
        """FLOPs of ``mode`` over the visible pairs only."""
        of_d, of_dv = _PRODUCTS[mode]
        return 2.0 * (of_d * self.head_dim + of_dv * self.dv) * self.visible_pairs()

    def bytes_moved(self, mode: str) -> int:
        """The least HBM traffic of ``mode``: each query and each visible key and value read once (a latent
        cache's values are lanes of its keys, read with them), each output written once."""
        esize = torch.finfo(self.torch_dtype).bits // 8
        q_elems, o_elems = (self.tokens * self.heads * d for d in (self.head_dim, self.dv))
        k_elems, v_elems = (self.visible_keys() * self.kv_heads * d
                            for d in (self.head_dim, 0 if self.latent else self.dv))
        rows = self.tokens * self.heads
        o_size = 2 if self.fp8 else esize  # FP8 inputs write a bfloat16 output
        q_size = 2 if self.fp8_cache else esize  # bfloat16 queries against an FP8 cache
        fwd = q_size * q_elems + esize * (k_elems + v_elems) + o_size * o_elems + 4 * rows  # q, k, v in; out, lse
        bwd = esize * (2 * (q_elems + k_elems + v_elems) + 2 * o_elems) + 8 * rows  # q k v out dout lse in; dq dk dv
        return {"fwd": fwd, "bwd": bwd, "fwd+bwd": fwd + bwd}[mode]

    def cache_seqlens(self, device) -> torch.Tensor:
        """``(B,)`` int32: the keys each sequence of a decode case holds."""
        return torch.tensor(self.lengths or (self.seqlen,) * self.batch, dtype=torch.int32, device=device)

    def block_table(self, device) -> torch.Tensor:
        """``(B, ceil(N / page_size))`` int32, the page of each block of a paged decode case: a fixed shuffle of
        a pool with one page per block, so that a sequence's neighbouring blocks are not neighbouring pages."""
        blocks = cdiv(self.seqlen, self.page_size)
        order = torch.randperm(self.batch * blocks, generator=torch.Generator().manual_seed(0))
        return order.view(self.batch, blocks).to(device=device, dtype=torch.int32)

    def to_pages(self, x: torch.Tensor) -> torch.Tensor:
        """A cache ``(B, Hkv, N, D)`` as the pool of :meth:`block_table`: ``(pages, page_size, Hkv, D)``."""
        B, H, N, D = x.shape
        table = self.block_table(x.device)                                          # (B, blocks)
        blocks = table.shape[1]
        padded = x.new_zeros(B, H, blocks * self.page_size, D)
        padded[:, :, :N] = x
        rows = padded.view(B, H, blocks, self.page_size, D).permute(0, 2, 3, 1, 4)  # (B, blocks, page, H, D)
        pool = x.new_empty(B * blocks, self.page_size, H, D)
        pool[table.flatten().long()] = rows.reshape(B * blocks, self.page_size, H, D)
        return pool

    def as_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["window"] = list(self.window)
        d["lengths"] = list(self.lengths)
        d["query_lengths"] = list(self.query_lengths)
        d["label"] = self.label
        return d

    @staticmethod
    def from_dict(d: dict) -> Case:
        """The case whose :meth:`as_dict` (a saved row's ``"case"``) this is; fields a file from before them
        lacks (``softcap``, ``chunk``, ``query_lengths`` ...) take their defaults."""
        names = {f.name for f in dataclasses.fields(Case)}
        kw = {k: v for k, v in d.items() if k in names}
        kw.update({k: tuple(kw[k]) for k in ("window", "lengths", "query_lengths") if k in kw})
        return Case(**kw)


def _counts(counts: tuple[int, ...]) -> str:
    """Query counts in words, runs of one count joined: ``(2048, 2048, 1, 1, 1)`` -> ``2x2048+3x1``."""
    runs = [(n, len(list(group))) for n, group in itertools.groupby(counts)]
    return "+".join(f"{times}x{n}" for n, times in runs)


_GPT_OSS = dict(heads=64, kv_heads=8, head_dim=64, sinks=True, dtype="bfloat16")
_STAGES = dict(batch=1, heads=16, seqlen=4096, head_dim=16, dtype="bfloat16")


def _gpt_oss(family: str, batch: int, seqlen: int, **kw) -> list[Case]:
    # GPT-OSS alternates full-causal layers and sliding layers of 128 keys, both with learned sinks.
    return [Case(family, batch, seqlen=seqlen, causal=True, **_GPT_OSS, **kw),
            Case(family, batch, seqlen=seqlen, causal=True, window=(127, 0), **_GPT_OSS, **kw)]


def packed_case(family: str, lengths, **kw) -> Case:
    """A packed case of documents of the given lengths."""
    lengths = tuple(lengths)
    return Case(family, len(lengths), seqlen=max(lengths), lengths=lengths, **kw)


def document_lengths(total: int, docs: int, seed: int = 0) -> tuple[int, ...]:
    """``docs`` random positive lengths summing to ``total`` (cuts drawn without repeats, seeded)."""
    cuts = sorted(random.Random(seed).sample(range(1, total), docs - 1))
    return tuple(b - a for a, b in zip([0] + cuts, cuts + [total]))


def cache_lengths(batch: int, most: int, seed: int = 0, least: int = 1) -> tuple[int, ...]:
    """``batch`` cache lengths drawn uniformly from ``least .. most`` (seeded)."""
    rng = random.Random(seed)
    return tuple(rng.randint(least, most) for _ in range(batch))


def mixed_case(family: str, lengths, query_lengths, **kw) -> Case:
    """A mixed step: sequence ``b`` holds ``lengths[b]`` keys, the last ``query_lengths[b]`` of them its
    queries; the cache as long as the longest sequence."""
    lengths, query_lengths = tuple(lengths), tuple(query_lengths)
    return Case(family, len(lengths), seqlen=max(lengths), lengths=lengths, query_lengths=query_lengths,
                queries=max(query_lengths), **kw)


# batch x cache length of the decode table (docs/design.md section 5): one long sequence, one short, a batch
# of long caches, a large batch of short ones
DECODE_SHAPES = ((1, 131072), (1, 8192), (8, 32768), (32, 4096))
# Pages of 64 keys, not 16: a page is gstar's whole tile of keys (16-key pages cut its tiles to 16 keys and
# quadruple every kernel's block-table reads); a window of 128 keys spans two or three pages. FA4 on Hopper
# loads pages by TMA only when a page is its whole 128-key tile, so at 64 it reads them with cp.async.
DECODE_PAGE = 64
# One decode step of GPT-OSS-20B serving a batch (attention shapes of transformers' GptOssConfig: 64 query
# heads, 8 kv heads, head dim 64, sliding window 128, learned sinks): 64 sequences whose caches hold 1 to 32768
# keys; about a million cached keys per layer, what one 80 GB card holds for the model's 24 layers beside its
# weights.
STEP_BATCH, STEP_MOST = 64, 32768


def _serving_step(family: str) -> list[Case]:
    """The GPT-OSS-20B serving step (``STEP_BATCH`` caches of ``cache_lengths``), each GPT-OSS layer."""
    return _gpt_oss(family, STEP_BATCH, STEP_MOST, queries=1, lengths=cache_lengths(STEP_BATCH, STEP_MOST))


# DeepSeek-V3's multi-head latent attention decoded with absorbed weights (transformers' DeepseekV3Config: 128
# heads, kv_lora_rank 512, qk_rope_head_dim 64): every query head attends one latent cache of 512 + 64 = 576 lanes
# a key, whose first 512 lanes are also the values (Case.latent), in pages of DECODE_PAGE keys as serving engines
# keep it. The default scale, 576 ** -0.5, stands in for the model's (192 ** -0.5 times YaRN's mscale): a scale
# changes no FLOP and no byte.
_MLA_DECODE = dict(heads=128, kv_heads=1, head_dim=576, value_dim=512, causal=True, dtype="bfloat16", queries=1,
                   page_size=DECODE_PAGE, latent=True)


def _mla_decode(family: str) -> list[Case]:
    """Latent decode steps: one long cache and a batch of long ones (the table's first and third shapes), then
    the serving step's STEP_BATCH caches of cache_lengths."""
    table = [Case(family, b, seqlen=n, **_MLA_DECODE) for b, n in DECODE_SHAPES[::2]]
    step = Case(family, STEP_BATCH, seqlen=STEP_MOST, lengths=cache_lengths(STEP_BATCH, STEP_MOST), **_MLA_DECODE)
    return table + [step]


def _decode_suite() -> list[Case]:
    """The table's shapes and the GPT-OSS-20B step, each pattern, in a contiguous cache then a paged one; then
    DeepSeek-V3's latent decode steps."""
    table = [c for b, n in DECODE_SHAPES for c in _gpt_oss("decode", b, n, queries=1)]
    step = _serving_step("decode")
    return table + step + [dataclasses.replace(c, page_size=DECODE_PAGE) for c in table + step] + _mla_decode("decode")


# One step of a GPT-OSS-20B server with chunked prefill: SERVING_CHUNKS prompts each bring a chunk of
# SERVING_CHUNK new tokens and SERVING_DECODES sequences one token each, 64 sequences as in the decode suite's step.
# A chunk is the last SERVING_CHUNK positions of its cache (its prompt's earlier chunks already there): chunk caches
# hold SERVING_CHUNK .. SERVING_MOST keys (cache_lengths, seed 1), decode caches SERVING_LEAST .. SERVING_MOST
# (seed 2). Speculative decoding verifies SERVING_DRAFTS queries a sequence (the last token and three drafts).
SERVING_CHUNKS, SERVING_CHUNK, SERVING_DECODES, SERVING_DRAFTS = 4, 2048, 60, 4
SERVING_LEAST, SERVING_MOST = 1024, 32768


def serving_lengths() -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The cache lengths of the serving step's chunks and of its decodes (fixed: seeded draws)."""
    return (cache_lengths(SERVING_CHUNKS, SERVING_MOST, seed=1, least=SERVING_CHUNK),
            cache_lengths(SERVING_DECODES, SERVING_MOST, seed=2, least=SERVING_LEAST))


def _serving_suite() -> list[Case]:
    """Each GPT-OSS layer pattern over pages of DECODE_PAGE keys: the mixed step (chunks first, then decodes),
    its chunks alone, its decodes alone, and a speculative step of SERVING_DRAFTS queries on each of its caches."""
    chunks, decodes = serving_lengths()
    steps = ((chunks + decodes, (SERVING_CHUNK,) * SERVING_CHUNKS + (1,) * SERVING_DECODES),
             (chunks, (SERVING_CHUNK,) * SERVING_CHUNKS),
             (decodes, (1,) * SERVING_DECODES),
             (chunks + decodes, (SERVING_DRAFTS,) * (SERVING_CHUNKS + SERVING_DECODES)))
    return [mixed_case("serving", lengths, counts, causal=True, window=w, page_size=DECODE_PAGE, **_GPT_OSS)
            for w in ((-1, -1), (127, 0)) for lengths, counts in steps]


# Gemma 2 9B (transformers' Gemma2Config): 16 query heads, 8 kv heads, head dim 256 (its query_pre_attn_scalar,
# so the default scale), scores soft-capped at 50 (attn_logit_softcapping); global causal layers alternate with
# sliding layers of 4096 keys (sliding_window = 4096: window (4095, 0)), 8192 positions.
_GEMMA = dict(heads=16, kv_heads=8, head_dim=256, causal=True, dtype="bfloat16")
_GEMMA2 = dict(batch=1, seqlen=8192, **_GEMMA)
GEMMA2_SOFTCAP, GEMMA2_WINDOW = 50.0, (4095, 0)
# Gemma 3 12B (Gemma3TextConfig as its model sets it): the same heads (16 / 8, head dim 256, query_pre_attn_scalar
# 256), no soft-cap, five sliding layers of 1024 keys (sliding_window = 1024: window (1023, 0)) to a global one.
GEMMA3_WINDOW = (1023, 0)
# batch x length at 4k and 8k positions, 8192 tokens a batch (the gemma and mla suites)
SHAPES_4K_8K = ((2, 4096), (1, 8192))
# Llama 4 (Scout and Maverick, transformers' Llama4TextConfig): 40 query heads, 8 kv heads, head dim 128; its local
# layers attend causally inside chunks of 8192 positions (attention_chunk_size).
_LLAMA4 = dict(batch=1, seqlen=16384, heads=40, kv_heads=8, head_dim=128, causal=True, dtype="bfloat16")
LLAMA4_CHUNK = 8192


def _models_suite() -> list[Case]:
    """Model layers with rules of their own: Gemma 2's causal and sliding layers, each soft-capped and then
    without the cap (the cap's cost read from one run); a Llama 4 chunked layer of 16k positions, then a causal
    window of the chunk's width, (8191, 0), on the same shape (each query of the chunked layer sees at most as
    many keys as the window's: it should take no longer)."""
    gemma = [Case("models", window=w, softcap=cap, **_GEMMA2) for w in ((-1, -1), GEMMA2_WINDOW)
             for cap in (GEMMA2_SOFTCAP, 0.0)]
    llama = [Case("models", chunk=LLAMA4_CHUNK, **_LLAMA4),
             Case("models", window=(LLAMA4_CHUNK - 1, 0), **_LLAMA4)]
    return gemma + llama


def _gemma_suite() -> list[Case]:
    """Gemma 2 9B's global and sliding layers, then Gemma 3 12B's sliding layer (its global layers are Gemma 2's
    causal rows), at each of SHAPES_4K_8K, without soft-cap: the models suite times Gemma 2's soft-capped layers
    (and its uncapped B1 N8192 rows are these, which ``all`` runs once). A window that hides no key is the causal
    row (Pattern.make drops it): Gemma 2's 4096 keys at 4096 positions."""
    cases = [Case("gemma", b, seqlen=n, window=w, **_GEMMA) for b, n in SHAPES_4K_8K
             for w in ((-1, -1), GEMMA2_WINDOW, GEMMA3_WINDOW)]
    return [c for c in cases if c.window == (-1, -1) or c.pattern.left >= 0]


def _fp8_suite() -> list[Case]:
    """Each FP8 case beside the same case in bfloat16: D 128 causal 8k, the GPT-OSS layers, long decode steps and
    the GPT-OSS-20B serving step from a paged cache (these also against an FP8 cache under bfloat16 queries)."""
    step = _serving_step("fp8")[0]  # its full-attention layer
    cases = [Case("fp8", 4, 16, 16, 8192, 128, causal=True), *_gpt_oss("fp8", 2, 4096),
             *[c for b, n in DECODE_SHAPES[::2] for c in _gpt_oss("fp8", b, n, queries=1)[:1]],
             dataclasses.replace(step, page_size=DECODE_PAGE)]
    return [dataclasses.replace(c, dtype=d) for c in cases
            for d in (("bfloat16", "fp8", FP8_CACHE) if c.decode else ("bfloat16", "fp8"))]


SUITES = {
    "gpt-oss": lambda: _gpt_oss("gpt-oss", 2, 4096),
    "long": lambda: _gpt_oss("long", 1, 8192) + _gpt_oss("long", 1, 32768),
    "fa": lambda: [Case("fa", 4, 16, 16, 8192, 128, causal=c) for c in (False, True)],
    # multi-head latent attention's training shape (DeepSeek-V3): queries and keys 192 wide, values 128; 4k and 8k
    "mla": lambda: [Case("mla", b, 128, 128, n, 192, causal=True, value_dim=128) for b, n in SHAPES_4K_8K],
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
    # Gemma 2 layers with and without their logit soft-cap; a Llama 4 chunked layer beside a window as wide
    "models": _models_suite,
    # Gemma 2 9B's causal and sliding layers and Gemma 3 12B's sliding layer at 4k and 8k, no soft-cap (the models
    # suite times Gemma 2's soft-capped layers)
    "gemma": _gemma_suite,
    # GPT-OSS decode steps: the table's shapes, contiguous and paged, and a GPT-OSS-20B serving step; DeepSeek-V3's
    # latent decode steps, paged
    "decode": _decode_suite,
    # FP8 inputs (forward only) beside bfloat16
    "fp8": _fp8_suite,
    # a GPT-OSS-20B server's mixed step (prefill chunks and decodes) over paged caches, and its parts
    "serving": _serving_suite,
}
SUITE_NAMES = tuple(SUITES) + ("all",)
FORWARD_ONLY = ("decode", "fp8", "serving")  # suites with no backward (decode steps, FP8 inputs)


def suite(name: str) -> list[Case]:
    """The cases of a suite of docs/design.md section 5 (``all``: every suite that times every mode, in
    order, a case that an earlier suite holds already, but for its family, left out: the gemma suite's Gemma 2
    rows at B1 N8192 are the models suite's uncapped rows; ``decode``, ``fp8`` and ``serving``, forward only, run
    on their own)."""
    if name == "all":
        seen, cases = set(), []
        for c in (c for key, build in SUITES.items() if key not in FORWARD_ONLY for c in build()):
            if (same := dataclasses.replace(c, family="")) not in seen:
                seen.add(same)
                cases.append(c)
        return cases
    if name not in SUITES:
        raise ValueError(f"unknown suite {name!r}; choose from {', '.join(SUITE_NAMES)}")
    return SUITES[name]()


def labelled(text: str, name: str = "all") -> Case:
    """The first case of ``suite(name)`` whose label contains ``text`` (the kernel scripts' ``--case``); a
    ValueError naming every label when none does."""
    cases = suite(name)
    found = next((c for c in cases if text in c.label), None)
    if found is None:
        raise ValueError(f"no case label contains {text!r}; labels: " + "; ".join(c.label for c in cases))
    return found


def for_cpu(case: Case) -> Case:
    """A GPU suite case shrunk for a CPU: batch 1 (a packed case keeps its documents, a decode case of unequal
    lengths its first 8 sequences, each 1/16 as long; a mixed step's counts over 16 queries 1/16 as many, each
    cache at least as long as its queries), heads / 8, length / 16, window / 8, chunk / 16 (as the
    length: as many chunks a sequence), float32 (FP8 cases stay FP8: the PyTorch path on their dequantised
    inputs); the soft-cap is kept.

    The group size ``Hq / Hkv`` is kept where the shrunk head count allows it; the point on a CPU is the
    tiled PyTorch path against eager attention at shapes a laptop finishes in seconds.
    """
    heads = max(1, case.heads // 8)
    kv_heads = max(1, heads // max(1, case.heads // case.kv_heads))
    left, right = case.window
    shrink = lambda w: w if w < 0 else max(0, (w + 1) // 8 - 1)  # noqa: E731 - keeps W keys -> W/8 keys
    if case.mixed:
        counts = tuple(nq if nq <= 16 else nq // 16 for nq in case.query_lengths[:8])
        lengths = tuple(max(nq, n // 16, 1) for nq, n in zip(counts, case.lengths))
        rows = {"batch": len(lengths), "seqlen": max(64, case.seqlen // 16, *lengths), "lengths": lengths,
                "query_lengths": counts, "queries": max(counts)}
    elif case.lengths:
        lengths = tuple(max(1, n // 16) for n in (case.lengths[:8] if case.decode else case.lengths))
        rows = dict(batch=len(lengths), seqlen=max(lengths) if case.packed else max(64, case.seqlen // 16),
                    lengths=lengths)
    else:
        rows = dict(batch=1, seqlen=max(64, case.seqlen // 16))
    return dataclasses.replace(case, heads=heads, kv_heads=kv_heads, window=(shrink(left), shrink(right)),
                               chunk=max(1, case.chunk // 16) if case.chunk else 0,
                               dtype=case.dtype if case.fp8 else "float32", **rows)


def custom(seqlens, *, batch=1, heads=16, kv_heads=None, head_dim=64, value_dim=None, causal=False,
           window=(-1, -1), sink_tokens=0, sinks=False, dtype="bfloat16", softcap=0.0, chunk=0) -> list[Case]:
    """One ``custom`` case per sequence length, from the shape flags of ``gstar bench``."""
    kv_heads = heads if kv_heads is None else kv_heads
    if heads % kv_heads:
        raise ValueError(f"--heads ({heads}) must be a multiple of --kv-heads ({kv_heads})")
    if softcap < 0 or chunk < 0:
        raise ValueError(f"--softcap ({softcap}) and --chunk ({chunk}) must be >= 0 (0: none)")
    return [Case("custom", batch, heads, kv_heads, n, head_dim, causal=causal, window=tuple(window),
                 sink_tokens=sink_tokens, sinks=sinks, dtype=dtype, value_dim=value_dim, softcap=float(softcap),
                 chunk=chunk) for n in seqlens]
