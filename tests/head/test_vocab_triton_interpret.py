"""The Triton kernels' logic on CPU, through Triton's interpreter (TRITON_INTERPRET=1).

Runs in a subprocess (the interpreter is chosen when the kernels are defined). Tiny tiles and
shapes, fp16 and fp32 only (the interpreter's bf16 dot is wrong in Triton 3.8); several
vocabulary splits, ties, both top-k selection modes (all elements, or grouped candidates with
one or two passes per tile, and the rows that need it selected again), promoted accumulation,
backward slices walked by fewer programs than tiles, each against the module's torch path.
The scripts shrink the measured, not user-settable, entries of the configuration (launch
groups, passes, column groups) through ``vocab_ops.kernel_config_scope``, entered for the rest of
the script (``tune``).
"""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

import pytest

pytest.importorskip("triton")

_ROOT = pathlib.Path(__file__).resolve().parents[2]

_SCRIPT = r"""
import contextlib

import torch
from _vocab_watch import reselected_rows
from megatron.context_parallel.head import vocab_ops as vo

_scopes = contextlib.ExitStack()


def tune(name, **changes):
    _scopes.enter_context(vo.kernel_config_scope(name, **changes))


for name in ("fwd", "fwd_topk", "bwd", "fp32"):
    vo.set_kernel_config(name, BM=16, BN=16, BK=16, warps=4, stages=1)
    tune(name, GROUP=2)
gen = torch.Generator().manual_seed(0)
cases = [
    # n, vocab, width, k, dtype, slots, promote
    (37, 101, 40, 5, torch.float16, 3, False),
    (37, 101, 40, 0, torch.float16, 3, False),
    (5, 33, 16, 33, torch.float32, 2, False),
    (40, 70, 48, 1, torch.float16, 5, True),
    (16, 64, 32, 0, torch.float32, 1, True),
]
for i, (n, vocab, width, k, dtype, slots, promote) in enumerate(cases):
    for name in ("fwd", "fwd_topk"):
        vo.set_kernel_config(name, promote=promote)
    # Cases 1 and 3: grouped candidates, two and one selection passes per tile.
    tune("fwd_topk", grouped=i % 2 > 0, G=4, passes=2 - (i == 3))
    h = torch.randn(n, width, generator=gen).to(dtype)
    w = (torch.randn(vocab, width, generator=gen) * 3 / width**0.5).to(dtype)
    target = torch.randint(-3, vocab + 3, (n,), generator=gen)
    ref = vo._stats_torch(h, w, target, k, 0)
    got = vo._stats_kernel(h, w, target, k, slots=slots)
    assert vo.forward_splits(n, vocab, k, slots) >= 1
    for a, b in zip(ref[:4], got[:4]):
        assert a.shape == b.shape and (a.numel() == 0 or (a - b).abs().max() < 1e-4), (a, b)
    assert torch.equal(ref[4], got[4])
    extra = torch.randint(-3, vocab + 3, (n, 2), generator=gen)
    ids = torch.cat([target[:, None], ref[4], extra], 1)
    g_ids = torch.randn(ids.shape, generator=gen)
    g_s = torch.randn(n, generator=gen)
    for chunk in (0, 7, 16):
        r = vo._backward_torch(h, w, ref[0], g_s, ids, g_ids, chunk, True, True, None)
        g = vo._backward_kernel(h, w, ref[0], g_s, ids, g_ids, chunk, True, True, None)
        for a, b in zip(g, r):
            err = ((a.double() - b.double()).norm() / b.double().norm()).item()
            assert err < 2e-3, (chunk, err)

# Grouped candidates: row 0's five best columns share column group 1 of tile 2 (columns
# 33, 37, 41, 45 with G = 4 groups of a 16-wide tile) plus one elsewhere. Its top-5 is only right
# if the row is selected again over every element; count the rows that are.
vo.set_kernel_config("fwd_topk", promote=False)
tune("fwd_topk", G=4, grouped=True, passes=2)
for _ in range(2):
    h = torch.randn(37, 32, generator=gen).half()
    w = (torch.randn(301, 32, generator=gen) * 3 / 32**0.5).half()
    for c in (33, 37, 41, 45, 200):
        w[c] = (h[0] * (4 + c / 100) / 32**0.5).half()
    with reselected_rows(vo) as redone:
        got = vo._stats_kernel(h, w, None, 5, slots=3)
    ref = vo._stats_torch(h, w, None, 5, 0)
    assert sorted(got[4][0].tolist()) == [33, 37, 41, 45, 200], got[4][0]
    assert torch.equal(ref[4], got[4]) and (ref[3] - got[3]).abs().max() < 1e-4
    assert len(redone) == 1 and 1 <= redone[0] < 37, redone

# Capped passes: with one pass per tile, row 0's two best columns (33 and 34: groups 1 and 2 of
# tile 2) cannot both enter the selection in that tile; the one left over must send the row back.
tune("fwd_topk", passes=1)
for _ in range(2):
    h = torch.randn(37, 32, generator=gen).half()
    w = (torch.randn(301, 32, generator=gen) * 3 / 32**0.5).half()
    for c in (33, 34):
        w[c] = (h[0] * (4 + c / 100) / 32**0.5).half()
    with reselected_rows(vo) as redone:
        got = vo._stats_kernel(h, w, None, 5, slots=3)
    ref = vo._stats_torch(h, w, None, 5, 0)
    assert got[4][0, :2].tolist() == [34, 33], got[4][0]
    assert torch.equal(ref[4], got[4]) and (ref[3] - got[3]).abs().max() < 1e-4
    assert len(redone) == 1 and 1 <= redone[0] < 37, redone

# Exact ties: integer data, few distinct weight rows (every selection mode).
for slots, grouped in ((1, False), (3, False), (3, True), (2, True)):
    tune("fwd_topk", grouped=grouped, passes=1 + (slots == 2))
    base = torch.randint(-3, 4, (5, 16), generator=gen).float()
    w = base[torch.randint(0, 5, (70,), generator=gen)].half()
    h = torch.randint(-3, 4, (20, 16), generator=gen).half()
    got = vo._stats_kernel(h, w, None, 12, slots=slots)
    logits = h.float() @ w.float().T
    assert torch.equal(got[3], logits.topk(12, dim=1).values)
    assert torch.equal(logits.gather(1, got[4]), got[3])
    assert all(len(set(row.tolist())) == 12 for row in got[4])
# The merge of the splits' slots: ties within and across splits (ascending id comes first),
# empty slots (-inf, id -1) last, slots past k ignored, S * k not a power of two.
tv = torch.randint(-4, 4, (3, 10, 8), generator=gen).float()
ti = torch.stack([torch.randperm(1000, generator=gen)[:24] for _ in range(10)], 1)
ti = ti.view(10, 3, 8).transpose(0, 1).contiguous().int()
tv[1, 2, :] = float("-inf")
ti[1, 2, :] = -1
tv[:, :, 5:] = 100.0
vals, ids = vo.vocab_triton.merge_topk(tv, ti, 5, 1000)
flat_v = tv[:, :, :5].permute(1, 0, 2).reshape(10, 15)
flat_i = ti[:, :, :5].permute(1, 0, 2).reshape(10, 15).long()
by_id = flat_i.where(flat_i >= 0, 10**6).sort(dim=1, stable=True).indices
ref = flat_v.gather(1, by_id).sort(dim=1, descending=True, stable=True)
assert torch.equal(vals, ref.values[:, :5]), (vals, ref.values)
assert torch.equal(ids, flat_i.gather(1, by_id).gather(1, ref.indices[:, :5])), ids
# Flagged rows overwritten in place, with no host read: through logit keys for the first
# `ahead` of them and the every-element kernel over a device-counted row list for the rest (all
# of them, some, none ahead; no flagged row: nothing). The same bits as the every-element
# forward; k above the vocabulary pads with -inf and id -1. The values passed in hold the
# grouped selection's, whose k-th is a floor for the exact k-th: tight (equal to it) or loose.
tune("fwd_topk", grouped=True, passes=2)
h = torch.randint(-3, 4, (21, 32), generator=gen).half()
w = torch.randint(-3, 4, (90, 32), generator=gen).half()
for vocab, k in ((90, 12), (11, 16)):
    every = vo._stats_kernel(h, w[:vocab], None, k, slots=3, grouped=False)
    if vocab < k:
        assert torch.equal(every[4][:, vocab:], torch.full((21, k - vocab), -1))
        assert torch.all(every[3][:, vocab:] == float("-inf"))
    for flagged, slack in (([0, 4, 9, 20], 0.0), ([1, 2, 3, 4, 5, 6, 7], 30.0), ([], 0.0)):
        mask = torch.zeros(21, dtype=torch.bool)
        mask[flagged] = True
        for ahead in (0, 2, 4, 128):
            tune("fwd_topk", reselect_ahead=ahead)
            v, i = torch.zeros(21, k), torch.zeros(21, k, dtype=torch.long)
            v[:, k - 1] = every[3][:, k - 1] - slack
            before = v.clone()
            cfg = vo._config("fwd_topk", h.dtype)
            with reselected_rows(vo) as redone:
                count = vo._reselect_into(h, w[:vocab], mask, v, i, k, 3, cfg)
            assert count.dtype == torch.int32 and count.tolist() == [len(flagged)]
            assert torch.equal(v[mask], every[3][mask]) and torch.equal(i[mask], every[4][mask])
            assert torch.equal(v[~mask], before[~mask]) and not i[~mask].any()
            assert redone == ([len(flagged)] if flagged else []), (ahead, redone)
print("interpreter ok")
"""


