"""Context-parallel output head: per-position fields of a forward, full sequence, source order.

``compute_forward_output`` takes this rank's final hidden rows (CP-local, in plan order), the
vocab-parallel output-layer weight (megatron-core ``ColumnParallelLinear`` layout, ``[V/TP, H]``
per tensor-parallel rank), the labels in source order and the fields a caller asked for
(``OutputOptions``). It computes every field on the local rows, then moves all of them into
source order with ONE CP gather (``mappings.gather_or_raise``).

Tensor parallelism stays inside the head: each TP rank reduces its vocab shard to a few numbers
per row (``vocab_ops.vocab_stats``: max, sum of exponentials, target logit, local top-k) with
no communication; one all-gather of those numbers over TP (``mappings``) and plain torch ops
combine them into the log-sum-exp, the target log-probs and the top-k, so vocab-wide logits are
neither gathered nor materialised for them, and autograd takes the combine's gradient back to
each shard, whose backward (``vocab_stats_backward``) recomputes its logits.

Steps of ``compute_forward_output``: ``_check_inputs`` (local, raises nothing yet), agreement
over TP (``_agree_over_tensor_parallel``: any TP rank's problem reaches the whole TP group),
``_local_fields`` (TP communication only), then the CP gather, which carries any problem to the
CP group, so every rank of TP x CP raises the same error and none waits in a collective.

Tree batches (shared-prefix packing, ``PrefixTree``) pass ``[S, K]`` labels: column 0 goes
through the path above; the rank's own fork rows (``fork_positions``), each repeated ``K - 1``
times with its other labels, run through the same vocab-parallel path as a handful of extra rows
and are scattered into the local ``[n_r, K]`` result, which rides in the same CP gather. The CP
ranks compare K, the fork positions and the tree through that gather's exchange (a zero-byte
field whose shape carries them, ``_HeadInputs.call_field``); TP ranks through
``_HeadInputs.describe``. ``ForwardOutput.samples()`` then cuts the output into the flat
root-to-leaf samples.

Gradient rule (the same as the CP gather's default): every CP rank computes the same loss on the
full outputs; each rank's input gradient is its own rows of that loss's gradient, so parameter
gradients summed over the CP group equal the single-device gradient.
"""

from __future__ import annotations

import dataclasses
import hashlib
from dataclasses import dataclass
from typing import (
    TYPE_CHECKING,
    Any,
    Callable,
    Dict,
    List,
    Mapping,
    Optional,
    Sequence,
    Tuple,
    Union,
)

import torch
import torch.distributed as dist

from megatron.context_parallel.comm import errors, groups
from megatron.context_parallel.comm.mappings import (
    copy_to_tensor_parallel_region,
    gather_from_tensor_parallel_region,
    gather_or_raise,
)
from megatron.context_parallel.comm.plan import ContextParallelPlan
from megatron.context_parallel.head import vocab_ops

if TYPE_CHECKING:  # pragma: no cover - typing only
    from megatron.context_parallel.tree import PrefixTree

__all__ = [
    "FIELDS",
    "IGNORE_INDEX",
    "OutputOptions",
    "TopK",
    "ForwardOutput",
    "compute_forward_output",
    "make_output_processor",
]

FIELDS = ("hidden_states", "target_logprobs", "top_k", "logits")

# Label value whose position has no target: its log-prob is 0.0 and gets no gradient.
IGNORE_INDEX = -100

# Columns of the per-row statistics each TP rank shares (then the top-k values and ids).
_MAX, _SUMEXP, _TARGET, _TOPK = 0, 1, 2, 3

_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


@dataclass(frozen=True)
class OutputOptions:
    """What a forward returns: the options shared by every entry point of the package.

    ``compute_forward_output``, ``make_output_processor`` and the model entry points take either
    ``options=OutputOptions(...)`` or these fields as keywords, never both.

    Attributes:
        fields: names from ``FIELDS`` (a name or a sequence); the others stay None.
        top_k: k of the ``top_k`` field (``1 <= k <= V``, checked against the vocabulary).
        gather_logits: False leaves ``logits`` rank-local (``[n_r, V/TP]``, as megatron's output
            layer makes it) and sets ``ForwardOutput.logits_are_local``; saves an ``[S, V]``
            copy per rank.
        chunk_size: None (default) lets the kernels choose; an int bounds the working memory
            of the target log-prob and top-k work: rows per chunk of the forward's torch path
            (the fused CUDA forward keeps no logits at all) and vocabulary columns per slice
            of the backward (``d_logits`` of ``[n_r, chunk_size]``), the same results either
            way up to fp32 summation order. See ``vocab_ops``.
        context_parallel_output_grad: True when CP ranks compute different losses on the full
            outputs, so output gradients are summed over CP (see the CP gather).

    Raises:
        errors.InputError: an unknown field, a non-int ``top_k`` or ``chunk_size < 1``.
    """

    fields: Union[str, Sequence[str]] = ("hidden_states",)
    top_k: int = 0
    gather_logits: bool = True
    chunk_size: Optional[int] = None
    context_parallel_output_grad: bool = False

    def __post_init__(self):
        fields = (self.fields,) if isinstance(self.fields, str) else tuple(self.fields)
        for name in fields:
            if name not in FIELDS:
                raise errors.make("unknown_field", note=f"got {name!r}")
        object.__setattr__(self, "fields", tuple(f for f in FIELDS if f in fields))
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < 0:
            raise errors.make("option", note=f"top_k must be an int >= 0, got {self.top_k!r}")
        size = self.chunk_size
        if size is not None and (isinstance(size, bool) or not isinstance(size, int) or size < 1):
            raise errors.make("chunk_size", size if isinstance(size, int) else -1)

    @classmethod
    def resolve(
        cls, options: Optional["OutputOptions"], keywords: Mapping[str, Any]
    ) -> "OutputOptions":
        """``options``, or ``OutputOptions(**keywords)``; an error naming the mix otherwise."""
        if options is None:
            unknown = set(keywords) - {f.name for f in dataclasses.fields(cls)}
            if unknown:
                raise errors.make("option", note=f"unknown output options {sorted(unknown)}")
            return cls(**keywords)
        if not isinstance(options, cls):
            raise errors.make("option", note=f"options must be an OutputOptions, got {options!r}")
        if keywords:
            raise errors.make("option", note=f"pass options= or {sorted(keywords)}, not both")
        return options

    def describe(self) -> Tuple[int, ...]:
        """Ints that ranks compare to know they asked for the same outputs."""
        mask = sum(1 << FIELDS.index(f) for f in self.fields)
        return (mask, self.top_k, int(self.gather_logits), int(self.context_parallel_output_grad))


