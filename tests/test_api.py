"""gstar.flash_attention's public surface: every bad input of docs/design.md section 2 raises the documented
error naming the argument, empty inputs return empty results, the output follows q's layout, and the
package imports light and runs its quickstart example."""

import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import gstar
from gstar.pattern import SINK_LIMIT
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
    ("head dim 0", lambda q, k, v: dict(q=q[..., :0], k=k[..., :0], v=v[..., :0]), ValueError,
     "q head dim (q.shape[-1]) must be >= 1, got 0"),
    ("head dim 0, scale given", lambda q, k, v: dict(q=q[..., :0], k=k[..., :0], v=v[..., :0], scale=1.0),
     ValueError, "q head dim (q.shape[-1]) must be >= 1, got 0"),
    ("head dim k", lambda q, k, v: dict(k=k[..., :4]), ValueError, "k head dim"),
    ("head dim k 0", lambda q, k, v: dict(k=k[..., :0]), ValueError, "k head dim must equal q head dim 8, got 0"),
    ("head dim v 0", lambda q, k, v: dict(v=v[..., :0]), ValueError, "v head dim (v.shape[-1]) must be >= 1, got 0"),
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
    ("causal numpy bool", lambda q, k, v: dict(causal=np.bool_(True)), TypeError,
     "causal must be a bool, got numpy.bool"),
    ("return_lse type", lambda q, k, v: dict(return_lse="no"), TypeError, "return_lse must be a bool, got str"),
    ("scale type", lambda q, k, v: dict(scale="0.1"), TypeError, "scale must be a finite float"),
    ("scale nan", lambda q, k, v: dict(scale=math.nan), TypeError, "scale must be a finite float"),
    ("scale beyond float", lambda q, k, v: dict(scale=10**400), TypeError, "scale must be a finite float"),
    ("scale tensor", lambda q, k, v: dict(scale=torch.tensor(0.5)), TypeError, "scale must be a finite float"),
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


def test_head_dim_limits_for_triton(device):
    """Both head dims are padded to powers of two up to 1024 (latent attention's 576-wide queries fit)."""
    q, k, v = (t.to(device) for t in qkv(d=1025))
    with pytest.raises(ValueError, match="q head dim must be between 1 and 1024"):
        gstar.flash_attention(q, k, v, backend="triton")
    q, k, v = (t.to(device) for t in qkv(d=8))
    with pytest.raises(ValueError, match="v head dim must be between 1 and 1024 for the Triton backend, got 1025"):
        gstar.flash_attention(q, k, torch.randn(*v.shape[:3], 1025, device=device), backend="triton")


ENTRY_POINTS = {
    "dense": lambda q, k, v, **kw: gstar.flash_attention(q, k, v, **kw),
    "varlen": lambda q, k, v, **kw: gstar.flash_attention_varlen(
        q[0].transpose(0, 1), k[0].transpose(0, 1), v[0].transpose(0, 1), torch.tensor([0, 9], dtype=torch.int32),
        torch.tensor([0, 11], dtype=torch.int32), 9, 11, **kw),
    "tiled": lambda q, k, v, backend: gstar.tiled_attention(q, k, v),
}


@pytest.mark.parametrize("entry,backend", [(e, b) for e in ("dense", "varlen") for b in ("auto", "torch", "triton")]
                         + [("tiled", "torch")])
def test_head_dim_zero_raises_value_error_everywhere(entry, backend):
    """D = 0 would divide by zero in the default scale ``D ** -0.5``: every entry point and backend refuses it
    first, naming q's head dim."""
    q, k, v = qkv(d=0)
    with pytest.raises(ValueError, match=r"q head dim \(q.shape\[-1\]\) must be >= 1, got 0"):
        ENTRY_POINTS[entry](q, k, v, backend=backend)


def test_numpy_scalars_are_accepted():
    q, k, v = qkv()
    want = gstar.flash_attention(q, k, v, window=(3, 0), sink_tokens=1, scale=0.25)
    got = gstar.flash_attention(q, k, v, window=(np.int64(3), np.int32(0)), sink_tokens=np.int64(1),
                                scale=np.float32(0.25))
    assert torch.equal(got, want)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_window_bounds_beyond_every_key_are_unbounded(backend):
    """A window bound wider than any sequence sees every key, however large (even past int32 or int64,
    where the kernels' position arithmetic would overflow): the result equals the unbounded window's."""
    q, k, v = qkv()
    want = gstar.flash_attention(q, k, v, backend=backend)
    for window in ((2**31 - 1, 2**31 - 1), (0, 2**63), (2**80, 2**40)):
        got = gstar.flash_attention(q, k, v, window=window, sink_tokens=2**40, backend=backend)
        torch.testing.assert_close(got, want)


