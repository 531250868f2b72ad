"""Tree packing: a prompt encoded once for its completions, under CP, as if packed flat."""

import os

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from megatron.core import parallel_state
from megatron.core.models.gpt.gpt_model import GPTModel
from megatron.core.transformer.transformer_config import TransformerConfig

from megatron.context_parallel import (
    PrefixTree,
    context_parallel_forward,
    get_gpt_layer_with_context_parallel_spec,
)


def main(rank, world):
    dist.init_process_group("gloo", rank=rank, world_size=world)
    parallel_state.initialize_model_parallel(context_parallel_size=world)
    config = TransformerConfig(
        num_layers=2, hidden_size=64, num_attention_heads=4, context_parallel_size=world,
        use_cpu_initialization=True, attention_dropout=0.0, hidden_dropout=0.0,
    )  # fmt: skip
    torch.manual_seed(0)
    spec = get_gpt_layer_with_context_parallel_spec()
    model = GPTModel(config, spec, 128, 64, position_embedding_type="rope")
    # Segment 0: a 12-token prompt; segments 1-3: three completions, each continuing it.
    tree = PrefixTree(parents=[-1, 0, 0, 0], lengths=[12, 5, 3, 6])
    ids = torch.randint(0, 128, (tree.seq_len,), generator=torch.Generator().manual_seed(1))
    labels = tree.labels(ids)  # [S, K]: the prompt's last row predicts each completion's start
    out = context_parallel_forward(model, ids, labels, tree=tree, fields="target_logprobs")
    samples = out.samples()  # per root-to-leaf path: log-probs as flat packing gives them
    assert [s.target_logprobs.shape[0] for s in samples] == [17, 15, 18]
    torch.stack([s.target_logprobs.mean() for s in samples]).sum().backward()
    if rank == 0:
        print(f"tree: OK, {len(samples)} samples of 50 tokens in {tree.seq_len} rows")


if __name__ == "__main__":
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29500")
    mp.start_processes(main, args=(2,), nprocs=2, start_method="fork")  # 2 ranks, gloo
