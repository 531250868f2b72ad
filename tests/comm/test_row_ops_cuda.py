"""GPU tests of the megatron_cp row kernels: exact equality with the CPU implementation.

Skipped without CUDA. Without the compiled extension ``test_kernels_are_loaded`` fails and the
others run against the torch fallback (with ``MCP_REQUIRE_EXTENSION=1`` the import fails).
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist
from _dist import run_distributed
from _rows import DTYPES, random_index

from megatron.context_parallel.comm import row_ops as ops
from megatron.context_parallel.comm.mappings import gather_from_context_parallel_region
from megatron.context_parallel.comm.plan import ContextParallelPlan

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


POISON = 0xA5


def _poison_allocator(nbytes=64 << 20):
    """Fills freed cache blocks with a pattern, so an output row the kernel skips shows up."""
    blob = torch.full((nbytes,), POISON, dtype=torch.uint8, device="cuda")
    del blob
    small = [
        torch.full((n,), POISON, dtype=torch.uint8, device="cuda") for n in (512, 4096, 1 << 16)
    ]
    del small


def _random_bytes(shape, gen):
    return torch.randint(0, 256, shape, generator=gen, dtype=torch.uint8)


def _random_src(shape, dtype, gen):
    # Random bytes reinterpreted: every bit pattern (NaNs included) must move unchanged, and
    # torch.equal on the uint8 view compares bits, not values.
    width = int(torch.tensor(shape[1:]).prod().item()) if len(shape) > 1 else 1
    elem = torch.empty((), dtype=dtype).element_size()
    if width == 0 or shape[0] == 0:
        return torch.empty(shape, dtype=dtype)
    raw = _random_bytes((shape[0], width * elem), gen)
    if dtype == torch.bool:
        raw = raw & 1
    return raw.view(dtype).reshape(shape)


def _bits(t):
    return t.contiguous().reshape(-1).view(torch.uint8)


def _same_bits(a, b):
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(_bits(a.cpu()), _bits(b.cpu()))


def test_kernels_are_loaded():
    assert ops.has_cuda_kernels(), "the compiled extension did not load (see _extension.status())"


def test_scatter_rows_equals_cpu_for_random_layouts():
    gen = torch.Generator().manual_seed(10)
    layouts = [
        [10240, 4, 80, 160],  # hidden bf16 5120, logprob fp32, top-k 20 fp32 and int64
        [160, 80, 16, 4],  # packer order: 16-byte multiples first
        [48, 6, 2, 1],
        [3, 5, 7, 9, 11],
        [2],
        [1],
        [0, 32],
        [16] * 20,  # more fields than one launch takes
    ]
    for widths in layouts:
        for lead in (0, 1, 3):  # a leading byte misaligns every field
            offsets = [lead + sum(widths[:f]) for f in range(len(widths))]
            row_bytes = lead + sum(widths) + 5
            for slots, num_out in ((37, 50), (1, 3), (5, 0), (0, 6)):
                packed = _random_bytes((slots, row_bytes), gen)
                row_source = random_index(num_out, slots, gen)
                want = ops.scatter_rows(packed, row_source, offsets, widths)
                _poison_allocator()
                got = ops.scatter_rows(packed.cuda(), row_source.cuda(), offsets, widths)
                torch.cuda.synchronize()
                assert len(got) == len(want)
                for g, w in zip(got, want):
                    assert g.is_cuda and torch.equal(g.cpu(), w), (widths, lead, slots, num_out)


def test_every_thread_cap_moves_the_same_bytes():
    """The tuning knob changes how threads share a row, never which bytes land where."""
    gen = torch.Generator().manual_seed(19)
    for widths in ([10240, 4, 80, 160], [3, 5, 7], [1], [48, 6, 2, 1]):
        offsets = [1 + sum(widths[:f]) for f in range(len(widths))]
        packed = _random_bytes((29, 1 + sum(widths) + 3), gen)
        row_source = random_index(45, 29, gen)
        want = ops.scatter_rows(packed, row_source, offsets, widths)
        for cap in (1, 2, 4, 8, 16, 32, 64, 128, 256):
            _poison_allocator()
            got = ops.scatter_rows(
                packed.cuda(), row_source.cuda(), offsets, widths, max_threads_per_row=cap
            )
            assert all(torch.equal(g.cpu(), w) for g, w in zip(got, want)), (widths, cap)


@pytest.mark.skipif(not ops.has_cuda_kernels(), reason="the torch fallback has no thread cap")
def test_bad_thread_cap_raises_in_the_binding_too():
    packed = torch.zeros(4, 8, dtype=torch.uint8, device="cuda")
    index = torch.zeros(2, dtype=torch.int64, device="cuda")
    for bad in (0, 3, 512):
        with pytest.raises(RuntimeError, match="power of two in \\[1, 256\\]"):
            torch.ops.megatron_cp.scatter_rows(packed, index, [0], [8], max_threads_per_row=bad)


def test_scatter_rows_column_slice_of_wider_buffer():
    gen = torch.Generator().manual_seed(11)
    wide = _random_bytes((64, 1000), gen)
    row_source = random_index(300, 64, gen)
    for start, stop in ((16, 528), (1, 514), (8, 1000)):
        view = wide[:, start:stop]
        widths = [stop - start - 2, 2]
        want = ops.scatter_rows(view, row_source, [0, widths[0]], widths)
        got = ops.scatter_rows(
            wide.cuda()[:, start:stop], row_source.cuda(), [0, widths[0]], widths
        )
        assert all(torch.equal(g.cpu(), w) for g, w in zip(got, want))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_gather_rows_equals_cpu_every_dtype(dtype):
    gen = torch.Generator().manual_seed(12)
    for shape in [(33,), (33, 1), (33, 3), (33, 5, 7), (33, 5120), (0, 4), (6, 0)]:
        src = _random_src(shape, dtype, gen)
        for num_out in (0, 1, 70):
            index = random_index(num_out, shape[0], gen)
            want = ops.gather_rows(src, index)
            _poison_allocator()
            got = ops.gather_rows(src.cuda(), index.cuda())
            assert _same_bits(got, want), (dtype, shape, num_out)


def test_gather_rows_misaligned_and_strided_views():
    gen = torch.Generator().manual_seed(13)
    base = _random_src((40, 131), torch.bfloat16, gen)
    index = random_index(90, 20, gen)
    cases = [
        lambda b: b[1:21],  # 262-byte rows starting 2 bytes past the allocation
        lambda b: b[::2],  # row stride twice the row
        lambda b: b[:20, 3:100],  # column slice: copied dense first
        lambda b: b.view(-1)[1 : 1 + 20 * 130].view(20, 130),  # odd element offset
    ]
    for make in cases:
        want = ops.gather_rows(make(base), index)
        got = ops.gather_rows(make(base.cuda()), index.cuda())
        assert _same_bits(got, want)


def test_gather_rows_gradient_on_cuda():
    gen = torch.Generator().manual_seed(14)
    src = torch.randn(50, 24, generator=gen)
    index = random_index(80, 50, gen)
    grad = torch.randn(80, 24, generator=gen)
    grads = []
    for device in ("cpu", "cuda"):
        s = src.to(device).detach().clone().requires_grad_()
        ops.gather_rows(s, index.to(device)).backward(grad.to(device))
        grads.append(s.grad.cpu())
    # Repeated indices sum in a different order on the GPU: compare with a tolerance.
    torch.testing.assert_close(grads[1], grads[0])


def test_offsets_past_2_31_bytes():
    free, _ = torch.cuda.mem_get_info()
    if free < (8 << 30):
        pytest.skip("needs 8 GiB of free GPU memory")
    gen = torch.Generator().manual_seed(15)
    row_bytes = 4160  # 16-byte multiple: the vector path
    slots = (2**31 // row_bytes) + 4096  # the last rows start past 2^31 bytes
    packed = torch.empty((slots, row_bytes), dtype=torch.uint8, device="cuda")
    packed[-4096:].copy_(_random_bytes((4096, row_bytes), gen).cuda())
    packed[:4096].copy_(_random_bytes((4096, row_bytes), gen).cuda())
    row_source = torch.cat(
        [torch.arange(slots - 4096, slots), torch.arange(0, 4096), torch.tensor([-1])]
    )
    row_source = row_source[torch.randperm(row_source.numel(), generator=gen)].cuda()
    got = ops.scatter_rows(packed, row_source, [0, 4096, 4100], [4096, 4, 60])
    want = torch.cat(got, dim=1)
    ref = packed.index_select(0, row_source.clamp(min=0))[:, :4160]
    ref[row_source < 0] = 0
    assert torch.equal(want, ref)
    out = ops.gather_rows(packed.view(slots, -1)[:, :4160], row_source)
    assert torch.equal(out, ref)


def test_opcheck_cuda():
    gen = torch.Generator().manual_seed(16)
    packed = _random_bytes((8, 40), gen).cuda()
    row_source = random_index(12, 8, gen).cuda()
    torch.library.opcheck(
        torch.ops.megatron_cp.scatter_rows.default, (packed, row_source, [0, 32], [32, 6])
    )
    src = torch.randn(9, 4, generator=gen).cuda().requires_grad_()
    index = random_index(7, 9, gen).cuda()
    torch.library.opcheck(torch.ops.megatron_cp.gather_rows.default, (src, index))


def test_scatter_rows_in_cuda_graph():
    gen = torch.Generator().manual_seed(17)
    slots, row_bytes, seq = 64, 10240 + 4, 100
    packed = torch.empty((slots, row_bytes), dtype=torch.uint8, device="cuda")
    row_source = torch.empty(seq, dtype=torch.int64, device="cuda")
    packed.copy_(_random_bytes((slots, row_bytes), gen))
    row_source.copy_(random_index(seq, slots, gen))
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):  # warm-up outside the graph (allocator, lazy init)
            ops.scatter_rows(packed, row_source, [0, 10240], [10240, 4])
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = ops.scatter_rows(packed, row_source, [0, 10240], [10240, 4])
    for _ in range(3):
        new_packed = _random_bytes((slots, row_bytes), gen)
        new_index = random_index(seq, slots, gen)
        packed.copy_(new_packed)
        row_source.copy_(new_index)
        graph.replay()
        want = ops.scatter_rows(new_packed, new_index, [0, 10240], [10240, 4])
        torch.cuda.synchronize()
        assert all(torch.equal(o.cpu(), w) for o, w in zip(outs, want))


def _unpack_scale_pick(packed, row_source, local_index):
    hidden, tok = ops.scatter_rows(packed, row_source, [0, 64], [64, 4])
    full = hidden.view(torch.bfloat16).float() * 2.0
    return ops.gather_rows(full, local_index), tok.view(torch.int32) + 1


def test_ops_under_torch_compile_cuda():
    gen = torch.Generator().manual_seed(18)
    packed = _random_bytes((30, 72), gen)
    packed[:, :64] = torch.randn(30, 32, generator=gen).bfloat16().view(torch.uint8)
    row_source = random_index(40, 30, gen)
    local_index = random_index(25, 40, gen)
    args = [t.cuda() for t in (packed, row_source, local_index)]
    compiled = torch.compile(_unpack_scale_pick, fullgraph=True)
    for got, want in zip(compiled(*args), _unpack_scale_pick(*args)):
        assert torch.equal(got, want)


_FALLBACK_SCRIPT = """
import warnings
import torch
from megatron.context_parallel.comm import row_ops as ops
assert not ops.has_cuda_kernels()
g = torch.Generator().manual_seed(0)
packed = torch.randint(0, 256, (9, 37), generator=g, dtype=torch.uint8)
idx = torch.tensor([3, -1, 8, 0, 0, 5])
src = torch.randn(9, 7, generator=g).bfloat16()
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    for _ in range(3):
        got = ops.scatter_rows(packed.cuda(), idx.cuda(), [0, 32], [32, 5])
        rows = ops.gather_rows(src.cuda(), idx.cuda())
