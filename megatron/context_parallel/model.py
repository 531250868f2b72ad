"""One call for a trainer: a megatron-core ``GPTModel`` forward under CP, full outputs back.

``context_parallel_forward(model, input_ids, labels, ...)`` takes the caller's whole packed
batch in the caller's order, picks (or takes) a ``ContextParallelPlan``, keeps this rank's rows
(``scatter_to_context_parallel_region``), runs the embedding and the decoder on them and hands
the final hidden rows to ``compute_forward_output``, which returns a ``ForwardOutput`` whose
fields cover the whole batch in source order on every CP rank. The caller never sees the
topology; gradients of any loss on those outputs flow back to the rows' owners.

Positions: every local row keeps its *source* position. Learned absolute embeddings get the
caller's ``position_ids`` of those rows; rotary embeddings are evaluated at them (so any plan
rotates exactly like the unsharded sequence); attention masks by source position.

Attention backends, found by looking at the layers' ``core_attention``:

* ``ContextParallelAttention`` (``get_gpt_layer_with_context_parallel_spec``): any plan.
* TransformerEngine's ``TEDotProductAttention``: only the layouts TE's own CP attention
  expects, i.e. ``ContextParallelPlan.zigzag`` for one sequence (``sbhd``) and
  ``ContextParallelPlan.thd`` for packed sequences (``thd``, rotary per sequence).
* megatron-core's ``DotProductAttention``: CP 1 only (packed input via an explicit mask).
"""

from __future__ import annotations

import functools
from typing import Optional, Sequence, Tuple, Union

import torch
import torch.distributed as dist

from megatron.context_parallel.attention import ContextParallelAttention, ContextParallelParams
from megatron.context_parallel.groups import group_rank_and_size, resolve_context_parallel_group
from megatron.context_parallel.head import ForwardOutput, compute_forward_output
from megatron.context_parallel.mappings import scatter_to_context_parallel_region
from megatron.context_parallel.plan import ContextParallelPlan, as_cu_seqlens

__all__ = ["context_parallel_forward", "default_plan"]

_REFERENCE, _TE, _LOCAL = "reference", "transformer_engine", "local"

_INT_DTYPES = (torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8)


@functools.lru_cache(maxsize=64)
def _cached_default_plan(
    seq_len: int, cp_size: int, cu_seqlens: Optional[Tuple[int, ...]]
) -> ContextParallelPlan:
    # Cached so a repeated batch shape reuses a plan already verified for the group (the
    # mappings check a plan's agreement across ranks the first time it meets a group).
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


def default_plan(
    seq_len: int, cp_size: int, cu_seqlens: Optional[Sequence[int]] = None
) -> ContextParallelPlan:
    """The plan ``context_parallel_forward`` picks when none is given.

    With ``cu_seqlens``: TE's THD layout (``ContextParallelPlan.thd``) when every sequence
    length divides by ``2 * cp_size``, else contiguous blocks of the packed buffer (packing
    kept). Without: Megatron's zigzag when ``seq_len`` divides by ``2 * cp_size``, else
    contiguous blocks. Plans are cached per (seq_len, cp_size, cu_seqlens).
    """
    cu = _host_cu_seqlens(cu_seqlens)
    if cu is not None and cu[-1] != seq_len:
        raise ValueError(f"cu_seqlens ends at {cu[-1]} but the batch has {seq_len} tokens")
    return _cached_default_plan(int(seq_len), int(cp_size), cu)


def _host_cu_seqlens(cu_seqlens) -> Optional[Tuple[int, ...]]:
    return None if cu_seqlens is None else as_cu_seqlens(cu_seqlens)


