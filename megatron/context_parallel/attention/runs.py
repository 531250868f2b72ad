"""Run tables: one rank's attention under any CP plan as a batch of bottom-right causal segments.

Causal attention by source position, within each packed sequence, for the rows one rank owns
(any plan: zigzag, contiguous, THD, uneven, empty, permuted, with positions nobody owns) is a
batch of ordinary fused-attention problems once the keys are laid out in *compact* order: the
owned positions of the batch in source order, positions nobody owns left out (no rank holds
their keys, so no query may see them). In compact coordinates a run of consecutive rows
``[a, b)`` of a sequence starting at ``s`` attends keys ``[s, b)``, the query at ``a + i``
seeing ``[s, a + i]``: a causal mask aligned to the bottom-right corner of a
``(b - a) x (b - s)`` block. Every plan decomposes exactly into such runs (a single row is a
run), so a varlen attention kernel with per-entry query / key offsets and a bottom-right
diagonal computes it with no score matrix in memory.

Two choices keep the batch cheap for the kernel:

* **Spans.** Runs of one sequence closer than ``merge_gap`` rows are merged into one entry
  whose rows in between (held by other ranks) run as *dummy* queries: zero rows whose output is
  dropped and whose output gradient is zero, so they add nothing to any gradient. A kernel's
  query tile is 64-128 rows, so a plan that interleaves single positions (a random half) would
  otherwise pay a whole tile per row.
* **Layout.** When the rank's rows already form the entries in its local order (no dummies,
  each run a contiguous block of local rows: zigzag, contiguous, THD, the report's plans) the
  kernel reads the local rows in place (``identity``); otherwise the queries are gathered into
  a span buffer (``span_source``) and the outputs gathered back (``local_to_span``).

Entries of one sequence share their keys' prefix. A kernel's backward writes each entry's key
and value gradients whole, so their gradient rows must not overlap: when some sequence has two
or more entries (``materialize``) each entry gets its own gradient rows (``mat_start``; a
kernel that cannot read overlapping key ranges is also given the keys copied to those rows,
``kv_source``), and each all-gather slot's gradient is the sum of its key's rows
(``slot_copies``). Those two hold a row per key-gradient row or slot, so they are not built on
the host nor copied: the device derives them from the per-entry tables at first use.

Everything here is built once per batch on the host from the plan, then copied to the device
once (``on(device)``), and shared by every layer. The builders run in C++
(``csrc/host/attention_tables.cpp``, linear passes) where the package was built with them, else
as the torch ops below, which define the tables and are the reference the C++ is tested against.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Dict, Iterator, List, NamedTuple, Optional, Set, Tuple

import torch

from megatron.context_parallel import _extension
from megatron.context_parallel.attention.settings import current_attention_settings
from megatron.context_parallel.attention.staging import (
    DeviceGroup,
    StagedTables,
    pin_staged_tables,
    spread,
)
from megatron.context_parallel.comm.plan import ContextParallelPlan

__all__ = [
    "AttentionRuns",
    "CompactKeys",
    "DeviceRuns",
    "KernelShapes",
    "adopt_calls",
    "copy_calls",
    "copy_numbers",
    "kernel_shapes",
    "recorded_shapes",
    "run_entries",
    "serial_host_ops",
    "stage_calls",
]

# Runs of one sequence closer than this are merged (their gap runs as dummy queries): merging
# costs at most this many dummy rows and saves a partly filled query tile (64-128 rows).
DEFAULT_MERGE_GAP = 64
# A causal call's backward runs as prefix and diagonal calls (``AttentionRuns.backward_split``)
# when its entries' rectangles exceed their visible pairs by this much: the second call's fixed
# cost (its own row passes) against the masked tiles a bottom-right backward does not skip.
SPLIT_MARGIN = 1.10

# The call tables the kernel reads as int32 (``StagedTables.to`` converts them).
INT32_TABLES = ("seq_len_q", "seq_len_kv")


def _bucket(n: int, per_octave: int = 1) -> int:
    """``n`` rounded up to one of ``per_octave`` sizes per power of two (at least 1).

    Kernel plans are keyed by these sizes, so batches of new lengths reuse built plans.
    """
    if n <= 1:
        return 1
    top = 1 << (int(n) - 1).bit_length()
    if per_octave <= 1:
        return top
    step = max(top // (2 * per_octave), 1)
    return -(-int(n) // step) * step


@contextlib.contextmanager
def serial_host_ops():
    """Torch's CPU ops inside run on the calling thread alone (the thread count is restored on
    exit); usable as a decorator.

    The tables are built once per batch, between long stretches in which the host only queues
    GPU work and torch's intra-op threads sleep. Waking them for a fill or a concatenation of
    ~10^5 int64 costs more than the split saves: on a 2-core CPU, S = 20,436, zigzag's tables
    went 0.88 -> 0.57 ms on one thread, the blocked random half 3.5 -> 2.2 ms. Off with
    ``AttentionSettings.serial_host_ops`` False (kept so the two can be timed).
    """
    threads = torch.get_num_threads()
    if threads == 1 or not current_attention_settings().serial_host_ops:
        yield
        return
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def host_ops():
    """The C++ table builders, or None: build with torch ops (``_extension.host_tables``)."""
    return _extension.host_tables()


def _run_starts(values: torch.Tensor) -> torch.Tensor:
    """For non-decreasing ``values``, the index of the first element equal to each element
    (``searchsorted(values, values)``, in one linear pass)."""
    n = values.numel()
    index = torch.arange(n)
    new = torch.ones(n, dtype=torch.bool)
    new[1:] = values[1:] != values[:-1]
    return torch.cummax(torch.where(new, index, 0), 0).values


def _run_ends(values: torch.Tensor) -> torch.Tensor:
    """For non-decreasing ``values``, one past the last element equal to each element
    (``searchsorted(values, values, right=True)``)."""
    n = values.numel()
    return n - _run_starts(values.flip(0)).flip(0)


def ascending_order(values: torch.Tensor) -> torch.Tensor:
    """A stable argsort, skipped (one comparison pass) when ``values`` is sorted already."""
    if values.numel() < 2 or bool((values[1:] >= values[:-1]).all()):
        return torch.arange(values.numel())
    return torch.argsort(values, stable=True)


def copy_numbers(values: torch.Tensor) -> torch.Tensor:
    """int64 like ``values``: for each element, how many equal elements come before it (its
    copy number; 0 for the first of each value)."""
    by_value = ascending_order(values)
    sorted_values = values[by_value]
    out = torch.empty_like(by_value)
    out[by_value] = torch.arange(sorted_values.numel()) - _run_starts(sorted_values)
    return out


class RankKeys(NamedTuple):
    """One rank's rows as compact keys (``CompactKeys.rank_keys``), what the C++ layout builders
    and costs read: ``sorted``, int64 ``[n]``, the rank's keys in ascending order (the plan's
    own ``local_positions`` where those are the keys already); ``order``, int64 ``[n]``, the
    local row of each sorted key, empty where the local rows come in key order; ``work``, the
    rows' own causal score elements (each row's keys from its sequence's start to itself)."""

    sorted: torch.Tensor
    order: torch.Tensor
    work: int


