"""What the examples share: launching ranks, megatron-core's process groups, a small GPTModel.

Launch: under ``torchrun`` (``RANK`` / ``WORLD_SIZE`` set) each process joins the job it was
started in. Started plainly, an example forks its own ranks on this machine. NCCL on one GPU
per rank when enough GPUs are visible, else gloo on the CPU (``--device cpu`` forces that).

CPU: megatron-core names CUDA outright in a few places the examples reach (rotary tables, the
pipeline schedules' token counter, the DDP grad buffer's stream, p2p shape exchange, tied
embeddings, the optimizers' flags). ``_cpu_shim`` makes each of those calls mean "the CPU" when
no GPU exists (see its docstring), and megatron's RNG tracker is put in its inference flavour,
whose forks touch no CUDA generator. The models here use no dropout. The package itself needs
none of this: it never calls CUDA on a CPU path.
"""

from __future__ import annotations

import argparse
import datetime
import logging
import multiprocessing
import os
import socket
import sys
import traceback
import warnings
from typing import Callable, Optional, Sequence

import torch
import torch.distributed as dist


def _quiet_third_party() -> None:
    """Hides megatron-core's "X is not installed, falling back" notices and deprecation chatter.

    They repeat once per rank, bury the table and ask for nothing the examples need.
    """
    warnings.filterwarnings("ignore", category=UserWarning, module=r"megatron\.core")
    warnings.filterwarnings("ignore", category=FutureWarning, message=r".*is deprecated")
    logging.getLogger("megatron.core").setLevel(logging.ERROR)


_quiet_third_party()

try:
    import megatron.context_parallel  # noqa: F401
