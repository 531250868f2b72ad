"""Tree packing of GRPO batches against flat packing: a model step, its attention, GDN, balance.

A GRPO batch is one prompt of ``P`` tokens and ``G`` completions of ``C`` tokens. Packed flat,
every completion repeats the prompt (``G`` samples of ``P + C`` tokens, in as many micro-batches
as the token budget needs); packed as a ``PrefixTree`` the prompt is a root segment and each
completion a child (``P + G * C`` tokens, one micro-batch). Batches (``--batches``): prompt
4,096 + 8 x 1,024, and prompt 16,384 + 16 x 512. On one GPU, at CP 1, side by side in one run:

* **model**: a GPTModel of ``--layers`` 4 layers shaped like a 27B dense model (hidden 5,120,
  40 query / 8 KV heads of 128, FFN 17,408, vocabulary 151,936), bf16, the package's layer spec,
  forward through ``context_parallel_forward`` (``tree=`` with ``tree.labels(ids)``, or
  ``cu_seqlens=`` per flat micro-batch), loss = sum of the completion tokens' log-probs (tree:
  through ``out.samples()``; flat: sliced per sample), backward. Forward+backward ms (median
  of ``--reps`` rounds, tree and flat timed in turns by ``timing.time_round_robin``; flat: all
  its micro-batches, i.e. their times summed), extra peak memory (``max_memory_allocated``
  beyond what existed before the step: activations and the parameter gradients), tokens.
  Target: tree time <= 1.15 x (tree tokens / flat tokens) x flat time.
* **log-probs**: the completion tokens' log-probs of tree against flat (max and mean abs diff)
  and, as the bf16 noise scale, the same between two flat runs: another packing of the samples
  (reverse order, one more sample per micro-batch, so every micro-batch differs), and the same
  packing with a random half of the embedding output's elements one floating-point step larger
  (one rounding difference; the kernels may well give bit-identical results for any packing,
  which makes the first scale 0). Noise = the larger; target: tree-vs-flat max <= 2 x noise.
* **attention**: one layer's attention of the tree alone (q ``[S, 40, 128]``, keys+values
  ``[S, 8, 256]`` bf16, the tree tables ``ContextParallelParams.for_plan(contiguous(S, 1),
  tree=tree).runs`` + ``fused_attention``) forward and forward+backward, against the floor:
  cuDNN causal SDPA over one sequence of ``L = S`` tokens (``sdpa_kernel(CUDNN_ATTENTION)``),
  its time scaled by (the tree's visible query-key pairs / ``L (L + 1) / 2``). Also the max
  error against an fp32 dense computation on a slice of rows. Target: <= 1.15 x the floor.
* **GDN hybrid**: a HybridModel ``--hybrid-pattern`` (default ``G-G-G-*-``: Qwen3.5's three Gated
  DeltaNet layers per attention layer, each followed by an MLP; GDN shape of Qwen3.5-27B as in
  ``bench_gdn.py``: 16 key / 48 value heads of 128, kernel 4) tree against flat, the whole step
  and one GDN layer (the package's ``ContextParallelGatedDeltaNet`` on random rows) alone. The
  GDN state exchange's share of the layer is n/a at CP 1 (no all-to-all runs): the table says
  so and gives the GDN layer's tree and flat times instead.
* **balance** (host only, at the real batch sizes even with ``--tiny``): ``plan_balance`` of the
  default ``tree_plan`` against ``ContextParallelPlan.contiguous`` at CP 2, 4, 8: max / mean of
  the attention work (keys seen) and of the tokens per rank.

``--tiny`` shrinks everything to run in seconds on a CPU (the dense attention path then stands in
for the fused one and the floor is torch's default SDPA: the numbers mean nothing, the script
is exercised). Writes ``bench_tree.json`` and ``bench_tree.md`` to ``--out``. A section that
raises is recorded (``errors`` in the JSON, a Notes list in the tables), the others still run,
and the script exits 1. With Triton < 3.7.1 on Hopper, fla refuses its gated backward: the GDN
rows then say so unless ``--lift-fla-hopper-guard`` is given (times only, as ``bench_gdn.py``).

Usage: python benchmarks/models/bench_tree.py [--reps 5] [--out DIR]
       python benchmarks/models/bench_tree.py --tiny --out DIR          # CPU smoke
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import socket
import sys
import time
import traceback
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

import torch

_ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(_ROOT))
sys.path.insert(0, str(_ROOT / "benchmarks"))  # timing and floor, the shared helpers

from floor import causal_sdpa_calls, tree_visible_pairs  # noqa: E402
from timing import GiB, extra_peak_bytes, time_round_robin  # noqa: E402

from megatron.context_parallel import (  # noqa: E402
    ContextParallelPlan,
    PrefixTree,
    plan_balance,
    tree_plan,
)

GRPO_BATCHES = "4096+8x1024,16384+16x512"
TINY_BATCHES = "24+4x8,40+6x5"
TIME_SLACK = 1.15  # the targets' factor over the ideal
NOISE_FACTOR = 2.0  # tree-vs-flat log-prob difference allowed over the flat-vs-flat one
FIELD = "target_logprobs"


# --- batches ---------------------------------------------------------------------------------


@dataclass
class Batch:
    """One GRPO group: a prompt and ``group`` completions of ``completion`` tokens each."""

    prompt: int
    group: int
    completion: int
    ids: torch.Tensor  # int64 [prompt + group * completion], the tree's packed order (CPU)

    @property
    def name(self) -> str:
        return f"{self.prompt}+{self.group}x{self.completion}"

    @property
    def tree(self) -> PrefixTree:
        return grpo_tree(self.prompt, self.group, self.completion)

    @property
    def sample_len(self) -> int:
        return self.prompt + self.completion

    def sample(self, i: int) -> torch.Tensor:
        """Sample ``i`` as flat packing has it: the prompt, then completion ``i``."""
        start = self.prompt + i * self.completion
        return torch.cat([self.ids[: self.prompt], self.ids[start : start + self.completion]])


def parse_batches(text: str) -> List[Tuple[int, int, int]]:
    """``"P+GxC,..."`` -> ``[(P, G, C), ...]``."""
    out = []
    for item in text.split(","):
        prompt, rest = item.strip().split("+")
        group, completion = rest.split("x")
        out.append((int(prompt), int(group), int(completion)))
    return out


def grpo_tree(prompt: int, group: int, completion: int) -> PrefixTree:
    """The prompt as a root segment, each completion a child of it."""
    return PrefixTree(parents=[-1] + [0] * group, lengths=[prompt] + [completion] * group)


def make_batch(prompt: int, group: int, completion: int, vocab: int, seed: int) -> Batch:
    g = torch.Generator().manual_seed(seed + prompt + 7 * group + 13 * completion)
    ids = torch.randint(0, vocab, (prompt + group * completion,), generator=g)
    return Batch(prompt, group, completion, ids)


def pack_greedy(order: Sequence[int], length: int, cap: int) -> List[List[int]]:
    """Samples (all ``length`` tokens) in ``order``, whole, into micro-batches of <= ``cap``."""
    per = max(1, cap // length)
    return [list(order[i : i + per]) for i in range(0, len(order), per)]


@dataclass
class MicroBatch:
    samples: List[int]
    ids: torch.Tensor
    labels: torch.Tensor
    cu: List[int]


def flat_micro_batches(batch: Batch, packing: List[List[int]], device) -> List[MicroBatch]:
    out = []
    for samples in packing:
        pieces = [batch.sample(i) for i in samples]
        ids = torch.cat(pieces)
        labels = torch.full_like(ids, -100)
        cu = [0]
        for piece in pieces:
            a = cu[-1]
            labels[a : a + piece.numel() - 1] = piece[1:]
            cu.append(a + piece.numel())
        out.append(MicroBatch(samples, ids.to(device), labels.to(device), cu))
    return out


# --- steps -----------------------------------------------------------------------------------


def tree_logprobs(model, batch: Batch, ids, labels, tree) -> List[torch.Tensor]:
    """Per completion, fp32 ``[C]``: its tokens' log-probs through ``out.samples()``."""
    from megatron.context_parallel.models.forward import context_parallel_forward

    out = context_parallel_forward(model, ids, labels, tree=tree, fields=FIELD)
    start = batch.prompt - 1
    return [s.target_logprobs[start : start + batch.completion] for s in out.samples()]


