"""CPU tests of the megatron_cp row ops against references built row by row in Python."""

from __future__ import annotations

import importlib.util
import warnings

import pytest
import torch
from _rows import DTYPES, random_index

from megatron.context_parallel import _extension
from megatron.context_parallel._env import env_flag
from megatron.context_parallel.comm import row_ops as ops


def _random(shape, dtype, gen):
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=gen).bool()
    if dtype.is_floating_point and dtype.itemsize == 1:
        return torch.randint(0, 256, shape, generator=gen, dtype=torch.uint8).view(dtype)
    if dtype.is_floating_point or dtype.is_complex:
        return torch.randn(shape, generator=gen, dtype=dtype)
    info = torch.iinfo(dtype)
    return torch.randint(max(info.min, -1000), min(info.max, 1000), shape, generator=gen).to(dtype)


def _ref_gather(src, index):
    rows = []
    for i in index.tolist():
        rows.append(src.new_zeros(src.shape[1:]) if i < 0 else src[i].clone())
    if not rows:
        return src.new_zeros((0,) + tuple(src.shape[1:]))
    return torch.stack(rows)


def _ref_scatter(packed, row_source, offsets, widths):
    data = packed.tolist()
    outs = []
    for off, width in zip(offsets, widths):
        rows = [[0] * width if s < 0 else data[s][off : off + width] for s in row_source.tolist()]
        outs.append(torch.tensor(rows, dtype=torch.uint8).reshape(len(rows), width))
    return outs


def test_scatter_rows_matches_reference_for_random_layouts():
    gen = torch.Generator().manual_seed(0)
    # (slots, fields widths): 16-byte multiples first, as the packer orders them, then odd ones.
    layouts = [
        (12, [32, 16, 4]),
        (7, [48, 6, 2, 1]),
        (9, [3, 5, 7]),
        (1, [20]),
        (5, [0, 8]),
    ]
    for slots, widths in layouts:
        offsets = [sum(widths[:f]) for f in range(len(widths))]
        row_bytes = sum(widths) + 3  # trailing bytes no field covers
        packed = torch.randint(0, 256, (slots, row_bytes), generator=gen, dtype=torch.uint8)
        for num_out in (0, 1, 17):
            row_source = random_index(num_out, slots, gen)
            got = ops.scatter_rows(packed, row_source, offsets, widths)
            want = _ref_scatter(packed, row_source, offsets, widths)
            assert len(got) == len(want)
            for g, w in zip(got, want):
                assert g.dtype == torch.uint8 and torch.equal(g, w)
                assert g.data_ptr() != packed.data_ptr() or g.numel() == 0


def test_scatter_rows_reads_a_column_slice_and_empty_buffer():
    gen = torch.Generator().manual_seed(1)
    wide = torch.randint(0, 256, (6, 40), generator=gen, dtype=torch.uint8)
    view = wide[:, 5:29]  # row stride 40, not the row width
    row_source = torch.tensor([5, -1, 0, 3, 3], dtype=torch.int64)
    got = ops.scatter_rows(view, row_source, [1, 9], [8, 15])
    want = _ref_scatter(view.contiguous(), row_source, [1, 9], [8, 15])
    assert all(torch.equal(g, w) for g, w in zip(got, want))
    # No slots at all: every row is unowned, so every output row is zero.
    empty = torch.empty((0, 10), dtype=torch.uint8)
    got = ops.scatter_rows(empty, torch.full((4,), -1, dtype=torch.int64), [0, 4], [4, 6])
    assert [tuple(g.shape) for g in got] == [(4, 4), (4, 6)]
    assert all(torch.equal(g, torch.zeros_like(g)) for g in got)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_gather_rows_matches_reference_every_dtype(dtype):
    gen = torch.Generator().manual_seed(2)
    for shape in [(11,), (11, 1), (11, 3), (11, 5, 7), (0, 3), (4, 0)]:
        src = _random(shape, dtype, gen)
        for num_out in (0, 1, 13):
            index = random_index(num_out, shape[0], gen)
            got = ops.gather_rows(src, index)
            assert got.dtype == dtype and got.shape == (num_out,) + shape[1:]
            want = _ref_gather(src, index)
            assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))


def test_gather_rows_strided_views():
    gen = torch.Generator().manual_seed(3)
    base = torch.randn(20, 9, generator=gen)
    index = random_index(15, 10, gen)
    for src in (base[::2], base[:10, 1:8], base.t()[:, :10].t(), base[:10].expand(10, 9)):
        assert torch.equal(ops.gather_rows(src, index), _ref_gather(src.contiguous(), index))


def test_scatter_rows_thread_cap_is_checked_and_moves_the_same_bytes():
    gen = torch.Generator().manual_seed(7)
    packed = torch.randint(0, 256, (9, 44), generator=gen, dtype=torch.uint8)
    row_source = random_index(15, 9, gen)
    want = ops.scatter_rows(packed, row_source, [0, 32], [32, 12])
    for cap in (1, 64, 256):
        got = ops.scatter_rows(packed, row_source, [0, 32], [32, 12], max_threads_per_row=cap)
        assert all(torch.equal(g, w) for g, w in zip(got, want))
    for bad in (0, 3, 512, -64, True, 64.0):
        with pytest.raises(ValueError, match="power of two in \\[1, 256\\]"):
            ops.scatter_rows(packed, row_source, [0, 32], [32, 12], max_threads_per_row=bad)


