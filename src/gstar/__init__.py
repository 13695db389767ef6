"""gstar: FlashAttention in Python and Triton for causal, GQA, sliding-window and sink attention."""

from .api import check_cu_seqlens_values, flash_attention, flash_attention_varlen, tiled_attention
from .reference import naive_attention
from .varlen import cu_seqlens_from_mask, cu_seqlens_from_position_ids, pad, unpad

__all__ = ["flash_attention", "flash_attention_varlen", "check_cu_seqlens_values", "naive_attention",
           "tiled_attention", "cu_seqlens_from_mask", "cu_seqlens_from_position_ids", "pad", "unpad"]
__version__ = "0.1.0"
