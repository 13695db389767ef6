"""Generate far past a fixed memory budget: a tiny random decoder with StreamingLLM attention (4 sink tokens
and a window of the last 64 tokens, learned sinks) on a :class:`gstar.streaming.StreamingCache`.

The cache's pages, block table and lengths are allocated once; each step returns the pages that have left the
window to the free list and reuses them, so memory and the time per token stay flat however long it runs.
Every ``--every`` tokens it prints the position reached, tokens per second and the pages in use (and on CUDA
the memory allocated); at the end the peak memory.

    python examples/streaming_generate.py                                   # CPU: 1,000 tokens in ~10 s
    python examples/streaming_generate.py --tokens 1000000 --graph          # CUDA: a million tokens

On CUDA the model runs in bfloat16 through the Triton decode kernel; ``--graph`` replays each decode step
from a CUDA graph (the cache's host work stays outside it: :meth:`StreamingCache.step` updates the block
table and lengths in place). Elsewhere it runs in float32 through the PyTorch path.
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

from gstar.streaming import StreamingCache

VOCAB = 256


def rotate(x, cos, sin):
    """Rotary embedding of ``x`` (B, H, N, hd) by angles ``cos``, ``sin`` (N, hd / 2)."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


class Layer(torch.nn.Module):
    """Pre-norm attention (GQA, rotary, learned sinks) and a GELU MLP."""

    def __init__(self, dim: int, heads: int, kv_heads: int, head_dim: int):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, head_dim
        self.attn_norm = torch.nn.RMSNorm(dim)
        self.qkv = torch.nn.Linear(dim, (heads + 2 * kv_heads) * head_dim, bias=False)
        self.out = torch.nn.Linear(heads * head_dim, dim, bias=False)
        self.sinks = torch.nn.Parameter(torch.randn(heads))  # one learned sink logit per query head
        self.mlp_norm = torch.nn.RMSNorm(dim)
        self.up = torch.nn.Linear(dim, 4 * dim, bias=False)
        self.down = torch.nn.Linear(4 * dim, dim, bias=False)

    def forward(self, x, cache: StreamingCache, index: int, cos, sin):
        B, N, _ = x.shape
        qkv = self.qkv(self.attn_norm(x)).view(B, N, -1, self.head_dim).transpose(1, 2)  # (B, Hq + 2 Hkv, N, hd)
        q, k, v = qkv.split([self.heads, self.kv_heads, self.kv_heads], dim=1)
        attn = cache.attend(index, rotate(q, cos, sin), rotate(k, cos, sin), v, sinks=self.sinks)  # (B, Hq, N, hd)
        x = x + self.out(attn.transpose(1, 2).reshape(B, N, -1))
        return x + self.down(F.gelu(self.up(self.mlp_norm(x))))


class Decoder(torch.nn.Module):
    def __init__(self, layers: int, dim: int, heads: int, kv_heads: int, head_dim: int, device):
        super().__init__()
        self.embed = torch.nn.Embedding(VOCAB, dim)
        self.layers = torch.nn.ModuleList(Layer(dim, heads, kv_heads, head_dim) for _ in range(layers))
        self.norm = torch.nn.RMSNorm(dim)
        # float64 angles: a float32 position times a frequency is off by ~0.1 rad past a million tokens
        self.inv_freq = 10000.0 ** -(torch.arange(0, head_dim, 2, dtype=torch.float64, device=device) / head_dim)

    def forward(self, tokens, cache: StreamingCache, position):
        """Logits ``(B, N, VOCAB)`` of ``tokens`` (B, N) at absolute positions ``position`` (1,) onwards, after
        ``cache.step(N)``."""
        x = self.embed(tokens)                                                   # (B, N, dim)
        positions = position + torch.arange(tokens.shape[1], device=tokens.device)  # (N,)
        angles = positions.double()[:, None] * self.inv_freq                     # (N, hd / 2)
        cos, sin = angles.cos().to(x.dtype), angles.sin().to(x.dtype)
        for index, layer in enumerate(self.layers):
            x = layer(x, cache, index, cos, sin)
        return self.norm(x) @ self.embed.weight.T


