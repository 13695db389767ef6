"""The ``"gstar"`` attention implementation for Hugging Face transformers.

Importing this module registers it (see :func:`register`); then::

    import gstar.integrations.transformers
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="gstar")   # or
    model.set_attn_implementation("gstar")

``"gstar_nondeterministic"`` is the same with ``deterministic=False``: on an H100 / H200 the backward of layers at
head dim 128 (Llama, Qwen) then takes the fused kernel adding dQ up in any order (full layers too; dQ's last
bits vary from run to run), where ``"gstar"`` takes it only for causal layers, its adds in a fixed order;
everywhere else the two names compute the same. A model call may also
pass ``deterministic=True / False`` itself (as transformers' flash-attention integration reads it).

Any decoder whose attention is causal (or bidirectional) with GQA and any of a sliding window, learned sinks,
logit soft-capping and chunked attention runs exactly: GPT-OSS (``s_aux`` becomes ``sinks``, with its
gradient), Llama, Qwen2/3, Mistral, Gemma 2, Gemma 3 (its text model; its vision-language model too, SigLIP
tower and image tokens included) and Llama 4's text model. The attention
function takes the model's ``(B, heads, N, head_dim)`` projections and returns ``(B, N, Hq, head_dim)``, as
transformers expects. What the model passes becomes gstar's keywords:

- ``sliding_window=W`` (W keys, the query's own included) is ``window=(W - 1, 0)``; ``(W - 1, W - 1)`` in a
  non-causal layer (Gemma's ``use_bidirectional_attention``);
- ``softcap`` (Gemma 2's ``attn_logit_softcapping``) is gstar's ``softcap``: the scores ``scaling * q . k``
  become ``softcap * tanh(s / softcap)`` before the mask; ``scaling`` (Gemma's ``query_pre_attn_scalar ** -0.5``)
  is gstar's ``scale``;
- a layer that ``config.layer_types[layer_idx]`` names ``"chunked_attention"`` (Llama 4) takes
  ``chunk=config.attention_chunk_size`` with its causal rule: a query sees the keys of its own chunk of
  positions, counted from each sequence's first real token as transformers counts them.

Like the flash-attention integrations, no 4-D mask is built. The mask function reads the mask transformers
describes (the layer's rule, padding, packed documents, and any overlay the model adds) and hands the
attention function ``None`` (every key it gets is a real one), the 2-D padding mask, packed documents'
boundaries, or, for a layer whose keys include slots not yet written (a static cache's preallocated buffer),
each sequence's filled length; the attention function picks one of four paths:

- plain batch: :func:`gstar.flash_attention` on the tensors as they come (no copies of q, k, v). With fewer
  queries than keys (decoding from a dynamic cache, whose sliding-window layers keep only the window's keys)
  the queries are the last keys, which is gstar's bottom-right alignment;
- static cache: :func:`gstar.flash_attention_with_kvcache` on the cache's buffer (k, v already written by
  the cache), ``cache_seqlens`` the filled length ``(B,)`` int32, computed on the device from the cache's
  offset (a device value in a static cache): no host read, so a compiled or graph-captured decode step
  stays whole. Forward only, as decoding is;
- padded batch (2-D mask with zeros): unpad, :func:`gstar.flash_attention_varlen`, pad back. With fewer
  queries than keys (generation) each row's queries must be its last real keys, as left padding gives (a
  mask whose last column holds a zero raises a ``ValueError``). Exact with either cache (a static buffer's
  unwritten slots lie past the mask), but the mask's lengths are read on the host, once per forward pass;
- packed batch (``cu_seq_lens_q/k`` from a flattening collator, or position ids restarting at 0 inside a
  row, which the attention function reads or, in models that do not forward them to it, such as Llama 4,
  the mask function finds where transformers found documents): :func:`gstar.flash_attention_varlen` on the
  flattened batch, each document attending only to itself.

transformers' caches keep only the last ``attention_chunk_size - 1`` keys of a chunked layer (its dynamic
cache's sliding layers; its static cache's rolling buffers), so that past the first chunk the keys no longer
start at position 0 and gstar, counting chunks from the first key, would misplace their boundaries. The mask
function then also marks the keys before the first query's chunk, which no query of the step sees, as
padding: unpadded, each row starts at a chunk boundary, and decoding is exact, at the padded path's cost (a
host read per forward pass). A cache whose keys start inside the queries' chunk raises a ``ValueError``.

Under ``torch.compile`` the plain, static-cache and ``cu_seq_lens`` paths trace without a host read; a padding
mask, whose lengths must be read to unpad, breaks the graph there, and position ids are not searched for
documents (pass ``cu_seq_lens_q/k`` instead). Nor can the mask function read a compiled model's mask
overlays: any ``or_mask_function`` / ``and_mask_function`` or block ids raise there (a bidirectional
model's overlays excepted),
as does a mask built for a chunked model's cache layer whose keys start past position 0 (masks that
``generate`` builds ahead of a step, for a static cache, are built uncompiled).

What the model asks for and gstar cannot do raises a ``ValueError`` naming the feature instead of being
silently wrong: attention dropout while training; any mask overlay a model lays over its causal mask other than
bidirectional token blocks; custom 4-D masks; token blocks with packed documents or into a static cache's buffer;
and, inside :func:`gstar.distributed.context_parallel`, chunked attention and token blocks.

Bidirectional token blocks (Gemma 3's image tokens, PaliGemma's prefix, marked by ``token_type_ids``) reach the
mask function as a blockwise overlay; their block ids become gstar's ``spans`` (a block's tokens see each other
both ways; a sliding layer's window still bounds how far back a query looks, as transformers intersects it),
through plain and padded batches alike.

Continuous batching (``model.generate_batch``, ``model.init_continuous_batching``): a model on ``"gstar"`` (or
``"gstar_nondeterministic"``) runs it as it is. transformers' manager takes only ``"sdpa"``, ``"paged|eager"`` and
names holding "flash" (these get no mask, the requests described by ``cu_seq_lens``), and sends any name holding
"flash" to its flash-attn loader; so :func:`register` wraps the manager's switch of implementation to put such a
model on :data:`PAGED` (``"gstar_paged_flash"``, the same attention function) for the batch and back on its own
name after. Each step packs its requests in one row, some prefilling, some decoding a token; the paged cache
writes the new keys and hands back each request's keys (a sliding layer's last ``W - 1`` beside the new ones,
``cu_seq_lens_k`` by layer type, of which the attention function takes this layer's entry), and
:func:`gstar.flash_attention_varlen` attends the queries as each request's last keys, windows, sinks and
soft-capping applied as above (releases whose cache leaves its writing to the attention function, 5.17 and
older, are written here first). A decode step on transformers' block table (its fast path, which transformers
enables for flash-attn 2 / 3 on CUDA) appends the new token into the layer's paged cache ``(num_pages,
page_size, Hkv, D)`` and attends through :func:`gstar.flash_attention_with_kvcache`; pages must hold a multiple
of 16 tokens (``ContinuousBatchingConfig(page_size=...)``, 256 by default). Rows a CUDA graph pads past the
last request come out unset, as flash-attn leaves them.
"""

