"""Context parallel: one sequence sharded along N over the ranks of a ``torch.distributed`` group.

- :func:`context_parallel_attention`: gstar's attention on each rank's shard, forward and backward, equal
  to the whole sequence's at that rank's tokens (docs/context-parallel.md);
- :func:`shard_sequence` / :func:`gather_sequence`: cut a whole-sequence tensor into this rank's shard and
  put the shards back together (``layout="zigzag"`` or ``"contiguous"``, :mod:`.layout` draws them);
- :func:`context_parallel`: a context manager under which Hugging Face's ``attn_implementation="gstar"``
  runs context-parallel;
- :func:`traffic` / :func:`reset_traffic`: the bytes this process sent and received.
"""

from .attention import context_parallel_attention
from .context import context_parallel
from .exchange import reset_traffic, traffic
from .layout import LAYOUTS, gather_sequence, shard_sequence

__all__ = ["LAYOUTS", "context_parallel", "context_parallel_attention", "gather_sequence", "reset_traffic",
           "shard_sequence", "traffic"]
