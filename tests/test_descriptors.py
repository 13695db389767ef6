"""When the kernels may read an operand through a tensor descriptor (gstar.kernels.common.descriptors)."""

import torch

from gstar.kernels.common import descriptors


def test_contiguous_and_strided_layouts_are_supported():
    x = torch.randn(2, 4, 33, 64, dtype=torch.bfloat16)                      # (B, H, N, D)
    assert descriptors.supported(x)
    assert descriptors.supported(x.transpose(1, 2).contiguous().transpose(1, 2))  # (B, N, H, D) storage


def test_unaligned_operands_keep_the_pointer_path():
    odd_rows = torch.randn(2, 4, 33, 36, dtype=torch.float16)                # 72-byte rows
    assert not descriptors.supported(odd_rows)
    storage = torch.randn(2 * 4 * 33 * 64 + 1, dtype=torch.float16)
    shifted = storage[1:].view(2, 4, 33, 64)                                  # base 2 bytes past alignment
    assert not descriptors.supported(shifted)
    broadcast = torch.randn(2, 1, 33, 64, dtype=torch.float16).expand(2, 4, 33, 64)  # head stride 0
    assert not descriptors.supported(broadcast)
    assert not descriptors.supported(torch.randn(2, 4, 64, 33).transpose(2, 3))  # last stride 33
    assert not descriptors.supported(torch.randn(2, 4, 0, 64))
    # one unsupported operand is enough
    assert not descriptors.supported(torch.randn(2, 4, 33, 64, dtype=torch.float16), odd_rows)


def test_tiles_describe_the_whole_tensor():
    x = torch.randn(2, 4, 33, 64, dtype=torch.bfloat16).transpose(1, 2).contiguous().transpose(1, 2)
    desc = descriptors.tiles(x, (1, 1, 16, 64))
    assert list(desc.shape) == [2, 4, 33, 64]
    assert list(desc.strides) == list(x.stride())
    assert list(desc.block_shape) == [1, 1, 16, 64]