from __future__ import annotations

import inspect
import weakref
from typing import NamedTuple

import torch

try:
    from transformers import AttentionInterface
except ImportError:  # older releases export it from modeling_utils only
    from transformers.modeling_utils import AttentionInterface
try:
    from transformers import AttentionMaskInterface
except ImportError:
    from transformers.masking_utils import AttentionMaskInterface
try:
    from transformers import masking_utils as _masking_utils
    _MASKS = _masking_utils.__name__  # the module whose mask-function building blocks gstar_mask recognises
except ImportError:  # releases without it build no mask functions
    _MASKS = None

from ..api import check_cu_seqlens_values, flash_attention, flash_attention_varlen
from ..checks import capturing as _capturing
from ..distributed import context as context_parallel
from ..kvcache import flash_attention_with_kvcache
from ..varlen import cu_seqlens_from_mask, cu_seqlens_from_position_ids, pad, unpad

NAME = "gstar"
NONDETERMINISTIC = "gstar_nondeterministic"
PAGED = "gstar_paged_flash"  # the name a model takes inside continuous batching (see _continuous_batching_switch)


class _Plans:
    """Packing plans keyed on the identity (and in-place version) of mask, position-id or cu_seq_lens tensors.

    Every layer of one forward pass receives the same tensors; computing their plan once saves a device
    sync per layer (building offsets, or checking given ones). Entries hold weak references, so a freed
    tensor is never matched.
    """

    def __init__(self, size: int = 8):
        self.size = size
        self.entries = []

    def get(self, tensors: tuple, key, build):
        """The plan of ``(tensors, key)``, built by ``build()`` on a miss."""
        versions = tuple(t._version for t in tensors)
        for refs, vs, k, plan in self.entries:
            if vs == versions and k == key and all(r() is t for r, t in zip(refs, tensors)):
                return plan
        plan = build()
        refs = tuple(weakref.ref(t) for t in tensors)
        self.entries = [(refs, versions, key, plan)] + self.entries[:self.size - 1]
        return plan


_plans = _Plans()


def _layer_chunk(module) -> int:
    """The chunk size of a chunked-attention layer (Llama 4's ``"chunked_attention"`` layers of
    ``attention_chunk_size`` tokens), else 0: read from ``module.config.layer_types[module.layer_idx]``, which is
    how transformers picks the layer's mask."""
    config = getattr(module, "config", None)
    layer = getattr(module, "layer_idx", None)
    types = getattr(config, "layer_types", None)
    if layer is None or not types or not 0 <= layer < len(types) or types[layer] != "chunked_attention":
        return 0
    chunk = getattr(config, "attention_chunk_size", None)
    if not chunk:
        raise ValueError(f"layer {layer} is a chunked_attention layer but the config sets no attention_chunk_size")
    return int(chunk)


def _options(module, dropout, sliding_window, softcap, is_causal):
    """gstar keywords (causal, window, softcap, chunk) from what the model passes; errors for what gstar does
    not compute."""
    if dropout and module.training:
        raise ValueError(f"gstar attention does not implement attention dropout (the model asks for p={dropout} "
                         f"while training): set the config's attention_dropout to 0.0, or use "
                         f"attn_implementation='eager'")
    causal = bool(getattr(module, "is_causal", True) if is_causal is None else is_causal)
    opts = {"causal": causal, "window": (-1, -1), "softcap": float(softcap or 0.0), "chunk": _layer_chunk(module)}
    if sliding_window:
        # HF's sliding_window=W lets a query see itself and W - 1 keys before it (and after, when bidirectional)
        left = int(sliding_window) - 1
        opts["window"] = (left, 0 if causal else left)
    return opts


def _rows_first(x):
    """(B, H, N, D) -> (B, N, H, D) view; free when x is the usual transposed projection output."""
    return x.transpose(1, 2)


