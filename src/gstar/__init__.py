"""gstar: exact, memory-efficient attention (FlashAttention) in Python and Triton, forward and backward, for
causal masks, GQA, sliding windows, sink tokens and learned sinks, on dense and packed batches.

- :func:`flash_attention`: ``(B, H, N, D)`` batches (Triton on CUDA tensors, tiled PyTorch on CPU ones);
- :func:`flash_attention_with_kvcache`: a few new queries against a contiguous or paged key/value cache
  (decoding; forward only);
- :func:`flash_attention_varlen`: packed ``(total, H, D)`` sequences with ``cu_seqlens`` (flash-attn's layout);
  :func:`cu_seqlens_from_mask`, :func:`cu_seqlens_from_position_ids`, :func:`unpad`, :func:`pad` and
  :func:`check_cu_seqlens_values` prepare them;
- :func:`tiled_attention`: the PyTorch path on any device; :func:`naive_attention`: the oracle;
- :func:`quantize_fp8`: FP8 inputs and their descales for the entry points' FP8 path (forward only);
- ``import gstar.integrations.transformers``: ``attn_implementation="gstar"`` for Hugging Face models;
- :mod:`gstar.distributed`: one sequence sharded over the ranks of a ``torch.distributed`` group.

The rule and the conventions are in docs/design.md; examples/quickstart.py runs each entry point.
"""

from . import distributed
from .api import (
           check_cu_seqlens_values,
           flash_attention,
           flash_attention_varlen,
           tiled_attention,
)
from .fp8 import quantize_fp8
from .kvcache import flash_attention_with_kvcache
from .reference import naive_attention
from .varlen import cu_seqlens_from_mask, cu_seqlens_from_position_ids, pad, unpad

__all__ = [
           "check_cu_seqlens_values",
           "cu_seqlens_from_mask",
           "cu_seqlens_from_position_ids",
           "distributed",
           "flash_attention",
           "flash_attention_varlen",
           "flash_attention_with_kvcache",
           "naive_attention",
           "pad",
           "quantize_fp8",
           "tiled_attention",
           "unpad",
]
__version__ = "0.1.0"