def test_max_seqlen_beyond_int32_positions_raises():
    q, k, v = (torch.randn(9, 2, 8) for _ in range(3))
    cu = torch.tensor([0, 9], dtype=torch.int32)
    with pytest.raises(ValueError, match="max_seqlen_q must be <= 1073741824"):
        gstar.flash_attention_varlen(q, k, v, cu, cu, 2**40, 9)


def test_check_cu_seqlens_values_names_a_non_tensor():
    with pytest.raises(TypeError, match="cu_seqlens_q must be a torch.Tensor, got list"):
        gstar.check_cu_seqlens_values([0, 9], torch.tensor([0, 9], dtype=torch.int32), 9, 9, 9, 9)


def test_triton_on_cpu_tensors_needs_interpreter(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    q, k, v = qkv()
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET=1"):
        gstar.flash_attention(q, k, v, backend="triton")


@pytest.mark.parametrize("versions,works", [({"triton": "3.6.0", "numpy": "2.4.1"}, False),
                                             ({"triton": "3.6.0", "numpy": "2.3.5"}, True),
                                             ({"triton": "3.7.1", "numpy": "2.4.6"}, True)])
def test_interpreter_refuses_a_numpy_it_breaks_on(monkeypatch, versions, works):
    """triton < 3.7's interpreter fails on numpy >= 2.4 with an error about array conversion: the API says
    what to install instead."""
    from gstar import checks
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setattr(checks.importlib.metadata, "version", versions.__getitem__)
    checks.interpreter_problem.cache_clear()
    try:
        q, k, v = qkv()
        if works:
            assert checks.interpreter_problem() is None
        else:
            with pytest.raises(RuntimeError, match=r"numpy<2.4' or triton >= 3.7"):
                gstar.flash_attention(q, k, v, backend="triton")
    finally:
        checks.interpreter_problem.cache_clear()


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


def test_import_is_light():
    """``import gstar`` loads neither triton (the kernels load it on the first Triton call) nor the CLI's
    rich."""
    code = "import sys, gstar; print(sorted({'triton', 'rich', 'gstar.kernels'} & set(sys.modules)))"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"


def test_quickstart_example_runs_on_cpu():
    """examples/quickstart.py runs as a newcomer would run it, and every difference it prints from the
    float64 oracle is float32 rounding."""
    script = Path(__file__).resolve().parents[1] / "examples" / "quickstart.py"
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="")
    result = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300, env=env)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert len(lines) == 8 and sum(line.startswith("packed") for line in lines) == 3, result.stdout
    for line in lines:
        error = float(line.split("max error ")[1].split()[0])
        assert error < 1e-4, line


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_infinite_sink_takes_every_row(backend):
    """A learned sink of +inf (docs/design.md section 1: logits above gstar.pattern.SINK_LIMIT count as it) takes
    every row of its head: zeros out, LSE at the cap, finite gradients (none for that sink), the other heads as
    the oracle has them; -inf is no sink at all."""
    q, k, v = (t.requires_grad_() for t in qkv(nq=33, nk=45, d=16))
    sinks = torch.tensor([float("inf"), 0.5, float("-inf"), 2.0], requires_grad=True)
    out, lse = gstar.flash_attention(q, k, v, causal=True, window=(9, 0), sinks=sinks, return_lse=True,
                                     backend=backend)
    ref, ref_lse = gstar.naive_attention(q.double(), k.double(), v.double(), causal=True, window=(9, 0),
                                         sinks=sinks.double())
    assert torch.equal(out[:, 0], torch.zeros_like(out[:, 0])) and torch.all(lse[:, 0] == SINK_LIMIT)
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse.double(), ref_lse, atol=1e-5, rtol=1e-5)
    no_sink = gstar.flash_attention(q, k, v, causal=True, window=(9, 0), backend=backend)
    torch.testing.assert_close(out[:, 2], no_sink[:, 2], atol=1e-6, rtol=1e-6)
    dout = torch.randn_like(out)
    grads = torch.autograd.grad((out * dout).sum() + lse[:, 1:].sum(), (q, k, v, sinks))
    want = torch.autograd.grad((ref * dout.double()).sum() + ref_lse[:, 1:].sum(), (q, k, v, sinks))
    assert all(torch.isfinite(g).all() for g in grads) and grads[3][0] == 0
    for g, w in zip(grads, want):
        torch.testing.assert_close(g.double(), w.double(), atol=1e-4, rtol=1e-4)