class CompactKeys:
    """The owned positions of a batch in source order (the compact keys) and their sequences.

    Attributes (int64, CPU; read-only: they may be the plan's and the caller's own tensors):
        slots: ``[N]``, the all-gather slot of each compact key.
        count: ``N``.
        of_position: ``[seq_len]``, the compact key of each owned position (unowned positions
            hold their predecessor's; never read for them).
        sequence: ``[N]``, the packed sequence of each compact key (non-decreasing).
        sequence_start: ``[N]``, the first compact key of each key's sequence.

    Where every position is owned (no padding) the compact keys are the positions: ``slots`` is
    the plan's ``row_source``, ``sequence`` the caller's, and ``of_position`` is made only if
    read (the C++ builders take an empty one for "each position its own key"), so the host
    writes one table of ``seq_len`` (the sequence starts) instead of four.
    """

    def __init__(self, plan: ContextParallelPlan, sequence: torch.Tensor):
        source = plan.row_source("cpu")
        sequence = sequence.to(torch.int64).contiguous()
        self._plan = plan
        self._ranks: Dict[int, RankKeys] = {}
        ops = host_ops()
        if ops is not None:
            if sum(plan.counts) == plan.seq_len:  # every position owned (none owned twice)
                slots, of_position, key_sequence = source, None, sequence
                self.sequence_start = ops.sequence_starts(sequence)
            else:
                slots, of_position, key_sequence, self.sequence_start = ops.compact_keys(
                    source, sequence
                )
            self.slots, self._of_position, self.sequence = slots, of_position, key_sequence
            self.count = int(self.slots.numel())
            return
        owned = source >= 0
        self.slots = source[owned]
        self.count = int(self.slots.numel())
        self._of_position = torch.cumsum(owned.to(torch.int64), 0) - 1
        self.sequence = sequence[owned]
        self.sequence_start = _run_starts(self.sequence)

    @property
    def of_position(self) -> torch.Tensor:
        """int64 ``[seq_len]`` (see the class docstring), made at the first read where every
        position is owned."""
        if self._of_position is None:
            self._of_position = torch.arange(self.count)
        return self._of_position

    def native_of_position(self) -> torch.Tensor:
        """``of_position`` as the C++ builders take it: empty where each position is its own
        key (not made for them)."""
        return _EMPTY if self._of_position is None else self._of_position

    def rank_keys(self, rank: int) -> RankKeys:
        """Rank ``rank``'s rows of the plan these keys were made for, as compact keys (C++
        ``rank_keys``, once per rank): what every C++ layout builder and cost of the rank
        reads (where the C++ builders are loaded: ``host_ops``). Raises RuntimeError naming a
        local position that is not the rank's own key."""
        cached = self._ranks.get(rank)
        if cached is None:
            positions = self._plan.local_positions(rank)
            (sorted_keys, order), (work, are_positions) = host_ops().rank_keys(
                positions, self.native_of_position(), self.sequence_start
            )
            cached = RankKeys(positions if are_positions else sorted_keys, order, int(work))
            self._ranks[rank] = cached
        return cached


_EMPTY = torch.empty(0, dtype=torch.int64)


# Kernel shapes. Every kernel plan (a cuDNN graph, ~0.1-0.2 s to build) is keyed by its shape
# (batch, max_q, max_kv): the entries, and the longest entry's rows and keys, rounded up to one
# of AttentionSettings.shape_buckets sizes per power of two. A larger shape is exact for a smaller
# batch (padding entries have no rows, cuDNN reads each entry's own lengths) and cost nothing
# measurable: on an H100 at S = 20,436, forward+backward of the five benchmark cases on shapes
# padded by 2x in query rows, 4x in keys, 4x in entries or 2x in all three ran at 0.97-1.04x their
# own (within the noise). So the shapes are powers of two, and a batch may also run on a recorded
# shape up to AttentionSettings.shape_reuse (2) times its own in every size, which bounds the
# shapes a process ever builds to a few per octave of the sequence length. Replayed over 200
# random uneven plans at S = 20,436 (probe_build_policy): 31 graph builds, 17 of them in the
# first 20 plans (the backward's are sized for the largest totals so far:
# cudnn.backward_totals), against 273 with 16 sizes per octave and no reuse, and 107 with reuse
# 1.5 and backward graphs per row total.


class KernelShapes:
    """The kernel shapes handed out in a process: each batch's own bucketed shape -> the shape
    it runs on.

    A shape, once chosen, stays chosen for that own shape: a batch that comes again runs on the
    graphs it ran on before (a later record must not move it to a shape whose backward graph was
    built for smaller totals).
    """

    def __init__(self):
        self._chosen: Dict[tuple, tuple] = {}

    def recorded(self) -> Set[tuple]:
        """The shapes handed out so far."""
        return set(self._chosen.values())

    def record(self, shape: Tuple[int, int, int]) -> None:
        """Records ``shape`` as chosen for itself (later batches may run on it)."""
        self._chosen[tuple(shape)] = tuple(shape)

    def shared(self, batch: int, max_q: int, max_kv: int, reuse: float) -> tuple:
        """The shape a batch whose own bucketed shape is ``(batch, max_q, max_kv)`` runs on: the
        one chosen before for that shape; else the recorded shape of least padded work covering
        it within ``reuse`` times in every size; else its own, recorded."""
        own = (batch, max_q, max_kv)
        chosen = self._chosen.get(own)
        if chosen is not None:
            return chosen
        chosen = own
        if reuse > 1:
            fits = [
                s
                for s in self.recorded()
                if batch <= s[0] <= batch * reuse
                and max_q <= s[1] <= max_q * reuse
                and max_kv <= s[2] <= max_kv * reuse
            ]
            if fits:
                chosen = min(fits, key=lambda s: (s[0] * s[1] * s[2], s))
        self._chosen[own] = chosen
        return chosen


# The process's record; ``kernel_shapes`` scopes a fresh one.
_SHAPES = [KernelShapes()]


def recorded_shapes() -> set:
    """The kernel shapes handed out so far in this process (or the innermost ``kernel_shapes``
    block)."""
    return _SHAPES[0].recorded()


@contextlib.contextmanager
def kernel_shapes(shapes: Optional[KernelShapes] = None) -> Iterator[KernelShapes]:
    """Tables built inside take their kernel shapes from ``shapes`` (default: a new, empty
    record), yielded; the process's record is back on exit (tests and probes start afresh)."""
    before = _SHAPES[0]
    _SHAPES[0] = KernelShapes() if shapes is None else shapes
    try:
        yield _SHAPES[0]
    finally:
        _SHAPES[0] = before


def _shared_shape(batch: int, max_q: int, max_kv: int) -> tuple:
    """The shape a batch of own bucketed shape ``(batch, max_q, max_kv)`` runs on, by the
    record in effect and ``AttentionSettings.shape_reuse``."""
    return _SHAPES[0].shared(batch, max_q, max_kv, current_attention_settings().shape_reuse)


