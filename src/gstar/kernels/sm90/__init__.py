"""The sm_90 (H100, H200) kernels, in Gluon: the warp-specialised forward and fused backward of
FlashAttention-3's schedule (``forward``, ``backward``), the register decode kernel for FP8 caches (``decode``),
and what they share (``ring``: shared-memory rings, their barriers, the copy engine's operations, wgmma operands).
:mod:`gstar.kernels.dispatch` says which calls take them; docs/hopper.md draws them."""
