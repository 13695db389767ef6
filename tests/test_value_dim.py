"""Value head dim different from the query/key head dim (``Dv != D``, docs/design.md section 1): every entry
point, forward and backward, against the oracle.

CPU tier: the tiled PyTorch path in float64 and the Triton kernels under the interpreter in float32 (IEEE
dots, relative error < 1e-4) and float16 (the bar of docs/design.md section 4), dense and packed, the split
dK/dV path, a seeded random grid with D and Dv drawn independently, the operators' fake implementations,
``torch.compile`` and a tiny random DeepSeek-V3 (latent attention: 12-wide queries over 6-wide values) in
transformers. GPU tier: bfloat16 and float16 at the shapes that matter (192 / 128 and 128 / 64 for training,
64 / 320 and 576 / 512 for latent decoding), descriptor loads and the split dK/dV path included.
"""

import dataclasses
import random

import pytest
import torch

import gstar
from gstar import ops
from gstar.lab.accuracy import relative_error, verdict
from gstar.kernels import attention_backward, card
from gstar.kernels.portable import tiles
from gstar.kernels.portable.tiles import backward_config
from gstar.pattern import Pattern, span_bounds
from gstar.reference import naive_attention
from tiers import grid

GRADS = ("dq", "dk", "dv", "dsinks")
# (D, Dv): narrower and wider values, padded and unpadded head dims on either side
PAIRS = {"d24-dv40": (24, 40), "d40-dv8": (40, 8), "d16-dv64": (16, 64), "d80-dv24": (80, 24)}
PATTERNS = {
    "full": dict(),
    "causal": dict(causal=True),
    "window-sink-tokens": dict(causal=True, window=(9, 0), sink_tokens=3),
    "two-sided": dict(window=(5, 7)),
}


def _inputs(B, Hq, Hkv, Nq, Nk, D, Dv, dtype, device, sinks=True, layout="bhnd"):
    """q (B, Hq, Nq, D), k (B, Hkv, Nk, D), v (B, Hkv, Nk, Dv) (as transposed (B, N, H, .) tensors with
    ``layout="bnhd"``), learned sinks (Hq,) float32 (float64 for float64 inputs) or None."""
    def rand(H, N, width):
        if layout == "bnhd":
            return torch.randn(B, N, H, width, device=device).to(dtype).transpose(1, 2)
        return torch.randn(B, H, N, width, device=device).to(dtype)
    s = torch.randn(Hq, device=device, dtype=torch.promote_types(dtype, torch.float32)) * 2 if sinks else None
    return rand(Hq, Nq, D), rand(Hkv, Nk, D), rand(Hkv, Nk, Dv), s


def _run(fn, q, k, v, sinks, dout, dlse):
    """``fn(q, k, v, sinks) -> (out, lse)`` and the gradients of ``sum(out * dout) + sum(lse * dlse)``
    with respect to q, k, v and the sinks (None without them)."""
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    sk = None if sinks is None else sinks.detach().requires_grad_()
    out, lse = fn(*leaves, sk)
    loss = (out.float() * dout.float()).sum() + (lse * dlse).sum()
    grads = torch.autograd.grad(loss, leaves + ([sk] if sk is not None else []))
    return out.detach(), lse.detach(), (*grads[:3], grads[3] if sk is not None else None)


def _oracle(q, k, v, sinks, dout, dlse, pattern_args, dtype):
    """naive_attention with every input cast to ``dtype``: (out, lse, grads)."""
    stat = torch.promote_types(dtype, torch.float32)
    return _run(lambda q_, k_, v_, s_: naive_attention(q_, k_, v_, sinks=s_, **pattern_args),
                q.to(dtype), k.to(dtype), v.to(dtype), None if sinks is None else sinks.to(stat),
                dout.to(dtype), dlse.to(stat))


def _gstar(q, k, v, sinks, dout, dlse, pattern_args, backend):
    return _run(lambda q_, k_, v_, s_: gstar.flash_attention(q_, k_, v_, sinks=s_, return_lse=True,
                                                             backend=backend, **pattern_args),
                q, k, v, sinks, dout, dlse)