@dataclass
class TopK:
    """The k most likely next tokens of every position.

    Attributes:
        logprobs: fp32 ``[S, k]``, descending along k; differentiable.
        tokens: int64 ``[S, k]``, vocabulary ids of ``logprobs``.
    """

    logprobs: torch.Tensor
    tokens: torch.Tensor


@dataclass
class ForwardOutput:
    """Per-position outputs of a forward for the whole (packed) input, in the caller's order.

    Each field is None unless it was requested. Position ``p`` of every field belongs to source
    position ``p`` of the input, identical on every CP rank; positions that no CP rank owns are
    zero.

    Attributes:
        hidden_states: ``[S, H]`` final hidden states (the dtype of the model).
        target_logprobs: fp32 log-prob of each position's label(s): ``[S]`` for ``[S]`` labels;
            ``[S, K]`` for ``[S, K]`` labels (a tree batch: column 0 the next token inside a
            segment, column ``c >= 1`` the first token of a fork row's ``c``-th child), whose
            columns ``>= 1`` are computed at the fork rows only and are 0.0 elsewhere. 0.0 where
            the label is -100 (no gradient there); NaN where the label is outside ``[0, V)``.
        top_k: ``TopK`` of ``[S, k]`` fp32 log-probs and int64 token ids (one distribution per
            row, whatever the labels).
        logits: ``[S, V]`` in the model dtype; or, when ``logits_are_local``, this rank's
            ``[plan.counts[cp_rank], V/TP]`` shard exactly as megatron's output layer makes it
            (rows at ``plan.local_positions(cp_rank)``, vocab ids from ``tp_rank * V/TP``).
        plan: the CP plan of the forward (its ``cu_seqlens`` split packed sequences).
        logits_are_local: True when ``logits`` was left rank-local (``gather_logits=False``).
        tree: the batch's ``PrefixTree`` (shared-prefix packing) when the forward had one, set
            by whoever built the output; ``samples()`` splits along it.
    """

    hidden_states: Optional[torch.Tensor] = None
    target_logprobs: Optional[torch.Tensor] = None
    top_k: Optional[TopK] = None
    logits: Optional[torch.Tensor] = None
    plan: Optional[ContextParallelPlan] = None
    logits_are_local: bool = False
    tree: Optional["PrefixTree"] = None

    def _refuse_local_logits(self, method: str) -> None:
        if self.logits_are_local and self.logits is not None:
            raise ValueError(
                f"{method}() needs full-sequence logits, but these logits are rank-local "
                f"(shape {tuple(self.logits.shape)}, plan {self.plan}); run the forward with "
                "gather_logits=True or leave 'logits' out of the fields"
            )

    def sequences(self) -> List["ForwardOutput"]:
        """Per-sequence views of a packed output (``plan.cu_seqlens``); ``[self]`` unpacked.

        The views share storage with this output and carry no plan.

        Raises:
            ValueError: ``logits`` is rank-local, so it cannot be split by source position.
        """
        self._refuse_local_logits("sequences")
        if self.plan is None or self.plan.cu_seqlens is None:
            return [self]
        split = self.plan.split_sequences

        def pieces(t: Optional[torch.Tensor]) -> list:
            return [None] * len(self.plan.sequence_lengths) if t is None else split(t)

        hidden, target, logits = (
            pieces(self.hidden_states),
            pieces(self.target_logprobs),
            pieces(self.logits),
        )
        if self.top_k is None:
            top_k = [None] * len(hidden)
        else:
            top_k = [
                TopK(lp, tok)
                for lp, tok in zip(
                    split(self.top_k.logprobs), split(self.top_k.tokens), strict=True
                )
            ]
        return [
            ForwardOutput(hidden_states=h, target_logprobs=t, top_k=k, logits=lg)
            for h, t, k, lg in zip(hidden, target, top_k, logits, strict=True)
        ]

    def samples(self) -> List["ForwardOutput"]:
        """One output per root-to-leaf path of ``tree`` (the flat samples); ``sequences()`` else.

        For leaf ``i`` of ``tree.leaves()`` with path ``P = tree.leaf_positions()[i]`` (int64
        source positions, root first, ``L = len(P)``) the view holds ``hidden_states[P]``
        ``[L, H]``, ``logits[P]`` ``[L, V]``, ``top_k`` rows ``[L, k]`` at ``P``, and
        ``target_logprobs`` fp32 ``[L]``: the flat sample's per-token log-probs, i.e.
        ``target_logprobs[P, tree.leaf_label_columns()[i]]`` for ``[S, K]`` labels (the column
        holding each path position's next token along this path) and ``target_logprobs[P]``
        for ``[S]`` labels. Shared positions (a common prefix) appear in every sample through it.

        The views are copies made by ``index_select`` / ``gather``, so they are differentiable:
        a loss over the samples backpropagates into this output, and the gradient of a position
        shared by several samples is the sum of theirs. They carry no plan and no tree.

        Raises:
            ValueError: ``logits`` is rank-local; the fields do not have ``tree.seq_len`` rows;
                ``target_logprobs`` has fewer columns than a path needs.
        """
        if self.tree is None:
            return self.sequences()
        self._refuse_local_logits("samples")
        tree = self.tree
        fields = [self.hidden_states, self.target_logprobs, self.logits]
        if self.top_k is not None:
            fields.append(self.top_k.logprobs)
        for t in fields:
            if t is not None and t.shape[0] != tree.seq_len:
                raise ValueError(
                    f"samples(): the output has {t.shape[0]} positions but the tree's seq_len "
                    f"is {tree.seq_len}"
                )
        paths = tree.leaf_positions()
        target = self.target_logprobs
        columns = tree.leaf_label_columns() if target is not None and target.dim() == 2 else None
        if columns is not None:
            needed = max((int(c.max()) + 1 for c in columns if c.numel()), default=1)
            if needed > target.shape[1]:
                raise ValueError(
                    f"samples(): the tree's paths read label column {needed - 1}, but "
                    f"target_logprobs has {target.shape[1]} columns (labels must be "
                    f"[S, K] with K >= {needed}, as tree.labels() makes them)"
                )
        out: List[ForwardOutput] = []
        for i, path in enumerate(paths):
            cache: Dict[torch.device, torch.Tensor] = {}

            def rows(t: Optional[torch.Tensor], path=path, cache=cache) -> Optional[torch.Tensor]:
                if t is None:
                    return None
                if t.device not in cache:
                    cache[t.device] = path.to(t.device, torch.int64)
                return t.index_select(0, cache[t.device])

            sample_target = rows(target)
            if columns is not None:
                column = columns[i].to(target.device, torch.int64)[:, None]
                sample_target = sample_target.gather(1, column).squeeze(1)
            top_k = None
            if self.top_k is not None:
                top_k = TopK(rows(self.top_k.logprobs), rows(self.top_k.tokens))
            out.append(
                ForwardOutput(
                    hidden_states=rows(self.hidden_states),
                    target_logprobs=sample_target,
                    top_k=top_k,
                    logits=rows(self.logits),
                )
            )
        return out


