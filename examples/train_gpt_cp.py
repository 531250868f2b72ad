"""Train a small GPTModel under DP x CP on synthetic data; the loss curve must equal CP 1's.

On a CPU (the script starts DP x CP gloo ranks itself; 2 x 2 by default)::

    python examples/train_gpt_cp.py --steps 20 --plot loss.png

On a GPU node (NCCL, one GPU per rank; DP = world size / CP)::

    torchrun --nproc-per-node 8 examples/train_gpt_cp.py --cp 4 --steps 50

The run is done twice from the same initial weights and the same global batches (one packed
batch per DP replica per step; a learnable rule, so the loss falls): first at CP 1 on every
rank as one device would (the replicas' losses averaged), then under DP x CP with
``context_parallel_forward``. The trainer's side of the CP run is the whole recipe:

* the loss is computed on the full-sequence ``target_logprobs``, identically on every CP rank;
* parameter gradients are summed over the CP group (each rank holds its own rows' share) and
  averaged over the DP replicas: one all-reduce over the DP x CP group, divided by DP;
* the logged loss is averaged over the pure DP group only (``reduce_over_data_parallel``).
  Summing it over CP too would count every replica CP times.

With megatron-core's DDP, which averages gradients over DP x CP, scale the loss by the CP size
instead (as megatron's own ``pretrain_gpt`` does), since each CP rank's gradient is a share of
the replica's gradient, not a copy of it.

Per-step losses of both runs are printed side by side and must agree within ``--atol``;
``--plot out.png`` draws both curves (needs matplotlib).
"""

from __future__ import annotations

import argparse
import sys

import _common as common
import torch
import torch.distributed as dist

from megatron.context_parallel import reduce_over_data_parallel


def synthetic_batch(seq_lens, vocab: int, seed: int, step: int, replica: int, device):
    """One replica's packed batch for one step: next token = (5 * token + 3) mod vocab.

    Each sequence starts at a random token; labels are the next tokens, -100 on each last one.
    """
    g = torch.Generator().manual_seed(seed * 1_000_003 + step * 1009 + replica)
    ids, labels = [], []
    for n in seq_lens:
        seq = torch.empty(n, dtype=torch.int64)
        seq[0] = torch.randint(0, vocab, (1,), generator=g)
        for i in range(1, n):
            seq[i] = (5 * seq[i - 1] + 3) % vocab
        # A little noise keeps the task from being trivially memorised in one step.
        flip = torch.rand(n, generator=g) < 0.1
        seq[flip] = torch.randint(0, vocab, (int(flip.sum()),), generator=g)
        target = torch.full((n,), -100, dtype=torch.int64)
        target[:-1] = seq[1:]
        ids.append(seq)
        labels.append(target)
    cu = [0]
    for n in seq_lens:
        cu.append(cu[-1] + n)
    return torch.cat(ids).to(device), torch.cat(labels).to(device), cu


def token_loss(model, ids, labels, cu) -> torch.Tensor:
    """Mean negative log-likelihood over the positions with a target (full sequence, any CP)."""
    from megatron.context_parallel.models.forward import context_parallel_forward

    out = context_parallel_forward(model, ids, labels, cu_seqlens=cu, fields="target_logprobs")
    valid = labels != -100
    return -(out.target_logprobs * valid).sum() / valid.sum()


def make_optimizer(args, model):
    if args.optimizer == "adam":
        return torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    return torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)


def run_reference(args, device, seq_lens, dp: int):
    """CP 1, as one device: every step averages the DP replicas' losses. Returns the losses."""
    common.init_parallel(cp=1)
    model = common.build_gpt(args, device, max_seq_len=max(seq_lens))
    optimizer = make_optimizer(args, model)
    losses = []
    steps = common.progress(args.steps, "CP 1      ")
    for step in steps:
        optimizer.zero_grad(set_to_none=True)
        total = 0.0
        for replica in range(dp):
            ids, labels, cu = synthetic_batch(
                seq_lens, args.vocab, args.seed, step, replica, device
            )
            loss = token_loss(model, ids, labels, cu) / dp
            loss.backward()
            total += loss.item()
        optimizer.step()
        losses.append(total)
        steps.set_postfix_str(f"loss {total:.4f}")
    return losses, [p.detach().clone() for p in model.parameters()]


def reduce_gradients(model, group, dp: int) -> None:
    """Sum over DP x CP, divide by DP: completes each replica's gradient, then averages them.

    One flat buffer, so one collective per step.
    """
    params = [p for p in model.parameters() if p.requires_grad]
    grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat, group=group)
    flat /= dp
    offset = 0
    for p in params:
        n = p.numel()
        p.grad = flat[offset : offset + n].view_as(p).clone()
        offset += n


