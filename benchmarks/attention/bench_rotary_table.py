"""What ``GPTModel``'s rotary table costs per micro-batch on the GPU, and what skipping it saves.

Under ``context_parallel_batch`` every layer applies rotary rows evaluated at the local rows'
source positions, so the table ``GPTModel._preprocess`` builds (``RotaryEmbedding.forward``:
the ``[L, 1, 1, dim]`` table, then megatron's CP slice, which copies a pinned index to the GPU)
is discarded. The package now marks the table length (``rotary.skip_table_length``) and the
model's rotary module answers it with an empty placeholder.

Timed per call, on one GPU, for ``L = rotary_table_length(S, cp)``:

* ``before, new length``: megatron's ``forward`` without its ``lru_cache`` (a packed batch whose
  length the cache has not seen: every micro-batch of varying length pays this);
* ``before, cached``: the cached call (the same length again);
* ``after``: the call the package's batches make now (the placeholder);
* ``rows we apply``: ``rotary_at_positions`` for this rank's rows, which the package builds
  either way (for scale).

Wall time per call with the GPU drained after each (host work, the pinned copy and the kernels
all count: ``timing.time_ms``'s host clock), median of ``--reps`` calls. A stand-in CP group
(``size()`` / ``rank()``) feeds megatron's slice, so one GPU is enough.

    python benchmarks/attention/bench_rotary_table.py --seq-len 20436
"""

from __future__ import annotations

import argparse
import pathlib
import sys

import torch

_ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(_ROOT))
sys.path.insert(0, str(_ROOT / "benchmarks"))  # timing, the shared helper

from timing import time_ms  # noqa: E402

from megatron.context_parallel.attention.rotary import (  # noqa: E402
    rotary_at_positions,
    rotary_table_length,
    skip_marked_tables,
    skip_table_length,
)
from megatron.context_parallel.comm.plan import ContextParallelPlan  # noqa: E402


class _StandInGroup:
    """What megatron's rotary CP slice reads of a process group."""

    def __init__(self, size: int, rank: int):
        self._size, self._rank = size, rank

    def size(self) -> int:
        return self._size

    def rank(self) -> int:
        return self._rank


def _per_call_us(fn, reps: int) -> float:
    return time_ms(fn, "cuda", reps, 1, clock="host") * 1e3


def _timings(seq_len: int, cp: int, kv_channels: int, reps: int) -> dict:
    """Per-call microseconds of the four calls (module docstring) at CP ``cp``."""
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding

    rope = RotaryEmbedding(kv_channels=kv_channels, rotary_percent=1.0)
    group = _StandInGroup(cp, 0)
    length = rotary_table_length(seq_len, cp)
    uncached = RotaryEmbedding.forward.__wrapped__
    out = {"length": length}
    out["before_new"] = _per_call_us(lambda: uncached(rope, length, 0, False, group), reps)
    out["before_cached"] = _per_call_us(lambda: rope(length, cp_group=group), reps)
    skip_marked_tables(rope)
    marked = skip_table_length(length)
    out["after"] = _per_call_us(lambda: rope(marked, cp_group=group), reps)
    positions = ContextParallelPlan.zigzag(length, cp).local_positions(0, "cuda")
    out["rows"] = _per_call_us(lambda: rotary_at_positions(rope, positions), reps)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq-len", type=int, default=20_436)
    parser.add_argument("--cp", type=int, nargs="+", default=[2, 4, 8])
    parser.add_argument("--kv-channels", type=int, default=128)
    parser.add_argument("--reps", type=int, default=200)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_rotary_table.py times the GPU path: no CUDA device here")
    print(f"S = {args.seq_len:,}, kv_channels {args.kv_channels}, {torch.cuda.get_device_name()}")
    print(
        "| CP | table rows L | before, new length (us) | before, cached (us) | after (us) "
        "| rows we apply (us) |"
    )
    print("|---|---|---|---|---|---|")
    for cp in args.cp:
        t = _timings(args.seq_len, cp, args.kv_channels, args.reps)
        print(
            f"| {cp} | {t['length']:,} | {t['before_new']:.1f} | {t['before_cached']:.1f} "
            f"| {t['after']:.1f} | {t['rows']:.1f} |"
        )


if __name__ == "__main__":
    main()
