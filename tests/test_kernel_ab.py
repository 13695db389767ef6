"""scripts/kernel-ab: another version of an sm_90 kernel module loads beside the tree's (its relative imports
resolved), from a file or a git revision, and a machine without an H100 / H200 gets a clear exit, not a crash.

The timing itself needs an sm_90 GPU; these run where there is none (CI), in a subprocess as a user would."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "kernel-ab"
pytestmark = pytest.mark.skipif(torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9,
                                reason="on an H100 / H200 the script times the kernels instead")


def _run(*args):
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, env=env,
                          timeout=120, cwd=ROOT)


@pytest.mark.parametrize("module,other", [
    ("backward", "HEAD"),                                                  # a git revision's version
    ("forward", str(ROOT / "src" / "gstar" / "kernels" / "sm90" / "forward.py")),  # a file
])
def test_loads_the_other_version_then_asks_for_sm90(module, other):
    result = _run(module, other, "--case", "D128 causal")
    assert result.returncode == 1, result.stderr[-2000:]
    assert f"loaded {module} from {other}; timing it needs an H100 / H200" in result.stderr


def test_unknown_revision_and_case_are_named():
    result = _run("backward", "no-such-revision")
    assert result.returncode == 1
    assert "'no-such-revision' is neither a file nor a revision" in result.stderr
    result = _run("forward", "HEAD", "--case", "no such case")
    assert result.returncode == 2
    assert "no case label contains 'no such case'" in result.stderr