def _padded(q, k, v, mask, spans=None, **opts):
    """Padded batch: q (B, Hq, Nq, D), k (B, Hkv, Nk, D), v (B, Hkv, Nk, Dv), mask (B, Nk), span ids None or
    (B, Nk) -> (B, Nq, Hq, Dv)."""
    B, _, Nq, _ = q.shape
    if mask.shape[1] < k.shape[2]:
        # a static cache allocates keys past the mask: those slots hold nothing yet
        k, v = k[:, :, :mask.shape[1]], v[:, :, :mask.shape[1]]
    elif mask.shape[1] > k.shape[2]:
        raise ValueError(f"the 2-D attention mask covers {mask.shape[1]} keys but the layer has {k.shape[2]}")
    Nk = k.shape[2]
    cu_k, max_k, idx_k = _plans.get((mask,), "k", lambda: cu_seqlens_from_mask(mask))
    if Nq == Nk:
        cu_q, max_q, idx_q = cu_k, max_k, idx_k
    else:
        def query_plan():
            # queries are the last Nq tokens; with left padding they are each sequence's last Nq_s keys,
            # which is exactly gstar's bottom-right alignment
            if not bool(mask[:, -1].all()):
                raise ValueError("gstar attention supports padding with fewer queries than keys (cached "
                                 "decoding) only for left padding: use padding_side='left' to generate")
            return cu_seqlens_from_mask(mask[:, -Nq:])
        cu_q, max_q, idx_q = _plans.get((mask,), ("q", Nq), query_plan)
    # offsets built from the mask are valid by construction: no per-layer check (a device sync)
    if spans is not None:
        spans = unpad(spans[:, :Nk, None], idx_k)[:, 0]                             # (total_k,)
    out = flash_attention_varlen(unpad(_rows_first(q), idx_q), unpad(_rows_first(k), idx_k),
                                 unpad(_rows_first(v), idx_k), cu_q, cu_k, max_q, max_k, check_cu_seqlens=False,
                                 spans=spans, **opts)  # (total_q, Hq, Dv)
    return pad(out, idx_q, B, Nq)


def _cached(q, k, v, cache_seqlens, **opts):
    """Static cache: q (B, Hq, Nq, D) against the cache's buffers k (B, Hkv, Nmax, D), v (B, Hkv, Nmax, Dv), of
    which sequence b's first cache_seqlens[b] slots are written, its queries the last Nq of those ->
    (B, Nq, Hq, Dv). The lengths come from the cache's own offset (see :func:`gstar_mask`): no check on the
    host, which would read them."""
    out = flash_attention_with_kvcache(q, k, v, cache_seqlens=cache_seqlens, check_values=False, **opts)
    return _rows_first(out)


def _packing_plan(position_ids, batch: int):
    """``(cu_seqlens, max_seqlen)`` when position ids restart inside a row (packed documents), else None."""
    pos = position_ids.reshape(-1, position_ids.shape[-1]).expand(batch, -1)   # (B, N)
    if pos.shape[1] < 2 or not bool((pos[:, 1:] != pos[:, :-1] + 1).any()):
        return None
    try:
        return cu_seqlens_from_position_ids(pos.flatten())
    except ValueError as err:
        raise ValueError(f"gstar attention reads position ids that restart inside a row as packed documents; "
                         f"these do not describe packed documents: {err}") from err


def _packed(q, k, v, cu_q, cu_k, max_q, max_k, **opts):
    """Flattened batch: q (B, Hq, Nq, D), k (B, Hkv, Nk, D), v (B, Hkv, Nk, Dv), documents by cu_seqlens ->
    (B, Nq, Hq, Dv). The offsets are the plan's, checked (or built) once per batch: no per-layer check."""
    B, Hq, Nq, _ = q.shape
    flat = [_rows_first(x).reshape(-1, x.shape[1], x.shape[3]) for x in (q, k, v)]  # (B * N, H, D or Dv)
    out = flash_attention_varlen(*flat, cu_q, cu_k, max_q, max_k, check_cu_seqlens=False, **opts)
    return out.view(B, Nq, Hq, v.shape[3])


class _Spans(NamedTuple):
    """The mask function's answer for a layer whose mask holds bidirectional token blocks (Gemma 3's image tokens,
    a prefix): gstar's span ids over the layer's keys and the padding mask (None without padding)."""
    ids: torch.Tensor              # (B, Nk): a block's id + 1, 0 outside blocks
    padding: torch.Tensor | None   # (B, Nk) bool, True at real tokens


class _Documents(NamedTuple):
    """The mask function's answer for a batch of packed documents (found by transformers in the position ids):
    the flattened batch's boundaries, as :func:`gstar.flash_attention_varlen` takes them. It reaches the
    attention function also where the model does not forward ``position_ids`` to it (Llama 4)."""
    cu_seqlens: torch.Tensor
    max_seqlen: int


def _max_length(given, cu):
    if given is not None:
        return int(given)
    return int((cu[1:] - cu[:-1]).max()) if cu.numel() > 1 else 0


def _flattened_plan(cu_seq_lens_q, cu_seq_lens_k, max_length_q, max_length_k, device, total_q, total_k, check,
                    padded=False):
    """``(cu_q, cu_k, max_q, max_k)`` of a flattened batch's given boundaries, as int32 on ``device``;
    with ``check`` their values are checked (the one device sync) and must cover ``total_q`` / ``total_k``
    rows, or, ``padded`` (a continuous batch padded to a CUDA graph's static shape), at most as many: the
    rows past the last offsets belong to no sequence and come out unset, as flash-attn leaves them."""
    cu_q, cu_k = (cu.to(device=device, dtype=torch.int32) for cu in (cu_seq_lens_q, cu_seq_lens_k))
    max_q, max_k = _max_length(max_length_q, cu_q), _max_length(max_length_k, cu_k)
    if check:
        if padded:
            ends = torch.stack((cu_q[-1], cu_k[-1])).tolist()
            for name, end, total in (("cu_seq_lens_q", ends[0], total_q), ("cu_seq_lens_k", ends[1], total_k)):
                if end > total:
                    raise ValueError(f"{name} ends at {end}, past the {total} rows the layer gets")
            total_q, total_k = ends
        check_cu_seqlens_values(cu_q, cu_k, total_q, total_k, max_q, max_k)
    return cu_q, cu_k, max_q, max_k