def test_gather_rows_gradient_sums_repeated_rows():
    gen = torch.Generator().manual_seed(4)
    src = torch.randn(6, 3, generator=gen, dtype=torch.float64, requires_grad=True)
    index = torch.tensor([2, -1, 2, 0, 5, 2], dtype=torch.int64)
    out = ops.gather_rows(src, index)
    grad_out = torch.randn(out.shape, generator=gen, dtype=torch.float64)
    out.backward(grad_out)
    want = torch.zeros(6, 3, dtype=torch.float64)
    for i, j in enumerate(index.tolist()):
        if j >= 0:
            want[j] += grad_out[i]
    assert torch.equal(src.grad, want)
    leaf = src.detach().requires_grad_()
    assert torch.autograd.gradcheck(lambda s: ops.gather_rows(s, index), (leaf,))


def test_bad_inputs_raise_before_any_work():
    packed = torch.zeros(4, 8, dtype=torch.uint8)
    idx = torch.zeros(3, dtype=torch.int64)
    with pytest.raises(ValueError, match="uint8"):
        ops.scatter_rows(packed.float(), idx, [0], [8])
    with pytest.raises(ValueError, match=r"\[4, 10\) of a 8-byte row"):
        ops.scatter_rows(packed, idx, [4], [6])
    with pytest.raises(ValueError, match="2 offsets but 1 widths"):
        ops.scatter_rows(packed, idx, [0, 1], [1])
    with pytest.raises(ValueError, match="int64"):
        ops.scatter_rows(packed, idx.int(), [0], [8])
    with pytest.raises(ValueError, match="1-D"):
        ops.gather_rows(packed, idx.view(3, 1))
    with pytest.raises(ValueError, match="0-d"):
        ops.gather_rows(torch.tensor(1.0), idx)
    with pytest.raises(TypeError):
        ops.gather_rows([1, 2], idx)


def test_opcheck_cpu():
    gen = torch.Generator().manual_seed(5)
    packed = torch.randint(0, 256, (8, 40), generator=gen, dtype=torch.uint8)
    row_source = random_index(12, 8, gen)
    torch.library.opcheck(
        torch.ops.megatron_cp.scatter_rows.default, (packed, row_source, [0, 32], [32, 6])
    )
    torch.library.opcheck(
        torch.ops.megatron_cp.scatter_rows.default,
        (packed, row_source, [0, 32], [32, 6]),
        {"max_threads_per_row": 32},
    )
    src = torch.randn(9, 4, generator=gen, requires_grad=True)
    index = random_index(7, 9, gen)
    torch.library.opcheck(torch.ops.megatron_cp.gather_rows.default, (src, index))
    torch.library.opcheck(
        torch.ops.megatron_cp.gather_rows.default,
        (torch.randint(0, 9, (9, 3), generator=gen), random_index(5, 9, gen)),
    )


def _unpack_and_pick(packed, row_source, local_index):
    hidden, tok = ops.scatter_rows(packed, row_source, [0, 16], [16, 4])
    full = hidden.view(torch.float32)
    return ops.gather_rows(full * 2.0, local_index), tok.view(torch.int32)


def test_ops_trace_under_torch_compile():
    gen = torch.Generator().manual_seed(6)
    packed = torch.randint(0, 256, (10, 24), generator=gen, dtype=torch.uint8)
    row_source = random_index(14, 10, gen)
    local_index = random_index(6, 14, gen)
    compiled = torch.compile(_unpack_and_pick, backend="aot_eager", fullgraph=True)
    for got, want in zip(
        compiled(packed, row_source, local_index), _unpack_and_pick(packed, row_source, local_index)
    ):
        assert torch.equal(got, want)


def test_extension_status_matches_this_install():
    """The real outcome in this environment (every outcome's logic: test_env.py).

    On a CPU torch nothing can load. On a CUDA torch a built extension must load: "broken"
    fails here, as it should, and so does a missing one when MCP_REQUIRE_EXTENSION is on (the
    import of ``ops`` would already have raised).
    """
    outcome, reason = _extension.status()
    assert ops.has_cuda_kernels() == (outcome == "loaded")
    if torch.version.cuda is None:
        assert (outcome, reason) == ("not built", "torch was built without CUDA")
    elif env_flag("MCP_DISABLE_EXTENSION"):
        assert (outcome, reason) == ("not built", "disabled by MCP_DISABLE_EXTENSION")
    elif importlib.util.find_spec("megatron.context_parallel._C") is None:
        assert outcome == "not built" and "without its CUDA extension" in reason
    else:
        assert outcome == "loaded", reason


@pytest.mark.skipif(ops.has_cuda_kernels(), reason="the compiled kernels replace the fallback")
def test_cuda_fallback_warns_once_and_moves_the_same_bytes(monkeypatch):
    """The functions registered for CUDA tensors when the kernels are missing, called directly
    (this machine may have no GPU): one warning for the process, the CPU results. The dispatch
    of real CUDA tensors to them is tested on a GPU (test_ops_cuda.py)."""
    monkeypatch.setattr(_extension, "_fallback_warned", False)
    gen = torch.Generator().manual_seed(8)
    packed = torch.randint(0, 256, (9, 37), generator=gen, dtype=torch.uint8)
    index = torch.tensor([3, -1, 8, 0, 0, 5])
    src = torch.randn(9, 7, generator=gen).bfloat16()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(3):
            rows = ops._scatter_rows_fallback(packed, index, [0, 32], [32, 5])
            picked = ops._gather_rows_fallback(src, index)
    assert len([w for w in caught if "torch indexing" in str(w.message)]) == 1
    want = ops.scatter_rows(packed, index, [0, 32], [32, 5])
    assert all(torch.equal(a, b) for a, b in zip(rows, want))
    assert torch.equal(picked, ops.gather_rows(src, index))
