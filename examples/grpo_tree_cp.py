"""GRPO-style training on tree-packed prompts under CP: each prompt encoded once for G completions.

On a CPU (the script starts its own gloo ranks; CP 2 by default)::

    python examples/grpo_tree_cp.py --steps 5

On a GPU node (NCCL, one GPU per rank)::

    torchrun --nproc-per-node 4 examples/grpo_tree_cp.py --cp 4

An RL trainer samples G completions per prompt. Packed flat, every completion repeats its
prompt; packed as a ``PrefixTree`` (the prompt a root segment, each completion a child), the
prompt is encoded once and every completion's rows attend to it. This script trains a tiny
GPTModel both ways from the same weights on the same synthetic groups:

* flat: every (prompt + completion) sample packed as its own sequence, at CP 1 (one device);
* tree: the groups packed as one tree per prompt, at CP ``--cp``, under the default
  ``tree_plan`` (attention work and tokens balanced over the ranks).

Each step's loss is a per-sample policy-gradient surrogate: ``-(advantage * mean log-prob of the
completion's tokens)``, averaged over samples; the per-sample log-probs come from
``ForwardOutput.samples()`` (each root-to-leaf path as the flat sample would have it). The
script prints the per-sample log-probs of the first step from both packings and the loss curves,
and passes when they agree within ``--atol`` and the tree used fewer tokens.

What a trainer needs for the tree path: ``PrefixTree(parents=..., lengths=...)``;
``labels = tree.labels(input_ids)`` (``[S, K]``: at a prompt's last row, column c holds the
first token of completion c); ``context_parallel_forward(model, ids, labels, tree=tree)``; then
``out.samples()``. Attention dropout must be 0 on the fused GPU path; this script's model has
no dropout at all, so both packings compute the same numbers.
"""

from __future__ import annotations

import argparse
import sys

import _common as common
import torch
import torch.distributed as dist