def _writes_cache(cache) -> bool:
    """Whether continuous batching's paged cache leaves writing it to the attention function (transformers
    releases whose ``PagedAttentionCache.update`` takes ``read_index`` / ``write_index``; later ones update it in
    the attention layer, before the function is called)."""
    return "read_index" in inspect.signature(cache.update).parameters


def _written(module, key, value, cache, kwargs):
    """Write a step's new keys and values into a paged cache that leaves it to the attention function
    (:func:`_writes_cache`) and return each request's keys and values as the cache gathers them, ``(1, Hkv,
    total_k, D)`` / ``(..., Dv)``: the rows ``cu_seq_lens_k`` describes."""
    key, value = cache.update(key_states=key, value_states=value, layer_idx=module.layer_idx,
                              read_index=kwargs["read_index"], write_index=kwargs["write_index"])
    return key.transpose(0, 1).unsqueeze(0), value.transpose(0, 1).unsqueeze(0)      # (1, Hkv, total_k, D)


def _layer_entry(value, module):
    """This layer's entry of a per-layer-type dict (continuous batching's ``cu_seq_lens_k`` / ``max_length_k`` of
    a model mixing sliding and full layers), picked by ``config.layer_types[layer_idx]`` as transformers' paged
    cache picks it; anything else as it is."""
    if not isinstance(value, dict):
        return value
    config, layer = getattr(module, "config", None), getattr(module, "layer_idx", None)
    types = getattr(config, "layer_types", None)
    kind = types[layer] if types and layer is not None and 0 <= layer < len(types) else "full_attention"
    if kind not in value:
        if len(value) != 1:
            raise ValueError(f"gstar attention got continuous batching lengths for the layer types {sorted(value)}, "
                             f"none of them this layer's ({kind!r})")
        kind = next(iter(value))
    return value[kind]


def _paged_decode(query, key, value, k_cache, v_cache, block_table, cu_seq_lens_k, **opts):
    """Continuous batching's decode step on a block table (transformers hands it to flash-attn kernels that append
    and attend): one new token per sequence, query ``(1, Hq, B, D)``, its key and value ``(1, Hkv, B, D)``, the
    layer's paged cache ``(num_pages, page_size, Hkv, D)`` and ``block_table`` ``(B, max_pages)``; each sequence's
    keys, new one included, number ``cu_seq_lens_k[b + 1] - cu_seq_lens_k[b]``. The token is written into the
    cache and attended to by :func:`gstar.flash_attention_with_kvcache` -> ``(1, B, Hq, Dv)``."""
    if query.shape[0] != 1 or query.shape[2] != key.shape[2]:
        raise ValueError(f"gstar attention takes a block-table (paged decode) batch as one packed row of one new "
                         f"token per sequence, got queries {tuple(query.shape)} and keys {tuple(key.shape)}")
    if k_cache.dim() != 4 or k_cache.shape[2] != key.shape[1] or k_cache.shape[3] != key.shape[3]:
        raise ValueError(f"gstar attention takes a paged cache laid out (num_pages, page_size, kv_heads, head_dim) "
                         f"= (-, -, {key.shape[1]}, {key.shape[3]}), got {tuple(k_cache.shape)}")
    if k_cache.shape[1] % 16:
        raise ValueError(f"gstar's paged cache takes pages of a multiple of 16 tokens, got page_size="
                         f"{k_cache.shape[1]}: set ContinuousBatchingConfig(page_size=...) to a multiple of 16")
    batch = query.shape[2]
    cu = cu_seq_lens_k.to(device=query.device, dtype=torch.int32)
    cache_seqlens = (cu[1:batch + 1] - cu[:batch] - 1).contiguous()  # keys held before this token
    q, k, v = (x.transpose(0, 2) for x in (query, key, value))       # (B, H, 1, D) views
    out = flash_attention_with_kvcache(q, k_cache, v_cache, k=k, v=v, cache_seqlens=cache_seqlens,
                                       block_table=block_table.to(torch.int32), **opts)   # (B, Hq, 1, Dv)
    return out.transpose(0, 2).transpose(1, 2)                       # (1, B, Hq, Dv)