def flat_logprobs(model, batch: Batch, mb: MicroBatch) -> Dict[int, torch.Tensor]:
    """Per sample of the micro-batch: its completion tokens' log-probs."""
    from megatron.context_parallel.models.forward import context_parallel_forward

    out = context_parallel_forward(model, mb.ids, mb.labels, cu_seqlens=mb.cu, fields=FIELD)
    lp = out.target_logprobs
    result = {}
    for j, i in enumerate(mb.samples):
        start = mb.cu[j] + batch.prompt - 1
        result[i] = lp[start : start + batch.completion]
    return result


class Steps:
    """The tree step and the flat step (all micro-batches) of one batch on one model."""

    def __init__(self, model, batch: Batch, flat: List[MicroBatch], device):
        self.model, self.batch, self.flat = model, batch, flat
        self.tree = batch.tree
        self.ids = batch.ids.to(device)
        self.labels = self.tree.labels(self.ids)

    def zero_grads(self):
        for p in self.model.parameters():
            p.grad = None

    def tree_step(self):
        lps = tree_logprobs(self.model, self.batch, self.ids, self.labels, self.tree)
        torch.cat(lps).sum().backward()

    def flat_step(self):
        for mb in self.flat:
            lps = flat_logprobs(self.model, self.batch, mb)
            torch.cat(list(lps.values())).sum().backward()

    def tree_values(self) -> List[torch.Tensor]:
        with torch.no_grad():
            lps = tree_logprobs(self.model, self.batch, self.ids, self.labels, self.tree)
        return [lp.float().cpu() for lp in lps]

    def flat_values(self, micro_batches: List[MicroBatch], ulp: bool = False) -> List[torch.Tensor]:
        """Per sample, its completion log-probs; with ``ulp`` the embedding output of every
        micro-batch has a random half of its elements one floating-point step larger."""
        got: Dict[int, torch.Tensor] = {}
        hook = self.model.embedding.register_forward_hook(_one_step) if ulp else None
        try:
            with torch.no_grad():
                for mb in micro_batches:
                    got.update(flat_logprobs(self.model, self.batch, mb))
        finally:
            if hook is not None:
                hook.remove()
        return [got[i].float().cpu() for i in range(self.batch.group)]


