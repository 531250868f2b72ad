"""context_parallel_batch in megatron-core's schedules: a forward_step as on one GPU."""

import os
from functools import partial

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from megatron.core import parallel_state
from megatron.core.models.gpt.gpt_model import GPTModel
from megatron.core.pipeline_parallel import get_forward_backward_func
from megatron.core.transformer.transformer_config import TransformerConfig

from megatron.context_parallel import (
    context_parallel_batch,
    get_gpt_layer_with_context_parallel_spec,
)


def loss_func(labels, output):  # as on one GPU; output: the batch's full ForwardOutput
    valid = labels != -100
    loss_sum, num_tokens = -(output.target_logprobs * valid).sum(), valid.sum()
    return loss_sum, num_tokens.int(), {"lm loss": torch.stack([loss_sum, num_tokens]).detach()}


def forward_step(data_iterator, model):
    ids, labels, cu_seqlens = next(data_iterator)  # the whole packed batch, on every CP rank
    batch = context_parallel_batch(
        model, ids, labels, cu_seqlens=cu_seqlens, fields="target_logprobs"
    )
    return model(**batch.forward_kwargs()), batch.loss_func(partial(loss_func, labels))


def main(rank, world):
    dist.init_process_group("gloo", rank=rank, world_size=world)
    parallel_state.initialize_model_parallel(context_parallel_size=world)
    config = TransformerConfig(
        num_layers=2, hidden_size=64, num_attention_heads=4, context_parallel_size=world,
        use_cpu_initialization=True, attention_dropout=0.0, hidden_dropout=0.0,
    )  # fmt: skip
    torch.manual_seed(0)
    model = GPTModel(config, get_gpt_layer_with_context_parallel_spec(), 128, 64)
    # With DDP: config.finalize_model_grads_func = finalize_model_grads (the sum over DP x CP).
    ids = torch.randint(0, 128, (60,), generator=torch.Generator().manual_seed(1))
    labels = ids.roll(-1).index_fill(0, torch.tensor([19, 59]), -100)  # 2 packed sequences
    data = iter([(ids, labels, [0, 20, 60])] * 2)  # two micro-batches
    losses = get_forward_backward_func()(
        forward_step_func=forward_step, data_iterator=data, model=[model],
        num_microbatches=2, seq_length=60, micro_batch_size=1,
    )  # fmt: skip
    loss_sum, num_tokens = sum(x["lm loss"] for x in losses)
    if rank == 0:
        print(f"schedules: OK, loss {loss_sum / num_tokens:.4f}")


if __name__ == "__main__":
    if not torch.cuda.is_available():  # CPU only: megatron's schedule puts a counter on "cuda"
        zeros = torch.zeros
        torch.zeros = lambda *a, device=None, **k: zeros(*a, device=None, **k)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29500")
    mp.start_processes(main, args=(2,), nprocs=2, start_method="fork")  # 2 ranks, gloo
