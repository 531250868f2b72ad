"""Block tables: one rank's causal attention for plans that scatter its rows among other ranks'.

A plan that gives a rank single positions here and there (a random half of a sequence) has
almost as many runs as rows; as bottom-right causal entries (``runs``) each run fills
a whole query tile, and merged into spans its dummy rows attend whole prefixes. Here the rank's
rows are taken in compact key order (``sorted``) and cut into *groups* of up to
``group_rows`` consecutive rows of one sequence. Group ``g``, whose rows lie between compact
keys ``lo_g`` and ``hi_g`` of a sequence starting at ``s``, attends

* its *bulk*, keys ``[s, lo_g)``, unmasked: every row of the group sees all of them, and
* its *diagonal*, keys ``[lo_g, hi_g]``, causally: as a span of every compact key in that range
  (rows of other ranks run as dummy queries, as spans do in the run tables), a square causal
  block. A span is ``group_rows`` rows over the rank's share of the sequence wide, so the
  dummies cost a few percent of the bulk.

Forward: one call of every group's bulk (groups share key prefixes, which the forward only
reads) and calls of diagonal spans (at most ``span_budget`` span rows each, by default no more
than the rank's rows, bounding the span buffers; balanced over as few calls as that allows); the
two partial results merge by their log-sum-exp.

Backward: every piece is differentiated against the *final* output and log-sum-exp, so pieces
add. The kernel writes each entry's key gradients whole, so one call must not hold two entries
with the same keys; the bulk's shared prefixes are therefore re-cut. With ``e_0 = s`` and
``e_{i+1} = lo_i`` for the groups ``i = 0, 1, ...`` of a sequence, group ``i``'s bulk is the
key pieces ``[e_j, e_{j+1})``, ``j <= i``. The pairs ``j == i`` make one call; the pairs
``j < i`` split by the highest bit ``L`` where ``i`` and ``j`` differ: at level ``L`` the
groups with bit ``L`` set in a block of ``2^(L+1)`` attend, as one entry, the keys of the
block's first ``2^L`` pieces. Within a level entries share neither rows nor keys, each group
meets each of its pieces exactly once, and ``log2(groups)`` levels cover the bulk. Each call's
query and key gradients are added into fp32 accumulators by the rows and keys it touched.

Everything is built once per batch on the host; ``on(device)`` copies it once per device.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, NamedTuple, Optional, Tuple

import torch

from megatron.context_parallel.attention.runs import (
    DEFAULT_MERGE_GAP,
    AttentionRuns,
    CompactKeys,
    ReadOnlyTables,
    ascending_order,
    host_ops,
    run_entries,
    serial_host_ops,
)
from megatron.context_parallel.comm.plan import ContextParallelPlan

__all__ = ["AttentionBlocks", "DeviceBlocks", "build_attention_tables", "choose_layout"]

KERNEL_TILE = 128  # query rows of the kernel's tile, as the layout choice counts work
DEFAULT_GROUP_ROWS = KERNEL_TILE  # the bulk entries fill whole tiles
# The blocked layout is chosen when the run tables' tiles would compute over this many times its
# work (or the rows' own causal work): its merge and gradient sums cost a few percent.
LAYOUT_MARGIN = 1.15
# Span rows per diagonal call, at most (H200: 4096 cost 7% at S = 131,072). By default a call's
# span is also kept within the rank's own rows: the level calls' buffers cover those rows, so a
# larger span would raise the backward's peak above theirs (random rows at 20,436 over CP 2:
# one span of 16,384 rows beside ~10,300 rows held the peak).
DEFAULT_SPAN_BUDGET = 16384


@dataclass
class DeviceBlocks:
    """The device tables of one ``AttentionBlocks`` (built by ``AttentionBlocks.on``).

    Attributes:
        order: int64 ``[n]``, the local row of each sorted row (None when the local rows are
            sorted already).
        local_to_sorted: int64 ``[n]``, the sorted row of each local row (None likewise).
        has_bulk: bool ``[n, 1]``, whether a sorted row's group has bulk keys (None: all have).
        slot_rows: int64 ``[slots]``, the compact key of each all-gather slot or -1 (None when
            the slots are the compact keys).
        compact_slots: int64 ``[N]``, the all-gather slot of each compact key (None likewise).

    A level call's sorted rows are its ``DeviceRuns.entry_rows()`` (made on the device).
    """

    order: Optional[torch.Tensor]
    local_to_sorted: Optional[torch.Tensor]
    has_bulk: Optional[torch.Tensor]
    slot_rows: Optional[torch.Tensor]
    compact_slots: Optional[torch.Tensor]


class AttentionBlocks(ReadOnlyTables):
    """One rank's causal attention under a plan, in the blocked layout (see the module doc).

    Build with ``AttentionBlocks.build``; read-only afterwards. Host tensors are int64 CPU.

    Attributes:
        rows: the rank's query rows (at least one; empty ranks take the run tables).
        num_keys: ``N``, the compact keys.
        slots: rows of the padded all-gather (``cp_size * max_count``).
        groups: the number of groups.
        order, local_to_sorted, slot_rows, compact_slots: host copies of ``DeviceBlocks``'s
            tables (None as there).
        bulk: the forward call of every group's bulk (``AttentionRuns.from_entries``, unmasked;
            None when no group has bulk keys).
        has_bulk: bool ``[n]`` per sorted row (None when every group has bulk keys).
        diagonal: ``(call, first, end)`` per diagonal call (causal): the call carries
            ``span_source`` (the sorted row of each span row, -1 for a dummy) and
            ``local_to_span`` (the span row of each of the sorted rows ``[first, end)`` it holds).
        levels: the backward's bulk calls (unmasked), pieces ``j == i`` first.
    """

    @classmethod
    @serial_host_ops()
    def build(
        cls,
        plan: ContextParallelPlan,
        rank: int,
        sequence: torch.Tensor,
        *,
        group_rows: int = DEFAULT_GROUP_ROWS,
        span_budget: Optional[int] = None,
        shape_buckets: Optional[int] = None,
        keys: Optional[CompactKeys] = None,
    ) -> "AttentionBlocks":
        """The blocked tables of rank ``rank``'s rows of ``plan`` (host only).

        Args:
            plan: the batch's plan; the rank must own at least one position.
            rank: this rank's index in the plan.
            sequence: int64 ``[seq_len]`` (CPU), the packed sequence of each source position.
            group_rows: sorted rows per group (a multiple of the kernel's query tile).
            span_budget: span rows per diagonal call (a call holds at least one group); by
                default ``DEFAULT_SPAN_BUDGET`` or the rank's rows, whichever is fewer.
            shape_buckets: as in ``AttentionRuns.build``.
            keys: ``CompactKeys(plan, sequence)`` when the caller has it already.
        """
        keys = CompactKeys(plan, sequence) if keys is None else keys
        positions = plan.local_positions(rank)
        n = int(positions.numel())
        if n == 0:
            raise ValueError(f"rank {rank} owns no positions; the blocked layout needs rows")
        if span_budget is None:
            span_budget = min(DEFAULT_SPAN_BUDGET, n)
        if host_ops() is not None:
            return cls._native_build(plan, rank, keys, group_rows, span_budget, shape_buckets)
        compact = keys.of_position[positions]
        order = ascending_order(compact)
        sorted_compact = compact[order]
        groups = _groups(sorted_compact, keys.sequence_start[sorted_compact], group_rows)

        def call(q_start, q_len, k_start, kv_len, causal, **extra):
            return AttentionRuns.from_entries(
                q_start, q_len, k_start, kv_len, query_rows=extra.pop("query_rows", n),
                num_keys=keys.count, causal=causal, shape_buckets=shape_buckets, **extra,
            )  # fmt: skip

        bulk, has_bulk = _bulk_call(call, groups)
        sorted_of_key = torch.full((keys.count,), -1, dtype=torch.int64)
        sorted_of_key[sorted_compact] = torch.arange(n)
        diagonal = _diagonal_calls(call, groups, sorted_compact, sorted_of_key, span_budget)
        levels = _level_calls(call, groups)
        return cls(
            plan=plan,
            rank=rank,
            rows=n,
            num_keys=keys.count,
            slots=plan.cp_size * plan.max_count,
            groups=int(groups.first.numel()),
            **_row_tables(plan, keys, order),
            bulk=bulk,
            has_bulk=has_bulk,
            diagonal=diagonal,
            levels=levels,
        )

    @classmethod
    def _native_build(cls, plan, rank, keys, group_rows, span_budget, shape_buckets):
        """``build`` by the C++ builder (``block_tables``), the same tables."""
        slots = plan.cp_size * plan.max_count
        rank_keys = keys.rank_keys(rank)
        tensors, meta = host_ops().block_tables(
            rank_keys.sorted, rank_keys.order, keys.slots, keys.sequence_start, group_rows,
            span_budget, slots, plan.slots_in_source_order,
        )  # fmt: skip
        groups, identity, has_bulk_call, n_diagonal, n_levels = meta[:5]
        order, local_to_sorted, has_bulk, slot_rows = tensors[:4]
        n_calls = int(has_bulk_call) + n_diagonal + n_levels
        sizes = meta[5 : 5 + 5 * n_calls]
        bounds = meta[5 + 5 * n_calls :]
        calls = []
        for c in range(n_calls):
            q_start, q_len, k_start, kv_len, mat_start, span_source, to_span = tensors[
                4 + 7 * c : 11 + 7 * c
            ]
            diagonal = has_bulk_call <= c < has_bulk_call + n_diagonal
            bulk = c < has_bulk_call
            calls.append(
                AttentionRuns.from_layout(
                    q_start, q_len, k_start, kv_len, mat_start, backward=not bulk,
                    query_rows=sizes[5 * c], mat_rows=sizes[5 * c + 1], num_keys=keys.count,
                    sizes=sizes[5 * c + 2 : 5 * c + 5],
                    causal=diagonal, span_source=span_source if diagonal else None,
                    local_to_span=to_span if diagonal else None,
                    rows_covered=not bulk or has_bulk.numel() == 0, shape_buckets=shape_buckets,
                )  # fmt: skip
            )
        diagonal = [
            (calls[has_bulk_call + d], bounds[2 * d], bounds[2 * d + 1]) for d in range(n_diagonal)
        ]
        return cls(
            plan=plan,
            rank=rank,
            rows=int(rank_keys.sorted.numel()),
            num_keys=keys.count,
            slots=slots,
            groups=groups,
            order=None if identity else order,
            local_to_sorted=None if identity else local_to_sorted,
            slot_rows=None if plan.slots_in_source_order else slot_rows,
            compact_slots=None if plan.slots_in_source_order else keys.slots,
            bulk=calls[0] if has_bulk_call else None,
            has_bulk=has_bulk.bool() if has_bulk.numel() else None,
            diagonal=diagonal,
            levels=calls[has_bulk_call + n_diagonal :],
        )

    def on(self, device: torch.device) -> DeviceBlocks:
        """The device tables (first use per device; every call's own tables with them)."""
        device = torch.device(device)
        cached = self._device.get(device)
        if cached is not None:
            return cached
        moved = self._copy(device).tables[0]
        if moved["has_bulk"] is not None:
            moved["has_bulk"] = moved["has_bulk"].bool().unsqueeze(-1)
        out = DeviceBlocks(**moved)
        self._device[device] = out
        return out

    def _copied_tables(self) -> List[Dict[str, Optional[torch.Tensor]]]:
        # One host-to-device copy for the blocks' tables and every call's.
        host = {
            "order": self.order,
            "local_to_sorted": self.local_to_sorted,
            "has_bulk": None if self.has_bulk is None else self.has_bulk.to(torch.int64),
            "slot_rows": self.slot_rows,
            "compact_slots": self.compact_slots,
        }
        return [host] + [c._host_tables() for c in self.calls()]

    def _copied_calls(self) -> List[Optional[AttentionRuns]]:
        return [None, *self.calls()]

    def calls(self) -> List[AttentionRuns]:
        """Every kernel call of the forward and backward."""
        out = [self.bulk] if self.bulk is not None else []
        return out + [c for c, _, _ in self.diagonal] + list(self.levels)

    def describe(self) -> str:
        """One line for messages and benchmarks."""
        spans = sum(c.query_rows for c, _, _ in self.diagonal)
        return (
            f"{self.groups} groups of {self.rows} rows ({len(self.diagonal)} diagonal calls, "
            f"{spans} span rows; {len(self.levels)} backward bulk calls) over {self.num_keys} keys"
        )


class _Groups(NamedTuple):
    """Groups of sorted rows, int64 ``[groups]`` each: first sorted row, rows, the compact keys
    of the first and last row (``lo``, ``hi``), the sequence's first key, the index of the group
    in its sequence, and the groups in its sequence."""

    first: torch.Tensor
    length: torch.Tensor
    lo: torch.Tensor
    hi: torch.Tensor
    start: torch.Tensor
    index: torch.Tensor
    size: torch.Tensor


def _groups(sorted_compact: torch.Tensor, seq_start: torch.Tensor, group_rows: int) -> _Groups:
    """The groups of up to ``group_rows`` sorted rows of one sequence each."""
    n = sorted_compact.numel()
    rows = torch.arange(n)
    new_seq = torch.ones(n, dtype=torch.bool)
    new_seq[1:] = seq_start[1:] != seq_start[:-1]
    seq_first = torch.cummax(torch.where(new_seq, rows, 0), 0).values
    in_seq = rows - seq_first
    first = torch.nonzero(new_seq | (in_seq % group_rows == 0)).flatten()
    length = torch.diff(first, append=torch.tensor([n]))
    seq_of_group = torch.cumsum(new_seq[first].to(torch.int64), 0) - 1
    return _Groups(
        first=first,
        length=length,
        lo=sorted_compact[first],
        hi=sorted_compact[first + length - 1],
        start=seq_start[first],
        index=in_seq[first] // group_rows,
        size=torch.bincount(seq_of_group)[seq_of_group],
    )


def _bulk_call(call, groups: _Groups) -> Tuple[Optional[AttentionRuns], Optional[torch.Tensor]]:
    """The forward's one call of every group's bulk keys ``[start, lo)`` (unmasked; None when
    no group has any), and bool ``[n]`` per sorted row whether its group has them (None: all)."""
    with_bulk = groups.lo > groups.start
    has_bulk = None
    if not bool(with_bulk.all()):
        has_bulk = torch.repeat_interleave(with_bulk, groups.length)
    if not bool(with_bulk.any()):
        return None, has_bulk
    w = with_bulk
    # Rows without bulk keys must read a zero output from the bulk call.
    bulk = call(
        groups.first[w], groups.length[w], groups.start[w], (groups.lo - groups.start)[w], False,
        rows_covered=has_bulk is None, backward=False,
    )  # fmt: skip
    return bulk, has_bulk


def _greedy_calls(sizes: List[int], budget: int) -> int:
    """Calls of consecutive items (at least one each) that packing greedily up to ``budget``
    makes."""
    calls = total = 0
    for i, size in enumerate(sizes):
        if i == 0 or total + size > budget:
            calls, total = calls + 1, 0
        total += size
    return calls


def _balanced_budget(sizes: List[int], budget: int) -> int:
    """The smallest budget <= ``budget`` under which greedy packing makes no more calls than
    under ``budget``: as many calls, the largest as small as consecutive calls allow (a greedy
    fill would leave a small last call beside full ones)."""
    calls = _greedy_calls(sizes, budget)
    lo, hi = 1, max(budget, 1)
    while lo < hi:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if _greedy_calls(sizes, mid) <= calls else (mid + 1, hi)
    return lo


def _diagonal_calls(call, groups: _Groups, sorted_compact, sorted_of_key, span_budget: int):
    """The causal calls of the groups' diagonal spans, at most ``span_budget`` span rows each
    (at least one group), balanced (``_balanced_budget``): ``(call, first sorted row, end)``
    per call."""
    first, length, lo = groups.first, groups.length, groups.lo
    span = groups.hi - lo + 1
    budget = _balanced_budget(span.tolist(), span_budget)
    diagonal = []
    g = 0
    while g < first.numel():
        # Groups g .. e - 1 (at least one) whose spans fit the budget together.
        fit = torch.searchsorted(torch.cumsum(span[g:], 0), budget, right=True)
        e = g + max(int(fit), 1)
        s_len = span[g:e]
        s_start = torch.cumsum(s_len, 0) - s_len
        total = int(s_len.sum())
        owner = torch.repeat_interleave(torch.arange(e - g), s_len)
        span_key = torch.arange(total) - s_start[owner] + lo[g:e][owner]
        rows = torch.arange(int(first[g]), int(first[e - 1] + length[e - 1]))
        group_of_row = torch.repeat_interleave(torch.arange(e - g), length[g:e])
        to_span = s_start[group_of_row] + sorted_compact[rows] - lo[g:e][group_of_row]
        c = call(
            s_start, s_len, lo[g:e], s_len, True, query_rows=total,
            span_source=sorted_of_key[span_key], local_to_span=to_span,
        )  # fmt: skip
        diagonal.append((c, int(rows[0]), int(rows[-1]) + 1))
        g = e
    return diagonal


def _level_calls(call, groups: _Groups) -> List[AttentionRuns]:
    """The backward's bulk calls (unmasked): the pieces ``j == i`` first, then one call per
    level of the pieces ``j < i`` (see the module docstring)."""
    first, length, lo, index, size = (
        groups.first,
        groups.length,
        groups.lo,
        groups.index,
        groups.size,
    )
    levels = []
    # Piece boundaries: e_j of each group's own sequence, as global arrays over groups.
    piece_start = torch.where(index == 0, groups.start, torch.roll(lo, 1))  # e_i of group i
    piece_end = lo  # e_{i+1}
    nonempty = piece_end > piece_start
    if bool(nonempty.any()):
        w = nonempty
        piece_len = (piece_end - piece_start)[w]
        levels.append(call(first[w], length[w], piece_start[w], piece_len, False))
    level = 0
    while (1 << level) < int(size.max()):
        half = 1 << level
        # A leader opens the right half of its block of 2^(level+1) groups.
        leader = index % (2 * half) == half
        gl = torch.nonzero(leader).flatten()
        if gl.numel():
            last = gl + torch.minimum(torch.full_like(gl, half), size[gl] - index[gl]) - 1
            q_start = first[gl]
            q_len = first[last] + length[last] - q_start
            j0 = gl - half  # the block's first group (same sequence)
            k_start = piece_start[j0]
            kv_len = lo[gl - 1] - k_start
            w = kv_len > 0
            if bool(w.any()):
                levels.append(call(q_start[w], q_len[w], k_start[w], kv_len[w], False))
        level += 1
    return levels


def _row_tables(plan, keys: CompactKeys, order: torch.Tensor) -> dict:
    """The host tables of ``order`` (the local row of each sorted row) and of the slots:
    ``order`` and ``local_to_sorted`` (None when the local rows are sorted already),
    ``slot_rows`` and ``compact_slots`` (None when the slots are the compact keys)."""
    n = int(order.numel())
    slot_rows = compact_slots = None
    if not plan.slots_in_source_order:
        compact_slots = keys.slots
        slot_rows = torch.full((plan.cp_size * plan.max_count,), -1, dtype=torch.int64)
        slot_rows[keys.slots] = torch.arange(keys.count)
    identity = bool(torch.equal(order, torch.arange(n)))
    local_to_sorted = torch.empty(n, dtype=torch.int64)
    local_to_sorted[order] = torch.arange(n)
    return dict(
        order=None if identity else order,
        local_to_sorted=None if identity else local_to_sorted,
        slot_rows=slot_rows,
        compact_slots=compact_slots,
    )


def _run_cost(plan, rank: int, sequence: torch.Tensor, keys: CompactKeys) -> Tuple[float, int]:
    """``(tile cost, work)`` of the run tables ``AttentionRuns.build`` would make for this rank:
    ``_tile_cost`` of their causal entries and the rows' own causal score elements, without
    laying out a table (C++ ``run_cost``: one pass over the rank's keys, where built)."""
    ops = host_ops()
    if ops is not None:
        rank_keys = keys.rank_keys(rank)
        cost = ops.run_cost(rank_keys.sorted, keys.sequence_start, DEFAULT_MERGE_GAP, KERNEL_TILE)
        return cost, rank_keys.work
    q_len, kv_len, work = run_entries(plan, rank, sequence, keys)
    return _tile_cost(q_len, kv_len, True), work


def _block_cost(plan, rank: int, keys: CompactKeys, group_rows: int = DEFAULT_GROUP_ROWS) -> float:
    """``_blocks_cost`` of the blocked tables ``AttentionBlocks.build`` would make for this rank,
    read from its groups without laying the tables out (C++ ``block_cost`` where built): every
    group's bulk keys ``[start, lo)`` unmasked and its diagonal span ``[lo, hi]`` causal."""
    ops = host_ops()
    if ops is not None:
        sorted_keys = keys.rank_keys(rank).sorted
        return ops.block_cost(sorted_keys, keys.sequence_start, group_rows, KERNEL_TILE)
    positions = plan.local_positions(rank)
    sorted_compact = torch.sort(keys.of_position[positions]).values
    groups = _groups(sorted_compact, keys.sequence_start[sorted_compact], group_rows)
    bulk = groups.lo > groups.start
    span = groups.hi - groups.lo + 1
    return _tile_cost(groups.length[bulk], (groups.lo - groups.start)[bulk], False) + _tile_cost(
        span, span, True
    )


def _tile_cost(
    q_len: torch.Tensor, kv_len: torch.Tensor, causal: bool, tile: int = KERNEL_TILE
) -> float:
    """Score elements a tiled kernel computes for entries: whole query tiles of ``tile`` rows,
    a causal tile running to the key bound of its last row."""
    ops = host_ops()
    if ops is not None:
        return ops.tile_cost(q_len, kv_len, causal, tile)
    tiles = -(-q_len // tile)
    if not causal:
        return float((tiles * tile * kv_len).sum())
    entry = torch.repeat_interleave(torch.arange(q_len.numel()), tiles)
    first_tile = torch.repeat_interleave(torch.cumsum(tiles, 0) - tiles, tiles)
    k = torch.arange(int(tiles.sum())) - first_tile
    end = torch.minimum((k + 1) * tile, q_len[entry])
    return float((tile * (kv_len[entry] - q_len[entry] + end)).sum())


def _blocks_cost(blocks: AttentionBlocks) -> float:
    """Score elements the blocked layout's forward calls compute (``_tile_cost``)."""
    cost = 0.0
    if blocks.bulk is not None:
        cost += _tile_cost(blocks.bulk.q_len, blocks.bulk.kv_len, False)
    for c, _, _ in blocks.diagonal:
        cost += _tile_cost(c.q_len, c.kv_len, True)
    return cost


def choose_layout(
    runs: AttentionRuns, blocks: AttentionBlocks, margin: float = LAYOUT_MARGIN
) -> str:
    """``"runs"`` or ``"blocks"``: the blocked layout when the run tables' tiles would compute
    over ``margin`` times its work (its merge and gradient sums cost a few percent)."""
    runs_cost = _tile_cost(runs.q_len, runs.kv_len, True)
    return "blocks" if runs_cost > margin * _blocks_cost(blocks) else "runs"


@serial_host_ops()
def build_attention_tables(
    plan: ContextParallelPlan, rank: int, sequence: torch.Tensor, *, padding_rows: int = 0
):
    """This rank's tables for ``fused_attention``: the run tables, or the blocked ones where
    ``choose_layout`` finds them cheaper (plans scattering the rank's rows)."""
    keys = CompactKeys(plan, sequence)

    def runs():
        return AttentionRuns.build(plan, rank, sequence, padding_rows=padding_rows, keys=keys)

    if padding_rows or plan.counts[rank] == 0:
        return runs()
    # The choice reads the run entries and the blocked groups, and only the chosen layout is
    # laid out: the run tables of a sequence cut into many runs give every run its own
    # key-gradient rows (0.5 GB at S = 131,072 for 64-row blocks over CP 4), far more than the
    # blocked tables that win.
    runs_cost, work = _run_cost(plan, rank, sequence, keys)
    # Run tables within the margin of the rows' own causal work need no comparison.
    if runs_cost <= LAYOUT_MARGIN * work:
        return runs()
    # Laying the blocked tables out only to compare took as long as the rest of the build
    # (THD at 20,436, where the runs win).
    if runs_cost > LAYOUT_MARGIN * _block_cost(plan, rank, keys):
        return AttentionBlocks.build(plan, rank, sequence, keys=keys)
    return runs()
