"""A plain-torch Gated DeltaNet, the tests' CP 1 reference, written apart from the package.

``gated_delta_net_sequence`` computes one sequence from its projected rows step by step: the
causal depthwise convolution as a loop over taps, fla's l2norm formula on queries and keys, the
gated delta rule as the recurrence ``M_t = a_t M_{t-1} + k_t (beta_t (v_t - k_t M_{t-1} a_t))``,
``o_t = q_t M_t / sqrt(dk)``, then the output norm per value head times ``silu(gate)``.
``PlainGatedDeltaNet`` is megatron-core's ``GatedDeltaNet`` (same parameters, same projections)
whose forward is that, for one sequence on one rank: the reference model's ``G`` layers.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F
from megatron.core.ssm.gated_delta_net import GatedDeltaNet

__all__ = ["gated_delta_net_sequence", "PlainGatedDeltaNet"]


def gated_delta_net_sequence(
    proj: torch.Tensor,
    conv_weight: torch.Tensor,
    a_log: torch.Tensor,
    dt_bias: torch.Tensor,
    norm: Callable[[torch.Tensor], torch.Tensor],
    shape: dict,
) -> torch.Tensor:
    """``[L, D]`` projected rows (q, k, v, gate, beta, alpha) of one sequence -> ``[L, V]``.

    ``conv_weight``: ``[C, K]``; ``norm``: the output norm over the last dim of ``[L, hv, dv]``;
    ``shape``: ``key_heads``, ``value_heads``, ``key_dim``, ``value_dim``, ``kernel``.
    """
    hk, hv = shape["key_heads"], shape["value_heads"]
    dk, dv, width = shape["key_dim"], shape["value_dim"], shape["kernel"]
    qk, v = hk * dk, hv * dv
    length = proj.shape[0]
    qkv, gate, beta, alpha = torch.split(proj, [2 * qk + v, v, hv, hv], dim=1)
    conv = []
    for t in range(length):
        acc = torch.zeros(qkv.shape[1], dtype=proj.dtype)
        for j in range(width):
            source = t - (width - 1) + j
            if source >= 0:
                acc = acc + conv_weight[:, j] * qkv[source]
        conv.append(F.silu(acc))
    conv = torch.stack(conv)
    q, k, val = torch.split(conv, [qk, qk, v], dim=1)
    # fla's l2norm, which megatron's GatedDeltaNet applies: x / sqrt(sum(x^2) + 1e-6).
    q, k = q.reshape(length, hk, dk), k.reshape(length, hk, dk)
    q = q / (q.pow(2).sum(-1, keepdim=True) + 1e-6).sqrt()
    k = k / (k.pow(2).sum(-1, keepdim=True) + 1e-6).sqrt()
    q = q.repeat_interleave(hv // hk, dim=1) / dk**0.5
    k = k.repeat_interleave(hv // hk, dim=1)
    val = val.reshape(length, hv, dv)
    decay = -a_log.exp() * F.softplus(alpha + dt_bias)
    beta = beta.sigmoid()
    # The recurrence in fp64: its rounding then stays far below the tolerance of the tests,
    # whatever order of operations the code under test uses.
    q, k, val, decay, beta = (x.double() for x in (q, k, val, decay, beta))
    memory = torch.zeros(hv, dk, dv, dtype=torch.float64)
    core = []
    for t in range(length):
        memory = memory * decay[t].exp()[:, None, None]
        recalled = torch.einsum("hk,hkv->hv", k[t], memory)
        delta = (val[t] - recalled) * beta[t][:, None]
        memory = memory + k[t][:, :, None] * delta[:, None, :]
        core.append(torch.einsum("hk,hkv->hv", q[t], memory))
    core = torch.stack(core).to(proj.dtype)
    gated = norm(core) * F.silu(gate.reshape(length, hv, dv))
    return gated.reshape(length, v)


class PlainGatedDeltaNet(GatedDeltaNet):
    """megatron-core's GatedDeltaNet computed by ``gated_delta_net_sequence``: one sequence,
    batch 1, CP 1 (the reference model runs one packed sequence at a time)."""

    def forward(self, hidden_states, attention_mask=None, packed_seq_params=None, **kwargs):
        assert self.cp_size == 1 and hidden_states.shape[1] == 1, hidden_states.shape
        proj, _ = self.in_proj(hidden_states)
        shape = dict(
            key_heads=self.num_key_heads,
            value_heads=self.num_value_heads,
            key_dim=self.key_head_dim,
            value_dim=self.value_head_dim,
            kernel=self.conv_kernel_dim,
        )
        mixed = gated_delta_net_sequence(
            proj[:, 0], self.conv1d.weight[:, 0], self.A_log, self.dt_bias, self.out_norm, shape
        )
        return self.out_proj(mixed.unsqueeze(1))