def _one_step(module, inputs, output):
    """Forward hook: a seeded random half of the elements one step (ulp) larger in magnitude,
    the size of one rounding difference."""
    bits = {2: torch.int16, 4: torch.int32, 8: torch.int64}[output.element_size()]
    g = torch.Generator(device=output.device).manual_seed(0)
    step = torch.randint(0, 2, output.shape, generator=g, device=output.device, dtype=bits)
    return (output.contiguous().view(bits) + step).view(output.dtype)


def diff(a: List[torch.Tensor], b: List[torch.Tensor]) -> Tuple[float, float]:
    d = (torch.cat(a) - torch.cat(b)).abs()
    return float(d.max()), float(d.mean())


def peak_gib(fn, device, before) -> Optional[float]:
    before()
    peak = extra_peak_bytes(fn, device)
    return None if peak is None else peak / GiB


def compare_packings(label, model, batch, args, device) -> Tuple[List[dict], dict]:
    """Model rows (tree, flat) of one batch and its log-prob comparison."""
    tree = batch.tree
    cap = args.flat_tokens or max(tree.seq_len, batch.sample_len)
    packing = pack_greedy(range(batch.group), batch.sample_len, cap)
    flat = flat_micro_batches(batch, packing, device)
    steps = Steps(model, batch, flat, device)
    # The noise scale: another flat packing, samples reversed, one more per micro-batch.
    per = max(len(p) for p in packing) + 1
    other = pack_greedy(
        list(reversed(range(batch.group))), batch.sample_len, per * batch.sample_len
    )
    values = {
        "tree": steps.tree_values(),
        "flat": steps.flat_values(flat),
        "flat repacked": steps.flat_values(flat_micro_batches(batch, other, device)),
        "flat one step": steps.flat_values(flat, ulp=True),
    }
    times = time_round_robin(
        {"tree": steps.tree_step, "flat": steps.flat_step},
        device,
        args.reps,
        args.warmup,
        before=steps.zero_grads,
    )
    peaks = {
        "tree": peak_gib(steps.tree_step, device, steps.zero_grads),
        "flat": peak_gib(steps.flat_step, device, steps.zero_grads),
    }
    steps.zero_grads()
    tokens = {"tree": tree.seq_len, "flat": sum(mb.ids.numel() for mb in flat)}
    token_ratio = tokens["tree"] / tokens["flat"]
    rows = [
        {
            "model": label,
            "batch": batch.name,
            "packing": "flat",
            "micro-batches": len(flat),
            "samples per micro-batch": ",".join(str(len(p)) for p in packing),
            "tokens": tokens["flat"],
            "fwd+bwd ms": times["flat"],
            "peak GiB": peaks["flat"],
        },
        {
            "model": label,
            "batch": batch.name,
            "packing": "tree",
            "micro-batches": 1,
            "samples per micro-batch": str(batch.group),
            "tokens": tokens["tree"],
            "fwd+bwd ms": times["tree"],
            "peak GiB": peaks["tree"],
            "tokens / flat": token_ratio,
            "time / flat": times["tree"] / times["flat"],
            "target time / flat": TIME_SLACK * token_ratio,
            "peak / flat": (
                peaks["tree"] / peaks["flat"] if peaks["tree"] and peaks["flat"] else None
            ),
        },
    ]
    rows[1]["pass"] = rows[1]["time / flat"] <= rows[1]["target time / flat"]
    tree_max, tree_mean = diff(values["tree"], values["flat"])
    repacked_max, repacked_mean = diff(values["flat repacked"], values["flat"])
    step_max, step_mean = diff(values["flat one step"], values["flat"])
    noise = max(repacked_max, step_max)
    logprobs = {
        "model": label,
        "batch": batch.name,
        "completion tokens": batch.group * batch.completion,
        "tree vs flat max": tree_max,
        "tree vs flat mean": tree_mean,
        "flat vs flat repacked max": repacked_max,
        "flat vs flat repacked mean": repacked_mean,
        "repacked samples per micro-batch": ",".join(str(len(p)) for p in other),
        "flat vs flat one-step embedding max": step_max,
        "flat vs flat one-step embedding mean": step_mean,
        "noise max": noise,
        "tree max / noise max": tree_max / noise if noise else None,
        "target": f"tree max <= {NOISE_FACTOR:g} x noise max",
        "pass": tree_max <= NOISE_FACTOR * noise,
    }
    if repacked_max == 0.0:
        logprobs["note"] = (
            "the two flat packings gave bit-identical log-probs (the kernels' results do not "
            "depend on the packing), so the noise scale is the one-step embedding perturbation"
        )
    return rows, logprobs


