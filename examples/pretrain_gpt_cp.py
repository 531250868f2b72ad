"""Pretrain a small GPT with megatron-core's own machinery under CP; the losses must equal CP 1's.

megatron's ``pretrain_gpt.py``, cut to what context parallelism touches: a ``model_provider``,
a ``forward_step`` that builds this rank's batch with ``context_parallel_batch`` and runs
``GPTModel.forward``, a ``loss_func`` on the full-sequence ``target_logprobs``,
``get_forward_backward_func()``, megatron's ``DistributedDataParallel``, its optimizer and
``finalize_model_grads``, and pipeline stages. Flags are megatron's.

On a CPU (the script starts its own gloo ranks; DP = world size / (CP x PP))::

    python examples/pretrain_gpt_cp.py --context-parallel-size 2 \
        --pipeline-model-parallel-size 2 --train-iters 20 --plot loss.png

On GPU nodes (NCCL, one GPU per rank)::

    torchrun --nproc-per-node 8 examples/pretrain_gpt_cp.py --context-parallel-size 2 \
        --pipeline-model-parallel-size 2 --train-iters 50 --plot loss.png

Each micro-batch is one packed sequence of documents (``--seq-length`` tokens, documents cut
at random multiples of 2 x CP tokens, positions restarting in each document, a learnable
token rule so the loss falls). The same global batches train twice from the same weights:
first at CP 1 and PP 1 with every rank a data-parallel replica, then in the requested layout.
The per-iteration losses (token-weighted means over the global batch) are printed side by side
and must agree within ``--atol``; ``--plot`` draws both curves.

What CP changes in a megatron training script (the README's "Megatron recipe"):

* ``forward_step``: give ``context_parallel_batch`` the whole packed batch and the whole
  labels (never sliced per CP rank); it picks this rank's rows, their position ids and rotary
  rows, ``packed_seq_params`` and the ``output_processor``; ``model(**batch.forward_kwargs())``
  returns a ``ForwardOutput`` for the whole batch, in order, on every CP rank.
* ``loss_func``: written as for one GPU, on the full output (the same on every CP rank), and
  returned as ``batch.loss_func(loss_func)``, which applies the CP scaling (a 3-tuple's
  ``loss_sum`` times CP: megatron divides by a token count summed over DP x CP).
* ``config.finalize_model_grads_func = finalize_model_grads`` and ``config.no_sync_func``: the
  gradient sum over DP x CP (each CP rank holds only its rows' share of a gradient).
* reported ``[sum, count]`` pairs may be summed over DP x CP, as megatron's training loop does:
  both are counted CP times, and the ratio is exact.
* pipelines: ``seq_length`` is the packed length (stages pass ``seq_length / CP`` rows) for
  equal shards; uneven plans (``--cp-plan uneven``) set ``variable_seq_lengths``.
"""

from __future__ import annotations

import argparse
import functools
import sys
from typing import List, Optional

import _common as common
import torch
import torch.distributed as dist

# ------------------------------------------------------------------------------------- data


def packed_batch(args, index: int, cp: int):
    """Global micro-batch ``index``: (tokens [S], labels [S], cu_seqlens), the same everywhere.

    Documents are random multiples of ``2 * cp`` tokens long, so the default plan is TE's THD
    layout; each follows ``next = (5 * token + 3) mod vocab`` with 10% noise. Labels are the
    next tokens, -100 on each document's last one.
    """
    g = torch.Generator().manual_seed(args.seed * 1_000_003 + index)
    unit = 2 * cp
    cu = [0]
    while cu[-1] < args.seq_length:
        units_left = (args.seq_length - cu[-1]) // unit
        cu.append(cu[-1] + unit * int(torch.randint(1, min(units_left, 16) + 1, (1,), generator=g)))
    tokens, labels = [], []
    for a, b in zip(cu[:-1], cu[1:]):
        seq = torch.empty(b - a, dtype=torch.int64)
        seq[0] = torch.randint(0, args.vocab_size, (1,), generator=g)
        for i in range(1, b - a):
            seq[i] = (5 * seq[i - 1] + 3) % args.vocab_size
        noise = torch.rand(b - a, generator=g) < 0.1
        seq[noise] = torch.randint(0, args.vocab_size, (int(noise.sum()),), generator=g)
        target = torch.full((b - a,), -100, dtype=torch.int64)
        target[:-1] = seq[1:]
        tokens.append(seq)
        labels.append(target)
    return torch.cat(tokens), torch.cat(labels), cu