# ---------------------------------------------------------------------------------------------
# Private helpers.


# ---------------------------------------------------------------------------------------------
# The local computation of a shard's statistics (no communication).


class _LocalVocabStats(torch.autograd.Function):
    """``vocab_ops.vocab_stats`` of one TP shard, differentiable in hidden and weight.

    Outputs: row max (not differentiable), sum of ``exp(logit - max)``, target logit, top-k
    logits, top-k shard-local ids (not differentiable). Backward: the upstream gradients of the
    sum, the target logit and the top-k logits become ``vocab_ops.vocab_stats_backward``'s
    ``grad_sum_exp`` and sparse per-id gradients; the logits are recomputed there. The max
    needs no gradient: through the log-sum-exp combine, the max's own gradient and the one it
    causes through the sum cancel exactly, so the combine treats it as a constant.

    The weight's gradient goes back to autograd, never straight into megatron's fp32
    ``main_grad``: megatron's DDP hook drops ``param.grad`` once ``grad_added_to_main_grad`` is
    set, which would lose the weight's other gradients (a tied embedding's lookup, the
    ``logits`` field). ``vocab_ops.vocab_stats_backward(main_grad=...)`` does that addition for
    callers who own every use of the weight.
    """

    @staticmethod
    def forward(ctx, hidden, weight, target, k, chunk_size):
        row_max, sum_exp, target_logit, top_values, top_ids = vocab_ops.vocab_stats(
            hidden, weight, target, k, chunk_size
        )
        ctx.save_for_backward(hidden, weight, target, row_max, top_ids)
        ctx.chunk_size, ctx.has_target = chunk_size, target is not None
        ctx.mark_non_differentiable(row_max, top_ids)
        return row_max, sum_exp, target_logit, top_values, top_ids

    @staticmethod
    def backward(ctx, _grad_max, grad_sum_exp, grad_target, grad_top, _grad_ids):
        hidden, weight, target, row_max, top_ids = ctx.saved_tensors
        want_h, want_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        if not (want_h or want_w):
            return (None,) * 5
        n, device = hidden.shape[0], hidden.device
        ids: List[torch.Tensor] = []
        grads: List[torch.Tensor] = []
        if ctx.has_target and grad_target is not None:
            ids.append(target[:, None])
            grads.append(grad_target.float()[:, None])
        if grad_top is not None and top_ids.shape[1]:
            ids.append(top_ids)
            grads.append(grad_top.float())
        if grad_sum_exp is None:
            grad_sum_exp = torch.zeros(n, dtype=torch.float32, device=device)
        ids_t = torch.cat(ids, 1) if ids else torch.zeros(n, 0, dtype=torch.int64, device=device)
        grads_t = torch.cat(grads, 1) if grads else torch.zeros(n, 0, device=device)
        grad_h, grad_w = vocab_ops.vocab_stats_backward(
            hidden,
            weight,
            row_max,
            grad_sum_exp.float(),
            ids_t,
            grads_t,
            ctx.chunk_size,
            want_h,
            want_w,
        )
        return grad_h, grad_w, None, None, None


