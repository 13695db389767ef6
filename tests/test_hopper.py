"""The warp-specialised Hopper forward (gstar.kernels.hopper): it compiles for sm_90a on any machine (the
CPU tier: Gluon kernels have no interpreter), it meets the accuracy bar beside the portable kernel on every
pattern it accepts, at odd lengths (the GPU tier, Hopper only), and the dispatcher sends it the calls
:func:`gstar.kernels.hopper.supported` accepts and nothing else."""

import os
import subprocess
import sys

import pytest
import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import make_backend
from triton.experimental.gluon._runtime import GluonASTSource
from triton.runtime.jit import create_function_from_signature

from inputs import make_qkv
from gstar.accuracy import verdict
from gstar.kernels import attention_forward, hopper
from gstar.pattern import Pattern
from gstar.reference import naive_attention

HOPPER = torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9
hopper_only = pytest.mark.skipif(not HOPPER, reason="needs an sm_90 GPU (H100 / H200)")


def _compile_sm90(D: int, causal: bool, with_sinks: bool, packed: bool):
    """The kernel compiled for sm_90a as a launch would specialise it, on meta tensors (no GPU)."""
    B, H, N = 1, 2, 256
    q, k, v, o = (torch.empty(B, N, H, D, dtype=torch.bfloat16, device="meta").transpose(1, 2) for _ in range(4))
    lse = torch.empty(B, H, N, device="meta")
    sinks = torch.empty(H, device="meta") if with_sinks else None
    cu = torch.empty(3, dtype=torch.int32, device="meta") if packed else None
    args = (hopper._descriptor(q, 64), hopper._descriptor(k, 128), hopper._descriptor(v, 128),
            hopper._descriptor(o, 64), o if packed else None, lse, sinks, cu, cu, N, N, 1, 0, 0, 0, 0.125,
            (o.stride(1), o.stride(2)), (lse.stride(0), lse.stride(1)))
    kwargs = dict(HEAD_DIM=D, HAS_LEFT=False, HAS_RIGHT=causal, HAS_SINK_TOKENS=False, num_warps=4, maxnreg=168)
    target = GPUTarget("cuda", 90, 32)
    fn = hopper._forward_kernel
    backend = make_backend(target)
    bound, specialization, options = create_function_from_signature(fn.signature, fn.params, backend)(
        *args, **kwargs)
    options, signature, constexprs, attrs = fn._pack_args(backend, kwargs, bound, specialization, options)
    return triton.compile(GluonASTSource(fn, signature, constexprs, attrs), target=target,
                          options=options.__dict__)


@pytest.mark.parametrize("D,causal,with_sinks,packed", [(128, True, True, False), (64, False, False, True)])
def test_compiles_warp_specialised_for_sm90(D, causal, with_sinks, packed):
    """The PTX has the schedule the module describes: register hand-over between partitions, tensor-memory
    copies completing on mbarriers, asynchronous warpgroup MMAs. A fresh process compiles it: this one may
    run Triton's interpreter, which Gluon kernels cannot call into."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run([sys.executable, __file__, *(str(int(x)) for x in (D, causal, with_sinks, packed))], env=env,
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    for instruction in ("setmaxnreg.dec", "setmaxnreg.inc", "cp.async.bulk.tensor", "mbarrier.try_wait",
                        "wgmma.mma_async", "wgmma.wait_group"):
        assert instruction in run.stdout, instruction


def test_not_supported_off_the_gpu():
    q = torch.randn(1, 2, 256, 128, dtype=torch.bfloat16)
    assert not hopper.supported(q, q, q, Pattern.make(256, 256, causal=True))


def _oracle(q, k, v, sinks, pattern, dtype):
    return naive_attention(q.to(dtype), k.to(dtype), v.to(dtype), causal=pattern.right == 0,
                           sinks=None if sinks is None else sinks.to(dtype), scale=q.shape[-1] ** -0.5)


def _check(out, lse, q, k, v, sinks, pattern):
    """The 2x bar against PyTorch in q's dtype, on out and LSE, with a float32 oracle; empty rows exact."""
    ref_out, ref_lse = _oracle(q, k, v, sinks, pattern, torch.float32)
    pt_out, pt_lse = _oracle(q, k, v, sinks, pattern, q.dtype)
    for v_ in (verdict("out", out, ref_out, pt_out), verdict("lse", lse, ref_lse, pt_lse)):
        assert v_.ok, str(v_)
    empty = ~pattern.mask(q.device).any(dim=-1)  # (Nq,) rows with no key: Nq > Nk under a causal mask
    assert torch.equal(out[:, :, empty], torch.zeros_like(out[:, :, empty]))
    expected = torch.full_like(lse, float("-inf")) if sinks is None else sinks.view(1, -1, 1).expand_as(lse)
    assert torch.equal(lse[:, :, empty], expected[:, :, empty])