mine = [w for w in caught if "torch indexing" in str(w.message)]
assert len(mine) == 1, [str(w.message) for w in caught]
want = ops.scatter_rows(packed, idx, [0, 32], [32, 5])
assert all(torch.equal(a.cpu(), b) for a, b in zip(got, want))
assert torch.equal(rows.cpu(), ops.gather_rows(src, idx))
print("FALLBACK-OK")
"""


def _run_child(script: str, env: dict) -> subprocess.CompletedProcess:
    """``script`` in a fresh Python with this checkout first on its path."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = dict(env, PYTHONPATH=root + os.pathsep + env.get("PYTHONPATH", ""))
    return subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120
    )


def test_cuda_without_extension_falls_back_with_one_warning():
    env = {k: v for k, v in os.environ.items() if k != "MCP_REQUIRE_EXTENSION"}
    env["MCP_DISABLE_EXTENSION"] = "1"
    proc = _run_child(_FALLBACK_SCRIPT, env)
    assert proc.returncode == 0 and "FALLBACK-OK" in proc.stdout, proc.stderr[-4000:]


# Failing TORCH_CHECKs that format integers, dtypes and sizes into their messages: with a
# static C++ runtime in the extension these crashed the process (SIGSEGV) instead of raising.
_BAD_CALLS_SCRIPT = """
import torch
from megatron.context_parallel.comm import row_ops as ops

assert ops.has_cuda_kernels()
packed = torch.zeros(4, 8, device="cuda")
index = torch.zeros(2, dtype=torch.int64, device="cuda")
calls = {
    "float packed": lambda: torch.ops.megatron_cp.scatter_rows(packed, index, [0], [32]),
    "int32 index": lambda: torch.ops.megatron_cp.gather_rows(packed, index.int()),
    "offsets": lambda: torch.ops.megatron_cp.scatter_rows(
        packed.byte(), index, [0, 8], [8]
    ),
}
for name, call in calls.items():
    try:
        call()
        print(name, "did not raise")
    except RuntimeError as exc:
        print(name, "RuntimeError:", str(exc).splitlines()[0])
print("BAD-CALLS-DONE")
"""


