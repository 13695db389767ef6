"""One adapter per implementation that ``gstar bench`` compares (docs/design.md section 5), all fed the same
``(B, H, N, D)`` inputs (values ``Dv`` wide).

An adapter says why it cannot run here at all (:meth:`Peer.unavailable`: not importable, needs CUDA) or
cannot express a case (:meth:`Peer.unsupported`: learned sinks, sink tokens, a window ...); the benchmark
shows that reason as an ``n/a`` row instead of dropping the peer. :meth:`Peer.build` does all setup
(compilation, block masks, dense masks) outside the timed region and returns ``fn(q, k, v, sinks) -> out``
with ``q: (B, Hq, N, D)``, ``k: (B, Hkv, N, D)``, ``v: (B, Hkv, N, Dv)``, ``sinks: (Hq,) float32 or None``,
``out: (B, Hq, N, Dv)``.
Peers whose native layout is ``(B, N, H, D)`` receive transposed views of ``(B, N, H, D)``-contiguous
tensors (``layout = "bnhd"``), so no copy happens inside the timed call. A packed case (the ``varlen`` suite)
has rows for gstar on the packed tokens and for gstar on the same documents padded into a batch
(``layout = "padded"``) only.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import math
import os

import torch

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


class Peer:
    """Base adapter; subclasses set ``name`` (and ``layout``, ``module``) and override what differs."""

    name = "?"
    layout = "bhnd"
    module = "torch"  # top-level module whose distribution version the reports record
    cuda_only = False

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
    packed case ``gstar.flash_attention_varlen`` on the packed ``(total, H, D)`` tokens."""

    name = "gstar"
    module = "gstar"

    def applies(self, case):
        return True

    def build(self, case, device):
        from ..api import flash_attention, flash_attention_varlen
        kw = dict(causal=case.causal, window=case.window, sink_tokens=case.sink_tokens)
        if case.packed and self.layout != "padded":
            cu, n = case.cu_seqlens(device), case.seqlen
            return lambda q, k, v, sinks: flash_attention_varlen(q, k, v, cu, cu, n, n, sinks=sinks, **kw)
        return lambda q, k, v, sinks: flash_attention(q, k, v, sinks=sinks, **kw)


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


class Eager(Peer):
    """Hugging Face GPT-OSS eager attention: repeat kv, scores, mask, sink column, softmax, drop it, @ v."""

    name = "eager"

    def unsupported(self, case, device, mode):
        return self._oom_risk(case, device, mode, 1)

    def uncapturable(self, case, device, mode):
        # a capture keeps intermediates that an eager call frees and reuses, so it needs more than the estimate
        # below: twice it (benchmarks/NOTES.md, 'Graph-timed runs: memory after a failed capture')
        return self._oom_risk(case, device, mode, 2)

    @staticmethod
    def _oom_risk(case, device, mode, factor: int) -> str | None:
        # scores, masked, + sink column, - max, softmax; the backward keeps about as many again
        buffers = (5 if mode == "fwd" else 10) * factor
        need = buffers * case.batch * case.heads * case.seqlen * (case.seqlen + 1) * case.torch_dtype.itemsize
        if need > 0.6 * _free_bytes(device):
            return f"OOM-risk: ~{need / 2**30:.0f} GiB" + (" in a CUDA graph" if factor > 1 else "")
        return None

    def build(self, case, device):
        visible = case.pattern.mask(device)                              # (N, N) bool
        group = case.heads // case.kv_heads
        scale = case.head_dim ** -0.5

        def eager(q, k, v, sinks):
            B, H, N, _ = q.shape
            k = k.repeat_interleave(group, dim=1)                        # (B, H, N, D)
            v = v.repeat_interleave(group, dim=1)
            scores = (q @ k.transpose(-1, -2)) * scale                   # (B, H, N, N)
            scores = scores.masked_fill(~visible, -math.inf)
            if sinks is not None:
                sink_col = sinks.to(scores.dtype).view(1, H, 1, 1).expand(B, H, N, 1)
                scores = torch.cat([scores, sink_col], dim=-1)           # (B, H, N, N + 1)
            scores = scores - scores.amax(dim=-1, keepdim=True)          # as HF does, before its softmax
            probs = torch.softmax(scores, dim=-1, dtype=scores.dtype)
            return probs[..., :N] @ v                                    # (B, H, N, Dv)
        return eager


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
        if self.backend == "flash" and case.torch_dtype == torch.float32:
            return "fp16/bf16 only"
        if self.backend == "flash" and case.dv != case.head_dim:
            return "equal head dims only"
        return _window_or_causal_only(case)

    def build(self, case, device):
        from torch.nn.attention import SDPBackend, sdpa_kernel
        from torch.nn.functional import scaled_dot_product_attention as sdpa
        backend = {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION}[self.backend]
        group = case.heads // case.kv_heads
        state = {"gqa": group > 1}  # native GQA first; repeated kv if this backend rejects enable_gqa

        def call(q, k, v, gqa):
            if group > 1 and not gqa:
                k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
            with sdpa_kernel(backend):
                return sdpa(q, k, v, is_causal=case.causal, enable_gqa=gqa)

        def fn(q, k, v, sinks):
            if state["gqa"]:
                try:
                    return call(q, k, v, True)
                except RuntimeError:
                    state["gqa"] = False
            return call(q, k, v, False)
        return fn