# --- models ----------------------------------------------------------------------------------


def init_single_rank(device: torch.device) -> None:
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import random as mrandom

    if not dist.is_initialized():
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(port))
        backend = "nccl" if device.type == "cuda" else "gloo"
        dist.init_process_group(backend, rank=0, world_size=1)
    if not ps.model_parallel_is_initialized():
        ps.initialize_model_parallel()
    if device.type == "cuda":
        mrandom.model_parallel_cuda_manual_seed(0)
    else:
        mrandom.initialize_rng_tracker(inference_rng_tracker=True, force_reset=True)


def model_config(args, device: torch.device, num_layers: int):
    from megatron.core.transformer.transformer_config import TransformerConfig

    dtype = getattr(torch, args.dtype)
    return TransformerConfig(
        num_layers=num_layers,
        hidden_size=args.hidden,
        ffn_hidden_size=args.ffn,
        num_attention_heads=args.heads,
        num_query_groups=args.groups,
        kv_channels=args.head_dim,
        gated_linear_unit=True,
        activation_func=torch.nn.functional.silu,
        normalization="RMSNorm",
        add_bias_linear=False,
        attention_dropout=0.0,
        hidden_dropout=0.0,
        bf16=dtype == torch.bfloat16,
        params_dtype=dtype,
        use_cpu_initialization=device.type != "cuda",
        bias_dropout_fusion=False,
        apply_rope_fusion=False,
        gradient_accumulation_fusion=False,
        masked_softmax_fusion=False,
    )


def build_gpt(args, device: torch.device, max_len: int):
    from megatron.core.models.gpt.gpt_model import GPTModel

    from megatron.context_parallel import get_gpt_layer_with_context_parallel_spec

    torch.manual_seed(args.seed)
    model = GPTModel(
        model_config(args, device, args.layers),
        get_gpt_layer_with_context_parallel_spec(normalization="RMSNorm"),
        vocab_size=args.vocab,
        max_sequence_length=max_len,
        position_embedding_type="rope",
    )
    return model.to(device)


def build_hybrid(args, device: torch.device, max_len: int):
    from megatron.core.models.hybrid.hybrid_model import HybridModel

    from megatron.context_parallel.models.hybrid import get_hybrid_stack_with_context_parallel_spec

    config = model_config(args, device, len(args.hybrid_pattern))
    config.is_hybrid_model = True
    config.linear_num_key_heads = args.gdn_key_heads
    config.linear_num_value_heads = args.gdn_value_heads
    config.linear_key_head_dim = args.gdn_head_dim
    config.linear_value_head_dim = args.gdn_head_dim
    config.linear_conv_kernel_dim = args.gdn_kernel
    torch.manual_seed(args.seed)
    model = HybridModel(
        config,
        get_hybrid_stack_with_context_parallel_spec(normalization="RMSNorm"),
        vocab_size=args.vocab,
        max_sequence_length=max_len,
        hybrid_layer_pattern=args.hybrid_pattern,
        position_embedding_type="rope",
    )
    return model.to(device)


def free(device: torch.device) -> None:
    import gc

    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


# --- attention -------------------------------------------------------------------------------


def _floor_calls(length: int, args, device):
    """(fwd, fwd+bwd) of causal SDPA over one sequence of ``length`` tokens (cuDNN on CUDA)."""
    fwd, both, _, _ = causal_sdpa_calls(
        length, args.heads, args.groups, args.head_dim, getattr(torch, args.dtype), device
    )

    def fwd_only():
        with torch.no_grad():
            return fwd()

    return fwd_only, both


def _dense_tree(q, kv, tree, scale, D):
    """Tree attention as one masked SDPA (the CPU stand-in): ``[S, H, D]``."""
    positions = torch.arange(tree.seq_len, device=q.device)
    mask = tree.visible(positions, positions)
    k, v = kv[..., :D], kv[..., D:]
    out = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(0, 1)[None],
        k.transpose(0, 1)[None],
        v.transpose(0, 1)[None],
        attn_mask=mask,
        scale=scale,
        enable_gqa=True,
    )
    return out[0].transpose(0, 1)