@pytest.mark.skipif(not ops.has_cuda_kernels(), reason="checks the compiled extension")
def test_bad_calls_into_the_extension_raise_runtime_error():
    """In a child process, so a crash fails this test (with its signal) instead of the run."""
    proc = _run_child(_BAD_CALLS_SCRIPT, dict(os.environ))
    report = f"exit {proc.returncode}\n{proc.stdout}\n{proc.stderr[-3000:]}"
    assert proc.returncode == 0 and "BAD-CALLS-DONE" in proc.stdout, report
    assert "float packed RuntimeError: scatter_rows: packed must be uint8" in proc.stdout, report
    assert "int32 index RuntimeError: gather_rows: index must be int64" in proc.stdout, report
    assert "offsets RuntimeError: scatter_rows: 2 offsets but 1 widths" in proc.stdout, report


@pytest.mark.skipif(not ops.has_cuda_kernels(), reason="checks the compiled extension")
def test_extension_links_the_shared_cpp_runtime():
    from megatron.context_parallel import _C
    from megatron.context_parallel._linkage import needed_libraries

    assert any(n.startswith("libstdc++.so") for n in needed_libraries(_C.__file__))


def _fields_for(plan, seed):
    gen = torch.Generator().manual_seed(seed)
    s = plan.seq_len
    return {
        "hidden": torch.randn(s, 3, 256, generator=gen).bfloat16(),
        "logp": torch.randn(s, generator=gen),
        "topk_val": torch.randn(s, 20, generator=gen),
        "topk_idx": torch.randint(0, 151936, (s, 20), generator=gen),
        "odd": torch.randint(-100, 100, (s, 3), generator=gen).to(torch.int16),
    }


