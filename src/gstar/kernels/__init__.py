"""Triton kernels and their host side. Importing this package imports triton; ``gstar.ops`` does so only
when a call runs on the Triton backend."""

from .backward import attention_backward
from .forward import attention_forward

__all__ = ["attention_forward", "attention_backward"]
