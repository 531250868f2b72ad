"""Benchmark the source-order CP gather against the gathers peers write, and against the floor.

Every approach turns each CP rank's shard of per-position outputs into full-sequence tensors in
source order on every rank. Each is run on every rank of the CP group and checked equal
(``torch.equal``) both to ours and to the full tensors the shards were cut from, before anything
is timed.

* ``floor``: one all-gather (``groups.all_gather_into``, the primitive ours uses) of the padded
  payload (every field of a row packed as bytes, ``cp * max_count`` rows), both buffers
  allocated beforehand. Communication only:
  nothing is put in source order, so no source-order gather can beat it.
* ``ours``: ``megatron.context_parallel.comm.mappings.gather_from_context_parallel_region``: the
  small exchange of every rank's verdict on its input, one data collective for all fields, then
  one row scatter into source order.
* ``(a) zero+index_copy+all_reduce``: mimics OpenPipe/ART pull request #912 ("Return full
  source-order context-parallel trainer outputs", ``src/art/megatron/trainer_rank.py``): per
  output field and per packed sequence, a zeroed full-length tensor, this rank's rows written at
  their source positions with ``index_copy_``, then ``all_reduce(SUM)`` over the CP group.
* ``(b) all_gather+cat+index_select``: mimics NVIDIA/Megatron-LM ``megatron/rl/rl_utils.py``
  (``get_logprobs`` with ``_build_cp_scatter_cache``): per field,
  ``torch.distributed.nn.functional.all_gather`` into a list, ``torch.cat``, then
  ``index_select`` by the inverse (``argsort``) of the rank-major position permutation, cached
  per layout.
* ``(c) list all_gather+Python un-zigzag``: mimics volcengine/verl ``verl/models/mcore/util.py``
  (``postprocess_packed_seqs``): per field, ``dist.all_gather`` into a list, a zeroed output,
  then a Python loop over sequences and ranks that copies each rank's two zigzag half-chunks
  into a per-sequence buffer and the buffer into the output. verl writes the buffer through a
  padding mask of a ``[batch, max_len]`` layout; our outputs are flat, so it is a slice copy.

All implementations here are written for this benchmark; none is copied from those projects.

Layout: every packed sequence is split as TransformerEngine's THD context parallelism does
(``ContextParallelPlan.thd``: ``2 * cp`` chunks, rank ``r`` holds chunks ``r`` and
``2cp-1-r``), the layout (b) and (c) are written for. Sequence lengths are rounded up to a
multiple of ``2 * cp`` as megatron-core requires (20,436 rows stay 20,436 at CP 2 and become
20,440 at CP 4), so every rank holds the same number of rows.

Payloads (``--scale k`` divides every row count by ``k``):

* ``hidden_states``: 20,436 x 5,120 bf16 (209 MB gathered).
* ``target_logprobs``: 20,436 fp32.
* ``top_k``: 20,436 x 20 fp32 values + 20,436 x 20 int64 tokens (two fields).
* ``step_16x5``: 16 packed sequences (uneven lengths, 20,436 rows in all) x 5 fields:
  target log-probs fp32, entropy fp32, argmax token int64, top-20 values fp32, top-20 tokens
  int64.
* with ``--sweep``: ``hidden_states/64``, ``/16``, ``/4`` (fewer rows) for the size plot.

Timing (``timing.samples_ms``): ``--warmup`` untimed calls, then ``--reps`` timed calls, each
after a barrier; on CUDA, CUDA events around the call on the current stream; on CPU,
``time.perf_counter``. A repetition counts as its slowest rank; the table gives the median over
repetitions.

Peak memory (``timing.extra_peak_bytes``): on CUDA, ``torch.cuda.max_memory_allocated()`` during
one call minus what was allocated before it (outputs included); on CPU, the running sum of the
CPU allocator's allocation and free events recorded by ``torch.profiler``
(``profile_memory=True``) during one call. Neither counts NCCL's or gloo's internal buffers.
``bound`` is what ours may hold: the padded receive buffer plus the outputs (plus the packed send
buffer when there are several fields).

Run (from the repository root):

    PYTHONPATH=. torchrun --nproc-per-node 2 benchmarks/comm/bench_gather.py --device cpu \\
        --reps 5 --warmup 1 --sweep --plot benchmarks/comm/gather_cpu_gloo.png
    PYTHONPATH=. torchrun --nproc-per-node 4 benchmarks/comm/bench_gather.py --device cuda --sweep

``--check-only`` runs the correctness check alone (``check_approaches``); tests/test_benchmarks.py
runs it on 2 gloo ranks.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import math
import os
import pathlib
import platform
import statistics
import sys
import time
import warnings
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
import torch.distributed.nn.functional as dist_fn

_ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(_ROOT))
sys.path.insert(0, str(_ROOT / "benchmarks"))  # timing, the shared helper

from timing import extra_peak_bytes, samples_ms, sync  # noqa: E402

from megatron.context_parallel.comm.groups import all_gather_into  # noqa: E402
from megatron.context_parallel.comm.mappings import (  # noqa: E402
    gather_from_context_parallel_region,
)
from megatron.context_parallel.comm.plan import ContextParallelPlan  # noqa: E402

FULL_ROWS = 20_436
HIDDEN = 5_120
TOP_K = 20
STEP_SEQUENCES = 16
SWEEP_DIVISORS = (64, 16, 4)

APPROACHES = ("floor", "ours", "a_allreduce", "b_index_select", "c_unzigzag")
LABELS = {
    "floor": "floor (1 all-gather)",
    "ours": "ours",
    "a_allreduce": "(a) zero+index_copy+all_reduce",
    "b_index_select": "(b) all_gather+cat+index_select",
    "c_unzigzag": "(c) list all_gather+Python un-zigzag",
}
SHORT = {
    "floor": "floor",
    "ours": "ours",
    "a_allreduce": "(a)",
    "b_index_select": "(b)",
    "c_unzigzag": "(c)",
}

Field = Tuple[str, Tuple[int, ...], torch.dtype]

# Megatron-LM's RL code still calls it; (b) keeps the call it mimics, without the noise.
warnings.filterwarnings("ignore", message=r"torch\.distributed\.nn\.functional\.all_gather is")


# ---------------------------------------------------------------------------------------------
# Payloads and per-rank state.


def _round_up(n: int, multiple: int) -> int:
    return max(multiple, -(-n // multiple) * multiple)


@dataclass(frozen=True)
class Payload:
    """Packed sequence lengths (each a multiple of ``2 * cp``) and the fields of one row."""

    name: str
    lengths: Tuple[int, ...]
    fields: Tuple[Field, ...]

    @property
    def rows(self) -> int:
        return sum(self.lengths)

    @property
    def row_bytes(self) -> int:
        return sum(
            math.prod(shape) * torch.empty(0, dtype=dt).element_size()
            for _, shape, dt in self.fields
        )


def make_payloads(cp: int, scale: float = 1.0, sweep: bool = False) -> List[Payload]:
    """The benchmark's payloads for a CP group of ``cp`` ranks, row counts divided by ``scale``."""
    mult = 2 * cp
    rows = _round_up(math.ceil(FULL_ROWS / scale), mult)
    hidden = (("hidden_states", (HIDDEN,), torch.bfloat16),)
    payloads = [
        Payload("hidden_states", (rows,), hidden),
        Payload("target_logprobs", (rows,), (("target_logprobs", (), torch.float32),)),
        Payload(
            "top_k",
            (rows,),
            (("top_k_logprobs", (TOP_K,), torch.float32), ("top_k_tokens", (TOP_K,), torch.int64)),
        ),
    ]
    # Uneven packed lengths, fixed by seed so every rank and every run agree.
    weights = torch.rand(STEP_SEQUENCES, generator=torch.Generator().manual_seed(0)) * 1.5 + 0.25
    weights = (weights / weights.sum()).tolist()
    lengths = tuple(_round_up(round(FULL_ROWS / scale * w), mult) for w in weights)
    payloads.append(
        Payload(
            "step_16x5",
            lengths,
            (
                ("target_logprobs", (), torch.float32),
                ("entropy", (), torch.float32),
                ("argmax_tokens", (), torch.int64),
                ("top_k_logprobs", (TOP_K,), torch.float32),
                ("top_k_tokens", (TOP_K,), torch.int64),
            ),
        )
    )
    if sweep:
        for div in SWEEP_DIVISORS:
            payloads.append(
                Payload(f"hidden_states/{div}", (_round_up(math.ceil(rows / div), mult),), hidden)
            )
    return payloads