@pytest.mark.gpu
@hopper_only
@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("Nq,Nk", [(128, 128), (1000, 1000), (777, 300), (300, 777), (129, 4097)])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("with_sinks", [False, True])
def test_gpu_both_kernels_within_bar(D, dtype, Nq, Nk, causal, with_sinks):
    """Every pattern the Hopper kernel accepts (full, causal; learned sinks; GQA; (B, N, H, D) strides) at
    odd lengths: the Hopper kernel and the portable one (``config={}`` keeps it) each within the bar."""
    q, k, v = make_qkv(2, 8, 2, Nq, Nk, D, dtype, device="cuda", layout="bnhd")
    sinks = torch.randn(8, device="cuda") if with_sinks else None
    pattern = Pattern.make(Nq, Nk, causal=causal)
    out = torch.full_like(q, float("nan"))
    lse = torch.full(q.shape[:3], float("nan"), device="cuda")
    hopper.forward(q, k, v, sinks, out, lse, pattern, D ** -0.5)
    _check(out, lse, q, k, v, sinks, pattern)
    _check(*attention_forward(q, k, v, sinks, pattern, D ** -0.5, config={}), q, k, v, sinks, pattern)


@pytest.mark.gpu
@hopper_only
@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("with_sinks", [False, True])
def test_gpu_packed_sequences(D, causal, with_sinks):
    """Packed sequences of odd, unequal lengths (a longest one of 300 rows, one shorter than a tile, Nq != Nk
    both ways): each sequence within the bar against its own oracle, for both kernels; no row of one
    sequence written by another's tile (the output starts as NaN)."""
    lengths_q, lengths_k = [300, 77, 129, 1], [300, 200, 64, 129]
    cu_q = torch.tensor([0, *torch.tensor(lengths_q).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    cu_k = torch.tensor([0, *torch.tensor(lengths_k).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    q = torch.randn(sum(lengths_q), 8, D, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(sum(lengths_k), 2, D, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    sinks = torch.randn(8, device="cuda") if with_sinks else None
    view = lambda t: t.transpose(0, 1).unsqueeze(0)  # noqa: E731 - (1, H, total, D), as ops passes them
    pattern = Pattern.make(max(lengths_q), max(lengths_k), causal=causal)
    out = torch.full_like(view(q), float("nan"))
    lse = torch.full((1, 8, q.shape[0]), float("nan"), device="cuda")
    hopper.forward(view(q), view(k), view(v), sinks, out, lse, pattern, D ** -0.5, (cu_q, cu_k))
    portable = attention_forward(view(q), view(k), view(v), sinks, pattern, D ** -0.5, config={},
                                 cu_seqlens=(cu_q, cu_k))
    for s, (nq, nk) in enumerate(zip(lengths_q, lengths_k)):
        rows, keys = slice(cu_q[s], cu_q[s] + nq), slice(cu_k[s], cu_k[s] + nk)
        seq = Pattern.make(nq, nk, causal=causal)
        args = (view(q)[:, :, rows], view(k)[:, :, keys], view(v)[:, :, keys], sinks, seq)
        _check(out[:, :, rows], lse[:, :, rows], *args)
        _check(portable[0][:, :, rows], portable[1][:, :, rows], *args)


@pytest.mark.gpu
@hopper_only
@pytest.mark.parametrize("D,Nq,causal,window,dtype,expected", [
    (128, 1000, True, (-1, -1), torch.bfloat16, True),
    (128, 1000, False, (-1, -1), torch.float16, True),
    (128, 1000, False, (127, 0), torch.bfloat16, False),  # window layers: the portable kernel
    (128, 100, True, (-1, -1), torch.bfloat16, False),   # less than one full Q tile
    (64, 1000, True, (-1, -1), torch.bfloat16, 64 in hopper.HEAD_DIMS),
    (128, 1000, True, (-1, -1), torch.float32, False),
])
def test_gpu_dispatch(D, Nq, causal, window, dtype, expected, monkeypatch):
    """attention_forward takes the Hopper kernel exactly where :func:`hopper.supported` says."""
    calls = []
    monkeypatch.setattr(hopper, "forward", lambda *a: calls.append(a) or hopper_forward(*a))
    q, k, v = make_qkv(1, 4, 2, Nq, Nq, D, dtype, device="cuda")
    attention_forward(q, k, v, None, Pattern.make(Nq, Nq, causal=causal, window=window), D ** -0.5)
    assert bool(calls) == expected


hopper_forward = hopper.forward


if __name__ == "__main__":  # the compile of test_compiles_warp_specialised_for_sm90: print the PTX
    print(_compile_sm90(int(sys.argv[1]), *(a == "1" for a in sys.argv[2:5])).asm["ptx"])
