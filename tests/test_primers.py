"""The primers: Triton weighted_row_sum against torch, CUDA vector_add / matrix_add bitwise against a + b.

CPU: the row sum under the Triton interpreter (float32, float16, small odd shapes), argument validation of
all three, and an nvcc compile of the CUDA sources. GPU tier: bfloat16 and larger shapes, and the CUDA
kernels' results.
"""

import os
import shutil
import subprocess

import pytest
import torch

from gstar.lab.accuracy import relative_error, verdict
from gstar.lab import cuda as cuda_primers
from gstar.lab.primers import weighted_row_sum

ROW_SUM_SHAPES = [(1, 1), (7, 300), (33, 1025), (5, 2500), (70, 17)]


def _row_sum_case(x, w):
    y = weighted_row_sum(x, w)
    assert y.shape == (x.shape[0],) and y.dtype == x.dtype and y.device == x.device
    ref = x.double() @ w.double()                                                 # (M,) the oracle
    if x.dtype == torch.float32:  # docs/design.md section 4's float32 bar (cuBLAS's fp32 matvec is no baseline)
        assert relative_error(y, ref) < 1e-4
    else:
        v = verdict("y", y, ref, x @ w)                                           # torch in x's dtype
        assert v.ok, v


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("shape", ROW_SUM_SHAPES)
def test_row_sum_matches_torch(device, dtype, shape):
    x = torch.randn(shape, device=device, dtype=dtype)
    w = torch.randn(shape[1], device=device, dtype=dtype)
    _row_sum_case(x, w)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_row_sum_strided_inputs(device, dtype):
    # rows 40 elements apart holding 33 values; every other element of a longer w
    x = torch.randn(9, 40, device=device, dtype=dtype)[:, 3:36]
    w = torch.randn(66, device=device, dtype=dtype)[::2]
    assert x.stride() == (40, 1) and w.stride() == (2,)
    _row_sum_case(x, w)


def test_row_sum_empty(device):
    y = weighted_row_sum(torch.randn(4, 0, device=device), torch.randn(0, device=device))
    assert torch.equal(y, torch.zeros(4, device=device))
    assert weighted_row_sum(torch.randn(0, 5, device=device), torch.randn(5, device=device)).shape == (0,)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("shape", ROW_SUM_SHAPES + [(4096, 8192), (1000, 4099), (3, 100_003)])
def test_row_sum_gpu(dtype, shape):
    x = torch.randn(shape, device="cuda", dtype=dtype)
    w = torch.randn(shape[1], device="cuda", dtype=dtype)
    _row_sum_case(x, w)


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
def test_row_sum_on_a_device_that_is_not_current():
    """x on cuda:1 while cuda:0 is current: the kernel runs on cuda:1 and matches cuda:0's result."""
    x, w = torch.randn(37, 300), torch.randn(300)
    torch.cuda.set_device(0)
    want = weighted_row_sum(x.to("cuda:0"), w.to("cuda:0")).cpu()
    got = weighted_row_sum(x.to("cuda:1"), w.to("cuda:1"))
    assert got.device == torch.device("cuda:1") and torch.cuda.current_device() == 0
    assert torch.equal(got.cpu(), want)


def test_row_sum_validation():
    x, w = torch.randn(3, 4), torch.randn(4)
    with pytest.raises(TypeError, match="x must be a torch.Tensor"):
        weighted_row_sum([[1.0]], w)
    with pytest.raises(ValueError, match="x must have 2 dims"):
        weighted_row_sum(torch.randn(3), w)
    with pytest.raises(ValueError, match="w must have 1 dims"):
        weighted_row_sum(x, torch.randn(4, 1))
    with pytest.raises(ValueError, match=r"w must have shape \(4,\)"):
        weighted_row_sum(x, torch.randn(5))
    with pytest.raises(TypeError, match="x must be float16, bfloat16 or float32"):
        weighted_row_sum(x.double(), w.double())
    with pytest.raises(TypeError, match="w must have x's dtype"):
        weighted_row_sum(x, w.half())
    with pytest.raises(ValueError, match="x must have unit stride"):
        weighted_row_sum(torch.randn(4, 3).t(), w)


