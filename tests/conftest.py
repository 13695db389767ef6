"""Test setup: the Triton interpreter on CPU-only machines, NaN-poisoned kernel outputs, and the tiers.

The interpreter and the poison must be switched on before triton or gstar.kernels is imported, which is why
they live here. Tiers: ``pytest`` runs the quick suite (every kernel path, about five minutes on two cores);
``pytest --full`` adds the tests marked ``slow`` (``tests/tiers.py`` marks most points of large parameter
grids so); tests marked ``gpu`` run only where CUDA is available. ``--shard i/n`` keeps every n-th collected
test from the i-th, so that n processes side by side share a run whose time goes to compiling kernels
(``SHARDS=n scripts/gpu-suite tests``).
"""

import os

import torch

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ["GSTAR_POISON"] = "1"

import pytest  # noqa: E402


def pytest_addoption(parser):
    parser.addoption("--full", action="store_true",
                     help="also run the tests marked slow (end-to-end runs and larger sweeps): the full suite")
    parser.addoption("--shard", metavar="I/N", help="run only every N-th collected test, from the I-th (0 <= I < N)")


def pytest_collection_modifyitems(config, items):
    if config.getoption("--shard"):
        i, n = (int(x) for x in config.getoption("--shard").split("/"))
        if not 0 <= i < n:
            raise pytest.UsageError(f"--shard {i}/{n}: I must lie in [0, N)")
        config.hook.pytest_deselected(items=[t for j, t in enumerate(items) if j % n != i])
        items[:] = [t for j, t in enumerate(items) if j % n == i]
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device (GPU tier)")
    skip_slow = pytest.mark.skip(reason="slow: part of the full suite (pytest --full)")
    full = config.getoption("--full")
    for item in items:
        if "gpu" in item.keywords and not HAS_CUDA:
            item.add_marker(skip_gpu)
        elif "slow" in item.keywords and not full:
            item.add_marker(skip_slow)


@pytest.fixture
def device():
    """Where kernel tests run: the GPU when there is one, else the CPU under the Triton interpreter."""
    return "cuda" if HAS_CUDA else "cpu"


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
