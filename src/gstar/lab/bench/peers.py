"""One adapter per implementation that ``gstar bench`` compares (docs/design.md section 5), all fed the same
``(B, H, N, D)`` inputs (values ``Dv`` wide).

An adapter says why it cannot run here at all (:meth:`Peer.unavailable`: not importable, needs CUDA) or
cannot express a case (:meth:`Peer.unsupported`: learned sinks, sink tokens, a window ...); the benchmark
shows that reason as an ``n/a`` row instead of dropping the peer. Every adapter either expresses a case's
logit soft-cap (``Case.softcap``, Gemma 2) and chunked attention (``Case.chunk``, Llama 4) or says it cannot:
a peer is never handed a rule it would silently drop. :meth:`Peer.build` does all setup
(compilation, block masks, dense masks) outside the timed region and returns ``fn(q, k, v, sinks) -> out``
with ``q: (B, Hq, N, D)``, ``k: (B, Hkv, N, D)``, ``v: (B, Hkv, N, Dv)``, ``sinks: (Hq,) float32 or None``,
``out: (B, Hq, N, Dv)``.
Peers whose native layout is ``(B, N, H, D)`` receive transposed views of ``(B, N, H, D)``-contiguous
tensors (``layout = "bnhd"``), so no copy happens inside the timed call. A packed case (the ``varlen`` suite)
has rows for gstar on the packed tokens and for gstar on the same documents padded into a batch
(``layout = "padded"``) only.

A decode case (the ``decode`` suite) gives ``q: (B, Hq, Nq, D)`` and its cache as ``k: (B, Hkv, N, D)``,
``v: (B, Hkv, N, Dv)``, or, paged, as the pools ``(pages, page_size, Hkv, D)`` / ``(..., Dv)`` of
``Case.block_table`` (the same layout for every peer); a latent case's (``Case.latent``) v and its pool are views
of the first ``Dv`` lanes of k and its pool. Each peer takes the lengths (``Case.cache_seqlens``)
and the block table from the case in :meth:`Peer.build`, on the device, outside the timed call. gstar runs
``flash_attention_with_kvcache``; ``gstar-prefill`` runs ``flash_attention`` on the same queries and dense
cache (the training kernel: one program per sequence and kv head).

A mixed step (the ``serving`` suite) gives its packed queries ``q: (total_q, Hq, D)`` (rows of sequence ``b`` at
``Case.query_offsets``, flash-attn's varlen layout, the same for every peer) and takes ``out: (total_q, Hq, Dv)``
back; its cache arrives as a decode case's. gstar runs ``flash_attention_with_kvcache`` with ``cu_seqlens_q``,
FA4 ``flash_attn_varlen_func`` with ``cu_seqlens_q`` and ``page_table``, FlashInfer (when importable) its
paged prefill wrapper, eager each sequence on its own gathered cache; peers with one query count for the whole
batch say so.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import itertools
import math
import os

import torch

from ...pattern import cdiv
from .cases import Case


def _free_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):  # not every OS reports it: then do not skip anything
        return 1 << 62


def _window_or_causal_only(case: Case) -> str | None:
    p = case.pattern
    if p.left >= 0 or p.right > 0:
        return "no sliding window"
    return None


NO_SOFTCAP = "no logit soft-capping"
NO_CHUNK = "no chunked attention"
NO_PACKED_QUERIES = "no packed queries (one query count for the whole batch)"
FA4_MAX_HEAD_DIM = 256  # flash_attn.cute's interface asserts head_dim <= 256 (4.0.0b36): no latent decoding (576)


def _softcap_or_chunk(case: Case, *, softcap: bool, chunk: bool) -> str | None:
    """Why a peer that can soft-cap scores only if ``softcap`` and bound keys by chunks only if ``chunk`` cannot
    run ``case``, or None."""
    if case.softcap and not softcap:
        return NO_SOFTCAP
    if case.chunk and not chunk:
        return NO_CHUNK
    return None


def _dense_cache(case: Case) -> str | None:
    """Why a peer that reads one dense ``(B, N)`` key tensor cannot run a decode case, or None."""
    if case.paged:
        return "no paged cache"
    if case.decode and case.lengths:
        return "one key length for the whole batch"
    return None


class Peer:
    """Base adapter; subclasses set ``name`` (and ``layout``, ``module``) and override what differs."""

    name = "?"
    layout = "bhnd"
    module = "torch"  # top-level module whose distribution version the reports record
    cuda_only = False
    fp8 = False  # takes FP8 inputs with descales (``fn(q, k, v, sinks, q_descale=, k_descale=, v_descale=)``)
    guarded = False  # a failure to build or run is an n/a row (its first line), not an error

    def _fn(self):
        """Import what the implementation needs (and return its entry point, where it has one)."""
        return None

    def applies(self, case: Case) -> bool:
        """Whether the benchmark gives this implementation a row on ``case`` (dense cases only by default)."""
        return not case.packed

    def unavailable(self, device: torch.device) -> str | None:
        """Why this implementation cannot run on ``device`` at all, or None."""
        if self.cuda_only and device.type != "cuda":
            return "needs CUDA"
        try:
            self._fn()
        except Exception as exc:  # ImportError, or a CUDA/CuTe setup error raised at import
            return f"not importable: {type(exc).__name__}"
        return None

    def unsupported(self, case: Case, device: torch.device, mode: str) -> str | None:
        """Why this implementation cannot express ``case``, or None."""
        return None

    def uncapturable(self, case: Case, device: torch.device, mode: str) -> str | None:
        """Why ``case`` should not be captured in a CUDA graph (``--timing graph``), or None. A capture that
        fails keeps its memory for the rest of the process (torch 2.11), so a likely failure is declined."""
        return None

    def build(self, case: Case, device: torch.device):
        """Setup outside the timed region; returns ``fn(q, k, v, sinks) -> out``."""
        raise NotImplementedError


class Gstar(Peer):
    """``gstar.flash_attention`` with ``backend="auto"``: Triton on CUDA, the tiled PyTorch path on CPU; on a
    packed case ``gstar.flash_attention_varlen`` on the packed ``(total, H, D)`` tokens; on a decode case
    ``gstar.flash_attention_with_kvcache`` on the cache (lengths on the device, values not checked on the host:
    a decode loop's call)."""

    name = "gstar"
    module = "gstar"
    kvcache = True  # a decode case through flash_attention_with_kvcache
    fp8 = True
    deterministic = True  # flash_attention's flag for a dense case

    def applies(self, case):
        return True

    def build(self, case, device):
        from ...api import flash_attention, flash_attention_varlen
        from ...kvcache import flash_attention_with_kvcache
        kw = dict(causal=case.causal, window=case.window, sink_tokens=case.sink_tokens, softcap=case.softcap,
                  chunk=case.chunk)
        if case.decode and self.kvcache:
            lengths = case.cache_seqlens(device)
            table = case.block_table(device) if case.paged else None
            if case.mixed:  # packed queries, the grid sized by the longest count
                kw.update(cu_seqlens_q=case.cu_seqlens_q(device), max_seqlen_q=case.queries)
            return lambda q, k, v, sinks, **fp8: flash_attention_with_kvcache(
                q, k, v, cache_seqlens=lengths, block_table=table, sinks=sinks, check_values=False, **kw, **fp8)
        if case.packed and self.layout != "padded":
            cu, n = case.cu_seqlens(device), case.seqlen
            return lambda q, k, v, sinks, **fp8: flash_attention_varlen(q, k, v, cu, cu, n, n, sinks=sinks, **kw,
                                                                        **fp8)
        return lambda q, k, v, sinks, **fp8: flash_attention(q, k, v, sinks=sinks, deterministic=self.deterministic,
                                                             **kw, **fp8)


class GstarPadded(Gstar):
    """``gstar.flash_attention`` on a packed case's documents right-padded into a ``(B, N)`` batch (padded
    outside the timed call): what packing saves. Right padding leaves every real row's result exact for
    patterns with no key right of the diagonal; the padded rows' upstream gradient is zero."""

    name = "gstar-padded"
    layout = "padded"

    def applies(self, case):
        return case.packed

    def unsupported(self, case, device, mode):
        return None if case.pattern.right == 0 else "right padding is exact for causal patterns only"


class GstarPrefill(Gstar):
    """``gstar.flash_attention`` on a decode case: the queries against the dense cache, as a decode step runs
    without ``flash_attention_with_kvcache`` (bottom-right alignment puts them at the cache's end)."""

    name = "gstar-prefill"
    kvcache = False

    def applies(self, case):
        return case.decode

    def unsupported(self, case, device, mode):
        if case.fp8_cache:
            return "16-bit queries on an FP8 cache: flash_attention_with_kvcache only"
        return _dense_cache(case)


class GstarNondeterministic(Gstar):
    """``gstar.flash_attention(deterministic=False)``: its backward may add dQ up in any order (on an H100 / H200,
    where the fused backward serves the case); the forward is gstar's own, so only passes with a backward
    get a row."""

    name = "gstar-nondet"
    deterministic = False

    def applies(self, case):
        return not (case.packed or case.decode)

    def unsupported(self, case, device, mode):
        return "the forward is gstar's" if mode == "fwd" else None


class Eager(Peer):
    """Hugging Face GPT-OSS eager attention: repeat kv, scores, mask, sink column, softmax, drop it, @ v; a
    soft-cap where Hugging Face's Gemma 2 eager attention applies it (``cap * tanh(s / cap)`` of the scaled
    scores, before the mask), a chunk in the mask (the case's pattern).

    The soft-cap runs in float32, rounded once to the scores' dtype: Gemma 2's eager code divides, takes tanh
    and multiplies in bfloat16, three roundings more than the bar's PyTorch baseline, which fails the bar at
    small caps (bf16 on an H100 at cap 5: out error 0.0249, 0.0226 allowed; at cap 50 it passes).

    A mixed step runs sequence by sequence, each against its own cache (gathered from its pages when paged):
    the Hugging Face layer of each request on its own dense cache."""

    name = "eager"

    def unsupported(self, case, device, mode):
        if case.paged and not case.mixed:
            return "no paged cache"
        return self._oom_risk(case, device, mode, 1)

    def uncapturable(self, case, device, mode):
        # a capture keeps intermediates that an eager call frees and reuses, so it needs more than the estimate
        # below: twice it
        return self._oom_risk(case, device, mode, 2)

    @staticmethod
    def _oom_risk(case, device, mode, factor: int) -> str | None:
        # scores, masked, + sink column, - max, softmax; the backward keeps about as many again. K and V repeated
        # for every query head (and their gradients): what a decode step's few rows need most of
        buffers, copies = (5, 1) if mode == "fwd" else (10, 2)
        if case.mixed:  # one sequence at a time: the largest one's buffers
            rows_keys = max(nq * (n + 1) for n, nq in zip(case.lengths, case.query_lengths))
            keys = max(case.lengths)
        else:
            rows_keys, keys = case.batch * case.pattern.nq * (case.seqlen + 1), case.batch * case.seqlen
        scores = buffers * case.heads * rows_keys
        repeated = copies * case.heads * keys * (case.head_dim + case.dv)
        need = factor * (scores + repeated) * case.torch_dtype.itemsize
        if need > 0.6 * _free_bytes(device):
            return f"OOM-risk: ~{need / 2**30:.0f} GiB" + (" in a CUDA graph" if factor > 1 else "")
        return None

    def build(self, case, device):
        if case.mixed:
            return self._build_mixed(case, device)
        # a decode batch of unequal lengths: each sequence's rule on its own length, nothing past it
        lengths = case.cache_seqlens(device).view(-1, 1, 1, 1) if case.decode and case.lengths else None
        visible = case.pattern.mask(device, nk=lengths)                  # (Nq, Nk), or (B, 1, Nq, Nk)
        return lambda q, k, v, sinks: _eager_attention(case, q, k, v, sinks, visible)

    @staticmethod
    def _build_mixed(case: Case, device):
        """Each sequence of a mixed step with queries, against its own keys: a view of a contiguous cache, or
        its pages gathered (their indices on the device, so a CUDA graph replays the gathers)."""
        starts = case.query_offsets()
        table = case.block_table(device).long() if case.paged else None  # (B, blocks)
        seqs = [(b, n, starts[b], starts[b + 1], case.pattern_of(n, nq).mask(device))
                for b, (n, nq) in enumerate(zip(case.lengths, case.query_lengths)) if nq]
        pages = {b: table[b, :cdiv(n, case.page_size)] for b, n, *_ in seqs} if case.paged else {}

        def keys(cache, b, n):  # sequence b's first n keys, (1, Hkv, n, D)
            if not case.paged:
                return cache[b:b + 1, :, :n]
            return cache[pages[b]].flatten(0, 1)[:n].transpose(0, 1)[None]  # pool (pages, page, Hkv, D)

        def eager(q, k, v, sinks):
            outs = [_eager_attention(case, q[r0:r1].transpose(0, 1)[None], keys(k, b, n), keys(v, b, n), sinks,
                                     visible)[0].transpose(0, 1) for b, n, r0, r1, visible in seqs]  # (nq, Hq, Dv)
            return torch.cat(outs)                                       # (total_q, Hq, Dv)
        return eager


def _eager_attention(case: Case, q, k, v, sinks, visible):
    """Hugging Face GPT-OSS eager attention (:class:`Eager`) of ``q (B, Hq, Nq, D)`` against ``k (B, Hkv, Nk, D)``,
    ``v (B, Hkv, Nk, Dv)``, the keys each query sees in ``visible`` (broadcast to ``(B, 1, Nq, Nk)``), the case's
    soft-cap; ``(B, Hq, Nq, Dv)``."""
    B, H, Nq, _ = q.shape
    Nk = k.shape[2]
    group = H // k.shape[1]
    k = k.repeat_interleave(group, dim=1)                                # (B, H, Nk, D)
    v = v.repeat_interleave(group, dim=1)
    scores = (q @ k.transpose(-1, -2)) * case.head_dim ** -0.5          # (B, H, Nq, Nk)
    if case.softcap:
        scores = (torch.tanh(scores.float() / case.softcap) * case.softcap).to(scores.dtype)
    scores = scores.masked_fill(~visible, -math.inf)
    if sinks is not None:
        sink_col = sinks.to(scores.dtype).view(1, H, 1, 1).expand(B, H, Nq, 1)
        scores = torch.cat([scores, sink_col], dim=-1)                   # (B, H, Nq, Nk + 1)
    scores = scores - scores.amax(dim=-1, keepdim=True)                  # as HF does, before its softmax
    probs = torch.softmax(scores, dim=-1, dtype=scores.dtype)
    return probs[..., :Nk] @ v                                           # (B, H, Nq, Dv)


class Sdpa(Peer):
    """``scaled_dot_product_attention`` pinned to one backend (flash or cuDNN) with ``sdpa_kernel``."""

    cuda_only = True

    def __init__(self, backend: str):
        self.backend = backend
        self.name = f"sdpa-{backend}"

    def unsupported(self, case, device, mode):
        if case.sinks:
            return "no learned sinks"
        if case.pattern.sink_tokens:
            return "no sink tokens"
        if rule := _softcap_or_chunk(case, softcap=False, chunk=False):
            return rule  # is_causal, no score modification
        if self.backend == "flash" and case.torch_dtype == torch.float32:
            return "fp16/bf16 only"
        if self.backend == "flash" and case.dv != case.head_dim:
            return "equal head dims only"
        if case.decode and case.causal and case.queries > 1:
            return "is_causal aligns queries top-left"
        return _dense_cache(case) or _window_or_causal_only(case)

    def build(self, case, device):
        from torch.nn.attention import SDPBackend, sdpa_kernel
        from torch.nn.functional import scaled_dot_product_attention as sdpa
        backend = {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION}[self.backend]
        group = case.heads // case.kv_heads
        state = {"gqa": group > 1}  # native GQA first; repeated kv if this backend rejects enable_gqa
        causal = case.causal and not case.decode  # one query at the cache's end sees every key

        def call(q, k, v, gqa):
            if group > 1 and not gqa:
                k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
            with sdpa_kernel(backend):
                return sdpa(q, k, v, is_causal=causal, enable_gqa=gqa)

        def fn(q, k, v, sinks):
            if state["gqa"]:
                try:
                    return call(q, k, v, True)
                except RuntimeError:
                    state["gqa"] = False
            return call(q, k, v, False)
        return fn


def flex_softcap(cap: float):
    """FlexAttention's ``score_mod`` of a logit soft-cap: ``cap * tanh(s / cap)`` of each scaled score (the
    mask comes after it, in the block mask)."""
    def softcap(score, b, h, q_idx, kv_idx):
        return torch.tanh(score / cap) * cap
    return softcap


def flex_with_sinks():
    """``fn(q, k, v, sinks, block_mask, score_mod=None) -> out``: FlexAttention with GQA and learned sinks
    (``sinks: (Hq,)`` float32 or None), ``q (B, Hq, Nq, D)`` against ``k, v (B, Hkv, Nk, D)`` under
    ``block_mask`` (and ``score_mod``, e.g. :func:`flex_softcap`), each row then scaled by the share of its
    softmax that the sink leaves to the keys, from the LSE Flex returns (the sink is not soft-capped)."""
    from torch.nn.attention.flex_attention import flex_attention
    aux = "return_aux" in inspect.signature(flex_attention).parameters

    def fn(q, k, v, sinks, block_mask, score_mod=None):
        kw = dict(block_mask=block_mask, score_mod=score_mod, enable_gqa=True)
        if sinks is None:
            return flex_attention(q, k, v, **kw)
        if aux:
            from torch.nn.attention.flex_attention import AuxRequest
            out, extra = flex_attention(q, k, v, **kw, return_aux=AuxRequest(lse=True))
            lse = extra.lse
        else:
            out, lse = flex_attention(q, k, v, **kw, return_lse=True)
        # sum_j e^s / (sum_j e^s + e^sink) = out * e^lse / (e^lse + e^sink) = out * sigmoid(lse - sink); a row
        # that sees no key has lse = -inf: weight 0, out 0, as the rule has it
        keep = torch.sigmoid(lse - sinks.view(1, -1, 1))                 # (B, Hq, Nq)
        return (out.float() * keep.unsqueeze(-1)).to(q.dtype)
    return fn


@functools.lru_cache(maxsize=1)
def _flex_compiled():
    import torch._dynamo
    cfg = torch._dynamo.config
    for knob in ("cache_size_limit", "recompile_limit"):  # one compiled graph per case shape
        if hasattr(cfg, knob):
            setattr(cfg, knob, max(getattr(cfg, knob), 256))
    return torch.compile(flex_with_sinks(), dynamic=False)


def flex_block_mask(case: Case, device):
    """The block mask of ``case`` for FlexAttention (the case's whole pattern: causal, window, sink tokens and
    chunk, through ``Pattern.visible``), or None where every query sees every key. A decode batch of unequal
    lengths gets one mask per sequence, its lengths read on the device inside the mask."""
    from torch.nn.attention.flex_attention import create_block_mask
    p = case.pattern
    if case.decode and case.lengths:
        lengths = case.cache_seqlens(device)
        return create_block_mask(lambda b, h, i, j: p.visible(i, j, nk=lengths[b]), case.batch, None, p.nq, p.nk,
                                 device=device)
    if p.visible_pairs() == p.nq * p.nk:
        return None
    return create_block_mask(lambda b, h, i, j: p.visible(i, j), None, None, p.nq, p.nk, device=device)


class Flex(Peer):
    """Compiled FlexAttention: a block mask for causal / window / sink tokens / chunk / cache lengths, a
    ``score_mod`` for a soft-cap (:func:`flex_softcap`), learned sinks via the LSE (:func:`flex_with_sinks`)."""

    name = "flex"
    cuda_only = True

    def _fn(self):
        return importlib.import_module("torch.nn.attention.flex_attention").flex_attention

    def unsupported(self, case, device, mode):
        # paged caches only through torch's experimental PagedAttention, outside the public flex_attention
        if case.paged:
            return "no paged cache"
        return NO_PACKED_QUERIES if case.mixed else None

    def build(self, case, device):
        block_mask = flex_block_mask(case, device)
        score_mod = flex_softcap(case.softcap) if case.softcap else None
        compiled = _flex_compiled()
        return lambda q, k, v, sinks: compiled(q, k, v, sinks, block_mask, score_mod)


class FA4(Peer):
    """FlashAttention-4 (``flash_attn.cute.flash_attn_func``), ``(B, N, H, D)`` layout, when importable; a decode
    case through its decode entry, ``flash_attn_varlen_func`` with the lengths on the device (``seqused_k``)
    and, paged, ``page_table`` over the pools (its paged layout is gstar's); a mixed step's packed queries
    through its ``cu_seqlens_q`` and ``max_seqlen_q``, each sequence's queries its last positions as in gstar.
    A soft-cap through its ``softcap`` argument; no chunked attention: FA4 would need a CuTe DSL ``mask_mod``
    (and block-sparse tensors to skip the hidden tiles), which this adapter does not build."""

    name = "fa4"
    layout = "bnhd"
    module = "flash_attn"
    cuda_only = True

    def _fn(self):
        from flash_attn.cute import flash_attn_func
        return flash_attn_func

    def _entry(self, case: Case):
        if case.decode:
            from flash_attn.cute import flash_attn_varlen_func
            return flash_attn_varlen_func
        return self._fn()

    def unsupported(self, case, device, mode):
        params = inspect.signature(self._entry(case)).parameters
        p = case.pattern
        if case.sinks and "learnable_sink" not in params:
            return "no learned sinks"
        if p.sink_tokens:
            return "no sink tokens"
        if (p.left >= 0 or p.right > 0) and "window_size" not in params:
            return "no sliding window"
        if rule := _softcap_or_chunk(case, softcap="softcap" in params, chunk=False):
            return rule + (" (only as a CuTe DSL mask_mod)" if rule == NO_CHUNK else "")
        if case.torch_dtype == torch.float32:
            return "fp16/bf16 only"
        if case.head_dim > FA4_MAX_HEAD_DIM:
            return f"head dims up to {FA4_MAX_HEAD_DIM}"
        if case.decode and "seqused_k" not in params:
            return "no per-sequence key lengths"
        if case.mixed and "cu_seqlens_q" not in params:
            return NO_PACKED_QUERIES
        if case.paged and "page_table" not in params:
            return "no paged cache"
        return None

    def build(self, case, device):
        fa = self._entry(case)
        p = case.pattern
        kw = {"causal": p.right == 0 and p.left < 0, "softmax_scale": case.head_dim ** -0.5}
        if p.left >= 0 or p.right > 0:
            kw["window_size"] = (p.left if p.left >= 0 else None, p.right if p.right >= 0 else None)
        if case.softcap:
            kw["softcap"] = case.softcap
        if case.decode:
            kw["seqused_k"] = case.cache_seqlens(device)
            if case.paged:
                kw["page_table"] = case.block_table(device)
            # split-KV on Blackwell (num_splits < 1: FA4's own choice); SM 8.x and 9.x assert a single split
            kw["num_splits"] = 0 if torch.cuda.get_device_capability(device)[0] in (10, 11) else 1
        if case.mixed:
            kw.update(cu_seqlens_q=case.cu_seqlens_q(device), max_seqlen_q=case.queries)

        def fn(q, k, v, sinks):
            extra = {} if sinks is None else {"learnable_sink": sinks}
            if not case.paged:  # a paged cache's pools arrive as they are: (pages, page_size, Hkv, D)
                k, v = k.transpose(1, 2), v.transpose(1, 2)
            res = fa(q if case.mixed else q.transpose(1, 2), k, v, **kw, **extra)
            out = res[0] if isinstance(res, tuple) else res              # (B, N, H, D), or (total_q, H, D)
            return out if case.mixed else out.transpose(1, 2)
        return fn


class Fla(Peer):
    """flash-linear-attention's softmax attention (``fla.ops.attn.parallel.parallel_attn``): causal only; a
    decode case through its decoding kernel (``fla.ops.attn.decoding.attn_decoding_one_step``): one query per
    sequence against its keys packed back to back (``cu_seqlens``), which a full cache of equal lengths is.
    Neither takes a soft-cap or a chunk (fla's ``chunk_size`` is a tile size of its kernels, not a rule)."""

    name = "fla"
    layout = "bnhd"
    module = "fla"
    cuda_only = True

    def _fn(self):
        from fla.ops.attn.parallel import parallel_attn
        return parallel_attn

    def _decoding(self):
        from fla.ops.attn.decoding import attn_decoding_one_step
        return attn_decoding_one_step

    def unsupported(self, case, device, mode):
        if rule := _softcap_or_chunk(case, softcap=False, chunk=False):
            return rule
        if case.mixed:
            return NO_PACKED_QUERIES
        if case.decode:
            return self._decode_unsupported(case)
        params = inspect.signature(self._fn()).parameters
        p = case.pattern
        if p.right != 0:
            return "causal only"
        if p.left >= 0 and "window_size" not in params:
            return "no sliding window"
        if p.sink_tokens:
            return "no sink tokens"
        if case.sinks and "sink_bias" not in params:
            return "no learned sinks"
        return None

    def _decode_unsupported(self, case: Case) -> str | None:
        try:
            params = inspect.signature(self._decoding()).parameters
        except ImportError:
            return "no decoding kernel (fla.ops.attn.decoding)"
        p = case.pattern
        if case.queries > 1:
            return "one query per sequence"
        if case.paged:
            return "no paged cache"
        if case.lengths:
            return "keys packed back to back: a cache of unequal lengths has gaps"
        if p.sink_tokens:
            return "no sink tokens"
        if p.left >= 0 and "window_size" not in params:
            return "no sliding window"
        if case.sinks and "sink_bias" not in params:
            return "no learned sinks"
        return None  # one query at its sequence's end: a right bound changes nothing

    def build(self, case, device):
        if case.decode:
            return self._build_decode(case, device)
        fla = self._fn()
        p = case.pattern
        kw = {"scale": case.head_dim ** -0.5}
        if p.left >= 0:
            kw["window_size"] = p.left + 1  # keys including the query's own position (checked against the oracle)

        def fn(q, k, v, sinks):
            extra = {} if sinks is None else {"sink_bias": sinks}
            res = fla(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), **kw, **extra)
            out = res[0] if isinstance(res, tuple) else res             # (B, N, H, D)
            return out.transpose(1, 2)
        return fn

    def _build_decode(self, case: Case, device):
        fla = self._decoding()
        p = case.pattern
        B, N = case.batch, case.seqlen
        kw = {"scale": case.head_dim ** -0.5,
              "cu_seqlens": torch.arange(0, (B + 1) * N, N, dtype=torch.int64, device=device)}  # (B + 1,)
        if p.left >= 0:
            kw["window_size"] = p.left + 1  # the last left + 1 keys, the query's own included

        def fn(q, k, v, sinks):
            extra = {} if sinks is None else {"sink_bias": sinks}
            Hq, Hkv = q.shape[1], k.shape[1]
            q1 = q.transpose(1, 2).reshape(1, B, Hq, -1)                 # (1, B, Hq, D): one query a sequence
            k1 = k.transpose(1, 2).reshape(1, B * N, Hkv, -1)            # (1, B N, Hkv, D): the cache, packed
            v1 = v.transpose(1, 2).reshape(1, B * N, Hkv, -1)
            out = fla(q1, k1, v1, **kw, **extra)                         # (1, B, Hq, Dv)
            return out.view(B, 1, Hq, -1).transpose(1, 2)                # (B, Hq, 1, Dv)
        return fn


