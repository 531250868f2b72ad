"""context_parallel_forward on a megatron-core GPTModel: full outputs on every CP rank."""

import os

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from megatron.core import parallel_state
from megatron.core.models.gpt.gpt_model import GPTModel
from megatron.core.transformer.transformer_config import TransformerConfig

from megatron.context_parallel import (
    context_parallel_forward,
    get_gpt_layer_with_context_parallel_spec,
)


def main(rank, world):
    dist.init_process_group("gloo", rank=rank, world_size=world)
    parallel_state.initialize_model_parallel(context_parallel_size=world)
    # Dropout 0: dropout > 0 needs megatron's RNG tracker (model_parallel_cuda_manual_seed, on
    # GPUs), and the fused attention (cuDNN, GPUs) raises on attention_dropout > 0 in training.
    config = TransformerConfig(
        num_layers=2, hidden_size=64, num_attention_heads=4, context_parallel_size=world,
        use_cpu_initialization=True, attention_dropout=0.0, hidden_dropout=0.0,
    )  # fmt: skip
    torch.manual_seed(0)  # the same weights on every rank
    spec = get_gpt_layer_with_context_parallel_spec()
    model = GPTModel(config, spec, 128, 64, position_embedding_type="rope")
    ids = torch.randint(0, 128, (60,), generator=torch.Generator().manual_seed(1))
    labels = ids.roll(-1)  # next tokens, source order; -100 = no label
    labels[[19, 59]] = -100  # two packed sequences: [0, 20) and [20, 60)
    out = context_parallel_forward(
        model, ids, labels, cu_seqlens=[0, 20, 60], fields=("hidden_states", "target_logprobs")
    )
    assert out.hidden_states.shape == (60, 64)  # [S, H]: whole batch, caller order, every rank
    loss = -out.target_logprobs.sum()  # the same value on every CP rank
    loss.backward()  # each rank: its rows' share of each parameter gradient (DDP sums them)
    if rank == 0:
        print(f"forward: OK, loss {loss.item():.4f}")


if __name__ == "__main__":
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29500")
    mp.start_processes(main, args=(2,), nprocs=2, start_method="fork")  # 2 ranks, gloo