def _upstream(q, v):
    """dout (B, Hq, Nq, Dv) in q's dtype and dlse (B, Hq, Nq) float32."""
    B, Hq, Nq, _ = q.shape
    return (torch.randn(B, Hq, Nq, v.shape[-1], device=q.device).to(q.dtype),
            torch.randn(B, Hq, Nq, device=q.device))


def _check_relative(result, ref, bound):
    out, lse, grads = result
    ref_out, ref_lse, ref_grads = ref
    assert out.shape == ref_out.shape
    for name, x, r in zip(("out", "lse") + GRADS, (out, lse, *grads), (ref_out, ref_lse, *ref_grads)):
        assert (x is None) == (r is None), name
        if x is not None:
            err = relative_error(x, r)
            assert err < bound, f"{name}: relative error {err:.3g}"


def _check_bar(result, ref, pt):
    """The bar of docs/design.md section 4: 2x PyTorch's own error on out and LSE, 3x on gradients."""
    for name, factor, x, r, p in zip(("out", "lse") + GRADS, (2, 2, 3, 3, 3, 3), (result[0], result[1], *result[2]),
                                     (ref[0], ref[1], *ref[2]), (pt[0], pt[1], *pt[2])):
        if x is not None:
            v = verdict(name, x, r, p, factor=factor)
            assert v.ok, str(v)


# ---------------------------------------------------------------------------------------------- CPU tier


@pytest.mark.parametrize("pattern", PATTERNS)
@pytest.mark.parametrize("pair", PAIRS)
def test_torch_path_matches_oracle(pair, pattern):
    D, Dv = PAIRS[pair]
    q, k, v, s = _inputs(2, 4, 2, 37, 45, D, Dv, torch.float64, "cpu")
    dout, dlse = _upstream(q, v)
    result = _gstar(q, k, v, s, dout, dlse, PATTERNS[pattern], "torch")
    _check_relative(result, _oracle(q, k, v, s, dout, dlse, PATTERNS[pattern], torch.float64), 1e-12)


def test_torch_path_gradcheck():
    q, k, v, s = (t.requires_grad_() for t in _inputs(1, 2, 1, 5, 7, 3, 5, torch.float64, "cpu"))
    assert torch.autograd.gradcheck(
        lambda *a: gstar.tiled_attention(*a[:3], sinks=a[3], causal=True, window=(2, 0), sink_tokens=1,
                                         return_lse=True), (q, k, v, s))


@pytest.mark.parametrize("pair,pattern", grid({p: (p,) for p in PAIRS}, {p: (p,) for p in PATTERNS}))
def test_triton_fp32_matches_oracle(pair, pattern, device):
    D, Dv = PAIRS[pair]
    q, k, v, s = _inputs(1, 4, 2, 33, 47, D, Dv, torch.float32, device)
    dout, dlse = _upstream(q, v)
    result = _gstar(q, k, v, s, dout, dlse, PATTERNS[pattern], "triton")
    _check_relative(result, _oracle(q, k, v, s, dout, dlse, PATTERNS[pattern], torch.float64), 1e-4)


def test_triton_fp16_within_bar(device):
    q, k, v, s = _inputs(1, 4, 1, 40, 53, 40, 24, torch.float16, device)
    dout, dlse = _upstream(q, v)
    args = dict(causal=True, window=(20, 0), sink_tokens=2)
    _check_bar(_gstar(q, k, v, s, dout, dlse, args, "triton"), _oracle(q, k, v, s, dout, dlse, args, torch.float64),
               _oracle(q, k, v, s, dout, dlse, args, torch.float16))