FLASHINFER_NA = ("flashinfer-python 0.7.4 is a 101 MB wheel that JIT-compiles its kernels with nvcc on first use; it "
                 "is not carried to the GPU machine")


class FlashInfer(Peer):
    """FlashInfer's paged-cache wrappers on a decode case or a mixed step: ``BatchDecodeWithPagedKVCacheWrapper``
    for one query a sequence, ``BatchPrefillWithPagedKVCacheWrapper`` (causal: each sequence's queries its last
    positions) for more or a query count per sequence. :meth:`build` plans them on the case's pages in
    FlashInfer's CSR form (per sequence its pages' indices and the last page's fill, ``"NHD"``: gstar's pool
    layout; a contiguous cache ``(B, N, Hkv, D)`` is a pool of one page of ``N`` keys a sequence); the timed call
    runs them. Guarded: FlashInfer JIT-compiles its kernels on first use, and any
    failure is an n/a row with its first line."""

    name = "flashinfer"
    layout = "bnhd"
    module = "flashinfer"
    cuda_only = True
    guarded = True
    workspace_bytes = 128 << 20  # FlashInfer's float workspace (its examples' 128 MB)

    def _fn(self):
        return importlib.import_module("flashinfer")

    def applies(self, case):
        return case.decode

    def unavailable(self, device):
        try:
            self._fn()
        except (ImportError, RuntimeError, OSError):  # not installed, or its setup failing at import
            return FLASHINFER_NA
        return super().unavailable(device)

    @staticmethod
    def _one_query(case: Case) -> bool:
        return not case.mixed and case.queries == 1

    def _wrapper(self, case: Case):
        fi = self._fn()
        one = self._one_query(case)
        return fi.BatchDecodeWithPagedKVCacheWrapper if one else fi.BatchPrefillWithPagedKVCacheWrapper

    def unsupported(self, case, device, mode):
        p = case.pattern
        if rule := _softcap_or_chunk(case, softcap=True, chunk=False):
            return rule
        if p.right != 0 and not self._one_query(case):
            return "causal patterns only"
        if p.sink_tokens:
            return "no sink tokens"
        if case.torch_dtype == torch.float32:
            return "fp16/bf16 only"
        if case.dv != case.head_dim:  # its paged wrappers take one head dim; latent attention has wrappers of its own
            return "values as wide as the keys only (latent attention: FlashInfer's MLA wrapper, not built here)"
        if case.sinks and "sinks" not in inspect.signature(self._wrapper(case).run).parameters:
            return "no learned sinks"
        return None

    def build(self, case, device):
        Hq, D = case.heads, case.head_dim
        lengths = case.cache_seqlens("cpu").tolist()
        page = case.page_size or case.seqlen  # a contiguous cache: one page of the whole cache a sequence
        counts = [cdiv(n, page) for n in lengths]                                       # pages of each sequence
        table = (case.block_table("cpu") if case.paged
                 else torch.arange(case.batch, dtype=torch.int32)[:, None])             # (B, blocks)
        indices = torch.cat([table[b, :m] for b, m in enumerate(counts)]).to(device)    # (pages read,)
        indptr = torch.tensor([0, *itertools.accumulate(counts)], dtype=torch.int32, device=device)
        last = torch.tensor([n - (m - 1) * page for n, m in zip(lengths, counts)], dtype=torch.int32,
                            device=device)                                              # (B,) keys of the last page
        kw = {"window_left": case.pattern.left, "logits_soft_cap": case.softcap or None, "sm_scale": D ** -0.5,
              "q_data_type": case.torch_dtype, "kv_data_type": case.torch_dtype}
        wrapper = self._wrapper(case)(torch.empty(self.workspace_bytes, dtype=torch.uint8, device=device), "NHD")
        pages = (indptr, indices, last, Hq, case.kv_heads, D, page)
        if self._one_query(case):
            wrapper.plan(*pages, **kw)
        else:
            qo = case.cu_seqlens_q(device) if case.mixed else torch.arange(
                0, case.tokens + 1, case.queries, dtype=torch.int32, device=device)    # (B + 1,)
            wrapper.plan(qo, *pages, causal=True, **kw)

        def fn(q, k, v, sinks):
            if not case.paged:  # views of (B, N, Hkv, D) memory: a pool of B pages of N keys
                k, v = k.transpose(1, 2), v.transpose(1, 2)
            rows = q if case.mixed else q.transpose(1, 2).reshape(-1, Hq, D)          # (total_q, Hq, D)
            out = wrapper.run(rows, (k, v), **({} if sinks is None else {"sinks": sinks}))
            return out if case.mixed else out.view(case.batch, case.queries, Hq, -1).transpose(1, 2)
        return fn


def all_peers() -> list[Peer]:
    """Every implementation, gstar first (the ratio column divides by its time)."""
    return [Gstar(), GstarPadded(), GstarPrefill(), GstarNondeterministic(), Eager(), Sdpa("flash"), Sdpa("cudnn"),
            Flex(), FA4(), Fla(), FlashInfer()]


PEER_NAMES = tuple(p.name for p in all_peers())
