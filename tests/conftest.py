"""Test setup: the Triton interpreter on CPU-only machines, NaN-poisoned kernel outputs, and the tiers.

The interpreter and the poison must be switched on before triton or gstar.kernels is imported, which is why
they live here. Tiers: ``pytest`` runs the quick suite (every kernel path, about five minutes on two cores);
``pytest --full`` adds the tests marked ``slow`` (``tests/tiers.py`` marks most points of large parameter
grids so); tests marked ``gpu`` run only where CUDA is available.
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


def pytest_collection_modifyitems(config, items):
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
