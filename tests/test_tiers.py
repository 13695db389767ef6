"""The test tiers' own options (tests/conftest.py): ``--shard i/n`` splits a run over n processes."""

import os
import subprocess
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))


def _collected(*args: str) -> list[str]:
    """The test ids a ``pytest --collect-only`` of tests/test_pattern.py keeps with ``args``."""
    result = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
                             os.path.join(HERE, "test_pattern.py"), *args], capture_output=True, text=True, cwd=HERE)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    return [line for line in result.stdout.splitlines() if "::" in line]


def test_shards_split_a_run_into_disjoint_parts_that_cover_it():
    every = _collected()
    shards = [_collected("--shard", f"{i}/3") for i in range(3)]
    assert len(every) >= 3 and all(shards)
    assert sorted(t for shard in shards for t in shard) == sorted(every)  # each test in exactly one shard


@pytest.mark.parametrize("spec", ["3/3", "-1/2"])
def test_a_shard_outside_the_run_is_refused(spec):
    result = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
                             os.path.join(HERE, "test_pattern.py"), "--shard", spec], capture_output=True, text=True,
                            cwd=HERE)
    assert result.returncode != 0 and "--shard" in result.stdout + result.stderr
