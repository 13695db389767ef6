"""``with gstar.distributed.context_parallel(group): ...``: Hugging Face's ``"gstar"`` attention, context-parallel.

Inside the block every attention layer of a model loaded with ``attn_implementation="gstar"`` takes its
q, k, v as this rank's shard of each sequence and runs :func:`context_parallel_attention`. The model sees
only its shard: input ids and position ids (hence rotary positions) must be sharded alike with
:func:`gstar.distributed.shard_sequence`; labels must be shifted on the whole sequence before they are
sharded, since a shard's last token predicts the first token of another rank's shard.
"""

from __future__ import annotations

import contextlib
from typing import NamedTuple

from .attention import context_parallel_attention
from .layout import check_layout


class Setting(NamedTuple):
    group: object
    layout: str
    check_ranks: bool

    def attention(self, query, key, value, *, causal, window, sinks, scale, attention_mask, packed, softcap=0.0):
        """The attention of one layer: query ``(B, Hq, n, D)``, key, value ``(B, Hkv, n, D|Dv)`` -> ``(B, n,
        Hq, Dv)``, as transformers expects."""
        if attention_mask is not None:
            raise ValueError("gstar context parallel attention takes no padding mask: shard unpadded sequences "
                             "of one length (pass attention_mask=None)")
        if packed:
            raise ValueError("gstar context parallel attention does not take packed documents (cu_seq_lens): "
                             "shard one sequence per row")
        out = context_parallel_attention(query, key, value, group=self.group, layout=self.layout, causal=causal,
                                         window=window, sinks=sinks, scale=scale, softcap=softcap,
                                         check_ranks=self.check_ranks)
        return out.transpose(1, 2)


# the settings of the open blocks, innermost last: a plain list, which torch.compile reads without a graph
# break (it cannot trace a ContextVar); blocks are process-wide, as a process holds one rank
_ACTIVE: list[Setting] = []


@contextlib.contextmanager
def context_parallel(group=None, layout: str = "zigzag", check_ranks: bool = True):
    """Run ``attn_implementation="gstar"`` layers context-parallel over ``group`` (default: the default group)
    with the given layout, for the forward passes inside the block (their backward needs no context).
    ``check_ranks`` as in :func:`context_parallel_attention` (one small all-gather per layer when True)."""
    _ACTIVE.append(Setting(group, check_layout(layout), check_ranks))
    try:
        yield
    finally:
        _ACTIVE.pop()


def active() -> Setting | None:
    """The innermost :func:`context_parallel` setting, or None outside one."""
    return _ACTIVE[-1] if _ACTIVE else None
