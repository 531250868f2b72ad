"""``ContextParallelPlan``: which CP rank owns which source positions, in local row order.

A plan is host-side and immutable. It is validated once, when built, and lazily caches the
device index tensors the row ops need (one copy per device), so the per-call path of a gather
never reads device memory back to the host.

Index conventions used by the row ops (all int64):

* ``local_positions(r)`` ``[counts[r]]``: source position of each local row of rank ``r``.
* ``slot_positions(device)`` ``[cp_size * max_count]``: for each slot of the padded all-gather
  buffer (rank ``r``'s row ``i`` is slot ``r * max_count + i``) its source position, or -1 for a
  padding slot.
* ``row_source(device)`` ``[seq_len]``: for each source position the slot that holds it, or -1
  when no rank owns it (such rows come out as zeros).
"""

from __future__ import annotations

import hashlib
from typing import List, Optional, Sequence, Tuple, Union

import torch

from megatron.context_parallel.comm import errors

__all__ = ["ContextParallelPlan"]

PositionsLike = Union[Sequence[int], torch.Tensor]

_INT_DTYPES = (torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8)


def _as_positions(value: PositionsLike, what: str) -> torch.Tensor:
    """A 1-D int64 CPU tensor from a list or tensor of positions; ValueError on other dtypes."""
    if isinstance(value, torch.Tensor):
        if value.dtype not in _INT_DTYPES:
            raise ValueError(f"{what} must have an integer dtype, got {value.dtype}")
        if value.dim() != 1:
            raise ValueError(f"{what} must be 1-D, got shape {tuple(value.shape)}")
        return value.detach().to(device="cpu", dtype=torch.int64).clone()
    items = list(value)
    for item in items:
        # bool is an int subclass in Python, but a mask is never a position list.
        if isinstance(item, bool) or not isinstance(item, int):
            raise ValueError(f"{what} must hold integers, got {type(item).__name__} ({item!r})")
    return torch.tensor(items, dtype=torch.int64)


def as_cu_seqlens(cu_seqlens: PositionsLike) -> Tuple[int, ...]:
    """Validated host tuple of cumulative sequence lengths (starts at 0, never decreases).

    A device tensor is read back once here: pass a list or a CPU tensor to avoid the sync.
    """
    t = _as_positions(cu_seqlens, "cu_seqlens")
    if t.numel() < 1 or int(t[0]) != 0:
        raise ValueError(f"cu_seqlens must start at 0, got {t.tolist()[:4]}")
    if t.numel() > 1 and bool((t[1:] < t[:-1]).any()):
        raise ValueError(f"cu_seqlens must be non-decreasing, got {t.tolist()}")
    return tuple(int(x) for x in t.tolist())


