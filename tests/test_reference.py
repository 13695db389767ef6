"""The references: naive_attention against a rebuild of Hugging Face GPT-OSS eager attention, the tiled
PyTorch path (the CPU backend) against naive_attention, forward and backward, and the reference module's
independence from what it judges."""

import ast
import json
import math
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

import gstar
from gstar.lab.accuracy import verdict
from gstar.reference import naive_attention


def hf_gpt_oss_eager(query, key, value, sinks, scaling, sliding_window=None):
    """GPT-OSS eager attention as Hugging Face writes it: additive mask, sink column, softmax, drop it.

    The mask is built here from the Hugging Face definition (causal; ``q - k < sliding_window``), not
    from gstar.pattern, so this test checks our window convention independently.
    """
    groups = query.shape[1] // key.shape[1]
    key, value = key.repeat_interleave(groups, 1), value.repeat_interleave(groups, 1)
    n = query.shape[2]
    qi, ki = torch.arange(n)[:, None], torch.arange(n)[None, :]
    allowed = ki <= qi
    if sliding_window is not None:
        allowed &= (qi - ki) < sliding_window
    mask = torch.zeros(n, n, dtype=query.dtype).masked_fill(~allowed, torch.finfo(query.dtype).min)
    logits = query @ key.transpose(2, 3) * scaling + mask
    sink_col = sinks.reshape(1, -1, 1, 1).expand(query.shape[0], -1, n, 1)
    combined = torch.cat([logits, sink_col], dim=-1)
    combined = combined - combined.max(dim=-1, keepdim=True).values
    probs = torch.softmax(combined, dim=-1)[..., :-1]
    return probs @ value


