"""CP probe: the same packed batch through a GPTModel at CP 1, 2 and 4; every output must match.

One command on a fresh CPU machine (the script starts 4 gloo ranks itself)::

    python examples/cp_probe.py

On a GPU node (NCCL, one GPU per rank; CP sizes that divide the world size)::

    torchrun --nproc-per-node 8 examples/cp_probe.py --cp-sizes 1,2,4,8

For each CP size the batch (three packed sequences, some positions without a target) runs
through ``context_parallel_forward`` with the plan it picks by default and, above CP 1, with an
uneven, shuffled plan like the prefix-tree rank plan of the original report. Every requested
field (hidden states, target log-probs, top-k, logits) comes back full-length in source order
on every rank and is compared with CP 1: the table gives the largest absolute difference over
all ranks, and the forward throughput. Then the report's own probe, ``hidden_states[1:][mask]``
with a full-sequence mask (which raised ``IndexError`` under CP before), runs on each output.

Exit status 0 and ``cp_probe: PASSED`` when every difference is within ``--atol``.
"""

from __future__ import annotations

import argparse
import sys
import time

import _common as common
import torch
import torch.distributed as dist

from megatron.context_parallel.comm.plan import ContextParallelPlan

FIELDS = ("hidden_states", "target_logprobs", "top_k", "logits")
PROMPT = 8  # leading positions of each sequence without a target (label -100), as in a chat


def make_batch(seq_lens, vocab: int, seed: int, device):
    """A packed batch: token ids, next-token labels (-100 on prompts and sequence ends)."""
    g = torch.Generator().manual_seed(seed)
    total = sum(seq_lens)
    ids = torch.randint(0, vocab, (total,), generator=g)
    labels = torch.full((total,), -100, dtype=torch.int64)
    cu = [0]
    for n in seq_lens:
        start = cu[-1]
        labels[start : start + n - 1] = ids[start + 1 : start + n]
        labels[start : start + min(PROMPT, n)] = -100
        cu.append(start + n)
    return ids.to(device), labels.to(device), cu


def uneven_plan(seq_len: int, cp: int, seed: int) -> ContextParallelPlan:
    """Shuffled positions, rank r holding a share proportional to cp - r (all uneven)."""
    g = torch.Generator().manual_seed(seed + cp)
    order = torch.randperm(seq_len, generator=g)
    weights = torch.arange(cp, 0, -1, dtype=torch.float64)
    ends = (weights.cumsum(0) / weights.sum() * seq_len).round().long().tolist()
    starts = [0] + ends[:-1]
    return ContextParallelPlan.from_rank_positions(
        [order[a:b].sort().values for a, b in zip(starts, ends)], seq_len
    )


def plan_name(plan: ContextParallelPlan, cu) -> str:
    """Which standard layout a plan is, by comparing it with each (else "uneven")."""
    if plan.cp_size == 1:
        return "whole"
    candidates = []
    for name, build in (
        ("thd", lambda: ContextParallelPlan.thd(cu, plan.cp_size)),
        ("zigzag", lambda: ContextParallelPlan.zigzag(plan.seq_len, plan.cp_size)),
        ("contiguous", lambda: ContextParallelPlan.contiguous(plan.seq_len, plan.cp_size)),
    ):
        try:
            candidates.append((name, build()))
        except ValueError:
            pass
    for name, other in candidates:
        if other.counts == plan.counts and all(
            torch.equal(other.local_positions(r), plan.local_positions(r))
            for r in range(plan.cp_size)
        ):
            return name
    return "uneven"


def seed_probe(out, labels) -> torch.Tensor:
    """The caller's code from the report, unchanged."""
    mask = labels[1:] != -100
    return out.hidden_states[1:][mask]


def max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    if a.shape != b.shape:
        return float("inf")
    if a.numel() == 0:
        return 0.0
    return (a.double() - b.double()).abs().max().item()


