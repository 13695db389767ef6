"""gstar: FlashAttention in Python and Triton for causal, GQA, sliding-window and sink attention."""

from .api import flash_attention
from .reference import naive_attention, tiled_attention

__all__ = ["flash_attention", "naive_attention", "tiled_attention"]
__version__ = "0.1.0"
