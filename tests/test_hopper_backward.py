"""The fused Hopper backward (gstar.kernels.hopper_backward, dQ added up with atomics): taken only when a call
asks for ``deterministic=False`` and the kernel serves it; within the 3x gradient bar on every pattern it
accepts at odd lengths, GQA, strided inputs and an LSE gradient (GPU tier, Hopper only). Off the GPU the
flag changes nothing. tests/test_kernel_sass.py compiles the kernel for sm_90a on the CPU."""

import pytest
import torch

import gstar
from inputs import make_qkv
from gstar.kernels import attention_backward, hopper_backward
from gstar.pattern import Pattern
from test_backward import _check_bar, _check_exact_zeros, _oracle

HOPPER = torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9
hopper_only = pytest.mark.skipif(not HOPPER, reason="needs an sm_90 GPU (H100 / H200)")


@pytest.mark.parametrize("dtype,D,Dv,causal,window,sinks,expected", [
    (torch.bfloat16, 128, 128, True, (-1, -1), False, True),
    (torch.float16, 128, 128, False, (-1, -1), False, True),
    (torch.bfloat16, 128, 128, False, (-1, 0), False, True),   # causal spelled as a window
    (torch.bfloat16, 128, 128, True, (-1, -1), True, False),   # learned sinks: the deterministic kernels
    (torch.bfloat16, 128, 128, True, (127, 0), False, False),  # a window layer
    (torch.bfloat16, 64, 64, True, (-1, -1), False, 64 in hopper_backward.HEAD_DIMS),
    (torch.bfloat16, 128, 128, False, (-1, 3), False, False),  # a right bound past the diagonal
    (torch.bfloat16, 128, 64, True, (-1, -1), False, False),   # Dv != D
    (torch.bfloat16, 96, 96, True, (-1, -1), False, False),    # a head dim it was not built for
    (torch.float32, 128, 128, True, (-1, -1), False, False),
])
def test_serves(dtype, D, Dv, causal, window, sinks, expected):
    pattern = Pattern.make(300, 300, causal=causal, window=window)
    assert hopper_backward.serves(dtype, D, Dv, pattern, sinks) == expected


def test_flag_changes_nothing_off_hopper():
    """On the CPU both settings run the deterministic kernels: bitwise equal gradients; a non-bool raises."""
    q, k, v = (t.requires_grad_() for t in make_qkv(1, 4, 2, 37, 29, 16, torch.float32))
    grads = []
    for deterministic in (True, False):
        out = gstar.flash_attention(q, k, v, causal=True, deterministic=deterministic)
        grads.append(torch.autograd.grad(out, (q, k, v), torch.ones_like(out)))
    for a, b in zip(*grads):
        assert torch.equal(a, b)
    with pytest.raises(TypeError, match="deterministic must be a bool"):
        gstar.flash_attention(q, k, v, deterministic=0)


@pytest.mark.gpu
@hopper_only
@pytest.mark.parametrize("D", hopper_backward.HEAD_DIMS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("Nq,Nk", [(128, 128), (1000, 1000), (777, 300), (300, 777), (65, 4097)])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("group", [1, 4])
def test_gpu_within_bar(D, dtype, Nq, Nk, causal, group, monkeypatch):
    """Full and causal attention at odd lengths (Nq > Nk leaves causal rows without keys, Nq < Nk keys no
    row sees), MHA and GQA 4 (a program walks several query heads: both warpgroups' turns at dQ cross head
    boundaries), (B, N, H, D) strides, an LSE gradient: the 3x bar, exact zeros, and the fused kernel is the
    one that ran."""
    calls = []
    monkeypatch.setattr(hopper_backward, "backward", lambda *a: calls.append(1) or fused(*a))
    q, k, v = make_qkv(2, 8, 8 // group, Nq, Nk, D, dtype, device="cuda", layout="bnhd")
    dout = torch.randn(2, 8, Nq, D, device="cuda").to(dtype)
    dlse = torch.randn(2, 8, Nq, device="cuda")
    pattern_args, scale = dict(causal=causal), D ** -0.5
    ref_out, ref_lse, ref = _oracle(q, k, v, None, dout, dlse, pattern_args, scale, torch.float64)
    _, _, pt = _oracle(q, k, v, None, dout, dlse, pattern_args, scale, dtype)
    out = torch.empty_like(q).copy_(ref_out)
    pattern = Pattern.make(Nq, Nk, causal=causal)
    grads = attention_backward(dout, q, k, v, out, ref_lse.float(), dlse, None, pattern, scale,
                               deterministic=False)
    assert calls == [1]
    _check_bar(grads, ref, pt)
    _check_exact_zeros(grads, pattern)


@pytest.mark.gpu
@hopper_only
def test_gpu_through_the_api(monkeypatch):
    """``flash_attention(deterministic=False)`` reaches the fused kernel through autograd, and its gradients
    agree with the deterministic ones up to rounding."""
    calls = []
    monkeypatch.setattr(hopper_backward, "backward", lambda *a: calls.append(1) or fused(*a))
    q, k, v = (t.requires_grad_() for t in make_qkv(1, 8, 8, 1000, 1000, 128, torch.bfloat16, device="cuda"))
    dout = torch.randn_like(q)
    grads = []
    for deterministic in (True, False):
        out = gstar.flash_attention(q, k, v, causal=True, deterministic=deterministic)
        grads.append(torch.autograd.grad(out, (q, k, v), dout))
    assert calls == [1]
    for a, b in zip(*grads):
        assert (a.float() - b.float()).abs().max() <= 0.02 * a.float().abs().max()


fused = hopper_backward.backward