def _random_cases(n, seed):
    """``n`` cases with D and Dv drawn independently, odd lengths, GQA ratios and random patterns."""
    rng = random.Random(seed)
    dims = (8, 16, 24, 40, 64, 80)
    for _ in range(n):
        hkv = rng.choice((1, 2))
        left, right = rng.choice((-1, 0, 3, 17)), rng.choice((-1, 0, 2))
        yield dict(Hq=hkv * rng.choice((1, 2, 4)), Hkv=hkv, Nq=rng.randrange(1, 50), Nk=rng.randrange(1, 50),
                   D=rng.choice(dims), Dv=rng.choice(dims), sinks=rng.random() < 0.5,
                   pattern=dict(window=(left, right), sink_tokens=rng.choice((0, 0, 2))))


RANDOM = list(_random_cases(12, seed=26))


@pytest.mark.parametrize("case", [pytest.param(c, id=f"case{i}", marks=() if i < 4 else pytest.mark.slow)
                                  for i, c in enumerate(RANDOM)])
def test_random_grid_fp32(case, device):
    q, k, v, s = _inputs(1, case["Hq"], case["Hkv"], case["Nq"], case["Nk"], case["D"], case["Dv"],
                         torch.float32, device, sinks=case["sinks"])
    dout, dlse = _upstream(q, v)
    result = _gstar(q, k, v, s, dout, dlse, case["pattern"], "triton")
    _check_relative(result, _oracle(q, k, v, s, dout, dlse, case["pattern"], torch.float64), 1e-4)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_packed_equals_per_sequence(backend, device):
    """flash_attention_varlen with Dv != D: each sequence's rows equal flash_attention on it alone."""
    device = "cpu" if backend == "torch" else device
    lengths_q, lengths_k = [5, 0, 19, 1], [9, 2, 19, 0]
    q = torch.randn(sum(lengths_q), 4, 24, device=device)
    k = torch.randn(sum(lengths_k), 2, 24, device=device)
    v = torch.randn(sum(lengths_k), 2, 40, device=device)
    s = torch.randn(4, device=device)
    cu_q, cu_k = (torch.tensor([0] + torch.tensor(n).cumsum(0).tolist(), dtype=torch.int32, device=device)
                  for n in (lengths_q, lengths_k))
    args = dict(causal=True, window=(6, 0), sink_tokens=1, sinks=s, return_lse=True, backend=backend)
    out, lse = gstar.flash_attention_varlen(q, k, v, cu_q, cu_k, max(lengths_q), max(lengths_k), **args)
    assert out.shape == (sum(lengths_q), 4, 40) and out.is_contiguous()
    for i in range(len(lengths_q)):
        rows, keys = slice(cu_q[i], cu_q[i + 1]), slice(cu_k[i], cu_k[i + 1])
        one, one_lse = gstar.flash_attention(*(t[None].transpose(1, 2) for t in (q[rows], k[keys], v[keys])),
                                             **args)
        assert relative_error(out[rows], one[0].transpose(0, 1)) < 1e-5
        assert relative_error(lse[:, rows], one_lse[0]) < 1e-5


@pytest.mark.parametrize("flat", [False, True], ids=["ranged", "flat"])
def test_split_dkdv_fp32(flat, device):
    """The split dK/dV path (float32 partials of both widths summed in a fixed order) and the flat loops."""
    q, k, v, s = _inputs(1, 4, 1, 45, 45, 24, 40, torch.float32, device)
    dout, dlse = _upstream(q, v)
    args = dict(causal=True, window=(20, 0), sink_tokens=2)
    pattern = Pattern.make(45, 45, **args)
    cfg = dataclasses.replace(backward_config(24, torch.float32, pattern, device, value_dim=40), head_splits=2,
                              q_chunk=1, flat=flat)
    ref = _oracle(q, k, v, s, dout, dlse, args, torch.float64)
    out, lse = ref[0].float(), ref[1].float()
    grads = attention_backward(dout, q, k, v, out, lse, dlse, s, pattern, 24 ** -0.5, config=cfg)
    for name, g, r in zip(GRADS, grads, ref[2]):
        assert g.shape == r.shape and relative_error(g, r) < 1e-4, name


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_output_follows_q_layout(backend, device):
    """The output has Dv columns laid out as q is: a transposed (B, N, H, D) q gives a transposed output."""
    device = "cpu" if backend == "torch" else device
    q, k, v, _ = _inputs(2, 4, 2, 17, 17, 24, 40, torch.float32, device, sinks=False, layout="bnhd")
    out = gstar.flash_attention(q, k, v, causal=True, backend=backend)
    assert out.shape == (2, 4, 17, 40) and out.transpose(1, 2).is_contiguous()
    assert relative_error(out, naive_attention(q.double(), k.double(), v.double(), causal=True)[0]) < 1e-4