def uneven_plan(seq_len: int, cp: int, cu, index: int):
    """A prefix-tree style plan: shuffled positions, every rank's share a different size."""
    from megatron.context_parallel import ContextParallelPlan

    g = torch.Generator().manual_seed(7919 + index)
    order = torch.randperm(seq_len, generator=g)
    weights = torch.arange(cp, 0, -1, dtype=torch.float64) + 0.5
    bounds = (weights.cumsum(0) / weights.sum() * seq_len).round().long().tolist()
    starts = [0] + bounds[:-1]
    shards = [order[a:b].sort().values for a, b in zip(starts, bounds)]
    return ContextParallelPlan.from_rank_positions(shards, seq_len, cu)


# ------------------------------------------------------------------------------------ model


def model_provider(args, pre_process: bool, post_process: bool, vp_stage: Optional[int]):
    """This rank's stage of the GPT (the whole model without pipeline parallelism)."""
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.transformer.transformer_config import TransformerConfig

    from megatron.context_parallel import get_gpt_layer_with_context_parallel_spec

    pp = ps.get_pipeline_model_parallel_world_size()
    vpp = ps.get_virtual_pipeline_model_parallel_world_size()
    config = TransformerConfig(
        num_layers=args.num_layers,
        hidden_size=args.hidden_size,
        num_attention_heads=args.num_attention_heads,
        context_parallel_size=ps.get_context_parallel_world_size(),
        pipeline_model_parallel_size=pp,
        virtual_pipeline_model_parallel_size=vpp,
        pipeline_dtype=torch.float32 if pp > 1 else None,
        # Stages exchange their row counts when CP shards differ in size. megatron-core 0.19.2
        # refuses that with its default MoE dispatcher even in a dense model, which has no MoE
        # dispatcher to run: name the one it accepts.
        variable_seq_lengths=args.cp_plan == "uneven",
        moe_token_dispatcher_type="alltoall" if args.cp_plan == "uneven" else "allgather",
        # Interleaved stages talk to the same neighbour in both directions; batched p2p would
        # match those messages by posting order on gloo (megatron-LM turns it off there too).
        batch_p2p_comm=vpp is None,
        calculate_per_token_loss=args.calculate_per_token_loss,
        **common.PLAIN_FP32_CONFIG,
    )
    return GPTModel(
        config,
        get_gpt_layer_with_context_parallel_spec(),
        vocab_size=args.vocab_size,
        max_sequence_length=args.max_position_embeddings,
        position_embedding_type="rope",
        share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights,
        pre_process=pre_process,
        post_process=post_process,
        vp_stage=vp_stage,
    )


def whole_model_name(stage, name: str) -> str:
    """The name, in the whole model, of a pipeline stage's parameter."""
    parts = name.split(".")
    if parts[:2] == ["decoder", "layers"]:
        parts[2] = str(stage.decoder.layers[int(parts[2])].layer_number - 1)
    if name == "output_layer.weight" and stage.share_embeddings_and_output_weights:
        return "embedding.word_embeddings.weight"  # the tied copy on the last stage
    return ".".join(parts)


def build_model(args, device, whole_state: Optional[dict]):
    """Model chunks of this rank; weights copied from ``whole_state`` (by whole-model name)
    when given, so every layout starts from the same weights."""
    from megatron.core import parallel_state as ps

    vpp = ps.get_virtual_pipeline_model_parallel_world_size()
    chunks = []
    for vp_stage in range(vpp) if vpp else [None]:
        torch.manual_seed(args.seed)
        stage = model_provider(
            args,
            pre_process=ps.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp_stage),
            post_process=ps.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp_stage),
            vp_stage=vp_stage,
        )
        if whole_state is not None:
            with torch.no_grad():
                for name, p in stage.named_parameters():
                    p.copy_(whole_state[whole_model_name(stage, name)])
        chunks.append(stage.to(device))
    return chunks


# ------------------------------------------------------------------------ forward and loss


def loss_func(labels: torch.Tensor, output):
    """megatron's 3-tuple loss on the full-sequence log-probs (identical on every CP rank),
    as on one GPU: ``(loss_sum, num_tokens, {"lm loss": [loss_sum, num_tokens]})``.
    ``batch.loss_func`` scales it for CP."""
    valid = labels != -100
    loss_sum = -(output.target_logprobs * valid).sum()
    num_tokens = valid.sum()
    report = torch.stack([loss_sum.detach(), num_tokens.float()])
    return loss_sum, num_tokens.int(), {"lm loss": report}