def synthetic_groups(args, step: int):
    """``(prompts, completions, advantages)`` of one step: ``--prompts`` prompts, each with
    ``--group`` completions of random lengths, and one advantage per completion."""
    g = torch.Generator().manual_seed(args.seed * 7919 + step)
    prompts, completions, advantages = [], [], []
    for _ in range(args.prompts):
        n = int(torch.randint(args.prompt_len // 2, args.prompt_len + 1, (1,), generator=g))
        prompts.append(torch.randint(0, args.vocab, (n,), generator=g))
        group = []
        for _ in range(args.group):
            m = int(torch.randint(1, args.completion_len + 1, (1,), generator=g))
            group.append(torch.randint(0, args.vocab, (m,), generator=g))
        completions.append(group)
        rewards = torch.randn(args.group, generator=g)
        advantages.append((rewards - rewards.mean()) / (rewards.std() + 1e-6))
    return prompts, completions, advantages


def tree_batch(prompts, completions):
    """The tree packing: each prompt, then its completions. Returns (tree, input ids)."""
    from megatron.context_parallel import PrefixTree

    parents, lengths, pieces = [], [], []
    for prompt, group in zip(prompts, completions):
        root = len(parents)
        parents.append(-1)
        lengths.append(prompt.numel())
        pieces.append(prompt)
        for completion in group:
            parents.append(root)
            lengths.append(completion.numel())
            pieces.append(completion)
    return PrefixTree(parents=parents, lengths=lengths), torch.cat(pieces)


def flat_batch(prompts, completions):
    """Every sample as its own sequence: (ids, labels, cu_seqlens)."""
    ids, labels, cu = [], [], [0]
    for prompt, group in zip(prompts, completions):
        for completion in group:
            sample = torch.cat([prompt, completion])
            target = torch.full_like(sample, -100)
            target[:-1] = sample[1:]
            ids.append(sample)
            labels.append(target)
            cu.append(cu[-1] + sample.numel())
    return torch.cat(ids), torch.cat(labels), cu


def sample_logprobs_flat(out, prompts, completions, cu):
    """Per sample: the log-probs of its completion tokens (each predicted from the row before)."""
    result = []
    index = 0
    for prompt, group in zip(prompts, completions):
        for completion in group:
            start = cu[index] + prompt.numel() - 1
            result.append(out.target_logprobs[start : start + completion.numel()])
            index += 1
    return result


def sample_logprobs_tree(out, prompts, completions):
    """The same from the tree output: ``samples()`` gives each path as the flat sample."""
    result = []
    samples = iter(out.samples())
    for prompt, group in zip(prompts, completions):
        for completion in group:
            path = next(samples).target_logprobs
            start = prompt.numel() - 1
            result.append(path[start : start + completion.numel()])
    return result


def surrogate_loss(logprobs, advantages) -> torch.Tensor:
    flat_adv = torch.cat(advantages)
    per_sample = torch.stack([lp.mean() for lp in logprobs])
    return -(flat_adv.to(per_sample.device) * per_sample).mean()


def run(args, device: torch.device, tree: bool):
    """Trains ``--steps`` steps; returns (losses, first step's per-sample log-probs, tokens)."""
    from megatron.context_parallel import context_parallel_forward

    common.init_parallel(cp=args.cp if tree else 1)
    model = common.build_gpt(args, device, max_seq_len=args.prompt_len + args.completion_len)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    cp_group = None
    if tree:
        from megatron.core import parallel_state as ps

        cp_group = ps.get_context_parallel_group()
    losses, first, tokens = [], None, 0
    for step in range(args.steps):
        prompts, completions, advantages = synthetic_groups(args, step)
        optimizer.zero_grad(set_to_none=True)
        if tree:
            packing, ids = tree_batch(prompts, completions)
            ids = ids.to(device)
            out = context_parallel_forward(
                model, ids, packing.labels(ids), tree=packing, fields="target_logprobs"
            )
            logprobs = sample_logprobs_tree(out, prompts, completions)
        else:
            ids, labels, cu = flat_batch(prompts, completions)
            out = context_parallel_forward(
                model, ids.to(device), labels.to(device), cu_seqlens=cu, fields="target_logprobs"
            )
            logprobs = sample_logprobs_flat(out, prompts, completions, cu)
        tokens = max(tokens, ids.numel())
        loss = surrogate_loss(logprobs, advantages)
        loss.backward()
        if cp_group is not None:
            # Every CP rank holds its rows' share of each gradient: sum them (megatron's DDP
            # does this over DP x CP).
            for p in model.parameters():
                if p.grad is not None:
                    dist.all_reduce(p.grad, group=cp_group)
        optimizer.step()
        losses.append(loss.item())
        if first is None:
            first = [lp.detach().cpu() for lp in logprobs]
    return losses, first, tokens


def train(args, device: torch.device) -> None:
    from megatron.core import parallel_state as ps

    world = dist.get_world_size()
    if world != args.cp:
        raise SystemExit(f"run {args.cp} ranks for --cp {args.cp} (got {world})")
    args.layers, args.hidden, args.heads = 2, 64, 4
    common.say(
        f"grpo_tree_cp: {args.prompts} prompts x {args.group} completions; flat at CP 1, "
        f"tree at CP {args.cp} ({device.type}, {dist.get_backend()})"
    )
    flat_losses, flat_first, flat_tokens = run(args, device, tree=False)
    tree_losses, tree_first, tree_tokens = run(args, device, tree=True)
    ps.destroy_model_parallel()

    common.say("")
    common.say("first step, per-sample mean completion log-prob: flat / tree")
    worst_lp = 0.0
    for i, (a, b) in enumerate(zip(flat_first, tree_first)):
        worst_lp = max(worst_lp, (a - b).abs().max().item())
        common.say(f"  sample {i:>2}: {a.mean().item():>9.5f}  {b.mean().item():>9.5f}")
    common.say(f"{'step':>4}  {'flat loss':>10}  {'tree loss':>10}")
    for step, (a, b) in enumerate(zip(flat_losses, tree_losses), start=1):
        common.say(f"{step:>4}  {a:>10.6f}  {b:>10.6f}")
    worst = max(worst_lp, max(abs(a - b) for a, b in zip(flat_losses, tree_losses)))
    worst = common.all_max([worst], device)[0]
    passed = worst <= args.atol and tree_tokens < flat_tokens
    common.say(
        f"grpo_tree_cp: {'PASSED' if passed else 'FAILED'}: per-sample log-probs and losses "
        f"match flat packing within {args.atol:.0e} (largest difference {worst:.1e}); tokens "
        f"per step: tree {tree_tokens}, flat {flat_tokens}"
    )
    if not passed:
        raise SystemExit(1)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--cp", type=int, default=2, help="context-parallel size of the tree run")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--prompts", type=int, default=2)
    parser.add_argument("--group", type=int, default=4, help="completions per prompt (G)")
    parser.add_argument("--prompt-len", type=int, default=24)
    parser.add_argument("--completion-len", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=128)
    parser.add_argument("--lr", type=float, default=1e-2)
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--atol", type=float, default=1e-4)
    common.add_launch_args(parser, default_world=2)
    args = parser.parse_args(argv)
    args.world_size = args.cp
    return common.launch(train, args)


if __name__ == "__main__":
    sys.exit(main())
