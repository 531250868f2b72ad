"""Staging: a batch's attention tables in one host buffer, one copy to the device, and the row
tables the device derives from the copy for every kernel call of the copy at once.

A batch's attention runs as several kernel calls (the blocked layout's bulk, diagonal and level
calls; a backward's prefix / diagonal parts and its windows). Each call's per-entry tables are
small, but the tables a step reads per row (the statistics index, each key-gradient row's
compact key, each query row of an entry) are as long as the call's rows, so they are not built
on the host nor copied: the device derives them. Derived call by call that took a few dozen
device ops a call, ~450 in a blocked layout's first forward+backward at S = 20,436 and ~3,700
at 131,072 (63 calls and backward windows), each a launch on the step's host thread. Copied as
one group (``StagedTables.copy``), the calls' tables lie name by name in one device buffer, so
each kind of derived table comes out for every call of the group in one pass of a dozen ops
(``DeviceGroup``), and each call reads its slice.

Host tables are int64 on the CPU; the names in ``int32`` are converted on the device (one
conversion for all of them).
"""

from __future__ import annotations

from typing import Dict, List, Optional, Sequence, Tuple

import torch

from megatron.context_parallel import _extension

__all__ = ["DeviceGroup", "StagedTables", "pin_staged_tables", "spread"]

# The per-entry tables of a kernel call (``AttentionRuns._host_tables``): the entries' lengths
# ([batch]) and first rows ([batch + 1], padding entries and a closing offset past the last).
_LENGTHS = ("seq_len_q", "seq_len_kv")
_ROWS = ("q_rows", "kv_rows", "mat_rows")
# The group's own host tables (per entry of every call), under names no call table takes.
_GROUP = "group "


def pin_staged_tables() -> bool:
    """Whether staged tables go to pinned memory now: where this process already holds a CUDA
    context. Pinning creates one, which a forked process cannot (a data-loader worker, a
    forked rank: CUDA refuses to start in a fork of a process that used it); elsewhere
    ``StagedTables.copy`` pins at the copy."""
    return torch.cuda.is_initialized()