def _vocab_parallel_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: Optional[torch.Tensor],
    k: int,
    chunk_size: Optional[int],
    tp_group,
    tp_rank: int,
    tp_size: int,
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Target log-probs fp32 ``[n]``, top-k log-probs fp32 ``[n, k]``, top-k ids int64 ``[n, k]``.

    ``hidden`` ``[n, H]`` (already through ``copy_to_tensor_parallel_region``), ``weight``
    ``[V/TP, H]``, ``labels`` int64 ``[n]`` global ids or None (then target log-probs are zero).
    One all-gather over TP, run on every rank whatever ``n`` (zero included).
    """
    n, shard = hidden.shape[0], weight.shape[0]
    vocab, vocab_start = shard * tp_size, tp_rank * shard
    local_k = min(k, shard)
    target = None if labels is None else labels - vocab_start
    row_max, sum_exp, target_logit, top_values, top_ids = _LocalVocabStats.apply(
        hidden, weight, target, local_k, chunk_size
    )
    # Ids travel bit-cast inside the fp32 statistics: one collective, exact ids.
    id_bits = (top_ids + vocab_start).to(torch.int32).view(torch.float32)
    stats = torch.cat(
        [row_max[:, None], sum_exp[:, None], target_logit[:, None], top_values, id_bits], dim=1
    )
    every = gather_from_tensor_parallel_region(stats, tp_group, dim=0)
    every = every.view(tp_size, n, stats.shape[1])
    maxima = every[:, :, _MAX].detach()
    global_max = maxima.amax(dim=0)
    lse = global_max + torch.log((every[:, :, _SUMEXP] * torch.exp(maxima - global_max)).sum(0))

    if labels is not None:
        valid = (labels >= 0) & (labels < vocab)
        target_lp = torch.where(valid, every[:, :, _TARGET].sum(dim=0) - lse, float("nan"))
        target_lp = torch.where(labels == IGNORE_INDEX, 0.0, target_lp)
    else:
        target_lp = torch.zeros(n, dtype=torch.float32, device=hidden.device)

    width = tp_size * local_k
    values = every[:, :, _TOPK : _TOPK + local_k].permute(1, 0, 2).reshape(n, width)
    ids = every[:, :, _TOPK + local_k :].detach().contiguous().view(torch.int32)
    ids = ids.permute(1, 0, 2).reshape(n, width)
    if tp_size > 1 and k:
        values, where = values.topk(k, dim=-1)
        ids = ids.gather(1, where)
    return target_lp, values - lse[:, None], ids.long()


# ---------------------------------------------------------------------------------------------
# The steps of compute_forward_output.


@dataclass
class _HeadInputs:
    """Checked inputs of one head call on this rank."""

    hidden: torch.Tensor  # [n, H] (a TP slice [n / TP, H] under sequence parallelism)
    weight: torch.Tensor  # [V/TP, H]
    labels: Optional[torch.Tensor]  # int64 [n]: this rank's rows' labels (column 0), or None
    options: OutputOptions
    plan: ContextParallelPlan
    cp_rank: int
    tp_rank: int
    tp_size: int
    sequence_parallel: bool
    # [S, K] labels: K (0 for [S] labels), this rank's fork rows (int64 [f_r], local row order
    # indices, on the rows' device) and their labels[:, 1:] (int64 [f_r, K - 1]).
    label_columns: int = 0
    fork_rows: Optional[torch.Tensor] = None
    fork_labels: Optional[torch.Tensor] = None
    # What the ranks compare about forks and tree: the number of fork positions, a 31-bit hash
    # of them, and a 31-bit hash of the tree's fingerprint (0 without a tree).
    fork_count: int = 0
    fork_hash: int = 0
    tree_hash: int = 0
    tree: Any = None

    # The length of ``describe()``: 11 values of the inputs, then ``OutputOptions.describe()``.
    DESCRIBED = 11 + len(OutputOptions().describe())

    def describe(self) -> Tuple[int, ...]:
        """What the ranks of a TP group must share for their collectives to match."""
        dtype = _DTYPES.index(self.hidden.dtype) if self.hidden.dtype in _DTYPES else 9
        return (
            self.plan.fingerprint,
            self.hidden.shape[0],
            self.hidden.shape[1],
            self.weight.shape[0],
            dtype,
            int(self.sequence_parallel),
            self.options.chunk_size or 0,
            self.label_columns,
            self.fork_count,
            self.fork_hash,
            self.tree_hash,
        ) + self.options.describe()

    def call_field(self) -> Optional[torch.Tensor]:
        """A zero-byte uint8 ``[n, 0, K, digest]`` field, or None.

        The CP gather compares every field's trailing shape between the ranks in its one
        exchange, so this field makes the CP group compare K and a 31-bit digest of the fork
        positions and the tree too (a rank that differs raises ``fields_differ`` on every rank)
        without moving a byte or adding a collective. None for ``[S]`` labels without a tree.
        """
        if not self.label_columns and self.tree is None:
            return None
        n = self.plan.counts[self.cp_rank]
        digest = _hash31(repr((self.fork_count, self.fork_hash, self.tree_hash)).encode())
        shape = (n, 0, self.label_columns, digest)
        return torch.empty(shape, dtype=torch.uint8, device=self.hidden.device)


_INT_DTYPES = (torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8)


def _hash31(values: bytes) -> int:
    """A 31-bit hash that is the same in every process (a dimension of ``call_field``)."""
    return int.from_bytes(hashlib.blake2b(values, digest_size=4).digest(), "little") >> 1


def _as_labels(labels, seq_len: int) -> torch.Tensor:
    """``labels`` as ``[S]`` or ``[S, K]``; raises naming the shape."""
    if labels is None:
        raise errors.make("labels_missing")
    if not isinstance(labels, torch.Tensor) or labels.dtype not in _INT_DTYPES:
        raise errors.make("labels_dtype")
    if labels.dim() == 2 and labels.shape[0] == 1 and (labels.shape[1] == seq_len != 1):
        labels = labels[0]  # megatron's [1, S]
    elif labels.dim() == 2 and labels.shape[0] == 1 and seq_len == 1 and labels.shape[1] == 1:
        labels = labels[0]
    if labels.dim() == 1:
        if labels.shape[0] != seq_len:
            raise errors.make("labels_shape", labels.numel(), seq_len)
        return labels
    if labels.dim() == 2 and labels.shape[0] == seq_len and labels.shape[1] >= 1:
        return labels
    raise errors.make(
        "labels_shape",
        labels.numel(),
        seq_len,
        note=f"labels are [S] or [S, K] with K >= 1, got shape {tuple(labels.shape)}",
    )


def _as_fork_positions(fork_positions, labels: torch.Tensor, tree, seq_len: int) -> torch.Tensor:
    """The fork rows of ``[S, K]`` labels: int64 CPU, sorted, unique, in ``[0, S)``.

    Given, or the tree's, or derived from the labels (rows where a column >= 1 is not -100):
    that reads the labels back to the host, a device sync when they live on a GPU.
    """
    if fork_positions is None:
        if tree is not None:
            return tree.fork_positions()
        if labels.shape[1] == 1:
            return torch.zeros(0, dtype=torch.int64)
        rest = labels[:, 1:].ne(IGNORE_INDEX).any(dim=1)
        return torch.nonzero(rest.cpu()).flatten()
    if isinstance(fork_positions, torch.Tensor):
        if fork_positions.dtype not in _INT_DTYPES:
            raise errors.make(
                "option", note=f"fork_positions must hold int ids, got {fork_positions.dtype}"
            )
        forks = fork_positions.detach().to("cpu", torch.int64)
    else:
        try:
            forks = torch.as_tensor(list(fork_positions), dtype=torch.int64)
        except (TypeError, ValueError, RuntimeError) as exc:
            raise errors.make(
                "option", note=f"fork_positions must be an int64 tensor or ints: {exc}"
            ) from exc
    if forks.dim() != 1:
        raise errors.make("option", note=f"fork_positions must be 1-D, got {tuple(forks.shape)}")
    if forks.numel():
        low, high = int(forks.min()), int(forks.max())
        if low < 0 or high >= seq_len:
            raise errors.make(
                "option",
                note=f"fork_positions must lie in [0, {seq_len}), got {low} .. {high}",
            )
        if forks.numel() > 1 and not bool((forks[1:] > forks[:-1]).all()):
            raise errors.make("option", note="fork_positions must be sorted and unique")
    return forks


def _fork_inputs(inputs: _HeadInputs, labels: torch.Tensor, forks: torch.Tensor) -> None:
    """Fills ``inputs``' fork fields: this rank's fork rows and their columns >= 1 labels.

    Host work on the plan's cached slot table and the fork positions; one small host-to-device
    copy of the rows; no sync.
    """
    plan, rank, device = inputs.plan, inputs.cp_rank, inputs.hidden.device
    inputs.fork_count = forks.numel()
    inputs.fork_hash = _hash31(forks.numpy().tobytes())
    first = rank * plan.max_count
    slots = plan.row_source("cpu").index_select(0, forks)
    mine = (slots >= first) & (slots < first + plan.counts[rank])
    rows = slots[mine] - first
    if labels.shape[1] == 1 or rows.numel() == 0:
        return
    inputs.fork_rows = rows.to(device)
    inputs.fork_labels = labels.index_select(0, forks[mine].to(device))[:, 1:]


def _check_inputs(
    hidden_local,
    output_weight,
    plan,
    labels,
    options,
    cp_group,
    tp_group,
    sequence_parallel,
    fork_positions=None,
    tree=None,
) -> _HeadInputs:
    """This rank's inputs, checked; raises an ``errors.InputError`` naming the first problem."""
    if not isinstance(plan, ContextParallelPlan):
        raise errors.make("not_a_plan")
    cp_rank = plan.rank_in(cp_group)
    tp_rank, tp_size = groups.group_rank_and_size(tp_group)
    if not isinstance(hidden_local, torch.Tensor) or not isinstance(output_weight, torch.Tensor):
        raise errors.make("not_a_tensor", 0)
    hidden = hidden_local
    if hidden.dim() == 3 and hidden.shape[1] == 1:
        hidden = hidden.squeeze(1)
    if hidden.dim() != 2:
        raise errors.make("hidden_shape", hidden_local.dim(), hidden_local.shape[1])
    if output_weight.dim() != 2 or output_weight.shape[1] != hidden.shape[1]:
        shape = tuple(output_weight.shape) + (0, 0)
        raise errors.make("weight_shape", shape[0], hidden.shape[1], shape[1])
    vocab = output_weight.shape[0] * tp_size
    if "top_k" in options.fields and not 1 <= options.top_k <= vocab:
        raise errors.make("top_k", options.top_k, vocab)
    n_rows = hidden.shape[0] * (tp_size if sequence_parallel else 1)
    if n_rows != plan.counts[cp_rank]:
        raise errors.make("hidden_rows", n_rows, plan.counts[cp_rank], cp_rank)
    tree_hash = 0
    if tree is not None:
        if not callable(getattr(tree, "leaf_positions", None)):
            raise errors.make("option", note=f"tree must be a PrefixTree, got {type(tree)}")
        tree.check_seq_len(plan.seq_len)
        tree_hash = _hash31(repr(tuple(tree.describe())).encode())
    inputs = _HeadInputs(
        hidden=hidden,
        weight=output_weight,
        labels=None,
        options=options,
        plan=plan,
        cp_rank=cp_rank,
        tp_rank=tp_rank,
        tp_size=tp_size,
        sequence_parallel=bool(sequence_parallel and tp_size > 1),
        tree_hash=tree_hash,
        tree=tree,
    )
    if "target_logprobs" in options.fields:
        labels = _as_labels(labels, plan.seq_len)
        positions = plan.local_positions(cp_rank, hidden.device)
        labels = labels.to(hidden.device).long()
        if labels.dim() == 1:
            inputs.labels = labels.index_select(0, positions)
        else:
            inputs.label_columns = labels.shape[1]
            inputs.labels = labels[:, 0].index_select(0, positions)
            forks = _as_fork_positions(fork_positions, labels, tree, plan.seq_len)
            _fork_inputs(inputs, labels, forks)
    return inputs