def _interpret(script: str) -> str:
    """Runs ``script`` in a Python with TRITON_INTERPRET=1 and the tests' helpers importable;
    returns its stdout (its stderr's tail on failure)."""
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=f"{_ROOT}{os.pathsep}{_ROOT / 'tests'}")
    proc = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


def test_kernels_in_triton_interpreter():
    assert "interpreter ok" in _interpret(_SCRIPT)


# The host side of the Gluon top-k path (vocab_ops with the Gluon kernel chosen): Gluon has no
# interpreter, so the kernel is replaced by what it writes by contract, built here from torch
# logits: per unit (row block, run of column tiles) and consumer, the statistics and exact top-k
# of the tiles that consumer takes (by the parity of the tile's place in its program's
# sequence), and as the largest logit left out its (k+1)-th (+inf on rows r % 5 == 0, which
# sends them to the re-selection). The merge, the re-selection and the split model run for real.
_GLUON_HOST_SCRIPT = r"""
import contextlib

import torch
from _vocab_watch import reselected_rows
from megatron.context_parallel.head import vocab_ops as vo

_scopes = contextlib.ExitStack()


def tune(name, **changes):
    _scopes.enter_context(vo.kernel_config_scope(name, **changes))


gluon = vo.vocab_gluon
for name in ("fwd", "fwd_topk", "bwd", "fp32"):
    vo.set_kernel_config(name, BM=16, BN=16, BK=16, warps=4, stages=1)
    tune(name, GROUP=2)
tune("fwd_topk", grouped=True, passes=2)
_scopes.enter_context(gluon.tile_config_scope("topk", BM=8, BN=16, GROUP=2))
seen = {"launches": 0, "idle": 0, "splits": set()}


def kernel_by_contract(hidden, weight, target, k, part, topv, topi, splits, slots, passes=None):
    cfg = gluon.TOPK_CONFIG
    bm, bn, group = cfg["BM"], cfg["BN"], cfg["GROUP"]
    n, vocab = hidden.shape[0], weight.shape[0]
    assert part.shape == (2 * splits, 4, n) and topv.shape[:2] == (2 * splits, n)
    assert topv.shape[2] >= max(8, k) and passes == vo.current_kernel_config()["fwd_topk"]["passes"]
    logits = hidden.float() @ weight.float().T
    num_r, num_c = -(-n // bm), -(-vocab // bn)
    per = -(-num_c // splits)
    num_s = -(-num_c // per)
    units = num_r * num_s
    part.fill_(float("nan"))
    topv.fill_(float("nan"))
    for p in range(min(units, slots)):
        j0 = 0
        for u in range(p, units, min(units, slots)):
            first = u // (group * num_s) * group
            size = min(num_r - first, group)
            r, s = first + u % (group * num_s) % size, u % (group * num_s) // size
            lo, hi = s * per, min(s * per + per, num_c)
            rows = torch.arange(r * bm, min(r * bm + bm, n))
            for cid in (0, 1):
                cols = [
                    col
                    for c in range(lo, hi)
                    if (j0 + c - lo) % 2 == cid
                    for col in range(c * bn, min(c * bn + bn, vocab))
                ]
                seen["idle"] += not cols
                sub = logits[rows][:, cols]
                m = sub.amax(1) if cols else torch.full((len(rows),), float("-inf"))
                total = (sub - m[:, None]).exp().sum(1) if cols else torch.zeros(len(rows))
                pick = torch.zeros(len(rows))
                if target is not None:
                    for i, row in enumerate(rows.tolist()):
                        if target[row].item() in cols:
                            pick[i] = logits[row, target[row]]
                order = sub.sort(dim=1, descending=True, stable=True)
                vals = torch.full((len(rows), topv.shape[2]), float("-inf"))
                ids = torch.full((len(rows), topv.shape[2]), -1, dtype=torch.int32)
                w = min(k, len(cols))
                vals[:, :w] = order.values[:, :w]
                ids[:, :w] = torch.tensor(cols, dtype=torch.int32)[order.indices[:, :w]]
                left = torch.full((len(rows),), float("-inf"))
                if len(cols) > k:
                    left = order.values[:, k]
                left = torch.where(rows % 5 == 0, float("inf"), left)
                slot = 2 * s + cid
                part[slot, 0, rows], part[slot, 1, rows] = m, total
                part[slot, 2, rows], part[slot, 3, rows] = pick, left
                topv[slot, rows], topi[slot, rows] = vals, ids
            j0 += hi - lo
    seen["launches"] += 1
    seen["splits"].add(splits)


gluon.launch_topk_pingpong = kernel_by_contract
gen = torch.Generator().manual_seed(1)
# n, vocab, width, k, slots, with target; one-tile units (vocab <= 16) make consumers sit out.
cases = [
    (37, 101, 40, 5, 3, True),
    (20, 16, 32, 16, 4, True),
    (40, 9, 16, 3, 2, False),
    (8, 200, 16, 20, 8, True),
    (33, 64, 32, 1, 5, True),
]
for n, vocab, width, k, slots, with_target in cases:
    h = torch.randn(n, width, generator=gen).half()
    w = (torch.randn(vocab, width, generator=gen) * 3 / width**0.5).half()
    target = torch.randint(-3, vocab + 3, (n,), generator=gen) if with_target else None
    with reselected_rows(vo) as redone:
        got = vo._stats_kernel(h, w, target, k, slots=slots, gluon=True)
    ref = vo._stats_torch(h, w, target, k, 0)
    for a, b in zip(ref[:4], got[:4]):
        assert a.shape == b.shape and (a - b).abs().max() < 1e-4, (n, vocab, a, b)
    assert torch.equal(ref[4], got[4]), (n, vocab, ref[4], got[4])
    assert redone == [len(range(0, n, 5))], (n, vocab, redone)
assert seen["launches"] == len(cases) and seen["idle"] > 0 and max(seen["splits"]) > 1, seen
print("gluon host path ok")
"""


def test_gluon_topk_host_path_in_interpreter():
    pytest.importorskip("triton.experimental.gluon")
    assert "gluon host path ok" in _interpret(_GLUON_HOST_SCRIPT)
