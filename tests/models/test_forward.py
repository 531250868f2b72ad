"""End to end: a tiny megatron-core GPTModel under CP gives the outputs and gradients of CP 1.

Every rank builds the same tiny fp32 model (2 layers, hidden 64, 4 heads, vocab 128, fixed
seed). The reference is megatron-core's own model at TP 1 / CP 1 (its ``DotProductAttention``,
``GPTModel.forward``), run one packed sequence at a time so packing cannot leak into it. The CP
runs go through ``context_parallel_forward`` with ``ContextParallelAttention``. The same loss,
weighted sums of every output field, is backpropagated in both; parameter gradients are summed
over CP (and DP) and TP shards are concatenated before comparing.

One spawned world per size runs many layouts in turn (``parallel_state`` is re-initialised
between them) to keep the suite fast on two cores.
"""

from __future__ import annotations

import math

import _megatron_cpu as mc
import pytest
import torch
import torch.distributed as dist
from _dist import run_distributed

from megatron.context_parallel.comm.mappings import reduce_over_data_parallel
from megatron.context_parallel.comm.plan import ContextParallelPlan
from megatron.context_parallel.models.forward import context_parallel_forward, default_plan

FIELDS = ("hidden_states", "target_logprobs", "logits", "top_k")
TOP_K = 3
ATOL = 1e-5
# Parameter gradients are sums over many rows; compare them relative to their own scale.
GRAD_RTOL = 1e-5

# ---------------------------------------------------------------------------------------------
# Batches and plans (built identically on every rank from a seed).