def test_row_sum_cpu_needs_interpreter(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET=1"):
        weighted_row_sum(torch.randn(2, 3), torch.randn(3))


@pytest.mark.parametrize("fn,ndim", [(cuda_primers.vector_add, 1), (cuda_primers.matrix_add, 2)])
def test_cuda_primers_validation(fn, ndim):
    shape = (5,) * ndim
    a = torch.randn(shape)
    with pytest.raises(TypeError, match="b must be a torch.Tensor"):
        fn(a, 1.0)
    with pytest.raises(ValueError, match=f"a must have {ndim} dim"):
        fn(torch.randn((5,) * (ndim + 1)), a)
    with pytest.raises(ValueError, match="same shape"):
        fn(a, torch.randn((6,) * ndim))
    with pytest.raises(TypeError, match="b must have a's dtype"):
        fn(a, a.half())
    with pytest.raises(TypeError, match="a must be float32, float16 or bfloat16"):
        fn(a.double(), a.double())
    with pytest.raises(ValueError, match="a must be a CUDA tensor"):
        fn(a, a)


@pytest.mark.slow  # nvcc, ~7 s
def test_cuda_sources_compile(tmp_path):
    """Each kernel source builds standalone for sm_90 with the flags torch's cpp_extension gives nvcc."""
    nvcc = shutil.which("nvcc") or (os.path.join(os.environ["CUDA_HOME"], "bin", "nvcc")
                                    if os.environ.get("CUDA_HOME") else None)
    if nvcc is None or not os.path.exists(nvcc):
        pytest.skip("nvcc not found (not on PATH, no CUDA_HOME): cannot compile the CUDA primers")
    from torch.utils.cpp_extension import COMMON_NVCC_FLAGS

    for source in cuda_primers.KERNEL_SOURCES:
        cmd = [nvcc, "-std=c++17", "-O3", "-arch=sm_90", "--Werror", "all-warnings", *COMMON_NVCC_FLAGS,
               "-I", str(cuda_primers.SOURCE_DIR), "-c", str(cuda_primers.SOURCE_DIR / source),
               "-o", str(tmp_path / f"{source}.o")]
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, f"{' '.join(cmd)}\n{done.stdout}\n{done.stderr}"


def _bitwise_equal(x, y):
    ints = {4: torch.int32, 2: torch.int16}[x.element_size()]
    return x.dtype == y.dtype and x.shape == y.shape and torch.equal(x.view(ints), y.contiguous().view(ints))


CUDA_DTYPES = [torch.float32, torch.float16, torch.bfloat16]


@pytest.mark.gpu
@pytest.mark.slow  # builds the CUDA extension (~20 s), a roofline tool rather than a kernel of gstar's
@pytest.mark.parametrize("dtype", CUDA_DTYPES)
@pytest.mark.parametrize("n", [1, 7, 8, 9, 31, 1000, 4097, (1 << 20) + 3])
def test_vector_add_bitwise(dtype, n):
    big_a = torch.randn(2 * n + 1, device="cuda").to(dtype)
    big_b = torch.randn(2 * n + 1, device="cuda").to(dtype)
    cases = [(big_a[:n], big_b[:n]),                # aligned: the 16-byte path
             (big_a[1:n + 1], big_b[:n]),           # misaligned a: the element path
             (big_a[::2][:n], big_b[1::2][:n])]     # strided
    for a, b in cases:
        out = cuda_primers.vector_add(a, b)
        assert out.is_contiguous() and out.device == a.device
        assert _bitwise_equal(out, a + b), (dtype, n, a.stride(), b.stride())


@pytest.mark.gpu
@pytest.mark.slow
@pytest.mark.parametrize("dtype", CUDA_DTYPES)
@pytest.mark.parametrize("shape", [(1, 1), (7, 300), (33, 1025), (64, 8192), (3, 1000), (70_001, 3),
                                   (1000, 24)])
def test_matrix_add_bitwise(dtype, shape):
    m, n = shape
    a = torch.randn(m, n, device="cuda").to(dtype)
    b = torch.randn(m, n, device="cuda").to(dtype)
    wide = torch.randn(m, n + 5, device="cuda").to(dtype)
    cases = [(a, b),                                            # contiguous
             (wide[:, 5:], b),                                  # row stride n + 5, shifted start
             (torch.randn(n, m, device="cuda").to(dtype).t(), b),  # column stride m
             (a, b[:1].expand(m, n))]                           # row stride 0
    for x, y in cases:
        out = cuda_primers.matrix_add(x, y)
        assert out.is_contiguous() and out.device == x.device
        assert _bitwise_equal(out, x + y), (dtype, shape, x.stride(), y.stride())


@pytest.mark.gpu
@pytest.mark.slow
def test_cuda_primers_empty_and_tall():
    e = torch.empty(0, device="cuda")
    assert cuda_primers.vector_add(e, e).shape == (0,)
    assert cuda_primers.matrix_add(e.view(0, 3), torch.empty(0, 3, device="cuda")).shape == (0, 3)
    # more rows than one grid column of blocks covers (65535 * rows per block): the row loop
    a = torch.randn(600_000, 2, device="cuda").half()
    assert _bitwise_equal(cuda_primers.matrix_add(a, a), a + a)
