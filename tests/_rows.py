"""Inputs shared by the row-op tests on CPU and CUDA: every dtype, random indices with -1s."""

import torch

# Every dtype the row ops must move unchanged (they treat rows as bytes).
DTYPES = [
    torch.float32,
    torch.float64,
    torch.float16,
    torch.bfloat16,
    torch.int8,
    torch.int16,
    torch.int32,
    torch.int64,
    torch.uint8,
    torch.bool,
    torch.complex64,
]
if hasattr(torch, "float8_e4m3fn"):
    DTYPES.append(torch.float8_e4m3fn)


def random_index(num_out, num_src, gen, missing=0.2):
    """int64 [num_out] in [-1, num_src): repeats allowed, about `missing` of them -1."""
    if num_src == 0:
        return torch.full((num_out,), -1, dtype=torch.int64)
    idx = torch.randint(0, num_src, (num_out,), generator=gen)
    drop = torch.rand(num_out, generator=gen) < missing
    return torch.where(drop, torch.full_like(idx, -1), idx)
