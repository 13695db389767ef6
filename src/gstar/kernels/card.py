"""The card a call runs on, asked once per device: its compute capability, its SM count, and whether it is an
NVIDIA GPU (inline PTX, programmatic dependent launches). Every call's plan reads them, and torch's queries cost
microseconds of host time that small shapes feel."""

from __future__ import annotations

import functools

import torch


@functools.lru_cache(maxsize=16)
def capability_major(device: torch.device) -> int:
    """The compute capability's major version (9: Hopper) of a CUDA device."""
    return torch.cuda.get_device_capability(device)[0]


@functools.lru_cache(maxsize=16)
def sm_count(device: str) -> int:
    """The SM count of a CUDA device; 0 for any other device (the plans never split work there)."""
    d = torch.device(device)
    return torch.cuda.get_device_properties(d).multi_processor_count if d.type == "cuda" else 0


def nvidia(device: torch.device) -> bool:
    """An NVIDIA GPU (CUDA, not ROCm)."""
    return device.type == "cuda" and torch.version.hip is None


def sm90(device: torch.device) -> bool:
    """An sm_90 GPU (H100, H200): where the Gluon kernels of :mod:`gstar.kernels.sm90` can run."""
    return device.type == "cuda" and capability_major(device) == 9