def run_context_parallel(args, device, seq_lens, reference):
    """DP x CP with ``context_parallel_forward``. Returns the losses and the final weights."""
    from megatron.core import parallel_state as ps

    common.init_parallel(cp=args.cp)
    dp = ps.get_data_parallel_world_size()
    replica = ps.get_data_parallel_rank()  # pure DP rank: the CP ranks of a replica share it
    grad_group = ps.get_data_parallel_group(with_context_parallel=True)
    model = common.build_gpt(args, device, max_seq_len=max(seq_lens))
    optimizer = make_optimizer(args, model)
    losses = []
    steps = common.progress(args.steps, f"DP{dp} x CP{args.cp}")
    for step in steps:
        optimizer.zero_grad(set_to_none=True)
        ids, labels, cu = synthetic_batch(seq_lens, args.vocab, args.seed, step, replica, device)
        loss = token_loss(model, ids, labels, cu)
        loss.backward()
        reduce_gradients(model, grad_group, dp)
        optimizer.step()
        logged = (reduce_over_data_parallel(loss.detach()) / dp).item()
        losses.append(logged)
        steps.set_postfix_str(f"loss {logged:.4f} (CP 1 {reference[step]:.4f})")
    return losses, [p.detach().clone() for p in model.parameters()]


def plot(path: str, reference, losses, label: str) -> None:
    common.plot_loss_curves(
        path,
        reference,
        losses,
        reference_label="CP 1 (one device)",
        label=label,
        ylabel="loss (mean token NLL)",
        title="Synthetic-data GPT training: CP leaves the loss unchanged",
        xlabel="step",
    )


def train(args, device: torch.device) -> None:
    from megatron.core import parallel_state as ps

    world = dist.get_world_size()
    if world % args.cp:
        raise SystemExit(f"--cp {args.cp} does not divide the world size {world}")
    dp = world // args.cp
    seq_lens = common.resolve_size(args, device)
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
    common.say(
        f"train_gpt_cp: {world} ranks on {device.type} ({dist.get_backend()}) = DP {dp} x CP "
        f"{args.cp}; GPTModel {args.layers} layers, hidden {args.hidden}, vocab {args.vocab}; "
        f"{args.steps} steps of {dp} x {sum(seq_lens)} tokens; {args.optimizer} lr {args.lr}"
    )
    reference, ref_weights = run_reference(args, device, seq_lens, dp)
    losses, weights = run_context_parallel(args, device, seq_lens, reference)
    ps.destroy_model_parallel()

    weight_diff = common.nanmax([(a - b).abs().max().item() for a, b in zip(ref_weights, weights)])
    diffs = [abs(a - b) for a, b in zip(reference, losses)]
    worst = common.all_max([common.nanmax(diffs), weight_diff], device)
    label = f"DP {dp} x CP {args.cp}"
    common.say("")
    common.say(f"{'step':>4}  {'loss CP 1':>10}  {'loss ' + label:>16}  {'|diff|':>8}")
    for step, (a, b, d) in enumerate(zip(reference, losses, diffs), start=1):
        common.say(f"{step:>4}  {a:>10.6f}  {b:>16.6f}  {d:>8.1e}")
    common.say(f"final weights: max |difference| {worst[1]:.1e}")
    if args.plot and common.is_rank0():
        plot(args.plot, reference, losses, label)
        common.say(f"plot: {args.plot}")
    passed = worst[0] <= args.atol
    common.say(
        f"train_gpt_cp: {'PASSED' if passed else 'FAILED'}: losses match CP 1 within "
        f"{args.atol:.0e} (largest difference {worst[0]:.1e}); loss {reference[0]:.4f} -> "
        f"{losses[-1]:.4f}"
    )
    if not passed:
        raise SystemExit(1)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--cp", type=int, default=2, help="context-parallel size")
    parser.add_argument(
        "--dp", type=int, default=2, help="data-parallel size when the script starts its own ranks"
    )
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--optimizer", choices=("adam", "sgd"), default="adam")
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument(
        "--atol",
        type=float,
        default=1e-4,
        help="largest allowed |loss difference| against CP 1 (fp32)",
    )
    parser.add_argument(
        "--plot",
        type=common.optional_path,
        metavar="PNG",
        help="save both loss curves to this PNG (needs matplotlib)",
    )
    common.add_model_args(parser)
    common.add_launch_args(parser, default_world=4)
    args = parser.parse_args(argv)
    if args.plot:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            parser.error("--plot needs matplotlib (pip install matplotlib)")
    args.world_size = args.dp * args.cp
    return common.launch(train, args)


if __name__ == "__main__":
    sys.exit(main())
