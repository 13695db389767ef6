"""gstar.flash_attention's public surface: every bad input of docs/design.md section 2 raises the documented
error naming the argument, empty inputs return empty results, and the output follows q's layout."""

import math

import pytest
import torch

import gstar
from gstar.reference import naive_attention


def qkv(b=1, hq=4, hkv=2, nq=9, nk=11, d=8, dtype=torch.float32):
    return torch.randn(b, hq, nq, d, dtype=dtype), torch.randn(b, hkv, nk, d, dtype=dtype), \
        torch.randn(b, hkv, nk, d, dtype=dtype)


BAD = [
    # (description, how to break the call, exception type, text the message must contain)
    ("q rank", lambda q, k, v: dict(q=q[0]), ValueError, "q must have 4 dims"),
    ("k not a tensor", lambda q, k, v: dict(k=k.tolist()), TypeError, "k must be a torch.Tensor"),
    ("batch mismatch", lambda q, k, v: dict(k=torch.cat([k, k])), ValueError, "batch sizes differ"),
    ("k/v length mismatch", lambda q, k, v: dict(v=v[:, :, :5]), ValueError, "k and v must have the same"),
    ("Hq % Hkv", lambda q, k, v: dict(k=k[:, :1].expand(1, 3, 11, 8), v=v[:, :1].expand(1, 3, 11, 8)),
     ValueError, "multiple of kv heads"),
    ("head dim k", lambda q, k, v: dict(k=k[..., :4]), ValueError, "k head dim"),
    ("head dim v", lambda q, k, v: dict(v=v[..., :4]), ValueError, "v head dim"),
    ("dtype mismatch", lambda q, k, v: dict(k=k.half()), TypeError, "share a dtype"),
    ("integer dtype", lambda q, k, v: dict(q=q.int(), k=k.int(), v=v.int()), TypeError, "float16, bfloat16"),
    ("strided last dim", lambda q, k, v: dict(q=torch.randn(1, 4, 9, 16)[..., ::2]), ValueError, "unit stride"),
    ("window type", lambda q, k, v: dict(window=5), TypeError, "window must be a (left, right)"),
    ("window float", lambda q, k, v: dict(window=(1.5, 0)), TypeError, "window must be a (left, right)"),
    ("negative window", lambda q, k, v: dict(window=(-2, 0)), ValueError, "window bounds"),
    ("sink_tokens < 0", lambda q, k, v: dict(sink_tokens=-1), ValueError, "sink_tokens must be >= 0"),
    ("sink_tokens type", lambda q, k, v: dict(sink_tokens=2.0), TypeError, "sink_tokens must be an int"),
    ("sinks shape", lambda q, k, v: dict(sinks=torch.zeros(2)), ValueError, "sinks must have shape (4,)"),
    ("sinks rank", lambda q, k, v: dict(sinks=torch.zeros(1, 4)), ValueError, "sinks must have 1 dims"),
    ("sinks dtype", lambda q, k, v: dict(sinks=torch.zeros(4, dtype=torch.int64)), TypeError, "floating-point"),
    ("causal type", lambda q, k, v: dict(causal="yes"), TypeError, "causal must be a bool"),
    ("scale type", lambda q, k, v: dict(scale="0.1"), TypeError, "scale must be a finite float"),
    ("scale nan", lambda q, k, v: dict(scale=math.nan), TypeError, "scale must be a finite float"),
    ("backend", lambda q, k, v: dict(backend="cuda"), ValueError, "backend must be one of"),
]


@pytest.mark.parametrize("name,change,exc,text", BAD, ids=[b[0] for b in BAD])
def test_bad_input_raises_clear_error(name, change, exc, text):
    q, k, v = qkv()
    args = dict(q=q, k=k, v=v)
    args.update(change(q, k, v))
    with pytest.raises(exc, match=None) as info:
        gstar.flash_attention(**args)
    assert text in str(info.value), str(info.value)


def test_head_dim_limit_for_triton(device):
    q, k, v = (t.to(device) for t in qkv(d=264))
    with pytest.raises(ValueError, match="head dim must be between 1 and 256"):
        gstar.flash_attention(q, k, v, backend="triton")


def test_triton_on_cpu_tensors_needs_interpreter(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    q, k, v = qkv()
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET=1"):
        gstar.flash_attention(q, k, v, backend="triton")


@pytest.mark.parametrize("shape", [(0, 4, 9, 11), (1, 4, 0, 11), (1, 4, 9, 0)])
def test_empty_inputs_return_empty_results(shape):
    b, hq, nq, nk = shape
    q, k, v = torch.randn(b, hq, nq, 8), torch.randn(b, 2, nk, 8), torch.randn(b, 2, nk, 8)
    out, lse = gstar.flash_attention(q, k, v, return_lse=True)
    assert out.shape == q.shape and lse.shape == (b, hq, nq)
    assert torch.equal(out, torch.zeros_like(out)) and torch.isneginf(lse).all()
    sinks = torch.randn(hq, requires_grad=True)
    out, lse = gstar.flash_attention(q, k, v, sinks=sinks, return_lse=True)
    assert torch.equal(lse, sinks.detach().view(1, hq, 1).expand(b, hq, nq))


def test_output_follows_q_layout_and_no_input_copies():
    # q as a transposed (B, N, H, D) tensor: the output's .transpose(1, 2) is contiguous
    q = torch.randn(2, 13, 4, 16).transpose(1, 2)
    k = torch.randn(2, 17, 2, 16).transpose(1, 2)
    v = torch.randn(2, 17, 2, 16).transpose(1, 2)
    out = gstar.flash_attention(q, k, v, causal=True)
    assert out.transpose(1, 2).is_contiguous()
    ref, _ = naive_attention(q.double(), k.double(), v.double(), causal=True)
    torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-5)


def test_causal_forces_right_zero_and_hf_window_convention():
    q, k, v = qkv(nq=20, nk=20)
    a = gstar.flash_attention(q, k, v, causal=True, window=(3, 7))
    b = gstar.flash_attention(q, k, v, window=(3, 0))
    torch.testing.assert_close(a, b)


def test_sinks_any_float_dtype_get_gradients_in_their_dtype():
    q, k, v = qkv()
    sinks = torch.randn(4, dtype=torch.bfloat16, requires_grad=True)
    gstar.flash_attention(q, k, v, sinks=sinks).sum().backward()
    assert sinks.grad is not None and sinks.grad.dtype == torch.bfloat16