def _op_cases(device, backend):
    """(tensors, options) of the operators, dense and packed, with Dv != D."""
    q, k, v, s = _inputs(2, 4, 2, 29, 29, 24, 40, torch.float32, device, layout="bnhd")
    lengths = [5, 0, 19, 1]
    cu = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32, device=device)
    total = sum(lengths)
    spans = span_bounds(torch.randint(0, 3, (total,), device=device), cu)                     # (total, 2)
    packed = (torch.randn(total, 4, 24, device=device), torch.randn(total, 2, 24, device=device),
              torch.randn(total, 2, 40, device=device), s, cu, cu, spans)
    options = (0.3, 1.5, backend, True)  # scale, softcap, backend, deterministic; the pattern's fields before them
    return [((q, k, v, s, None, None, None), ([29, 29, 5, 0, 2, 7], *options)),
            (packed, ([max(lengths), max(lengths), 5, 0, 2, 7], *options))]


def test_fake_outputs_match_real(device):
    """The fake implementations promise the real outputs' shapes, dtypes and strides with Dv != D."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    for backend in (["torch", "triton"] if device == "cpu" else ["triton"]):
        for tensors, options in _op_cases(device, backend):
            real = ops.forward_op(*tensors, *options)
            grads = ops.backward_op(torch.randn_like(real[0]), *real, None, *tensors, *options)
            with FakeTensorMode(allow_non_fake_inputs=True) as mode:
                fake_in = [None if t is None else mode.from_tensor(t) for t in tensors]
                fake = ops.forward_op(*fake_in, *options)
                fake_grads = ops.backward_op(mode.from_tensor(real[0]), *(mode.from_tensor(t) for t in real),
                                             None, *fake_in, *options)
            assert real[0].shape[-1] == 40
            for r, f in zip((*real, *grads), (*fake, *fake_grads)):
                assert (r.shape, r.dtype, r.stride()) == (f.shape, f.dtype, f.stride())


@pytest.mark.slow
def test_opcheck(device):
    for tensors, options in _op_cases(device, "torch" if device == "cpu" else "triton"):
        tensors = [None if t is None else t.detach().requires_grad_(t.is_floating_point()) for t in tensors]
        torch.library.opcheck(ops.forward_op, (*tensors, *options))
        out, lse = ops.forward_op(*tensors, *options)
        torch.library.opcheck(ops.backward_op, (torch.randn_like(out), out.detach(), lse.detach(), None,
                                                *(None if t is None else t.detach() for t in tensors), *options))


def test_compile_fullgraph(device):
    """No graph break, and compiled gradients equal eager ones (aot_eager on CPU runs the same ops)."""
    def step(q, k, v, s, dout):
        out, lse = gstar.flash_attention(q, k, v, causal=True, window=(6, 0), sinks=s, return_lse=True)
        return (out * dout).sum() + lse.square().sum()

    torch._dynamo.reset()
    compiled = torch.compile(step, fullgraph=True, backend="inductor" if device == "cuda" else "aot_eager")
    q, k, v, s = (t.requires_grad_() for t in _inputs(1, 4, 2, 37, 37, 16, 48, torch.float32, device))
    dout = torch.randn(1, 4, 37, 48, device=device)
    got = torch.autograd.grad(compiled(q, k, v, s, dout), (q, k, v, s))
    want = torch.autograd.grad(step(q, k, v, s, dout), (q, k, v, s))
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)


def test_transformers_latent_attention_matches_eager(monkeypatch):
    """A tiny random DeepSeek-V3 (queries and keys 12 wide, values 6) through attn_implementation="gstar":
    logits, loss and every parameter gradient equal eager attention's, and the layers do hand gstar values
    narrower than the queries (no padding in between)."""
    transformers = pytest.importorskip("transformers")
    import gstar.integrations.transformers as integration
    config = dict(vocab_size=61, hidden_size=32, intermediate_size=16, moe_intermediate_size=8, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=4, n_routed_experts=4, num_experts_per_tok=2, n_group=1,
                  topk_group=1, first_k_dense_replace=1, q_lora_rank=16, kv_lora_rank=8, qk_rope_head_dim=4,
                  qk_nope_head_dim=8, v_head_dim=6, max_position_embeddings=64)
    seen = []
    real = integration.flash_attention

    def spy(q, k, v, **kwargs):
        seen.append((q.shape[-1], v.shape[-1]))
        return real(q, k, v, **kwargs)

    monkeypatch.setattr(integration, "flash_attention", spy)
    torch.manual_seed(0)
    auto = transformers.AutoModelForCausalLM
    eager = auto.from_config(transformers.DeepseekV3Config(**config), attn_implementation="eager").float()
    ours = auto.from_config(transformers.DeepseekV3Config(**config), attn_implementation="gstar").float()
    ours.load_state_dict(eager.state_dict())
    ids = torch.randint(0, 61, (2, 19))
    results = [model(ids, labels=ids) for model in (eager, ours)]
    for r in results:
        r.loss.backward()
    assert seen == [(12, 6)] * 2
    assert (results[0].logits - results[1].logits).abs().max() <= 1e-5
    grads = [{n: p.grad for n, p in m.named_parameters() if p.grad is not None} for m in (eager, ours)]
    assert grads[0].keys() == grads[1].keys() and grads[0]
    for name, g in grads[0].items():
        assert (grads[1][name] - g).abs().max() <= 1e-5, name


def test_config_fits_the_mean_padded_width(monkeypatch):
    """Tiles are chosen for the mean of the padded D and Dv: (64, 320) takes the short tiles of width 512,
    (576, 512) those of 1024, (128, 64) keeps D = 128's, and (192, 128) its own measured row."""
    monkeypatch.setattr(card, "capability_major", lambda device: 9)
    pattern = Pattern.make(4096, 4096, causal=True)
    for (D, Dv), same in (((64, 320), 512), ((576, 512), 1024), ((128, 64), 128)):
        assert (tiles.forward_config(D, torch.bfloat16, pattern, "cuda", value_dim=Dv)
                == tiles.forward_config(same, torch.bfloat16, pattern, "cuda"))
        assert (backward_config(D, torch.bfloat16, pattern, "cuda", value_dim=Dv)
                == backward_config(same, torch.bfloat16, pattern, "cuda"))
    fwd = tiles.forward_config(192, torch.bfloat16, pattern, "cuda", value_dim=128)
    assert (fwd["BLOCK_M"], fwd["BLOCK_N"], fwd["num_stages"], fwd["HALVES"]) == (128, 64, 3, False)
    bwd = backward_config(192, torch.bfloat16, pattern, "cuda", batch_heads=256, value_dim=128)
    assert (bwd.dkdv_m, bwd.dkdv_n, bwd.dq_m, bwd.dq_n, bwd.dq_tma) == (32, 128, 128, 64, True)