def gstar_attention_forward(module, query, key, value, attention_mask, scaling=None, dropout=0.0,
                            sliding_window=None, softcap=None, is_causal=None, s_aux=None, position_ids=None,
                            cu_seq_lens_q=None, cu_seq_lens_k=None, max_length_q=None, max_length_k=None,
                            deterministic=None, block_table=None, k_cache=None, v_cache=None, **kwargs):
    """transformers attention function backed by gstar (registered as ``"gstar"``).

    Args:
        module: the attention module (reads ``training``, ``is_causal``, default True, and, for the chunk size,
            ``config.layer_types[layer_idx]`` and ``config.attention_chunk_size``).
        query: ``(B, Hq, Nq, D)``; key: ``(B, Hkv, Nk, D)``; value: ``(B, Hkv, Nk, Dv)`` (e.g. latent attention's
            128-wide values under 192-wide queries) with ``Hq % Hkv == 0``.
        attention_mask: from the ``"gstar"`` mask function: ``None``, the ``(B, Nk)`` padding mask, packed
            documents' boundaries (found in the position ids), or the ``(B,)`` int32 filled lengths of a static
            cache's buffer (keys past them are unwritten slots), which a non-causal layer ignores: its keys (an
            encoder's, cross-attention's) are all real.
        scaling: multiplies ``q . k`` (default ``D ** -0.5``).
        dropout: must be 0 while the module trains (gstar has no attention dropout).
        sliding_window: ``W`` keys per query including itself, i.e. gstar ``window=(W - 1, 0)``.
        softcap: logit soft-capping (Gemma 2's ``attn_logit_softcapping``; None or 0: none), gstar's ``softcap``:
            the scores ``scaling * q . k`` become ``softcap * tanh(s / softcap)`` before the mask and the softmax,
            on every path, with gradients.
        is_causal: overrides ``module.is_causal``.
        s_aux: ``(Hq,)`` learned sink logits (GPT-OSS), gstar ``sinks``; gradients flow to them.
        position_ids: ``(B, N)`` or ``(1, N)``; ids restarting at 0 inside a row mark packed documents.
        cu_seq_lens_q, cu_seq_lens_k, max_length_q, max_length_k: document boundaries of a flattened batch
            (from e.g. ``DataCollatorWithFlattening``, or continuous batching's packed requests, whose
            ``cu_seq_lens_k`` / ``max_length_k`` may be dicts by layer type: this layer's entry is taken); take
            precedence over position ids.
        block_table, k_cache, v_cache: continuous batching's decode step on a block table: the layer's paged
            cache ``(num_pages, page_size, Hkv, D)`` into which the new tokens' keys and values are appended,
            attended by :func:`gstar.flash_attention_with_kvcache`.
        deterministic: :func:`gstar.flash_attention`'s flag for a plain batch (None: True, gstar's default;
            packed, padded and cached batches have only the deterministic backward).
        kwargs: whatever else the model forwards: continuous batching's ``cache`` (with ``read_index`` and
            ``write_index``), written here where the transformers release leaves that to the attention function,
            and ``max_seqlen_q`` / ``max_seqlen_k``, that release's names of ``max_length_q`` / ``max_length_k``;
            the rest is ignored.

    Returns ``(attn_output, None)``, ``attn_output`` ``(B, Nq, Hq, Dv)``, as the flash integrations do (no
    attention probabilities exist to return).
    """
    opts = _options(module, dropout, sliding_window, softcap, is_causal)
    causal = opts["causal"]
    cache = kwargs.get("cache")  # continuous batching's PagedAttentionCache
    if cache is not None and block_table is None and _writes_cache(cache):
        key, value = _written(module, key, value, cache, kwargs)
    # releases that leave the cache to the attention function name the longest lengths max_seqlen_q / _k
    max_length_q = kwargs.get("max_seqlen_q") if max_length_q is None else max_length_q
    max_length_k = kwargs.get("max_seqlen_k") if max_length_k is None else max_length_k
    cu_seq_lens_k, max_length_k = _layer_entry(cu_seq_lens_k, module), _layer_entry(max_length_k, module)
    # continuous batching (transformers' PagedAttentionCache): its requests packed in one row
    paged = kwargs.get("write_index") is not None or block_table is not None
    if block_table is not None or k_cache is not None or v_cache is not None:
        if block_table is None or k_cache is None or v_cache is None or cu_seq_lens_k is None:
            raise ValueError("gstar attention needs block_table, k_cache, v_cache and cu_seq_lens_k together for a "
                             "paged decode step")
        if attention_mask is not None or context_parallel.active() is not None:
            raise ValueError("gstar attention takes a paged decode step without an attention mask and outside "
                             "gstar.distributed.context_parallel")
        return _paged_decode(query, value=value, key=key, k_cache=k_cache, v_cache=v_cache, block_table=block_table,
                             cu_seq_lens_k=cu_seq_lens_k, sinks=s_aux, scale=scaling, **opts), None
    documents = spans = None
    if isinstance(attention_mask, _Documents):
        documents, attention_mask = attention_mask, None
    elif isinstance(attention_mask, _Spans):
        spans, attention_mask = attention_mask
    if attention_mask is not None and attention_mask.dim() not in (1, 2):
        raise ValueError(f"gstar attention takes no {attention_mask.dim()}-D custom attention mask (only the "
                         f"2-D padding mask): it expresses causal, sliding-window, chunked, padding and packing "
                         f"masks itself; use attn_implementation='eager' for arbitrary masks")
    setting = context_parallel.active()
    if setting is not None:  # inside gstar.distributed.context_parallel: this rank holds a shard of the sequence
        for feature, asked in (("chunked attention", opts["chunk"]),
                               ("bidirectional token blocks (token_type_ids)", spans is not None)):
            if asked:
                raise ValueError(f"gstar context parallel attention does not take {feature}: run this model "
                                 f"outside gstar.distributed.context_parallel")
        return setting.attention(query, key, value, causal=causal, window=opts["window"], sinks=s_aux,
                                 scale=scaling, attention_mask=attention_mask, softcap=opts["softcap"],
                                 packed=cu_seq_lens_q is not None or documents is not None), None
    opts.update(sinks=s_aux, scale=scaling)

    filled = None
    if attention_mask is not None and attention_mask.dim() == 1:
        # a static cache's filled lengths; a non-causal layer's keys (an encoder's, cross-attention's) are all real
        filled, attention_mask = (attention_mask if causal else None), None
    if filled is not None:
        out = _cached(query, key, value, filled, **opts)
    elif attention_mask is not None:
        out = _padded(query, key, value, attention_mask, spans=spans, **opts)
    elif spans is not None and (cu_seq_lens_q is not None or documents is not None):
        raise ValueError("gstar attention cannot combine bidirectional token blocks (token_type_ids) with packed "
                         "documents: pass the documents as a padded batch")
    elif cu_seq_lens_q is not None or cu_seq_lens_k is not None:
        if cu_seq_lens_q is None or cu_seq_lens_k is None:
            raise ValueError("gstar attention needs both cu_seq_lens_q and cu_seq_lens_k for a flattened batch")
        given = (cu_seq_lens_q, cu_seq_lens_k, max_length_q, max_length_k, query.device,
                 query.shape[0] * query.shape[2], key.shape[0] * key.shape[2])
        if torch.compiler.is_compiling() or _capturing(query.device):
            # a graph can neither read the values nor cache on identity
            plan = _flattened_plan(*given, check=False)
        else:  # checked once per batch, then reused by every layer
            lengths = (max_length_q, max_length_k)
            tensors = (cu_seq_lens_q, cu_seq_lens_k) + tuple(m for m in lengths if isinstance(m, torch.Tensor))
            plan_key = ("cu", *(None if isinstance(m, torch.Tensor) else m for m in lengths), *given[4:], paged)
            plan = _plans.get(tensors, plan_key, lambda: _flattened_plan(*given, check=True, padded=paged))
        out = _packed(query, key, value, *plan, **opts)
    elif documents is not None:
        if query.shape[2] != key.shape[2]:
            raise ValueError("gstar attention cannot combine packed documents (position ids restarting at 0) "
                             "with a KV cache")
        cu, longest = documents
        out = _packed(query, key, value, cu, cu, longest, longest, **opts)
    else:
        plan = None
        # finding documents in position ids reads them; a compiled graph cannot, so under torch.compile
        # packed documents must come as cu_seq_lens_q / cu_seq_lens_k (as DataCollatorWithFlattening gives)
        if (position_ids is not None and position_ids.dim() <= 2 and position_ids.shape[-1] == query.shape[2]
                and not torch.compiler.is_compiling()):
            plan = _plans.get((position_ids,), ("pos", query.shape[0]),
                              lambda: _packing_plan(position_ids, query.shape[0]))
        if plan is None:
            flag = True if deterministic is None else deterministic
            out = _rows_first(flash_attention(query, key, value, deterministic=flag, spans=spans, **opts))
        elif query.shape[2] != key.shape[2]:
            raise ValueError("gstar attention cannot combine packed documents (position ids restarting at 0) "
                             "with a KV cache")
        elif spans is not None:
            raise ValueError("gstar attention cannot combine bidirectional token blocks (token_type_ids) with "
                             "packed documents (position ids restarting at 0): pass the documents as a padded batch")
        else:
            cu, longest = plan
            out = _packed(query, key, value, cu, cu, longest, longest, **opts)
    return out, None