def forward_step(args, device, data_iterator, model):
    """megatron's ``forward_step_func``: this rank's rows of the batch through GPTModel."""
    from megatron.core import parallel_state as ps

    from megatron.context_parallel import context_parallel_batch

    index, tokens, labels, cu = next(data_iterator)
    tokens, labels = tokens.to(device), labels.to(device)
    plan = None
    if args.cp_plan == "uneven":
        cp = ps.get_context_parallel_world_size()
        plan = uneven_plan(tokens.numel(), cp, cu, index)
    batch = context_parallel_batch(
        model, tokens, labels, cu_seqlens=cu, plan=plan, fields="target_logprobs"
    )
    output = model(**batch.forward_kwargs())  # ForwardOutput on the last stage
    return output, batch.loss_func(functools.partial(loss_func, labels))


# -------------------------------------------------------------------------------- training


def train(args, device, cp: int, pp: int, vpp: Optional[int], whole_state, label: str):
    """``--train-iters`` iterations in one layout; returns (losses, initial whole weights)."""
    from megatron.core import parallel_state as ps
    from megatron.core.distributed import (
        DistributedDataParallel,
        DistributedDataParallelConfig,
        finalize_model_grads,
    )
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.pipeline_parallel import get_forward_backward_func

    common.init_parallel(cp=cp, pp=pp, vpp=vpp)
    dp = ps.get_data_parallel_world_size()
    replica = ps.get_data_parallel_rank()
    chunks = build_model(args, device, whole_state)
    if whole_state is None:
        whole_state = {n: p.detach().cpu().clone() for n, p in chunks[0].named_parameters()}
    config = chunks[0].config
    config.finalize_model_grads_func = finalize_model_grads
    ddp_config = DistributedDataParallelConfig(
        use_distributed_optimizer=args.use_distributed_optimizer
    )
    model = [DistributedDataParallel(config, ddp_config, c) for c in chunks]
    no_sync = [m.no_sync for m in model]
    config.no_sync_func = no_sync if len(no_sync) > 1 else no_sync[0]
    optimizer = get_megatron_optimizer(
        OptimizerConfig(
            optimizer=args.optimizer,
            lr=args.lr,
            weight_decay=args.weight_decay,
            clip_grad=args.clip_grad,
            use_distributed_optimizer=args.use_distributed_optimizer,
        ),
        model,
    )
    per_replica = args.global_batch_size // dp
    schedule = get_forward_backward_func()
    losses: List[float] = []
    iterations = common.progress(args.train_iters, f"{label:<16}")
    for iteration in iterations:
        for m in model:
            m.zero_grad_buffer()
        optimizer.zero_grad()
        first = iteration * args.global_batch_size + replica * per_replica
        micro = [
            (i, *packed_batch(args, i, args.context_parallel_size))
            for i in range(first, first + per_replica)
        ]
        iterators = [iter(micro) for _ in model]
        reports = schedule(
            forward_step_func=functools.partial(forward_step, args, device),
            data_iterator=iterators if len(model) > 1 else iterators[0],
            model=model,
            num_microbatches=per_replica,
            seq_length=args.seq_length,
            micro_batch_size=1,
            forward_only=False,
        )
        optimizer.step()
        # [loss sum, tokens] of the last stages, summed over the whole world (DP x CP x PP, the
        # other stages add zeros): CP counts both CP times, so the ratio is exact.
        pair = torch.zeros(2, dtype=torch.float64, device=device)
        for report in reports:
            pair += report["lm loss"].to(pair)
        dist.all_reduce(pair)
        losses.append((pair[0] / pair[1]).item())
        iterations.set_postfix_str(f"loss {losses[-1]:.4f}")
    ps.destroy_model_parallel()
    return losses, whole_state


def plot(path: str, reference, losses, label: str) -> None:
    common.plot_loss_curves(
        path,
        reference,
        losses,
        reference_label="CP 1, PP 1",
        label=label,
        ylabel="lm loss (token-weighted mean)",
        title="megatron-core pretraining under CP: the loss curve of CP 1",
        xlabel="iteration",
    )


