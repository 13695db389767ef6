"""gstar.lab.roofline: floors() arithmetic, the JSON round trip, and `gstar roofline` on CPU and GPU."""

import argparse
import json

import pytest
import torch

from gstar.lab import roofline
from gstar.lab.cli import roofline as cli
from gstar import buffers

CARD = "NVIDIA H100 80GB HBM3"


def _result(card=CARD, created="2026-11-26T01:00:00+00:00", copy=3000.0, tflops=800.0):
    kernels = {name: {"shape": [4, 8], "bytes": 96, "ms": 1.0, "gbps": copy * 0.9, "pct_of_copy": 90.0}
               for name in roofline.PRIMERS}
    kernels["copy"] = {"shape": [8], "bytes": 64, "ms": 1.0, "gbps": copy, "pct_of_copy": 100.0}
    return {"schema": roofline.SCHEMA, "card": card, "card_slug": roofline.card_slug(card), "driver": "580",
            "cuda": "13.0", "torch": "2.11.0", "triton": "3.6.0", "created": created, "dtype": "bfloat16",
            "copy_gbps": copy, "memory_gbps": copy, "matmul_tflops": tflops, "matmul_shape": [8192] * 3,
            "kernels": kernels}


def test_floors_compute_bound():
    f = roofline.floors(1e12, 1e9, _result(), ms=2.5)
    assert f["compute_ms"] == pytest.approx(1.25)
    assert f["memory_ms"] == pytest.approx(1 / 3)
    assert f["floor_ms"] == pytest.approx(1.25) and f["bound"] == "compute"
    assert f["pct_of_floor"] == pytest.approx(50.0)


def test_floors_memory_bound_and_ceiling_choice():
    r = _result(copy=2000.0, tflops=500.0)
    r["memory_gbps"] = 4000.0  # a primer streamed faster than the copy: that is the ceiling
    f = roofline.floors(5e9, 8e9, r)
    assert f["compute_ms"] == pytest.approx(0.01)
    assert f["memory_ms"] == pytest.approx(2.0)
    assert f["floor_ms"] == pytest.approx(2.0) and f["bound"] == "memory"
    assert "pct_of_floor" not in f
    del r["memory_gbps"]  # a file without it: the copy rate is the ceiling
    assert roofline.floors(0, 8e9, r)["memory_ms"] == pytest.approx(4.0)


def test_floors_rejects_bad_input():
    with pytest.raises(ValueError, match="must be >= 0"):
        roofline.floors(-1, 0, _result())
    with pytest.raises(ValueError, match="must be positive"):
        roofline.floors(1, 1, _result(tflops=0.0))


def test_card_slug_and_default_path(tmp_path):
    assert roofline.card_slug(CARD) == "nvidia-h100-80gb-hbm3"
    assert roofline.default_path(CARD, tmp_path) == tmp_path / "roofline-nvidia-h100-80gb-hbm3.json"
    assert roofline.results_dir().parts[-2:] == ("benchmarks", "results")


def test_json_round_trip_and_newest_match(tmp_path):
    old, new = _result(created="2026-11-01T00:00:00+00:00"), _result(created="2026-11-20T00:00:00+00:00")
    path = roofline.save(new, roofline.default_path(CARD, tmp_path))
    assert roofline.load(path) == new
    roofline.save(old, tmp_path / "roofline-nvidia-h100-older.json")
    roofline.save(_result(card="NVIDIA H200", created="2026-12-01T00:00:00+00:00"),
                  roofline.default_path("NVIDIA H200", tmp_path))
    stale = dict(_result(created="2027-01-01T00:00:00+00:00"), schema=roofline.SCHEMA + 1)
    (tmp_path / "roofline-future.json").write_text(json.dumps(stale))
    (tmp_path / "roofline-broken.json").write_text("{not json")
    assert roofline.load(card=CARD, directory=tmp_path) == new
    assert roofline.load(card="NVIDIA H200", directory=tmp_path)["created"].startswith("2026-12")
    assert roofline.load(card="NVIDIA A100", directory=tmp_path) is None
    with pytest.raises(FileNotFoundError):
        roofline.load(tmp_path / "missing.json")


@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU behaviour")
def test_load_without_gpu_or_card_is_none(tmp_path):
    roofline.save(_result(), roofline.default_path(CARD, tmp_path))
    assert roofline.load(directory=tmp_path) is None
    with pytest.raises(RuntimeError, match="needs a CUDA device"):
        roofline.measure()


def _args(argv):
    parser = argparse.ArgumentParser()
    cli.add_arguments(parser)
    return parser.parse_args(argv)


@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU behaviour")
def test_cli_on_cpu_fails_and_says_a_gpu_is_required(tmp_path, capsys):
    out = tmp_path / "r.json"
    assert cli.run(_args(["--json", str(out)])) == 1
    assert "a CUDA GPU is required" in capsys.readouterr().err
    assert not out.exists()


@pytest.mark.gpu
def test_cli_on_gpu_writes_json_and_primers_reach_85pct_of_copy(tmp_path, monkeypatch, capsys):
    """Every primer streams at >= 85% of the device-to-device copy bandwidth."""
    monkeypatch.setattr(buffers, "POISON", False)  # the NaN fill of outputs would be timed too
    monkeypatch.setenv("COLUMNS", "200")  # rich shortens names in a narrow (captured) terminal
    out = tmp_path / "roofline.json"
    assert cli.run(_args(["--json", str(out), "--matmul-n", "4096"])) == 0
    printed = capsys.readouterr().out
    result = roofline.load(out)
    assert result["card"] == torch.cuda.get_device_name()
    assert all(name in printed for name in roofline.PRIMERS)
    assert result["copy_gbps"] > 0 and result["matmul_tflops"] > 0
    assert result["buffer_bytes"] >= 8 * torch.cuda.get_device_properties(0).L2_cache_size
    for name in roofline.PRIMERS:
        assert result["kernels"][name]["pct_of_copy"] >= 85.0, (name, result["kernels"])