def _agree_over_tensor_parallel(
    problem: Optional[BaseException], inputs: Optional[_HeadInputs], tp_group
) -> Optional[BaseException]:
    """Shares problems and call descriptions within the TP group; returns the first problem.

    Does not raise: the problem must still travel to the CP group in the gather's exchange, or
    the CP peers of this TP group would wait there.
    """
    if groups.group_rank_and_size(tp_group)[1] == 1:
        return problem
    description = inputs.describe() if problem is None else (0,) * _HeadInputs.DESCRIBED
    return groups.find_problem_or_difference(problem, tp_group, description)


def _local_fields(inputs: _HeadInputs, tp_group) -> Tuple[Dict[str, torch.Tensor], Any]:
    """Every requested field of this rank's rows (TP communication only); and local logits."""
    options = inputs.options
    hidden = inputs.hidden
    if inputs.sequence_parallel:
        hidden = gather_from_tensor_parallel_region(hidden, tp_group, dim=0)
    # Vocab-parallel consumers read `hidden_tp`; `hidden` itself is what every TP rank shares.
    hidden_tp = copy_to_tensor_parallel_region(hidden, tp_group)
    local: Dict[str, torch.Tensor] = {}
    if "hidden_states" in options.fields:
        local["hidden_states"] = hidden
    k = options.top_k if "top_k" in options.fields else 0
    if "target_logprobs" in options.fields or k:
        target_lp, top_lp, top_ids = _vocab_parallel_logprobs(
            hidden_tp,
            inputs.weight,
            inputs.labels,
            k,
            options.chunk_size,
            tp_group,
            inputs.tp_rank,
            inputs.tp_size,
        )
        if "target_logprobs" in options.fields:
            local["target_logprobs"] = _with_fork_columns(inputs, target_lp, hidden_tp, tp_group)
        if k:
            local["top_k_logprobs"] = top_lp
            local["top_k_tokens"] = top_ids
    logits_local = None
    if "logits" in options.fields:
        logits_local = torch.matmul(hidden_tp, inputs.weight.t())
        if options.gather_logits:
            local["logits"] = gather_from_tensor_parallel_region(logits_local, tp_group, dim=-1)
    call = inputs.call_field()
    if call is not None:
        local["call"] = call
    if not local:
        # Nothing to gather, but the CP exchange must still run (peers may have a problem).
        local["nothing"] = hidden.new_empty((hidden.shape[0], 0))
    return local, logits_local


