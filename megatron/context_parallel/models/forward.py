"""megatron-core ``GPTModel.forward`` under CP for any plan: one batch helper, one forward path.

``context_parallel_batch(model, input_ids, labels, ...)`` takes the caller's whole packed batch
in the caller's order and returns, for this rank, everything ``GPTModel.forward`` needs: the
local input ids and position ids (this rank's rows, in its plan's order), the attention inputs
(``packed_seq_params`` with its max lengths filled, or a mask) and an ``output_processor`` that
turns the final hidden rows into a ``ForwardOutput`` whose fields cover the whole batch in source
order on every CP rank. A megatron ``forward_step_func`` calls it and then the model::

    batch = context_parallel_batch(model, tokens, labels, cu_seqlens=cu, fields="target_logprobs")
    output = model(**batch.forward_kwargs())   # ForwardOutput on the last pipeline stage

so megatron-core's schedules, ``DistributedDataParallel``, ``finalize_model_grads`` and pipeline
stages run unchanged. ``context_parallel_forward`` is exactly those two lines. A megatron-core
``HybridModel`` goes through the same two lines: its forward has no ``output_processor``, so the
batch attaches hooks that add one (``megatron.context_parallel.models.hybrid``), and its attention
layers follow the rules below while its other layers are checked there.

Positions: every local row keeps its *source* position. Learned absolute embeddings get the
caller's ``position_ids`` of those rows; rotary embeddings are evaluated at them by
``ContextParallelSelfAttention`` (so any plan rotates exactly like the unsharded sequence);
attention masks by source position.

Attention backends, found from the layers' modules; combinations that cannot be right raise
``ValueError`` naming the plan and the module before anything runs:

* ``ContextParallelSelfAttention`` + ``ContextParallelAttention``
  (``get_gpt_layer_with_context_parallel_spec``): any plan.
* Another self-attention + ``ContextParallelAttention``: megatron-core applies ``GPTModel``'s
  zigzag-sliced rotary table, so only plans where that table is exact (Megatron's zigzag layout
  of one sequence with position ids ``0 .. S-1``).
* TransformerEngine's ``TEDotProductAttention``: only the layouts TE's own CP attention expects,
  ``ContextParallelPlan.zigzag`` for one sequence (``sbhd``) and ``ContextParallelPlan.thd`` for
  packed sequences (``thd``, rotary per sequence), with default position ids.
* megatron-core's ``DotProductAttention``: CP 1 only, rows whose rotary positions are
  ``0 .. n-1`` in row order (any row order and packing without rotary); an explicit mask
  keeps attention causal by source position and within each sequence.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, Callable, Dict, Optional, Sequence, Tuple, Union

import torch
import torch.distributed as dist
from torch import Tensor

from megatron.context_parallel.attention.layers import (
    ContextParallelAttention,
    ContextParallelSelfAttention,
)
from megatron.context_parallel.attention.rotary import megatron_rotary_is_exact, rotary_table_length
from megatron.context_parallel.comm import groups
from megatron.context_parallel.comm.plan import ContextParallelPlan, as_cu_seqlens
from megatron.context_parallel.head.output import (
    ForwardOutput,
    OutputOptions,
    make_output_processor,
)
from megatron.context_parallel.models import hybrid
from megatron.context_parallel.params import ContextParallelParams, default_position_ids
from megatron.context_parallel.tree import PrefixTree, tree_plan

__all__ = [
    "ContextParallelBatch",
    "context_parallel_batch",
    "context_parallel_forward",
    "default_plan",
]

# Attention backends (see the module docstring).
_SOURCE, _MEGATRON_ROTARY, _TE, _LOCAL, _NO_LAYERS = (
    "source",
    "megatron_rotary",
    "transformer_engine",
    "local",
    "no_layers",
)

_INT_DTYPES = (torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8)


# ---------------------------------------------------------------------------------------------
# Plans.


@functools.lru_cache(maxsize=64)
def _cached_default_plan(
    seq_len: int, cp_size: int, cu_seqlens: Optional[Tuple[int, ...]]
) -> ContextParallelPlan:
    # Cached: a repeated batch shape reuses its plan (and the plan's device index tensors).
    if cu_seqlens is not None:
        lengths = [b - a for a, b in zip(cu_seqlens[:-1], cu_seqlens[1:])]
        if all(n % (2 * cp_size) == 0 for n in lengths):
            return ContextParallelPlan.thd(cu_seqlens, cp_size)
        # Uneven documents: contiguous blocks of the packed buffer, keeping the packing so the
        # output still splits per sequence.
        blocks = ContextParallelPlan.contiguous(seq_len, cp_size)
        return ContextParallelPlan.from_rank_positions(
            [blocks.local_positions(r) for r in range(cp_size)], seq_len, cu_seqlens
        )
    if seq_len % (2 * cp_size) == 0:
        return ContextParallelPlan.zigzag(seq_len, cp_size)
    return ContextParallelPlan.contiguous(seq_len, cp_size)


@functools.lru_cache(maxsize=64)
def _cached_tree_plan(tree: PrefixTree, cp_size: int) -> ContextParallelPlan:
    return tree_plan(tree, cp_size)


def default_plan(
    seq_len: int, cp_size: int, cu_seqlens: Optional[Sequence[int]] = None
) -> ContextParallelPlan:
    """The plan ``context_parallel_batch`` picks when none is given.

    With ``cu_seqlens``: TE's THD layout (``ContextParallelPlan.thd``) when every sequence
    length divides by ``2 * cp_size``, else contiguous blocks of the packed buffer (packing
    kept). Without: Megatron's zigzag when ``seq_len`` divides by ``2 * cp_size``, else
    contiguous blocks. Plans are cached per (seq_len, cp_size, cu_seqlens).
    """
    cu = None if cu_seqlens is None else as_cu_seqlens(cu_seqlens)
    if cu is not None and cu[-1] != seq_len:
        raise ValueError(f"cu_seqlens ends at {cu[-1]} but the batch has {seq_len} tokens")
    return _cached_default_plan(int(seq_len), int(cp_size), cu)


def _resolve_plan(
    plan: Optional[ContextParallelPlan],
    seq_len: int,
    cp_size: int,
    cu: Optional[Tuple[int, ...]],
    tree: Optional[PrefixTree] = None,
) -> Tuple[ContextParallelPlan, Optional[Tuple[int, ...]]]:
    """(the batch's plan, its cu_seqlens); ValueError naming the numbers when they disagree."""
    if cu is not None and cu[-1] != seq_len:
        raise ValueError(f"cu_seqlens ends at {cu[-1]} but input_ids has {seq_len} tokens")
    if tree is not None:
        _check_tree(tree, seq_len, cu, plan)
    if plan is None:
        plan = (
            _cached_default_plan(seq_len, cp_size, cu)
            if tree is None
            else _cached_tree_plan(tree, cp_size)
        )
    elif not isinstance(plan, ContextParallelPlan):
        raise TypeError(f"plan must be a ContextParallelPlan, got {type(plan).__name__}")
    if plan.seq_len != seq_len:
        raise ValueError(f"the plan covers {plan.seq_len} positions but input_ids has {seq_len}")
    if plan.cp_size != cp_size:
        raise ValueError(
            f"the CP group has {cp_size} ranks but the plan has cp_size {plan.cp_size}"
        )
    if cu is not None and plan.cu_seqlens is not None and cu != plan.cu_seqlens:
        raise ValueError(f"cu_seqlens {list(cu)} differ from the plan's {list(plan.cu_seqlens)}")
    if plan.max_count == 0:
        raise ValueError(f"the plan owns no position of the {seq_len}-token batch")
    return plan, (cu if cu is not None else plan.cu_seqlens)


def _check_tree(tree, seq_len: int, cu, plan: Optional[ContextParallelPlan]) -> None:
    """ValueError unless ``tree`` is a ``PrefixTree`` of ``seq_len`` positions without
    ``cu_seqlens`` (the tree's roots are the sequences)."""
    if not isinstance(tree, PrefixTree):
        raise TypeError(f"tree must be a PrefixTree, got {type(tree).__name__}")
    tree.check_seq_len(seq_len)
    if cu is not None or (plan is not None and plan.cu_seqlens is not None):
        raise ValueError(
            f"a tree-packed batch ({tree}) takes no cu_seqlens: its roots are the sequences"
        )


# ---------------------------------------------------------------------------------------------
# The model.


def _as_sequence(t: Tensor, what: str, seq_len: Optional[int] = None) -> Tensor:
    """``[S]`` from ``[S]`` or ``[1, S]``; ValueError naming the shape otherwise."""
    if not isinstance(t, Tensor):
        raise TypeError(f"{what} must be a tensor, got {type(t).__name__}")
    if t.dim() == 2 and t.shape[0] == 1:
        t = t[0]
    if t.dim() != 1:
        raise ValueError(f"{what} must be [S] or [1, S] (one packed batch), got {tuple(t.shape)}")
    if t.dtype not in _INT_DTYPES:
        raise ValueError(f"{what} must hold integers, got dtype {t.dtype}")
    if seq_len is not None and t.shape[0] != seq_len:
        raise ValueError(f"{what} has {t.shape[0]} positions but input_ids has {seq_len}")
    return t


def _unwrap(model):
    """The GPTModel or HybridModel (or pipeline stage of one) inside DDP / Float16Module style
    wrappers."""
    inner = model
    while not hasattr(inner, "decoder") and hasattr(inner, "module"):
        inner = inner.module
    for name in ("decoder", "config", "position_embedding_type"):
        if not hasattr(inner, name):
            raise TypeError(
                f"context_parallel_batch needs a megatron-core GPTModel or HybridModel (or a "
                f"pipeline stage of one); {type(model).__name__} has no {name!r}"
            )
    return inner


def _check_model(gpt) -> None:
    config = gpt.config
    if getattr(config, "use_mup", False):
        raise ValueError("context_parallel_batch does not support MuP logit scaling")
    if config.multi_latent_attention:
        raise ValueError("context_parallel_batch does not support multi-latent attention")
    if gpt.position_embedding_type not in ("rope", "learned_absolute", "none"):
        raise ValueError(
            f"position_embedding_type {gpt.position_embedding_type!r} is not supported under CP"
        )


def _attention_backend(gpt) -> Tuple[str, str]:
    """(backend, the layers' attention modules in words, for messages)."""
    kinds, names = set(), set()
    is_hybrid = hybrid.is_hybrid_model(gpt)
    for layer in hybrid.attention_layers(gpt) if is_hybrid else gpt.decoder.layers:
        attention = getattr(layer, "self_attention", None)
        core = getattr(attention, "core_attention", None)
        names.add(f"{type(attention).__name__} with {type(core).__name__}")
        if isinstance(core, ContextParallelAttention):
            own = isinstance(attention, ContextParallelSelfAttention)
            kinds.add(_SOURCE if own else _MEGATRON_ROTARY)
        elif type(core).__name__ == "TEDotProductAttention":
            kinds.add(_TE)
        elif type(core).__name__ == "DotProductAttention":
            kinds.add(_LOCAL)
        else:
            spec = (
                "get_hybrid_stack_with_context_parallel_spec()"
                if is_hybrid
                else "get_gpt_layer_with_context_parallel_spec()"
            )
            raise TypeError(
                f"unsupported core attention {type(core).__name__}; build the model with "
                f"{spec} (or TE's spec for zigzag / THD plans)"
            )
    if not kinds:
        return _NO_LAYERS, "no layers"
    if len(kinds) != 1:
        raise TypeError(f"the layers mix attention modules: {sorted(names)}")
    return kinds.pop(), names.pop()


def _same_rows(a: ContextParallelPlan, b: Optional[ContextParallelPlan]) -> bool:
    return (
        b is not None
        and a.counts == b.counts
        and all(torch.equal(a.local_positions(r), b.local_positions(r)) for r in range(a.cp_size))
    )


def _check_plan_for_backend(
    backend: str,
    module: str,
    plan: ContextParallelPlan,
    cu: Optional[Tuple[int, ...]],
    positions: Callable[[], Tensor],
    rotary: bool,
) -> None:
    """ValueError naming the plan and the module when the layers would compute on wrong rows.

    ``positions()`` gives the batch's position ids on the host (only read when needed).
    """
    if backend == _TE and plan.cp_size > 1:
        if cu is None:
            name = "ContextParallelPlan.zigzag"
            expected = None
            if plan.seq_len % (2 * plan.cp_size) == 0:
                expected = ContextParallelPlan.zigzag(plan.seq_len, plan.cp_size)
        else:
            name = "ContextParallelPlan.thd"
            try:
                expected = ContextParallelPlan.thd(cu, plan.cp_size)
            except ValueError:
                expected = None
        if not _same_rows(plan, expected):
            raise ValueError(
                f"{module} under CP needs the {name} layout; got {plan}. Use "
                "get_gpt_layer_with_context_parallel_spec() for other plans"
            )
        if rotary and not torch.equal(positions(), default_position_ids(plan.seq_len, cu)):
            raise ValueError(
                f"{module} applies megatron-core's rotary table, which assumes position ids "
                f"0 .. len-1 per sequence; {plan} was given other position ids"
            )
    elif backend == _LOCAL:
        if plan.cp_size > 1:
            raise ValueError(
                f"{module} cannot run CP {plan.cp_size} ({plan}); build the model with "
                "get_gpt_layer_with_context_parallel_spec()"
            )
        if rotary and not megatron_rotary_is_exact(plan, positions(), plan.counts[0]):
            raise ValueError(
                f"{module} applies megatron-core's rotary table at row indices 0 .. n-1, which "
                f"are not the position ids of the rows of {plan}; build the model with "
                "get_gpt_layer_with_context_parallel_spec()"
            )
    elif backend == _MEGATRON_ROTARY:
        table_len = rotary_table_length(plan.seq_len, plan.cp_size)
        if not megatron_rotary_is_exact(plan, positions(), table_len):
            raise ValueError(
                f"{module}: megatron-core's SelfAttention applies GPTModel's own rotary table, "
                f"sliced in zigzag order, which is wrong for the rows of {plan}. Build the "
                "layers with get_gpt_layer_with_context_parallel_spec() "
                "(ContextParallelSelfAttention applies rotary at source positions)"
            )


def _lengths(cu: Sequence[int]) -> list:
    return [b - a for a, b in zip(cu[:-1], cu[1:])]


# ---------------------------------------------------------------------------------------------
# The batch.


@dataclass
class ContextParallelBatch:
    """What ``GPTModel.forward`` needs on this rank for one packed batch under a CP plan.

    Attributes:
        input_ids: int ``[1, n]``: this rank's token ids in its plan's order (``n =
            plan.counts[rank]``, or one padding row on a rank that owns nothing); None when the
            caller passed no ids (pipeline stages after the first ignore them).
        position_ids: int64 ``[1, n]``: the position ids of those rows.
        attention_mask: bool ``[1, 1, n, n]`` (True = masked) for megatron-core's
            ``DotProductAttention`` at CP 1; None for the other backends.
        packed_seq_params: ``ContextParallelParams`` for the package's attention (rotary rows at
            source positions, ``max_seqlen_q / kv`` filled), TE's THD ``PackedSeqParams``, or
            None (TE zigzag, megatron-core's attention).
        output_processor: the ``GPTModel.forward(output_processor=...)`` hook returning the
            ``ForwardOutput`` (full sequence, caller order, every CP rank) on the last pipeline
            stage; it drops the padding row of an empty rank first.
        plan: the batch's ``ContextParallelPlan``.
        cp_size: the CP group size. A 3-tuple ``loss_func`` returns ``loss_sum * cp_size``
            (megatron divides by a token count summed over DP x CP); ``loss_func()`` does it.
        padding_rows: 1 on a rank that owns no position (it runs one padding row), else 0.
        per_token_loss: the model's ``config.calculate_per_token_loss``.
        attention_shape: ``(query heads on this TP rank, head dimension)`` of the model's
            attention layers, for which ``prepare`` stages the backward's calls.
    """

    input_ids: Optional[Tensor]
    position_ids: Tensor
    attention_mask: Optional[Tensor]
    packed_seq_params: Any
    output_processor: Callable[..., ForwardOutput]
    plan: ContextParallelPlan
    cp_size: int
    padding_rows: int
    per_token_loss: bool = False
    attention_shape: Optional[Tuple[int, int]] = None

    def forward_kwargs(self) -> Dict[str, Any]:
        """Keyword arguments of ``GPTModel.forward`` (``model(**batch.forward_kwargs())``)."""
        return dict(
            input_ids=self.input_ids,
            position_ids=self.position_ids,
            attention_mask=self.attention_mask,
            packed_seq_params=self.packed_seq_params,
            output_processor=self.output_processor,
        )

    def prepare(self, device=None, *, heads=None, head_dim=None) -> "ContextParallelBatch":
        """Builds the batch's attention tables ahead of the forward (see
        ``ContextParallelParams.prepare``, whose arguments these are; ``heads`` and
        ``head_dim`` default to ``attention_shape``, the model's); nothing to do for batches
        without the package's params (TE, megatron-core's attention). Returns ``self``."""
        if isinstance(self.packed_seq_params, ContextParallelParams):
            if heads is None and head_dim is None and self.attention_shape is not None:
                heads, head_dim = self.attention_shape
            self.packed_seq_params.prepare(device, heads=heads, head_dim=head_dim)
        return self

    @property
    def pipeline_seq_length(self) -> Optional[int]:
        """``seq_length`` for megatron's pipeline schedules, or None when there is none.

        The schedules size the tensors passed between stages as ``seq_length / cp_size`` rows.
        That is every rank's row count only when the plan's shards are equal (zigzag, THD,
        equal contiguous blocks): then this is ``rows * cp_size``. For uneven or empty shards
        it is None: set ``config.variable_seq_lengths = True`` so the stages exchange shapes.
        """
        rows = _stage_rows(self.plan)
        if len(rows) != 1:
            return None
        return rows.pop() * self.cp_size

    def loss_func(self, loss_func: Callable[..., tuple]) -> Callable[..., tuple]:
        """``loss_func`` scaled for megatron's schedules, so gradients equal those of CP 1.

        Write ``loss_func`` as for CP 1, on the full-sequence ``ForwardOutput`` (the same on
        every CP rank), and return ``batch.loss_func(loss_func)`` from the
        ``forward_step_func``. megatron-core treats a loss as this rank's share of the batch;
        here every CP rank holds the loss of the whole batch, so:

        * a 3-tuple ``(loss_sum, num_tokens, report)`` becomes ``(loss_sum * cp_size,
          num_tokens, report)``: megatron divides by a token count summed over DP x CP, in
          which every CP rank counted the whole batch;
        * a 2-tuple ``(loss, report)`` becomes ``(loss / cp_size, report)`` under
          ``config.calculate_per_token_loss``: megatron multiplies a 2-tuple loss by
          ``cp_size`` and, in that mode, never divides by DP x CP, so CP would scale the
          gradients by ``cp_size``. Otherwise the loss passes unchanged (megatron's ``cp_size``
          and its DP x CP average cancel).

        Either way the schedule receives a new tensor, so its in-place scaling of the loss
        never reaches a ``report`` that shares the caller's loss.

        Args:
            loss_func: megatron's ``loss_func(output)`` (``output`` the ``ForwardOutput``),
                returning ``(loss, report)`` or ``(loss_sum, num_tokens, report)`` with a
                scalar loss; the gradient flows back through the scaled loss unchanged
                otherwise.

        Returns:
            A callable with ``loss_func``'s signature, for the ``forward_step_func`` to return.

        Raises:
            TypeError: ``loss_func`` returned something other than a 2- or 3-tuple (same on
                every CP rank: they all compute it on the same output).
        """
        cp_size, per_token = self.cp_size, self.per_token_loss

        def scaled(output, *args, **kwargs):
            result = loss_func(output, *args, **kwargs)
            if kwargs.get("non_loss_data"):
                return result  # megatron's collect_non_loss_data path: no loss to scale
            if not isinstance(result, tuple) or len(result) not in (2, 3):
                got = f"{len(result)}-tuple" if isinstance(result, tuple) else type(result).__name__
                raise TypeError(
                    "a megatron loss_func returns (loss, report) or (loss_sum, num_tokens, "
                    f"report); got a {got}"
                )
            if len(result) == 3:
                loss, num_tokens, report = result
                return loss * cp_size, num_tokens, report
            loss, report = result
            return (loss / cp_size if per_token else loss * 1), report

        return scaled


def _stage_rows(plan: ContextParallelPlan) -> set:
    """The row counts the ranks' pipeline stages pass on (an empty rank runs one padding row)."""
    return {c if c else 1 for c in plan.counts}


def _drop_padding(processor: Callable[..., ForwardOutput], padding_rows: int):
    """The output processor, minus the padding row an empty rank ran through the layers."""
    if not padding_rows:
        return processor

    def output_processor(*, hidden_states: Tensor, **kwargs: Any) -> ForwardOutput:
        return processor(
            hidden_states=hidden_states[: hidden_states.shape[0] - padding_rows], **kwargs
        )

    return output_processor


def _local_mask(plan: ContextParallelPlan, cu, device, tree=None) -> Tensor:
    """bool ``[1, 1, n, n]``, True = masked: causal by source position, within each sequence.

    For megatron-core's ``DotProductAttention`` at CP 1, whose own causal mask assumes the rows
    are in source order.
    """
    params = ContextParallelParams.for_plan(plan, None, device=device, cu_seqlens=cu, tree=tree)
    return ~params.allowed(True)[None, None]


def _te_thd_params(cu: Tuple[int, ...], cp_group, device):
    """megatron-core's THD ``PackedSeqParams`` for TE: the unsplit ``cu_seqlens`` (int32), the
    longest sequence, the CP group. TE then picks each rank's rows (``ContextParallelPlan.thd``)
    and megatron-core applies rotary per sequence."""
    from megatron.core.packed_seq_params import PackedSeqParams

    longest = max(_lengths(cu), default=0)
    cu_t = torch.tensor(cu, dtype=torch.int32, device=device)
    return PackedSeqParams(
        qkv_format="thd",
        cu_seqlens_q=cu_t,
        cu_seqlens_kv=cu_t,
        cu_seqlens_q_padded=cu_t,
        cu_seqlens_kv_padded=cu_t,
        max_seqlen_q=longest,
        max_seqlen_kv=longest,
        cp_group=cp_group,
    )


def context_parallel_batch(
    model,
    input_ids: Optional[Tensor],
    labels: Optional[Tensor] = None,
    *,
    position_ids: Optional[Tensor] = None,
    cu_seqlens: Optional[Union[Sequence[int], Tensor]] = None,
    plan: Optional[ContextParallelPlan] = None,
    cp_group: Optional[dist.ProcessGroup] = None,
    tree: Optional[PrefixTree] = None,
    options: Optional[OutputOptions] = None,
    **option_keywords: Any,
) -> ContextParallelBatch:
    """Everything ``GPTModel.forward`` needs on this rank to run one packed batch under CP.

    Every rank of the CP group (and every pipeline stage) calls it with the same full batch.
    The local rows are picked on the host side of the plan; the only communication is one
    small exchange over the CP group (and the TP group, when it has several ranks) in which
    the ranks compare their plans and calls and share any rank's bad input, so that the
    model's own collectives run only on rows every rank agrees on.

    Args:
        model: a megatron-core ``GPTModel`` or one pipeline stage of it, possibly wrapped
            (``DistributedDataParallel``, ``Float16Module``: anything with ``.module``).
        input_ids: int ``[S]`` or ``[1, S]``: the packed batch in the caller's order. May be
            None on pipeline stages that do not embed (``pre_process=False``) when ``plan`` is
            given.
        labels: int ``[S]`` (or ``[1, S]``) targets in source order, already shifted; -100 marks
            positions without one. Full length, never sliced; needed for ``target_logprobs``
            (read on the last pipeline stage only). Or ``[S, K]`` several targets per row
            (``PrefixTree.labels``: a fork row's next token in each child); ``target_logprobs``
            is then ``[S, K]``.
        position_ids: int ``[S]`` position ids of the batch in source order; default ``0 ..
            len-1`` within each packed sequence. Rotary and learned embeddings use them.
        cu_seqlens: cumulative lengths ``(0, l0, l0+l1, ..., S)`` of packed sequences (a list or
            CPU tensor; a device tensor is read back once); attention stays within a sequence.
        plan: the ``ContextParallelPlan`` (the same on every CP rank); default ``default_plan(S,
            cp, cu_seqlens)``, or ``tree_plan(tree, cp)`` under a tree.
        cp_group: the CP group; default the model's (``pg_collection.cp``), else megatron-core's
            ``parallel_state`` one.
        tree: a ``PrefixTree`` for shared-prefix packing (no ``cu_seqlens`` then): each query
            sees its segment's ancestors and its own segment up to itself; position ids default
            to ``tree.position_ids()``; the output's ``samples()`` gives each root-to-leaf path
            as the flat sample would.
        options: an ``OutputOptions`` for the ``ForwardOutput``; or pass its fields
            (``fields``, ``top_k``, ``gather_logits``, ``chunk_size``,
            ``context_parallel_output_grad``) as keywords, as to ``compute_forward_output``.

    Returns:
        A ``ContextParallelBatch``; ``model(**batch.forward_kwargs())`` returns the
        ``ForwardOutput`` on the last pipeline stage and the hidden rows ``[n, 1, H]`` (this
        rank's, plan order) on the others.

    Raises:
        ValueError / TypeError, on every rank of the CP (and TP) group alike: malformed inputs;
            a plan whose ``seq_len`` or ``cp_size`` does not match; ``cu_seqlens`` that disagree
            with the plan's; bad output options; an unsupported model feature (MLA, YaRN /
            mRoPE, MuP); a plan the model's attention modules cannot run correctly (the message
            names the plan and the module); ranks whose plans or calls differ. A rank that
            found the problem itself raises its own message; its peers raise an
            ``InputError`` naming that rank. Pipeline stages are not in the exchange: a stage
            waiting for a failed one is released by the process group's timeout.
    """
    gpt = _unwrap(model)
    pgs = getattr(gpt, "pg_collection", None)
    if cp_group is None:
        cp_group = getattr(pgs, "cp", None) if pgs is not None else None
        if cp_group is None:
            cp_group = groups.resolve_context_parallel_group(None)
    tp_group = getattr(pgs, "tp", None) if pgs is not None else None
    problem: Optional[BaseException] = None
    batch: Optional[ContextParallelBatch] = None
    call = _undescribed_call()
    try:
        batch, call = _prepare_batch(
            gpt,
            input_ids,
            labels,
            position_ids,
            cu_seqlens,
            plan,
            cp_group,
            tp_group,
            OutputOptions.resolve(options, option_keywords),
            tree,
        )
    except Exception as exc:  # noqa: BLE001 - every rank must hear of any problem
        problem = exc
    _agree(problem, call, cp_group, tp_group)
    return batch


# A call's description: the plan's agreement values, the output options' ``describe()``, then
# these. A rank whose preparation failed sends zeros of the same length (``_undescribed_call``).
_CALL_TAIL = (
    "cu_seqlens_hash",
    "backend",
    "labels_given",
    "label_columns",
    "input_ids_given",
    "tree_fingerprint",
)
_BACKEND_CODES = {_SOURCE: 1, _MEGATRON_ROTARY: 2, _TE: 3, _LOCAL: 4, _NO_LAYERS: 5}


def _undescribed_call() -> Tuple[int, ...]:
    """Zeros as long as any good rank's call description, derived from the same parts."""
    options = len(OutputOptions().describe())
    return (0,) * (ContextParallelPlan.AGREEMENT_VALUES + options + len(_CALL_TAIL))


def _batch_inputs(gpt, input_ids, labels, plan):
    """(input_ids [S] or None, labels [S] or None, S, device); ValueError on a bad batch."""
    if input_ids is not None:
        input_ids = _as_sequence(input_ids, "input_ids")
        seq_len, device = input_ids.shape[0], input_ids.device
    elif getattr(gpt, "pre_process", True):
        raise ValueError("input_ids are needed on the first pipeline stage (it embeds them)")
    elif plan is None:
        raise ValueError("without input_ids (a later pipeline stage) the plan must be given")
    else:
        seq_len = plan.seq_len
        device = next(gpt.parameters()).device
    if labels is not None:
        labels = _as_labels(labels, seq_len)
    return input_ids, labels, seq_len, device


def _as_labels(labels: Tensor, seq_len: int) -> Tensor:
    """``[S]`` or ``[S, K]`` integer labels (``[1, S]`` accepted); ValueError otherwise."""
    if isinstance(labels, Tensor) and labels.dim() == 2 and labels.shape[0] == seq_len != 1:
        if labels.dtype not in _INT_DTYPES or labels.shape[1] < 1:
            raise ValueError(
                f"labels [S, K] must hold integers with K >= 1, got {labels.dtype} "
                f"{tuple(labels.shape)}"
            )
        return labels
    return _as_sequence(labels, "labels", seq_len)


def _check_layout(config, plan, tp_size: int) -> None:
    """Refuse plans the model's pipeline or sequence-parallel settings cannot carry."""
    if (
        config.pipeline_model_parallel_size > 1
        and not config.variable_seq_lengths
        and len(_stage_rows(plan)) != 1
    ):
        raise ValueError(
            f"pipeline stages pass every CP rank's rows between them, but the CP ranks of "
            f"{plan} run {list(plan.counts)} rows (an empty rank runs 1) and "
            "config.variable_seq_lengths is False: set config.variable_seq_lengths = True so "
            "the stages exchange shapes"
        )
    if config.sequence_parallel and tp_size > 1 and any(c == 0 or c % tp_size for c in plan.counts):
        raise ValueError(
            f"sequence parallelism needs every CP shard non-empty and divisible by TP "
            f"{tp_size}; plan counts {plan.counts}"
        )


def _local_rows(plan, cp_rank, input_ids, position_ids, device):
    """(local ids or None, local position ids, padding rows): this rank's rows by an index (no
    communication: ids carry no gradient), one padding row on an empty rank (megatron-core's
    layers cannot run zero rows)."""
    padding = 1 if plan.counts[cp_rank] == 0 else 0
    rows = plan.local_positions(cp_rank, device)
    local_positions = position_ids.to(device, torch.int64).index_select(0, rows)
    local_ids = None if input_ids is None else input_ids.index_select(0, rows)
    if padding:
        local_positions = local_positions.new_zeros(1)
        local_ids = None if local_ids is None else local_ids.new_zeros(1)
    return local_ids, local_positions, padding


def _attention_inputs(gpt, backend, plan, cu, cp_group, cp_size, position_ids, device, tree):
    """(attention_mask, packed_seq_params) for the layers' attention backend."""
    rotary = gpt.position_embedding_type == "rope"
    # A hybrid's Gated DeltaNet layers take their rows from the params too, also on a pipeline
    # stage without attention layers.
    with_params = backend == _NO_LAYERS and hybrid.is_hybrid_model(gpt)
    if backend in (_SOURCE, _MEGATRON_ROTARY) or with_params:
        packed = ContextParallelParams.for_plan(
            plan,
            cp_group if cp_size > 1 else None,
            device=device,
            cu_seqlens=cu,
            position_ids=position_ids,
            rotary=gpt.rotary_pos_emb if rotary and backend == _SOURCE else None,
            # Every layer applies the rows above: GPTModel's own table would be dead work.
            megatron_table=backend != _SOURCE,
            tree=tree,
        )
        return None, packed
    if backend == _LOCAL:
        return _local_mask(plan, cu, device, tree), None
    if backend == _TE and cu is not None:
        return None, _te_thd_params(cu, cp_group, device)
    return None, None


def _call_description(plan, options, cu, backend, labels, input_ids, tree) -> Tuple[int, ...]:
    """The ints every rank compares in the exchange (fixed length: see ``_CALL_TAIL``)."""
    tail = dict(
        # Tuples of ints hash alike in every process.
        cu_seqlens_hash=0 if cu is None else hash(cu) & ((1 << 62) - 1),
        backend=_BACKEND_CODES[backend],
        labels_given=int(labels is not None),
        label_columns=0 if labels is None or labels.dim() == 1 else labels.shape[1],
        input_ids_given=int(input_ids is not None),
        tree_fingerprint=0 if tree is None else tree.fingerprint,
    )
    return (
        *plan.agreement_values(),
        *options.describe(),
        *(tail[name] for name in _CALL_TAIL),
    )


def _prepare_batch(
    gpt, input_ids, labels, position_ids, cu_seqlens, plan, cp_group, tp_group, options, tree
) -> Tuple[ContextParallelBatch, Tuple[int, ...]]:
    """The batch and the ints that describe the call; local work only, raises on bad input."""
    _check_model(gpt)
    config = gpt.config
    input_ids, labels, seq_len, device = _batch_inputs(gpt, input_ids, labels, plan)
    cp_rank, cp_size = groups.group_rank_and_size(cp_group)
    tp_size = groups.group_rank_and_size(tp_group)[1] if tp_group is not None else 1

    cu = None if cu_seqlens is None else as_cu_seqlens(cu_seqlens)
    plan, cu = _resolve_plan(plan, seq_len, cp_size, cu, tree)
    _check_layout(config, plan, tp_size)
    if position_ids is None:
        position_ids = default_position_ids(seq_len, cu) if tree is None else tree.position_ids()
    else:
        position_ids = _as_sequence(position_ids, "position_ids", seq_len)
    host_positions = functools.lru_cache(maxsize=1)(lambda: position_ids.to("cpu", torch.int64))

    backend, module = _attention_backend(gpt)
    if tree is not None and backend == _TE:
        raise ValueError(f"{module} cannot run a tree-packed batch ({tree}): no tree masks")
    rotary = gpt.position_embedding_type == "rope"
    _check_plan_for_backend(backend, module, plan, cu, host_positions, rotary)
    if hybrid.is_hybrid_model(gpt):
        # HybridModel.forward takes no output_processor: hooks on the model add it.
        hybrid.check_layers(gpt, plan, cu, tree)
        hybrid.attach_head(gpt)

    local_ids, local_positions, padding = _local_rows(
        plan, cp_rank, input_ids, position_ids, device
    )
    attention_mask, packed = _attention_inputs(
        gpt, backend, plan, cu, cp_group, cp_size, position_ids, device, tree
    )
    processor = make_output_processor(
        plan, labels=labels, cp_group=cp_group, options=options, **_tree_outputs(tree, labels)
    )
    batch = ContextParallelBatch(
        input_ids=None if local_ids is None else local_ids[None],
        position_ids=local_positions[None],
        attention_mask=attention_mask,
        packed_seq_params=packed,
        output_processor=_drop_padding(processor, padding),
        plan=plan,
        cp_size=cp_size,
        padding_rows=padding,
        per_token_loss=bool(config.calculate_per_token_loss),
        attention_shape=_attention_shape(config, tp_size),
    )
    return batch, _call_description(plan, options, cu, backend, labels, input_ids, tree)


def _attention_shape(config, tp_size: int) -> Tuple[int, int]:
    """(query heads on one TP rank, head dimension) of a megatron ``TransformerConfig``."""
    head_dim = config.kv_channels or config.hidden_size // config.num_attention_heads
    return config.num_attention_heads // tp_size, head_dim


def _tree_outputs(tree: Optional[PrefixTree], labels: Optional[Tensor]) -> Dict[str, Any]:
    """The output processor's tree keywords: the tree (for ``samples()``) and, for ``[S, K]``
    labels, the fork rows whose further columns are evaluated."""
    if tree is None:
        return {}
    extra: Dict[str, Any] = {"tree": tree}
    if labels is not None and labels.dim() == 2:
        extra["fork_positions"] = tree.fork_positions()
    return extra


def _agree(problem: Optional[BaseException], call, cp_group, tp_group) -> None:
    """One exchange over TP (when it has several ranks), one over CP: every rank raises when
    any rank's preparation failed or the ranks' plans or calls differ; none runs on alone.

    Every rank, the bad one included, raises the first bad rank's ``InputError`` (its numbers and
    note, so the same message everywhere); on the bad rank its own exception is the
    ``__cause__``.
    """
    first = None
    if tp_group is not None and groups.group_rank_and_size(tp_group)[1] > 1:
        first = groups.find_problem_or_difference(problem, tp_group, call)
    first, rows = groups.find_problem(first or problem, cp_group, call)
    if first is not None:
        raise first
    # Every rank sees every row: all raise alike, or none.
    ContextParallelPlan.raise_unless_same(rows)
    groups.raise_if_calls_differ(rows)


def context_parallel_forward(
    model,
    input_ids: Optional[Tensor],
    labels: Optional[Tensor] = None,
    **options: Any,
) -> Union[ForwardOutput, Tensor]:
    """Forward: shard the caller's batch by the plan, run ``GPTModel.forward`` on this rank's
    rows, gather the requested fields to source order on every CP rank; backward: each rank
    gets its rows' gradients.

    Exactly ``model(**context_parallel_batch(model, input_ids, labels, **options)
    .forward_kwargs())``: one forward path, the one megatron's schedules run. Every rank of the
    CP group calls it with the same full batch.

    Args:
        model, input_ids, labels, **options: as ``context_parallel_batch`` (``position_ids``,
            ``cu_seqlens``, ``plan``, ``cp_group``, ``tree``, and the output options:
            ``options=`` an ``OutputOptions``, or its fields ``fields``, ``top_k``,
            ``gather_logits``, ``chunk_size``, ``context_parallel_output_grad`` as keywords).

    Returns:
        ``ForwardOutput`` over all ``S`` positions in the caller's order (``plan`` attached) on
        the last pipeline stage (or without pipeline parallelism); this rank's hidden rows
        ``[n, 1, H]`` on earlier stages (whose input megatron's schedule sets).

    Raises:
        ValueError / TypeError: see ``context_parallel_batch``.
    """
    batch = context_parallel_batch(model, input_ids, labels, **options)
    return model(**batch.forward_kwargs())