# ---------------------------------------------------------------------------------------------- GPU tier

# (name, dtype, B, Hq, Hkv, Nq, Nk, D, Dv, pattern)
GPU_CASES = [
    ("d192-dv128-causal", torch.bfloat16, 2, 8, 8, 1023, 1023, 192, 128, dict(causal=True)),
    ("d192-dv128-window", torch.bfloat16, 1, 8, 2, 777, 801, 192, 128, dict(causal=True, window=(127, 0),
                                                                            sink_tokens=4)),
    ("d128-dv64-gqa", torch.float16, 1, 16, 2, 1000, 1000, 128, 64, dict(causal=True)),
    ("d64-dv128-two-sided", torch.bfloat16, 1, 8, 8, 239, 256, 64, 128, dict(window=(31, 17))),
    ("d64-dv320-decode", torch.bfloat16, 2, 16, 1, 3, 1500, 64, 320, dict(causal=True)),
    ("d576-dv512-decode", torch.bfloat16, 1, 16, 1, 4, 1111, 576, 512, dict(causal=True)),
    ("d576-dv512-prefill", torch.bfloat16, 1, 4, 1, 113, 203, 576, 512, dict(causal=True, window=(50, 0))),
]


@pytest.mark.gpu
@pytest.mark.parametrize("sinks", [False, True], ids=["nosinks", "sinks"])
@pytest.mark.parametrize("case", GPU_CASES, ids=[c[0] for c in GPU_CASES])
def test_gpu_within_bar(case, sinks):
    _, dtype, B, Hq, Hkv, Nq, Nk, D, Dv, args = case
    q, k, v, s = _inputs(B, Hq, Hkv, Nq, Nk, D, Dv, dtype, "cuda", sinks=sinks)
    dout, dlse = _upstream(q, v)
    _check_bar(_gstar(q, k, v, s, dout, dlse, args, "triton"), _oracle(q, k, v, s, dout, dlse, args, torch.float32),
               _oracle(q, k, v, s, dout, dlse, args, dtype))