def _with_fork_columns(
    inputs: _HeadInputs, target_lp: torch.Tensor, hidden_tp: torch.Tensor, tp_group
) -> torch.Tensor:
    """``[n]`` column-0 log-probs, or fp32 ``[n, K]`` with the fork rows' columns >= 1 added.

    The ``f_r`` local fork rows, each repeated ``K - 1`` times with its labels ``[:, 1:]``, go
    through the same vocab-parallel log-prob path as ``f_r * (K - 1)`` extra rows (one more TP
    all-gather, run by every TP rank of this CP rank alike: they share the plan and the forks);
    their log-probs are scattered into zeros at the fork rows. Differentiable for every column.
    """
    k = inputs.label_columns
    if not k:
        return target_lp
    n = target_lp.shape[0]
    if k == 1 or inputs.fork_rows is None:
        return torch.cat([target_lp[:, None], target_lp.new_zeros(n, k - 1)], dim=1)
    rows, labels = inputs.fork_rows, inputs.fork_labels
    extra_hidden = hidden_tp.index_select(0, rows).repeat_interleave(k - 1, dim=0)
    extra, _, _ = _vocab_parallel_logprobs(
        extra_hidden,
        inputs.weight,
        labels.reshape(-1),
        0,
        inputs.options.chunk_size,
        tp_group,
        inputs.tp_rank,
        inputs.tp_size,
    )
    rest = target_lp.new_zeros(n, k - 1).index_copy(0, rows, extra.view(rows.shape[0], k - 1))
    return torch.cat([target_lp[:, None], rest], dim=1)


