"""Tree tables: one rank's attention under a ``PrefixTree`` packing, as fused kernel calls.

Under a tree a query row in segment ``s`` sees the keys of ``s``'s ancestors (all of them) and
the keys of ``s`` up to itself. Both parts are ordinary fused-attention problems over the
compact keys (the owned positions in source order, as in ``runs``):

* the *own* part, causal within each segment, is the run tables of the plan with the segments
  as the sequences (``AttentionRuns.build(plan, rank, segment_index)``): any plan, spans and
  dummies as there;
* the *ancestor* part is unmasked: every row of a segment sees every owned key of each of its
  ancestors, and an ancestor's owned keys are one contiguous range of compact keys. Level
  ``l`` holds, for each segment ``a`` at depth ``l`` with descendants on this rank, one entry:
  the rank's rows of ``a``'s descendants (gathered into the level's query buffer, grouped by
  ``a``) against ``a``'s keys. Within a level entries share neither query rows (a row has one
  ancestor per depth) nor keys (distinct segments), so one call runs each level both ways, and
  a tree of depth ``D`` takes ``D`` such calls (one for a prompt with its completions).

The pieces merge by their log-sum-exp (``sums.merge``); the backward differentiates every piece
against the final output and log-sum-exp, so query and key gradients add (in fp32, by the rows
and keys each call touched), as the blocked layout does (``blocks``). The work is exactly the
visible query-key pairs plus the kernel's tile padding: a shared prompt is read once per level
call, never copied per completion.

Built once per batch on the host (``TreeTables.build``); ``on(device)`` copies it once per
device and every layer shares it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

import torch

from megatron.context_parallel.attention.runs import (
    AttentionRuns,
    CompactKeys,
    ReadOnlyTables,
    ascending_order,
    copy_numbers,
    serial_host_ops,
)
from megatron.context_parallel.comm.plan import ContextParallelPlan
from megatron.context_parallel.tree import PrefixTree

__all__ = ["TreeTables", "DeviceTreeTables"]


@dataclass
class DeviceTreeTables:
    """The device tables of one ``TreeTables`` (built by ``TreeTables.on``).

    Attributes:
        level_rows: per ancestor level, int64 ``[m]``: the local row of each row of the
            level's query buffer.
        level_slices: per ancestor level, ``slice(a, b)`` when its query buffer is the local
            rows ``a .. b - 1`` in order (read and written in place, no gather), else None.
        own_rounds: the own part's key gradients by rounds ``(dst, src)`` of int64 ``[k]``:
            row ``src[i]`` of its backward key buffer (``src`` None: row ``i``) adds into
            compact key ``dst[i]``. Within a round no key repeats (the sum adds without
            atomics); a key the own part copied for ``c`` entries takes ``c`` rounds.
        compact_slots: int64 ``[N]``, the all-gather slot of each compact key (None when the
            slots are the compact keys).
        slot_rows: int64 ``[slots]``, the compact key of each slot or -1 (None likewise).
    """

    level_rows: List[torch.Tensor]
    level_slices: List[Optional[slice]]
    own_rounds: List[Tuple[torch.Tensor, Optional[torch.Tensor]]]
    compact_slots: Optional[torch.Tensor]
    slot_rows: Optional[torch.Tensor]


class TreeTables(ReadOnlyTables):
    """One rank's attention under a tree packing (see the module doc). Read-only once built.

    Attributes:
        rows: the rank's query rows (``counts[rank] + padding_rows``).
        slots: rows of the padded all-gather (``cp_size * max_count``).
        num_keys: ``N``, the compact keys.
        own: the run tables of the own-segment causal part.
        levels: the ancestor calls (unmasked ``AttentionRuns.from_entries``), shallowest first.
        level_rows: per level, int64 ``[m]`` local rows of the level's query buffer.
        compact_slots, slot_rows: as ``DeviceTreeTables`` (host copies).
    """

    @classmethod
    @serial_host_ops()
    def build(
        cls,
        plan: ContextParallelPlan,
        rank: int,
        tree: PrefixTree,
        *,
        padding_rows: int = 0,
        shape_buckets: Optional[int] = None,
    ) -> "TreeTables":
        """The tree tables of rank ``rank``'s rows of ``plan`` (host only).

        Args:
            plan: the batch's plan (``plan.seq_len == tree.seq_len``).
            rank: this rank's index in the plan.
            tree: the batch's ``PrefixTree``.
            padding_rows: an empty rank's one padding row (attends nothing).
            shape_buckets: as in ``AttentionRuns.build``.
        """
        tree.check_seq_len(plan.seq_len)
        segment = tree.segment_index()
        keys = CompactKeys(plan, segment)
        own = AttentionRuns.build(
            plan, rank, segment, padding_rows=padding_rows, shape_buckets=shape_buckets, keys=keys
        )
        first_key, key_count = _segment_keys(tree, keys)
        levels, level_rows = [], []
        seg_of_row = segment[plan.local_positions(rank)]
        for ancestor in _ancestors_by_depth(tree):
            level = _level_call(
                ancestor[seg_of_row], first_key, key_count, keys.count, shape_buckets
            )
            if level is not None:
                levels.append(level[0])
                level_rows.append(level[1])
        compact_slots = slot_rows = None
        if not plan.slots_in_source_order:
            compact_slots = keys.slots
            slot_rows = torch.full((plan.cp_size * plan.max_count,), -1, dtype=torch.int64)
            slot_rows[keys.slots] = torch.arange(keys.count)
        return cls(
            plan=plan,
            rank=rank,
            rows=int(plan.counts[rank]) + padding_rows,
            slots=plan.cp_size * plan.max_count,
            num_keys=keys.count,
            own=own,
            levels=levels,
            level_rows=level_rows,
            compact_slots=compact_slots,
            slot_rows=slot_rows,
        )

    def on(self, device: torch.device) -> DeviceTreeTables:
        """The device tables (built on first use per device, then shared by every layer), the
        kernel calls' (``own``, its split backward's, ``levels``) in the same copy."""
        device = torch.device(device)
        cached = self._device.get(device)
        if cached is None:
            moved = self._copy(device).tables[0]
            cached = DeviceTreeTables(
                level_rows=[moved[f"level {i}"] for i in range(len(self.level_rows))],
                level_slices=self._derived["level_slices"],
                own_rounds=[
                    (moved[f"own dst {j}"], moved[f"own src {j}"])
                    for j in range(self._derived["own_rounds"])
                ],
                compact_slots=moved["compact_slots"],
                slot_rows=moved["slot_rows"],
            )
            self._device[device] = cached
        return cached

    def _copied_tables(self) -> List[Dict[str, Optional[torch.Tensor]]]:
        # The levels' rows, the own part's copy rounds and the slot maps, and every kernel
        # call's tables, in one copy; the levels' slices are host work of the same pass.
        own = self.own
        if own.materialize:
            rounds = _copy_rounds(own.kv_source)
        else:
            rounds = [(torch.arange(own.mat_rows), None)]
        host = {"compact_slots": self.compact_slots, "slot_rows": self.slot_rows}
        host.update((f"level {i}", rows) for i, rows in enumerate(self.level_rows))
        for j, (dst, src) in enumerate(rounds):
            host[f"own dst {j}"], host[f"own src {j}"] = dst, src
        self._derived["level_slices"] = [_as_slice(r) for r in self.level_rows]
        self._derived["own_rounds"] = len(rounds)
        calls = own._copied_tables() + [c._host_tables() for c in self.levels]
        return [host] + calls

    def _copied_calls(self) -> List[Optional[AttentionRuns]]:
        return [None, *self.own._copied_calls(), *self.levels]

    def describe(self) -> str:
        """One line for logs: the own part's entries and the ancestor calls' entries."""
        levels = ", ".join(str(c.entries) for c in self.levels) or "none"
        return f"tree tables: own {self.own.entries} entries; ancestor levels {levels}"


def _segment_keys(tree: PrefixTree, keys: CompactKeys):
    """(first compact key, owned key count) of every segment, int64 ``[num_segments]``."""
    # Built with the segments as the sequences, the keys' "sequence" is their segment.
    count = torch.bincount(keys.sequence, minlength=tree.num_segments)
    first = torch.cumsum(count, 0) - count
    return first, count


def _as_slice(rows: torch.Tensor) -> Optional[slice]:
    """``slice(a, b)`` when int64 ``rows`` are ``a, a + 1, ..., b - 1``, else None."""
    a = int(rows[0])
    if torch.equal(rows, torch.arange(a, a + rows.numel())):
        return slice(a, a + rows.numel())
    return None


def _copy_rounds(key_of_row: torch.Tensor) -> List[Tuple[torch.Tensor, torch.Tensor]]:
    """``[(dst, src)]``: the rows ``src`` of a backward key buffer whose compact keys
    ``key_of_row`` (int64 ``[M]``) are their ``j``-th copy, for ``j = 0, 1, ...``, and those keys
    ``dst``: within a round no key repeats."""
    copy = copy_numbers(key_of_row)
    rounds = []
    for j in range(int(copy.max()) + 1 if copy.numel() else 0):
        src = torch.nonzero(copy == j)[:, 0]
        rounds.append((key_of_row[src], src))
    return rounds


def _ancestors_by_depth(tree: PrefixTree) -> List[torch.Tensor]:
    """Per depth ``l`` below the deepest segment's: int64 ``[num_segments]``, each segment's
    ancestor at depth ``l`` (-1 for segments at depth ``<= l``, which have none there)."""
    depth = max(tree.depth)
    table = torch.full((depth, tree.num_segments), -1, dtype=torch.int64)
    for s, parent in enumerate(tree.parents):
        if parent >= 0:
            table[:, s] = table[:, parent]
            table[tree.depth[parent], s] = parent
    return list(table)


def _level_call(ancestor_of_row, first_key, key_count, num_keys: int, shape_buckets):
    """One ancestor level's unmasked call and its query rows (None when no row has keys there).

    ``ancestor_of_row``: int64 ``[n]``, each local row's ancestor at this depth (-1: none).
    """
    has = ancestor_of_row >= 0
    has &= key_count[ancestor_of_row.clamp(min=0)] > 0
    rows = torch.nonzero(has)[:, 0]
    if rows.numel() == 0:
        return None
    rows = rows[ascending_order(ancestor_of_row[rows])]
    ancestor = ancestor_of_row[rows]
    segments, q_len = torch.unique_consecutive(ancestor, return_counts=True)
    q_start = torch.cumsum(q_len, 0) - q_len
    call = AttentionRuns.from_entries(
        q_start,
        q_len,
        first_key[segments],
        key_count[segments],
        query_rows=int(rows.numel()),
        num_keys=num_keys,
        causal=False,
        shape_buckets=shape_buckets,
    )
    return call, rows