def _full_tensor(shape: Tuple[int, ...], dtype: torch.dtype, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    if dtype.is_floating_point:
        return torch.randn(shape, generator=gen, dtype=torch.float32).to(dtype)
    return torch.randint(0, 151_936, shape, generator=gen, dtype=dtype)


class Setup:
    """One payload on one rank: data, plan, and every approach's cached indices and buffers.

    Everything an approach would cache across calls in its home project (ART's per-item
    positions, megatron's inverse permutation, the floor's buffers) is built here, untimed.
    """

    def __init__(self, payload: Payload, group, device: torch.device, seed: int = 0):
        self.payload = payload
        self.group = group
        self.device = device
        self.rank = dist.get_rank(group)
        self.cp = dist.get_world_size(group)
        cu = [0]
        for n in payload.lengths:
            cu.append(cu[-1] + n)
        self.plan = ContextParallelPlan.thd(cu, self.cp)
        self.seqs = [(cu[i], payload.lengths[i]) for i in range(len(payload.lengths))]
        mine = self.plan.local_positions(self.rank)
        self.full: Dict[str, torch.Tensor] = {}
        self.local: Dict[str, torch.Tensor] = {}
        for i, (name, shape, dtype) in enumerate(payload.fields):
            full = _full_tensor((payload.rows,) + shape, dtype, seed * 1000 + i)
            self.local[name] = full.index_select(0, mine).to(device)
            self.full[name] = full.to(device)
        # ART: per packed sequence, this rank's row range and its positions within the sequence.
        self.art_items = []
        lo = 0
        for start, length in self.seqs:
            hi = lo + length // self.cp
            self.art_items.append((lo, hi, length, (mine[lo:hi] - start).to(device)))
            lo = hi
        # Megatron RL: rank-major concatenation of every rank's positions, inverted once.
        gather_perm = torch.cat([self.plan.local_positions(r) for r in range(self.cp)])
        self.inverse_perm = torch.argsort(gather_perm).to(device)
        # Floor: the same padded byte payload ours moves, buffers allocated once.
        self.send = torch.empty(
            self.plan.max_count, payload.row_bytes, dtype=torch.uint8, device=device
        )
        self.recv = torch.empty(
            self.cp * self.plan.max_count, payload.row_bytes, dtype=torch.uint8, device=device
        )

    @property
    def recv_bytes(self) -> int:
        return self.recv.numel()

    @property
    def send_bytes(self) -> int:
        return self.send.numel()

    @property
    def out_bytes(self) -> int:
        return self.payload.rows * self.payload.row_bytes


# ---------------------------------------------------------------------------------------------
# The approaches. Each takes a Setup and returns the gathered outputs.


def run_floor(s: Setup):
    all_gather_into(s.recv, s.send, s.group)
    return None


def run_ours(s: Setup):
    return gather_from_context_parallel_region(s.local, s.plan, s.group)


def run_a_allreduce(s: Setup):
    """(a) per field, per packed sequence: zeros, own rows by index_copy_, all_reduce SUM."""
    outs = {}
    for name, local in s.local.items():
        items = []
        for lo, hi, length, positions in s.art_items:
            full = torch.zeros(
                (length,) + tuple(local.shape[1:]), dtype=local.dtype, device=local.device
            )
            full.index_copy_(0, positions, local[lo:hi])
            dist.all_reduce(full, op=dist.ReduceOp.SUM, group=s.group)
            items.append(full)
        outs[name] = items
    return outs


def run_b_index_select(s: Setup):
    """(b) per field: autograd list all_gather, cat, index_select by the cached inverse perm."""
    outs = {}
    for name, local in s.local.items():
        gathered = dist_fn.all_gather(local.contiguous(), group=s.group)
        outs[name] = torch.cat(gathered, dim=0).index_select(0, s.inverse_perm)
    return outs


def run_c_unzigzag(s: Setup):
    """(c) per field: list all_gather, then a Python loop over sequences and ranks."""
    outs = {}
    cp = s.cp
    for name, local in s.local.items():
        parts = [torch.empty_like(local) for _ in range(cp)]
        dist.all_gather(parts, local, group=s.group)
        # verl puts the rank's own tensor back so its autograd history survives the gather.
        parts[s.rank] = local
        trailing = tuple(local.shape[1:])
        out = torch.zeros((s.payload.rows,) + trailing, dtype=local.dtype, device=local.device)
        for start, length in s.seqs:
            chunk = length // cp
            half = chunk // 2
            base = start // cp
            tmp = torch.empty((length,) + trailing, dtype=local.dtype, device=local.device)
            for j in range(cp):
                o = parts[j]
                tmp[j * half : (j + 1) * half] = o[base : base + half]
                tmp[length - (j + 1) * half : length - j * half] = o[base + half : base + chunk]
            out[start : start + length] = tmp
        outs[name] = out
    return outs


RUNNERS: Dict[str, Callable[[Setup], object]] = {
    "floor": run_floor,
    "ours": run_ours,
    "a_allreduce": run_a_allreduce,
    "b_index_select": run_b_index_select,
    "c_unzigzag": run_c_unzigzag,
}


def calls(approach: str, payload: Payload) -> int:
    """Collectives per call of ``approach`` on ``payload``."""
    if approach in ("floor", "ours"):
        return 1
    if approach == "a_allreduce":
        return len(payload.fields) * len(payload.lengths)
    return len(payload.fields)


def _as_full(value) -> torch.Tensor:
    return torch.cat(value, dim=0) if isinstance(value, list) else value


def check_setup(s: Setup) -> None:
    """Raises AssertionError unless every approach returns the full tensors, in source order."""
    ours = run_ours(s)
    for name, full in s.full.items():
        if not torch.equal(ours[name], full):
            raise AssertionError(f"{s.payload.name}: ours differs from the reference on {name}")
    for approach in ("a_allreduce", "b_index_select", "c_unzigzag"):
        got = RUNNERS[approach](s)
        for name in s.full:
            if not torch.equal(_as_full(got[name]), ours[name]):
                raise AssertionError(f"{s.payload.name}: {approach} differs from ours on {name}")


def check_approaches(
    group=None, device: Optional[torch.device] = None, scale: float = 400.0
) -> List[str]:
    """Checks every approach against ours and the reference on every payload; names checked."""
    device = torch.device("cpu") if device is None else device
    group = dist.group.WORLD if group is None else group
    cp = dist.get_world_size(group)
    checked = []
    for payload in make_payloads(cp, scale, sweep=False):
        check_setup(Setup(payload, group, device))
        checked.append(payload.name)
    return checked


# ---------------------------------------------------------------------------------------------
# Measurement.


def _time_call(
    fn, s: Setup, warmup: int, reps: int, min_seconds: float, max_reps: int
) -> List[float]:
    """Per-call seconds of this rank; at least ``reps`` calls, more for fast calls."""
    t0 = time.perf_counter()
    for _ in range(warmup):
        out = fn(s)
        del out
    sync(s.device)
    per_call = (time.perf_counter() - t0) / max(warmup, 1)
    # Every rank must run the same number of barriers: agree on the slowest rank's estimate.
    per_call = _max_over_ranks([per_call], s.group, s.device)[0]
    if per_call > 0:
        reps = max(reps, min(max_reps, math.ceil(min_seconds / per_call)))
    # CUDA events around the call on CUDA, the wall clock on CPU; a barrier before each call.
    times = samples_ms(lambda: fn(s), s.device, reps, 0, before=lambda: dist.barrier(group=s.group))
    return [t / 1e3 for t in times]


def _peak_bytes(fn, s: Setup) -> Optional[int]:
    dist.barrier(group=s.group)
    return extra_peak_bytes(lambda: fn(s), s.device)


def _max_over_ranks(values: Sequence[float], group, device: torch.device) -> List[float]:
    mine = torch.tensor(list(values), dtype=torch.float64, device=device)
    everyone = torch.empty(
        dist.get_world_size(group) * mine.numel(), dtype=torch.float64, device=device
    )
    all_gather_into(everyone, mine, group)
    return everyone.view(dist.get_world_size(group), -1).max(dim=0).values.tolist()


def bench_payload(
    payload: Payload,
    group,
    device: torch.device,
    warmup: int,
    reps: int,
    approaches: Sequence[str],
    min_seconds: float = 0.0,
    max_reps: int = 200,
) -> Dict:
    s = Setup(payload, group, device)
    check_setup(s)
    # The floor moves bytes it never reads; its send buffer content does not matter.
    result = {
        "payload": payload.name,
        "rows": payload.rows,
        "sequences": len(payload.lengths),
        "fields": len(payload.fields),
        "row_bytes": payload.row_bytes,
        "gathered_bytes": s.recv_bytes,
        "out_bytes": s.out_bytes,
        "send_bytes": s.send_bytes,
        "approaches": {},
    }
    for approach in approaches:
        fn = RUNNERS[approach]
        times = _time_call(fn, s, warmup, reps, min_seconds, max_reps)
        times = _max_over_ranks(times, group, device)
        peak = _peak_bytes(fn, s) if approach != "floor" else s.recv_bytes
        peak = _max_over_ranks([-1.0 if peak is None else float(peak)], group, device)[0]
        result["approaches"][approach] = {
            "calls": calls(approach, payload),
            "median_s": statistics.median(times),
            "reps": len(times),
            "min_s": min(times),
            "times_s": times,
            "peak_bytes": None if peak < 0 else int(peak),
        }
    floor = result["approaches"].get("floor", {}).get("median_s")
    for entry in result["approaches"].values():
        entry["ratio_to_floor"] = entry["median_s"] / floor if floor else None
    del s
    gc.collect()
    return result


# ---------------------------------------------------------------------------------------------
# Reporting.


def _mb(n: Optional[float]) -> str:
    return "n/a" if n is None else f"{n / 1e6:.1f}"


def _ms(t: float) -> str:
    return f"{t * 1e3:.3g}" if t * 1e3 < 100 else f"{t * 1e3:.0f}"


def _bound(r: Dict) -> int:
    send = r["send_bytes"] if r["fields"] > 1 else 0
    return r["gathered_bytes"] + r["out_bytes"] + send


def time_table(results: Sequence[Dict], approaches: Sequence[str]) -> str:
    head = ["payload", "rows", "gathered MB"] + [f"{SHORT[a]} ms (x floor)" for a in approaches]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in results:
        cells = [r["payload"], f"{r['rows']:,}", _mb(r["gathered_bytes"])]
        for a in approaches:
            e = r["approaches"][a]
            ratio = "" if e["ratio_to_floor"] is None else f" ({e['ratio_to_floor']:.2f}x)"
            cells.append(f"{_ms(e['median_s'])}{ratio}")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def memory_table(results: Sequence[Dict], approaches: Sequence[str]) -> str:
    head = ["payload", "outputs MB", "bound MB"] + [f"{SHORT[a]} peak MB" for a in approaches]
    head += ["ours / bound", "calls (a)/(b)/(c)"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in results:
        cells = [r["payload"], _mb(r["out_bytes"]), _mb(_bound(r))]
        cells += [_mb(r["approaches"][a]["peak_bytes"]) for a in approaches]
        ours = r["approaches"].get("ours", {}).get("peak_bytes")
        cells.append("n/a" if ours is None else f"{ours / _bound(r):.2f}")
        cells.append(
            "/".join(
                str(calls(a, _payload_of(r)))
                for a in ("a_allreduce", "b_index_select", "c_unzigzag")
            )
        )
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _payload_of(r: Dict) -> Payload:
    # Only the counts matter to calls(): sequences and fields.
    return Payload(r["payload"], (1,) * r["sequences"], (("x", (), torch.uint8),) * r["fields"])


def target_lines(results: Sequence[Dict], backend: str) -> List[str]:
    by_name = {r["payload"]: r for r in results}
    binding = backend == "nccl"
    tag = "" if binding else " (informational: the targets bind on NCCL)"
    lines = []

    def verdict(ok: bool) -> str:
        return ("PASS" if ok else "FAIL") if binding else ("met" if ok else "not met")

    hidden = by_name.get("hidden_states", {}).get("approaches", {})
    if "ours" in hidden and "floor" in hidden:
        r = hidden["ours"]["ratio_to_floor"]
        lines.append(
            f"hidden_states: ours / floor = {r:.2f} (target <= 1.15): {verdict(r <= 1.15)}"
        )
    if "ours" in hidden and "a_allreduce" in hidden:
        r = hidden["ours"]["median_s"] / hidden["a_allreduce"]["median_s"]
        lines.append(f"hidden_states: ours / (a) = {r:.2f} (target <= 0.6): {verdict(r <= 0.6)}")
    step = by_name.get("step_16x5", {}).get("approaches", {})
    if "ours" in step and "a_allreduce" in step:
        r = step["a_allreduce"]["median_s"] / step["ours"]["median_s"]
        lines.append(f"step_16x5: (a) / ours = {r:.1f} (target >= 5): {verdict(r >= 5)}")
    worst = None
    for r in results:
        ours = r["approaches"].get("ours", {}).get("peak_bytes")
        if ours is not None:
            worst = max(worst or 0.0, ours / _bound(r))
    if worst is not None:
        lines.append(
            f"memory: max ours peak / bound = {worst:.2f} (target <= 1): "
            f"{verdict(worst <= 1.0)}"
        )
    return [line + tag for line in lines]


def plot(results: Sequence[Dict], approaches: Sequence[str], path: str, title: str) -> None:
    """Time vs gathered payload size per approach, log-log (needs matplotlib).

    Lines join the single-field hidden-state payloads (the size sweep); the other payloads are
    unjoined markers, since their call counts differ.
    """
    import textwrap

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ordered = sorted(results, key=lambda r: r["gathered_bytes"])
    sweep = [r for r in ordered if r["payload"].startswith("hidden_states")]
    others = [r for r in ordered if not r["payload"].startswith("hidden_states")]
    fig, ax = plt.subplots(figsize=(7.5, 4.8), dpi=100)
    styles = {
        "floor": ("k", "--", "s"),
        "ours": ("tab:blue", "-", "o"),
        "a_allreduce": ("tab:red", "-", "^"),
        "b_index_select": ("tab:green", "-", "v"),
        "c_unzigzag": ("tab:purple", "-", "D"),
    }

    def xy(rows, a):
        return (
            [r["gathered_bytes"] / 1e6 for r in rows],
            [r["approaches"][a]["median_s"] * 1e3 for r in rows],
        )

    for a in approaches:
        color, ls, marker = styles[a]
        ax.plot(
            *xy(sweep, a), color=color, linestyle=ls, marker=marker, markersize=5, label=LABELS[a]
        )
        ax.plot(
            *xy(others, a),
            color=color,
            linestyle="none",
            marker=marker,
            markersize=6,
            markerfacecolor="none",
        )
    for r in ordered:
        top = max(e["median_s"] for e in r["approaches"].values()) * 1e3
        ax.annotate(
            r["payload"],
            (r["gathered_bytes"] / 1e6, top),
            textcoords="offset points",
            xytext=(0, 6),
            fontsize=7,
            ha="center",
        )
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("gathered payload per rank, MB (all fields, padded rows)")
    ax.set_ylabel("median time per call, ms")
    ax.set_title("\n".join(textwrap.wrap(title, 95)), fontsize=8)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(
        fontsize=7,
        loc="upper left",
        title="lines: hidden-state size sweep; open markers: other payloads",
        title_fontsize=7,
    )
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


# ---------------------------------------------------------------------------------------------
# Entry point.


def _device_description(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"{platform.processor() or platform.machine()} CPU, {os.cpu_count()} cores"


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--device",
        choices=("cpu", "cuda"),
        default="cpu",
        help="cpu uses gloo, cuda uses NCCL (one GPU per rank, LOCAL_RANK)",
    )
    parser.add_argument(
        "--backend",
        choices=("auto", "nccl", "gloo"),
        default="auto",
        help="auto: NCCL for cuda, gloo for cpu; gloo with --device cuda runs "
        "several ranks on one GPU (correctness and GPU memory, not speed)",
    )
    parser.add_argument("--scale", type=float, default=1.0, help="divide every row count by this")
    parser.add_argument("--reps", type=int, default=20, help="timed calls per approach")
    parser.add_argument("--warmup", type=int, default=3, help="untimed calls before timing")
    parser.add_argument(
        "--min-seconds",
        type=float,
        default=1.0,
        help="time each approach for at least this long (more reps, fast calls)",
    )
    parser.add_argument("--max-reps", type=int, default=200, help="cap on timed calls")
    parser.add_argument("--sweep", action="store_true", help="add smaller hidden-state payloads")
    parser.add_argument("--payloads", default="", help="comma-separated payload names (all)")
    parser.add_argument(
        "--approaches",
        default=",".join(APPROACHES),
        help=f"comma-separated subset of {','.join(APPROACHES)}",
    )
    parser.add_argument("--json", default="", help="write all results here (rank 0)")
    parser.add_argument("--markdown", default="", help="write the tables here (rank 0)")
    parser.add_argument("--plot", default="", help="write a PNG plot here (needs matplotlib)")
    parser.add_argument("--check-only", action="store_true", help="correctness check, no timing")
    parser.add_argument("--replot", default="", help="plot a --json file to --plot; no run")
    args = parser.parse_args(argv)

    if args.replot:
        with open(args.replot) as f:
            saved = json.load(f)
        names = list(saved["results"][0]["approaches"])
        plot(saved["results"], names, args.plot or "gather.png", saved["header"])
        return 0

    if "RANK" not in os.environ:
        print(
            "launch with torchrun, e.g. PYTHONPATH=. torchrun --nproc-per-node 2 "
            "benchmarks/comm/bench_gather.py --device cpu",
            file=sys.stderr,
        )
        return 2
    if args.device == "cuda":
        # NCCL needs one GPU per rank; gloo moves CUDA tensors through the host, so its ranks
        # may share a GPU.
        local_rank = int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count()
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
        if args.backend == "gloo":
            dist.init_process_group("gloo")
        else:
            dist.init_process_group("nccl", device_id=device)
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo")
    group = dist.group.WORLD
    rank, cp = dist.get_rank(), dist.get_world_size()
    approaches = [a for a in args.approaches.split(",") if a]
    unknown = sorted(set(approaches) - set(APPROACHES))
    if unknown:
        raise ValueError(f"unknown approaches {unknown}; choose from {APPROACHES}")
    if "floor" not in approaches:
        approaches.insert(0, "floor")
    try:
        if args.check_only:
            names = check_approaches(group, device, args.scale)
            if rank == 0:
                print(f"all approaches equal ours and the reference on {names} at CP {cp}")
            return 0
        payloads = make_payloads(cp, args.scale, args.sweep)
        if args.payloads:
            wanted = set(args.payloads.split(","))
            payloads = [p for p in payloads if p.name in wanted]
        backend = dist.get_backend(group)
        results = []
        for payload in payloads:
            results.append(
                bench_payload(
                    payload,
                    group,
                    device,
                    args.warmup,
                    args.reps,
                    approaches,
                    args.min_seconds,
                    args.max_reps,
                )
            )
            if rank == 0:
                r = results[-1]
                print(
                    f"[{payload.name}] "
                    + ", ".join(
                        f"{SHORT[a]} {_ms(e['median_s'])} ms" for a, e in r["approaches"].items()
                    ),
                    flush=True,
                )
        if rank != 0:
            return 0
        when = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
        header = (
            f"CP {cp}, {backend}, {_device_description(device)}, torch {torch.__version__}, "
            f"scale {args.scale:g}, median of >= {args.reps} reps (>= {args.min_seconds:g} s "
            f"per approach, <= {args.max_reps}) after {args.warmup} warm-up, {when}"
        )
        command = "torchrun --nproc-per-node {} benchmarks/comm/bench_gather.py {}".format(
            cp, " ".join(argv if argv is not None else sys.argv[1:])
        )
        text = "\n\n".join(
            [
                header,
                "Median time per call, ms (ratio to the floor):\n\n"
                + time_table(results, approaches),
                "Peak memory per rank, MB (bound = padded receive buffer + outputs [+ send buffer "
                "when several fields]):\n\n" + memory_table(results, approaches),
                "Targets:\n" + "\n".join(f"- {line}" for line in target_lines(results, backend)),
                f"Command: `{command}`",
            ]
        )
        print("\n" + text)
        if args.markdown:
            with open(args.markdown, "w") as f:
                f.write(text + "\n")
        if args.json:
            with open(args.json, "w") as f:
                json.dump(
                    {
                        "header": header,
                        "command": command,
                        "cp": cp,
                        "backend": backend,
                        "device": _device_description(device),
                        "results": results,
                    },
                    f,
                    indent=1,
                )
        if args.plot:
            plot(results, approaches, args.plot, header)
        return 0
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