except ImportError:
    # Run from a checkout that was not pip-installed: the package sits next to examples/.
    sys.path.append(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def add_launch_args(parser: argparse.ArgumentParser, default_world: int) -> None:
    group = parser.add_argument_group("launch")
    group.add_argument(
        "--device",
        choices=("auto", "cpu", "cuda"),
        default="auto",
        help="auto: one GPU per rank when enough are visible, else the CPU (gloo)",
    )
    group.add_argument(
        "--world-size",
        type=int,
        default=default_world,
        help="ranks to start when not launched by torchrun (default %(default)s)",
    )


def parse_ints(text: str) -> list:
    return [int(x) for x in text.split(",") if x.strip()]


# ----------------------------------------------------------------------------------- launch


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _use_cuda(device: str, local_world: int) -> bool:
    if device == "cpu":
        return False
    enough = torch.cuda.is_available() and torch.cuda.device_count() >= local_world
    if device == "cuda" and not enough:
        raise SystemExit(
            f"--device cuda needs {local_world} visible GPUs, found "
            f"{torch.cuda.device_count() if torch.cuda.is_available() else 0}"
        )
    return enough


class _NoStream:
    """Stands in for ``torch.cuda.current_stream()``: CPU work is already in order."""

    def wait_event(self, event) -> None:
        pass

    def wait_stream(self, stream) -> None:
        pass


def _on_cpu(factory):
    def factory_on_cpu(*args, **kwargs):
        device = kwargs.get("device")
        if device is not None and torch.device(device).type == "cuda":
            kwargs["device"] = "cpu"
        kwargs.pop("pin_memory", None)  # no pinned allocator without CUDA
        return factory(*args, **kwargs)

    return factory_on_cpu


def _cuda_type_names(type_of):
    def type_name(self, *args, **kwargs):
        name = type_of(self, *args, **kwargs)
        if args or kwargs or self.device.type != "cpu":
            return name
        return name.replace("torch.", "torch.cuda.", 1)

    return type_name


def _cpu_shim() -> None:
    """On a machine without CUDA, let megatron-core's CUDA-only calls run on the CPU.

    Each makes one hard-coded CUDA call mean the CPU, where every tensor of a gloo rank lives:
    ``torch.cuda.current_device()`` answers ``cpu``; ``torch.zeros / empty / ones / full /
    tensor(device="cuda")`` allocate on the CPU without pinning; ``Tensor.cuda()`` returns the
    tensor; ``torch.cuda.current_stream()`` is a stream whose waits do nothing and
    ``torch.cuda.synchronize()`` returns at once (gloo calls complete before they return);
    ``Tensor.type()`` names a CPU tensor as its CUDA twin, which megatron's distributed
    optimizer requires. The same shims as the tests' ``tests/_megatron_cpu.py`` (examples do
    not import tests), which says where megatron-core calls each; the package needs none.
    """
    if torch.cuda.is_available() or getattr(torch.cuda, "_mcp_cpu_shim", False):
        return
    torch.cuda._mcp_cpu_shim = True
    torch.cuda.current_device = lambda: torch.device("cpu")
    for name in ("zeros", "empty", "ones", "full", "tensor"):
        setattr(torch, name, _on_cpu(getattr(torch, name)))
    torch.Tensor.cuda = lambda self, *args, **kwargs: self
    torch.Tensor.type = _cuda_type_names(torch.Tensor.type)
    torch.cuda.current_stream = lambda *args, **kwargs: _NoStream()
    torch.cuda.synchronize = lambda *args, **kwargs: None


def _join(rank: int, world: int, local_rank: int, local_world: int, cuda: bool, init: str):
    """Initialises torch.distributed for this rank; returns the rank's device."""
    if cuda:
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    else:
        _cpu_shim()
        # Ranks share the cores: one thread each keeps them from oversubscribing.
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // local_world))
        device = torch.device("cpu")
    dist.init_process_group(
        "nccl" if cuda else "gloo",
        init_method=init,
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(minutes=5),
    )
    return device


def _spawned(rank, world, port, cuda, fn, args, errors):
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world))
    try:
        device = _join(rank, world, rank, world, cuda, f"tcp://127.0.0.1:{port}")
        fn(args, device)
    except SystemExit as exc:
        if exc.code not in (None, 0):
            errors.put((rank, f"exit code {exc.code}"))
    except BaseException:  # noqa: BLE001 - the parent reports every rank's failure
        errors.put((rank, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def launch(fn: Callable[[argparse.Namespace, torch.device], None], args) -> int:
    """Runs ``fn(args, device)`` on every rank; returns the process exit code.

    Under torchrun the current process is one rank. Otherwise ``args.world_size`` ranks are
    started here: forked on the CPU (they inherit the imports, which is much faster than a
    fresh interpreter each), spawned with one GPU each under NCCL. The examples import
    megatron-core inside their rank functions, so ``--help`` answers at once.
    """
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        local_world = int(os.environ.get("LOCAL_WORLD_SIZE", os.environ["WORLD_SIZE"]))
        local_rank = int(os.environ.get("LOCAL_RANK", 0))
        cuda = _use_cuda(args.device, local_world)
        device = _join(
            int(os.environ["RANK"]),
            int(os.environ["WORLD_SIZE"]),
            local_rank,
            local_world,
            cuda,
            "env://",
        )
        try:
            fn(args, device)
        finally:
            dist.destroy_process_group()
        return 0

    world = args.world_size
    cuda = _use_cuda(args.device, world)
    if not cuda:
        # Import megatron-core once here; the forked ranks inherit it instead of each paying
        # for the import on shared cores.
        import megatron.context_parallel.models.forward  # noqa: F401
    ctx = multiprocessing.get_context("spawn" if cuda else "fork")
    errors = ctx.Queue()
    port = _free_port()
    procs = [
        ctx.Process(target=_spawned, args=(r, world, port, cuda, fn, args, errors))
        for r in range(world)
    ]
    for p in procs:
        p.start()
    for p in procs:
        p.join()
    failed = []
    while not errors.empty():
        failed.append(errors.get())
    failed += [
        (r, f"died with exit code {p.exitcode}")
        for r, p in enumerate(procs)
        if p.exitcode not in (0, None) and r not in {f[0] for f in failed}
    ]
    for rank, text in sorted(failed):
        print(f"--- rank {rank} failed ---\n{text}", file=sys.stderr)
    return 1 if failed else 0


# ---------------------------------------------------------------------- megatron-core setup


def init_parallel(cp: int, tp: int = 1, pp: int = 1, vpp: Optional[int] = None) -> None:
    """(Re)builds megatron-core's process groups as TP x CP x DP x PP over the running world,
    with ``vpp`` virtual stages per pipeline rank when given."""
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import random as mrandom

    if ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()
    ps.initialize_model_parallel(
        tensor_model_parallel_size=tp,
        context_parallel_size=cp,
        pipeline_model_parallel_size=pp,
        virtual_pipeline_model_parallel_size=vpp,
    )
    mrandom.initialize_rng_tracker(inference_rng_tracker=True, force_reset=True)


# Presets: a CPU run has to finish in seconds on two cores; a GPU run should be big enough to time.
SIZES = {
    "tiny": dict(layers=2, hidden=64, heads=4, vocab=128, seq_lens="64,80,56"),
    "medium": dict(layers=4, hidden=1024, heads=16, vocab=32768, seq_lens="2048,4096,1024,1024"),
}


def add_model_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("model and batch (a GPTModel, fp32, rotary, no dropout)")
    group.add_argument(
        "--size",
        choices=("auto", *SIZES),
        default="auto",
        help="preset for the options below that are not given; auto: tiny on CPU, medium on GPU",
    )
    group.add_argument("--layers", type=int)
    group.add_argument("--hidden", type=int)
    group.add_argument("--heads", type=int)
    group.add_argument("--vocab", type=int)
    group.add_argument("--seq-lens", help="comma-separated lengths of the packed sequences")
    group.add_argument("--seed", type=int, default=1234, help="weights and data seed")


def resolve_size(args, device: torch.device) -> list:
    """Fills the model options left unset from the preset; returns the sequence lengths."""
    name = args.size if args.size != "auto" else ("medium" if device.type == "cuda" else "tiny")
    for key in ("layers", "hidden", "heads", "vocab"):
        if getattr(args, key) is None:
            setattr(args, key, SIZES[name][key])
    if args.seq_lens is None:
        args.seq_lens = SIZES[name]["seq_lens"]
    return parse_ints(args.seq_lens)


# TransformerConfig settings of the examples' models: fp32, built on the CPU RNG (the same
# weights at every parallel size), no fused kernels (none exist on a CPU) and no dropout (so a
# CP run can be compared with CP 1 number for number).
PLAIN_FP32_CONFIG = dict(
    use_cpu_initialization=True,
    params_dtype=torch.float32,
    bias_dropout_fusion=False,
    masked_softmax_fusion=False,
    gradient_accumulation_fusion=False,
    apply_rope_fusion=False,
    attention_dropout=0.0,
    hidden_dropout=0.0,
)


def build_gpt(args, device: torch.device, max_seq_len: int):
    """A GPTModel whose weights depend only on ``args.seed``, not on the parallel layout.

    Weights are made on the CPU from the seeded CPU generator (``use_cpu_initialization``), so
    every rank and every CP size gets the same model, then moved to ``device``. The layers use
    ``ContextParallelAttention`` (any plan; dense on CPU), so no TransformerEngine is needed.
    """
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.transformer.transformer_config import TransformerConfig

    from megatron.context_parallel.attention.layers import get_gpt_layer_with_context_parallel_spec

    config = TransformerConfig(
        num_layers=args.layers,
        hidden_size=args.hidden,
        num_attention_heads=args.heads,
        tensor_model_parallel_size=ps.get_tensor_model_parallel_world_size(),
        context_parallel_size=ps.get_context_parallel_world_size(),
        **PLAIN_FP32_CONFIG,
    )
    torch.manual_seed(args.seed)
    model = GPTModel(
        config,
        get_gpt_layer_with_context_parallel_spec(),
        vocab_size=args.vocab,
        max_sequence_length=max_seq_len,
        position_embedding_type="rope",
    )
    return model.to(device)


# ------------------------------------------------------------------------------------ output


def plot_loss_curves(
    path: str,
    reference,
    losses,
    *,
    reference_label: str,
    label: str,
    ylabel: str,
    title: str,
    xlabel: str,
) -> None:
    """Both loss curves on top, their absolute difference on a log scale below (PNG)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = list(range(1, len(reference) + 1))
    diffs = [max(abs(a - b), 1e-12) for a, b in zip(reference, losses)]
    fig, (top, bottom) = plt.subplots(
        2, 1, figsize=(7, 6), sharex=True, gridspec_kw={"height_ratios": [3, 1]}
    )
    top.plot(steps, reference, "-", lw=2.5, color="#9ecae1", label=reference_label)
    top.plot(steps, losses, "o--", ms=3, color="#08519c", label=label)
    top.set_ylabel(ylabel)
    top.set_title(title)
    top.legend()
    top.grid(alpha=0.3)
    bottom.semilogy(steps, diffs, ".-", color="#cb181d")
    bottom.set_xlabel(xlabel)
    bottom.set_ylabel("|difference|\n(0 shown as 1e-12)")
    bottom.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def is_rank0() -> bool:
    return not dist.is_initialized() or dist.get_rank() == 0


def say(*parts, file=None) -> None:
    """print on global rank 0 only, flushed (ranks' output would interleave otherwise)."""
    if is_rank0():
        print(*parts, file=file or sys.stdout, flush=True)


def progress(steps: int, label: str):
    """tqdm over ``range(steps)``, drawn on rank 0's stderr (disabled on the other ranks).

    tqdm is a development requirement (requirements-dev.txt), imported here so that the
    examples that draw no bar (cp_probe, gather_demo) run without it.
    """
    try:
        from tqdm import tqdm
    except ImportError as exc:
        raise ImportError(
            "the training examples draw their progress with tqdm: pip install tqdm"
        ) from exc
    return tqdm(range(steps), desc=label, file=sys.stderr, disable=not is_rank0(), mininterval=0)


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def all_max(values: Sequence[float], device: torch.device) -> list:
    """Element-wise max of a list of floats over all ranks (NaN-safe: NaN wins)."""
    t = torch.tensor([float(v) for v in values], dtype=torch.float64, device=device)
    nan = torch.isnan(t).to(torch.float64)
    dist.all_reduce(nan, op=dist.ReduceOp.MAX)
    dist.all_reduce(t.nan_to_num_(nan=0.0), op=dist.ReduceOp.MAX)
    return [float("nan") if n else v for n, v in zip(nan.tolist(), t.tolist())]


def nanmax(values: Sequence[float]) -> float:
    """max() that returns NaN when any value is NaN (plain max() may skip it)."""
    values = list(values)
    if any(v != v for v in values):
        return float("nan")
    return max(values) if values else 0.0


def optional_path(value: Optional[str]) -> Optional[str]:
    return os.path.abspath(value) if value else None