def _as_sequence(t: torch.Tensor, what: str, seq_len: Optional[int] = None) -> torch.Tensor:
    """``[S]`` from ``[S]`` or ``[1, S]``; ValueError naming the shape otherwise."""
    if not isinstance(t, torch.Tensor):
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
    """The GPTModel inside DDP / Float16Module style wrappers (``.module`` chains)."""
    inner = model
    while not hasattr(inner, "decoder") and hasattr(inner, "module"):
        inner = inner.module
    for name in ("embedding", "decoder", "output_layer", "config"):
        if not hasattr(inner, name):
            raise TypeError(
                f"context_parallel_forward needs a megatron-core GPTModel (embedding, decoder, "
                f"output_layer); {type(model).__name__} has no {name!r}"
            )
    if not (getattr(inner, "pre_process", True) and getattr(inner, "post_process", True)):
        raise ValueError(
            "context_parallel_forward runs whole models; pipeline stages (pre_process or "
            "post_process False) are not supported"
        )
    return inner


def _attention_backend(model) -> str:
    kinds = set()
    for layer in model.decoder.layers:
        core = getattr(getattr(layer, "self_attention", None), "core_attention", None)
        if isinstance(core, ContextParallelAttention):
            kinds.add(_REFERENCE)
        elif type(core).__name__ == "TEDotProductAttention":
            kinds.add(_TE)
        elif type(core).__name__ == "DotProductAttention":
            kinds.add(_LOCAL)
        else:
            raise TypeError(
                f"unsupported core attention {type(core).__name__}; build the model with "
                "get_gpt_layer_with_context_parallel_spec() (or TE's spec for zigzag / THD plans)"
            )
    if len(kinds) != 1:
        raise TypeError(f"the layers mix core attention backends {sorted(kinds)}")
    return kinds.pop()


def _rotary_rows(rope, positions: torch.Tensor) -> torch.Tensor:
    """megatron's ``RotaryEmbedding.get_emb`` evaluated at ``positions``: ``[n, 1, 1, dim]``.

    Computed directly for the given positions (any order, any plan), on the positions' device.
    """
    inv_freq = rope.inv_freq.to(positions.device)
    seq = positions.to(inv_freq.dtype)
    if rope.seq_len_interpolation_factor is not None:
        seq = seq * (1 / rope.seq_len_interpolation_factor)
    freqs = torch.outer(seq, inv_freq)
    if rope.rotary_interleaved:
        emb = torch.stack((freqs.view(-1, 1), freqs.view(-1, 1)), dim=-1).view(freqs.shape[0], -1)
    else:
        emb = torch.cat((freqs, freqs), dim=-1)
    return emb[:, None, None, :]


def _check_te_layout(plan: ContextParallelPlan, cu: Optional[Tuple[int, ...]]) -> None:
    """TE's CP attention computes on fixed layouts; any other plan would be silently wrong."""
    if plan.cp_size == 1:
        return
    if cu is None:
        expected = (
            ContextParallelPlan.zigzag(plan.seq_len, plan.cp_size)
            if plan.seq_len % (2 * plan.cp_size) == 0
            else None
        )
        name = "ContextParallelPlan.zigzag"
    else:
        try:
            expected = ContextParallelPlan.thd(cu, plan.cp_size)
        except ValueError:
            expected = None
        name = "ContextParallelPlan.thd"
    if (
        expected is None
        or expected.counts != plan.counts
        or not all(
            torch.equal(expected.local_positions(r), plan.local_positions(r))
            for r in range(plan.cp_size)
        )
    ):
        raise ValueError(
            f"TEDotProductAttention under CP needs the {name} layout; got {plan}. Use "
            "get_gpt_layer_with_context_parallel_spec() for other plans"
        )


