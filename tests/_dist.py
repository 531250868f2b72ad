"""The suite's one multi-process harness: run a function on N gloo ranks of this machine.

``run_distributed(fn, world_size, *args)`` starts the ranks for one call; ``DistributedPool``
keeps them alive for many (hypothesis examples). Every rank runs ``fn(rank, world_size, *args)``
in the default process group (gloo, one intra-op thread) and reports its return value or its
formatted exception to the parent. Workers assert what they check, so a failure arrives as the
rank's own traceback in a ``WorkerError``.

Nothing can hang the suite: a rank that does not report within ``timeout`` seconds, or that dies
without reporting, fails the call, and the parent kills what is left. ``pg_timeout`` is the
process group's own timeout, after which a collective waiting on a missing peer raises inside
the rank.

Ranks are forked by default: they inherit the parent's imports (megatron-core included), which
keeps the suite fast on 2 cores. A parent that has used CUDA must pass ``start_method="spawn"``
(a forked child cannot use its CUDA context); ``fn`` must then be a module-level function of an
importable module, and the ranks import everything afresh.
"""

from __future__ import annotations

import datetime
import multiprocessing as mp
import os
import queue as queue_module
import socket
import time
import traceback
from typing import Any, Callable, Collection, List

import torch
import torch.distributed as dist

__all__ = ["run_distributed", "DistributedPool", "WorkerError"]

# A rank whose process ended is given this long for its last report to arrive through the
# queue's pipe before it counts as having died without reporting.
_EXIT_GRACE_S = 1.0


class WorkerError(AssertionError):
    """A rank raised, died or hung; the message carries each failing rank and its traceback."""


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _init_rank(rank: int, world_size: int, port: int, pg_timeout: float) -> None:
    torch.set_num_threads(1)
    # Code that reads the launcher's variables (megatron-core does) sees a torchrun-like rank.
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank),
    )
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world_size,
        timeout=datetime.timedelta(seconds=pg_timeout),
    )


def _destroy_group() -> None:
    if dist.is_initialized():
        try:
            dist.destroy_process_group()
        except Exception:  # noqa: BLE001 - best effort on the way out
            pass


def _worker(rank, world_size, port, pg_timeout, fn, args, outbox):
    try:
        _init_rank(rank, world_size, port, pg_timeout)
        result = fn(rank, world_size, *args)
        outbox.put((rank, True, result))
    except BaseException:  # noqa: BLE001 - report every failure to the parent
        outbox.put((rank, False, traceback.format_exc()))
    finally:
        _destroy_group()


def _describe_exit(code: int) -> str:
    return f"was killed by signal {-code}" if code < 0 else f"exited with code {code}"


def _collect(outbox, procs, ranks, timeout: float, what: str):
    """Waits for one report from each of ``ranks``; returns ``(results, failures, missing)``.

    ``results`` maps rank to return value, ``failures`` lists ``(rank, text)``, ``missing`` is
    the set of ranks that never reported. Stops early when a rank's process ended without
    reporting (after a short grace for a report still in the pipe), and after ``timeout`` s.
    """
    deadline = time.monotonic() + timeout
    pending = set(ranks)
    ended_at: dict = {}
    results: dict = {}
    failures: list = []
    missing: set = set()
    while pending:
        try:
            rank, ok, payload = outbox.get(timeout=0.1)
        except queue_module.Empty:
            now = time.monotonic()
            for r in sorted(pending):
                code = procs[r].exitcode
                if code is not None and now - ended_at.setdefault(r, now) > _EXIT_GRACE_S:
                    failures.append((r, f"rank {r} {_describe_exit(code)} before reporting"))
                    pending.discard(r)
                    missing.add(r)
            if pending and now > deadline:
                for r in sorted(pending):
                    failures.append((r, f"rank {r} did not finish {what} within {timeout} s"))
                missing |= pending
                break
            continue
        if rank not in pending:
            failures.append((rank, f"rank {rank} reported, but it was expected to be lost"))
            continue
        pending.discard(rank)
        if ok:
            results[rank] = payload
        else:
            failures.append((rank, payload))
    return results, failures, missing


def _raise_failures(failures) -> None:
    if failures:
        ordered = sorted(failures, key=lambda failure: failure[0])
        text = "\n".join(f"--- rank {r} ---\n{tb}" for r, tb in ordered)
        raise WorkerError(text)


def _stop(procs) -> None:
    for p in procs:
        p.join(timeout=5)
    for p in procs:
        if p.is_alive():
            p.kill()  # SIGKILL also ends a stopped (SIGSTOP) process
            p.join()


