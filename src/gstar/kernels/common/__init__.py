"""What every kernel shares, whatever its language or card: the rule and the per-sequence bounds (``rule``), the
blocks a tile walks (``walk``), the online softmax and its state (``softmax``), FP8's descales and widenings
(``fp8``), split-KV decoding's program map and merge (``split``), the backward's fixed-order partial sums
(``partials``), padded head dims (``sizes``) and tensor descriptors (``descriptors``)."""
