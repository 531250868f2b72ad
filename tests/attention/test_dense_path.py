"""``ContextParallelAttention``'s dense path against megatron-core's ``DotProductAttention``:
a single-rank ``attention_mask`` that is not causal, and attention dropout.

Both modules run in one gloo rank (megatron's ``parallel_state`` on a world of 1, the CPU shims
of ``_megatron_cpu`` for megatron's own attention), fp32, on the same query / key / value:

* masks: random boolean masks (True = masked, as megatron's) broadcast over heads or one per
  head, with ``padding``, ``no_mask`` and ``causal`` mask types. A mask that ignored the given
  ``attention_mask`` (or that fell back to causal) changes the output, checked too;
* dropout: in training mode with ``attention_dropout`` 0.5, both draw their dropout mask from
  the same CPU generator state (megatron's inference RNG tracker forks as a no-op on CPU), so the
  outputs agree; the output also differs from the eval-mode output and from the output under
  another random seed, and over many draws it averages to the eval-mode output (dropout rescales
  by 1 / (1 - p)).
"""

from __future__ import annotations

import _megatron_cpu as mc
import pytest
import torch
from _dist import DistributedPool

HEADS, GROUPS, HEAD_DIM = 4, 2, 8


@pytest.fixture(scope="module")
def pool():
    made = DistributedPool(1)
    yield made
    made.close()


def _config(dropout: float):
    from megatron.core.transformer.transformer_config import TransformerConfig

    return TransformerConfig(
        num_layers=1,
        hidden_size=HEADS * HEAD_DIM,
        num_attention_heads=HEADS,
        num_query_groups=GROUPS,
        use_cpu_initialization=True,
        params_dtype=torch.float32,
        masked_softmax_fusion=False,
        attention_dropout=dropout,
        hidden_dropout=0.0,
    )


def _modules(mask_type, dropout: float):
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    from megatron.context_parallel.attention.layers import ContextParallelAttention

    config = _config(dropout)
    ours = ContextParallelAttention(config, 1, mask_type, "self")
    theirs = DotProductAttention(config, 1, mask_type, "self")
    return ours, theirs


def _qkv(sq: int, b: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(sq, b, HEADS, HEAD_DIM, generator=gen)
    k = torch.randn(sq, b, GROUPS, HEAD_DIM, generator=gen)
    v = torch.randn(sq, b, GROUPS, HEAD_DIM, generator=gen)
    return q, k, v


def _random_mask(shape, seed: int) -> torch.Tensor:
    """Bool, True = masked; every query row keeps at least one key (its own position)."""
    gen = torch.Generator().manual_seed(seed)
    masked = torch.rand(shape, generator=gen) < 0.5
    sq = shape[-1]
    eye = torch.eye(sq, dtype=torch.bool).expand(shape)
    return masked & ~eye


def _w_masks(rank, world):
    from megatron.core.transformer.enums import AttnMaskType

    mc.init_parallel()
    sq, b = 9, 2
    q, k, v = _qkv(sq, b, seed=1)
    causal = torch.triu(torch.ones(sq, sq, dtype=torch.bool), diagonal=1)
    cases = {
        "padding, mask over heads": (AttnMaskType.padding, _random_mask((b, 1, sq, sq), 2)),
        "padding, mask per head": (AttnMaskType.padding, _random_mask((b, HEADS, sq, sq), 3)),
        "no_mask type, mask given": (AttnMaskType.no_mask, _random_mask((b, 1, sq, sq), 4)),
        "causal type, other mask": (AttnMaskType.causal, _random_mask((b, 1, sq, sq), 5)),
        "padding, the causal mask": (AttnMaskType.padding, causal[None, None].expand(b, 1, -1, -1)),
    }
    out = {}
    for name, (mask_type, mask) in cases.items():
        ours, theirs = _modules(mask_type, 0.0)
        got = ours(q, k, v, mask)
        want = theirs(q, k, v, mask)
        unmasked = ours(q, k, v, None, attn_mask_type=AttnMaskType.no_mask)
        causal_out = ours(q, k, v, None, attn_mask_type=AttnMaskType.causal)
        out[name] = (
            (got - want).abs().max().item(),
            (got - unmasked).abs().max().item(),
            (got - causal_out).abs().max().item(),
            tuple(got.shape),
        )
    return out


def test_single_rank_attention_mask_matches_dot_product_attention(pool):
    (results,) = pool.run(_w_masks)
    for name, (err, vs_unmasked, vs_causal, shape) in results.items():
        assert shape == (9, 2, HEADS * HEAD_DIM), (name, shape)
        assert err < 1e-5, (name, err)
        # The mask matters: ignoring it (or taking the causal one) would be visible.
        assert vs_unmasked > 1e-2, (name, vs_unmasked)
        if name != "padding, the causal mask":
            assert vs_causal > 1e-2, (name, vs_causal)
        else:
            assert vs_causal < 1e-5, (name, vs_causal)


def _w_dropout(rank, world):
    from megatron.core.transformer.enums import AttnMaskType

    mc.init_parallel()
    sq, b, p = 11, 2, 0.5
    q, k, v = _qkv(sq, b, seed=6)
    out = {}
    for mask_type, mask in (
        (AttnMaskType.causal, None),
        (AttnMaskType.padding, _random_mask((b, 1, sq, sq), 7)),
    ):
        ours, theirs = _modules(mask_type, p)
        ours.train()
        theirs.train()
        torch.manual_seed(100)
        got = ours(q, k, v, mask)
        torch.manual_seed(100)
        want = theirs(q, k, v, mask)
        torch.manual_seed(101)
        other_seed = ours(q, k, v, mask)
        mean = torch.zeros_like(got)
        draws = 400
        for seed in range(draws):
            torch.manual_seed(1000 + seed)
            mean += ours(q, k, v, mask) / draws
        ours.eval()
        theirs.eval()
        plain = ours(q, k, v, mask)
        plain_theirs = theirs(q, k, v, mask)
        out[str(mask_type)] = dict(
            vs_megatron=(got - want).abs().max().item(),
            vs_eval=(got - plain).abs().max().item(),
            vs_other_seed=(got - other_seed).abs().max().item(),
            mean_vs_eval=(mean - plain).abs().max().item(),
            eval_vs_megatron=(plain - plain_theirs).abs().max().item(),
            scale=plain.abs().max().item(),
        )
    return out


def test_dense_path_applies_dropout_like_dot_product_attention(pool):
    (results,) = pool.run(_w_dropout)
    for name, r in results.items():
        assert r["vs_megatron"] < 1e-5, (name, r)
        assert r["eval_vs_megatron"] < 1e-5, (name, r)
        assert r["vs_eval"] > 0.1 * r["scale"], (name, r)
        assert r["vs_other_seed"] > 0.1 * r["scale"], (name, r)
        # Unbiased: 400 draws average to the eval output (a dropout without the 1 / (1 - p)
        # rescale, or a doubled one, misses by ~scale / 2).
        assert r["mean_vs_eval"] < 0.15 * r["scale"], (name, r)
