"""Triton and Gluon kernels and their host side. Importing this package imports triton; ``gstar.ops`` and
``gstar.kvcache`` do so only when a call runs on the Triton backend.

- ``dispatch``: which kernel serves a call on this card (every measured table), and the three entry points below;
- ``common``: what every kernel shares (the rule, the block walk, the softmax, FP8's descales, split-KV's merge,
  the backward's partial sums);
- ``portable``: the Triton kernels of every GPU (forward, backward, decode) with their tiles and dK/dV schedule;
- ``sm90``: the Gluon kernels of H100 / H200 (forward, fused backward, FP8 decode) and their rings;
- ``device`` (the card's facts) and ``launch`` (the cached kernel launcher).
"""

from .dispatch import attention_backward, attention_forward, decode_forward

__all__ = ["attention_backward", "attention_forward", "decode_forward"]