def _filled_lengths(batch_size, q_length, kv_length, q_offset, kv_offset, cache_position, device):
    """``(B,)`` int32: the keys written in a layer's ``kv_length`` slots once this step's are added, or None
    when all are. The slots hold positions ``kv_offset ..``, the queries end at ``q_offset + q_length``; a
    static cache gives ``q_offset`` as a device tensor (older releases give ``cache_position``), which is
    used as it is, never read."""
    if q_length is None:  # releases before transformers 5 pass the queries' positions instead
        q_length, end = cache_position.shape[0], cache_position[-1] + 1
    else:
        end = q_offset + q_length
    if q_length == kv_length:  # the layer holds exactly the queries' keys
        return None
    filled = end - kv_offset
    if isinstance(filled, torch.Tensor):
        return filled.to(torch.int32).reshape(1).expand(batch_size).contiguous()
    if filled >= kv_length:
        return None
    return torch.full((batch_size,), filled, dtype=torch.int32, device=device)


# transformers' mask-function building blocks (transformers.masking_utils), by qualified name: combinators, whose
# closures hold the functions they combine, and the patterns the attention function applies itself
_AND, _OR = "and_masks.<locals>.and_mask", "or_masks.<locals>.or_mask"
_REMAP = "remap_positions_for_packed_sequence.<locals>.inner_mask"  # packed documents, from position ids
_OFFSETS = "add_offsets_to_mask_function.<locals>.inner_mask"
_CHUNKED = "chunked_overlay.<locals>.inner_mask"
_BLOCKWISE = "blockwise_overlay.<locals>.inner_mask"  # bidirectional blocks: image tokens, a prefix-LM's prefix
_SLIDING = "sliding_window_overlay.<locals>.inner_mask"
_EXPRESSED = ("causal_mask_function", "bidirectional_mask_function",
              "sliding_window_bidirectional_overlay.<locals>.inner_mask", "padding_mask_function.<locals>.inner_mask",
              "packed_sequence_mask_function.<locals>.inner_mask")


def _closure(fn) -> dict:
    """The variables a nested function closes over, by name."""
    return dict(zip(fn.__code__.co_freevars, (cell.cell_contents for cell in fn.__closure__ or ())))


def _bidirectional_model(config) -> bool:
    """Whether the model runs every attention layer non-causal (Gemma's ``use_bidirectional_attention``): its
    mask overlays then open the bidirectional (windowed) pattern that its non-causal layers compute anyway."""
    return bool(getattr(config, "use_bidirectional_attention", False))