def probe(args, device: torch.device) -> None:
    from megatron.core import parallel_state as ps

    from megatron.context_parallel.models.forward import context_parallel_forward

    seq_lens = common.resolve_size(args, device)
    world = dist.get_world_size()
    cp_sizes = sorted(set([1] + common.parse_ints(args.cp_sizes)))
    bad = [c for c in cp_sizes if world % c]
    if bad:
        raise SystemExit(f"CP sizes {bad} do not divide the world size {world}")
    if device.type == "cuda":
        # Exact fp32 matmuls, so the comparison with CP 1 measures the gather, not TF32 noise.
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False

    ids, labels, cu = make_batch(seq_lens, args.vocab, args.seed, device)
    seq_len = ids.shape[0]
    common.say(
        f"cp_probe: {world} ranks on {device.type} ({dist.get_backend()}); GPTModel "
        f"{args.layers} layers, hidden {args.hidden}, {args.heads} heads, vocab {args.vocab}; "
        f"{len(seq_lens)} packed sequences {seq_lens} = {seq_len} tokens; top-k {args.top_k}"
    )

    reference = None
    rows = []
    for cp in cp_sizes:
        common.init_parallel(cp)
        model = common.build_gpt(args, device, max_seq_len=max(seq_lens))
        model.eval()
        plans = [("default", None)]
        if cp > 1:
            plans.append(("uneven", uneven_plan(seq_len, cp, args.seed)))
        for _, plan in plans:
            kwargs = dict(cu_seqlens=cu, plan=plan, fields=FIELDS, top_k=args.top_k)
            with torch.no_grad():
                out = context_parallel_forward(model, ids, labels, **kwargs)  # also a warm-up
                common.synchronize(device)
                start = time.perf_counter()
                for _ in range(args.iters):
                    context_parallel_forward(model, ids, labels, **kwargs)
                common.synchronize(device)
                elapsed = time.perf_counter() - start
            probe_rows = seed_probe(out, labels)
            if reference is None:
                reference = (out, probe_rows)
            ref, ref_probe = reference
            diffs = [
                max_diff(out.hidden_states, ref.hidden_states),
                max_diff(out.target_logprobs, ref.target_logprobs),
                max_diff(out.top_k.logprobs, ref.top_k.logprobs),
                max_diff(out.logits, ref.logits),
                max_diff(probe_rows, ref_probe),
                float((out.top_k.tokens != ref.top_k.tokens).sum().item()),
                elapsed,
            ]
            diffs = common.all_max(diffs, device)
            rows.append(
                dict(
                    cp=cp,
                    dp=ps.get_data_parallel_world_size(),
                    plan=plan_name(out.plan, cu),
                    counts=out.plan.counts,
                    diffs=diffs[:5],
                    id_swaps=int(diffs[5]),
                    tokens_per_s=seq_len * args.iters / max(diffs[6], 1e-9),
                    probe_shape=tuple(probe_rows.shape),
                )
            )
        del model

    passed = report(rows, args.atol, seq_len)
    ps.destroy_model_parallel()
    if not passed:
        raise SystemExit(1)


def report(rows, atol: float, seq_len: int) -> bool:
    """Prints the table and the verdict on rank 0; True when every difference is within atol."""
    head = ["CP", "DP", "plan", "rows per CP rank", *FIELDS, "probe", "tokens/s"]
    lines = []
    for r in rows:
        counts = "/".join(map(str, r["counts"]))
        cells = [f"{d:.1e}" for d in r["diffs"]]
        lines.append(
            [str(r["cp"]), str(r["dp"]), r["plan"], counts, *cells, f"{r['tokens_per_s']:,.0f}"]
        )
    widths = [max(len(h), *(len(line[i]) for line in lines)) for i, h in enumerate(head)]
    common.say("")
    common.say("max |difference| against CP 1 over all ranks (fields full-length, source order):")
    common.say("  ".join(h.rjust(w) for h, w in zip(head, widths)))
    for line in lines:
        common.say("  ".join(c.rjust(w) for c, w in zip(line, widths)))

    # NaN compares False with everything, so it can only fail these checks, never pass them.
    every = [d for r in rows for d in r["diffs"]]
    worst = common.nanmax(every)
    shapes = {r["probe_shape"] for r in rows}
    swaps = sum(r["id_swaps"] for r in rows)
    probe_ok = len(shapes) == 1 and all(r["diffs"][4] <= atol for r in rows)
    common.say("")
    if swaps:
        # Top-k values are compared above; ids may swap only between (near-)equal logits.
        common.say(f"note: {swaps} top-k id(s) differ from CP 1 between near-equal logits")
    cps = ", ".join(str(c) for c in sorted({r["cp"] for r in rows}))
    common.say(
        f"report probe: output.hidden_states[1:][mask] with a full-sequence mask "
        f"[{seq_len - 1}] -> {' / '.join(str(s) for s in sorted(shapes))} at CP {cps}: "
        f"{'passed' if probe_ok else 'FAILED'}"
    )
    passed = probe_ok and all(d <= atol for d in every)
    common.say(
        f"cp_probe: {'PASSED' if passed else 'FAILED'} "
        f"(largest difference {worst:.1e}, tolerance {atol:.0e})"
    )
    return passed


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--cp-sizes", default="1,2,4", help="comma-separated CP sizes")
    parser.add_argument("--top-k", type=int, default=4)
    parser.add_argument("--iters", type=int, default=2, help="timed forwards per plan")
    parser.add_argument(
        "--atol", type=float, default=1e-4, help="largest allowed |difference| against CP 1 (fp32)"
    )
    common.add_model_args(parser)
    common.add_launch_args(parser, default_world=4)
    args = parser.parse_args(argv)
    return common.launch(probe, args)


if __name__ == "__main__":
    sys.exit(main())