@pytest.mark.parametrize("sliding_window", [None, 1, 5, 16])
def test_naive_matches_hf_gpt_oss_eager(sliding_window):
    q = torch.randn(2, 8, 37, 16, dtype=torch.float64)
    k, v = torch.randn(2, 2, 37, 16, dtype=torch.float64), torch.randn(2, 2, 37, 16, dtype=torch.float64)
    sinks = torch.randn(8, dtype=torch.float64) * 3
    expected = hf_gpt_oss_eager(q, k, v, sinks, 0.25, sliding_window)
    window = (-1, 0) if sliding_window is None else (sliding_window - 1, 0)
    out, _ = naive_attention(q, k, v, window=window, sinks=sinks, scale=0.25)
    torch.testing.assert_close(out, expected, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("sliding_window", [None, 4])
def test_naive_matches_transformers_gpt_oss(sliding_window):
    modeling = pytest.importorskip("transformers.models.gpt_oss.modeling_gpt_oss")
    q = torch.randn(1, 4, 19, 8, dtype=torch.float64)
    k, v = torch.randn(1, 2, 19, 8, dtype=torch.float64), torch.randn(1, 2, 19, 8, dtype=torch.float64)
    module = SimpleNamespace(num_key_value_groups=2, sinks=torch.randn(4, dtype=torch.float64), training=False)
    i, j = torch.arange(19)[:, None], torch.arange(19)[None, :]
    allowed = (j <= i) if sliding_window is None else (j <= i) & (i - j < sliding_window)
    mask = torch.zeros(19, 19, dtype=torch.float64).masked_fill(~allowed, -math.inf)[None, None]
    expected, _ = modeling.eager_attention_forward(module, q, k, v, mask, scaling=0.3, dropout=0.0)
    window = (-1, 0) if sliding_window is None else (sliding_window - 1, 0)
    out, _ = naive_attention(q, k, v, window=window, sinks=module.sinks, scale=0.3)
    torch.testing.assert_close(out.transpose(1, 2), expected, rtol=1e-10, atol=1e-10)


def test_naive_empty_rows_and_lse():
    q, k, v = torch.randn(1, 2, 6, 8), torch.randn(1, 2, 3, 8), torch.randn(1, 2, 3, 8)
    out, lse = naive_attention(q, k, v, causal=True)  # rows 0..2 sit before the first key
    assert torch.equal(out[:, :, :3], torch.zeros_like(out[:, :, :3]))
    assert torch.isneginf(lse[:, :, :3]).all() and torch.isfinite(lse[:, :, 3:]).all()
    sinks = torch.tensor([1.5, -2.0])
    out, lse = naive_attention(q, k, v, causal=True, sinks=sinks)
    assert torch.equal(out[:, :, :3], torch.zeros_like(out[:, :, :3]))
    assert torch.equal(lse[0, :, :3], sinks[:, None].expand(2, 3))


CASES = [
    # (Nq, Nk, Hq, Hkv, D, pattern keywords)
    (70, 130, 4, 2, 16, dict(causal=True)),
    (130, 70, 4, 1, 16, dict(causal=True)),
    (113, 127, 4, 4, 24, dict(window=(20, 3), sink_tokens=5)),
    (5, 200, 8, 2, 16, dict()),
    (100, 100, 2, 1, 8, dict(window=(0, 0))),
    (129, 129, 4, 2, 16, dict(causal=True, window=(64, -1), sink_tokens=70)),
]


@pytest.mark.parametrize("nq,nk,hq,hkv,d,kw", CASES)
@pytest.mark.parametrize("with_sinks", [False, True])
def test_tiled_matches_naive_forward_and_backward(nq, nk, hq, hkv, d, kw, with_sinks):
    f64 = dict(dtype=torch.float64)
    q = torch.randn(2, hq, nq, d, **f64, requires_grad=True)
    k = torch.randn(2, hkv, nk, d, **f64, requires_grad=True)
    v = torch.randn(2, hkv, nk, d, **f64, requires_grad=True)
    sinks = (torch.randn(hq, **f64) * 10).requires_grad_() if with_sinks else None
    leaves = [q, k, v] + ([sinks] if with_sinks else [])
    out, lse = gstar.tiled_attention(q, k, v, sinks=sinks, return_lse=True, **kw)
    ref, ref_lse = naive_attention(q, k, v, sinks=sinks, **kw)
    torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(lse, ref_lse, rtol=1e-10, atol=1e-10)
    w, w_lse = torch.randn_like(out), torch.randn_like(lse)
    finite = torch.isfinite(ref_lse)
    grads = torch.autograd.grad((out * w).sum() + (lse[finite] * w_lse[finite]).sum(), leaves)
    ref_grads = torch.autograd.grad((ref * w).sum() + (ref_lse[finite] * w_lse[finite]).sum(), leaves)
    for g, r in zip(grads, ref_grads):
        assert not torch.isnan(g).any()
        torch.testing.assert_close(g, r, rtol=1e-9, atol=1e-9)


def test_tiled_gradcheck_float64():
    f64 = dict(dtype=torch.float64, requires_grad=True)
    q, k, v = torch.randn(1, 4, 21, 8, **f64), torch.randn(1, 2, 29, 8, **f64), torch.randn(1, 2, 29, 8, **f64)
    sinks = torch.randn(4, **f64)

    def f(q, k, v, sinks):
        return gstar.tiled_attention(q, k, v, window=(5, 0), sink_tokens=2, sinks=sinks, return_lse=True)

    assert torch.autograd.gradcheck(f, (q, k, v, sinks))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_tiled_low_precision_meets_bar(dtype):
    q, k, v = (torch.randn(1, 4, 97, 32) * 3 for _ in range(3))
    sinks = torch.randn(4) * 5
    kw = dict(causal=True, window=(31, 0), sink_tokens=3, sinks=sinks)
    ref, _ = naive_attention(q.double(), k.double(), v.double(), **kw)
    out_pt, _ = naive_attention(q.to(dtype), k.to(dtype), v.to(dtype), **kw)
    out = gstar.tiled_attention(q.to(dtype), k.to(dtype), v.to(dtype), **kw)
    assert out.dtype == dtype
    assert verdict("out", out, ref, out_pt).ok


def test_tiled_memory_is_linear():
    """The PyTorch path never allocates an Nq x Nk matrix, forward or backward: its largest intermediate
    is a tile row. (It runs inside a torch.library operator, where a TorchFunctionMode does not reach, so
    the spy watches the backend functions themselves.)"""
    from gstar import reference
    from gstar.pattern import Pattern
    seen = []

    class Spy(torch.overrides.TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            result = func(*args, **(kwargs or {}))
            if isinstance(result, torch.Tensor):
                seen.append(result.numel())
            return result

    n, tile = 1024, reference.TILE
    q, k, v = (torch.randn(1, 1, n, 8) for _ in range(3))
    pattern = Pattern.make(n, n, causal=True)
    with Spy():
        out, lse = reference.tiled_forward(q, k, v, None, pattern, 0.3)
        reference.tiled_backward(torch.randn_like(out), q, k, v, out, lse, None, None, pattern, 0.3)
    assert len(seen) > 100  # the spy saw the tile loop
    assert max(seen) <= max(n * 8, tile * tile), max(seen)


def _imported_names(path: Path):
    """Every module an import statement of a gstar source file names, function-level (lazy) ones included."""
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0:
            yield node.module
        elif isinstance(node, ast.ImportFrom):  # relative: from . import x, from .x import y (inside gstar/)
            yield from ([f"gstar.{node.module}"] if node.module else [f"gstar.{a.name}" for a in node.names])


# Loads gstar.reference without the package's __init__ (which imports the API), then prints the file of every
# gstar or triton module that came with it.
LOAD_REFERENCE_ALONE = """
import importlib.util, json, sys, types
package = types.ModuleType("gstar")
package.__path__ = list(importlib.util.find_spec("gstar").submodule_search_locations)
sys.modules["gstar"] = package
import gstar.reference
print(json.dumps({m: getattr(sys.modules[m], "__file__", None) for m in sys.modules
                  if m.split(".")[0] in ("gstar", "triton")}))
"""


def test_reference_imports_neither_the_api_nor_the_kernels():
    """The oracle and the PyTorch path stand apart from what they judge: gstar.reference pulls in neither
    gstar.api, gstar.ops, gstar.kernels nor triton, and no import statement of the gstar modules it loads
    names them, not even inside a function."""
    forbidden = ("gstar.api", "gstar.ops", "gstar.kernels", "triton")
    result = subprocess.run([sys.executable, "-c", LOAD_REFERENCE_ALONE], capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0, result.stderr
    loaded = json.loads(result.stdout)
    assert "gstar.reference" in loaded and not set(forbidden) & set(loaded), sorted(loaded)
    for name, path in loaded.items():
        if path is not None:
            names = list(_imported_names(Path(path)))
            assert not [n for n in names if n.startswith(forbidden)], (name, names)
