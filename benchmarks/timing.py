"""The one timing and memory helper of the benchmarks and probes.

Every script under ``benchmarks/`` times through this module, so a number in ``RESULTS.md`` means
the same thing whichever script printed it:

* :func:`time_ms` / :func:`samples_ms`: ``warmup`` untimed calls, then ``reps`` timed ones (the
  median, or every sample). Clocks: CUDA events around the call on the current stream (the
  default on CUDA), the wall clock with the device synchronised before and after (``"host"``,
  the default on CPU), or the wall clock of the call alone, synchronised only before
  (``"launch"``: host time while the GPU works).
* :func:`time_round_robin`: several callables timed in turns, a new (seeded) order each round,
  so that clocks and temperature drift alike for all; optionally each one's median ratio to a
  unit timed in the same rounds.
* :func:`kernel_ms`: GPU time only, calls queued behind a sleep kernel with an event between
  consecutive calls, rotating over input sets (no host launch gaps).
* :func:`extra_peak_bytes`: the peak allocated during a call beyond what existed before it (the
  CUDA caching allocator; on CPU the profiler's allocation events).
* :func:`gpu_sleep`: queue calibrated milliseconds of GPU spinning, so the host runs ahead.

Scripts import it as ``timing``: each one, in its subsystem's folder (``comm/``, ``attention/``,
``head/``, ``mixers/``, ``models/``) or in ``probes/``, puts ``benchmarks/`` and the repository
root on ``sys.path`` itself, so it runs from any directory.
"""

from __future__ import annotations

import gc
import random
import statistics
import time
from typing import Callable, Dict, List, Optional, Sequence, Tuple, Union

import torch

GiB = float(1 << 30)

_CLOCKS = ("auto", "events", "host", "launch")
_SLEEP_CYCLES_PER_MS: Optional[float] = None


def _device(device) -> torch.device:
    return device if isinstance(device, torch.device) else torch.device(device)


def sync(device) -> None:
    """Waits for ``device``'s queued work (nothing on CPU)."""
    if _device(device).type == "cuda":
        torch.cuda.synchronize(device)


def gpu_sleep(ms: float) -> None:
    """Queues about ``ms`` milliseconds of spinning on the current CUDA stream
    (``torch.cuda._sleep``, cycles per millisecond calibrated on the first call)."""
    global _SLEEP_CYCLES_PER_MS
    if _SLEEP_CYCLES_PER_MS is None:
        cycles = 10_000_000
        torch.cuda._sleep(cycles)  # warm-up
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        torch.cuda._sleep(cycles)
        end.record()
        end.synchronize()
        _SLEEP_CYCLES_PER_MS = cycles / start.elapsed_time(end)
    torch.cuda._sleep(int(ms * _SLEEP_CYCLES_PER_MS))


def samples_ms(
    fn: Callable[[], object],
    device,
    reps: int,
    warmup: int = 1,
    lead_ms: float = 0.0,
    *,
    clock: str = "auto",
    before: Optional[Callable[[], object]] = None,
) -> List[float]:
    """Milliseconds of each of ``reps`` calls of ``fn()``, after ``warmup`` untimed calls.

    Before each timed call the device is synchronised, then ``before()`` runs (untimed: a
    barrier, queued work), then on CUDA the GPU spins ``lead_ms`` milliseconds.

    Args:
        fn: the call.
        device: where ``fn`` runs (``torch.device`` or a string).
        reps: timed calls.
        warmup: untimed calls first.
        lead_ms: CUDA only: the GPU spins that long before the start, so the call's launches
            (Python, the launchers) queue while it does, as in a training step where the host
            runs ahead. With events the time is then the GPU's from the start event; host time
            after a host read inside ``fn`` still counts. 0: timed from an idle GPU, so host
            time before the first launch counts too.
        clock: ``"events"`` (CUDA events around the call on the current stream), ``"host"``
            (``time.perf_counter``, the device synchronised after the call too), ``"launch"``
            (``time.perf_counter`` around the call alone: host time while the GPU works), or
            ``"auto"``: events on CUDA, host elsewhere.
        before: called before each timed call, after the synchronisation; not timed.
    """
    if clock not in _CLOCKS:
        raise ValueError(f"clock must be one of {_CLOCKS}, got {clock!r}")
    device = _device(device)
    cuda = device.type == "cuda"
    if clock == "auto":
        clock = "events" if cuda else "host"
    if clock == "events" and not cuda:
        raise ValueError(f"CUDA events time CUDA calls; {device} needs clock='host'")
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        sync(device)
        if before is not None:
            before()
        if lead_ms and cuda:
            gpu_sleep(lead_ms)
        if clock == "events":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            if clock == "host":
                sync(device)
            times.append((time.perf_counter() - t0) * 1e3)
    return times


def time_ms(
    fn: Callable[[], object],
    device,
    reps: int,
    warmup: int = 1,
    lead_ms: float = 0.0,
    *,
    clock: str = "auto",
    before: Optional[Callable[[], object]] = None,
) -> float:
    """Median milliseconds of ``fn()``: :func:`samples_ms`'s median (same arguments)."""
    return statistics.median(
        samples_ms(fn, device, reps, warmup, lead_ms, clock=clock, before=before)
    )