def spread(lengths: torch.Tensor, total: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """``(entry, offset)``, int64 ``[total]`` each on the device of ``lengths`` (int64 ``[E]``,
    ``total`` their sum): each row of entries of these lengths, laid end to end, as its entry
    and its offset in it. No host synchronisation on a device."""
    device = lengths.device
    entry = torch.repeat_interleave(
        torch.arange(lengths.numel(), device=device), lengths, output_size=int(total)
    )
    first = torch.cumsum(lengths, 0) - lengths
    return entry, torch.arange(int(total), device=device) - first[entry]


class StagedTables:
    """Dicts of int64 host tensors (or None) packed into one host buffer, ready for ``copy``'s
    single host-to-device copy.

    Packing is host work alone, so it can run ahead of the step (``AttentionRuns.stage``, a
    data-loader thread); ``copy`` then copies and views. With ``pin`` the buffer is pinned, so
    the copy does not block the host: a copy from pageable memory would wait for everything
    already queued on the stream, so tables built while the GPU runs earlier layers would stall
    the host until the GPU drained.

    The tables are packed name by name (the ``int32`` names first), each name's tables in dict
    order, so that one name's tables of every dict form one region of the device buffer.

    Args:
        tables: the dicts (name -> int64 tensor or None).
        int32: names converted to int32 on the device (their region converts as one tensor).
        pin: pin the buffer (for a CUDA device; ``copy`` pins an unpinned one itself).
        calls: per dict, the kernel call (``AttentionRuns``) whose per-entry tables it holds
            (``_LENGTHS`` and ``_ROWS`` present), or None; with two calls or more the copy also
            carries the per-entry tables the group derives its row tables from
            (``DeviceGroup``).
        row_maps: the group derives the calls' key sources and entry rows too (a backward's
            parts and windows never read theirs: their whole call's serve).
    """

    def __init__(
        self,
        tables,
        int32=(),
        pin: bool = False,
        calls: Optional[Sequence] = None,
        row_maps: bool = True,
    ):
        tables = list(tables)
        self._count = len(tables)
        members = [(i, c) for i, c in enumerate(calls or ()) if c is not None]
        if len(members) < 2:
            # One call derives its own tables in as many ops as the group would, without the
            # group's per-entry tables.
            members = []
        self._members = members
        self._layout = _GroupLayout(members, row_maps) if members else None
        if self._layout is not None:
            tables.append(self._layout.host_tables())
        names = [(i, k) for i, t in enumerate(tables) for k, v in t.items() if v is not None]
        if members:
            # The group reads the per-entry regions call by call: the calls' dicts, and only
            # they, must hold every per-entry table.
            per_entry = set(_LENGTHS + _ROWS)
            calls_at = {i for i, _ in members}
            held = [(i, k) for i, k in names if k in per_entry]
            holders = {i for i, _ in held}
            whole = len(held) == len(per_entry) * len(calls_at)  # (dict, name) pairs are unique
            if holders != calls_at or not whole:
                raise ValueError(
                    f"the per-entry tables {sorted(per_entry)} must be the calls' dicts' "
                    f"(dicts {sorted(calls_at)}), each holding all of them; found them in "
                    f"dicts {sorted(holders)}"
                )
        names.sort(key=lambda name: (name[1] not in int32, name[1]))
        flat = [tables[i][k] for i, k in names]
        flat = [t if t.dim() == 1 else t.reshape(-1) for t in flat]
        # Packed straight into pinned memory where pinned: the caching host allocator hands back
        # a block already mapped, where a fresh pageable buffer would fault in every page and
        # then be copied once more to pin it.
        total = sum(t.numel() for t in flat)
        packed = torch.empty(total, dtype=torch.int64, pin_memory=pin)
        if flat:
            torch.cat(flat, out=packed)
        self.packed = packed
        self._template = [list(t) for t in tables]
        self._names = names
        self._shapes = [tables[i][k].shape for i, k in names]
        self._n32 = sum(1 for _, k in names if k in int32)

    def to(self, device: torch.device) -> list:
        """The dicts on ``device``: device tensors, the ``int32`` ones as int32."""
        return self.copy(device).tables

    def copy(self, device: torch.device) -> "DeviceGroup":
        """The one host-to-device copy: the dicts on ``device`` (``DeviceGroup.tables``) and,
        where ``calls`` were given, their group's derivations."""
        packed = self.packed
        if torch.device(device).type == "cuda":
            # The caching host allocator keeps the pinned block until the copy has run.
            pinned = packed if packed.is_pinned() else packed.pin_memory()
            packed = pinned.to(device, non_blocking=True)
        else:
            packed = packed.to(device)
        n32, sizes = self._n32, [shape.numel() for shape in self._shapes]
        narrow = sum(sizes[:n32])
        wide = packed[narrow:]
        parts = list(wide.split(sizes[n32:]))
        if n32:
            converted = packed[:narrow].to(torch.int32)
            parts = list(converted.split(sizes[:n32])) + parts
        out = [dict.fromkeys(t) for t in self._template]
        # Each name's tables lie back to back: its region, and each dict's place in it.
        spans: Dict[str, List[int]] = {}  # name -> [first, end) in the packed buffer
        at: Dict[Tuple[int, str], int] = {}
        first = 0
        for (i, k), shape, part, size in zip(self._names, self._shapes, parts, sizes):
            out[i][k] = part if len(shape) == 1 else part.view(shape)
            span = spans.setdefault(k, [first, first])
            at[(i, k)] = first - span[0]
            span[1] = first = first + size
        regions = {
            k: converted[a:b] if b <= narrow else wide[a - narrow : b - narrow]
            for k, (a, b) in spans.items()
        }
        group_tables = out[self._count] if self._layout is not None else None
        return DeviceGroup(
            out[: self._count], regions, at, self._members, self._layout, group_tables
        )


class _GroupLayout:
    """Host sizes of a group's derived tables: where each call's slice of each kind starts.

    Per call ``m`` (entries ``b_m`` including padding, ``max_q_m``): the statistics index
    ``[b_m * max_q_m]`` and, with ``row_maps``, the entry rows ``[sum of q_len_m]`` and, for
    calls with their own key-gradient rows (``materialize``), the key sources
    ``[mat_rows_m]``; each kind's calls back to back."""

    def __init__(self, members, row_maps: bool):
        calls = [c for _, c in members]
        self.row_maps = row_maps
        self.batch = [int(c.batch) for c in calls]
        self.max_q = [int(c.max_q) for c in calls]
        self.q_total = [int(c.q_len.sum()) for c in calls]
        maps = [row_maps and c.materialize for c in calls]
        self.kv_rows = [int(c.mat_rows) if m else 0 for c, m in zip(calls, maps)]
        self.key_total = sum(int(c.key_rows) for c, m in zip(calls, maps) if m)
        self.stats_at = _starts([b * q for b, q in zip(self.batch, self.max_q)])
        self.entries_at = _starts(self.q_total)
        self.kv_at = _starts(self.kv_rows)
        self.entries = sum(self.batch)

    def host_tables(self) -> Dict[str, torch.Tensor]:
        """int64 ``[E]`` per entry of every call (``E`` the calls' padded entries): its row in
        the ``_ROWS`` regions (each call's tables there hold a closing offset more), its first
        statistics slot, its call's first key-source row, and whether that call has key
        sources (1) or not (0). Made by the C++ ``group_tables`` where built (one op for
        the dozen small torch ops below, which define it)."""
        ops = _extension.host_tables()
        if ops is not None:
            names = ("row", "stats", "kv at", "kv take")
            tables = ops.group_tables(
                self.batch, self.max_q, self.stats_at[:-1], self.kv_at[:-1], self.kv_rows
            )
            return {_GROUP + name: t for name, t in zip(names, tables)}
        batch = torch.tensor(self.batch, dtype=torch.int64)
        call = torch.repeat_interleave(torch.arange(batch.numel()), batch)
        first = torch.cumsum(batch, 0) - batch
        entry = torch.arange(self.entries)
        local = entry - first[call]
        stats_at = torch.tensor(self.stats_at[:-1], dtype=torch.int64)
        max_q = torch.tensor(self.max_q, dtype=torch.int64)
        kv_rows = torch.tensor(self.kv_rows, dtype=torch.int64)
        return {
            _GROUP + "row": entry + call,
            _GROUP + "stats": stats_at[call] + local * max_q[call],
            _GROUP + "kv at": torch.tensor(self.kv_at[:-1], dtype=torch.int64)[call],
            _GROUP + "kv take": (kv_rows > 0).to(torch.int64)[call],
        }


def _starts(sizes: List[int]) -> List[int]:
    """``[0, s_0, s_0 + s_1, ...]``: where each of ``sizes`` starts, and their end."""
    out = [0]
    for s in sizes:
        out.append(out[-1] + s)
    return out


class DeviceGroup:
    """The device side of one ``StagedTables.copy``: ``tables`` (the dicts, on the device) and,
    for the kernel calls among them (``members``), their derived tables, each kind made for
    every call at the first call's request and sliced per call.

    Attributes:
        tables: the copied dicts (device tensors; the ``int32`` names as int32).
    """

    def __init__(self, tables, regions, at, members, layout, group_tables):
        self.tables = tables
        self._regions = regions
        self._at = at
        self._index = {i: m for m, (i, _) in enumerate(members)}
        self._layout = layout
        self._group = group_tables
        self._made: Dict[tuple, torch.Tensor] = {}

    def holds(self, i: int) -> bool:
        """Whether dict ``i`` is a kernel call of the group (its derivations come from here)."""
        return i in self._index

    @property
    def row_maps(self) -> bool:
        """Whether the group derives its calls' key sources and entry rows."""
        return self._layout.row_maps

    def offsets(self, i: int, which: str, stride: int) -> torch.Tensor:
        """int64 ``[batch + 1, 1, 1, 1]``: call ``i``'s ``which`` rows (``q_rows``, ``kv_rows``
        or ``mat_rows``) times ``stride``, a view of one product over every call's."""
        stride = int(stride)
        scaled = self._once((which, stride), lambda: self._regions[which] * stride)
        first = self._at[(i, which)]
        return scaled[first : first + self._layout.batch[self._index[i]] + 1].view(-1, 1, 1, 1)

    def stats_index(self, i: int) -> torch.Tensor:
        """int64 ``[batch * max_q]``: call ``i``'s statistics index (``DeviceRuns.stats_index``
        at the call's own ``max_q``)."""
        lay = self._layout
        made = self._once(
            "stats",
            lambda: _expand(
                lay.stats_at[-1],
                self._group[_GROUP + "stats"],
                self._row_of("q_rows"),
                self._lengths("seq_len_q"),
                sum(lay.q_total),
            ),
        )
        return self._slice(made, lay.stats_at, i)

    def key_sources(self, i: int) -> torch.Tensor:
        """int64 ``[mat_rows]``: call ``i``'s key sources (``DeviceRuns.kv_source``)."""
        lay = self._layout
        made = self._once(
            "kv",
            lambda: _expand(
                lay.kv_at[-1],
                self._group[_GROUP + "kv at"] + self._row_of("mat_rows"),
                self._row_of("kv_rows"),
                self._lengths("seq_len_kv") * self._group[_GROUP + "kv take"],
                lay.key_total,
            ),
        )
        return self._slice(made, lay.kv_at, i)

    def entry_rows(self, i: int) -> torch.Tensor:
        """int64 ``[sum of q_len]``: call ``i``'s entry rows (``DeviceRuns.entry_rows``)."""
        lay = self._layout

        def make():
            entry, offset = spread(self._lengths("seq_len_q"), sum(lay.q_total))
            return self._row_of("q_rows")[entry] + offset

        return self._slice(self._once("entries", make), lay.entries_at, i)

    def _once(self, key, make) -> torch.Tensor:
        """``make()``, made at the first request of ``key`` and kept."""
        out = self._made.get(key)
        if out is None:
            out = self._made[key] = make()
        return out

    def _slice(self, made: torch.Tensor, starts: List[int], i: int) -> torch.Tensor:
        """Call ``i``'s part of a table made for every call, laid out at ``starts``."""
        m = self._index[i]
        return made[starts[m] : starts[m + 1]]

    def _lengths(self, which: str) -> torch.Tensor:
        """int64 ``[E]``: each entry's ``which`` length (``seq_len_q`` / ``seq_len_kv``)."""
        return self._once(("lengths", which), lambda: self._regions[which].to(torch.int64))

    def _row_of(self, which: str) -> torch.Tensor:
        """int64 ``[E]``: each entry's ``which`` row (the closing offsets skipped)."""
        return self._once(("row", which), lambda: self._regions[which][self._group[_GROUP + "row"]])


def _expand(size: int, dst, src, lengths, total: int) -> torch.Tensor:
    """int64 ``[size]``, -1 but for the rows of every entry: entry ``e``'s row ``dst[e] + j``
    holds ``src[e] + j`` for ``j < lengths[e]`` (``total`` the sum of ``lengths``)."""
    out = torch.full((int(size),), -1, dtype=torch.int64, device=lengths.device)
    entry, offset = spread(lengths, total)
    out[dst[entry] + offset] = src[entry] + offset
    return out