@functools.lru_cache(maxsize=1)
def _flex_compiled():
    import torch._dynamo
    from torch.nn.attention.flex_attention import flex_attention
    cfg = torch._dynamo.config
    for knob in ("cache_size_limit", "recompile_limit"):  # one compiled graph per case shape
        if hasattr(cfg, knob):
            setattr(cfg, knob, max(getattr(cfg, knob), 256))
    aux = "return_aux" in inspect.signature(flex_attention).parameters

    def flex_with_sinks(q, k, v, sinks, block_mask):
        if sinks is None:
            return flex_attention(q, k, v, block_mask=block_mask, enable_gqa=True)
        if aux:
            from torch.nn.attention.flex_attention import AuxRequest
            out, extra = flex_attention(q, k, v, block_mask=block_mask, enable_gqa=True,
                                        return_aux=AuxRequest(lse=True))
            lse = extra.lse
        else:
            out, lse = flex_attention(q, k, v, block_mask=block_mask, enable_gqa=True, return_lse=True)
        # sum_j e^s / (sum_j e^s + e^sink) = out * e^lse / (e^lse + e^sink) = out * sigmoid(lse - sink)
        keep = torch.sigmoid(lse - sinks.view(1, -1, 1))                 # (B, H, N)
        return (out.float() * keep.unsqueeze(-1)).to(q.dtype)
    return torch.compile(flex_with_sinks, dynamic=False)


class Flex(Peer):
    """Compiled FlexAttention: a block mask for causal / window / sink tokens, learned sinks via the LSE."""

    name = "flex"
    cuda_only = True

    def _fn(self):
        return importlib.import_module("torch.nn.attention.flex_attention").flex_attention

    def build(self, case, device):
        from torch.nn.attention.flex_attention import create_block_mask
        p = case.pattern
        block_mask = None
        if p.left >= 0 or p.right >= 0:
            block_mask = create_block_mask(lambda b, h, i, j: p.visible(i, j), None, None, p.nq, p.nk,
                                           device=device)
        compiled = _flex_compiled()
        return lambda q, k, v, sinks: compiled(q, k, v, sinks, block_mask)


class FA4(Peer):
    """FlashAttention-4 (``flash_attn.cute.flash_attn_func``), ``(B, N, H, D)`` layout, when importable."""

    name = "fa4"
    layout = "bnhd"
    module = "flash_attn"
    cuda_only = True

    def _fn(self):
        from flash_attn.cute import flash_attn_func
        return flash_attn_func

    def unsupported(self, case, device, mode):
        params = inspect.signature(self._fn()).parameters
        p = case.pattern
        if case.sinks and "learnable_sink" not in params:
            return "no learned sinks"
        if p.sink_tokens:
            return "no sink tokens"
        if (p.left >= 0 or p.right > 0) and "window_size" not in params:
            return "no sliding window"
        if case.torch_dtype == torch.float32:
            return "fp16/bf16 only"
        return None

    def build(self, case, device):
        fa = self._fn()
        p = case.pattern
        kw = {"causal": p.right == 0 and p.left < 0, "softmax_scale": case.head_dim ** -0.5}
        if p.left >= 0 or p.right > 0:
            kw["window_size"] = (p.left if p.left >= 0 else None, p.right if p.right >= 0 else None)

        def fn(q, k, v, sinks):
            extra = {} if sinks is None else {"learnable_sink": sinks}
            res = fa(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), **kw, **extra)
            out = res[0] if isinstance(res, tuple) else res              # (B, N, H, D)
            return out.transpose(1, 2)
        return fn


class Fla(Peer):
    """flash-linear-attention's softmax attention (``fla.ops.attn.parallel.parallel_attn``): causal only."""

    name = "fla"
    layout = "bnhd"
    module = "fla"
    cuda_only = True

    def _fn(self):
        from fla.ops.attn.parallel import parallel_attn
        return parallel_attn

    def unsupported(self, case, device, mode):
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

    def build(self, case, device):
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


def all_peers() -> list[Peer]:
    """Every implementation, gstar first (the ratio column divides by its time)."""
    return [Gstar(), GstarPadded(), Eager(), Sdpa("flash"), Sdpa("cudnn"), Flex(), FA4(), Fla()]


PEER_NAMES = tuple(p.name for p in all_peers())