def context_parallel_forward(
    model,
    input_ids: torch.Tensor,
    labels: Optional[torch.Tensor] = None,
    *,
    position_ids: Optional[torch.Tensor] = None,
    cu_seqlens: Optional[Union[Sequence[int], torch.Tensor]] = None,
    plan: Optional[ContextParallelPlan] = None,
    fields: Union[str, Sequence[str]] = ("hidden_states",),
    top_k: int = 0,
    cp_group: Optional[dist.ProcessGroup] = None,
    tp_group: Optional[dist.ProcessGroup] = None,
    gather_logits: bool = True,
    context_parallel_output_grad: bool = False,
) -> ForwardOutput:
    """Forward: shard the caller's batch by the plan, run the model, gather the requested
    fields to source order on every CP rank; backward: each rank gets its rows' gradients.

    Every rank of the CP group calls this with the same full batch.

    Args:
        model: a megatron-core ``GPTModel`` (or a ``.module`` wrapper of one) holding the whole
            layer stack (no pipeline stages).
        input_ids: int ``[S]`` or ``[1, S]``: the packed batch in the caller's order.
        labels: int ``[S]`` (or ``[1, S]``) targets in source order, already shifted; -100 marks
            positions without one. Needed for ``target_logprobs``.
        position_ids: int ``[S]`` source position ids for the position embedding; default
            ``0 .. len-1`` within each packed sequence. TE THD runs use megatron's own
            per-sequence rotary positions and ignore them.
        cu_seqlens: cumulative lengths ``(0, l0, l0+l1, ..., S)`` of packed sequences (a list or
            CPU tensor; a device tensor is read back once); attention stays within a sequence.
        plan: the ``ContextParallelPlan`` (same on every rank); default ``default_plan(S, cp,
            cu_seqlens)`` (THD, zigzag or contiguous).
        fields, top_k, gather_logits, context_parallel_output_grad: see
            ``megatron.context_parallel.head.compute_forward_output``.
        cp_group: the CP group; default the model's (``model.pg_collection.cp``), else
            megatron's ``parallel_state`` one.
        tp_group: the TP group; default the model's, else megatron's.

    Returns:
        ``ForwardOutput`` over all ``S`` positions in the caller's order (``plan`` attached).

    Raises:
        ValueError / TypeError: malformed inputs, a plan whose ``seq_len`` or ``cp_size`` does
            not match, ``cu_seqlens`` that disagree with the plan's, a plan TE cannot run, or an
            unsupported model feature (MLA, yarn / mrope, MuP, pipeline stages). Raised on every
            rank alike, before any collective.
    """
    gpt = _unwrap(model)
    config = gpt.config
    input_ids = _as_sequence(input_ids, "input_ids")
    seq_len = input_ids.shape[0]
    device = input_ids.device
    if labels is not None:
        labels = _as_sequence(labels, "labels", seq_len)
    if getattr(config, "use_mup", False):
        raise ValueError("context_parallel_forward does not support MuP logit scaling")
    if config.multi_latent_attention:
        raise ValueError("context_parallel_forward does not support multi-latent attention")
    pos_type = gpt.position_embedding_type
    if pos_type not in ("rope", "learned_absolute", "none"):
        raise ValueError(f"position_embedding_type {pos_type!r} is not supported under CP")

    pgs = getattr(gpt, "pg_collection", None)
    if cp_group is None:
        cp_group = getattr(pgs, "cp", None) if pgs is not None else None
        if cp_group is None:
            cp_group = resolve_context_parallel_group(None)
    if tp_group is None and pgs is not None:
        tp_group = getattr(pgs, "tp", None)
    cp_rank, cp_size = group_rank_and_size(cp_group)
    tp_size = group_rank_and_size(tp_group)[1] if tp_group is not None else 1

    cu = _host_cu_seqlens(cu_seqlens)
    if cu is not None and cu[-1] != seq_len:
        raise ValueError(f"cu_seqlens ends at {cu[-1]} but input_ids has {seq_len} tokens")
    if plan is None:
        plan = _cached_default_plan(seq_len, cp_size, cu)
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
    if cu is None:
        cu = plan.cu_seqlens
    if plan.max_count == 0:
        raise ValueError(f"the plan owns no position of the {seq_len}-token batch")
    if config.sequence_parallel and tp_size > 1 and any(c == 0 or c % tp_size for c in plan.counts):
        raise ValueError(
            f"sequence parallelism needs every CP shard non-empty and divisible by TP "
            f"{tp_size}; plan counts {plan.counts}"
        )
    backend = _attention_backend(gpt)
    if backend == _LOCAL and cp_size > 1:
        raise ValueError(
            "megatron-core's DotProductAttention cannot run CP > 1; build the model with "
            "get_gpt_layer_with_context_parallel_spec()"
        )
    if backend == _TE:
        _check_te_layout(plan, cu)

    if position_ids is None:
        lengths = [seq_len] if cu is None else [b - a for a, b in zip(cu[:-1], cu[1:])]
        position_ids = torch.cat(
            [torch.arange(n, dtype=torch.int64) for n in lengths]
            or [torch.zeros(0, dtype=torch.int64)]
        ).to(device)
    else:
        position_ids = _as_sequence(position_ids, "position_ids", seq_len).to(device)

    local_ids = scatter_to_context_parallel_region(input_ids, plan, cp_group)
    local_positions = scatter_to_context_parallel_region(position_ids, plan, cp_group)
    padding = 1 if plan.counts[cp_rank] == 0 else 0
    if padding:
        # megatron-core's layers cannot run zero rows: an empty rank runs one padding row,
        # masked out of every attention (see ContextParallelParams.padding_rows) and dropped.
        local_ids = torch.zeros(1, dtype=local_ids.dtype, device=device)
        local_positions = torch.zeros(1, dtype=local_positions.dtype, device=device)
    decoder_input = gpt.embedding(input_ids=local_ids[None], position_ids=local_positions[None])

    rotary = None
    attention_mask = None
    packed = None
    if backend == _REFERENCE:
        packed = ContextParallelParams.for_plan(
            plan, cp_group if cp_size > 1 else None, device=device, cu_seqlens=cu
        )
        if pos_type == "rope":
            rotary = _rotary_rows(gpt.rotary_pos_emb, local_positions)
    elif backend == _LOCAL:
        # The rows are in plan order, which need not be source order, so the default causal
        # mask would be wrong; megatron's convention is True = masked.
        params = ContextParallelParams.for_plan(plan, None, device=device, cu_seqlens=cu)
        attention_mask = ~params.allowed(True)[None, None]
        if pos_type == "rope":
            rotary = _rotary_rows(gpt.rotary_pos_emb, local_positions)
    else:
        rotary, packed = _te_inputs(gpt, plan, cu, cp_group, device, local_positions, pos_type)

    hidden = gpt.decoder(
        hidden_states=decoder_input,
        attention_mask=attention_mask,
        rotary_pos_emb=rotary,
        packed_seq_params=packed,
    )
    if padding:
        hidden = hidden[:0]
    if gpt.share_embeddings_and_output_weights:
        weight = gpt.shared_embedding_or_output_weight()
    else:
        weight = gpt.output_layer.weight
    return compute_forward_output(
        hidden,
        weight,
        plan,
        labels=labels,
        fields=fields,
        top_k=top_k,
        cp_group=cp_group,
        tp_group=tp_group,
        sequence_parallel=bool(config.sequence_parallel and tp_size > 1),
        gather_logits=gather_logits,
        context_parallel_output_grad=context_parallel_output_grad,
    )


