"""The Gated DeltaNet layer under a ``PrefixTree`` on CUDA (fla) equals its torch path on the CPU.

On CUDA the tree's gated delta rule is one fla varlen call per tree depth, each segment starting
from its parent's final state gathered from the previous depth's call, and the convolution is
fla's over the gathered ``[tail ++ segment]`` rows; on the CPU the layer runs megatron-core's
torch rule segment by segment and a torch convolution (``test_gdn_tree`` checks that path
against the flat layer on every root-to-leaf path). Two gloo ranks share the GPU (spawned: CUDA
does not survive a fork); at CP 1 and 2, with a random plan and ``tree_plan``'s, the bf16 CUDA
layer and the fp32 CPU layer (the same bf16-rounded parameters and inputs) must agree within
bf16's tolerance: outputs, input gradients and summed parameter gradients within 3e-2 of their
own scale. Segments of 65 to 150 rows cross fla's 64-row chunks; one-token segments sit between.

fla 0.6.0 refuses its gated backward on Hopper with Triton < 3.7.1 (its issue 640); there the
gradients are compared only with ``MCP_LIFT_FLA_HOPPER_GUARD=1`` (as ``test_gdn_cuda``), and the
outputs always.
"""

from __future__ import annotations

import pytest
import torch
from _dist import run_distributed

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]
pytest.importorskip("fla", reason="fla's kernels are the CUDA path")

# Head sizes fla's kernels tile well; heads divide by 2.
SHAPE = dict(key_heads=4, value_heads=8, key_dim=32, value_dim=32, kernel=4)
BF16_TOL = 3e-2
# The hand tree of test_gdn_tree with longer segments: depth 3, several roots, a root without
# children, one-token segments (short parents whose children's tails reach further up).
TREE = ((-1, 0, 1, 1, 2, 0, -1, -1, 7, 8, 7), (150, 1, 70, 2, 1, 130, 90, 1, 65, 3, 40))


def _fla_backward_allowed() -> bool:
    import fla.ops.common.chunk_o as chunk_o

    return not (
        chunk_o.IS_NVIDIA_HOPPER and chunk_o.TRITON_ABOVE_3_4_0 and not chunk_o.TRITON_ABOVE_3_7_1
    )


def _error(got, want) -> float:
    if want.numel() == 0:
        return 0.0
    return (got - want).abs().max().item() / (1.0 + want.abs().max().item())


def _world(rank, world_size):
    import os

    import _megatron_cpu as mc
    from megatron.core import parallel_state as ps

    from megatron.context_parallel.tree import PrefixTree
    from mixers import test_gdn_tree as t

    if os.environ.get("MCP_LIFT_FLA_HOPPER_GUARD") == "1":
        import fla.ops.common.chunk_o as chunk_o

        chunk_o.TRITON_ABOVE_3_7_1 = True
    backward = _fla_backward_allowed()

    mc.init_parallel(1, world_size)
    group = ps.get_context_parallel_group()
    gpu = t.build_layer(world_size, SHAPE).to("cuda", torch.bfloat16)
    cpu = t.build_layer(world_size, SHAPE).cpu()
    with torch.no_grad():
        for p, q in zip(cpu.parameters(), gpu.parameters()):
            p.copy_(q.float().cpu())
    tree = PrefixTree(*TREE)
    failures = []
    for kind, seed in (("random", 1), ("tree_plan", 2)):
        plan = t._plan(tree, world_size, seed, kind)
        x, weights = t.batch(tree.seq_len, seed)
        x = x.bfloat16()
        got = t.run_tree(gpu, tree, plan, rank, group, x, weights, "cuda", backward)
        want = t.run_tree(cpu, tree, plan, rank, group, x.float(), weights, "cpu", backward)
        errors = {"out": _error(got[0], want[0])}
        if backward:
            errors["dx"] = _error(got[1], want[1])
            for param, g in want[2].items():
                errors[f"grad {param}"] = _error(got[2][param], g)
        name = f"{kind} cp{world_size} rank {rank}"
        failures += [f"{name} {k}: {v:.3g}" for k, v in errors.items() if not v <= BF16_TOL]
        print(name, "backward" if backward else "forward only", errors)
    return failures


@pytest.mark.parametrize("cp", [1, 2])
def test_gdn_tree_on_cuda_with_fla_equals_the_torch_path(cp):
    failures = sum(run_distributed(_world, cp, start_method="spawn", timeout=600), [])
    assert not failures, "\n".join(failures)
