"""Regression test for the ART bug report (github.com/OpenPipe/ART, PR #912).

A probe did ``output.hidden_states[1:][mask]`` with a full-sequence mask. Under CP 2 and CP 4
the forward returned each rank's uneven shard of a prefix-tree rank plan, so the probe raised
``IndexError: The shape of the mask [20435] at index 0 does not match the shape of the indexed
tensor [8659, 5120]``. Now ``context_parallel_forward`` returns the full sequence in source
order, and the probe must give exactly what it gives at CP 1.
"""

from __future__ import annotations

import _megatron_cpu as mc
import pytest
import torch
from _dist import run_distributed

from megatron.context_parallel.comm.plan import ContextParallelPlan
from megatron.context_parallel.models.forward import context_parallel_forward

SEQ_LEN = 203
CU_SEQLENS = (0, 61, 140, 203)  # three packed views, as a trainer packs them
FIELDS = ("hidden_states", "target_logprobs")


def _batch():
    g = torch.Generator().manual_seed(51)
    ids = torch.randint(0, mc.TINY["vocab_size"], (SEQ_LEN,), generator=g)
    labels = torch.randint(0, mc.TINY["vocab_size"], (SEQ_LEN,), generator=g)
    labels[:20] = -100  # a prompt without targets
    return ids, labels


def _prefix_tree_plan(cp: int) -> ContextParallelPlan:
    """Uneven shards: rank r owns a share proportional to cp - r of a shuffled sequence."""
    g = torch.Generator().manual_seed(1000 + cp)
    order = torch.randperm(SEQ_LEN, generator=g)
    weights = torch.arange(cp, 0, -1, dtype=torch.float64)
    bounds = (weights.cumsum(0) / weights.sum() * SEQ_LEN).round().long().tolist()
    starts = [0] + bounds[:-1]
    shards = [order[a:b].sort().values for a, b in zip(starts, bounds)]
    return ContextParallelPlan.from_rank_positions(shards, SEQ_LEN)


def _probe(output, labels):
    # The caller's code from the report, unchanged: a full-sequence mask over positions 1..S-1.
    mask = labels[1:] != -100
    return output.hidden_states[1:][mask]


def _probe_equals_cp1_at_cp4_and_cp2(rank, world_size):
    from megatron.core import parallel_state as ps

    ids, labels = _batch()
    mc.init_parallel(1, 1)
    reference = _probe(
        context_parallel_forward(mc.build_tiny_gpt(), ids, labels, cu_seqlens=CU_SEQLENS), labels
    )
    assert reference.shape == (SEQ_LEN - 1 - 19, mc.TINY["hidden_size"])
    for cp in (4, 2):
        mc.init_parallel(1, cp)
        plan = _prefix_tree_plan(cp)
        assert len(set(plan.counts)) == cp, plan.counts  # uneven shards, as in the report
        out = context_parallel_forward(
            mc.build_tiny_gpt(), ids, labels, cu_seqlens=CU_SEQLENS, plan=plan, fields=FIELDS
        )
        # The report's failure, reproduced on what the forward used to hand back: this rank's rows.
        shard = out.hidden_states[plan.local_positions(ps.get_context_parallel_rank())]
        with pytest.raises(IndexError, match="does not match"):
            shard[1:][labels[1:] != -100]
        # ...and gone on the full output, which equals CP 1.
        probe = _probe(out, labels)
        assert probe.shape == reference.shape, (rank, cp)
        assert (probe - reference).abs().max().item() <= 1e-5, (rank, cp)


def test_probe_pattern_on_full_outputs_at_cp2_and_cp4():
    run_distributed(_probe_equals_cp1_at_cp4_and_cp2, 4)