def _te_inputs(gpt, plan, cu, cp_group, device, local_positions, pos_type):
    """Rotary table and ``PackedSeqParams`` for TEDotProductAttention (zigzag or THD plans).

    Zigzag (one sequence, ``sbhd``): TE's ring attention assumes Megatron's zigzag rows, whose
    rotary rows are exactly the rows at their source positions. THD: megatron-core passes the
    per-sequence rotary table and ``cu_seqlens`` to TE, which picks each rank's rows itself.
    """
    from megatron.core.packed_seq_params import PackedSeqParams

    if cu is None:
        rotary = _rotary_rows(gpt.rotary_pos_emb, local_positions) if pos_type == "rope" else None
        return rotary, None
    lengths = [b - a for a, b in zip(cu[:-1], cu[1:])]
    longest = max(lengths) if lengths else 0
    cu_t = torch.tensor(cu, dtype=torch.int32, device=device)
    packed = PackedSeqParams(
        qkv_format="thd",
        cu_seqlens_q=cu_t,
        cu_seqlens_kv=cu_t,
        cu_seqlens_q_padded=cu_t,
        cu_seqlens_kv_padded=cu_t,
        max_seqlen_q=longest,
        max_seqlen_kv=longest,
        cp_group=cp_group,
    )
    rotary = None
    if pos_type == "rope":
        rotary = _rotary_rows(gpt.rotary_pos_emb, torch.arange(longest, device=device))
    return rotary, packed
