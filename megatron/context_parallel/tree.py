"""``PrefixTree``: shared-prefix packing of a batch, and ``tree_plan``, its default CP plan.

A prefix tree packs sequences that share prefixes (a GRPO prompt and its completions) into one
sequence of ``seq_len`` positions without repeating the shared part. The packed sequence is a
list of *segments*, each a contiguous range of positions; segment ``i`` continues the sequence
of its parent ``parents[i]`` (an earlier segment) or starts a new one (``-1``, a root). A
root-to-leaf path of segments is one of the original sequences.

Like ``ContextParallelPlan`` a tree is host-side and immutable: it is validated once, when
built, and lazily caches its derived int64 CPU tensors (and the device copies ``labels`` and
``visible`` index with, one per device), so per-call paths never read device memory back.

Flat packing is the special case of a forest of roots without children (``parents`` all -1,
``lengths`` the sequence lengths): ``visible`` is then "same sequence and causal".
"""

from __future__ import annotations

import hashlib
import math
import numbers
from typing import Dict, List, Sequence, Tuple, Union

import torch

from megatron.context_parallel.comm.plan import ContextParallelPlan

__all__ = ["PrefixTree", "tree_plan", "plan_balance"]

IntsLike = Union[Sequence[int], torch.Tensor]

_IGNORE_INDEX = -100
_INT_DTYPES = (torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8)


def _as_ints(value: IntsLike, what: str) -> Tuple[int, ...]:
    """A tuple of python ints from a sequence of ints or a 1-D integer tensor.

    Raises:
        ValueError: a non-integer dtype or item (bool included), naming the segment.
    """
    if isinstance(value, torch.Tensor):
        if value.dtype not in _INT_DTYPES:
            raise ValueError(f"{what} must have an integer dtype, got {value.dtype}")
        if value.dim() != 1:
            raise ValueError(f"{what} must be 1-D, got shape {tuple(value.shape)}")
        return tuple(int(x) for x in value.tolist())
    if isinstance(value, (str, bytes)):
        raise ValueError(f"{what} must be a sequence of ints, got {type(value).__name__}")
    items = list(value)
    for i, item in enumerate(items):
        # bool is an int subclass in Python, but a mask is never a parent or a length.
        if isinstance(item, bool) or not isinstance(item, numbers.Integral):
            raise ValueError(
                f"segment {i}: {what} entry must be an int, got {type(item).__name__} ({item!r})"
            )
    return tuple(int(x) for x in items)


def _device_of(device: Union[str, torch.device]) -> torch.device:
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return device