def run(args, device: torch.device) -> None:
    world = dist.get_world_size()
    cp, pp = args.context_parallel_size, args.pipeline_model_parallel_size
    vpp = args.num_virtual_stages_per_pipeline_rank
    if world % (cp * pp):
        raise SystemExit(f"CP {cp} x PP {pp} does not divide the world size {world}")
    dp = world // (cp * pp)
    if args.global_batch_size % world:
        raise SystemExit(
            f"--global-batch-size {args.global_batch_size} must be a multiple of the world size "
            f"{world} (the CP 1 run uses every rank as a data-parallel replica)"
        )
    if vpp and (args.global_batch_size // dp) % pp:
        raise SystemExit("interleaved stages need micro-batches per replica divisible by PP")
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
    layout = f"DP {dp} x CP {cp} x PP {pp}" + (f" (VPP {vpp})" if vpp else "")
    common.say(
        f"pretrain_gpt_cp: {world} ranks on {device.type} ({dist.get_backend()}); GPT "
        f"{args.num_layers} layers, hidden {args.hidden_size}, vocab {args.vocab_size}, "
        f"{'untied' if args.untie_embeddings_and_output_weights else 'tied'} embeddings; "
        f"{args.train_iters} iterations of {args.global_batch_size} x {args.seq_length} packed "
        f"tokens; {args.optimizer} lr {args.lr}"
        + (", distributed optimizer" if args.use_distributed_optimizer else "")
        + (", per-token loss" if args.calculate_per_token_loss else "")
        + f"; CP plan: {args.cp_plan}"
    )
    reference, whole = train(args, device, 1, 1, None, None, f"CP 1, DP {world}")
    losses, _ = train(args, device, cp, pp, vpp, whole, layout)

    diffs = [abs(a - b) for a, b in zip(reference, losses)]
    worst = common.all_max([common.nanmax(diffs)], device)[0]
    common.say("")
    common.say(
        f"{'iter':>4}  {'loss CP 1':>10}  {'loss ' + layout:>{len(layout) + 5}}  {'|diff|':>8}"
    )
    for i, (a, b, d) in enumerate(zip(reference, losses, diffs), start=1):
        common.say(f"{i:>4}  {a:>10.6f}  {b:>{len(layout) + 5}.6f}  {d:>8.1e}")
    if args.plot and common.is_rank0():
        plot(args.plot, reference, losses, layout)
        common.say(f"plot: {args.plot}")
    passed = worst <= args.atol
    common.say(
        f"pretrain_gpt_cp: {'PASSED' if passed else 'FAILED'}: losses match CP 1 within "
        f"{args.atol:.0e} (largest difference {worst:.1e}); loss {reference[0]:.4f} -> "
        f"{losses[-1]:.4f}"
    )
    if not passed:
        raise SystemExit(1)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    group = parser.add_argument_group("parallelism (megatron's flags)")
    group.add_argument("--context-parallel-size", type=int, default=2)
    group.add_argument("--pipeline-model-parallel-size", type=int, default=2)
    group.add_argument(
        "--num-virtual-stages-per-pipeline-rank",
        type=int,
        help="interleaved pipeline schedule with this many model chunks per rank",
    )
    group.add_argument("--use-distributed-optimizer", action="store_true")
    group.add_argument(
        "--cp-plan",
        choices=("default", "uneven"),
        default="default",
        help="default: TE's THD layout of the packed documents; uneven: a shuffled plan whose "
        "shards all differ in size, new every micro-batch (like a prefix-tree rank plan)",
    )
    group = parser.add_argument_group("model and data (megatron's flags)")
    group.add_argument("--num-layers", type=int, default=4)
    group.add_argument("--hidden-size", type=int, default=64)
    group.add_argument("--num-attention-heads", type=int, default=4)
    group.add_argument("--vocab-size", type=int, default=128, help="synthetic token ids")
    group.add_argument("--seq-length", type=int, default=128, help="packed tokens per micro-batch")
    group.add_argument("--max-position-embeddings", type=int)
    group.add_argument("--untie-embeddings-and-output-weights", action="store_true")
    group.add_argument(
        "--global-batch-size", type=int, default=8, help="micro-batches per iteration"
    )
    group.add_argument("--seed", type=int, default=1234)
    group = parser.add_argument_group("training (megatron's flags)")
    group.add_argument("--train-iters", type=int, default=10)
    group.add_argument("--optimizer", choices=("adam", "sgd"), default="adam")
    group.add_argument("--lr", type=float, default=3e-3)
    group.add_argument("--weight-decay", type=float, default=0.0)
    group.add_argument("--clip-grad", type=float, default=1.0)
    group.add_argument("--calculate-per-token-loss", action="store_true")
    group = parser.add_argument_group("output")
    group.add_argument(
        "--atol", type=float, default=1e-4, help="largest allowed |loss difference| from CP 1"
    )
    group.add_argument(
        "--plot",
        type=common.optional_path,
        metavar="PNG",
        help="save both loss curves to this PNG (needs matplotlib)",
    )
    common.add_launch_args(parser, default_world=4)
    args = parser.parse_args(argv)
    if args.plot:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            parser.error("--plot needs matplotlib (pip install matplotlib)")
    if args.max_position_embeddings is None:
        args.max_position_embeddings = args.seq_length
    if args.seq_length % (2 * args.context_parallel_size):
        parser.error("--seq-length must be a multiple of 2 x --context-parallel-size")
    if args.use_distributed_optimizer and args.optimizer != "adam":
        parser.error("megatron's distributed optimizer supports adam only")
    return common.launch(run, args)


if __name__ == "__main__":
    sys.exit(main())