def _reference_rows(q, kv, tree, rows, scale, D):
    """fp32 dense attention of query rows ``rows`` under the tree mask: ``[len(rows), H, D]``."""
    H, G = q.shape[1], kv.shape[1]
    positions = torch.arange(tree.seq_len, device=q.device)
    mask = tree.visible(rows, positions)
    k = kv[..., :D].float().repeat_interleave(H // G, dim=1)
    v = kv[..., D:].float().repeat_interleave(H // G, dim=1)
    scores = torch.einsum("nhd,shd->hns", q[rows].float(), k) * scale
    scores = scores.masked_fill(~mask[None], float("-inf"))
    return torch.einsum("hns,shd->nhd", torch.softmax(scores, dim=-1), v)


def attention_row(batch: Batch, args, device, mode: str) -> dict:
    from megatron.context_parallel.attention.fused import fused_attention
    from megatron.context_parallel.params import ContextParallelParams

    tree = batch.tree
    S, H, G, D = tree.seq_len, args.heads, args.groups, args.head_dim
    dtype = getattr(torch, args.dtype)
    scale = D**-0.5
    g = torch.Generator(device=device).manual_seed(S)
    q = torch.randn(S, H, D, device=device, generator=g).to(dtype)
    kv = torch.randn(S, G, 2 * D, device=device, generator=g).to(dtype)
    do = torch.randn_like(q)
    row = {"batch": batch.name, "S": S, "attention": mode}
    if mode == "fused":
        plan = ContextParallelPlan.contiguous(S, 1)
        start = time.perf_counter()
        params = ContextParallelParams.for_plan(plan, None, device=device, tree=tree)
        runs = params.runs
        runs.on(device)
        row["tables ms (host, once)"] = (time.perf_counter() - start) * 1e3
        row["tables"] = type(runs).__name__

        kernel = None
        if args.bottom_right:
            from megatron.context_parallel.attention import cudnn

            kernel = cudnn.CudnnKernel(cudnn.CudnnOptions(square_top_left=False))
            row["diagonal"] = "bottom-right on every causal call"

        def attend(qq, kk):
            return fused_attention(qq, kk, runs, scale, kernel=kernel)

    else:

        def attend(qq, kk):
            return _dense_tree(qq, kk, tree, scale, D)

    def fwd():
        with torch.no_grad():
            return attend(q, kv)

    def both():
        qq, kk = q.detach().requires_grad_(), kv.detach().requires_grad_()
        attend(qq, kk).backward(do)

    length = args.floor_len or S
    floor_fwd, floor_both = _floor_calls(length, args, device)
    t = time_round_robin(
        {
            "tree fwd": fwd,
            "tree fwd+bwd": both,
            "floor fwd": floor_fwd,
            "floor fwd+bwd": floor_both,
        },
        device,
        args.reps,
        args.warmup,
    )
    pairs = tree_visible_pairs(tree)
    share = pairs / (length * (length + 1) / 2)
    floor_f, floor_b = t["floor fwd"] * share, t["floor fwd+bwd"] * share
    # A slice of rows: the prompt's last ones and the first and last completions' rows.
    picks = [batch.prompt - 1, batch.prompt, tree.seq_len - 1]
    picks += list(range(0, batch.prompt, max(1, batch.prompt // 32)))
    picks += list(range(batch.prompt, tree.seq_len, max(1, (tree.seq_len - batch.prompt) // 96)))
    rows = torch.tensor(sorted(set(picks)), device=device)
    got = fwd()[rows].float()
    err = float((got - _reference_rows(q, kv, tree, rows, scale, D)).abs().max())
    row.update(
        {
            "visible pairs": pairs,
            "floor L": length,
            "pairs / floor's L(L+1)/2": share,
            "floor fwd ms (scaled)": floor_f,
            "floor fwd+bwd ms (scaled)": floor_b,
            "tree fwd ms": t["tree fwd"],
            "tree fwd+bwd ms": t["tree fwd+bwd"],
            "fwd x floor": t["tree fwd"] / floor_f,
            "fwd+bwd x floor": t["tree fwd+bwd"] / floor_b,
            "target x floor": TIME_SLACK,
            "max err vs fp32": err,
            "checked rows": int(rows.numel()),
        }
    )
    row["pass"] = row["fwd x floor"] <= TIME_SLACK and row["fwd+bwd x floor"] <= TIME_SLACK
    return row


# --- GDN -------------------------------------------------------------------------------------


def gdn_layer_row(model, batch: Batch, flat: List[MicroBatch], args, device) -> dict:
    """One GDN layer (the package's mixer, projections included) on random rows: tree vs flat."""
    from megatron.context_parallel.mixers.gdn import ContextParallelGatedDeltaNet
    from megatron.context_parallel.params import ContextParallelParams

    layer = next(m for m in model.modules() if isinstance(m, ContextParallelGatedDeltaNet))
    dtype = getattr(torch, args.dtype)
    tree = batch.tree

    def case(n, **kw):
        params = ContextParallelParams.for_plan(
            ContextParallelPlan.contiguous(n, 1), None, device=device, **kw
        )
        hidden = torch.randn(n, 1, args.hidden, device=device).to(dtype).requires_grad_()
        return params, hidden

    tree_case = case(tree.seq_len, tree=tree)
    flat_cases = [case(mb.ids.numel(), cu_seqlens=mb.cu) for mb in flat]

    def run(cases, backward):
        for params, hidden in cases:
            hidden.grad = None
            out, _ = layer(hidden, None, packed_seq_params=params)
            if backward:
                out.backward(torch.ones_like(out))

    def timed(backward):
        return time_round_robin(
            {
                "tree": lambda: run([tree_case], backward),
                "flat": lambda: run(flat_cases, backward),
            },
            device,
            args.reps,
            args.warmup,
        )

    row = {"batch": batch.name, "GDN layer": type(layer).__name__}
    with torch.no_grad():
        fwd = timed(False)
    row["GDN fwd ms tree"], row["GDN fwd ms flat"] = fwd["tree"], fwd["flat"]
    try:
        both = timed(True)
        row["GDN fwd+bwd ms tree"], row["GDN fwd+bwd ms flat"] = both["tree"], both["flat"]
        row["GDN fwd+bwd tree / flat"] = both["tree"] / both["flat"]
    except RuntimeError as exc:
        if "3.7.1" not in str(exc):
            raise
        row["note"] = f"backward not timed (fla refuses it here): {str(exc)[:160]}"
    row["GDN fwd tree / flat"] = fwd["tree"] / fwd["flat"]
    row["tokens tree / flat"] = tree.seq_len / sum(mb.ids.numel() for mb in flat)
    row["state exchange share of the layer"] = "n/a at CP 1 (no all-to-all runs)"
    layer.zero_grad(set_to_none=True)
    return row


# --- balance ---------------------------------------------------------------------------------


def balance_rows(batches: Sequence[Tuple[int, int, int]], sizes: Sequence[int]) -> List[dict]:
    rows = []
    for prompt, group, completion in batches:
        tree = grpo_tree(prompt, group, completion)
        for cp in sizes:
            for name, plan in (
                ("tree_plan", tree_plan(tree, cp)),
                ("contiguous", ContextParallelPlan.contiguous(tree.seq_len, cp)),
            ):
                b = plan_balance(tree, plan)
                rows.append(
                    {
                        "batch": f"{prompt}+{group}x{completion}",
                        "CP": cp,
                        "plan": name,
                        "work max/mean": b["work_ratio"],
                        "tokens max/mean": b["tokens_ratio"],
                        "work per rank": list(b["work"]),
                        "tokens per rank": list(b["tokens"]),
                    }
                )
    return rows


# --- output ----------------------------------------------------------------------------------


def _fmt(v) -> str:
    if v is None:
        return "-"
    if isinstance(v, bool):
        return "pass" if v else "FAIL"
    if isinstance(v, float):
        if v != 0 and (abs(v) < 1e-3 or abs(v) >= 1e5):
            return f"{v:.2e}"
        return f"{v:.3g}" if abs(v) < 100 else f"{v:.0f}"
    return str(v)


def markdown_table(rows: List[dict], cols: Sequence[str]) -> str:
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    lines += ["| " + " | ".join(_fmt(r.get(c)) for c in cols) + " |" for r in rows]
    return "\n".join(lines)


def write_outputs(results: dict, out: str) -> str:
    os.makedirs(out, exist_ok=True)
    parts = [f"# bench_tree: {results['device']} (torch {results['torch']})", ""]
    if results.get("model"):
        parts += ["## Model step, tree vs flat (CP 1)", ""]
        cols = ["model", "batch", "packing", "micro-batches", "samples per micro-batch"]
        cols += ["tokens", "fwd+bwd ms", "peak GiB", "tokens / flat", "time / flat"]
        cols += ["target time / flat", "pass", "peak / flat"]
        parts += [markdown_table(results["model"], cols), ""]
    if results.get("logprobs"):
        parts += ["## Completion log-probs: tree vs flat, against the noise of flat vs flat", ""]
        parts += [
            "Noise: the larger of flat vs flat repacked (samples reversed, one more per "
            "micro-batch) and flat vs flat with the embedding output of a random half of the "
            f"elements one floating-point step larger. Pass: tree max <= {NOISE_FACTOR:g} x noise.",
            "",
        ]
        cols = ["model", "batch", "completion tokens", "tree vs flat max", "tree vs flat mean"]
        cols += ["flat vs flat repacked max", "flat vs flat one-step embedding max"]
        cols += ["noise max", "tree max / noise max", "pass"]
        parts += [markdown_table(results["logprobs"], cols), ""]
        notes = [
            f"{r['model']} {r['batch']}: {r['note']}" for r in results["logprobs"] if "note" in r
        ]
        parts += [f"- {n}" for n in notes] + ([""] if notes else [])
    if results.get("attention"):
        parts += ["## Tree attention (one layer) against the cuDNN causal floor", ""]
        cols = ["batch", "S", "attention", "visible pairs", "floor L", "pairs / floor's L(L+1)/2"]
        cols += ["floor fwd ms (scaled)", "tree fwd ms", "fwd x floor"]
        cols += ["floor fwd+bwd ms (scaled)", "tree fwd+bwd ms", "fwd+bwd x floor"]
        cols += ["target x floor", "pass", "max err vs fp32", "tables ms (host, once)"]
        parts += [markdown_table(results["attention"], cols), ""]
    elif results.get("attention skipped"):
        parts += ["## Tree attention", "", results["attention skipped"], ""]
    if results.get("gdn"):
        parts += [f"## GDN hybrid `{results['hybrid pattern']}`, tree vs flat (CP 1)", ""]
        cols = ["batch", "GDN fwd+bwd ms tree", "GDN fwd+bwd ms flat", "GDN fwd+bwd tree / flat"]
        cols += ["GDN fwd ms tree", "GDN fwd ms flat", "GDN fwd tree / flat"]
        cols += ["tokens tree / flat", "state exchange share of the layer"]
        parts += [markdown_table(results["gdn"], cols), ""]
        notes = [f"{r['batch']}: {r['note']}" for r in results["gdn"] if "note" in r]
        parts += [f"- {n}" for n in notes] + ([""] if notes else [])
    if results.get("notes") or results.get("errors"):
        parts += ["## Notes", ""]
        parts += [f"- {n}" for n in results.get("notes", [])]
        parts += [f"- ERROR {e}" for e in results.get("errors", [])] + [""]
    parts += ["## Balance of the default tree_plan against contiguous blocks (host)", ""]
    parts += [
        markdown_table(
            results["balance"], ["batch", "CP", "plan", "work max/mean", "tokens max/mean"]
        ),
        "",
    ]
    text = "\n".join(parts)
    with open(os.path.join(out, "bench_tree.md"), "w") as f:
        f.write(text)
    with open(os.path.join(out, "bench_tree.json"), "w") as f:
        json.dump(results, f, indent=1, default=str)
    return text


# --- main ------------------------------------------------------------------------------------


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tiny", action="store_true", help="tiny sizes on the CPU (a smoke run)")
    p.add_argument("--device", default=None, help="default: cuda if available (cpu with --tiny)")
    p.add_argument("--batches", default=None, help=f"P+GxC,... (default {GRPO_BATCHES})")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=5120)
    p.add_argument("--ffn", type=int, default=17408)
    p.add_argument("--heads", type=int, default=40)
    p.add_argument("--groups", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--vocab", type=int, default=151936)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--reps", type=int, default=5, help="timed rounds (median)")
    p.add_argument("--warmup", type=int, default=1, help="untimed rounds first")
    p.add_argument(
        "--flat-tokens",
        type=int,
        default=0,
        help="token budget of a flat micro-batch (default: the tree's tokens, or one sample)",
    )
    p.add_argument(
        "--attention",
        choices=("auto", "fused", "dense", "skip"),
        default="auto",
        help="the attention row: fused tree tables (auto on CUDA), dense masked SDPA (auto on "
        "CPU), or skip",
    )
    p.add_argument("--floor-len", type=int, default=0, help="floor's sequence (default: S)")
    p.add_argument(
        "--bottom-right",
        action="store_true",
        help="the attention row with CudnnOptions(square_top_left=False): calls of square "
        "causal entries (the tree's own part at CP 1) keep the diagonal bottom-right, the same "
        "mask, whose backward skips no masked tile",
    )
    p.add_argument("--no-model", action="store_true", help="skip the GPTModel rows")
    p.add_argument("--no-hybrid", action="store_true", help="skip the GDN hybrid rows")
    p.add_argument("--hybrid-pattern", default="G-G-G-*-")
    p.add_argument("--gdn-key-heads", type=int, default=16)
    p.add_argument("--gdn-value-heads", type=int, default=48)
    p.add_argument("--gdn-head-dim", type=int, default=128)
    p.add_argument("--gdn-kernel", type=int, default=4)
    p.add_argument(
        "--lift-fla-hopper-guard",
        action="store_true",
        help="time fla's gated backward on Hopper with Triton < 3.7.1 (fla issue 640: wrong "
        "results there; for timing only, as bench_gdn.py)",
    )
    p.add_argument("--balance-cp", default="2,4,8")
    p.add_argument("--balance-batches", default=GRPO_BATCHES, help="host only, any size")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--out", default=os.environ.get("OUT", "."))
    args = p.parse_args(argv)
    if args.tiny:
        tiny = dict(
            layers=2, hidden=64, ffn=128, heads=4, groups=2, head_dim=16, vocab=256, reps=1,
            warmup=0, hybrid_pattern="G-*-", gdn_key_heads=2, gdn_value_heads=4, gdn_head_dim=8,
        )  # fmt: skip
        defaults = p.parse_args([])
        for key, value in tiny.items():
            if getattr(args, key) == getattr(defaults, key):
                setattr(args, key, value)
        args.batches = args.batches or TINY_BATCHES
        args.device = args.device or "cpu"
    args.batches = args.batches or GRPO_BATCHES
    args.device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    return args


def _print_row(row: dict) -> None:
    print(json.dumps({k: _fmt(v) for k, v in row.items()}), flush=True)


def _attempt(results: dict, what: str, fn) -> bool:
    """Runs ``fn()``; on an exception records it under ``results["errors"]`` (the other rows
    still run and the tables are still written; the script then exits 1). fla's refusal of its
    gated backward on Hopper is recorded as a note instead (``--lift-fla-hopper-guard``)."""
    try:
        fn()
        return True
    except Exception as exc:  # noqa: BLE001 - report, go on, exit non-zero at the end
        text = f"{what}: {type(exc).__name__}: {str(exc)[:400]}"
        if "3.7.1" in str(exc):
            results["notes"].append(text + " (rerun with --lift-fla-hopper-guard to time it)")
        else:
            results["errors"].append(text)
            traceback.print_exc()
        print(text, flush=True)
        return False


def model_rows(results: dict, label: str, build, batches: List[Batch], args, device) -> None:
    """The model's tree and flat rows for every batch (and its GDN layer's, for the hybrid)."""
    max_len = max(max(b.sample_len, b.tree.seq_len) for b in batches)
    held: dict = {}
    if not _attempt(results, f"build {label}", lambda: held.update(m=build(args, device, max_len))):
        return
    model = held.pop("m")
    for batch in batches:

        def packings(batch=batch):
            rows, lp = compare_packings(label, model, batch, args, device)
            results["model"].extend(rows)
            results["logprobs"].append(lp)
            for row in rows + [lp]:
                _print_row(row)

        def gdn(batch=batch):
            cap = args.flat_tokens or max(batch.tree.seq_len, batch.sample_len)
            packing = pack_greedy(range(batch.group), batch.sample_len, cap)
            flat = flat_micro_batches(batch, packing, device)
            row = gdn_layer_row(model, batch, flat, args, device)
            results["gdn"].append(row)
            _print_row(row)

        # The GDN layer alone first: its row is the hybrid's point, and it is the shorter run
        # (the whole hybrid step compiles fla's tree variants, with initial states, on first use).
        if build is build_hybrid:
            _timed(results, f"GDN layer {batch.name}", gdn)
            free(device)
        _timed(results, f"{label} {batch.name}", packings)
        free(device)


def _timed(results: dict, name: str, fn) -> bool:
    """``_attempt`` with the section's wall time printed (a device call's limit cuts sections)."""
    start = time.perf_counter()
    done = _attempt(results, name, fn)
    print(f"[{name}: {time.perf_counter() - start:.1f} s]", flush=True)
    return done


def main(argv=None) -> dict:
    args = parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda":
        device = torch.device("cuda", torch.cuda.current_device())
    shapes = parse_batches(args.batches)
    batches = [make_batch(*s, args.vocab, args.seed) for s in shapes]
    results = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "args": vars(args),
        "model": [],
        "logprobs": [],
        "attention": [],
        "gdn": [],
        "notes": [],
        "errors": [],
    }
    started = time.perf_counter()
    sizes = [int(c) for c in args.balance_cp.split(",") if c]
    results["balance"] = balance_rows(parse_batches(args.balance_batches), sizes)
    print(f"balance: {len(results['balance'])} rows", flush=True)

    mode = args.attention
    if mode == "auto":
        mode = "fused" if device.type == "cuda" else "dense"
    if mode == "skip":
        results["attention skipped"] = "attention row skipped (--attention skip)"
    for batch in batches if mode != "skip" else ():

        def attention(batch=batch):
            row = attention_row(batch, args, device, mode)
            results["attention"].append(row)
            _print_row(row)

        _attempt(results, f"attention {batch.name}", attention)
        free(device)

    if not args.no_model or not args.no_hybrid:
        init_single_rank(device)
    models = [] if args.no_model else [("GPT", build_gpt)]
    if not args.no_hybrid:
        models.append((f"hybrid {args.hybrid_pattern}", build_hybrid))
        results["hybrid pattern"] = args.hybrid_pattern
        results["fla hopper guard lifted"] = bool(args.lift_fla_hopper_guard)
        if args.lift_fla_hopper_guard:
            import fla.ops.common.chunk_o as chunk_o

            chunk_o.TRITON_ABOVE_3_7_1 = True
            results["notes"].append(
                "fla's Hopper guard lifted (--lift-fla-hopper-guard): its gated backward may "
                "compute wrong values with this Triton (fla issue 640); GDN backward times only"
            )
    for label, build in models:
        model_rows(results, label, build, batches, args, device)
        free(device)  # the model went with model_rows' frame
    results["seconds"] = time.perf_counter() - started
    print(write_outputs(results, args.out))
    if results["errors"]:
        print(f"{len(results['errors'])} section(s) failed:", *results["errors"], sep="\n")
    return results


if __name__ == "__main__":
    sys.exit(1 if main()["errors"] else 0)
