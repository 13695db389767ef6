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

Any decoder whose attention is causal + GQA + optional sliding window + optional learned sinks runs exactly:
GPT-OSS (``s_aux`` becomes ``sinks``, with its gradient), Llama, Qwen2/3, Mistral. The attention function
takes the model's ``(B, heads, N, head_dim)`` projections and returns ``(B, N, Hq, head_dim)``, as
transformers expects; the model's ``sliding_window=W`` (W keys, the query's own included) is gstar's
``window=(W - 1, 0)``.

Like the flash-attention integrations, no 4-D mask is built. The mask function hands the attention function
``None`` (every key it gets is a real one), the 2-D padding mask, or, for a layer whose keys include slots
not yet written (a static cache's preallocated buffer), each sequence's filled length; the attention
function picks one of four paths:

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
  row): :func:`gstar.flash_attention_varlen` on the flattened batch, each document attending only to itself.

Under ``torch.compile`` the plain, static-cache and ``cu_seq_lens`` paths trace without a host read; a padding
mask, whose lengths must be read to unpad, breaks the graph there, and position ids are not searched for
documents (pass ``cu_seq_lens_q/k`` instead).

What the model asks for and gstar cannot do (attention dropout while training, logit soft-capping, custom
4-D masks) raises a ``ValueError`` naming the feature instead of being silently ignored.
"""

from __future__ import annotations

import weakref

import torch

try:
    from transformers import AttentionInterface
except ImportError:  # older releases export it from modeling_utils only
    from transformers.modeling_utils import AttentionInterface
try:
    from transformers import AttentionMaskInterface
except ImportError:
    from transformers.masking_utils import AttentionMaskInterface

from ..api import check_cu_seqlens_values, flash_attention, flash_attention_varlen
from ..distributed import context as context_parallel
from ..kvcache import flash_attention_with_kvcache
from ..varlen import cu_seqlens_from_mask, cu_seqlens_from_position_ids, pad, unpad

NAME = "gstar"
NONDETERMINISTIC = "gstar_nondeterministic"


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


def _options(module, dropout, sliding_window, softcap, is_causal):
    """(causal, window) from what the model passes; errors for what gstar does not compute."""
    if dropout and module.training:
        raise ValueError(f"gstar attention does not implement attention dropout (the model asks for p={dropout} "
                         f"while training): set the config's attention_dropout to 0.0, or use "
                         f"attn_implementation='eager'")
    if softcap is not None:
        raise ValueError("gstar attention does not implement attention logit soft-capping (softcap, e.g. "
                         "Gemma 2's attn_logit_softcapping): use attn_implementation='eager'")
    causal = bool(getattr(module, "is_causal", True) if is_causal is None else is_causal)
    if not sliding_window:
        return causal, (-1, -1)
    # HF's sliding_window=W lets a query see itself and W - 1 keys before it (and after, when bidirectional)
    left = int(sliding_window) - 1
    return causal, (left, 0 if causal else left)


def _rows_first(x):
    """(B, H, N, D) -> (B, N, H, D) view; free when x is the usual transposed projection output."""
    return x.transpose(1, 2)


def _padded(q, k, v, mask, **opts):
    """Padded batch: q (B, Hq, Nq, D), k (B, Hkv, Nk, D), v (B, Hkv, Nk, Dv), mask (B, Nk) -> (B, Nq, Hq, Dv)."""
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
    out = flash_attention_varlen(unpad(_rows_first(q), idx_q), unpad(_rows_first(k), idx_k),
                                 unpad(_rows_first(v), idx_k), cu_q, cu_k, max_q, max_k, check_cu_seqlens=False,
                                 **opts)  # (total_q, Hq, Dv)
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


def _max_length(given, cu):
    if given is not None:
        return int(given)
    return int((cu[1:] - cu[:-1]).max()) if cu.numel() > 1 else 0


def _flattened_plan(cu_seq_lens_q, cu_seq_lens_k, max_length_q, max_length_k, device, total_q, total_k, check):
    """``(cu_q, cu_k, max_q, max_k)`` of a flattened batch's given boundaries, as int32 on ``device``;
    with ``check`` their values are checked (the one device sync) and must cover ``total_q`` / ``total_k``
    rows."""
    cu_q, cu_k = (cu.to(device=device, dtype=torch.int32) for cu in (cu_seq_lens_q, cu_seq_lens_k))
    max_q, max_k = _max_length(max_length_q, cu_q), _max_length(max_length_k, cu_k)
    if check:
        check_cu_seqlens_values(cu_q, cu_k, total_q, total_k, max_q, max_k)
    return cu_q, cu_k, max_q, max_k


def gstar_attention_forward(module, query, key, value, attention_mask, scaling=None, dropout=0.0,
                            sliding_window=None, softcap=None, is_causal=None, s_aux=None, position_ids=None,
                            cu_seq_lens_q=None, cu_seq_lens_k=None, max_length_q=None, max_length_k=None,
                            deterministic=None, **kwargs):
    """transformers attention function backed by gstar (registered as ``"gstar"``).

    Args:
        module: the attention module (reads ``training`` and ``is_causal``, default True).
        query: ``(B, Hq, Nq, D)``; key: ``(B, Hkv, Nk, D)``; value: ``(B, Hkv, Nk, Dv)`` (e.g. latent attention's
            128-wide values under 192-wide queries) with ``Hq % Hkv == 0``.
        attention_mask: from the ``"gstar"`` mask function: ``None``, the ``(B, Nk)`` padding mask, or the
            ``(B,)`` int32 filled lengths of a static cache's buffer (keys past them are unwritten slots), which
            a non-causal layer ignores: its keys (an encoder's, cross-attention's) are all real.
        scaling: multiplies ``q . k`` (default ``D ** -0.5``).
        dropout: must be 0 while the module trains (gstar has no attention dropout).
        sliding_window: ``W`` keys per query including itself, i.e. gstar ``window=(W - 1, 0)``.
        softcap: unsupported (raises when set).
        is_causal: overrides ``module.is_causal``.
        s_aux: ``(Hq,)`` learned sink logits (GPT-OSS), gstar ``sinks``; gradients flow to them.
        position_ids: ``(B, N)`` or ``(1, N)``; ids restarting at 0 inside a row mark packed documents.
        cu_seq_lens_q, cu_seq_lens_k, max_length_q, max_length_k: document boundaries of a flattened batch
            (from e.g. ``DataCollatorWithFlattening``); take precedence over position ids.
        deterministic: :func:`gstar.flash_attention`'s flag for a plain batch (None: True, gstar's default;
            packed, padded and cached batches have only the deterministic backward).
        kwargs: whatever else the model forwards (ignored).

    Returns ``(attn_output, None)``, ``attn_output`` ``(B, Nq, Hq, Dv)``, as the flash integrations do (no
    attention probabilities exist to return).
    """
    causal, window = _options(module, dropout, sliding_window, softcap, is_causal)
    if attention_mask is not None and attention_mask.dim() not in (1, 2):
        raise ValueError(f"gstar attention takes no {attention_mask.dim()}-D custom attention mask (only the "
                         f"2-D padding mask): it expresses causal, sliding-window, padding and packing masks "
                         f"itself; use attn_implementation='eager' for arbitrary masks")
    setting = context_parallel.active()
    if setting is not None:  # inside gstar.distributed.context_parallel: this rank holds a shard of the sequence
        return setting.attention(query, key, value, causal=causal, window=window, sinks=s_aux, scale=scaling,
                                 attention_mask=attention_mask, packed=cu_seq_lens_q is not None), None
    opts = dict(causal=causal, window=window, sinks=s_aux, scale=scaling)

    filled = None
    if attention_mask is not None and attention_mask.dim() == 1:
        # a static cache's filled lengths; a non-causal layer's keys (an encoder's, cross-attention's) are all real
        filled, attention_mask = (attention_mask if causal else None), None
    if filled is not None:
        out = _cached(query, key, value, filled, **opts)
    elif attention_mask is not None:
        out = _padded(query, key, value, attention_mask, **opts)
    elif cu_seq_lens_q is not None or cu_seq_lens_k is not None:
        if cu_seq_lens_q is None or cu_seq_lens_k is None:
            raise ValueError("gstar attention needs both cu_seq_lens_q and cu_seq_lens_k for a flattened batch")
        given = (cu_seq_lens_q, cu_seq_lens_k, max_length_q, max_length_k, query.device,
                 query.shape[0] * query.shape[2], key.shape[0] * key.shape[2])
        if torch.compiler.is_compiling():  # a graph can neither read the values nor cache on identity
            plan = _flattened_plan(*given, check=False)
        else:  # checked once per batch, then reused by every layer
            lengths = (max_length_q, max_length_k)
            tensors = (cu_seq_lens_q, cu_seq_lens_k) + tuple(m for m in lengths if isinstance(m, torch.Tensor))
            plan_key = ("cu", *(None if isinstance(m, torch.Tensor) else m for m in lengths), *given[4:])
            plan = _plans.get(tensors, plan_key, lambda: _flattened_plan(*given, check=True))
        out = _packed(query, key, value, *plan, **opts)
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
            out = _rows_first(flash_attention(query, key, value, deterministic=flag, **opts))
        elif query.shape[2] != key.shape[2]:
            raise ValueError("gstar attention cannot combine packed documents (position ids restarting at 0) "
                             "with a KV cache")
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


def gstar_mask(batch_size=None, q_length=None, kv_length=None, q_offset=0, kv_offset=0, mask_function=None,
               attention_mask=None, cache_position=None, device=None, **kwargs):
    """transformers mask function for ``"gstar"``: no 4-D mask; what the attention function needs to tell real
    keys from padding and from unwritten cache slots.

    Returns ``None`` when every key the layer gets is real (the attention function applies causality, windows
    and packing itself); the ``(B, kv_length)`` boolean padding mask over the layer's keys when it holds
    padding; else, when the queries end before the layer's last slot (a static cache's buffer, not yet
    filled), the ``(B,)`` int32 filled lengths, built on the device from the cache's offset. Cross-attention
    (encoder keys) looks the same here; its non-causal attention ignores them. ``generate`` builds a static
    cache's masks before the model's forward pass and hands them back to it: lengths given as
    ``attention_mask`` are returned as they are. Extra mask overlays a model may pass in ``mask_function``
    (e.g. bidirectional image tokens) are not expressible. Every argument is a keyword with a default because
    releases differ in what they pass (older ones send ``cache_position`` instead of ``q_length`` and
    ``q_offset``).
    """
    if attention_mask is not None and attention_mask.dim() == 1:
        return attention_mask
    if attention_mask is not None:
        mask = attention_mask[:, -kv_length:]  # a sliding-window cache keeps only the last kv_length keys
        if not bool(mask.all()):
            return mask
    return _filled_lengths(batch_size, q_length, kv_length, q_offset, kv_offset, cache_position, device)


def gstar_nondeterministic_attention_forward(*args, deterministic=None, **kwargs):
    """The ``"gstar_nondeterministic"`` implementation: :func:`gstar_attention_forward` with
    ``deterministic=False`` unless the call passes the flag itself."""
    return gstar_attention_forward(*args, deterministic=False if deterministic is None else deterministic, **kwargs)


def register():
    """Register ``"gstar"`` and ``"gstar_nondeterministic"`` with transformers' attention and mask interfaces
    (idempotent)."""
    for name, attention in ((NAME, gstar_attention_forward),
                            (NONDETERMINISTIC, gstar_nondeterministic_attention_forward)):
        AttentionInterface.register(name, attention)
        AttentionMaskInterface.register(name, gstar_mask)


register()
