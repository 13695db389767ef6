"""Triton kernels and their host side. Importing this package imports triton; ``gstar.ops`` does so only
when a call runs on the Triton backend.

Modules: ``attention`` (the two entry points below and their cached launch plans), ``forward`` and
``backward`` (the kernels), ``hopper`` and ``hopper_backward`` (sm_90's warp-specialised ones), ``decode``
(the KV-cache kernel) and ``hopper_decode`` (sm_90's for long FP8 caches, in Gluon), ``widen`` (an FP8
forward's V, widened before the launch), ``ranges`` (the rule and the tile ranges inside the kernels),
``schedule`` (the dK/dV work split), ``configs`` (tile sizes per head dim, dtype and card), ``launch`` (the
cached kernel launcher), ``descriptors`` (tensor descriptors for Hopper's copy engine), ``primers`` (a first
kernel).
"""

from .attention import attention_backward, attention_forward

__all__ = ["attention_forward", "attention_backward"]