def run_distributed(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout: float = 180.0,
    pg_timeout: float = 60.0,
    start_method: str = "fork",
    lost_ranks: Collection[int] = (),
) -> List[Any]:
    """Runs ``fn(rank, world_size, *args)`` on ``world_size`` new gloo ranks.

    Args:
        fn: the rank's body; its return value must pickle.
        world_size: number of ranks.
        *args: passed to ``fn`` after ``rank, world_size``.
        timeout: seconds the parent waits for all reports before failing and killing the ranks.
        pg_timeout: the process group's timeout (``init_process_group(timeout=...)``), seconds.
        start_method: ``"fork"`` (default) or ``"spawn"`` (a parent that has used CUDA).
        lost_ranks: ranks expected never to report (a fault test kills or stops them). Their
            result is ``None``; they are killed once the other ranks have reported, and one that
            reports anyway is a failure.

    Returns:
        The per-rank return values, in rank order.

    Raises:
        WorkerError: a rank raised, died without reporting, or did not finish within
            ``timeout``; the message holds every failing rank's traceback or fate.
    """
    lost = set(lost_ranks)
    ctx = mp.get_context(start_method)
    outbox = ctx.Queue()
    port = _free_port()
    procs = [
        ctx.Process(
            target=_worker,
            args=(r, world_size, port, pg_timeout, fn, args, outbox),
            daemon=True,
        )
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    try:
        reporting = [r for r in range(world_size) if r not in lost]
        results, failures, missing = _collect(outbox, procs, reporting, timeout, fn.__name__)
        # Hung and lost ranks will not end by themselves: no point waiting for them. Hung ones
        # first, so that killing a lost rank cannot wake them up to report late.
        for r in sorted(missing) + sorted(lost - missing):
            procs[r].kill()
            procs[r].join()
        if lost:
            # A lost rank that reported anyway may still be in the queue.
            while True:
                try:
                    rank, _, _ = outbox.get(timeout=0.2)
                except queue_module.Empty:
                    break
                if rank in lost:
                    failures.append((rank, f"rank {rank} reported, but it was expected to be lost"))
    finally:
        _stop(procs)
    _raise_failures(failures)
    return [results.get(r) for r in range(world_size)]


def _pool_worker(rank, world_size, port, pg_timeout, inbox, outbox):
    try:
        _init_rank(rank, world_size, port, pg_timeout)
    except BaseException:  # noqa: BLE001
        outbox.put((rank, False, traceback.format_exc()))
        return
    while True:
        job = inbox.get()
        if job is None:
            break
        fn, args = job
        try:
            outbox.put((rank, True, fn(rank, world_size, *args)))
        except BaseException:  # noqa: BLE001 - a failing job must not end the worker
            outbox.put((rank, False, traceback.format_exc()))
    _destroy_group()


class DistributedPool:
    """``world_size`` gloo ranks forked once and reused for many jobs (hypothesis examples).

    ``run(fn, *args)`` runs ``fn(rank, world_size, *args)`` on every rank and returns the
    per-rank results, raising ``WorkerError`` like ``run_distributed``. A job that times out or
    loses a rank leaves the group in an unknown state, so the pool is torn down and re-forked.
    ``close()`` ends the ranks. ``start_method="spawn"`` for ranks that use CUDA: asking torch
    whether CUDA exists (``torch.cuda.is_available()``) already makes a forked child's CUDA
    unusable.
    """

    def __init__(
        self,
        world_size: int,
        timeout: float = 120.0,
        pg_timeout: float = 60.0,
        start_method: str = "fork",
    ):
        self.world_size = world_size
        self.timeout = timeout
        self.pg_timeout = pg_timeout
        self.start_method = start_method
        self._procs: list = []
        self._start()

    def _start(self):
        ctx = mp.get_context(self.start_method)
        port = _free_port()
        self._outbox = ctx.Queue()
        self._inboxes = [ctx.Queue() for _ in range(self.world_size)]
        self._procs = [
            ctx.Process(
                target=_pool_worker,
                args=(r, self.world_size, port, self.pg_timeout, self._inboxes[r], self._outbox),
                daemon=True,
            )
            for r in range(self.world_size)
        ]
        for p in self._procs:
            p.start()

    def run(self, fn: Callable[..., Any], *args: Any) -> List[Any]:
        for inbox in self._inboxes:
            inbox.put((fn, args))
        ranks = range(self.world_size)
        results, failures, missing = _collect(
            self._outbox, self._procs, ranks, self.timeout, fn.__name__
        )
        if missing:
            # A rank hung or died: the others may be stuck in a collective.
            self.close()
            self._start()
        _raise_failures(failures)
        return [results[r] for r in ranks]

    def close(self):
        for inbox in self._inboxes:
            try:
                inbox.put(None)
            except Exception:  # noqa: BLE001
                pass
        _stop(self._procs)
        self._procs = []