class PrefixTree:
    """Shared-prefix packing: segments in packed order, each a contiguous range of positions.

    Segment ``i`` covers positions ``starts[i] .. starts[i] + lengths[i] - 1``; segments follow
    each other in packed order without gaps. Its rows continue the sequence of ``parents[i]``
    (which must be an earlier segment) or, for ``-1``, start one. Any depth, any number of roots,
    single-child chains and one-token segments are allowed. Trees compare equal when their
    ``parents`` and ``lengths`` are equal; they pickle (spawned workers receive them).

    Attributes (tuples of python ints unless said otherwise):
        parents: parent segment of each segment, -1 for a root.
        lengths: positions of each segment (each >= 1).
        starts: first position of each segment.
        seq_len: total positions, ``sum(lengths)``.
        num_segments: number of segments.
        children: for each segment the tuple of its children, in packed order.
        depth: for each segment its depth (a root has depth 0).
        max_children: ``K``, the number of label columns of ``labels``: ``max(1, largest
            number of children)``.
        fingerprint: a 63-bit hash of ``(parents, lengths)``, used to check that every rank
            uses the same tree.
    """

    __slots__ = (
        "parents",
        "lengths",
        "starts",
        "seq_len",
        "num_segments",
        "children",
        "depth",
        "max_children",
        "fingerprint",
        "_cache",
    )

    def __init__(self, parents: IntsLike, lengths: IntsLike):
        """Validates and builds a tree.

        Args:
            parents: ``parents[i]`` is -1 (a root) or the index of an earlier segment.
            lengths: ``lengths[i]`` is the number of positions of segment ``i``, an int >= 1.

        Raises:
            ValueError: no segments, ``parents`` and ``lengths`` of different sizes, or a
                segment whose parent is not -1 or an earlier segment, or whose length is not a
                positive int (bools are refused). The message names the segment.
        """
        parents = _as_ints(parents, "parent")
        lengths = _as_ints(lengths, "length")
        if len(parents) != len(lengths):
            raise ValueError(
                f"parents has {len(parents)} entries but lengths has {len(lengths)}; "
                "a PrefixTree needs one of each per segment"
            )
        if not parents:
            raise ValueError("a PrefixTree needs at least one segment, got none")
        for i, (parent, length) in enumerate(zip(parents, lengths)):
            if parent != -1 and not 0 <= parent < i:
                raise ValueError(
                    f"segment {i}: parent {parent} is not an earlier segment (nor -1 for a root)"
                )
            if length < 1:
                raise ValueError(f"segment {i}: length {length} is not a positive int")
        starts, depth, children, position = [], [], [[] for _ in parents], 0
        for i, (parent, length) in enumerate(zip(parents, lengths)):
            starts.append(position)
            position += length
            if parent == -1:
                depth.append(0)
            else:
                depth.append(depth[parent] + 1)
                children[parent].append(i)
        object.__setattr__(self, "parents", parents)
        object.__setattr__(self, "lengths", lengths)
        object.__setattr__(self, "starts", tuple(starts))
        object.__setattr__(self, "seq_len", position)
        object.__setattr__(self, "num_segments", len(parents))
        object.__setattr__(self, "children", tuple(tuple(c) for c in children))
        object.__setattr__(self, "depth", tuple(depth))
        object.__setattr__(self, "max_children", max(1, max(len(c) for c in children)))
        h = hashlib.blake2b(digest_size=8)
        h.update(repr(("PrefixTree", parents, lengths)).encode())
        object.__setattr__(self, "fingerprint", int.from_bytes(h.digest(), "little") >> 1)
        object.__setattr__(self, "_cache", {})

    def __setattr__(self, name, value):
        raise AttributeError(f"PrefixTree is immutable (cannot set {name!r})")

    # ------------------------------------------------------------------ checks

    def check_seq_len(self, seq_len: int) -> None:
        """Raises ValueError (naming both numbers) unless ``seq_len`` is the tree's ``seq_len``."""
        if isinstance(seq_len, bool) or not isinstance(seq_len, numbers.Integral):
            raise ValueError(
                f"seq_len must be an int, got {seq_len!r} (the tree has {self.seq_len})"
            )
        if int(seq_len) != self.seq_len:
            raise ValueError(
                f"the input has {int(seq_len)} positions but the PrefixTree has seq_len "
                f"{self.seq_len}"
            )

    def _check_segment(self, segment: int) -> int:
        if isinstance(segment, bool) or not isinstance(segment, numbers.Integral):
            raise ValueError(f"segment must be an int, got {segment!r}")
        if not 0 <= segment < self.num_segments:
            raise ValueError(
                f"segment {segment} out of range for a PrefixTree of {self.num_segments} segments"
            )
        return int(segment)

    # ------------------------------------------------------------------ structure

    def ancestors(self, segment: int) -> Tuple[int, ...]:
        """The ancestors of ``segment``, root first, excluding ``segment`` itself."""
        segment = self._check_segment(segment)
        path = []
        parent = self.parents[segment]
        while parent != -1:
            path.append(parent)
            parent = self.parents[parent]
        return tuple(reversed(path))

    def leaves(self) -> Tuple[int, ...]:
        """Segments without children, in packed order (one per packed sequence)."""
        return tuple(i for i, c in enumerate(self.children) if not c)

    def describe(self) -> Tuple[int, ...]:
        """``(num_segments, seq_len, fingerprint)``: the ints ranks compare to share a tree."""
        return (self.num_segments, self.seq_len, self.fingerprint)

    # ------------------------------------------------------------------ per-position tensors

    def segment_index(self) -> torch.Tensor:
        """int64 ``[seq_len]`` (CPU): the segment of each position (a fresh copy)."""
        return self._segment_index().clone()

    def position_ids(self) -> torch.Tensor:
        """int64 ``[seq_len]`` (CPU): position ids a single device would give each row.

        A root starts at 0; a segment continues from its parent's last position id + 1, so the
        ids along every root-to-leaf path are ``0 .. len(path) - 1``. A fresh copy.
        """
        return self._cached_cpu("position_ids", self._build_position_ids).clone()

    def leaf_positions(self) -> List[torch.Tensor]:
        """Per leaf (packed order of ``leaves()``): int64 source positions of its path.

        The path is the leaf's root-to-leaf segments, root first, each segment's positions
        ascending: ``[len(path)]``, a packed sequence in its own order. Fresh copies.
        """
        return [p.clone() for p in self._cached_cpu("leaf_positions", self._build_leaf_paths)[0]]

    def leaf_label_columns(self) -> List[torch.Tensor]:
        """Per leaf: int64 ``[len(path)]``, the ``labels`` column of each path row's next token.

        ``labels(input_ids)[leaf_positions()[j], leaf_label_columns()[j]]`` is the flat
        next-token labels of path ``j`` (its last entry -100): 0 inside a segment; ``c`` at a
        segment's last row whose next path segment is its ``c``-th child (0-based, packed
        order); 0 at the path's last row.
        """
        return [c.clone() for c in self._cached_cpu("leaf_positions", self._build_leaf_paths)[1]]

    def fork_positions(self) -> torch.Tensor:
        """int64 (CPU, sorted): last rows of segments with >= 2 children.

        The only rows where ``labels`` columns >= 1 can hold a token.
        """
        rows = [
            self.starts[i] + self.lengths[i] - 1 for i, c in enumerate(self.children) if len(c) >= 2
        ]
        return torch.tensor(rows, dtype=torch.int64)

    def labels(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Next-token labels of every row, for every path through it: int64 ``[seq_len, K]``.

        Column 0 holds the next token inside a segment; at a segment's last row column ``c``
        holds the first token of its ``c``-th child (0-based, packed order); every other entry
        (a leaf's last row, columns past a segment's children) is -100. ``K = max_children``.
        No host sync: the gather index is built once on the host and cached per device.

        Args:
            input_ids: integer ``[seq_len]`` token ids in source (packed) order, any device.

        Returns:
            int64 ``[seq_len, max_children]`` on ``input_ids``' device.

        Raises:
            ValueError: ``input_ids`` is not a 1-D integer tensor of ``seq_len`` ids.
        """
        if not isinstance(input_ids, torch.Tensor):
            raise ValueError(f"input_ids must be a tensor, got {type(input_ids).__name__}")
        if input_ids.dtype not in _INT_DTYPES:
            raise ValueError(f"input_ids must hold integer ids, got {input_ids.dtype}")
        if input_ids.dim() != 1:
            raise ValueError(
                f"input_ids must be 1-D [seq_len] = [{self.seq_len}], got shape "
                f"{tuple(input_ids.shape)}"
            )
        self.check_seq_len(input_ids.shape[0])
        source = self._on_device("label_source", input_ids.device, self._build_label_source)
        ids = input_ids.to(torch.int64)
        taken = ids.index_select(0, source.clamp(min=0).flatten()).view(source.shape)
        return torch.where(source >= 0, taken, torch.full_like(taken, _IGNORE_INDEX))

    def visible(self, query_positions: torch.Tensor, key_positions: torch.Tensor) -> torch.Tensor:
        """The dense attention mask: bool ``[q, k]``, True where the key is visible to the query.

        A key is visible iff ``0 <= key <= query`` and ``segment(key)`` is ``segment(query)``
        or one of its ancestors. A -1 (padding) key or query, or one ``>= seq_len``, sees and
        is seen by nothing. Vectorised (a DFS interval test per pair), no host sync.

        Args:
            query_positions: integer ``[q]`` source positions.
            key_positions: integer ``[k]`` source positions, on the same device.

        Returns:
            bool ``[q, k]`` on the inputs' device.
        """
        for what, t in (("query_positions", query_positions), ("key_positions", key_positions)):
            if not isinstance(t, torch.Tensor) or t.dtype not in _INT_DTYPES or t.dim() != 1:
                raise ValueError(f"{what} must be a 1-D integer tensor")
        if query_positions.device != key_positions.device:
            raise ValueError(
                f"query_positions are on {query_positions.device} but key_positions on "
                f"{key_positions.device}"
            )
        device = query_positions.device
        table = self._on_device("dfs_table", device, self._build_dfs_table)  # [3, S]
        q = query_positions.to(torch.int64)
        k = key_positions.to(torch.int64)
        q_ok = (q >= 0) & (q < self.seq_len)
        k_ok = (k >= 0) & (k < self.seq_len)
        q_enter = table[1].index_select(0, q.clamp(0, self.seq_len - 1))
        k_info = table.index_select(1, k.clamp(0, self.seq_len - 1))  # enter, exit
        k_enter, k_exit = k_info[1], k_info[2]
        inside = (k_enter[None, :] <= q_enter[:, None]) & (q_enter[:, None] < k_exit[None, :])
        causal = k[None, :] <= q[:, None]
        return inside & causal & q_ok[:, None] & k_ok[None, :]

    def conv_tail_positions(self, width: int) -> torch.Tensor:
        """int64 ``[num_segments, width]`` (CPU): the ``width`` inputs before each segment.

        For each segment the source positions of the ``width`` rows that precede its first row
        along its root path (through further ancestors when the parent is shorter), oldest
        first; -1 where the path has fewer (roots: all -1). A fresh copy.

        Raises:
            ValueError: ``width`` is not an int >= 0.
        """
        if isinstance(width, bool) or not isinstance(width, numbers.Integral) or width < 0:
            raise ValueError(f"width must be an int >= 0, got {width!r}")
        width = int(width)
        return self._cached_cpu(("conv_tail", width), lambda: self._build_conv_tail(width)).clone()

    # ------------------------------------------------------------------ dunder

    def __eq__(self, other) -> bool:
        if not isinstance(other, PrefixTree):
            return NotImplemented
        return self.parents == other.parents and self.lengths == other.lengths

    def __hash__(self) -> int:
        return self.fingerprint

    def __repr__(self) -> str:
        return (
            f"PrefixTree(num_segments={self.num_segments}, seq_len={self.seq_len}, "
            f"roots={self.parents.count(-1)}, leaves={len(self.leaves())})"
        )

    def __reduce__(self):
        return (PrefixTree, (self.parents, self.lengths))

    # ------------------------------------------------------------------ internals

    def _cached_cpu(self, key, build):
        value = self._cache.get(key)
        if value is None:
            value = build()
            self._cache[key] = value
        return value

    def _on_device(self, key, device, build) -> torch.Tensor:
        device = _device_of(device)
        value = self._cache.get((key, device))
        if value is None:
            value = self._cached_cpu(key, build).to(device)
            self._cache[(key, device)] = value
        return value

    def _segment_index(self) -> torch.Tensor:
        return self._cached_cpu(
            "segment_index",
            lambda: torch.repeat_interleave(
                torch.arange(self.num_segments, dtype=torch.int64),
                torch.tensor(self.lengths, dtype=torch.int64),
            ),
        )

    def _offsets(self) -> torch.Tensor:
        """int64 ``[seq_len]``: each row's offset inside its segment."""
        starts = torch.tensor(self.starts, dtype=torch.int64)
        return torch.arange(self.seq_len, dtype=torch.int64) - starts[self._segment_index()]

    def _ancestor_lengths(self) -> Tuple[int, ...]:
        """For each segment the total length of its ancestors (its first row's position id)."""
        total: List[int] = []
        for parent in self.parents:
            total.append(0 if parent == -1 else total[parent] + self.lengths[parent])
        return tuple(total)

    def _build_position_ids(self) -> torch.Tensor:
        first = torch.tensor(self._ancestor_lengths(), dtype=torch.int64)
        return first[self._segment_index()] + self._offsets()

    def _row_work(self) -> torch.Tensor:
        """int64 ``[seq_len]``: keys each row sees (its position id + 1)."""
        return self._cached_cpu("row_work", lambda: self._build_position_ids() + 1)

    def _build_leaf_paths(self) -> Tuple[List[torch.Tensor], List[torch.Tensor]]:
        positions, columns = [], []
        for leaf in self.leaves():
            path = self.ancestors(leaf) + (leaf,)
            pos_parts, col_parts = [], []
            for depth, segment in enumerate(path):
                start, length = self.starts[segment], self.lengths[segment]
                pos_parts.append(torch.arange(start, start + length, dtype=torch.int64))
                cols = torch.zeros(length, dtype=torch.int64)
                if depth + 1 < len(path):
                    cols[-1] = self.children[segment].index(path[depth + 1])
                col_parts.append(cols)
            positions.append(torch.cat(pos_parts))
            columns.append(torch.cat(col_parts))
        return positions, columns

    def _build_label_source(self) -> torch.Tensor:
        """int64 ``[seq_len, K]``: the position whose token each label entry takes, -1 = none."""
        source = torch.full((self.seq_len, self.max_children), -1, dtype=torch.int64)
        next_row = torch.arange(1, self.seq_len + 1, dtype=torch.int64)
        last = torch.tensor(
            [s + n - 1 for s, n in zip(self.starts, self.lengths)], dtype=torch.int64
        )
        inside = torch.ones(self.seq_len, dtype=torch.bool)
        inside[last] = False
        source[:, 0] = torch.where(inside, next_row, source[:, 0])
        for segment, kids in enumerate(self.children):
            row = self.starts[segment] + self.lengths[segment] - 1
            for c, child in enumerate(kids):
                source[row, c] = self.starts[child]
        return source

    def _build_dfs_table(self) -> torch.Tensor:
        """int64 ``[3, seq_len]``: per row its segment, and its segment's DFS enter / exit.

        Segment ``a`` is an ancestor-or-self of ``b`` iff ``enter[a] <= enter[b] < exit[a]``.
        """
        enter = [0] * self.num_segments
        exit_ = [0] * self.num_segments
        clock = 0
        roots = [i for i, p in enumerate(self.parents) if p == -1]
        stack = [(r, False) for r in reversed(roots)]
        while stack:
            segment, done = stack.pop()
            if done:
                exit_[segment] = clock
                continue
            enter[segment] = clock
            clock += 1
            stack.append((segment, True))
            stack.extend((c, False) for c in reversed(self.children[segment]))
        seg = self._segment_index()
        return torch.stack(
            [
                seg,
                torch.tensor(enter, dtype=torch.int64)[seg],
                torch.tensor(exit_, dtype=torch.int64)[seg],
            ]
        )

    def _build_conv_tail(self, width: int) -> torch.Tensor:
        tails = torch.full((self.num_segments, width), -1, dtype=torch.int64)
        if width == 0:
            return tails
        for segment, parent in enumerate(self.parents):
            if parent == -1:
                continue
            end = self.starts[parent] + self.lengths[parent]
            own = torch.arange(max(self.starts[parent], end - width), end, dtype=torch.int64)
            tails[segment] = torch.cat([tails[parent], own])[-width:]
        return tails


# ---------------------------------------------------------------------- plans for trees


def _check_positive(value, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
        raise ValueError(f"{what} must be a positive int, got {value!r}")
    return int(value)


def tree_plan(tree: PrefixTree, cp_size: int, *, block: int = 64) -> ContextParallelPlan:
    """The default plan for a tree: balances attention work and tokens across ranks.

    A row's attention work is the number of keys it sees (its ancestors' total length + its
    offset in its segment + 1, i.e. its position id + 1). The positions are cut into blocks of
    ``block`` consecutive rows (the last one shorter; ``block`` shrinks to ``ceil(seq_len /
    cp_size)`` for short trees so every rank gets rows). Blocks go, heaviest first (ties: lower
    position first), to the rank with the least work so far among those still under the token
    cap ``ceil(seq_len / cp_size) + block`` (ties: lower rank). Each rank's rows are in ascending
    source order. Deterministic: every rank builds the same plan from the same tree.

    Args:
        tree: the batch's ``PrefixTree``.
        cp_size: ranks of the CP group.
        block: rows per block, a positive int.

    Returns:
        A ``ContextParallelPlan`` of ``tree.seq_len`` positions, each owned exactly once
        (``cu_seqlens`` None: a tree is not a flat packing).

    Raises:
        ValueError: ``tree`` is not a PrefixTree, or ``cp_size`` / ``block`` not positive ints.
    """
    if not isinstance(tree, PrefixTree):
        raise ValueError(f"tree must be a PrefixTree, got {type(tree).__name__}")
    cp_size = _check_positive(cp_size, "cp_size")
    block = _check_positive(block, "block")
    seq_len = tree.seq_len
    share = math.ceil(seq_len / cp_size)
    block = min(block, share)
    cap = share + block
    cumulative = torch.cat([torch.zeros(1, dtype=torch.int64), tree._row_work().cumsum(0)])
    bounds = list(range(0, seq_len, block)) + [seq_len]
    edges = torch.tensor(bounds, dtype=torch.int64)
    block_work = (cumulative[edges[1:]] - cumulative[edges[:-1]]).tolist()
    order = sorted(range(len(block_work)), key=lambda b: (-block_work[b], b))
    work = [0] * cp_size
    tokens = [0] * cp_size
    owned: List[List[int]] = [[] for _ in range(cp_size)]
    for b in order:
        size = bounds[b + 1] - bounds[b]
        best = -1
        for r in range(cp_size):
            if tokens[r] + size <= cap and (best < 0 or work[r] < work[best]):
                best = r
        # Never taken: were every rank above cap - size >= ceil(seq_len / cp_size) rows, the
        # ranks would hold more than seq_len rows between them.
        if best < 0:
            best = min(range(cp_size), key=lambda r: (tokens[r], r))
        work[best] += block_work[b]
        tokens[best] += size
        owned[best].append(b)
    rank_positions = []
    for blocks in owned:
        parts = [torch.arange(bounds[b], bounds[b + 1], dtype=torch.int64) for b in sorted(blocks)]
        rank_positions.append(torch.cat(parts) if parts else torch.zeros(0, dtype=torch.int64))
    return ContextParallelPlan.from_rank_positions(rank_positions, seq_len)


def plan_balance(tree: PrefixTree, plan: ContextParallelPlan) -> Dict[str, object]:
    """How evenly ``plan`` spreads ``tree``'s attention work and tokens over its ranks.

    Args:
        tree: the batch's ``PrefixTree``.
        plan: any plan of ``tree.seq_len`` positions (unowned positions count for nobody).

    Returns:
        A dict: ``work`` and ``tokens`` (per-rank tuples of ints: keys seen summed over the
        rank's rows, and its row count), ``work_max``, ``work_mean``, ``work_ratio`` (max /
        mean, 1.0 is perfect), ``tokens_max``, ``tokens_mean``, ``tokens_ratio``.

    Raises:
        ValueError: ``plan.seq_len`` is not ``tree.seq_len``.
    """
    if not isinstance(tree, PrefixTree):
        raise ValueError(f"tree must be a PrefixTree, got {type(tree).__name__}")
    if not isinstance(plan, ContextParallelPlan):
        raise ValueError(f"plan must be a ContextParallelPlan, got {type(plan).__name__}")
    tree.check_seq_len(plan.seq_len)
    row_work = tree._row_work()
    work = tuple(int(row_work[plan.local_positions(r)].sum()) for r in range(plan.cp_size))
    tokens = tuple(plan.counts)
    work_mean = sum(work) / plan.cp_size
    tokens_mean = sum(tokens) / plan.cp_size
    return {
        "work": work,
        "tokens": tokens,
        "work_max": max(work),
        "work_mean": work_mean,
        "work_ratio": max(work) / work_mean if work_mean else 1.0,
        "tokens_max": max(tokens),
        "tokens_mean": tokens_mean,
        "tokens_ratio": max(tokens) / tokens_mean if tokens_mean else 1.0,
    }