def _read_mask_function(mask_function, config) -> dict:
    """Walk the mask function transformers built for a layer type; raise a ``ValueError`` for any part the
    attention function does not compute itself. Returns what the walk found of the layer's own rules:
    ``"chunk"``, a chunked layer's ``(chunk_size, left_padding)`` (each row's count of leading padding, from
    which transformers counts chunks), and ``"positions"``, the ``(B, N)`` position ids in which transformers
    found packed documents.

    The layer's own pattern (causal or bidirectional, its sliding window, its chunks), the padding and packed
    documents are what gstar computes from the attention function's arguments. Blockwise overlays (Gemma 3's and
    PaliGemma's bidirectional image / prefix blocks from ``token_type_ids``) are gstar's spans: ``"blocks"``, the
    ``(B, N)`` block ids (-1 outside a block) of a mask holding one. Any other overlay joined by *or* opens keys
    to some queries (a model's ``or_mask_function``) and one joined by *and* hides some (an
    ``and_mask_function``): gstar expresses neither, except the overlays of a bidirectional model (see
    :func:`_bidirectional_model`)."""
    found = {}

    def walk(fn, opening):  # opening: fn is (part of) an overlay joined by "or" to the layer's pattern
        name = getattr(fn, "__qualname__", "") if getattr(fn, "__module__", "") == _MASKS else ""
        if name == _AND:
            for part in _closure(fn)["mask_functions"]:
                walk(part, opening)
        elif name == _OR:
            first, *rest = _closure(fn)["mask_functions"]
            walk(first, opening)
            for part in rest:
                walk(part, True)
        elif name == _REMAP:
            values = _closure(fn)
            found["positions"] = values["position_ids"]
            walk(values["mask_function"], opening)
        elif name == _OFFSETS:
            walk(_closure(fn)["mask_function"], opening)
        elif name == _BLOCKWISE:
            blocks = _closure(fn)["block_sequence_ids"]  # (B, N): a block's id, or -1
            if bool((blocks >= 0).any()):  # blocks of image / prefix tokens: gstar's spans
                found["blocks"] = blocks
        elif opening and _bidirectional_model(config):
            pass
        elif not opening and name == _SLIDING:
            # the layer's own window (an and_mask_function may repeat it): the attention function's sliding_window
            window, own = _closure(fn)["sliding_window"], getattr(config, "sliding_window", None)
            if isinstance(own, int) and window != own:
                raise ValueError(f"gstar attention cannot express a sliding-window overlay of {window} keys over "
                                 f"layers whose window is the config's sliding_window={own}: use "
                                 f"attn_implementation='eager'")
        elif not opening and name in _EXPRESSED:
            pass
        elif not opening and name == _CHUNKED:
            values = _closure(fn)
            found["chunk"] = (int(values["chunk_size"]), values["left_padding"])
        else:
            label = getattr(fn, "__qualname__", repr(fn))
            how = "or_mask_function: opens keys" if opening else "and_mask_function: hides keys"
            raise ValueError(f"gstar attention cannot express the mask overlay {label} the model adds to its "
                             f"causal mask ({how} that gstar's causal / sliding-window / chunk rules do not): use "
                             f"attn_implementation='eager'")

    walk(mask_function, False)
    return found


def _chunk_start_mask(mask, chunk, left, q_first, kv_offset, width, device):
    """A chunked layer whose keys start at cache slot ``kv_offset > 0`` (a sliding cache layer holding the last
    ``chunk_size - 1`` keys): gstar counts chunks from each row's first key, transformers from the row's first
    real token (slot ``left``). The keys before the first query's chunk are seen by no query of the step;
    marking them as padding makes every row's first key a chunk start, so that the unpadded rows' chunks are
    the model's. Returns the ``(B, width)`` mask of the keys to keep (``mask`` and'ed in when given)."""
    device = left.device if device is None else device
    left = left.to(device=device, dtype=torch.long)
    start = left + torch.div(q_first - left, chunk, rounding_mode="floor") * chunk - kv_offset   # (B,)
    if bool((start < 0).any()):
        raise ValueError(f"gstar attention cannot place the chunk boundaries of a chunked attention layer whose "
                         f"cache dropped keys of the queries' chunk (its keys start at position {kv_offset}, "
                         f"chunks of {chunk}): use a cache that keeps the last attention_chunk_size - 1 keys "
                         f"(transformers' DynamicCache / StaticCache), or attn_implementation='eager'")
    keep = torch.arange(width, device=device) >= start[:, None]
    return keep if mask is None else mask & keep