@pytest.mark.gpu
@pytest.mark.parametrize("changes", [dict(dq_tma=True, dkdv_tma=True), dict(head_splits=2, q_chunk=3),
                                     dict(head_splits=2, q_chunk=3, flat=True, dq_tma=True)],
                         ids=["descriptors", "split", "split-flat-descriptors"])
def test_gpu_backward_paths_within_bar(changes):
    """Descriptor loads of both widths and the split dK/dV path at (192, 128), forced below their thresholds."""
    B, Hq, Hkv, N, D, Dv = 1, 8, 2, 1000, 192, 128
    args = dict(causal=True, window=(300, 0), sink_tokens=4)
    q, k, v, s = _inputs(B, Hq, Hkv, N, N, D, Dv, torch.bfloat16, "cuda")
    dout, dlse = _upstream(q, v)
    pattern = Pattern.make(N, N, **args)
    cfg = dataclasses.replace(backward_config(D, torch.bfloat16, pattern, "cuda", value_dim=Dv), **changes)
    out, lse = gstar.flash_attention(q, k, v, sinks=s, return_lse=True, **args)
    grads = attention_backward(dout, q, k, v, out, lse, dlse, s, pattern, D ** -0.5, config=cfg)
    ref, pt = (_oracle(q, k, v, s, dout, dlse, args, dt) for dt in (torch.float32, torch.bfloat16))
    _check_bar((out, lse, grads), ref, pt)


@pytest.mark.gpu
def test_gpu_packed_within_bar():
    lengths = [300, 1, 0, 777, 64]
    cu = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32, device="cuda")
    total = sum(lengths)
    q, k = (torch.randn(total, h, 192, device="cuda", dtype=torch.bfloat16) for h in (8, 2))
    v = torch.randn(total, 2, 128, device="cuda", dtype=torch.bfloat16)
    out = gstar.flash_attention_varlen(q, k, v, cu, cu, max(lengths), max(lengths), causal=True)
    assert out.shape == (total, 8, 128)
    for i, n in enumerate(lengths):
        if n == 0:  # no rows to compare
            continue
        rows = slice(cu[i], cu[i + 1])
        one = [t[rows].transpose(0, 1)[None] for t in (q, k, v)]
        ref, pt = (naive_attention(*(t.to(dt) for t in one), causal=True)[0] for dt in (torch.float32, torch.bfloat16))
        v_ = verdict(f"sequence {i}", out[rows].transpose(0, 1)[None], ref, pt)
        assert v_.ok, str(v_)