def _case(kind: str, cp: int, seed: int):
    """(input_ids [S], labels [S], cu_seqlens or None, plan or None, expected default plan)."""
    g = torch.Generator().manual_seed(seed)
    cu, plan, expected = None, None, None
    if kind == "zigzag":
        seq_len = 24
        expected = ContextParallelPlan.zigzag(seq_len, cp)
    elif kind == "contiguous":
        seq_len = 26  # divides by no 2 * cp here: the default falls back to contiguous blocks
        expected = ContextParallelPlan.contiguous(seq_len, cp)
    elif kind == "thd":
        cu = (0, 4 * cp, 6 * cp, 12 * cp)
        seq_len = cu[-1]
        expected = ContextParallelPlan.thd(cu, cp)
    elif kind == "uneven":
        # Prefix-tree style: packed, arbitrary owners and order, uneven, one rank empty.
        cu = (0, 9, 16, 27)
        seq_len = cu[-1]
        order = torch.randperm(seq_len, generator=g)
        cuts = sorted(torch.randint(0, seq_len + 1, (cp - 2,), generator=g).tolist())
        bounds = [0] + cuts + [seq_len]
        shards = [order[a:b] for a, b in zip(bounds[:-1], bounds[1:])]
        empty = int(torch.randint(0, cp, (1,), generator=g))
        shards.insert(empty, order[:0])
        plan = ContextParallelPlan.from_rank_positions(shards, seq_len)
        assert plan.counts[empty] == 0
    elif kind == "permuted":
        # Equal shards of a random permutation of packed sequences: every rank's rows out of
        # source order and from every sequence.
        cu = (0, 5 * cp, 8 * cp, 12 * cp)
        seq_len = cu[-1]
        order = torch.randperm(seq_len, generator=g)
        plan = ContextParallelPlan.from_rank_positions(list(order.chunk(cp)), seq_len)
    else:
        raise AssertionError(kind)
    ids = torch.randint(0, mc.TINY["vocab_size"], (seq_len,), generator=g)
    labels = torch.randint(0, mc.TINY["vocab_size"], (seq_len,), generator=g)
    labels[torch.randperm(seq_len, generator=g)[: seq_len // 5]] = -100
    return ids, labels, cu, plan, expected


def _loss_weights(seq_len: int, seed: int):
    g = torch.Generator().manual_seed(10_000 + seed)
    h, v = mc.TINY["hidden_size"], mc.TINY["vocab_size"]
    return {
        "hidden_states": torch.randn(seq_len, h, generator=g),
        "target_logprobs": torch.randn(seq_len, generator=g),
        "logits": torch.randn(seq_len, v, generator=g) / 10,
        "top_k": torch.randn(seq_len, TOP_K, generator=g),
    }


def _loss(fields: dict, weights: dict) -> torch.Tensor:
    return sum((fields[k] * weights[k]).sum() for k in weights)


# ---------------------------------------------------------------------------------------------
# The reference: megatron-core's own model at TP 1 / CP 1, one sequence at a time.


def _reference(ids, labels, cu, seed, model_kw):
    """Reference fields, loss and parameter gradients (by name), computed on this rank alone."""
    model = mc.build_tiny_gpt(reference=True, **model_kw)
    cuts = cu if cu is not None else (0, ids.numel())
    hidden, logits = [], []
    # The model's own forward (GPTModel or HybridModel: logits [1, n, V]); the final hidden
    # states are the decoder's output.
    model.decoder.register_forward_hook(lambda module, args, out: hidden.append(out[:, 0]))
    for a, b in zip(cuts[:-1], cuts[1:]):
        n = b - a
        causal = torch.ones(n, n, dtype=torch.bool).triu(1)[None, None]
        logits.append(model(ids[None, a:b], torch.arange(n)[None], causal)[0])
    hidden, logits = torch.cat(hidden), torch.cat(logits)
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    target = logprobs.gather(1, labels.clamp(min=0)[:, None])[:, 0]
    target = torch.where(labels == -100, 0.0, target)
    top_lp, top_ids = logprobs.topk(TOP_K, dim=-1)
    fields = {"hidden_states": hidden, "target_logprobs": target, "logits": logits, "top_k": top_lp}
    loss = _loss(fields, _loss_weights(ids.numel(), seed))
    loss.backward()
    out = {k: v.detach() for k, v in fields.items()}
    out["top_k_tokens"] = top_ids
    out["loss"] = loss.detach()
    out["grads"] = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
    return out


# ---------------------------------------------------------------------------------------------
# CP runs.


def _full_grads(model, sum_group) -> dict:
    """Parameter gradients summed over ``sum_group``, TP shards concatenated (by name)."""
    from megatron.core import parallel_state as ps

    tp_group = ps.get_tensor_model_parallel_group()
    tp = dist.get_world_size(tp_group)
    grads = {}
    for name, p in model.named_parameters():
        g = p.grad.detach().clone()
        dist.all_reduce(g, group=sum_group)
        if tp > 1 and getattr(p, "tensor_model_parallel", False):
            parts = [torch.empty_like(g) for _ in range(tp)]
            dist.all_gather(parts, g, group=tp_group)
            g = torch.cat(parts, dim=p.partition_dim)
        grads[name] = g
    return grads


def _compare(out, ref, grads) -> dict:
    """Max abs errors of every field and the largest relative gradient error."""
    errors = {
        "hidden_states": (out.hidden_states - ref["hidden_states"]).abs().max().item(),
        "target_logprobs": (out.target_logprobs - ref["target_logprobs"]).abs().max().item(),
        "logits": (out.logits - ref["logits"]).abs().max().item(),
        "top_k": (out.top_k.logprobs - ref["top_k"]).abs().max().item(),
        "top_k_tokens_equal": bool(torch.equal(out.top_k.tokens, ref["top_k_tokens"])),
    }
    worst = 0.0
    for name, g in ref["grads"].items():
        scale = 1.0 + g.abs().max().item()
        worst = max(worst, (grads[name] - g).abs().max().item() / scale)
    errors["grads"] = worst
    return errors


def _output_loss(out, seq_len, seed):
    """The test loss on every differentiable field of a ForwardOutput."""
    fields = {
        "hidden_states": out.hidden_states,
        "target_logprobs": out.target_logprobs,
        "logits": out.logits,
        "top_k": out.top_k.logprobs,
    }
    return _loss(fields, _loss_weights(seq_len, seed))


def _forward_and_loss(kind, cp, seed, model_kw):
    """The tiny model's CP forward of case ``kind`` and the test loss on every field."""
    ids, labels, cu, plan, expected = _case(kind, cp, seed)
    model = mc.build_tiny_gpt(**model_kw)
    out = context_parallel_forward(
        model, ids, labels, cu_seqlens=cu, plan=plan, fields=FIELDS, top_k=TOP_K
    )
    return ids, plan, expected, model, out, _output_loss(out, ids.numel(), seed)


def _run_cp_case(kind, tp, cp, seed, model_kw, references, check_default=True):
    from megatron.core import parallel_state as ps

    ids, plan, expected, model, out, loss = _forward_and_loss(kind, cp, seed, model_kw)
    loss.backward()
    grads = _full_grads(model, ps.get_context_parallel_group())
    errors = _compare(out, references[(kind, cp, seed, tuple(sorted(model_kw.items())))], grads)
    errors["shapes_ok"] = (
        tuple(out.hidden_states.shape) == (ids.numel(), mc.TINY["hidden_size"])
        and tuple(out.logits.shape) == (ids.numel(), mc.TINY["vocab_size"])
        and tuple(out.target_logprobs.shape) == (ids.numel(),)
    )
    if plan is None and check_default:
        errors["default_plan_ok"] = out.plan == expected
    return errors


def _world(rank, world_size, cases, extra):
    """Runs ``cases`` [(kind, tp, cp, seed, model_kw)] in turn; returns their errors by name."""
    # References first, each on this rank alone (TP 1, CP 1: the world is pure DP here).
    mc.init_parallel(1, 1)
    refs = {}
    for kind, _, cp, seed, kw in cases + extra.get("dp_cases", []):
        key = (kind, cp, seed, tuple(sorted(kw.items())))
        if key not in refs:
            ids, labels, cu, _, _ = _case(kind, cp, seed)
            refs[key] = _reference(ids, labels, cu, seed, kw)
    results = {}
    layout = None
    for kind, tp, cp, seed, kw in cases:
        if layout != (tp, cp):
            mc.init_parallel(tp, cp)
            layout = (tp, cp)
        results[f"{kind}-tp{tp}-cp{cp}-{seed}-{kw}"] = _run_cp_case(kind, tp, cp, seed, kw, refs)
    if extra.get("dp_cases"):
        results.update(_data_parallel(rank, extra["dp_cases"], refs))
    return results


def _data_parallel(rank, dp_cases, refs):
    """DP 2 x CP 2: each DP replica gets its own batch; losses reduce over pure DP only."""
    from megatron.core import parallel_state as ps

    mc.init_parallel(1, 2)
    dp_rank = ps.get_data_parallel_rank(with_context_parallel=False)
    kind, _, cp, seed, kw = dp_cases[dp_rank]
    ids, plan, _, model, out, loss = _forward_and_loss(kind, cp, seed, kw)
    total = reduce_over_data_parallel(loss)
    loss.backward()
    # Megatron's DDP reduces gradients over DP x CP.
    grads = _full_grads(model, ps.get_data_parallel_group(with_context_parallel=True))
    keys = [(k, c, s, tuple(sorted(w.items()))) for k, _, c, s, w in dp_cases]
    expected_loss = sum(refs[k]["loss"] for k in keys)
    worst = 0.0
    for name in refs[keys[0]]["grads"]:
        g = sum(refs[k]["grads"][name] for k in keys)
        worst = max(worst, (grads[name] - g).abs().max().item() / (1.0 + g.abs().max().item()))
    mine = _compare(out, refs[keys[dp_rank]], grads)
    mine.pop("grads")
    expected = expected_loss.item()
    mine["loss_over_dp"] = abs(total.item() - expected) / (1 + abs(expected))
    mine["grads"] = worst
    return {f"dp2-cp2-replica{dp_rank}": mine}


def _check(results_per_rank):
    failures = []
    for rank, results in enumerate(results_per_rank):
        for name, errors in results.items():
            for key, value in errors.items():
                if isinstance(value, bool):
                    ok = value
                elif key in ("grads", "loss_over_dp"):
                    ok = value <= GRAD_RTOL
                else:
                    ok = value <= ATOL
                if not ok or (isinstance(value, float) and math.isnan(value)):
                    failures.append(f"rank {rank} {name}: {key} = {value}")
    assert not failures, "\n".join(failures)


KINDS = ("zigzag", "contiguous", "thd", "uneven")


def _cases(cp, tp=1, seed=0, kinds=KINDS, **kw):
    return [(kind, tp, cp, seed + i, dict(kw)) for i, kind in enumerate(kinds)]


def test_cp2_all_plans_and_cp1_paths():
    cases = (
        _cases(2)
        + _cases(2, kinds=("zigzag",), seed=7, num_query_groups=2)
        + _cases(2, kinds=("uneven",), seed=8, position_embedding_type="learned_absolute")
    )
    results = run_distributed(_world, 2, cases, {})
    _check(results)


def test_cp3_all_plans():
    _check(run_distributed(_world, 3, _cases(3), {}))


def test_cp4_tp2cp2_dp2cp2():
    cases = _cases(4) + _cases(2, tp=2, kinds=("thd", "uneven"), seed=20)
    dp_cases = _cases(2, kinds=("zigzag", "uneven"), seed=30)
    _check(run_distributed(_world, 4, cases, {"dp_cases": dp_cases}))


# ---------------------------------------------------------------------------------------------
# CP 1 and the public helpers (no collective of CP size > 1 involved).


def _cp1(rank, world_size):
    """CP 1: the package's spec runs any row order and packing; megatron-core's own attention
    runs what its rotary table gets right, and refuses the rest."""
    mc.init_parallel(1, 1)
    results = {}
    fields = dict(fields=FIELDS, top_k=TOP_K)

    def run(name, model, ids, labels, ref, seed, **kwargs):
        out = context_parallel_forward(model, ids, labels, **kwargs, **fields)
        _output_loss(out, ids.numel(), seed).backward()
        grads = {n: p.grad for n, p in model.named_parameters()}
        results[name] = _compare(out, ref, grads)

    for kind, seed in (("thd", 3), ("uneven", 4)):
        ids, labels, cu, _, _ = _case(kind, 2, seed)
        ref = _reference(ids, labels, cu, seed, {})
        # A permuted one-rank plan: rows in an order other than the source order.
        plan = ContextParallelPlan.from_rank_positions([torch.randperm(ids.numel())])
        run(
            f"cp1-{kind}-package-spec",
            mc.build_tiny_gpt(),
            ids,
            labels,
            ref,
            seed,
            cu_seqlens=cu,
            plan=plan,
        )

    # megatron-core's DotProductAttention: one sequence, rows in source order (rotary at 0..n-1).
    ids, labels, _, _, _ = _case("zigzag", 2, 5)
    ref = _reference(ids, labels, None, 5, {})
    megatron = mc.build_tiny_gpt(reference=True)
    run("cp1-megatron-attention-in-order", megatron, ids, labels, ref, 5)
    # Without rotary, megatron's attention runs any row order and packing (mask by source).
    kind, seed, kw = "uneven", 6, {"position_embedding_type": "learned_absolute"}
    p_ids, p_labels, cu, _, _ = _case(kind, 2, seed)
    ref = _reference(p_ids, p_labels, cu, seed, kw)
    plan = ContextParallelPlan.from_rank_positions([torch.randperm(p_ids.numel())])
    run(
        "cp1-megatron-learned",
        mc.build_tiny_gpt(reference=True, **kw),
        p_ids,
        p_labels,
        ref,
        seed,
        cu_seqlens=cu,
        plan=plan,
    )

    # Rotary rows that megatron's table would get wrong: refused, naming the plan and module.
    messages = []
    permuted = ContextParallelPlan.from_rank_positions([torch.randperm(ids.numel())])
    for kwargs in (dict(plan=permuted), dict(cu_seqlens=(0, 10, 24))):
        try:
            context_parallel_forward(mc.build_tiny_gpt(reference=True), ids, labels, **kwargs)
            messages.append(None)
        except ValueError as exc:
            messages.append(str(exc))
    return results, messages


def test_cp1_package_spec_any_rows_megatron_attention_only_where_exact():
    ((results, messages),) = run_distributed(_cp1, 1)
    _check([results])
    for message in messages:
        assert message is not None
        assert "SelfAttention with DotProductAttention" in message, message
        assert "ContextParallelPlan(cp_size=1" in message, message


def test_default_plan_choice():
    assert default_plan(24, 2) == ContextParallelPlan.zigzag(24, 2)
    assert default_plan(26, 2) == ContextParallelPlan.contiguous(26, 2)
    assert default_plan(24, 2, [0, 8, 24]) == ContextParallelPlan.thd([0, 8, 24], 2)
    uneven = default_plan(10, 2, [0, 3, 10])
    assert uneven.cu_seqlens == (0, 3, 10)
    assert uneven.counts == (5, 5)
    assert torch.equal(uneven.local_positions(1), torch.arange(5, 10))
    with pytest.raises(ValueError, match="ends at 9"):
        default_plan(10, 2, [0, 3, 9])


def _bad_inputs(rank, world_size):
    mc.init_parallel(1, world_size)
    model = mc.build_tiny_gpt()
    ids = torch.randint(0, 128, (24,))
    messages = []
    for kwargs in (
        dict(plan=ContextParallelPlan.zigzag(16, world_size)),
        dict(plan=ContextParallelPlan.zigzag(24, 1)),
        dict(cu_seqlens=[0, 8, 20]),
        dict(position_ids=torch.arange(23)),
        dict(labels=torch.zeros(25, dtype=torch.int64)),
    ):
        try:
            context_parallel_forward(model, ids, **kwargs)
            messages.append(None)
        except ValueError as exc:
            messages.append(str(exc))
    return messages


def test_bad_inputs_raise_on_every_rank_before_any_collective():
    per_rank = run_distributed(_bad_inputs, 2)
    assert per_rank[0] == per_rank[1]
    expected = ["16 positions", "cp_size 1", "ends at 20", "23 positions", "25 positions"]
    for message, needle in zip(per_rank[0], expected):
        assert message is not None and needle in message, (message, needle)


def _one_rank_bad(rank, world_size):
    """Only the last rank's call is wrong: every rank raises (none waits in the model's
    collectives), and a later good call still works. Returns {call: (type, message)}."""
    import megatron.context_parallel.models.forward as cp_model

    mc.init_parallel(1, world_size)
    model = mc.build_tiny_gpt()
    ids = torch.randint(0, 128, (24,), generator=torch.Generator().manual_seed(0))
    labels = ids.roll(-1)
    bad = rank == world_size - 1
    good = dict(plan=ContextParallelPlan.zigzag(24, world_size), fields="target_logprobs")
    calls = {
        "labels": dict(good, labels=labels[:20] if bad else labels),
        "plan": dict(good, plan=ContextParallelPlan.contiguous(24, world_size)) if bad else good,
        "fields": dict(good, fields="hidden_states") if bad else good,
        "plan_module": dict(good, plan=ContextParallelPlan.contiguous(24, 1)) if bad else good,
        "position_type": dict(good, position_ids=[0] * 24) if bad else good,
    }
    # Exceptions that are not about the input at all, raised inside the batch's preparation on
    # the bad rank only (a data pipeline's StopIteration, an out-of-memory, any RuntimeError).
    failures = {
        "runtime": RuntimeError("CUDA error: an illegal memory access (rows 3..7)"),
        "stop": StopIteration("data iterator exhausted after 12 batches"),
        "oom": torch.OutOfMemoryError("tried to allocate 20.00 GiB"),
    }
    real_processor = cp_model.make_output_processor

    def failing(exc):
        def make_output_processor(*args, **kwargs):
            if bad:
                raise exc
            return real_processor(*args, **kwargs)

        return make_output_processor

    results = {}

    def attempt(name, kwargs):
        kwargs = dict(kwargs)
        kwargs.setdefault("labels", labels)
        try:
            context_parallel_forward(model, ids, **kwargs)
            results[name] = None
        except Exception as exc:  # noqa: BLE001 - what each rank raised is the result
            cause = type(exc.__cause__).__name__ if exc.__cause__ is not None else None
            results[name] = (type(exc).__name__, str(exc), cause)

    for name, kwargs in calls.items():
        attempt(name, kwargs)
    for name, exc in failures.items():
        cp_model.make_output_processor = failing(exc)
        try:
            attempt(name, good)
        finally:
            cp_model.make_output_processor = real_processor
    # A longer description of the output options: a rank whose preparation failed must still
    # send a row as long as its peers' (one definition of the length), or the exchange breaks.
    real_describe = cp_model.OutputOptions.describe
    cp_model.OutputOptions.describe = lambda self: real_describe(self) + (7, 7)
    try:
        attempt("longer_description", calls["labels"])
    finally:
        cp_model.OutputOptions.describe = real_describe
    out = context_parallel_forward(model, ids, labels, **good)
    results["later_good_call"] = tuple(out.target_logprobs.shape)
    return results


def test_one_rank_bad_input_raises_on_every_rank():
    """Every rank, the bad one included, raises the same InputError with the bad rank's
    numbers; on the bad rank its own exception is the cause."""
    per_rank = run_distributed(_one_rank_bad, 3, timeout=120)
    last = len(per_rank) - 1
    for results in per_rank:
        assert results.pop("later_good_call") == (24,)
    expected = {
        "labels": ("InputError", "ValueError: labels has 20 positions but input_ids has 24"),
        "longer_description": ("InputError", "labels has 20 positions but input_ids has 24"),
        "plan_module": ("InputError", "the CP group has 3 ranks but the plan has cp_size 1"),
        "position_type": ("InputTypeError", "TypeError: position_ids must be a tensor"),
        "runtime": ("InputError", "RuntimeError: CUDA error: an illegal memory access"),
        "stop": ("InputError", "StopIteration: data iterator exhausted after 12 batches"),
        "oom": ("InputError", "OutOfMemoryError: tried to allocate 20.00 GiB"),
    }
    for name, (kind, needle) in expected.items():
        seen = {(r[name][0], r[name][1]) for r in per_rank}
        assert len(seen) == 1, (name, seen)  # the same type and text on every rank
        kind_seen, message = seen.pop()
        assert kind_seen == kind, (name, kind_seen)
        assert message.startswith(f"rank {last}: input rejected ("), message
        assert needle in message, (name, message)
        # Only the bad rank carries the original exception as the cause.
        causes = [r[name][2] for r in per_rank]
        assert causes[:last] == [None] * last and causes[last] is not None, (name, causes)
    assert per_rank[last]["oom"][2] == "OutOfMemoryError"
    for results in per_rank:
        # Calls whose difference only shows when ranks compare: the same error everywhere.
        assert "different plans" in results["plan"][1], results
        assert "different calls" in results["fields"][1], results


def _without_shims(rank, world_size):
    """CP 2 on CPU in a fresh process in which nothing patched torch: ``context_parallel_batch``
    and the model's forward and backward run (GPTModel builds no rotary table of its own, whose
    CP slice calls ``pin_memory`` and ``.cuda()``). Then, with ``_megatron_cpu``'s shims, which
    megatron-core's own attention and rotary table need, the reference to compare with."""
    from megatron.core import parallel_state as ps

    untouched = (torch.cuda.current_device, torch.Tensor.cuda, torch.zeros, torch.tensor)
    assert not mc._INSTALLED
    ps.initialize_model_parallel(context_parallel_size=world_size)
    ids, labels, cu, plan, _ = _case("uneven", world_size, 5)
    model = mc.build_tiny_gpt()
    out = context_parallel_forward(
        model, ids, labels, cu_seqlens=cu, plan=plan, fields=FIELDS, top_k=TOP_K
    )
    fields = {k: getattr(out, k) for k in FIELDS if k != "top_k"}
    fields["top_k"] = out.top_k.logprobs
    _loss(fields, _loss_weights(ids.numel(), 5)).backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
    for g in grads.values():
        dist.all_reduce(g, group=ps.get_context_parallel_group())
    assert (torch.cuda.current_device, torch.Tensor.cuda, torch.zeros, torch.tensor) == untouched

    mc.init_parallel(1, 1)  # installs the shims, for the reference only
    ref = _reference(ids, labels, cu, 5, {})
    errors = {k: (v.detach() - ref[k]).abs().max().item() for k, v in fields.items()}
    for name, g in grads.items():
        scale = ref["grads"][name].abs().max().item()
        errors[f"grad {name}"] = (g - ref["grads"][name]).abs().max().item() / max(scale, 1e-30)
    return errors


def test_cpu_forward_and_backward_need_no_shim():
    # Spawned: forked ranks would inherit whatever the parent process patched.
    for errors in run_distributed(_without_shims, 2, start_method="spawn", timeout=300):
        for key, value in errors.items():
            bound = GRAD_RTOL if key.startswith("grad") else ATOL
            assert value <= bound, (key, value)


def _prepared_batch(rank, world_size):
    """TP 2: ``batch.prepare()`` stages the backward for the attention layers' own shape."""
    from megatron.context_parallel.attention import cudnn
    from megatron.context_parallel.models.forward import context_parallel_batch

    mc.init_parallel(world_size, 1)
    model = mc.build_tiny_gpt(num_query_groups=2)
    attention = model.decoder.layers[0].self_attention
    shape = (attention.num_attention_heads_per_partition, attention.hidden_size_per_attention_head)
    ids, labels, cu, _, _ = _case("thd", 1, 7)
    batch = context_parallel_batch(model, ids, labels, cu_seqlens=cu).prepare()
    tables = batch.packed_seq_params.runs
    return batch.attention_shape, shape, ("backward", cudnn.KERNEL, *shape) in tables._derived


def test_batch_prepare_stages_the_backward_for_the_models_attention():
    for mine, theirs, staged in run_distributed(_prepared_batch, 2):
        assert mine == theirs and staged, (mine, theirs)
