"""Context-parallel output head: per-position fields of a forward, full sequence, source order.

``compute_forward_output`` takes this rank's final hidden rows (CP-local, in plan order), the
vocab-parallel output-layer weight (megatron-core ``ColumnParallelLinear`` layout, ``[V/TP, H]``
per tensor-parallel rank), the labels in source order and the fields a caller asked for. It
computes every field on the local rows, then moves all of them into source order with ONE call
of ``gather_from_context_parallel_region`` (one collective over the CP group).

Tensor parallelism stays inside the head: the log-softmax normaliser and the top-k are combined
over the TP group from per-rank statistics (one all-gather of a few numbers per row), so
vocab-wide logits are never gathered for them. Target log-probs and top-k walk the local rows in
chunks of ``chunk_size`` rows, recomputing each chunk's logits in backward, so no more than a
few ``chunk_size x V/TP`` tensors are alive at a time in either direction.

Gradient rule (the same as the CP gather's default): every CP rank computes the same loss on the
full outputs; each rank's input gradient is its own rows of that loss's gradient, so parameter
gradients summed over the CP group equal the single-device gradient.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, List, Optional, Sequence, Tuple, Union

import torch
import torch.distributed as dist

from megatron.context_parallel.groups import (
    all_gather_single,
    group_rank_and_size,
    resolve_context_parallel_group,
    resolve_tensor_parallel_group,
)
from megatron.context_parallel.mappings import gather_from_context_parallel_region
from megatron.context_parallel.plan import ContextParallelPlan

__all__ = [
    "FIELDS",
    "IGNORE_INDEX",
    "TopK",
    "ForwardOutput",
    "compute_forward_output",
    "make_output_processor",
]

FIELDS = ("hidden_states", "target_logprobs", "top_k", "logits")

# Label value whose position has no target: its log-prob is 0.0 and gets no gradient.
IGNORE_INDEX = -100

# Columns of the per-row statistics a TP rank shares in the forward (see _VocabParallelLogprobs).
_MAX, _SUMEXP, _TARGET, _TOPK = 0, 1, 2, 3


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


def _normalise_fields(fields: Union[str, Sequence[str]]) -> Tuple[str, ...]:
    if isinstance(fields, str):
        fields = (fields,)
    fields = tuple(fields)
    for name in fields:
        if name not in FIELDS:
            raise ValueError(f"unknown field {name!r}; the fields are {FIELDS}")
    return tuple(f for f in FIELDS if f in fields)


# ---------------------------------------------------------------------------------------------
# Autograd Functions.


class _CopyToTensorParallelRegion(torch.autograd.Function):
    """Forward: identity. Backward: all-reduce (sum) over TP.

    The vocab-parallel consumers of the hidden rows each see V/TP of the vocabulary, so the
    gradient of the rows is the sum of their contributions.
    """

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class _GatherFromSequenceParallelRegion(torch.autograd.Function):
    """Forward: all-gather the TP ranks' row slices (dim 0). Backward: keep own slice.

    Every TP rank uses the gathered rows alike (consumers that see only part of the vocabulary
    sum their gradients first, in ``_CopyToTensorParallelRegion``), so no reduction here.
    """

    @staticmethod
    def forward(ctx, x, group, rank, size):
        ctx.rank, ctx.rows = rank, x.shape[0]
        x = x.contiguous()
        out = x.new_empty((size * x.shape[0],) + tuple(x.shape[1:]))
        if out.numel() > 0:
            all_gather_single(out, x, group)
        return out

    @staticmethod
    def backward(ctx, grad):
        start = ctx.rank * ctx.rows
        return grad[start : start + ctx.rows].contiguous(), None, None, None


class _GatherFromVocabParallelRegion(torch.autograd.Function):
    """Forward: ``[n, V/TP]`` shards -> ``[n, V]`` (all-gather over TP). Backward: own columns."""

    @staticmethod
    def forward(ctx, x, group, rank, size):
        ctx.rank, ctx.cols = rank, x.shape[1]
        # Concatenated along dim 0 (the layout every backend accepts), then rank-major columns.
        parts = x.new_empty((size * x.shape[0], x.shape[1]))
        if parts.numel() > 0:
            all_gather_single(parts, x.contiguous(), group)
        parts = parts.view(size, x.shape[0], x.shape[1])
        return parts.permute(1, 0, 2).reshape(x.shape[0], size * x.shape[1])

    @staticmethod
    def backward(ctx, grad):
        start = ctx.rank * ctx.cols
        return grad[:, start : start + ctx.cols].contiguous(), None, None, None


def _chunk_logits(hidden: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """fp32 ``[c, V/TP]`` logits of a chunk of rows (matmul in the model dtype, as megatron)."""
    return torch.matmul(hidden, weight.t()).float()


class _VocabParallelLogprobs(torch.autograd.Function):
    """Target log-probs and top-k of vocab-parallel logits, chunk by chunk, recomputed in backward.

    Forward, per chunk of rows: local logits ``[c, V/TP]`` (fp32), their max, the sum of
    ``exp(logit - max)``, the target's logit when this TP rank holds it, and the local top-k.
    These few numbers per row are all-gathered over TP once, after the last chunk, and combined
    into the global log-sum-exp and top-k. Only ``lse`` ``[n]`` and the top-k ids are saved.

    Backward, per chunk: d logprob(t) / d logits = onehot(t) - softmax, so the logits' gradient
    is ``scatter(g at the selected ids) - (sum of g) * softmax``, with softmax recomputed from the
    saved ``lse``. The hidden rows' gradient covers this rank's vocab shard only; the sum over TP
    happens in ``_CopyToTensorParallelRegion`` upstream.

    Inputs: hidden ``[n, H]``, weight ``[V/TP, H]``, labels int64 ``[n]`` (or None), ``k``,
    ``chunk_size``, ``tp_group``, ``tp_rank``, ``tp_size``.
    Outputs: target log-probs fp32 ``[n]`` (zeros without labels), top-k log-probs fp32
    ``[n, k]``, top-k ids int64 ``[n, k]`` (not differentiable).
    """

    @staticmethod
    def forward(ctx, hidden, weight, labels, k, chunk_size, group, tp_rank, tp_size):
        n, shard = hidden.shape[0], weight.shape[0]
        vocab = shard * tp_size
        vocab_start = tp_rank * shard
        local_k = min(k, shard)
        device = hidden.device
        stats = torch.zeros(n, _TOPK + 2 * local_k, dtype=torch.float32, device=device)
        local_target = None
        if labels is not None:
            local_target = labels - vocab_start
            target_here = (local_target >= 0) & (local_target < shard)
            local_target = local_target.clamp(0, max(shard - 1, 0))
        for start in range(0, n, chunk_size):
            end = min(start + chunk_size, n)
            logits = _chunk_logits(hidden[start:end], weight)
            row_max = logits.amax(dim=-1)
            stats[start:end, _MAX] = row_max
            if local_target is not None:
                picked = logits.gather(1, local_target[start:end, None]).squeeze(1)
                stats[start:end, _TARGET] = torch.where(target_here[start:end], picked, 0.0)
            if local_k:
                values, ids = logits.topk(local_k, dim=-1)
                stats[start:end, _TOPK : _TOPK + local_k] = values
                # Ids travel bit-cast inside the fp32 statistics: one collective, exact ids.
                ids32 = (ids + vocab_start).to(torch.int32)
                stats[start:end, _TOPK + local_k :] = ids32.view(torch.float32)
            # In place: this chunk's logits buffer becomes its exp, no second [c, V/TP] tensor.
            stats[start:end, _SUMEXP] = logits.sub_(row_max[:, None]).exp_().sum(dim=-1)
            del logits

        if tp_size > 1 and n > 0:
            every = stats.new_empty((tp_size * n, stats.shape[1]))
            all_gather_single(every, stats, group)
            every = every.view(tp_size, n, stats.shape[1])
        else:
            every = stats[None]
        global_max = every[:, :, _MAX].amax(dim=0)
        sum_exp = (every[:, :, _SUMEXP] * torch.exp(every[:, :, _MAX] - global_max)).sum(dim=0)
        lse = global_max + torch.log(sum_exp)

        if labels is not None:
            valid = (labels >= 0) & (labels < vocab)
            target_logit = every[:, :, _TARGET].sum(dim=0)
            target_lp = torch.where(valid, target_logit - lse, float("nan"))
            target_lp = torch.where(labels == IGNORE_INDEX, 0.0, target_lp)
        else:
            valid = None
            target_lp = torch.zeros(n, dtype=torch.float32, device=device)

        if k:
            width = every.shape[0] * local_k
            cand_values = every[:, :, _TOPK : _TOPK + local_k].permute(1, 0, 2).reshape(n, width)
            cand_ids = (
                every[:, :, _TOPK + local_k :].contiguous().view(torch.int32).permute(1, 0, 2)
            ).reshape(n, width)
            if tp_size > 1:
                top_values, where = cand_values.topk(k, dim=-1)
                top_ids = cand_ids.gather(1, where).long()
            else:
                top_values, top_ids = cand_values, cand_ids.long()
            top_lp = top_values - lse[:, None]
        else:
            top_lp = torch.zeros(n, 0, dtype=torch.float32, device=device)
            top_ids = torch.zeros(n, 0, dtype=torch.int64, device=device)

        ctx.mark_non_differentiable(top_ids)
        ctx.save_for_backward(hidden, weight, labels, valid, lse, top_ids)
        ctx.chunk_size, ctx.vocab_start, ctx.has_labels = (
            chunk_size,
            vocab_start,
            labels is not None,
        )
        return target_lp, top_lp, top_ids

    @staticmethod
    def backward(ctx, grad_target, grad_top, _grad_ids):
        hidden, weight, labels, valid, lse, top_ids = ctx.saved_tensors
        n, shard = hidden.shape[0], weight.shape[0]
        want_h, want_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        if not (want_h or want_w):
            return (None,) * 8

        # The ids whose log-probs were used, and their gradients; ignored labels get none.
        ids, grads = [], []
        if ctx.has_labels and grad_target is not None:
            ids.append(labels.clamp(min=0)[:, None])
            grads.append(torch.where(valid, grad_target.float(), 0.0)[:, None])
        if grad_top is not None and top_ids.shape[1] > 0:
            ids.append(top_ids)
            grads.append(grad_top.float())
        grad_h = torch.zeros_like(hidden) if want_h else None
        grad_w = torch.zeros_like(weight) if want_w else None
        if not ids:
            return grad_h, grad_w, None, None, None, None, None, None
        ids = torch.cat(ids, dim=1) - ctx.vocab_start
        grads = torch.cat(grads, dim=1)
        here = (ids >= 0) & (ids < shard)
        ids = ids.clamp(0, max(shard - 1, 0))
        grads_here = torch.where(here, grads, 0.0)
        total = grads.sum(dim=1)

        for start in range(0, n, ctx.chunk_size):
            end = min(start + ctx.chunk_size, n)
            rows = hidden[start:end]
            # Softmax recomputed in place, then turned into the logits' gradient in place.
            d_logits = _chunk_logits(rows, weight).sub_(lse[start:end, None]).exp_()
            d_logits.mul_(-total[start:end, None])
            d_logits.scatter_add_(1, ids[start:end], grads_here[start:end])
            d_logits = d_logits.to(hidden.dtype)
            if want_h:
                grad_h[start:end] = torch.matmul(d_logits, weight)
            if want_w:
                grad_w.addmm_(d_logits.t(), rows)
            del d_logits
        return grad_h, grad_w, None, None, None, None, None, None


# ---------------------------------------------------------------------------------------------
# Public entry point.


def compute_forward_output(
    hidden_local: torch.Tensor,
    output_weight: torch.Tensor,
    plan: ContextParallelPlan,
    *,
    labels: Optional[torch.Tensor] = None,
    fields: Union[str, Sequence[str]] = ("hidden_states",),
    top_k: int = 0,
    cp_group: Optional[dist.ProcessGroup] = None,
    tp_group: Optional[dist.ProcessGroup] = None,
    sequence_parallel: bool = False,
    gather_logits: bool = True,
    chunk_size: int = 512,
    context_parallel_output_grad: bool = False,
) -> ForwardOutput:
    """Forward: fields of the local rows, one CP gather to source order; backward: own rows.

    Every requested field is computed on this rank's rows (vocab-parallel over TP), then all of
    them move into source order with one collective over the CP group. In backward each rank
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
        fields: names from ``FIELDS`` to compute; the others stay None.
        top_k: k of the ``top_k`` field (``1 <= k <= V``).
        cp_group: the CP group; None means megatron-core's (a single rank outside a job).
        tp_group: the TP group; None means megatron-core's (a single rank outside a job).
        sequence_parallel: ``hidden_local`` is sequence-parallel over ``tp_group``.
        gather_logits: False leaves ``logits`` rank-local (``[n_r, V/TP]``, as megatron's output
            layer makes it) and sets ``logits_are_local``; saves an ``[S, V]`` copy per rank.
        chunk_size: rows per chunk for target log-probs and top-k; bounds their working memory
            to a few ``chunk_size x V/TP`` fp32 tensors, forward and backward.
        context_parallel_output_grad: passed to the CP gather: True when CP ranks compute
            different losses on the full outputs, so output gradients are summed over CP.

    Returns:
        ``ForwardOutput`` whose requested fields cover all ``plan.seq_len`` positions in source
        order, identical on every rank of the CP and TP groups (``hidden_states [S, H]``,
        ``target_logprobs`` fp32 ``[S]``, ``top_k`` ``[S, k]``, ``logits [S, V]``), each
        differentiable w.r.t. ``hidden_local`` and ``output_weight`` (token ids excepted).

    Raises:
        ValueError: an unknown field; ``top_k`` requested with k outside ``[1, V]``; labels
            missing, not integer or not ``seq_len`` long; a weight whose hidden size differs from
            the rows'; a CP group size other than ``plan.cp_size``; hidden rows other than
            ``plan.counts[cp_rank]`` (raised through the CP gather's agreement check, so on every
            rank the first time a plan meets a group).
    """
    wanted = _normalise_fields(fields)
    if not isinstance(plan, ContextParallelPlan):
        raise TypeError(f"plan must be a ContextParallelPlan, got {type(plan).__name__}")
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1:
        raise ValueError(f"chunk_size must be a positive int, got {chunk_size!r}")
    cp_group = resolve_context_parallel_group(cp_group)
    tp_group = resolve_tensor_parallel_group(tp_group)
    cp_rank, cp_size = group_rank_and_size(cp_group)
    tp_rank, tp_size = group_rank_and_size(tp_group)
    if cp_size != plan.cp_size:
        raise ValueError(
            f"the CP group has {cp_size} ranks but the plan has cp_size {plan.cp_size}"
        )

    if hidden_local.dim() == 3:
        if hidden_local.shape[1] != 1:
            raise ValueError(
                f"hidden_local [s, b, h] must have b == 1 (packed input), got shape "
                f"{tuple(hidden_local.shape)}"
            )
        hidden_local = hidden_local.squeeze(1)
    elif hidden_local.dim() != 2:
        raise ValueError(
            f"hidden_local must be [n, H] or [n, 1, H], got shape {tuple(hidden_local.shape)}"
        )
    if output_weight.dim() != 2 or output_weight.shape[1] != hidden_local.shape[1]:
        raise ValueError(
            f"output_weight must be [V/TP, H] with H = {hidden_local.shape[1]} (the hidden "
            f"size of hidden_local), got shape {tuple(output_weight.shape)}"
        )
    vocab = output_weight.shape[0] * tp_size
    k = 0
    if "top_k" in wanted:
        if isinstance(top_k, bool) or not isinstance(top_k, int) or not 1 <= top_k <= vocab:
            raise ValueError(
                f"top_k must be an int in [1, {vocab}] (the vocabulary: {output_weight.shape[0]} "
                f"rows x TP {tp_size}), got {top_k!r}"
            )
        k = top_k
    if "target_logprobs" in wanted:
        if labels is None:
            raise ValueError("'target_logprobs' needs labels ([seq_len] ids in source order)")
        if labels.is_floating_point() or labels.is_complex() or labels.dtype == torch.bool:
            raise ValueError(f"labels must hold integer ids, got dtype {labels.dtype}")
        if labels.dim() == 2 and labels.shape[0] == 1:
            labels = labels[0]
        if labels.dim() != 1 or labels.shape[0] != plan.seq_len:
            raise ValueError(
                f"labels must be [seq_len] = [{plan.seq_len}] in source order, got shape "
                f"{tuple(labels.shape)}"
            )
    n_rows = hidden_local.shape[0] * (tp_size if sequence_parallel else 1)
    if n_rows != plan.counts[cp_rank]:
        # Let the CP gather's agreement check report it, so that every CP rank raises alike
        # rather than this one alone while the others wait in the collective.
        # A zero-width stand-in carries the row count (all TP slices together under SP).
        stand_in = hidden_local.new_empty((n_rows, 0))
        gather_from_context_parallel_region({"hidden_states": stand_in}, plan, cp_group)
        raise ValueError(
            f"CP rank {cp_rank} has {n_rows} hidden rows but the plan gives it "
            f"{plan.counts[cp_rank]} (plan counts {plan.counts})"
        )
    if not wanted:
        return ForwardOutput(plan=plan)

    hidden = hidden_local
    if sequence_parallel and tp_size > 1:
        hidden = _GatherFromSequenceParallelRegion.apply(hidden, tp_group, tp_rank, tp_size)
    # Vocab-parallel consumers read `hidden_tp`; `hidden` itself is what every TP rank shares.
    hidden_tp = _CopyToTensorParallelRegion.apply(hidden, tp_group) if tp_size > 1 else hidden

    local = {}
    if "hidden_states" in wanted:
        local["hidden_states"] = hidden
    if "target_logprobs" in wanted or k:
        local_labels = None
        if "target_logprobs" in wanted:
            positions = plan.local_positions(cp_rank, hidden.device)
            local_labels = labels.to(hidden.device).long().index_select(0, positions)
        target_lp, top_lp, top_ids = _VocabParallelLogprobs.apply(
            hidden_tp, output_weight, local_labels, k, chunk_size, tp_group, tp_rank, tp_size
        )
        if local_labels is not None:
            local["target_logprobs"] = target_lp
        if k:
            local["top_k_logprobs"] = top_lp
            local["top_k_tokens"] = top_ids
    logits_local = None
    if "logits" in wanted:
        logits_local = torch.matmul(hidden_tp, output_weight.t())
        if gather_logits:
            if tp_size > 1:
                logits_local = _GatherFromVocabParallelRegion.apply(
                    logits_local, tp_group, tp_rank, tp_size
                )
            local["logits"] = logits_local

    full = {}
    if local:
        full = gather_from_context_parallel_region(
            local, plan, cp_group, context_parallel_output_grad=context_parallel_output_grad
        )
    out = ForwardOutput(
        hidden_states=full.get("hidden_states"),
        target_logprobs=full.get("target_logprobs"),
        logits=full.get("logits"),
        plan=plan,
    )
    if k:
        out.top_k = TopK(logprobs=full["top_k_logprobs"], tokens=full["top_k_tokens"])
    if "logits" in wanted and not gather_logits:
        out.logits, out.logits_are_local = logits_local, True
    return out


def make_output_processor(
    plan: ContextParallelPlan,
    *,
    labels: Optional[torch.Tensor] = None,
    fields: Union[str, Sequence[str]] = ("hidden_states",),
    top_k: int = 0,
    cp_group: Optional[dist.ProcessGroup] = None,
    gather_logits: bool = True,
    chunk_size: int = 512,
    context_parallel_output_grad: bool = False,
) -> Callable[..., ForwardOutput]:
    """A megatron-core ``GPTModel.forward(output_processor=...)`` hook returning ``ForwardOutput``.

    The hook receives the decoder's final hidden states ``[s_local, 1, H]`` and the model's
    output layer; the TP group and sequence parallelism come from that ``ColumnParallelLinear``
    (``output_layer.tp_group``, ``output_layer.sequence_parallel``), the weight from
    ``output_weight`` when embeddings are shared, else ``output_layer.weight``. Pass
    ``cp_group=model.pg_collection.cp`` (None: ``parallel_state``'s CP group). ``labels`` are
    the full sequence's, in source order; the model's own (CP-local) labels are ignored.

    Raises:
        ValueError (when called): the model uses MuP logit scaling or an output-layer bias,
            which this head does not apply.
    """

    def output_processor(
        *, hidden_states: torch.Tensor, output_layer, output_weight=None, config=None, **_: Any
    ) -> ForwardOutput:
        if config is not None and getattr(config, "use_mup", False):
            raise ValueError("make_output_processor does not apply MuP logit scaling (use_mup)")
        if getattr(output_layer, "bias", None) is not None:
            raise ValueError("make_output_processor does not apply an output-layer bias")
        weight = output_weight if output_weight is not None else output_layer.weight
        return compute_forward_output(
            hidden_states,
            weight,
            plan,
            labels=labels,
            fields=fields,
            top_k=top_k,
            cp_group=cp_group,
            tp_group=getattr(output_layer, "tp_group", None),
            sequence_parallel=bool(getattr(output_layer, "sequence_parallel", False)),
            gather_logits=gather_logits,
            chunk_size=chunk_size,
            context_parallel_output_grad=context_parallel_output_grad,
        )

    return output_processor
