"""Multi-process test harness: run a function on N gloo ranks on this CPU and collect results.

Workers are forked (the parent's imports, megatron-core included, are inherited, which keeps
the suite fast on 2 cores), run with one intra-op thread each, and report either their return
value or their formatted exception back to the parent. A rank that neither answers nor exits
within ``timeout`` seconds fails the test instead of hanging the suite.
"""

from __future__ import annotations

import datetime
import multiprocessing as mp
import os
import socket
import traceback
from typing import Any, Callable, List

import torch
import torch.distributed as dist

__all__ = ["run_distributed", "DistributedPool", "WorkerError"]


class WorkerError(AssertionError):
    """A rank raised; the message carries its rank and traceback."""


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank, world_size, port, fn, args, queue):
    torch.set_num_threads(1)
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    os.environ["RANK"] = str(rank)
    os.environ["WORLD_SIZE"] = str(world_size)
    os.environ["LOCAL_RANK"] = str(rank)
    try:
        dist.init_process_group(
            "gloo",
            init_method=f"tcp://127.0.0.1:{port}",
            rank=rank,
            world_size=world_size,
            timeout=datetime.timedelta(seconds=60),
        )
        result = fn(rank, world_size, *args)
        queue.put((rank, True, result))
    except BaseException:  # noqa: BLE001 - report every failure to the parent
        queue.put((rank, False, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:  # noqa: BLE001
                pass


def run_distributed(
    fn: Callable[..., Any], world_size: int, *args: Any, timeout: float = 180.0
) -> List[Any]:
    """Runs ``fn(rank, world_size, *args)`` on ``world_size`` forked gloo ranks.

    Returns the per-rank return values (which must pickle). Raises ``WorkerError`` with every
    failing rank's traceback if any rank raised, or if a rank did not finish within ``timeout``.
    """
    ctx = mp.get_context("fork")
    queue = ctx.Queue()
    port = _free_port()
    procs = [
        ctx.Process(target=_worker, args=(r, world_size, port, fn, args, queue), daemon=True)
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    results: dict = {}
    failures = []
    try:
        for _ in range(world_size):
            try:
                rank, ok, payload = queue.get(timeout=timeout)
            except Exception:  # noqa: BLE001 - queue.Empty: some rank hung
                missing = sorted(set(range(world_size)) - set(results) - {f[0] for f in failures})
                failures.append((-1, f"ranks {missing} did not finish within {timeout} s"))
                break
            if ok:
                results[rank] = payload
            else:
                failures.append((rank, payload))
    finally:
        for p in procs:
            p.join(timeout=5)
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join()
    if failures:
        text = "\n".join(f"--- rank {r} ---\n{tb}" for r, tb in sorted(failures))
        raise WorkerError(text)
    return [results[r] for r in range(world_size)]


def _pool_worker(rank, world_size, port, inbox, outbox):
    torch.set_num_threads(1)
    try:
        dist.init_process_group(
            "gloo",
            init_method=f"tcp://127.0.0.1:{port}",
            rank=rank,
            world_size=world_size,
            timeout=datetime.timedelta(seconds=60),
        )
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
    dist.destroy_process_group()


class DistributedPool:
    """``world_size`` gloo ranks forked once and reused for many jobs (hypothesis examples).

    ``run(fn, *args)`` runs ``fn(rank, world_size, *args)`` on every rank and returns the
    per-rank results, raising ``WorkerError`` like ``run_distributed``. A job that times out
    leaves the group in an unknown state, so the pool is torn down and re-forked.
    """

    def __init__(self, world_size: int, timeout: float = 120.0):
        self.world_size = world_size
        self.timeout = timeout
        self._procs: list = []
        self._start()

    def _start(self):
        ctx = mp.get_context("fork")
        port = _free_port()
        self._outbox = ctx.Queue()
        self._inboxes = [ctx.Queue() for _ in range(self.world_size)]
        self._procs = [
            ctx.Process(
                target=_pool_worker,
                args=(r, self.world_size, port, self._inboxes[r], self._outbox),
                daemon=True,
            )
            for r in range(self.world_size)
        ]
        for p in self._procs:
            p.start()

    def run(self, fn: Callable[..., Any], *args: Any) -> List[Any]:
        for inbox in self._inboxes:
            inbox.put((fn, args))
        results: dict = {}
        failures = []
        for _ in range(self.world_size):
            try:
                rank, ok, payload = self._outbox.get(timeout=self.timeout)
            except Exception:  # noqa: BLE001 - queue.Empty: a rank hung
                self.close()
                self._start()
                raise WorkerError(
                    f"a rank did not finish {fn.__name__} in {self.timeout} s"
                ) from None
            if ok:
                results[rank] = payload
            else:
                failures.append((rank, payload))
        if failures:
            text = "\n".join(f"--- rank {r} ---\n{tb}" for r, tb in sorted(failures))
            raise WorkerError(text)
        return [results[r] for r in range(self.world_size)]

    def close(self):
        for inbox in self._inboxes:
            try:
                inbox.put(None)
            except Exception:  # noqa: BLE001
                pass
        for p in self._procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
                p.join()
        self._procs = []