def _gather_cuda_equals_cpu(rank, world):
    torch.cuda.set_device(0)
    gen = torch.Generator().manual_seed(99)
    perm = torch.randperm(1003, generator=gen)
    cuts = sorted(torch.randint(0, 1000, (world - 1,), generator=gen).tolist())
    bounds = [0] + cuts + [1000]  # uneven shards; positions 1000..1002 owned by nobody
    uneven = ContextParallelPlan.from_rank_positions(
        [perm[bounds[r] : bounds[r + 1]].tolist() for r in range(world)], seq_len=1003
    )
    for plan in (ContextParallelPlan.zigzag(8 * world * 13, world), uneven):
        full = _fields_for(plan, seed=plan.seq_len)
        pos = plan.local_positions(rank)
        local_cpu = {k: v[pos] for k, v in full.items()}
        out_cpu = gather_from_context_parallel_region(local_cpu, plan, group=dist.group.WORLD)
        local_gpu = {k: v.cuda() for k, v in local_cpu.items()}
        local_gpu["hidden"].requires_grad_()
        out_gpu = gather_from_context_parallel_region(local_gpu, plan, group=dist.group.WORLD)
        owned = plan.row_source() >= 0
        for k in full:
            assert out_gpu[k].is_cuda
            assert torch.equal(out_gpu[k].detach().cpu(), out_cpu[k]), k
            want = full[k].clone()
            want[~owned] = 0
            assert torch.equal(out_cpu[k], want), k
        weight = torch.randn(out_gpu["hidden"].shape, generator=gen).bfloat16()
        (out_gpu["hidden"].float() * weight.cuda().float()).sum().backward()
        grad = local_gpu["hidden"].grad.cpu()
        assert torch.equal(grad, weight[pos]), "default backward: own rows of the grad"


def test_full_gather_on_cuda_equals_cpu_with_gloo_ranks():
    """4 gloo ranks sharing the one GPU: the gather of CUDA tensors equals the CPU gather.

    Spawned, not forked: this process has used CUDA, and a forked child cannot.
    """
    run_distributed(_gather_cuda_equals_cpu, 4, start_method="spawn", timeout=300)