class ContextParallelPlan:
    """Ownership of the source positions ``0 .. seq_len-1`` by the ranks of a CP group.

    ``local_positions(r)`` are the source positions rank ``r`` holds, in the order of its local
    rows. Shards may be uneven or empty; positions that no rank owns are allowed and come out of
    a gather as zero rows that receive no gradient. Build plans with the class methods; plans
    compare equal when they own the same positions in the same order.

    Attributes:
        cp_size: number of ranks in the CP group.
        seq_len: length of the full (packed) sequence.
        counts: rows per rank, a tuple of ``cp_size`` ints.
        max_count: the largest count; every rank's shard is padded to it for the all-gather.
        cu_seqlens: cumulative sequence lengths of packed input (``(0, l0, l0+l1, ...)``), or
            None for one unpacked sequence.
        fingerprint: a 63-bit hash of the plan, used to check that every rank uses the same one.
        slots_in_source_order: True when all-gather slot ``s`` holds position ``s`` for every
            ``s < seq_len`` and there is no padding (a contiguous plan with equal shards): the
            all-gather buffer is then already the full output and needs no reorder.
    """

    __slots__ = (
        "_positions",
        "cp_size",
        "seq_len",
        "counts",
        "max_count",
        "cu_seqlens",
        "fingerprint",
        "_device_cache",
        "slots_in_source_order",
    )

    def __init__(
        self,
        rank_positions: Sequence[torch.Tensor],
        seq_len: int,
        cu_seqlens: Optional[Tuple[int, ...]] = None,
        *,
        _validated: bool = False,
    ):
        """Use the class methods; this constructor expects int64 CPU tensors."""
        if not _validated:
            rank_positions = [
                _as_positions(p, f"rank_positions[{r}]") for r, p in enumerate(rank_positions)
            ]
            self._validate(rank_positions, seq_len, cu_seqlens)
        positions = tuple(rank_positions)
        counts = tuple(int(p.numel()) for p in positions)
        object.__setattr__(self, "_positions", positions)
        object.__setattr__(self, "cp_size", len(positions))
        object.__setattr__(self, "seq_len", int(seq_len))
        object.__setattr__(self, "counts", counts)
        object.__setattr__(self, "max_count", max(counts) if counts else 0)
        object.__setattr__(self, "cu_seqlens", cu_seqlens)
        object.__setattr__(self, "fingerprint", self._compute_fingerprint())
        object.__setattr__(self, "_device_cache", {})
        object.__setattr__(self, "slots_in_source_order", self._slots_are_positions())

    def __setattr__(self, name, value):
        raise AttributeError(f"ContextParallelPlan is immutable (cannot set {name!r})")

    # ------------------------------------------------------------------ constructors

    @classmethod
    def from_rank_positions(
        cls,
        rank_positions: Sequence[PositionsLike],
        seq_len: Optional[int] = None,
        cu_seqlens: Optional[PositionsLike] = None,
    ) -> "ContextParallelPlan":
        """A plan from every rank's source positions in local row order.

        Args:
            rank_positions: ``rank_positions[r]`` is a list or 1-D integer tensor of the source
                positions rank ``r`` holds, in its local row order. May be empty.
            seq_len: full sequence length; defaults to the largest position + 1, or to
                ``cu_seqlens[-1]`` when that is given.
            cu_seqlens: cumulative lengths of the packed sequences (starting at 0, ending at
                ``seq_len``), kept so full outputs can be split per sequence.

        Raises:
            ValueError: no ranks, a non-integer dtype, a negative position or one >= seq_len,
                or a position owned twice (the message names the ranks).
        """
        if len(rank_positions) == 0:
            raise ValueError("rank_positions must list at least one rank")
        tensors = [_as_positions(p, f"rank_positions[{r}]") for r, p in enumerate(rank_positions)]
        cu = None if cu_seqlens is None else as_cu_seqlens(cu_seqlens)
        if seq_len is None and cu is not None:
            seq_len = cu[-1]
        if seq_len is None:
            nonempty = [int(t.max()) for t in tensors if t.numel() > 0]
            seq_len = max(nonempty) + 1 if nonempty else 0
        elif isinstance(seq_len, bool) or not isinstance(seq_len, int):
            raise ValueError(f"seq_len must be an int, got {seq_len!r}")
        cls._validate(tensors, seq_len, cu)
        return cls(tensors, seq_len, cu, _validated=True)

    @classmethod
    def zigzag(cls, seq_len: int, cp_size: int) -> "ContextParallelPlan":
        """Megatron's load-balanced causal layout (``get_batch_on_this_cp_rank``).

        The sequence is cut into ``2 * cp_size`` equal chunks; rank ``r`` holds chunk ``r``
        followed by chunk ``2 * cp_size - 1 - r``.

        Raises:
            ValueError: ``seq_len`` is not divisible by ``2 * cp_size``.
        """
        cls._check_cp_size(cp_size)
        if seq_len < 0 or seq_len % (2 * cp_size) != 0:
            raise ValueError(
                f"zigzag needs seq_len divisible by 2*cp_size={2 * cp_size}, got seq_len={seq_len}"
            )
        chunk = seq_len // (2 * cp_size)
        positions = [cls._zigzag_rank(0, chunk, cp_size, r) for r in range(cp_size)]
        return cls(positions, seq_len, _validated=True)

    @classmethod
    def contiguous(cls, seq_len: int, cp_size: int) -> "ContextParallelPlan":
        """Rank ``r`` holds the ``r``-th contiguous block; sizes as ``torch.tensor_split``."""
        cls._check_cp_size(cp_size)
        if seq_len < 0:
            raise ValueError(f"seq_len must be >= 0, got {seq_len}")
        blocks = torch.tensor_split(torch.arange(seq_len, dtype=torch.int64), cp_size)
        return cls([b.clone() for b in blocks], seq_len, _validated=True)

    @classmethod
    def thd(cls, cu_seqlens: PositionsLike, cp_size: int) -> "ContextParallelPlan":
        """Packed sequences split as TransformerEngine's ``thd_get_partitioned_indices`` does.

        Every sequence is cut into ``2 * cp_size`` equal chunks; rank ``r`` holds chunk ``r``
        then chunk ``2 * cp_size - 1 - r`` of each sequence, sequences in order. The plan keeps
        ``cu_seqlens`` so a full output can be split per sequence (``split_sequences``).

        Raises:
            ValueError: a sequence length is not divisible by ``2 * cp_size``, or
                ``cu_seqlens`` does not start at 0 or decreases.
        """
        cls._check_cp_size(cp_size)
        cu = as_cu_seqlens(cu_seqlens)
        lengths = [b - a for a, b in zip(cu[:-1], cu[1:])]
        for i, length in enumerate(lengths):
            if length % (2 * cp_size) != 0:
                raise ValueError(
                    f"thd needs every sequence length divisible by 2*cp_size={2 * cp_size}; "
                    f"sequence {i} has length {length}"
                )
        positions = []
        for r in range(cp_size):
            parts = [
                cls._zigzag_rank(start, length // (2 * cp_size), cp_size, r)
                for start, length in zip(cu[:-1], lengths)
            ]
            positions.append(torch.cat(parts) if parts else torch.zeros(0, dtype=torch.int64))
        return cls(positions, cu[-1], cu, _validated=True)

    @classmethod
    def from_local_positions(
        cls, local_positions: PositionsLike, group, seq_len: Optional[int] = None
    ) -> "ContextParallelPlan":
        """Collective: each rank passes its own positions; every rank gets the same plan.

        Two small all-gathers over ``group`` (counts and ``seq_len``, then the padded
        positions), both on the group's collective device. A rank whose positions are not a
        1-D integer list raises on every rank, as does any plan error (a position owned twice).

        Args:
            local_positions: this rank's source positions in local row order.
            group: the CP process group (every rank of it must call this).
            seq_len: full length; defaults to the largest position of any rank + 1. Must be the
                same on every rank when given.
        """
        from megatron.context_parallel.comm import groups

        problem, mine = None, torch.zeros(0, dtype=torch.int64)
        try:
            mine = _as_positions(local_positions, "local_positions")
            if seq_len is not None and (isinstance(seq_len, bool) or not isinstance(seq_len, int)):
                raise ValueError(f"seq_len must be an int, got {seq_len!r}")
        except Exception as exc:  # noqa: BLE001 - every rank must hear of it
            problem = exc
        size = groups.group_rank_and_size(group)[1]
        given = -1 if seq_len is None or problem is not None else seq_len
        rows = groups.agree(problem, group, (mine.numel(), given))
        groups.raise_if_calls_differ([row[1:] for row in rows])
        longest = max(row[0] for row in rows)
        device = groups.collective_device(group)
        padded = torch.full((longest,), -1, dtype=torch.int64)
        padded[: mine.numel()] = mine
        everyone = torch.empty(size * longest, dtype=torch.int64, device=device)
        groups.all_gather_into(everyone, padded.to(device), group)
        everyone = everyone.view(size, longest).cpu()
        rank_positions = [everyone[r, : rows[r][0]].clone() for r in range(size)]
        # Every rank builds the plan from the same numbers, so any error here is the same
        # error on every rank.
        return cls.from_rank_positions(rank_positions, seq_len)

    # ------------------------------------------------------------------ queries

    def local_positions(self, rank: int, device: Optional[torch.device] = None) -> torch.Tensor:
        """Source positions of rank ``rank``'s local rows: int64 ``[counts[rank]]``.

        On CPU (default) a fresh copy; on another device the plan's cached copy (do not modify).
        """
        if not 0 <= rank < self.cp_size:
            raise ValueError(f"rank {rank} out of range for a plan of cp_size {self.cp_size}")
        if device is None or torch.device(device).type == "cpu":
            return self._positions[rank].clone()
        return self._cached(("local", rank), device, lambda: self._positions[rank])

    def slot_positions(self, device: Union[str, torch.device] = "cpu") -> torch.Tensor:
        """int64 ``[cp_size * max_count]``: source position of each all-gather slot, -1 = pad."""
        return self._cached("slots", device, self._build_slot_positions)

    def row_source(self, device: Union[str, torch.device] = "cpu") -> torch.Tensor:
        """int64 ``[seq_len]``: the all-gather slot holding each position, -1 = nobody owns it."""
        return self._cached("row_source", device, self._build_row_source)

    def owned_mask(self) -> torch.Tensor:
        """bool ``[seq_len]`` (CPU): True where some rank owns the position."""
        return self.row_source("cpu") >= 0

    def rank_in(self, group) -> int:
        """This process's rank in ``group`` (a CP group of ``cp_size`` ranks; None = one rank).

        The one check that a group fits a plan, used by every mapping.

        Raises:
            errors.InputError: the group's size is not ``cp_size``.
        """
        from megatron.context_parallel.comm.groups import group_rank_and_size

        rank, size = group_rank_and_size(group)
        if size != self.cp_size:
            raise errors.make("group_size", size, self.cp_size)
        return rank

    def rank_in_single(self) -> int:
        """0, for a caller that runs as the only rank; raises when ``cp_size`` is not 1."""
        if self.cp_size != 1:
            raise errors.make("group_size", 1, self.cp_size)
        return 0

    # The length of ``agreement_values()``: callers put these first in a call's description.
    AGREEMENT_VALUES = 3

    def agreement_values(self) -> Tuple[int, int, int]:
        """``(fingerprint, seq_len, cp_size)``: what ranks compare to know they share a plan."""
        return (self.fingerprint, self.seq_len, self.cp_size)

    @staticmethod
    def raise_unless_same(rows: Sequence[Sequence[int]]) -> None:
        """Raises ``plans_differ`` on every rank when the ranks' ``agreement_values`` differ.

        Args:
            rows: every rank's ``agreement_values()`` (as exchanged), in rank order.
        """
        n = ContextParallelPlan.AGREEMENT_VALUES
        first = tuple(rows[0][:n])
        for row in rows[1:]:
            if tuple(row[:n]) != first:
                raise errors.make("plans_differ", first[1], row[1], first[2], row[2])

    def verify(self, group) -> "ContextParallelPlan":
        """Collective: checks that every rank of ``group`` holds this same plan; returns self.

        One small all-gather (fingerprint, ``seq_len``, ``cp_size`` and any local problem) on
        the group's collective device. Idempotent and stateless: it may be called any number of
        times, and every call of a mapping makes the same check inside its own exchange, so
        calling it is only a way to fail early (say, right after building the plans).

        Raises:
            errors.InputError: on every rank alike, when the group's size is not ``cp_size`` on
                some rank or the ranks' plans differ.
        """
        from megatron.context_parallel.comm import groups

        problem = None
        try:
            self.rank_in(group)
        except errors.InputError as exc:
            problem = exc
        self.raise_unless_same(groups.agree(problem, group, self.agreement_values()))
        return self

    @property
    def sequence_lengths(self) -> Tuple[int, ...]:
        """Lengths of the packed sequences (one entry, ``seq_len``, without cu_seqlens)."""
        if self.cu_seqlens is None:
            return (self.seq_len,)
        cu = self.cu_seqlens
        return tuple(b - a for a, b in zip(cu[:-1], cu[1:]))

    def split_sequences(self, full: torch.Tensor, seq_dim: int = 0) -> List[torch.Tensor]:
        """Per-sequence views of a full-sequence tensor (size ``seq_len`` along ``seq_dim``).

        One view per packed sequence of ``cu_seqlens`` (one view of everything without it).
        """
        if full.dim() == 0 or not -full.dim() <= seq_dim < full.dim():
            raise ValueError(f"seq_dim {seq_dim} out of range for a {full.dim()}-D tensor")
        if full.shape[seq_dim] != self.seq_len:
            raise ValueError(
                f"split_sequences needs size {self.seq_len} along dim {seq_dim}, "
                f"got {full.shape[seq_dim]}"
            )
        return list(torch.split(full, list(self.sequence_lengths), dim=seq_dim))

    # ------------------------------------------------------------------ dunder

    def __eq__(self, other) -> bool:
        if not isinstance(other, ContextParallelPlan):
            return NotImplemented
        return (
            self.fingerprint == other.fingerprint
            and self.seq_len == other.seq_len
            and self.counts == other.counts
            and self.cu_seqlens == other.cu_seqlens
            and all(torch.equal(a, b) for a, b in zip(self._positions, other._positions))
        )

    def __hash__(self) -> int:
        return self.fingerprint

    def __repr__(self) -> str:
        extra = f", sequences={len(self.cu_seqlens) - 1}" if self.cu_seqlens is not None else ""
        return (
            f"ContextParallelPlan(cp_size={self.cp_size}, seq_len={self.seq_len}, "
            f"counts={self.counts}{extra})"
        )

    def __reduce__(self):
        return (_rebuild_plan, (list(self._positions), self.seq_len, self.cu_seqlens))

    # ------------------------------------------------------------------ internals

    @staticmethod
    def _check_cp_size(cp_size: int) -> None:
        if isinstance(cp_size, bool) or not isinstance(cp_size, int) or cp_size < 1:
            raise ValueError(f"cp_size must be a positive int, got {cp_size!r}")

    @staticmethod
    def _zigzag_rank(start: int, chunk: int, cp_size: int, rank: int) -> torch.Tensor:
        first = torch.arange(rank * chunk, (rank + 1) * chunk, dtype=torch.int64)
        mirror = 2 * cp_size - 1 - rank
        second = torch.arange(mirror * chunk, (mirror + 1) * chunk, dtype=torch.int64)
        return torch.cat([first, second]) + start

    @staticmethod
    def _validate(
        positions: Sequence[torch.Tensor], seq_len: int, cu_seqlens: Optional[Tuple[int, ...]]
    ) -> None:
        if seq_len < 0:
            raise ValueError(f"seq_len must be >= 0, got {seq_len}")
        for r, p in enumerate(positions):
            if p.numel() == 0:
                continue
            low, high = int(p.min()), int(p.max())
            if low < 0:
                raise ValueError(f"rank {r} holds negative position {low}")
            if high >= seq_len:
                raise ValueError(f"rank {r} holds position {high} >= seq_len {seq_len}")
        if not positions:
            return
        flat = torch.cat(list(positions))
        if flat.numel() == 0:
            return
        owners = torch.cat(
            [torch.full((p.numel(),), r, dtype=torch.int64) for r, p in enumerate(positions)]
        )
        order = torch.argsort(flat, stable=True)
        sorted_pos = flat[order]
        dup = torch.nonzero(sorted_pos[1:] == sorted_pos[:-1]).flatten()
        if dup.numel() > 0:
            pos = int(sorted_pos[int(dup[0])])
            ranks = sorted(set(owners[order][sorted_pos == pos].tolist()))
            where = f"ranks {ranks}" if len(ranks) > 1 else f"rank {ranks[0]} (twice in its rows)"
            raise ValueError(
                f"position {pos} is owned twice, by {where}; "
                f"{dup.numel()} duplicate position(s) in all"
            )
        if cu_seqlens is not None and cu_seqlens[-1] != seq_len:
            raise ValueError(f"cu_seqlens ends at {cu_seqlens[-1]} but seq_len is {seq_len}")

    def _compute_fingerprint(self) -> int:
        h = hashlib.blake2b(digest_size=8)
        h.update(repr((self.seq_len, self.counts, self.cu_seqlens)).encode())
        for p in self._positions:
            h.update(p.numpy().tobytes())
        return int.from_bytes(h.digest(), "little") & ((1 << 63) - 1)

    def _cached(self, key, device, build) -> torch.Tensor:
        device = torch.device(device)
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        cache_key = (key, device)
        tensor = self._device_cache.get(cache_key)
        if tensor is None:
            tensor = build().to(device)
            self._device_cache[cache_key] = tensor
        return tensor

    def _slots_are_positions(self) -> bool:
        if self.cp_size * self.max_count != self.seq_len:
            return False
        return bool(torch.equal(self._build_slot_positions(), torch.arange(self.seq_len)))

    def _build_slot_positions(self) -> torch.Tensor:
        slots = torch.full((self.cp_size, self.max_count), -1, dtype=torch.int64)
        for r, p in enumerate(self._positions):
            slots[r, : p.numel()] = p
        return slots.flatten()

    def _build_row_source(self) -> torch.Tensor:
        source = torch.full((self.seq_len,), -1, dtype=torch.int64)
        slots = self._build_slot_positions()
        valid = torch.nonzero(slots >= 0).flatten()
        source[slots[valid]] = valid
        return source


def _rebuild_plan(positions, seq_len, cu_seqlens):
    return ContextParallelPlan(positions, seq_len, cu_seqlens, _validated=True)