def memory(device) -> str:
    return f"  memory {torch.cuda.memory_allocated(device) / 2**20:,.1f} MiB" if device.type == "cuda" else ""


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=int, default=1000, help="tokens to generate per sequence")
    p.add_argument("--every", type=int, default=None, help="tokens between reports (default: a tenth)")
    p.add_argument("--batch", type=int, default=1, help="sequences generated together")
    p.add_argument("--prompt", type=int, default=16, help="random prompt tokens, prefilled in one step")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--window", type=int, default=64, help="W: a query sees itself and the W - 1 tokens before")
    p.add_argument("--sink-tokens", type=int, default=4, help="S: the first tokens every query sees")
    p.add_argument("--block-size", type=int, default=16, help="keys per page")
    p.add_argument("--graph", action="store_true", help="replay each decode step from a CUDA graph (CUDA only)")
    args = p.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if args.graph and device.type != "cuda":
        p.error("--graph needs a CUDA device")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    every = args.every or max(1, args.tokens // 10)
    torch.manual_seed(0)

    heads, kv_heads, head_dim = 4, 2, 16
    model = Decoder(args.layers, 64, heads, kv_heads, head_dim, device).to(device=device, dtype=dtype).eval()
    cache = StreamingCache(layers=args.layers, batch=args.batch, kv_heads=kv_heads, head_dim=head_dim,
                           sink_tokens=args.sink_tokens, window=args.window, block_size=args.block_size,
                           max_new=args.prompt, dtype=dtype, device=device)
    pool_mib = (cache.k.nbytes + cache.v.nbytes) / 2**20
    print(f"{args.layers} layers, batch {args.batch}, {args.sink_tokens} sink tokens + window {args.window}: "
          f"{cache.pages} pages of {args.block_size} keys ({cache.width} per sequence), {pool_mib:.3f} MiB of "
          f"keys and values, on {device} in {dtype}")

    position = torch.zeros(1, dtype=torch.long, device=device)  # absolute position of the step's first token
    token = torch.zeros(args.batch, 1, dtype=torch.long, device=device)  # (B, 1) the last token generated

    def forward(tokens):  # the next token of each sequence, into `token`
        token.copy_(model(tokens, cache, position)[:, -1:].argmax(-1))

    def decode():
        forward(token)

    side = torch.cuda.Stream(device) if args.graph else None
    with torch.inference_mode():
        position.fill_(cache.step(args.prompt))
        forward(torch.randint(VOCAB, (args.batch, args.prompt), device=device))
        run = decode
        last, clock = 0, time.perf_counter()
        for i in range(1, args.tokens + 1):
            position.fill_(cache.step(1))
            if side is not None and i <= 2:  # eager warm-up on the capture stream: kernels compiled, allocator warm
                side.wait_stream(torch.cuda.current_stream(device))
                with torch.cuda.stream(side):
                    decode()
                torch.cuda.current_stream(device).wait_stream(side)
                continue
            if side is not None and i == 3:
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, stream=side):
                    decode()
                run = graph.replay
            run()
            if i % every == 0 or i == args.tokens:
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                now = time.perf_counter()
                rate = (i - last) * args.batch / (now - clock)
                print(f"tokens {i:>10,}  position {cache.length:>10,}  {rate:>9,.0f} tokens/s  "
                      f"pages {cache.pages_in_use}/{cache.pages}{memory(device)}")
                last, clock = i, now
    if device.type == "cuda":
        print(f"peak memory {torch.cuda.max_memory_allocated(device) / 2**20:,.1f} MiB")
    else:
        print(f"peak memory: the pool's {cache.pages} pages, {pool_mib:.3f} MiB of keys and values")
    print("last tokens:", token.flatten().tolist())


if __name__ == "__main__":
    main()
