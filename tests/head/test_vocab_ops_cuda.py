"""GPU tests of the vocab-parallel head ops: the Triton path against the CPU path and fp64.

Skipped without CUDA. Shapes include N not a multiple of any tile, odd V, k = 1 and k = V (the
kernel for V <= 64, the documented torch fallback above), all targets outside the shard, both
operand-loading variants (tensor descriptors and pointers), CUDA-graph capture and replay,
torch.compile and opcheck.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
from _vocab_ref import IGNORE, backward_fp64, logprobs_fp64, rel_err, shard_logprobs, stats_fp64
from _vocab_watch import reselected_rows

from megatron.context_parallel.head import vocab_ops
from megatron.context_parallel.head.vocab_ops import vocab_stats, vocab_stats_backward

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

DTYPES = (torch.bfloat16, torch.float16, torch.float32)
GRAD_TOL = {torch.bfloat16: 2e-2, torch.float16: 3e-3, torch.float32: 1e-5}


@pytest.fixture
def configure():
    """``configure(name, **changes)`` enters ``vocab_ops.kernel_config_scope`` until the test
    ends (any entry, measured ones too)."""
    with contextlib.ExitStack() as stack:
        yield lambda name, **changes: stack.enter_context(
            vocab_ops.kernel_config_scope(name, **changes)
        )


@pytest.fixture
def loading(request, configure):
    """Runs the test with the kernels loading operands through descriptors ("tma") or pointers,
    or with descriptors and the switches turned from the defaults ("alt": the Triton forward and
    d_logits kernels instead of the Gluon ones, the top-k over every element instead of grouped
    candidates; "capped": grouped top-k with one selection pass per tile instead of three;
    "triton-topk": the top-k forward through the Triton kernel, which the Gluon one replaces by
    default on Hopper). The entries are changed for the test alone (``configure``)."""
    for key in ("fwd", "fwd_topk", "bwd"):
        configure(key, tma=request.param != "pointers")
    config = vocab_ops.current_kernel_config()
    if request.param == "alt":
        for key in ("fwd", "bwd"):
            configure(key, pingpong=not config[key]["pingpong"])
        configure("fwd_topk", grouped=not config["fwd_topk"]["grouped"])
    if request.param == "triton-topk":
        configure("fwd_topk", grouped=True, pingpong=False)
    if request.param == "capped":
        configure("fwd_topk", grouped=True, passes=1)
    return request.param


_HOPPER = pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9,
    reason="the Gluon kernels run on Hopper only",
)


def _inputs(n, vocab, width, dtype, seed, scale=2.0):
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, width, generator=gen).to(dtype)
    weight = (torch.randn(vocab, width, generator=gen) * scale / width**0.5).to(dtype)
    return hidden.cuda(), weight.cuda(), gen


def _poison():
    # Fill freed cache blocks with NaN so an output element nothing wrote shows up.
    blob = torch.full((64 << 20,), float("nan"), device="cuda")
    del blob


SHAPES = [
    # n, vocab, width, k
    (1, 1, 16, 1),
    (37, 101, 40, 5),
    (130, 257, 64, 1),
    (200, 999, 136, 20),
    (300, 64, 128, 64),  # k = V inside the kernel
    (77, 301, 96, 301),  # k = V > 64: torch fallback on the GPU
    (1000, 5003, 256, 20),
]


# Every shape in bf16 with descriptors; the other dtypes and the pointer loads on a few (each
# dtype and variant is a separate kernel compile).
STATS_CASES = (
    [(*s, torch.bfloat16, "tma") for s in SHAPES]
    + [
        (*SHAPES[i], dtype, mode)
        for i, dtype, mode in [
            (1, torch.float16, "tma"),
            (3, torch.float16, "tma"),
            (1, torch.float32, "tma"),
            (3, torch.float32, "tma"),
            (1, torch.bfloat16, "pointers"),
            (3, torch.bfloat16, "pointers"),
            (4, torch.bfloat16, "pointers"),
            (1, torch.bfloat16, "alt"),
            (3, torch.bfloat16, "alt"),
            (6, torch.bfloat16, "alt"),
            (3, torch.float32, "alt"),
            (1, torch.bfloat16, "capped"),
            (3, torch.bfloat16, "capped"),
            (6, torch.bfloat16, "capped"),
        ]
    ]
    + [(*s, torch.bfloat16, "triton-topk") for s in SHAPES if s[3]]
    + [(*SHAPES[3], torch.float16, "triton-topk")]
    + [
        # k = 0: on Hopper the Gluon forward (tma), else or with "alt" the Triton one.
        (n, vocab, width, 0, dtype, mode)
        for n, vocab, width, dtype, mode in [
            (1, 1, 16, torch.bfloat16, "tma"),
            (37, 101, 40, torch.bfloat16, "tma"),
            (200, 999, 136, torch.bfloat16, "tma"),
            (1000, 5003, 256, torch.bfloat16, "tma"),
            (200, 999, 136, torch.float16, "tma"),
            (200, 999, 136, torch.bfloat16, "alt"),
        ]
    ]
)


@pytest.mark.parametrize(
    "n,vocab,width,k,dtype,loading", STATS_CASES, indirect=["loading"], ids=lambda x: str(x)
)
def test_stats_against_cpu_and_fp64(n, vocab, width, k, dtype, loading):
    hidden, weight, gen = _inputs(n, vocab, width, dtype, n * 31 + vocab)
    target = torch.randint(-3, vocab + 3, (n,), generator=gen)
    target[::5] = IGNORE
    _poison()
    got = vocab_stats(hidden, weight, target.cuda(), k)
    cpu = vocab_stats(hidden.cpu(), weight.cpu(), target, k)
    ref_max, ref_sum, ref_pick, ref_values, _, logits = stats_fp64(
        hidden.cpu(), weight.cpu(), target, k
    )
    scale = logits.abs().max().clamp(min=1).item()
    tol = 3e-6 * scale * (width / 16) ** 0.5
    for name, a, b in zip(
        ("max", "target", "values"), got[:3:2] + got[3:4], (ref_max, ref_pick, ref_values)
    ):
        assert torch.isfinite(a).all(), name
        if a.numel():  # no values with k = 0
            assert (a.cpu().double() - b).abs().max().item() <= tol, name
    ours_sum = got[1].cpu().double() * torch.exp(got[0].cpu().double() - ref_max)
    assert rel_err(ours_sum, ref_sum) < 1e-5
    torch.testing.assert_close(got[2].cpu(), cpu[2], rtol=0, atol=tol)
    if k:
        ids = got[4].cpu()
        assert torch.all(got[3][:, 1:] <= got[3][:, :-1])
        at_ids = logits.gather(1, ids)
        assert (at_ids - got[3].cpu().double()).abs().max().item() <= tol
        srt = logits.sort(dim=1, descending=True).values
        if k < vocab:
            clear = ((srt[:, :k] - srt[:, 1 : k + 1]) > 1e-3).all(dim=1)
            assert torch.equal(ids[clear], logits.topk(k, dim=1).indices[clear])
        else:
            assert torch.equal(ids.sort(dim=1).values, torch.arange(vocab).expand(n, vocab))


def test_topk_exact_with_ties():
    """Duplicated weight rows and integer data give exactly tied logits: the values must still be
    the exact top-k multiset, the ids distinct and pointing at those values."""
    gen = torch.Generator().manual_seed(21)
    base = torch.randint(-3, 4, (7, 64), generator=gen).float()
    weight = base[torch.randint(0, 7, (1500,), generator=gen)].to(torch.bfloat16).cuda()
    hidden = torch.randint(-3, 4, (300, 64), generator=gen).to(torch.bfloat16).cuda()
    _, _, _, values, ids = vocab_stats(hidden, weight, None, 20)
    logits = hidden.float() @ weight.float().t()  # integers: exact in any order
    assert torch.equal(values, logits.topk(20, dim=1).values)
    assert torch.equal(logits.gather(1, ids), values)
    assert torch.all(ids.sort(dim=1).values[:, 1:] != ids.sort(dim=1).values[:, :-1])


@pytest.mark.parametrize("passes", [1, 3])
def test_grouped_topk_reselects_rows_whose_group_held_more(passes, configure):
    """Row 0's best columns all sit in one column group (columns j * 8 + 3 of the first 256-wide
    tile, with 8 groups per tile): grouped candidates offer two of them, so the row must be
    selected again over every element, and few other rows may be."""
    hidden, weight, _ = _inputs(1000, 5003, 256, torch.bfloat16, 23)
    best = [11, 19, 27, 35, 43, 51]
    for rank, col in enumerate(best):
        weight[col] = (hidden[0].float() * (0.05 - 0.001 * rank)).to(torch.bfloat16)
    configure("fwd_topk", grouped=True, G=8, passes=passes)
    with reselected_rows(vocab_ops) as redone:
        _, _, _, values, ids = vocab_stats(hidden, weight, None, 8)
    logits = hidden.double() @ weight.double().t()
    assert ids[0, :6].tolist() == best
    srt = logits.sort(dim=1, descending=True).values
    clear = ((srt[:, :8] - srt[:, 1:9]) > 1e-3).all(dim=1)
    assert torch.equal(ids[clear], logits.topk(8, dim=1).indices[clear])
    assert (logits.gather(1, ids) - values.double()).abs().max().item() < 1e-3
    assert len(redone) == 1 and redone[0] >= 1, redone
    if passes == 3:  # the default; one pass a tile leaves most rows to re-select (802 of 1000)
        assert redone[0] < 1000 // 50, redone


@pytest.mark.parametrize("loading", ["tma", "pointers", "alt"], indirect=True)
@pytest.mark.parametrize("vocab,k", [(5003, 20), (40, 64)])
def test_reselection_gives_the_every_element_bits(vocab, k, loading):
    """The flagged rows' re-selection (logit keys for the first ``ahead`` of them, the
    every-element kernel over a device-counted row list for the rest: all, some or none of them
    ahead, and a row list longer than one block) returns the every-element forward's values and
    ids bit for bit, into the flagged rows only; k above the vocabulary pads with -inf and id -1.
    """
    _check_reselection(*_inputs(300, vocab, 256, torch.bfloat16, 31 + vocab)[:2], k)


def test_reselection_gives_the_every_element_bits_fp32():
    """The same for fp32 inputs, which take their own tile (``KernelConfig.fp32``) on every path."""
    _check_reselection(*_inputs(300, 5003, 256, torch.float32, 17)[:2], 20)


def _check_reselection(hidden, weight, k):
    vocab = weight.shape[0]
    slots = vocab_ops._sm_count(hidden.device)
    every = vocab_ops._stats_kernel(hidden, weight, None, k, slots, False)
    if k > vocab:
        assert torch.all(every[4][:, vocab:] == -1)
        assert torch.all(every[3][:, vocab:] == float("-inf"))
    cfg = vocab_ops._config("fwd_topk", hidden.dtype)
    for flagged in ([0, 5, 77, 128, 299], list(range(0, 300, 2))):
        mask = torch.zeros(300, dtype=torch.bool, device="cuda")
        mask[flagged] = True
        for ahead in (0, 3, 128):
            # The grouped selection's values come in; its k-th is a floor for the exact k-th.
            values = torch.zeros(300, k, device="cuda")
            values[:, k - 1] = every[3][:, k - 1]
            ids = torch.zeros(300, k, dtype=torch.int64, device="cuda")
            count = vocab_ops._reselect_into(
                hidden, weight, mask, values, ids, k, slots, dict(cfg, reselect_ahead=ahead)
            )
            assert count.tolist() == [len(flagged)]
            diff = (values[mask] - every[3][mask]).abs().nan_to_num().max().item()
            same_i = torch.equal(ids[mask], every[4][mask])
            assert diff == 0 and same_i, (ahead, len(flagged), diff, same_i)
            assert not values[~mask][:, : k - 1].any() and not ids[~mask].any()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_logit_keys_tile_keeps_the_forward_bits(dtype):
    """The re-selection's 64-row, one-warpgroup keys tile gives the 128-row, two-warpgroup tile's
    bits (the forward's), with the operands through descriptors and through pointers."""
    from megatron.context_parallel.head import vocab_triton as _vocab_triton

    hidden, weight, _ = _inputs(100, 3001, 5120, dtype, 41)
    slots = vocab_ops._sm_count(hidden.device)
    for tma in (True, False):
        cfg = dict(vocab_ops.current_kernel_config()["fwd_topk"], tma=tma)
        width = _vocab_triton.key_columns(3001, cfg)
        got = [torch.empty(100, width, dtype=torch.int64, device="cuda") for _ in range(2)]
        keys_cfg = vocab_ops._keys_tile(cfg)
        _vocab_triton.logit_keys(
            hidden, weight, got[0], cfg, slots, use_tma=vocab_ops._use_tma(cfg, hidden, weight)
        )
        _vocab_triton.logit_keys(
            hidden, weight, got[1], keys_cfg, slots,
            use_tma=vocab_ops._use_tma(keys_cfg, hidden, weight),
        )  # fmt: skip
        assert vocab_ops._keys_tile(cfg)["BM"] == 64
        assert torch.equal(got[0], got[1]), tma


def test_promoted_accumulation_is_at_least_as_exact():
    hidden, weight, gen = _inputs(700, 4000, 1024, torch.bfloat16, 22)
    target = torch.randint(0, 4000, (700,), generator=gen).cuda()
    exact = (hidden.double() * weight[target].double()).sum(dim=1)
    plain = vocab_stats(hidden, weight, target, 5)
    plain_k0 = vocab_stats(hidden, weight, target, 0)  # the Gluon forward on Hopper
    saved = {k: vocab_ops.kernel_config(k) for k in ("fwd", "fwd_topk")}
    for key in saved:
        vocab_ops.set_kernel_config(key, promote=True)
    try:
        promoted = vocab_stats(hidden, weight, target, 5)
        # promote also wins over the configured Gluon forward (which has no such mode).
        promoted_k0 = vocab_stats(hidden, weight, target, 0)
    finally:
        for key, cfg in saved.items():
            vocab_ops.set_kernel_config(key, **cfg)
    err_plain = (plain[2].double() - exact).abs().max().item()
    err_promoted = (promoted[2].double() - exact).abs().max().item()
    assert err_promoted <= err_plain + 1e-7, (err_promoted, err_plain)
    assert torch.equal(plain[4], promoted[4]) or (plain[3] - promoted[3]).abs().max() < 1e-3
    assert torch.equal(promoted_k0[2], promoted[2])
    assert err_promoted <= (plain_k0[2].double() - exact).abs().max().item() + 1e-7


def test_all_targets_outside_and_no_target():
    hidden, weight, _ = _inputs(150, 333, 64, torch.bfloat16, 3)
    outside = torch.full((150,), IGNORE, device="cuda")
    outside[::2] = 333
    got = vocab_stats(hidden, weight, outside, 3)
    assert torch.all(got[2] == 0)
    # k = 0 (the Gluon forward on Hopper): 333 sits in the last column tile, past the shard.
    assert torch.all(vocab_stats(hidden, weight, outside, 0)[2] == 0)
    none = vocab_stats(hidden, weight, None, 3)
    for a, b in zip(got[:2] + got[3:], none[:2] + none[3:]):
        assert torch.equal(a, b)


BWD_SHAPES = [(1, 3, 16, 1), (257, 999, 72, 21), (600, 2049, 128, 6)]
BWD_CASES = [(*s, torch.bfloat16, c, "tma") for s in BWD_SHAPES for c in (None, 1, 100, 1000)] + [
    (*BWD_SHAPES[1], torch.float16, 256, "tma"),
    (*BWD_SHAPES[1], torch.float32, 256, "tma"),
    (*BWD_SHAPES[2], torch.bfloat16, 1000, "pointers"),
    (*BWD_SHAPES[1], torch.bfloat16, None, "alt"),
    (*BWD_SHAPES[2], torch.bfloat16, 1000, "alt"),
    (*BWD_SHAPES[1], torch.float16, 256, "alt"),
]


@pytest.mark.parametrize(
    "n,vocab,width,m,dtype,chunk,loading", BWD_CASES, indirect=["loading"], ids=lambda x: str(x)
)
def test_backward_against_cpu_and_fp64(n, vocab, width, m, dtype, chunk, loading):
    hidden, weight, gen = _inputs(n, vocab, width, dtype, n + vocab + m)
    row_max = vocab_stats(hidden, weight, None, 0)[0]
    g_s = torch.randn(n, generator=gen).cuda()
    ids = torch.randint(-3, vocab + 3, (n, m), generator=gen)
    if m > 1:
        ids[:, -1] = ids[:, 0]
    ids = ids.cuda()
    g_ids = torch.randn(n, m, generator=gen).cuda()
    _poison()
    gh, gw = vocab_stats_backward(hidden, weight, row_max, g_s, ids, g_ids, chunk)
    ref_h, ref_w = backward_fp64(
        hidden.cpu(), weight.cpu(), row_max.cpu(), g_s.cpu(), ids.cpu(), g_ids.cpu()
    )
    cpu_h, cpu_w = vocab_stats_backward(
        hidden.cpu(), weight.cpu(), row_max.cpu(), g_s.cpu(), ids.cpu(), g_ids.cpu(), chunk
    )
    for got, ref, cpu in ((gh, ref_h, cpu_h), (gw, ref_w, cpu_w)):
        assert torch.isfinite(got).all()
        assert rel_err(got.cpu(), ref) <= GRAD_TOL[dtype]
        # Same rule as the CPU path: within a few roundings of it.
        assert rel_err(got.cpu(), cpu.double()) <= GRAD_TOL[dtype]


def _triton_then_gluon(monkeypatch, config, launcher, run):
    """``run()`` with the Triton kernels (config ``pingpong=False``), then with the Gluon one
    (``_vocab_gluon.<launcher>``, checked to be what ran); returns both results."""
    from megatron.context_parallel.head import vocab_gluon as _vocab_gluon

    launches = []
    real = getattr(_vocab_gluon, launcher)
    monkeypatch.setattr(
        _vocab_gluon, launcher, lambda *a, **kw: launches.append(1) or real(*a, **kw)
    )
    saved = vocab_ops.kernel_config(config)
    results = []
    try:
        for pingpong in (False, True):
            vocab_ops.set_kernel_config(config, pingpong=pingpong)
            _poison()
            results.append(run())
            assert bool(launches) == pingpong
    finally:
        vocab_ops.set_kernel_config(config, **saved)
    return results


@_HOPPER
@pytest.mark.parametrize(
    "n,vocab,width,m,dtype,chunk",
    [
        (333, 2999, 136, 3, torch.bfloat16, 640),  # ragged rows, columns and slices, H % 64 != 0
        (2000, 20000, 256, 21, torch.bfloat16, 4096),  # several tiles per consumer
        (1000, 5003, 64, 2, torch.float16, None),
        (4100, 37984, 512, 1, torch.bfloat16, None),
    ],
)
def test_gluon_dlogits_gives_the_triton_kernels_bits(n, vocab, width, m, dtype, chunk, monkeypatch):
    from megatron.context_parallel.head import vocab_gluon as _vocab_gluon

    assert _vocab_gluon.builds(torch.device("cuda"), dtype, "dlogits")
    hidden, weight, gen = _inputs(n, vocab, width, dtype, n + vocab)
    row_max = vocab_stats(hidden, weight, None, 0)[0]
    g_s = torch.randn(n, generator=gen).cuda()
    ids = torch.randint(-3, vocab + 3, (n, m), generator=gen).cuda()
    g_ids = torch.randn(n, m, generator=gen).cuda()
    grads = _triton_then_gluon(
        monkeypatch,
        "bwd",
        "launch_dlogits_pingpong",
        lambda: vocab_stats_backward(hidden, weight, row_max, g_s, ids, g_ids, chunk),
    )
    for triton_grad, gluon_grad in zip(*grads):
        assert torch.equal(triton_grad, gluon_grad)


@_HOPPER
@pytest.mark.parametrize(
    "n,vocab,width,dtype,with_target",
    [
        (333, 2999, 136, torch.bfloat16, True),  # ragged rows and columns, H % 64 != 0
        (64, 130, 64, torch.bfloat16, True),  # targets past the shard's end, in its last tile
        (2000, 20000, 256, torch.bfloat16, False),  # several tiles per consumer
        (1000, 5003, 64, torch.float16, True),
        (1, 1, 16, torch.bfloat16, True),
    ],
)
def test_gluon_forward_against_the_triton_kernel(n, vocab, width, dtype, with_target, monkeypatch):
    from megatron.context_parallel.head import vocab_gluon as _vocab_gluon

    assert _vocab_gluon.builds(torch.device("cuda"), dtype, "stats")
    hidden, weight, gen = _inputs(n, vocab, width, dtype, n + vocab)
    target = torch.randint(-3, vocab + 3, (n,), generator=gen) if with_target else None
    if with_target:
        target[: min(n, 4)] = torch.tensor([vocab, vocab + 1, -1, 0])[: min(n, 4)]
        target = target.cuda()
    outs = _triton_then_gluon(
        monkeypatch, "fwd", "launch_stats_pingpong", lambda: vocab_stats(hidden, weight, target, 0)
    )
    (tri_max, tri_sum, tri_tgt, _, _), (glu_max, glu_sum, glu_tgt, _, _) = outs
    # Logits agree to a few fp32 units in the last place (the tensor cores' accumulation is not
    # IEEE and the two kernels issue different wgmma shapes: 64x256 against 64x128; equal bits
    # on most shapes, not all: H200, H = 136); sums also differ in rounding order (a running sum
    # over tiles against per-tile sums merged after).
    for gluon, triton_ in ((glu_max, tri_max), (glu_tgt, tri_tgt), (glu_sum, tri_sum)):
        torch.testing.assert_close(gluon, triton_, rtol=1e-5, atol=1e-5)


def test_backward_single_gradient_and_main_grad():
    hidden, weight, gen = _inputs(300, 700, 64, torch.bfloat16, 11)
    row_max = vocab_stats(hidden, weight, None, 0)[0]
    g_s = torch.randn(300, generator=gen).cuda()
    ids = torch.randint(0, 700, (300, 4), generator=gen).cuda()
    g_ids = torch.randn(300, 4, generator=gen).cuda()
    both = vocab_stats_backward(hidden, weight, row_max, g_s, ids, g_ids, 256)
    only_h = vocab_stats_backward(hidden, weight, row_max, g_s, ids, g_ids, 256, True, False)
    only_w = vocab_stats_backward(hidden, weight, row_max, g_s, ids, g_ids, 256, False, True)
    assert only_h[1] is None and only_w[0] is None
    assert torch.equal(only_h[0], both[0]) and torch.equal(only_w[1], both[1])
    main_grad = torch.randn(700, 64, device="cuda")
    start = main_grad.clone()
    out = vocab_stats_backward(hidden, weight, row_max, g_s, ids, g_ids, 256, main_grad=main_grad)
    assert out[1] is None
    assert rel_err(main_grad - start, both[1].double()) < 1e-2


def test_composed_head_against_fp64():
    hidden, weight, gen = _inputs(333, 1001, 96, torch.bfloat16, 12)
    labels = torch.randint(0, 1001, (333,), generator=gen)
    labels[::7] = IGNORE
    labels = labels.cuda()
    h = hidden.clone().requires_grad_(True)
    w = weight.clone().requires_grad_(True)
    target_lp, top_lp, top_ids = shard_logprobs(h, w, labels, 20, None, 300)
    ref_t, ref_top = logprobs_fp64(hidden.cpu(), weight.cpu(), labels.cpu(), top_ids.cpu())
    assert (target_lp.cpu().double() - ref_t).abs().max() < 1e-5
    assert (top_lp.cpu().double() - ref_top).abs().max() < 1e-5
    u = torch.randn(333, device="cuda")
    v = torch.randn(333, 20, device="cuda") * 0.1
    ((target_lp * u).sum() + (top_lp * v).sum()).backward()
    h64 = hidden.cpu().double().requires_grad_(True)
    w64 = weight.cpu().double().requires_grad_(True)
    t64, top64 = logprobs_fp64(h64, w64, labels.cpu(), top_ids.cpu())
    ((t64 * u.cpu().double()).sum() + (top64 * v.cpu().double()).sum()).backward()
    assert rel_err(h.grad.cpu(), h64.grad) < 1e-2
    assert rel_err(w.grad.cpu(), w64.grad) < 1e-2


@pytest.mark.parametrize("ahead", [128, 2])
def test_cuda_graph_capture_and_replay(ahead, configure):
    """The whole forward (grouped top-k and its re-selection) and backward replay from a graph
    on new data as they run eagerly: nothing was decided on the host. With ``ahead = 2`` some
    flagged rows take the row-list launch, a different set (and number) in the replayed data."""
    hidden, weight, gen = _inputs(500, 3001, 128, torch.bfloat16, 13)
    labels = torch.randint(0, 3001, (500,), generator=gen).cuda()
    # Six columns whose logits top the rows equal to `best`: they share one column group, so
    # those rows are always flagged for re-selection.
    best = hidden[0].clone()
    cols = [11, 19, 27, 35, 43, 51]
    for rank, col in enumerate(cols):
        weight[col] = (best.float() * (0.1 - 0.002 * rank)).to(torch.bfloat16)
    hidden[[0, 3, 8]] = best
    configure("fwd_topk", grouped=True, reselect_ahead=ahead)
    g_s = torch.randn(500, generator=gen).cuda()
    ids = torch.randint(0, 3001, (500, 21), generator=gen).cuda()
    g_ids = torch.randn(500, 21, generator=gen).cuda()

    def step():
        m, s, t, v, i = vocab_stats(hidden, weight, labels, 20)
        gh, gw = vocab_stats_backward(hidden, weight, m, g_s, ids, g_ids, 1000)
        return m, s, t, v, i, gh, gw

    eager = step()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        step()  # warm-up on the side stream compiles and autotunes outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = step()
    hidden.copy_(torch.randn_like(hidden))
    hidden[[1, 5, 7, 9, 400]] = best
    graph.replay()
    fresh = step()
    torch.cuda.synchronize()
    for a, b in zip(captured, fresh):
        assert torch.equal(a, b)
    assert not torch.equal(captured[0], eager[0])
    assert captured[4][[1, 5, 7, 9, 400], :6].tolist() == [cols] * 5


def test_torch_compile_and_opcheck():
    hidden, weight, gen = _inputs(65, 129, 32, torch.bfloat16, 14)
    labels = torch.randint(0, 129, (65,), generator=gen).cuda()

    def fn(h, w, t):
        m, s, tl, v, i = vocab_stats(h, w, t, 4)
        lse = m + torch.log(s)
        return tl - lse, v - lse[:, None], i

    compiled = torch.compile(fn, fullgraph=True)
    for a, b in zip(compiled(hidden, weight, labels), fn(hidden, weight, labels)):
        torch.testing.assert_close(a, b)
    row_max = vocab_stats(hidden, weight, None, 0)[0]
    g_s = torch.randn(65, device="cuda")
    ids = torch.randint(0, 129, (65, 3), device="cuda")
    g_ids = torch.randn(65, 3, device="cuda")
    ops = torch.ops.megatron_cp
    torch.library.opcheck(ops.vocab_stats.default, (hidden, weight, labels, 4, 0))
    torch.library.opcheck(
        ops.vocab_stats_backward.default,
        (hidden, weight, row_max, g_s, ids, g_ids, 64, True, True, None),
    )


@_HOPPER
@pytest.mark.parametrize(
    "n,vocab,width,k,dtype,with_target",
    [
        (333, 2999, 136, 20, torch.bfloat16, True),  # ragged rows and columns, H % 64 != 0
        (64, 130, 64, 5, torch.bfloat16, True),  # targets past the shard's end, in its last tile
        (2000, 20000, 256, 20, torch.bfloat16, False),  # several tiles per consumer and unit
        (12800, 120, 64, 20, torch.bfloat16, True),  # one-tile units: a consumer sits some out
        (1000, 5003, 64, 1, torch.float16, True),
        (100, 40, 64, 40, torch.bfloat16, True),  # k = the shard, 64 slots: one consumer idle
        (4100, 37984, 128, 20, torch.bfloat16, True),  # a TP-4 shard's width, two splits
    ],
)
def test_gluon_topk_against_the_triton_kernel(n, vocab, width, k, dtype, with_target, monkeypatch):
    from megatron.context_parallel.head import vocab_gluon as _vocab_gluon

    assert _vocab_gluon.builds(torch.device("cuda"), dtype, "topk", k)
    hidden, weight, gen = _inputs(n, vocab, width, dtype, n + vocab + k)
    target = None
    if with_target:
        target = torch.randint(-3, vocab + 3, (n,), generator=gen)
        target[: min(n, 4)] = torch.tensor([vocab, vocab + 1, -1, 0])[: min(n, 4)]
        target = target.cuda()
    outs = _triton_then_gluon(
        monkeypatch,
        "fwd_topk",
        "launch_topk_pingpong",
        lambda: vocab_stats(hidden, weight, target, k),
    )
    (t_max, t_sum, t_tgt, t_val, t_ids), (g_max, g_sum, g_tgt, g_val, g_ids) = outs
    # Each consumer sums its own tiles, merged after: rounding order differs from the Triton
    # kernel's running sum over the split.
    for gluon, triton_ in ((g_max, t_max), (g_tgt, t_tgt), (g_sum, t_sum)):
        torch.testing.assert_close(gluon, triton_, rtol=1e-5, atol=1e-5)
    # The logits agree to a few fp32 units in the last place (64x128 against 64x256 wgmma
    # products), so the exact top-k agrees wherever neighbours are clearly apart (ties to the
    # lower id; empty slots -inf with id -1).
    assert torch.equal(g_val.isinf(), t_val.isinf())
    torch.testing.assert_close(g_val, t_val, rtol=0, atol=1e-5)
    vals = t_val.cpu()
    apart = (vals[:, :-1] - vals[:, 1:]) > 1e-4
    clear = torch.ones(vals.shape, dtype=torch.bool)
    clear[:, :-1] &= apart
    clear[:, 1:] &= apart
    assert torch.equal(g_ids.cpu()[clear], t_ids.cpu()[clear])