def compute_forward_output(
    hidden_local: torch.Tensor,
    output_weight: torch.Tensor,
    plan: ContextParallelPlan,
    *,
    labels: Optional[torch.Tensor] = None,
    cp_group: Optional[dist.ProcessGroup] = None,
    tp_group: Optional[dist.ProcessGroup] = None,
    sequence_parallel: bool = False,
    fork_positions: Optional[torch.Tensor] = None,
    tree: Optional["PrefixTree"] = None,
    options: Optional[OutputOptions] = None,
    **option_keywords: Any,
) -> ForwardOutput:
    """Forward: fields of the local rows, one CP gather to source order; backward: own rows.

    Every requested field is computed on this rank's rows (vocab-parallel over TP), then all of
    them move into source order with one data collective over the CP group. In backward each rank
    receives its own rows' gradient, summed over the TP ranks' vocab shards.

    Args:
        hidden_local: this rank's final hidden rows in plan order, ``[n_r, H]`` or megatron's
            ``[n_r, 1, H]``. With ``sequence_parallel`` it is this TP rank's slice
            ``[n_r / TP, (1,) H]`` and is all-gathered over ``tp_group`` first.
        output_weight: this TP rank's vocab shard of the output layer, ``[V/TP, H]`` (megatron
            ``ColumnParallelLinear`` layout: rows ``tp_rank * V/TP ...`` of the vocabulary).
        plan: the CP plan; ``n_r == plan.counts[cp_rank]``.
        labels: int ``[plan.seq_len]`` (or ``[1, seq_len]``) in SOURCE order, already shifted;
            -100 marks positions without a target. Required for ``target_logprobs``. Or int
            ``[seq_len, K]`` (a tree batch, ``PrefixTree.labels``): column 0 is each row's next
            token, columns ``>= 1`` other next tokens of the fork rows (``fork_positions``);
            then ``target_logprobs`` is ``[S, K]``.
        cp_group: the CP group; None means megatron-core's (a single rank outside a job).
        tp_group: the TP group; None means megatron-core's (a single rank outside a job).
        sequence_parallel: ``hidden_local`` is sequence-parallel over ``tp_group``.
        fork_positions: for ``[S, K]`` labels, the only source positions whose columns ``>= 1``
            are computed (elsewhere they are 0.0): int64 CPU ``[F]``, sorted and unique
            (``PrefixTree.fork_positions()``). None takes ``tree.fork_positions()`` when a tree
            is given, else derives them from the labels (rows where a column ``>= 1`` is not
            -100), which reads the labels back to the host once per call: a device sync when
            they live on a GPU. Ignored for ``[S]`` labels.
        tree: the batch's ``PrefixTree`` (its ``seq_len`` must be the plan's); it is set on the
            returned output for ``ForwardOutput.samples()``.
        options: an ``OutputOptions``; or pass its fields (``fields``, ``top_k``,
            ``gather_logits``, ``chunk_size``, ``context_parallel_output_grad``) as keywords.

    Returns:
        ``ForwardOutput`` whose requested fields cover all ``plan.seq_len`` positions in source
        order, identical on every rank of the CP and TP groups (``hidden_states [S, H]``,
        ``target_logprobs`` fp32 ``[S]`` or ``[S, K]``, ``top_k`` ``[S, k]``, ``logits [S, V]``),
        each differentiable w.r.t. ``hidden_local`` and ``output_weight`` (token ids excepted;
        every column of ``[S, K]`` log-probs included), with ``tree`` set when given.
        The fork rows' columns ``>= 1`` cost ``F_r * (K - 1)`` extra rows of the same
        vocab-parallel path on each rank (``F_r`` its fork rows) and ride in the same gather.
        Target log-probs and top-k come from fp32 logits (fp32 accumulation), so they are
        exact to fp32 whatever the model dtype; ``logits`` are the output layer's own (model
        dtype).

    Raises:
        errors.InputError (a ValueError): on EVERY rank of the TP and CP groups alike when any
            of them passes an unknown field, ``top_k`` outside ``[1, V]``, labels that are
            missing, not integer or not ``seq_len`` long, a weight whose hidden size differs
            from the rows', a CP group size other than ``plan.cp_size``, hidden rows other than
            ``plan.counts[cp_rank]``, ``fork_positions`` that are not sorted unique positions,
            a tree of another ``seq_len``, or when ranks' calls differ (K, the fork positions
            and the tree included). One small exchange per group
            carries these checks; no rank is left waiting in a collective.
    """
    return _run_head(
        hidden_local,
        output_weight,
        plan,
        labels,
        groups.resolve_context_parallel_group(cp_group),
        groups.resolve_tensor_parallel_group(tp_group),
        sequence_parallel,
        options,
        option_keywords,
        fork_positions=fork_positions,
        tree=tree,
    )