def gstar_mask(batch_size=None, q_length=None, kv_length=None, q_offset=0, kv_offset=0, mask_function=None,
               attention_mask=None, cache_position=None, device=None, config=None, use_vmap=False, **kwargs):
    """transformers mask function for ``"gstar"``: no 4-D mask; what the attention function needs to tell real
    keys from padding and from unwritten cache slots.

    Returns ``None`` when every key the layer gets is real (the attention function applies causality, windows,
    chunks and packing itself); the ``(B, kv_length)`` boolean padding mask over the layer's keys when it holds
    padding; else, when the queries end before the layer's last slot (a static cache's buffer, not yet
    filled), the ``(B,)`` int32 filled lengths, built on the device from the cache's offset. Cross-attention
    (encoder keys) looks the same here; its non-causal attention ignores them. ``generate`` builds a static
    cache's masks before the model's forward pass and hands them back to it: lengths given as
    ``attention_mask`` are returned as they are.

    A chunked layer (Llama 4) whose cache keeps only its last keys (``kv_offset > 0``) gets a boolean mask
    that also hides the keys before the first query's chunk, so that its rows, unpadded, start at a chunk
    boundary (see :func:`_chunk_start_mask`). ``mask_function`` is read (:func:`_read_mask_function`): an overlay
    the model adds that gstar does not compute (bidirectional image tokens from ``token_type_ids``, another
    ``or_mask_function`` / ``and_mask_function``) raises a ``ValueError``. Under ``torch.compile`` the mask
    function's closures cannot be read: there an overlay (``use_vmap``, which transformers sets exactly when
    the model passes an ``or_mask_function`` / ``and_mask_function``, or an *or* at the mask function's top,
    as block ids make it) raises unless the model is bidirectional, and so does a chunked model's cache layer
    whose keys start past position 0. Every argument is a keyword with a default because releases differ in
    what they pass (older ones send ``cache_position`` instead of ``q_length`` and ``q_offset``).
    """
    if attention_mask is not None and attention_mask.dim() == 1:
        return attention_mask
    found = {}
    if torch.compiler.is_compiling():
        # a traced function's __name__ can be read (not its closure, nor its __qualname__): an "or" at the top is
        # an overlay too
        overlay = use_vmap or getattr(mask_function, "__name__", None) == _OR.rpartition(".")[2]
        if overlay and not _bidirectional_model(config):
            raise ValueError("under torch.compile gstar attention cannot read the mask overlay the model passes "
                             "(or_mask_function / and_mask_function, e.g. bidirectional image tokens): run the "
                             "model uncompiled, which checks it, or use attn_implementation='eager'")
        if kv_offset and "chunked_attention" in (getattr(config, "layer_types", None) or ()):
            raise ValueError("under torch.compile gstar attention cannot place the chunks of a chunked attention "
                             "layer whose cache keeps only its last keys: let generate build the masks (it does "
                             "for a static cache) or run the forward pass uncompiled")
    elif mask_function is not None and _MASKS is not None:
        found = _read_mask_function(mask_function, config)
    positions = found.get("positions")
    blocks = found.get("blocks")
    if blocks is not None:  # bidirectional token blocks: gstar's spans over the layer's keys
        if positions is not None or kv_offset or (q_length is not None and q_length != kv_length):
            raise ValueError("gstar attention takes bidirectional token blocks (token_type_ids: image tokens, a "
                             "prefix) in a pass over the whole sequence (training, or generate's prefill into the "
                             "dynamic cache), not with packed documents or into a static cache's buffer: use "
                             "cache_implementation='dynamic' or attn_implementation='eager'")
        mask = None if attention_mask is None else attention_mask[:, -kv_length:].bool()
        ids = blocks[:, :kv_length].to(device=blocks.device if device is None else device) + 1   # (B, Nk)
        return _Spans(ids, None if mask is None or bool(mask.all()) else mask)
    if positions is not None and attention_mask is None and q_length == kv_length:
        # documents transformers found in the position ids (it looks only without cache and padding)
        plan = _plans.get((positions,), ("pos", batch_size), lambda: _packing_plan(positions, batch_size))
        if plan is not None:
            return _Documents(*plan)
    chunked = found.get("chunk")
    mask = None
    if attention_mask is not None:
        mask = attention_mask[:, -kv_length:]  # a sliding-window cache keeps only the last kv_length keys
    if chunked is not None and kv_offset:
        q_first = cache_position[0] if q_length is None else q_offset
        width = kv_length if mask is None else mask.shape[1]
        mask = _chunk_start_mask(mask, *chunked, q_first, kv_offset, width, device)
    if mask is not None and not bool(mask.all()):
        return mask
    return _filled_lengths(batch_size, q_length, kv_length, q_offset, kv_offset, cache_position, device)


def gstar_nondeterministic_attention_forward(*args, deterministic=None, **kwargs):
    """The ``"gstar_nondeterministic"`` implementation: :func:`gstar_attention_forward` with
    ``deterministic=False`` unless the call passes the flag itself."""
    return gstar_attention_forward(*args, deterministic=False if deterministic is None else deterministic, **kwargs)


def _set_implementation(model, name: str, names) -> None:
    """Write attention implementation ``name`` into the configs of ``model`` and its sub-models whose
    implementation is one of ``names``, as they are: ``set_attn_implementation`` would send a name holding
    "flash" to transformers' flash-attn loader, which knows no registered functions."""
    for module in model.modules():
        config = getattr(module, "config", None)
        if getattr(config, "_attn_implementation", None) in names:
            config._attn_implementation_internal = name


def _continuous_batching_switch(switch):
    """Wrap ``ContinuousBatchingManager.switch_to_cb_friendly_attn``, which accepts ``"sdpa"``, ``"paged|eager"``
    and names holding "flash" (batches without masks, packed requests described by ``cu_seq_lens``) and would
    replace or reject ``"gstar"``: a model on ``"gstar"`` or ``"gstar_nondeterministic"`` runs the batch on
    :data:`PAGED`, the same attention function under a name continuous batching treats as flash attention's
    (no masks built, the cache sized for grouped kv heads); stopping the manager restores the model's own."""
    def switch_to_cb_friendly_attn(self, model, *args, **kwargs):
        own = model.config._attn_implementation
        if own not in (NAME, NONDETERMINISTIC):
            return switch(self, model, *args, **kwargs)
        _set_implementation(model, PAGED, (NAME, NONDETERMINISTIC))
        self._original_attn_impl = own
        return None

    switch_to_cb_friendly_attn.__doc__ = switch.__doc__
    switch_to_cb_friendly_attn.gstar_wrapped = switch
    return switch_to_cb_friendly_attn


def _register_continuous_batching():
    try:
        from transformers.generation.continuous_batching.continuous_api import (
            ContinuousBatchingManager,
        )
    except ImportError:  # releases without continuous batching, or with an older manager
        return
    switch = getattr(ContinuousBatchingManager, "switch_to_cb_friendly_attn", None)
    if switch is not None and not hasattr(switch, "gstar_wrapped"):
        ContinuousBatchingManager.switch_to_cb_friendly_attn = _continuous_batching_switch(switch)


def register():
    """Register ``"gstar"``, ``"gstar_nondeterministic"`` and the continuous-batching name :data:`PAGED` with
    transformers' attention and mask interfaces, and let continuous batching run models on ``"gstar"``
    (idempotent)."""
    for name, attention in ((NAME, gstar_attention_forward),
                            (NONDETERMINISTIC, gstar_nondeterministic_attention_forward),
                            (PAGED, gstar_attention_forward)):
        AttentionInterface.register(name, attention)
        AttentionMaskInterface.register(name, gstar_mask)
    _register_continuous_batching()


register()
