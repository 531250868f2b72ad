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

Gradient rule (the same as the CP gather's default): every CP rank computes the same loss on the
full outputs; each rank's input gradient is its own rows of that loss's gradient, so parameter
gradients summed over the CP group equal the single-device gradient.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple, Union

import torch
import torch.distributed as dist

from megatron.context_parallel import errors, groups, vocab_ops
from megatron.context_parallel.mappings import (
    copy_to_tensor_parallel_region,
    gather_from_tensor_parallel_region,
    gather_or_raise,
)
from megatron.context_parallel.plan import ContextParallelPlan

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
        target_logprobs: fp32 ``[S]``: log-prob of each position's label; 0.0 where the label
            is -100 (no gradient there); NaN where the label is outside ``[0, V)``.
        top_k: ``TopK`` of ``[S, k]`` fp32 log-probs and int64 token ids.
        logits: ``[S, V]`` in the model dtype; or, when ``logits_are_local``, this rank's
            ``[plan.counts[cp_rank], V/TP]`` shard exactly as megatron's output layer makes it
            (rows at ``plan.local_positions(cp_rank)``, vocab ids from ``tp_rank * V/TP``).
        plan: the CP plan of the forward (its ``cu_seqlens`` split packed sequences).
        logits_are_local: True when ``logits`` was left rank-local (``gather_logits=False``).
    """

    hidden_states: Optional[torch.Tensor] = None
    target_logprobs: Optional[torch.Tensor] = None
    top_k: Optional[TopK] = None
    logits: Optional[torch.Tensor] = None
    plan: Optional[ContextParallelPlan] = None
    logits_are_local: bool = False

    def sequences(self) -> List["ForwardOutput"]:
        """Per-sequence views of a packed output (``plan.cu_seqlens``); ``[self]`` unpacked.

        The views share storage with this output and carry no plan.

        Raises:
            ValueError: ``logits`` is rank-local, so it cannot be split by source position.
        """
        if self.logits_are_local and self.logits is not None:
            raise ValueError(
                "sequences() needs full-sequence logits, but these logits are rank-local "
                f"(shape {tuple(self.logits.shape)}, plan {self.plan}); run the forward with "
                "gather_logits=True or leave 'logits' out of the fields"
            )
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
    labels: Optional[torch.Tensor]  # int64 [n]: this rank's rows' labels, or None
    options: OutputOptions
    plan: ContextParallelPlan
    cp_rank: int
    tp_rank: int
    tp_size: int
    sequence_parallel: bool

    # The length of ``describe()``: 7 values of the inputs, then ``OutputOptions.describe()``.
    DESCRIBED = 7 + len(OutputOptions().describe())

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
        ) + self.options.describe()


def _check_inputs(
    hidden_local, output_weight, plan, labels, options, cp_group, tp_group, sequence_parallel
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
    local_labels = None
    if "target_logprobs" in options.fields:
        if labels is None:
            raise errors.make("labels_missing")
        if not isinstance(labels, torch.Tensor) or labels.dtype not in (
            torch.int64,
            torch.int32,
            torch.int16,
            torch.int8,
            torch.uint8,
        ):
            raise errors.make("labels_dtype")
        if labels.dim() == 2 and labels.shape[0] == 1:
            labels = labels[0]
        if labels.dim() != 1 or labels.shape[0] != plan.seq_len:
            raise errors.make("labels_shape", labels.numel(), plan.seq_len)
        positions = plan.local_positions(cp_rank, hidden.device)
        local_labels = labels.to(hidden.device).long().index_select(0, positions)
    return _HeadInputs(
        hidden=hidden,
        weight=output_weight,
        labels=local_labels,
        options=options,
        plan=plan,
        cp_rank=cp_rank,
        tp_rank=tp_rank,
        tp_size=tp_size,
        sequence_parallel=bool(sequence_parallel and tp_size > 1),
    )


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
            local["target_logprobs"] = target_lp
        if k:
            local["top_k_logprobs"] = top_lp
            local["top_k_tokens"] = top_ids
    logits_local = None
    if "logits" in options.fields:
        logits_local = torch.matmul(hidden_tp, inputs.weight.t())
        if options.gather_logits:
            local["logits"] = gather_from_tensor_parallel_region(logits_local, tp_group, dim=-1)
    if not local:
        # Nothing to gather, but the CP exchange must still run (peers may have a problem).
        local["nothing"] = hidden.new_empty((hidden.shape[0], 0))
    return local, logits_local


def compute_forward_output(
    hidden_local: torch.Tensor,
    output_weight: torch.Tensor,
    plan: ContextParallelPlan,
    *,
    labels: Optional[torch.Tensor] = None,
    cp_group: Optional[dist.ProcessGroup] = None,
    tp_group: Optional[dist.ProcessGroup] = None,
    sequence_parallel: bool = False,
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
            -100 marks positions without a target. Required for ``target_logprobs``.
        cp_group: the CP group; None means megatron-core's (a single rank outside a job).
        tp_group: the TP group; None means megatron-core's (a single rank outside a job).
        sequence_parallel: ``hidden_local`` is sequence-parallel over ``tp_group``.
        options: an ``OutputOptions``; or pass its fields (``fields``, ``top_k``,
            ``gather_logits``, ``chunk_size``, ``context_parallel_output_grad``) as keywords.

    Returns:
        ``ForwardOutput`` whose requested fields cover all ``plan.seq_len`` positions in source
        order, identical on every rank of the CP and TP groups (``hidden_states [S, H]``,
        ``target_logprobs`` fp32 ``[S]``, ``top_k`` ``[S, k]``, ``logits [S, V]``), each
        differentiable w.r.t. ``hidden_local`` and ``output_weight`` (token ids excepted).
        Target log-probs and top-k come from fp32 logits (fp32 accumulation), so they are
        exact to fp32 whatever the model dtype; ``logits`` are the output layer's own (model
        dtype).

    Raises:
        errors.InputError (a ValueError): on EVERY rank of the TP and CP groups alike when any
            of them passes an unknown field, ``top_k`` outside ``[1, V]``, labels that are
            missing, not integer or not ``seq_len`` long, a weight whose hidden size differs
            from the rows', a CP group size other than ``plan.cp_size``, hidden rows other than
            ``plan.counts[cp_rank]``, or when ranks' calls differ. One small exchange per group
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
    options: Optional[OutputOptions] = None,
    **option_keywords: Any,
) -> Callable[..., ForwardOutput]:
    """A megatron-core ``GPTModel.forward(output_processor=...)`` hook returning ``ForwardOutput``.

    The hook receives the decoder's final hidden states ``[s_local, 1, H]`` and the model's
    output layer; the TP group and sequence parallelism come from that ``ColumnParallelLinear``
    (``output_layer.tp_group``, ``output_layer.sequence_parallel``), the weight from
    ``output_weight`` when embeddings are shared, else ``output_layer.weight``. Pass
    ``cp_group=model.pg_collection.cp`` (None: ``parallel_state``'s CP group). ``labels`` are
    the full sequence's, in source order; the model's own (CP-local) labels are ignored.
    Output options as in ``compute_forward_output``.

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
        )

    return output_processor