def _kernel_sizes(
    entries: int, longest_q: int, longest_kv: int, query_rows: int, mat_rows: int, shape_buckets
) -> dict:
    """The bucketed sizes a kernel plan is keyed by (see ``AttentionRuns``) for ``entries``
    entries whose longest has ``longest_q`` rows and ``longest_kv`` keys; ``shape_buckets``
    None: ``AttentionSettings.shape_buckets``."""
    if shape_buckets is None:
        shape_buckets = current_attention_settings().shape_buckets
    batch, max_q, max_kv = _shared_shape(
        _bucket(entries),
        _bucket(longest_q if entries else 1, shape_buckets),
        _bucket(longest_kv if entries else 1, shape_buckets),
    )
    return dict(
        batch=batch,
        max_q=max_q,
        max_kv=max_kv,
        # cuDNN sizes its dQ accumulator by these totals in multiples of 64 rows.
        total_q=-(-_bucket(query_rows, per_octave=8) // 64) * 64,
        total_mat=-(-_bucket(mat_rows, per_octave=8) // 64) * 64,
    )


@dataclass
class DeviceRuns:
    """The device copies of one ``AttentionRuns`` (built by ``AttentionRuns.on``).

    Attributes:
        seq_len_q: int32 ``[batch, 1, 1, 1]``, query rows of each entry (0 for padding entries).
        seq_len_kv: int32 ``[batch, 1, 1, 1]``, keys of each entry (0 for padding entries).
        q_rows: int64 ``[batch + 1]``, first query-buffer row of each entry.
        kv_rows: int64 ``[batch + 1]``, first compact key row of each entry (forward).
        mat_rows: int64 ``[batch + 1]``, first row of each entry in the backward's key buffer.
        span_source / local_to_span / compact_slots: as on ``AttentionRuns``.
        entry_copy: int64 ``[batch]``, each entry's copy number (``AttentionRuns.entry_copy``;
            0 for padding entries), or None.
        runs: the host tables these came from (their sizes and flags).
        group: the ``DeviceGroup`` of the copy these came in, which derives the row tables
            below for every call of that copy at once (None: derived for this call alone).
        member: this call's dict in ``group``.
    """

    seq_len_q: torch.Tensor
    seq_len_kv: torch.Tensor
    q_rows: torch.Tensor
    kv_rows: torch.Tensor
    mat_rows: torch.Tensor
    span_source: Optional[torch.Tensor]
    local_to_span: Optional[torch.Tensor]
    compact_slots: Optional[torch.Tensor]
    entry_copy: Optional[torch.Tensor]
    runs: "AttentionRuns" = field(repr=False)
    group: Optional[DeviceGroup] = field(default=None, repr=False)
    member: int = -1
    _offsets: Dict[tuple, torch.Tensor] = field(default_factory=dict, repr=False)

    @property
    def kv_source(self) -> Optional[torch.Tensor]:
        """int64 ``[mat_rows]`` on the device, as ``AttentionRuns.kv_source`` (derived from the
        per-entry tables at first use)."""
        if not self.runs.materialize:
            return None
        out = self._offsets.get("kv_source")
        if out is None:
            if self.group is not None and self.group.row_maps:
                out = self.group.key_sources(self.member)
            else:
                out = key_sources(*self._entries(), self.runs.mat_rows)
            self._offsets["kv_source"] = out
        return out

    @property
    def slot_copies(self) -> Optional[torch.Tensor]:
        """int64 ``[copies, slots]`` on the device, as ``AttentionRuns.slot_copies`` (derived
        from the per-entry tables and ``compact_slots`` at first use)."""
        runs = self.runs
        if runs.slots_are_rows:
            return None
        out = self._offsets.get("slot_copies")
        if out is None:
            out = self._offsets["slot_copies"] = slot_copy_rows(
                *self._entries(), self.entry_copy, runs.materialize, runs.copies,
                self.compact_slots, runs.slots, runs.num_keys,
            )  # fmt: skip
        return out

    def entry_rows(self) -> torch.Tensor:
        """int64 ``[sum of q_len]``: the query-buffer rows of the entries, entry by entry (made
        on the device at first use)."""
        out = self._offsets.get("entry_rows")
        if out is None:
            if self.group is not None and self.group.row_maps:
                out = self.group.entry_rows(self.member)
            else:
                q_len = self.seq_len_q.view(-1).to(torch.int64)
                entry, offset = spread(q_len, int(self.runs.q_len.sum()))
                out = self.q_rows[:-1][entry] + offset
            self._offsets["entry_rows"] = out
        return out

    def _entries(self):
        """``(k_start, mat_start, kv_len, key_rows)`` of the padded entries (padding entries
        have no keys), ``key_rows`` their key total."""
        kv_len = self.seq_len_kv.view(-1).to(torch.int64)
        return self.kv_rows[:-1], self.mat_rows[:-1], kv_len, self.runs.key_rows

    def offsets(self, which: str, stride: int) -> torch.Tensor:
        """int64 ``[batch + 1, 1, 1, 1]`` element offsets: ``which`` rows times ``stride``."""
        key = (which, int(stride))
        out = self._offsets.get(key)
        if out is None:
            if self.group is not None:
                out = self.group.offsets(self.member, which, stride)
            else:
                out = (getattr(self, which) * int(stride)).reshape(-1, 1, 1, 1).contiguous()
            self._offsets[key] = out
        return out

    def stats_index(self, max_q: int) -> torch.Tensor:
        """int64 ``[batch * max_q]``: the query-buffer row of each padded statistics slot
        ``(entry, i)``, -1 past the entry's rows. Made on the device at first use: it follows
        from ``q_rows`` and ``seq_len_q``, and copied from the host it was the largest table
        (half the bytes of a blocked layout's)."""
        key = ("stats", int(max_q))
        out = self._offsets.get(key)
        if out is None:
            if self.group is not None and int(max_q) == self.runs.max_q:
                out = self.group.stats_index(self.member)
            else:
                slot = torch.arange(int(max_q), device=self.q_rows.device)
                rows = self.q_rows[:-1, None] + slot
                out = torch.where(slot < self.seq_len_q.view(-1, 1), rows, -1).flatten()
            self._offsets[key] = out
        return out


class ReadOnlyTables:
    """Host tables set once at construction (keyword arguments), then read-only; device copies
    are cached per device in ``_device``, from the host layout ``stage`` makes once
    (``_copied_tables``: the dicts of int64 host tensors ``on`` copies)."""

    def __init__(self, **values):
        for name, value in values.items():
            object.__setattr__(self, name, value)
        object.__setattr__(self, "_device", {})
        object.__setattr__(self, "_derived", {})  # values computed from the tables on first use

    def __setattr__(self, name, value):
        raise AttributeError(f"{type(self).__name__} is read-only (cannot set {name!r})")

    def stage(self) -> StagedTables:
        """The host tables ``on`` copies, laid out in one host buffer (pinned where this process
        uses CUDA: ``pin_staged_tables``) at the first call: host work alone, so a data-loader
        thread may call it ahead of the step (``ContextParallelParams.prepare``) and leave
        ``on`` one copy."""
        staged = self._derived.get("staged")
        if staged is None:
            with serial_host_ops():
                pin = pin_staged_tables()
                tables = self._copied_tables()
                staged = StagedTables(tables, INT32_TABLES, pin, self._copied_calls())
                self._derived["staged"] = staged
        return staged

    def _copy(self, device: torch.device) -> DeviceGroup:
        """The staged tables' one copy to ``device``; each kernel call among them not yet on
        ``device`` takes its dict (``adopt_calls``)."""
        group = self.stage().copy(device)
        adopt_calls(self._copied_calls() or (), group, device)
        return group

    def _copied_tables(self) -> List[Dict[str, Optional[torch.Tensor]]]:
        raise NotImplementedError

    def _copied_calls(self) -> Optional[List[Optional["AttentionRuns"]]]:
        """Per dict of ``_copied_tables``: the kernel call whose tables it holds, or None (no
        dict holds a call's)."""
        return None


class AttentionRuns(ReadOnlyTables):
    """One rank's causal attention under a plan, as entries of a bottom-right causal batch.

    Build with ``AttentionRuns.build``; read-only afterwards. All host tensors are int64 CPU.

    Attributes:
        rows: the rank's query rows (``counts[rank] + padding_rows``).
        num_keys: ``N``, the owned positions of the batch (the compact key rows).
        entries: the number of real entries ``B`` (0 for a rank that owns nothing).
        q_start, q_len, k_start, kv_len, mat_start: int64 ``[B]`` per entry: its first row in the
            query buffer and its row count; its first compact key and key count; its first row
            in the backward's key buffer.
        identity: the query buffer is the local rows themselves (no gather).
        span_source: int64 ``[query_rows]``, the local row of each query-buffer row, -1 for a
            dummy (None when ``identity``).
        local_to_span: int64 ``[counts[rank]]``, the query-buffer row of each local row (None
            when ``identity``).
        query_rows: rows of the query buffer (``rows`` when ``identity``).
        materialize: entries overlap, so each gets its own rows of key gradients.
        kv_source: int64 ``[mat_rows]``, the compact key of each of those rows (-1: a row no
            entry writes; None unless ``materialize``). A property: derived from the per-entry
            tables at first read.
        mat_rows: rows of the backward's key gradients (``num_keys`` unless ``materialize``).
        key_rows: the entries' key total (``kv_len.sum()``).
        compact_slots: int64 ``[N]``, the all-gather slot of each compact key, or None when the
            slots already are the compact keys (a contiguous plan with equal shards).
        slots: rows of the padded all-gather (``cp_size * max_count``).
        entry_copy: int64 ``[B]``, with ``materialize``: each entry's copy number, its rank by
            key count (longest first) among its sequence's entries. Each starts at its
            sequence's first key, so the entries covering a key are its copies 0, 1, ...
        copies: the most copies of one key (1 without ``materialize``).
        slots_are_rows: the backward buffer rows are the all-gather slots themselves.
        slot_copies: int64 ``[copies, slots]`` (a property, derived at first read; None when
            ``slots_are_rows``): row ``j`` holds, for each slot, the backward buffer row of its
            key's copy ``j`` (-1: none, e.g. a padding slot).
        keys_covered: without copies, every compact key is attended by some entry (else the
            key gradient starts at zero rather than being written whole by the kernel).
        rows_covered: every query-buffer row belongs to an entry, or is never read (so the
            kernel need not zero the rows outside the entries).
        batch, max_q, max_kv, total_q, total_mat: the sizes a kernel plan is keyed by, bucketed
            (``_bucket``) so that batches of new lengths reuse plans.
        causal: the entries are bottom-right causal blocks (``from_entries`` also makes
            unmasked ones).
        work: score elements of the rows' own causal attention (each row's keys from its
            sequence's start to itself; no tiles, no dummies), for the layout choice (None on
            ``from_entries`` calls).
        window: ``(q_lo, q_hi, m_lo, m_hi)`` on a call of ``backward_windows``: the rows of the
            whole call's query buffer and key-gradient buffer it runs on (its tables count
            from ``q_lo`` and ``m_lo``); None on a whole call.
    """

    window: Optional[Tuple[int, int, int, int]] = None

    @classmethod
    @serial_host_ops()
    def build(
        cls,
        plan: ContextParallelPlan,
        rank: int,
        sequence: torch.Tensor,
        *,
        padding_rows: int = 0,
        merge_gap: int = DEFAULT_MERGE_GAP,
        shape_buckets: Optional[int] = None,
        longest_first: bool = True,
        keys: Optional["CompactKeys"] = None,
    ) -> "AttentionRuns":
        """The entries of rank ``rank``'s rows of ``plan`` (host only, no device work).

        Args:
            plan: the batch's plan.
            rank: this rank's index in the plan.
            sequence: int64 ``[seq_len]`` (CPU), the packed sequence of each source position
                (non-decreasing).
            padding_rows: extra query rows after the owned ones that attend nothing (an empty
                rank's one padding row).
            merge_gap: runs of one sequence with fewer than this many rows between them merge
                into one entry (``1`` never merges).
            shape_buckets: sizes per power of two that the longest entry's rows and keys are
                rounded up to (kernel plans are built per size; None:
                ``AttentionSettings.shape_buckets``, powers of two). Padded sizes cost nothing
                measurable (see the kernel shape notes above ``KernelShapes``;
                on the H200 too, once entries ran longest first: THD 1.18x the floor with
                powers of two, 1.19x with 16 sizes per octave).
            longest_first: order the entries by key count, longest first (the kernel then
                starts its longest tiles first, and the short ones fill the tail).
            keys: ``CompactKeys(plan, sequence)`` when the caller has it already.
        """
        keys = CompactKeys(plan, sequence) if keys is None else keys
        build = _reference_tables if host_ops() is None else _native_tables
        tables, flags = build(plan, rank, sequence, keys, padding_rows, merge_gap, longest_first)
        slots = plan.cp_size * plan.max_count
        identity, query_rows, materialize, mat_rows, keys_covered, n_copies, work = flags
        return cls._from_tables(
            tuple(tables[:7]), bool(identity), query_rows, bool(materialize), mat_rows,
            entry_copy=tables[7] if materialize else None, copies=int(n_copies),
            slots_are_rows=not materialize and plan.slots_in_source_order,
            keys_covered=bool(keys_covered), work=work, shape_buckets=shape_buckets,
            plan=plan, rank=rank, rows=int(plan.counts[rank]) + padding_rows,
            num_keys=keys.count, compact_slots=None if plan.slots_in_source_order else keys.slots,
            slots=slots, rows_covered=padding_rows == 0, causal=True,
        )  # fmt: skip

    @classmethod
    def _from_tables(
        cls, tables, identity, query_rows, materialize, mat_rows, *, entry_copy, copies,
        slots_are_rows, keys_covered, work, shape_buckets, sizes=None, **rest,
    ) -> "AttentionRuns":  # fmt: skip
        """The object from the per-entry ``tables`` (``q_start, q_len, k_start, kv_len,
        mat_start, span_source, local_to_span``; the last two read only where ``identity`` makes
        them meaningful), the layout flags, and the attributes in ``rest``; the kernel sizes
        follow from the entries (``sizes``: their key total, longest rows and longest keys,
        where the caller has them)."""
        q_start, q_len, k_start, kv_len, mat_start, span_source, local_to_span = tables
        entries = int(q_len.numel())
        if sizes is None:
            sizes = (
                int(kv_len.sum()),
                *((int(q_len.max()), int(kv_len.max())) if entries else (1, 1)),
            )
        key_rows, longest_q, longest_kv = sizes
        return cls(
            q_start=q_start,
            q_len=q_len,
            k_start=k_start,
            kv_len=kv_len,
            mat_start=mat_start,
            entries=entries,
            identity=identity,
            span_source=None if identity else span_source,
            local_to_span=None if identity else local_to_span,
            query_rows=query_rows,
            materialize=materialize,
            mat_rows=mat_rows,
            key_rows=key_rows,
            entry_copy=entry_copy,
            copies=copies,
            slots_are_rows=slots_are_rows,
            keys_covered=keys_covered,
            work=work,
            **_kernel_sizes(entries, longest_q, longest_kv, query_rows, mat_rows, shape_buckets),
            **rest,
        )

    @classmethod
    def from_entries(
        cls,
        q_start: torch.Tensor,
        q_len: torch.Tensor,
        k_start: torch.Tensor,
        kv_len: torch.Tensor,
        *,
        query_rows: int,
        num_keys: int,
        causal: bool,
        span_source: Optional[torch.Tensor] = None,
        local_to_span: Optional[torch.Tensor] = None,
        rows_covered: bool = True,
        backward: bool = True,
        shape_buckets: Optional[int] = None,
    ) -> "AttentionRuns":
        """One kernel call of entries given directly (the blocked layout's calls).

        Entries must not share query rows; their keys may overlap. The backward writes each
        entry's key gradients to its own rows (``materialize``: packed in query-row order,
        ``kv_source`` naming the compact key of each), so the caller adds them where they
        belong. Entries are run longest first.

        Args:
            q_start, q_len, k_start, kv_len: int64 ``[B]`` per entry (no empty entries).
            query_rows: rows of the query buffer the call reads.
            num_keys: compact keys ``N`` (``k_start + kv_len <= N``).
            causal: bottom-right causal entries, else unmasked.
            span_source, local_to_span: carried for the caller (see ``AttentionRuns``).
            rows_covered: the caller never reads query rows outside the entries (else the
                kernel zeroes their output).
            backward: the call also runs backward (else no key-gradient rows are laid out:
                a forward-only call may hold overlapping keys of any total length).
        """
        entries = int(q_len.numel())
        if entries > 1:
            first = torch.argsort(kv_len, descending=True, stable=True)
            q_start, q_len, k_start, kv_len = (t[first] for t in (q_start, q_len, k_start, kv_len))
        if backward:
            mat_start, mat_rows = _own_key_rows(q_start, kv_len)
        else:
            mat_start, mat_rows = k_start, num_keys
        return cls.from_layout(
            q_start, q_len, k_start, kv_len, mat_start, backward=backward, query_rows=query_rows,
            mat_rows=mat_rows, num_keys=num_keys, causal=causal, span_source=span_source,
            local_to_span=local_to_span, rows_covered=rows_covered, shape_buckets=shape_buckets,
        )  # fmt: skip

    @classmethod
    def from_layout(
        cls, q_start, q_len, k_start, kv_len, mat_start, *, backward, query_rows, mat_rows,
        num_keys, causal, span_source, local_to_span, rows_covered, shape_buckets, sizes=None,
    ) -> "AttentionRuns":  # fmt: skip
        """One kernel call of entries already ordered and laid out (``from_entries``'s, or a
        builder's that did both): with ``backward`` each entry has its own key-gradient rows
        at ``mat_start`` (``kv_source`` derived from them), else key rows are at ``k_start``
        (forward only). ``sizes``: as ``_from_tables``'."""
        tables = (q_start, q_len, k_start, kv_len, mat_start, span_source, local_to_span)
        return cls._from_tables(
            tables, span_source is None, query_rows, bool(backward), mat_rows,
            entry_copy=None, copies=1, slots_are_rows=True, keys_covered=True, work=None,
            shape_buckets=shape_buckets, sizes=sizes,
            plan=None, rank=None, rows=query_rows, num_keys=num_keys, compact_slots=None,
            slots=None, rows_covered=bool(rows_covered), causal=bool(causal),
        )  # fmt: skip

    @property
    def kv_source(self) -> Optional[torch.Tensor]:
        """int64 ``[mat_rows]``: the compact key of each key-gradient row, -1 where no entry
        writes (None unless ``materialize``); derived from the entries at first read."""
        if not self.materialize:
            return None
        if "kv_source" not in self._derived:
            entries = (self.k_start, self.mat_start, self.kv_len, self.key_rows)
            self._derived["kv_source"] = key_sources(*entries, self.mat_rows)
        return self._derived["kv_source"]

    @property
    def slot_copies(self) -> Optional[torch.Tensor]:
        """int64 ``[copies, slots]``: row ``j`` holds each slot's backward buffer row of its
        key's copy ``j`` (-1: none); None when ``slots_are_rows``. Derived at first read (the
        device derives its own, ``DeviceRuns.slot_copies``)."""
        if self.slots_are_rows:
            return None
        if "slot_copies" not in self._derived:
            self._derived["slot_copies"] = slot_copy_rows(
                self.k_start, self.mat_start, self.kv_len, self.key_rows, self.entry_copy,
                self.materialize, self.copies, self.compact_slots, self.slots, self.num_keys,
            )  # fmt: skip
        return self._derived["slot_copies"]

    def on(self, device: torch.device) -> DeviceRuns:
        """The device tables (built on first use per device, then shared by every layer)."""
        device = torch.device(device)
        cached = self._device.get(device)
        if cached is not None:
            return cached
        self._copy(device)
        return self._device[device]

    def _copied_tables(self) -> List[Dict[str, Optional[torch.Tensor]]]:
        # The split backward's two calls (if any) travel in the same copy: the backward then
        # finds their tables on the device, with no host work of its own.
        split = self.backward_split() or ()
        return [self._host_tables()] + [c._host_tables(call_only=True) for c in split]

    def _copied_calls(self) -> List["AttentionRuns"]:
        return [self, *(self.backward_split() or ())]

    def backward_split(
        self, margin: float = SPLIT_MARGIN
    ) -> Optional[Tuple["AttentionRuns", "AttentionRuns"]]:
        """This causal call's backward as two calls over the same buffers, or None.

        Each entry (``q_len`` rows over ``kv_len`` keys, bottom-right) is its *prefix*, the
        first ``kv_len - q_len`` keys, which every row sees (an unmasked call; entries without
        one are left out), and its *diagonal*, the last ``q_len`` keys, a square causal block
        (a causal call of square entries, which a kernel may align top-left). The two calls'
        key rows (``k_start`` and ``mat_start``) are the entry's, split at the same point, so
        between them they write each key-gradient row the whole call writes, once; their query
        gradients add. Differentiated against the whole call's output and log-sum-exp, the
        sum is the call's backward exactly.

        Split only where the entries' full rectangles (``q_len * kv_len``, what a ragged
        backward that skips no masked tile computes) exceed ``margin`` times their visible
        pairs; None for unmasked calls, calls of square entries, or none at all.
        """
        key = ("backward_split", float(margin))
        if key in self._derived:
            return self._derived[key]
        out = None
        ops = host_ops()
        if ops is not None and self.causal and self.entries:
            tables, meta = ops.split_tables(
                self.q_start, self.q_len, self.k_start, self.kv_len, self.mat_start, margin
            )
            if tables:
                out = (
                    self._part_of(tables[:5], meta[1:4], False, rows_covered=bool(meta[0])),
                    self._part_of(tables[5:], meta[4:7], True, rows_covered=True),
                )
        elif self.causal and self.entries and not torch.equal(self.q_len, self.kv_len):
            q_len, kv_len = self.q_len, self.kv_len
            prefix_len = kv_len - q_len
            rectangle = float((q_len * kv_len).sum())
            visible = float((q_len * prefix_len + q_len * (q_len + 1) // 2).sum())
            if rectangle > margin * visible:
                out = (
                    self._part(prefix_len > 0, torch.zeros_like(prefix_len), prefix_len, False),
                    self._part(torch.ones_like(q_len, dtype=torch.bool), prefix_len, q_len, True),
                )
        self._derived[key] = out
        return out

    def backward_windows(self, max_rows: int) -> Tuple["AttentionRuns", ...]:
        """This call's backward as calls over windows of its buffers, or ``(self,)`` when its
        query rows and key-gradient rows come to at most ``max_rows`` (or its entries span all
        of them and form one window).

        A kernel's backward may size its accumulators by the rows its buffers span rather than
        by the rows its entries use (cuDNN: fp32 dQ for every query row and, with GQA, fp32
        per-query-head dK / dV for every key-gradient row), so one call over a long batch holds
        gigabytes that the same entries cut into several calls do not. Entries taken in
        query-row order are grouped while the group's query-row window plus its key-gradient
        window (``mat_start`` rows, laid out in query-row order) stays within ``max_rows``; an
        entry larger than that is a window of its own. One window narrower than the buffers
        (entries that use a part of the compact keys) is still a window.

        Each window is a call whose ``window`` is ``(q_lo, q_hi, m_lo, m_hi)`` and whose tables
        count from ``q_lo`` and ``m_lo``: its backward is given the rows ``[q_lo, q_hi)`` of
        the query buffer, the output, its gradient and the statistics, and the key-gradient
        rows ``[m_lo, m_hi)`` (and those rows of per-entry key copies); the compact keys are
        read in place (``k_start`` is not rebased). Query rows of a window outside its entries
        read a zero gradient (``rows_covered`` False). Every entry is in one window and the
        windows' entries keep this call's order, so the windows' key gradients are this call's
        and their query gradients add up to it.
        """
        key = ("backward_windows", int(max_rows))
        if key in self._derived:
            return self._derived[key]
        out = (self,)
        if self.entries and self.query_rows + self.mat_rows > max_rows:
            out = self._windows(int(max_rows))
        self._derived[key] = out
        return out

    def _windows(self, max_rows: int) -> Tuple["AttentionRuns", ...]:
        """``backward_windows``' calls (a greedy pass over the entries in query-row order)."""
        order = ascending_order(self.q_start).tolist()
        q_start, q_len = self.q_start.tolist(), self.q_len.tolist()
        m_start, m_len = self.mat_start.tolist(), self.kv_len.tolist()
        groups, members = [], []
        q_lo = q_hi = m_lo = m_hi = 0
        for e in order:
            qe, me = q_start[e] + q_len[e], m_start[e] + m_len[e]
            if members:
                lo, hi = min(m_lo, m_start[e]), max(m_hi, me)
                if max(q_hi, qe) - q_lo + hi - lo <= max_rows:
                    members.append(e)
                    q_hi, m_lo, m_hi = max(q_hi, qe), lo, hi
                    continue
                groups.append((members, (q_lo, q_hi, m_lo, m_hi)))
            members, q_lo, q_hi, m_lo, m_hi = [e], q_start[e], qe, m_start[e], me
        groups.append((members, (q_lo, q_hi, m_lo, m_hi)))
        if len(groups) == 1 and groups[0][1] == (0, self.query_rows, 0, self.mat_rows):
            return (self,)
        return tuple(self._window(sorted(members), window) for members, window in groups)

    def _window(self, members, window) -> "AttentionRuns":
        """The call of the entries ``members`` (indices, this call's order) on ``window``."""
        q_lo, q_hi, m_lo, m_hi = window
        keep = torch.tensor(members, dtype=torch.int64)
        q_len = self.q_len[keep]
        tables = (
            self.q_start[keep] - q_lo, q_len, self.k_start[keep], self.kv_len[keep],
            self.mat_start[keep] - m_lo, None, None,
        )  # fmt: skip
        return self._from_tables(
            tables, True, q_hi - q_lo, self.materialize, m_hi - m_lo, entry_copy=None,
            copies=self.copies, slots_are_rows=True, keys_covered=False, work=None,
            shape_buckets=None, plan=self.plan, rank=self.rank,
            rows=q_hi - q_lo, num_keys=self.num_keys, compact_slots=None, slots=self.slots,
            rows_covered=int(q_len.sum()) == q_hi - q_lo, causal=self.causal,
            window=(q_lo, q_hi, m_lo, m_hi),
        )  # fmt: skip

    def _part(self, keep, key_shift, kv_len, causal: bool) -> "AttentionRuns":
        """The call of the entries ``keep`` with their keys from ``k_start + key_shift`` (and
        key-gradient rows from ``mat_start + key_shift``), ``kv_len`` of them."""
        shift = key_shift[keep]
        tables = (
            self.q_start[keep], self.q_len[keep], self.k_start[keep] + shift, kv_len[keep],
            self.mat_start[keep] + shift,
        )  # fmt: skip
        return self._part_of(tables, None, causal, rows_covered=bool(keep.all()))

    def _part_of(self, tables, sizes, causal: bool, *, rows_covered: bool) -> "AttentionRuns":
        """The call of per-entry ``tables`` (``q_start, q_len, k_start, kv_len, mat_start``) over
        this call's buffers; ``rows_covered``: it keeps every entry."""
        return self._from_tables(
            (*tables, self.span_source, self.local_to_span), self.identity, self.query_rows,
            self.materialize, self.mat_rows, entry_copy=None, copies=self.copies,
            slots_are_rows=True, keys_covered=self.keys_covered, work=None,
            shape_buckets=None, sizes=sizes, plan=self.plan, rank=self.rank, rows=self.rows,
            num_keys=self.num_keys, compact_slots=self.compact_slots, slots=self.slots,
            # Rows of entries left out of the call must read a zero query gradient.
            rows_covered=self.rows_covered and rows_covered, causal=causal,
        )  # fmt: skip

    def _host_tables(self, call_only: bool = False) -> Dict[str, Optional[torch.Tensor]]:
        """The int64 host tables ``on`` copies (None: absent); ``call_only``: the kernel's
        per-entry tables alone (a split backward's calls read the row maps of the whole call)."""
        ops = host_ops()
        if ops is not None:
            parts = ops.call_tables(
                self.q_start, self.q_len, self.k_start, self.kv_len, self.mat_start, self.batch,
                self.max_q, self.query_rows, self.num_keys, self.mat_rows,
            )  # fmt: skip
            names = ("seq_len_q", "seq_len_kv", "q_rows", "kv_rows", "mat_rows")
            host = dict(zip(names, parts))
        else:
            host = self._reference_call_tables()
        if call_only:
            return dict(host, span_source=None, local_to_span=None, compact_slots=None,
                        entry_copy=None)  # fmt: skip
        entry_copy = self.entry_copy
        if entry_copy is not None and self.batch > self.entries:
            entry_copy = torch.cat([entry_copy, entry_copy.new_zeros(self.batch - self.entries)])
        host.update(
            span_source=self.span_source,
            local_to_span=self.local_to_span,
            compact_slots=self.compact_slots,
            entry_copy=entry_copy,
        )
        return host

    def _reference_call_tables(self) -> Dict[str, torch.Tensor]:
        """The per-entry device layout by torch ops (the definition ``call_tables`` meets)."""
        pad = self.batch - self.entries

        def starts(values: torch.Tensor, total: int) -> torch.Tensor:
            # Padding entries (and the closing offset) point past the last row.
            return torch.cat([values, torch.full((pad + 1,), total, dtype=torch.int64)])

        return {
            "seq_len_q": torch.cat([self.q_len, self.q_len.new_zeros(pad)]),
            "seq_len_kv": torch.cat([self.kv_len, self.kv_len.new_zeros(pad)]),
            "q_rows": starts(self.q_start, self.query_rows),
            "kv_rows": starts(self.k_start, self.num_keys),
            "mat_rows": starts(self.mat_start, self.mat_rows),
        }

    def _adopt(self, device: torch.device, parts, group: Optional[DeviceGroup] = None, member=-1):
        """Caches and returns the ``DeviceRuns`` of tables already on ``device`` (dict
        ``member`` of ``group``'s copy, where it came in one)."""
        parts = dict(parts)
        for name in INT32_TABLES:
            parts[name] = parts[name].view(-1, 1, 1, 1)
        if group is not None and not group.holds(member):
            group = None
        moved = DeviceRuns(**parts, runs=self, group=group, member=member)
        self._device[device] = moved
        return moved

    def describe(self) -> str:
        """One line for messages and benchmarks."""
        layout = "in place" if self.identity else f"{self.query_rows} span rows"
        keys = f", keys copied to {self.mat_rows} rows" if self.materialize else ""
        return f"{self.entries} entries ({layout}{keys}) over {self.num_keys} keys"


def stage_calls(calls) -> StagedTables:
    """The kernel tables of ``calls`` (``AttentionRuns``: a backward's parts and windows) laid
    out for one copy as one group (``adopt_calls``). Each call's kernel tables alone travel
    (``_host_tables(call_only=True)``: no row maps), and the group derives their offsets and
    statistics index only: such calls read no other (their whole call's serve)."""
    with serial_host_ops():
        tables = [c._host_tables(call_only=True) for c in calls]
        return StagedTables(tables, INT32_TABLES, pin_staged_tables(), calls, False)


def adopt_calls(calls, group: DeviceGroup, device: torch.device) -> None:
    """Gives each of ``calls`` (per dict of ``group``'s copy: its call, or None) not yet on
    ``device`` its tables of ``group``; a call copied before keeps its own."""
    device = torch.device(device)
    for m, call in enumerate(calls):
        if call is not None and device not in call._device:
            call._adopt(device, group.tables[m], group, m)


def copy_calls(calls, device: torch.device) -> None:
    """Copies the tables of the kernel calls among ``calls`` not yet on ``device`` in one copy,
    as one ``DeviceGroup``, whose row tables are then derived for all of them at once."""
    device = torch.device(device)
    todo = list({id(c): c for c in calls if device not in c._device}.values())
    if todo:
        adopt_calls(todo, stage_calls(todo).copy(device), device)


# --- one rank's entries: the C++ builder, and the torch ops that define it ----------------------
# Both return ``run_tables``' layout: the per-entry tables ``(q_start, q_len, k_start, kv_len,
# mat_start, span_source, local_to_span, entry_copy)`` and the flags ``(identity,
# query_rows, materialize, mat_rows, keys_covered, copies, work)``.


def run_entries(
    plan: ContextParallelPlan,
    rank: int,
    sequence: torch.Tensor,
    keys: CompactKeys,
    merge_gap: int = DEFAULT_MERGE_GAP,
) -> Tuple[torch.Tensor, torch.Tensor, int]:
    """``(q_len, kv_len, work)`` of the entries ``AttentionRuns.build`` would make, without
    laying out their tables: what a layout choice needs. The tables themselves can be large
    (plans that cut a sequence into many runs give every entry its own key-gradient rows), so
    they are built only for the layout that runs."""
    positions = plan.local_positions(rank)
    compact = keys.of_position[positions]
    spans = _spans(compact, sequence[positions], merge_gap)
    lo, q_len = spans["lo"], spans["len"]
    kv_len = lo + q_len - keys.sequence_start[lo] if lo.numel() else lo
    work = int((compact - keys.sequence_start[compact] + 1).sum()) if compact.numel() else 0
    return q_len, kv_len, work


def _native_tables(plan, rank, sequence, keys, padding_rows, merge_gap, longest_first):
    """``AttentionRuns.build``'s tables from the C++ builder (``run_tables``)."""
    rank_keys = keys.rank_keys(rank)
    tables, flags = host_ops().run_tables(
        plan.local_positions(rank), keys.native_of_position(), rank_keys.sorted, rank_keys.order,
        keys.sequence, keys.sequence_start, padding_rows, merge_gap, longest_first,
    )  # fmt: skip
    return tables, (*flags, rank_keys.work)


def _reference_tables(plan, rank, sequence, keys, padding_rows, merge_gap, longest_first):
    """``AttentionRuns.build``'s tables by torch ops (the definition ``run_tables`` meets)."""
    positions = plan.local_positions(rank)
    compact = keys.of_position[positions]
    spans = _spans(compact, sequence[positions], merge_gap)
    identity, query_rows, q_start, q_len, lo, span_source, local_to_span = _query_layout(
        compact, spans, keys.count, padding_rows
    )
    k_start = keys.sequence_start[lo] if lo.numel() else lo
    kv_len = lo + q_len - k_start
    if longest_first and q_len.numel() > 1:
        first = torch.argsort(kv_len, descending=True, stable=True)
        q_start, q_len, lo, k_start, kv_len = (
            t[first] for t in (q_start, q_len, lo, k_start, kv_len)
        )
    entry_seq = keys.sequence[lo] if lo.numel() else lo
    materialize = q_len.numel() > 1 and int(torch.unique(entry_seq).numel()) < q_len.numel()
    if materialize:
        mat_start, mat_rows = _own_key_rows(q_start, kv_len)
        entry_copy = _entry_copies(entry_seq, kv_len)
    else:
        mat_start, mat_rows, entry_copy = k_start, keys.count, torch.zeros_like(q_len)
    copies = int(entry_copy.max()) + 1 if entry_copy.numel() else 1
    keys_covered = not materialize and _keys_covered(keys, k_start, kv_len)
    tables = (q_start, q_len, k_start, kv_len, mat_start, span_source, local_to_span, entry_copy)
    work = int((compact - keys.sequence_start[compact] + 1).sum())
    return tables, (identity, query_rows, materialize, mat_rows, keys_covered, copies, work)


def _spans(compact: torch.Tensor, seq: torch.Tensor, merge_gap: int) -> dict:
    """The rank's rows in compact key order (``order``, ``sorted_compact``), cut into spans of
    one sequence with gaps under ``merge_gap``: each span's first and last sorted row, its first
    compact key and its length in keys (own rows and dummies)."""
    n = int(compact.numel())
    order = ascending_order(compact)
    sorted_compact, sorted_seq = compact[order], seq[order]
    gaps = sorted_compact[1:] - sorted_compact[:-1]
    new_span = (gaps > max(int(merge_gap), 1)) | (sorted_seq[1:] != sorted_seq[:-1])
    firsts = torch.nonzero(torch.cat([torch.ones(min(n, 1), dtype=torch.bool), new_span]))
    firsts = firsts.flatten()
    lasts = torch.cat([firsts[1:] - 1, torch.tensor([n - 1])]) if n else firsts
    span_lo = sorted_compact[firsts]
    return dict(
        seq=seq,
        order=order,
        sorted_compact=sorted_compact,
        firsts=firsts,
        lasts=lasts,
        lo=span_lo,
        len=sorted_compact[lasts] + 1 - span_lo,
    )


def _query_layout(compact: torch.Tensor, spans: dict, num_keys: int, padding_rows: int):
    """Where each entry's query rows lie: ``(identity, query_rows, q_start, q_len, lo,
    span_source, local_to_span)``, ``lo`` the first compact key of each entry. The local rows
    themselves when they already form the spans in local order (no dummies, as many maximal
    runs), else a span buffer gathered from them."""
    n = int(compact.numel())
    seq, span_lo, span_len = spans["seq"], spans["lo"], spans["len"]
    if int(span_len.sum()) == n:
        # The local order holds the same runs iff it has as many maximal runs.
        local_breaks = ((compact[1:] - compact[:-1]) != 1) | (seq[1:] != seq[:-1])
        if n == 0 or int(local_breaks.sum()) + 1 == int(spans["firsts"].numel()):
            local_firsts = torch.nonzero(
                torch.cat([torch.ones(min(n, 1), dtype=torch.bool), local_breaks])
            ).flatten()
            local_lasts = torch.cat([local_firsts[1:], torch.tensor([n])]) if n else local_firsts
            lo = compact[local_firsts] if n else local_firsts
            q_len = local_lasts - local_firsts
            return True, n + padding_rows, local_firsts, q_len, lo, None, None
    q_start = torch.cumsum(span_len, 0) - span_len
    query_rows = int(span_len.sum())
    # Query-buffer row j holds compact key (lo of its span + offset), owned locally or not.
    span_id = torch.repeat_interleave(torch.arange(span_len.numel()), span_len)
    span_key = torch.arange(query_rows) - q_start[span_id] + span_lo[span_id]
    local_of_key = torch.full((num_keys,), -1, dtype=torch.int64)
    local_of_key[compact] = torch.arange(n)
    span_source = local_of_key[span_key]
    firsts, lasts, order = spans["firsts"], spans["lasts"], spans["order"]
    sorted_span = torch.repeat_interleave(torch.arange(firsts.numel()), lasts - firsts + 1)
    local_to_span = torch.empty(n, dtype=torch.int64)
    local_to_span[order] = spans["sorted_compact"] - span_lo[sorted_span] + q_start[sorted_span]
    return False, query_rows, q_start, span_len, span_lo, span_source, local_to_span


def _entry_copies(entry_seq: torch.Tensor, kv_len: torch.Tensor) -> torch.Tensor:
    """int64 ``[B]``: each entry's rank by key count (longest first, then entry order) among
    the entries of its sequence (``AttentionRuns.entry_copy``)."""
    by_len = torch.argsort(kv_len, descending=True, stable=True)
    order = by_len[torch.argsort(entry_seq[by_len], stable=True)]
    rank = torch.arange(order.numel()) - _run_starts(entry_seq[order])
    out = torch.empty_like(rank)
    out[order] = rank
    return out


def _own_key_rows(q_start, kv_len):
    """Each entry's own key-gradient rows: ``(mat_start, mat_rows)``. Packed in the order of
    the entries' query rows, not the kernel's entry order: entries with neighbouring query rows
    then have neighbouring key-gradient rows, and a backward cut into windows of both
    (``AttentionRuns.backward_windows``) gets narrow windows."""
    order = ascending_order(q_start)
    packed = torch.cumsum(kv_len[order], 0) - kv_len[order]
    mat_start = torch.empty_like(kv_len)
    mat_start[order] = packed
    return mat_start, int(kv_len.sum())


def _key_gradient_rows(k_start, mat_start, kv_len, key_rows: int):
    """``(row, key, entry)``, int64 ``[key_rows]`` each on the tables' device: for every
    key-gradient row the entries write, the row, its compact key and its entry (entries with
    no keys, such as padding entries, write none)."""
    entry, offset = spread(kv_len, key_rows)
    return mat_start[entry] + offset, k_start[entry] + offset, entry


def key_sources(k_start, mat_start, kv_len, key_rows: int, mat_rows: int) -> torch.Tensor:
    """int64 ``[mat_rows]``: the compact key of each key-gradient row (-1: no entry writes it),
    from the per-entry tables, on their device (``AttentionRuns.kv_source``)."""
    row, key, _ = _key_gradient_rows(k_start, mat_start, kv_len, key_rows)
    out = torch.full((int(mat_rows),), -1, dtype=torch.int64, device=kv_len.device)
    out[row] = key
    return out


def slot_copy_rows(
    k_start, mat_start, kv_len, key_rows: int, entry_copy, materialize: bool, copies: int,
    compact_slots: Optional[torch.Tensor], slots: int, num_keys: int,
) -> torch.Tensor:  # fmt: skip
    """int64 ``[copies, slots]``: row ``j`` names each all-gather slot's backward buffer row of
    its key's copy ``j`` (-1: none); a slot's gradient is the sum of its copies
    (``AttentionRuns.slot_copies``). With ``materialize`` a row's copy is its entry's
    ``entry_copy``; else the rows are the compact keys, one copy each. On the tables' device."""
    device = kv_len.device
    if materialize:
        row, key, entry = _key_gradient_rows(k_start, mat_start, kv_len, key_rows)
        copy = entry_copy[entry]
    else:
        row = key = torch.arange(int(num_keys), device=device)
        copy = 0
    slot = key if compact_slots is None else compact_slots[key]
    out = torch.full((int(copies) * int(slots),), -1, dtype=torch.int64, device=device)
    out[copy * int(slots) + slot] = row
    return out.view(int(copies), int(slots))


def _keys_covered(keys: CompactKeys, k_start, kv_len) -> bool:
    """Without copies, whether every compact key is attended by some entry: a key past this
    rank's last row of its sequence is not, so its gradient row must start at zero instead of
    being written."""
    if not kv_len.numel():
        return False
    seq_end = _run_ends(keys.sequence)
    ends = torch.zeros(keys.count, dtype=torch.int64)
    ends[k_start] = k_start + kv_len
    return bool(torch.equal(torch.cummax(ends, 0).values, seq_end))