def time_round_robin(
    fns: Dict[str, Callable[[], object]],
    device,
    reps: int,
    warmup: int = 1,
    unit: Optional[str] = None,
    lead_ms: float = 0.0,
    seed: int = 0,
    *,
    clock: str = "auto",
    before: Optional[Callable[[], object]] = None,
) -> Union[Dict[str, float], Tuple[Dict[str, float], Dict[str, float]]]:
    """Median ms of each ``fns[name]()``, timed in turns: every round runs each once.

    Each round runs the calls in a new order (seeded, so every rank of a group draws the same
    one): on the H200 a unit GEMM ran up to 14% slower after compute-bound calls than after
    memory-bound ones (likely the clock following the power draw), so a fixed order would give
    every method the same neighbour in every round and bias its ratio (a unit GEMM timed against
    itself in a fixed order read 0.98-1.06).

    Args:
        fns: the calls by name.
        device, lead_ms, clock, before: as :func:`samples_ms` (every call gets the same lead).
        reps: rounds.
        warmup: untimed rounds (in the given order).
        unit: a name in ``fns``: also return, per name, the median over rounds of its time over
            ``unit``'s in the same round.
        seed: the random seed of the orders.

    Returns:
        ``{name: median ms}``, and with ``unit`` also ``{name: median ratio to unit}``.
    """
    for _ in range(warmup):
        for fn in fns.values():
            fn()
    times: Dict[str, List[float]] = {name: [] for name in fns}
    order = list(fns)
    rng = random.Random(seed)
    for _ in range(reps):
        rng.shuffle(order)
        for name in order:
            times[name] += samples_ms(fns[name], device, 1, 0, lead_ms, clock=clock, before=before)
    medians = {name: statistics.median(t) for name, t in times.items()}
    if unit is None:
        return medians
    ratios = {
        name: statistics.median(a / b for a, b in zip(t, times[unit])) for name, t in times.items()
    }
    return medians, ratios


def kernel_ms(fns: Sequence[Callable[[], object]], reps: int, warmup: int = 5) -> float:
    """Median GPU milliseconds of one call, without the host's launch gaps.

    ``fns[k]`` runs the call on input set ``k`` (rotate over enough sets that consecutive calls
    do not share L2). Calls are queued in batches of up to 200 behind a sleep kernel longer than
    queueing the batch, with a CUDA event recorded between consecutive calls."""
    for i in range(warmup):
        fns[i % len(fns)]()
    torch.cuda.synchronize()
    times: List[float] = []
    done = 0
    while done < reps:
        batch = min(reps - done, 200)
        events = [torch.cuda.Event(enable_timing=True) for _ in range(batch + 1)]
        gpu_sleep(25.0)
        events[0].record()
        for i in range(batch):
            fns[(done + i) % len(fns)]()
            events[i + 1].record()
        torch.cuda.synchronize()
        times += [events[i].elapsed_time(events[i + 1]) for i in range(batch)]
        done += batch
    return statistics.median(times)


def nbytes(obj) -> int:
    """Bytes of the tensors in ``obj`` (a tensor, or nested lists / tuples of them)."""
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, (list, tuple)):
        return sum(nbytes(o) for o in obj)
    return 0


def _cpu_peak_bytes(fn: Callable[[], object]) -> Tuple[Optional[int], object]:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        out = fn()
    try:
        events = sorted(
            (e.start_ns(), e.nbytes())
            for e in prof.profiler.kineto_results.events()
            if e.name() == "[memory]"
        )
    except AttributeError:  # profiler internals moved: report no number rather than a wrong one
        return None, out
    running = peak = 0
    for _, size in events:
        running += size
        peak = max(peak, running)
    return peak, out


def extra_peak_bytes(
    fn: Callable[[], object], device, kept_bytes: int = 0, minus_output: bool = False
) -> Optional[int]:
    """Bytes allocated at the peak of ``fn()`` beyond what was allocated before it.

    Less ``kept_bytes`` (what the call must hold anyway: outputs, gradients) and, with
    ``minus_output``, the bytes of the tensors ``fn`` returns. On CUDA the caching allocator's
    peak (``max_memory_allocated``); on CPU the running sum of the allocator's allocation and
    free events recorded by ``torch.profiler`` during the call (None where the profiler's
    internals moved). Neither counts NCCL's or gloo's internal buffers."""
    device = _device(device)
    if device.type != "cuda":
        peak, out = _cpu_peak_bytes(fn)
        if peak is None:
            return None
    else:
        # Tensors held only by reference cycles of earlier calls would otherwise be freed by the
        # collector during the call and drop below the base (a negative peak was read so).
        gc.collect()
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
        out = fn()
        torch.cuda.synchronize(device)
        peak = torch.cuda.max_memory_allocated(device) - base
    return peak - kept_bytes - (nbytes(out) if minus_output else 0)
