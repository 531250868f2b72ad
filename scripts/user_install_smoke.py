"""What a user does first after ``pip install .``: import the package and run it, on a CPU.

Run by ``scripts/check_user_install.sh`` with the fresh venv's interpreter, from outside the
source tree, so the installed copy is what imports. Checks, each a failure when wrong:

1. ``megatron.context_parallel`` imports from the venv's site-packages (not the checkout), with
   the distribution's metadata (version, ``Requires-Python``) and megatron-core >= 0.19.2.
2. A one-rank gather of a shuffled shard lands every row at its source position (exact).
3. A tiny megatron-core ``GPTModel`` under ``get_gpt_layer_with_context_parallel_spec`` runs
   ``context_parallel_forward`` and a backward on gloo ranks at CP 1 and CP 2 (forked, 127.0.0.1),
   and the CP 2 outputs equal the CP 1 ones.
4. With ``--attention``: the ``attention`` extra's cuDNN frontend imports and loads cuDNN.

Usage: python user_install_smoke.py [--attention]
"""

from __future__ import annotations

import argparse
import importlib.metadata
import os
import socket
import sys
import sysconfig
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

VOCAB, HIDDEN, SEQ = 128, 64, 24


def _check_install() -> None:
    import megatron.context_parallel as mcp

    site = os.path.realpath(sysconfig.get_paths()["purelib"])
    where = os.path.realpath(mcp.__file__)
    assert where.startswith(site + os.sep), f"imported from {where}, not from {site}"
    dist_meta = importlib.metadata.metadata("megatron-context-parallel")
    assert dist_meta["Version"] == mcp.__version__, (dist_meta["Version"], mcp.__version__)
    assert dist_meta["Requires-Python"] == ">=3.12", dist_meta["Requires-Python"]
    core = importlib.metadata.version("megatron-core")
    assert tuple(int(p) for p in core.split(".")[:3]) >= (0, 19, 2), core
    print(
        f"  package {mcp.__version__} from {os.path.dirname(where)}; python "
        f"{sys.version.split()[0]}, torch {torch.__version__}, megatron-core {core}"
    )


def _check_gather() -> None:
    from megatron.context_parallel import ContextParallelPlan, gather_from_context_parallel_region

    positions = [4, 0, 3, 1, 2]
    plan = ContextParallelPlan.from_rank_positions([positions], seq_len=5)
    shard = torch.arange(10, dtype=torch.float32).view(5, 2)
    out = gather_from_context_parallel_region(shard, plan)
    want = torch.empty_like(shard)
    want[positions] = shard
    assert torch.equal(out, want), (out, want)
    print("  one-rank gather: exact")


def _model_run(rank: int, world: int, port: int, outdir: str) -> None:
    from megatron.core import parallel_state
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.transformer.transformer_config import TransformerConfig

    from megatron.context_parallel import (
        context_parallel_forward,
        get_gpt_layer_with_context_parallel_spec,
    )

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world
    )
    try:
        parallel_state.initialize_model_parallel(context_parallel_size=world)
        config = TransformerConfig(
            num_layers=2,
            hidden_size=HIDDEN,
            num_attention_heads=4,
            context_parallel_size=world,
            use_cpu_initialization=True,
            attention_dropout=0.0,
            hidden_dropout=0.0,
        )
        torch.manual_seed(0)
        model = GPTModel(config, get_gpt_layer_with_context_parallel_spec(), VOCAB, 64, "rope")
        ids = torch.randint(0, VOCAB, (SEQ,), generator=torch.Generator().manual_seed(1))
        labels = ids.roll(-1)
        labels[[9, SEQ - 1]] = -100  # two packed sequences: [0, 10) and [10, SEQ)
        out = context_parallel_forward(
            model,
            ids,
            labels,
            cu_seqlens=[0, 10, SEQ],
            fields=("hidden_states", "target_logprobs"),
        )
        assert out.hidden_states.shape == (SEQ, HIDDEN), out.hidden_states.shape
        loss = -out.target_logprobs.sum()
        loss.backward()
        assert all(p.grad is not None for p in model.parameters() if p.requires_grad)
        if rank == 0:
            torch.save(
                {"hidden": out.hidden_states.detach(), "logprobs": out.target_logprobs.detach()},
                os.path.join(outdir, f"cp{world}.pt"),
            )
        parallel_state.destroy_model_parallel()
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _check_model() -> None:
    with tempfile.TemporaryDirectory() as outdir:
        for world in (1, 2):
            mp.start_processes(
                _model_run,
                args=(world, _free_port(), outdir),
                nprocs=world,
                start_method="fork",
            )
        one = torch.load(os.path.join(outdir, "cp1.pt"))
        two = torch.load(os.path.join(outdir, "cp2.pt"))
    for key in one:
        torch.testing.assert_close(two[key], one[key], rtol=1e-5, atol=1e-5)
    print("  GPTModel forward + backward at CP 1 and CP 2 on gloo: CP 2 outputs equal CP 1's")


def _check_attention_extra() -> None:
    from megatron.context_parallel.attention import cudnn as backend

    frontend = backend._cudnn()
    assert frontend is not None, "the cuDNN frontend does not import, or cuDNN does not load"
    version = frontend.backend_version()
    print(f"  attention extra: cuDNN frontend {frontend.__version__}, cuDNN {version}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--attention", action="store_true", help="check the attention extra")
    args = parser.parse_args()
    checks = [_check_install, _check_gather, _check_model]
    if args.attention:
        checks.append(_check_attention_extra)
    for check in checks:
        check()
    print("user install smoke: OK")
    return 0


if __name__ == "__main__":
    sys.exit(main())