def _run_head(
    hidden_local,
    output_weight,
    plan,
    labels,
    cp_group,
    tp_group,
    sequence_parallel,
    options,
    option_keywords,
    precheck: Optional[Callable[[], None]] = None,
    fork_positions=None,
    tree=None,
) -> ForwardOutput:
    """``compute_forward_output`` on resolved groups; ``precheck`` is a caller's own check."""
    problem: Optional[BaseException] = None
    inputs: Optional[_HeadInputs] = None
    try:
        if precheck is not None:
            precheck()
        resolved = OutputOptions.resolve(options, option_keywords)
        inputs = _check_inputs(
            hidden_local,
            output_weight,
            plan,
            labels,
            resolved,
            cp_group,
            tp_group,
            sequence_parallel,
            fork_positions,
            tree,
        )
    except Exception as exc:  # noqa: BLE001 - every rank must hear of any problem
        problem = exc
    problem = _agree_over_tensor_parallel(problem, inputs, tp_group)
    local, logits_local = _local_fields(inputs, tp_group) if problem is None else ({}, None)
    full = gather_or_raise(
        local,
        plan,
        cp_group,
        context_parallel_output_grad=(
            inputs.options.context_parallel_output_grad if inputs is not None else False
        ),
        problem=problem,
    )
    return _forward_output(full, inputs, logits_local)


def _forward_output(
    full: Dict[str, torch.Tensor], inputs: _HeadInputs, logits_local: Optional[torch.Tensor]
) -> ForwardOutput:
    """Assembles the gathered fields into a ``ForwardOutput``."""
    out = ForwardOutput(
        hidden_states=full.get("hidden_states"),
        target_logprobs=full.get("target_logprobs"),
        logits=full.get("logits"),
        plan=inputs.plan,
        tree=inputs.tree,
    )
    if "top_k_logprobs" in full:
        out.top_k = TopK(logprobs=full["top_k_logprobs"], tokens=full["top_k_tokens"])
    if logits_local is not None and not inputs.options.gather_logits:
        out.logits, out.logits_are_local = logits_local, True
    return out


def make_output_processor(
    plan: ContextParallelPlan,
    *,
    labels: Optional[torch.Tensor] = None,
    cp_group: Optional[dist.ProcessGroup] = None,
    fork_positions: Optional[torch.Tensor] = None,
    tree: Optional["PrefixTree"] = None,
    options: Optional[OutputOptions] = None,
    **option_keywords: Any,
) -> Callable[..., ForwardOutput]:
    """A megatron-core ``GPTModel.forward(output_processor=...)`` hook returning ``ForwardOutput``.

    The hook receives the decoder's final hidden states ``[s_local, 1, H]`` and the model's
    output layer; the TP group and sequence parallelism come from that ``ColumnParallelLinear``
    (``output_layer.tp_group``, ``output_layer.sequence_parallel``), the weight from
    ``output_weight`` when embeddings are shared, else ``output_layer.weight``. Pass
    ``cp_group=model.pg_collection.cp`` (None: ``parallel_state``'s CP group). ``labels`` are
    the full sequence's, in source order (``[S]`` or ``[S, K]``); the model's own (CP-local)
    labels are ignored. ``fork_positions``, ``tree`` and the output options as in
    ``compute_forward_output``.

    Raises (when called, on every rank of TP x CP alike, like ``compute_forward_output``):
        errors.InputError: bad output options, or the model uses MuP logit scaling or an
            output-layer bias, which this head does not apply.
    """
    cp = groups.resolve_context_parallel_group(cp_group)

    def output_processor(
        *, hidden_states: torch.Tensor, output_layer, output_weight=None, config=None, **_: Any
    ) -> ForwardOutput:
        def unsupported() -> None:
            if config is not None and getattr(config, "use_mup", False):
                raise errors.make("option", note="the head does not apply MuP logit scaling")
            if getattr(output_layer, "bias", None) is not None:
                raise errors.make("option", note="the head does not apply an output-layer bias")

        weight = output_weight if output_weight is not None else output_layer.weight
        return _run_head(
            hidden_states,
            weight,
            plan,
            labels,
            cp,
            groups.resolve_tensor_parallel_group(getattr(output_layer, "tp_group", None)),
            bool(getattr(output_layer, "sequence_parallel", False)),
            options,
            option_keywords,
            precheck=unsupported,
            fork_positions=fork_positions,
            tree=tree,
        )

    return output_processor
