"""gstar in a minute: dense causal GQA attention with a sliding window and learned sinks, its backward,
packed variable-length sequences, and both checked against the naive oracle.

    python examples/quickstart.py

On a CUDA machine it runs the Triton kernels in bfloat16; elsewhere the tiled PyTorch path in float32
(a few seconds on a laptop CPU). Each line prints the largest difference from ``gstar.naive_attention``
run in float64 on the same inputs, and for the dense call also the naive implementation's own difference
in the input dtype, which gstar's accuracy bar allows twice over (three times for gradients).
"""

import torch

import gstar

device = "cuda" if torch.cuda.is_available() else "cpu"
dtype = torch.bfloat16 if device == "cuda" else torch.float32
torch.manual_seed(0)


def max_error(x: torch.Tensor, ref: torch.Tensor) -> float:
    return (x.double() - ref).abs().max().item()


def leaves(*shape):
    return torch.randn(*shape, device=device, dtype=dtype, requires_grad=True)


# A dense batch is (batch, heads, seqlen, head_dim). 8 query heads share 2 kv heads (GQA): query head h
# reads kv head h // 4. Each query sees itself and the 127 keys before it (causal, window (127, 0): Hugging
# Face's sliding_window=128), and a learned sink logit per query head joins every row's softmax (GPT-OSS).
B, Hq, Hkv, N, D = 2, 8, 2, 256, 64
q, k, v = leaves(B, Hq, N, D), leaves(B, Hkv, N, D), leaves(B, Hkv, N, D)
sinks = torch.randn(Hq, device=device, requires_grad=True)
rule = dict(causal=True, window=(127, 0))

out = gstar.flash_attention(q, k, v, sinks=sinks, **rule)                    # (B, Hq, N, D), q's dtype
dout = torch.randn_like(out)
dq, dk, dv, dsinks = torch.autograd.grad(out, (q, k, v, sinks), dout)       # shaped like q, k, v, sinks



# The oracle builds the whole N x N score matrix. In float64 it is the reference; in the input dtype it
# shows PyTorch's own rounding error, the yardstick of gstar's accuracy bar (docs/design.md section 4).
def naive(precision):
    inputs = [t.detach().to(precision).requires_grad_() for t in (q, k, v, sinks)]
    result, _ = gstar.naive_attention(*inputs[:3], sinks=inputs[3], **rule)
    return (result, *torch.autograd.grad(result, inputs, dout.to(precision)))


names = ("out", "dq", "dk", "dv", "dsinks")
for name, x, ref, pt in zip(names, (out, dq, dk, dv, dsinks), naive(torch.float64), naive(dtype)):
    print(f"dense  {name:6} {str(tuple(x.shape)):17} max error {max_error(x, ref):.1e} "
          f"(naive attention in {dtype}: {max_error(pt, ref):.1e})")

# Packed sequences (flash-attn's varlen layout): three documents of 100, 30 and 126 tokens stacked in one
# (total, heads, head_dim) tensor, bounded by int32 cumulative lengths. Each document attends only to
# itself, with positions counted from its own start.
lengths = [100, 30, 126]
cu_seqlens = torch.tensor([0, 100, 130, 256], dtype=torch.int32, device=device)  # where each document starts
qp, kp, vp = leaves(sum(lengths), Hq, D), leaves(sum(lengths), Hkv, D), leaves(sum(lengths), Hkv, D)
out_p = gstar.flash_attention_varlen(qp, kp, vp, cu_seqlens, cu_seqlens, max(lengths), max(lengths),
                                     sinks=sinks, **rule)                   # (total, Hq, D)
out_p.sum().backward()                                                       # gradients in qp.grad, ...

bounds = cu_seqlens.tolist()
for s, (start, end) in enumerate(zip(bounds, bounds[1:])):
    # one document as a batch of one: (1, heads, length, head_dim)
    doc = [t[start:end].detach().double().transpose(0, 1)[None] for t in (qp, kp, vp)]
    ref_p, _ = gstar.naive_attention(*doc, sinks=sinks.detach().double(), **rule)
    error = max_error(out_p[start:end], ref_p[0].transpose(0, 1))
    print(f"packed document {s} ({end - start:3} tokens)  max error {error:.1e}")
