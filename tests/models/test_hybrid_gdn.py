"""A Qwen3.5-style Gated DeltaNet hybrid (megatron-core's HybridModel) under CP equals CP 1.

The pattern mixes Gated DeltaNet layers (``G``, the package's ``ContextParallelGatedDeltaNet``
from ``get_hybrid_stack_with_context_parallel_spec``), gated-output attention (``*``) and MLPs
(``-``). The reference is the same HybridModel at CP 1, one packed sequence at a time, with
megatron-core's own attention and the tests' plain-torch Gated DeltaNet (``_gdn_ref``: the
convolution and the gated delta rule as loops over time) in its GDN layers, so nothing of the
package's GDN exchange or kernels is in it. The harness is ``test_model``'s and
``test_megatron_native``'s (the dense hybrid tests use the same): every output field and every
parameter gradient within 1e-5 in fp32 at CP 2, 3 and 4 for every plan kind; megatron's
schedules with DDP, and PP 2 x CP 2 stages; the bug report's probe on an uneven plan.
"""

from __future__ import annotations

import pytest
from _dist import run_distributed

import models.test_forward as test_model
import models.test_hybrid as test_hybrid
import models.test_megatron_native as native

pytest.importorskip("fla", reason="megatron-core builds GatedDeltaNet only with fla installed")

GDN = "GG*-G-"
KINDS = test_model.KINDS + ("permuted",)


def _cases(cp, seed, kinds=KINDS):
    return test_model._cases(cp, seed=seed, kinds=kinds, pattern=GDN, attention_output_gate=True)


def test_gdn_hybrid_cp2_every_plan():
    test_model._check(run_distributed(test_model._world, 2, _cases(2, 100), {}))


def test_gdn_hybrid_cp3_every_plan():
    test_model._check(run_distributed(test_model._world, 3, _cases(3, 110), {}))


def test_gdn_hybrid_cp4_every_plan():
    test_model._check(run_distributed(test_model._world, 4, _cases(4, 120), {}))


CASES = [
    native.Case("gdn-uneven-sum", plan="uneven", loss="sum", pattern="G*G-"),
    native.Case("gdn-empty-per-token", plan="empty", loss="per_token", pattern="G*G-"),
    native.Case("gdn-pp2-cp2-thd", pp=2, plan="thd", pattern="G*|-G"),
    native.Case("gdn-pp2-cp2-uneven-tied", pp=2, plan="uneven", tied=True, pattern="G-|*G"),
]


def test_gdn_hybrid_schedules_ddp_cp2_and_pp2_cp2():
    per_rank = run_distributed(native._cases_worker, 4, CASES, timeout=600)
    native._check(per_rank, [c.name for c in CASES])


def test_report_probe_on_gdn_hybrid_with_uneven_plan():
    for error in run_distributed(test_hybrid._report_probe, 4, GDN):
        assert error <= 1e-5, error
