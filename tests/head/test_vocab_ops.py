"""CPU tests of the vocab-parallel head ops (megatron_cp::vocab_stats and its backward).

Semantics against float64 references written independently (tests/_vocab_ref.py), the precision
rule of the backward at small chunk settings (gradient error at most 1.1x that of the naive bf16
computation, which the old row-chunked bf16 accumulation fails), opcheck and fake tensors.
"""

from __future__ import annotations

import pytest
import torch
from _vocab_ref import (
    IGNORE,
    backward_fp64,
    logprobs_fp64,
    naive_logprobs,
    rel_err,
    shard_logprobs,
    stats_fp64,
)
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from megatron.context_parallel.head import vocab_ops
from megatron.context_parallel.head.vocab_ops import vocab_stats, vocab_stats_backward

DTYPES = (torch.bfloat16, torch.float16, torch.float32)
# Relative error allowed for quantities computed from the inputs' logits (fp32 accumulation of
# exact products: only accumulation order separates us from float64) ...
FP32_TOL = 2e-6
# ... and for gradients, which pass through one rounding of d_logits and of the result.
GRAD_TOL = {torch.bfloat16: 2e-2, torch.float16: 3e-3, torch.float32: 1e-5}


def _inputs(n, vocab, width, dtype, seed, scale=2.0):
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, width, generator=gen).to(dtype)
    weight = (torch.randn(vocab, width, generator=gen) * scale / max(width, 1) ** 0.5).to(dtype)
    return hidden, weight, gen


def _check_stats(hidden, weight, target, k, chunk):
    row_max, sum_exp, picked, values, ids = vocab_stats(hidden, weight, target, k, chunk)
    n = hidden.shape[0]
    assert row_max.dtype == sum_exp.dtype == picked.dtype == values.dtype == torch.float32
    assert ids.dtype == torch.int64
    assert row_max.shape == sum_exp.shape == picked.shape == (n,)
    assert values.shape == ids.shape == (n, k)
    if n == 0:
        return
    ref_max, ref_sum, ref_pick, ref_values, _, logits = stats_fp64(hidden, weight, target, k)
    scale = logits.abs().amax(dim=1).clamp(min=1.0)
    torch.testing.assert_close(row_max.double(), ref_max, rtol=0, atol=FP32_TOL * scale.max())
    # sum_exp is relative to each path's own row_max: rescale ours to the reference's max.
    ours = sum_exp.double() * torch.exp(row_max.double() - ref_max)
    torch.testing.assert_close(ours, ref_sum, rtol=4 * FP32_TOL * 10, atol=0)
    torch.testing.assert_close(picked.double(), ref_pick, rtol=0, atol=FP32_TOL * scale.max())
    if target is not None:
        outside = (target < 0) | (target >= weight.shape[0])
        assert torch.all(picked[outside] == 0)
    if k:
        torch.testing.assert_close(values.double(), ref_values, rtol=0, atol=FP32_TOL * scale.max())
        assert torch.all(values[:, 1:] <= values[:, :-1])
        # Each id points at its own value, and where the values are not (nearly) tied the ids
        # are the reference's.
        at_ids = logits.gather(1, ids)
        torch.testing.assert_close(at_ids, values.double(), rtol=0, atol=FP32_TOL * scale.max())
        assert ids.unique(dim=1).shape[1] == k if n else True
        ref_sorted = logits.sort(dim=1, descending=True).values
        gap_lo = ref_sorted[:, :k] - ref_sorted[:, 1 : k + 1] if k < logits.shape[1] else None
        if gap_lo is not None:
            clear = (gap_lo > 1e-3 * scale[:, None]).all(dim=1)
            ref_ids = logits.topk(k, dim=1).indices
            assert torch.equal(ids[clear], ref_ids[clear])


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    n=st.integers(0, 37),
    vocab=st.integers(1, 45),
    width=st.integers(1, 24),
    dtype=st.sampled_from(DTYPES),
    k_mode=st.sampled_from(["zero", "one", "all", "some"]),
    target_mode=st.sampled_from(["none", "mixed", "outside"]),
    chunk=st.one_of(st.none(), st.integers(1, 50)),
    seed=st.integers(0, 2**31 - 1),
)
def test_stats_match_fp64(n, vocab, width, dtype, k_mode, target_mode, chunk, seed):
    hidden, weight, gen = _inputs(n, vocab, width, dtype, seed)
    k = {"zero": 0, "one": 1, "all": vocab, "some": (seed % vocab) + 1}[k_mode]
    if target_mode == "none":
        target = None
    elif target_mode == "mixed":
        target = torch.randint(-3, vocab + 3, (n,), generator=gen)
    else:
        target = torch.where(torch.rand(n, generator=gen) < 0.5, IGNORE, vocab + 7)
    _check_stats(hidden, weight, target, k, chunk)


def test_stats_empty_shard_rows_and_odd_chunks():
    hidden, weight, _ = _inputs(0, 9, 8, torch.bfloat16, 0)
    out = vocab_stats(hidden, weight, torch.zeros(0, dtype=torch.int64), 3, 4)
    assert [tuple(t.shape) for t in out] == [(0,), (0,), (0,), (0, 3), (0, 3)]
    hidden, weight, _ = _inputs(53, 31, 16, torch.bfloat16, 1)
    _check_stats(hidden, weight, torch.arange(53) - 11, 31, 7)


def test_chunk_size_changes_nothing_on_cpu():
    hidden, weight, gen = _inputs(29, 40, 12, torch.bfloat16, 2)
    target = torch.randint(0, 40, (29,), generator=gen)
    base = vocab_stats(hidden, weight, target, 5, None)
    for chunk in (1, 3, 28, 29, 100):
        other = vocab_stats(hidden, weight, target, 5, chunk)
        for a, b in zip(base, other):
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)


def _random_backward_args(n, vocab, m, gen, dup=True):
    row_max_src = torch.randn(n, generator=gen)
    grad_sum_exp = torch.randn(n, generator=gen)
    ids = torch.randint(-4, vocab + 4, (n, m), generator=gen)
    if dup and m >= 2 and n:
        ids[:, -1] = ids[:, 0]  # repeated ids add up
    grad_ids = torch.randn(n, m, generator=gen)
    return row_max_src, grad_sum_exp, ids, grad_ids


# Two roundings (d_logits once, the product once) of the terms' magnitudes, per dtype.
TERM_TOL = {torch.bfloat16: 2 * 2.0**-8, torch.float16: 2 * 2.0**-11, torch.float32: 1e-5}


def _term_magnitudes(hidden, weight, row_max, grad_sum_exp, ids, grad_ids):
    """fp64 ``|d_logits| @ |weight|`` and ``|d_logits|.T @ |hidden|``, ``d_logits`` by its
    definition (see ``backward_fp64``): the magnitudes of the gradient products' terms."""
    h, w = hidden.double(), weight.double()
    vocab = w.shape[0]
    d = grad_sum_exp.double()[:, None] * torch.exp(h @ w.t() - row_max.double()[:, None])
    if ids.numel():
        here = (ids >= 0) & (ids < vocab)
        picked = torch.where(here, grad_ids.double(), 0.0)
        d.scatter_add_(1, ids.clamp(0, max(vocab - 1, 0)), picked)
    return d.abs() @ w.abs(), d.abs().t() @ h.abs()


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    n=st.integers(0, 33),
    vocab=st.integers(1, 41),
    width=st.integers(1, 20),
    m=st.integers(0, 6),
    dtype=st.sampled_from(DTYPES),
    chunk=st.one_of(st.none(), st.integers(1, 45)),
    want=st.sampled_from([(True, True), (True, False), (False, True), (False, False)]),
    seed=st.integers(0, 2**31 - 1),
)
def test_backward_matches_fp64_autograd(n, vocab, width, m, dtype, chunk, want, seed):
    hidden, weight, gen = _inputs(n, vocab, width, dtype, seed)
    row_max = vocab_stats(hidden, weight, None, 0)[0]
    _, grad_sum_exp, ids, grad_ids = _random_backward_args(n, vocab, m, gen)
    gh, gw = vocab_stats_backward(
        hidden, weight, row_max, grad_sum_exp, ids, grad_ids, chunk, *want
    )
    ref_h, ref_w = backward_fp64(hidden, weight, row_max, grad_sum_exp, ids, grad_ids)
    # A once-rounded d_logits leaves an error relative to the magnitudes of each product's terms
    # (|d| @ |w|, |d|.T @ |h|), which cancellation can make far larger than the result
    # (hypothesis found n = 30, V = 1, H = 1 in bf16: 0.125 of the result). So a result within
    # GRAD_TOL of the reference passes, and so does one within a few roundings of the terms.
    scale_h, scale_w = _term_magnitudes(hidden, weight, row_max, grad_sum_exp, ids, grad_ids)
    pairs = ((gh, ref_h, scale_h, want[0], hidden), (gw, ref_w, scale_w, want[1], weight))
    for got, ref, scale, wanted, like in pairs:
        if not wanted:
            assert got is None
            continue
        assert got.dtype == like.dtype and got.shape == like.shape
        err = rel_err(got, ref)
        of_terms = (got.double() - ref).norm().item() / max(scale.norm().item(), 1e-300)
        assert err <= GRAD_TOL[dtype] or of_terms <= TERM_TOL[dtype], (err, of_terms)


def test_backward_duplicates_and_outside_ids():
    hidden, weight, _ = _inputs(4, 6, 8, torch.float32, 3)
    row_max = vocab_stats(hidden, weight, None, 0)[0]
    zero = torch.zeros(4)
    ids = torch.tensor([[2, 2, -1, 6], [0, 5, 5, 5], [-100, 9, 1, 1], [3, 3, 3, 3]])
    grads = torch.tensor(
        [[1.0, 2.0, 5.0, 7.0], [1.0, 1.0, 1.0, 1.0], [4.0, 4.0, 0.5, 0.25], [1.0] * 4]
    )
    gh, gw = vocab_stats_backward(hidden, weight, row_max, zero, ids, grads, 4)
    d = torch.zeros(4, 6, dtype=torch.float64)
    d[0, 2] = 3.0
    d[1, 0], d[1, 5] = 1.0, 3.0
    d[2, 1] = 0.75
    d[3, 3] = 4.0
    torch.testing.assert_close(gh.double(), d @ weight.double(), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(gw.double(), d.t() @ hidden.double(), rtol=1e-6, atol=1e-6)


def test_main_grad_accumulates_in_fp32():
    hidden, weight, gen = _inputs(19, 23, 16, torch.bfloat16, 4)
    row_max = vocab_stats(hidden, weight, None, 0)[0]
    _, g_s, ids, g_ids = _random_backward_args(19, 23, 3, gen)
    start = torch.randn(23, 16, generator=gen)
    main_grad = start.clone()
    gh, gw = vocab_stats_backward(
        hidden, weight, row_max, g_s, ids, g_ids, 5, True, True, main_grad=main_grad
    )
    assert gw is None and gh is not None
    _, ref_w = backward_fp64(hidden, weight, row_max, g_s, ids, g_ids)
    # Only d_logits is rounded (to bf16); the sum lands in fp32.
    assert rel_err(main_grad - start, ref_w) < 1e-2
    plain = vocab_stats_backward(hidden, weight, row_max, g_s, ids, g_ids, 5, False, True)[1]
    assert rel_err(main_grad - start, plain.double()) < 1e-2


def test_composed_logprobs_match_fp64():
    """The head's composition (one shard) against float64 log-softmax autograd."""
    hidden, weight, gen = _inputs(45, 37, 24, torch.float32, 5)
    labels = torch.randint(0, 37, (45,), generator=gen)
    labels[::7] = IGNORE
    h = hidden.clone().requires_grad_(True)
    w = weight.clone().requires_grad_(True)
    target_lp, top_lp, top_ids = shard_logprobs(h, w, labels, 4, 8, 5)
    ref_target, ref_top = logprobs_fp64(hidden, weight, labels, top_ids)
    torch.testing.assert_close(target_lp.double(), ref_target, rtol=0, atol=1e-5)
    torch.testing.assert_close(top_lp.double(), ref_top, rtol=0, atol=1e-5)
    assert torch.all(target_lp[::7] == 0)

    u = torch.randn(45, generator=gen)
    v = torch.randn(45, 4, generator=gen)
    ((target_lp * u).sum() + (top_lp * v).sum()).backward()
    h64 = hidden.double().requires_grad_(True)
    w64 = weight.double().requires_grad_(True)
    t64, top64 = logprobs_fp64(h64, w64, labels, top_ids)
    ((t64 * u.double()).sum() + (top64 * v.double()).sum()).backward()
    assert rel_err(h.grad, h64.grad) < 1e-5
    assert rel_err(w.grad, w64.grad) < 1e-5


# --- precision rule --------------------------------------------------------------------------


def _precision_case(seed=7, n=2048, vocab=1000, width=64):
    hidden, weight, gen = _inputs(n, vocab, width, torch.bfloat16, seed)
    labels = torch.randint(0, vocab, (n,), generator=gen)
    labels[::7] = IGNORE
    upstream = torch.randn(n, generator=gen)
    h64 = hidden.double().requires_grad_(True)
    w64 = weight.double().requires_grad_(True)
    (logprobs_fp64(h64, w64, labels)[0] * upstream.double()).sum().backward()
    h = hidden.clone().requires_grad_(True)
    w = weight.clone().requires_grad_(True)
    (naive_logprobs(h, w, labels) * upstream).sum().backward()
    naive = (rel_err(h.grad, h64.grad), rel_err(w.grad, w64.grad))
    return hidden, weight, labels, upstream, (h64.grad, w64.grad), naive


def _row_chunked_bf16(hidden, weight, labels, upstream, rows):
    """The old head's backward: per row chunk, ``grad_w.addmm_`` in bf16 (for the teeth test)."""
    logits = hidden.float() @ weight.float().t()
    lse = torch.logsumexp(logits, dim=1)
    vocab = weight.shape[0]
    valid = (labels >= 0) & (labels < vocab)
    g = torch.where(valid, upstream, 0.0)
    d = -g[:, None] * torch.exp(logits - lse[:, None])
    d.scatter_add_(1, labels.clamp(0, vocab - 1)[:, None], g[:, None])
    d = d.to(hidden.dtype)
    grad_w = torch.zeros_like(weight)
    for start in range(0, hidden.shape[0], rows):
        grad_w.addmm_(d[start : start + rows].t(), hidden[start : start + rows])
    return grad_w


@pytest.fixture(scope="module")
def precision_case():
    return _precision_case()


@pytest.mark.parametrize("bwd_chunk", [1, 7, 64, 333, None])
def test_gradient_precision_rule(precision_case, bwd_chunk):
    hidden, weight, labels, upstream, (ref_h, ref_w), (naive_h, naive_w) = precision_case
    h = hidden.clone().requires_grad_(True)
    w = weight.clone().requires_grad_(True)
    target_lp, _, _ = shard_logprobs(h, w, labels, 0, 64, bwd_chunk)
    (target_lp * upstream).sum().backward()
    err_h, err_w = rel_err(h.grad, ref_h), rel_err(w.grad, ref_w)
    assert err_h <= 1.1 * naive_h, (err_h, naive_h)
    assert err_w <= 1.1 * naive_w, (err_w, naive_w)


def test_precision_rule_catches_chunked_bf16_accumulation(precision_case):
    """The criterion has teeth: bf16 accumulation over 64-row chunks fails it by far."""
    hidden, weight, labels, upstream, (_, ref_w), (_, naive_w) = precision_case
    err = rel_err(_row_chunked_bf16(hidden, weight, labels, upstream, 64), ref_w)
    assert err > 1.5 * naive_w, (err, naive_w)


# --- validation, opcheck, fake tensors --------------------------------------------------------


def test_bad_inputs_raise():
    hidden, weight, _ = _inputs(4, 5, 8, torch.bfloat16, 8)
    with pytest.raises(ValueError, match="k must be"):
        vocab_stats(hidden, weight, None, 6)
    with pytest.raises(ValueError, match="weight is"):
        vocab_stats(hidden, weight.float(), None, 1)
    with pytest.raises(ValueError, match="H must match"):
        vocab_stats(hidden, weight[:, :4], None, 1)
    with pytest.raises(ValueError, match="target must be"):
        vocab_stats(hidden, weight, torch.zeros(3, dtype=torch.int64), 1)
    with pytest.raises(ValueError, match="bf16, fp16 or fp32"):
        vocab_stats(hidden.double(), weight.double(), None, 1)
    with pytest.raises(ValueError, match="chunk_size"):
        vocab_stats(hidden, weight, None, 1, 0)
    row_max = torch.zeros(4)
    with pytest.raises(ValueError, match="grad_ids must be"):
        vocab_stats_backward(
            hidden,
            weight,
            row_max,
            row_max,
            torch.zeros(4, 2, dtype=torch.int64),
            torch.zeros(4, 3),
        )
    with pytest.raises(ValueError, match="row_max must be"):
        vocab_stats_backward(
            hidden,
            weight,
            row_max.double(),
            row_max,
            torch.zeros(4, 0, dtype=torch.int64),
            torch.zeros(4, 0),
        )


def _op_args():
    hidden, weight, gen = _inputs(9, 13, 16, torch.bfloat16, 9)
    target = torch.randint(-2, 15, (9,), generator=gen)
    row_max = vocab_stats(hidden, weight, None, 0)[0]
    _, g_s, ids, g_ids = _random_backward_args(9, 13, 3, gen)
    return hidden, weight, target, row_max, g_s, ids, g_ids


def test_opcheck():
    hidden, weight, target, row_max, g_s, ids, g_ids = _op_args()
    ops = torch.ops.megatron_cp
    torch.library.opcheck(ops.vocab_stats.default, (hidden, weight, target, 3, 4))
    torch.library.opcheck(ops.vocab_stats.default, (hidden, weight, None, 0, 0))
    torch.library.opcheck(
        ops.vocab_stats_backward.default,
        (hidden, weight, row_max, g_s, ids, g_ids, 5, True, True, None),
    )
    torch.library.opcheck(
        ops.vocab_stats_backward.default,
        (hidden, weight, row_max, g_s, ids, g_ids, 0, False, True, torch.zeros(13, 16)),
    )


def test_fake_tensors_and_compile():
    from torch._subclasses.fake_tensor import FakeTensorMode

    hidden, weight, target, row_max, g_s, ids, g_ids = _op_args()
    with FakeTensorMode() as mode:
        fh, fw = mode.from_tensor(hidden), mode.from_tensor(weight)
        out = vocab_stats(fh, fw, mode.from_tensor(target), 4, 2)
        assert [tuple(t.shape) for t in out] == [(9,), (9,), (9,), (9, 4), (9, 4)]
        gh, gw = vocab_stats_backward(
            fh,
            fw,
            mode.from_tensor(row_max),
            mode.from_tensor(g_s),
            mode.from_tensor(ids),
            mode.from_tensor(g_ids),
            3,
            True,
            False,
        )
        assert tuple(gh.shape) == (9, 16) and gw is None

    def step(h, w, t):
        m, s, tl, v, i = vocab_stats(h, w, t, 2, 4)
        return tl - (m + torch.log(s)), v, i

    compiled = torch.compile(step, backend="eager", fullgraph=True)
    for a, b in zip(compiled(hidden, weight, target), step(hidden, weight, target)):
        assert torch.equal(a, b)


def test_slice_width_is_balanced_and_bounded():
    # The automatic backward slice: balanced, aligned, within the byte budget.
    width = vocab_ops._slice_width(20436, 151936, 0, 2, 256)
    assert width % 256 == 0 and width * 20436 * 2 <= vocab_ops._BWD_SLICE_BYTES
    slices = -(-151936 // width)
    assert slices * width - 151936 < 256 * slices
    assert vocab_ops._slice_width(100, 37984, 0, 2, 256) == 37984
    assert vocab_ops._slice_width(100, 50, 7, 2, 256) == 7


@pytest.fixture
def own_configs():
    """Kernel configuration changes inside the test are undone after it."""
    with vocab_ops.kernel_config_scope():
        yield


def test_fp32_inputs_take_the_fp32_tile(own_configs):
    # fp32 products run on the CUDA cores, where the tensor-core tile takes minutes to build: the
    # "fp32" entries replace the tile of every kernel for them, and only for them.
    fp32_tile = vocab_ops.current_kernel_config()["fp32"]
    for name in ("fwd", "fwd_topk", "bwd"):
        vocab_ops.set_kernel_config(name, promote=True)
        fp32 = vocab_ops._config(name, torch.float32)
        assert {key: fp32[key] for key in fp32_tile} == fp32_tile
        own = vocab_ops.current_kernel_config()[name]
        assert fp32["promote"] is True and fp32["GROUP"] == own["GROUP"]
        for dtype in (torch.bfloat16, torch.float16):
            assert vocab_ops._config(name, dtype) == own
    assert vocab_ops.kernel_config("fp32")["BN"] != vocab_ops.kernel_config("fwd")["BN"]


def test_restoring_a_saved_config_undoes_promote(own_configs):
    # A saved kernel_config copy restores with set_kernel_config, which only updates keys: every
    # settable switch must be in the copy, or it would stay on (a leaked promote=True kept the
    # Gluon kernels off in later GPU tests).
    for name in ("fwd", "fwd_topk", "bwd", "fp32"):
        saved = vocab_ops.kernel_config(name)
        assert set(saved) == set(vocab_ops._USER_KEYS[name])
        changed = {"promote": True, "pingpong": False} if name != "fp32" else {"BN": 32}
        vocab_ops.set_kernel_config(name, **changed)
        assert vocab_ops.kernel_config(name) != saved
        vocab_ops.set_kernel_config(name, **saved)
        assert vocab_ops.kernel_config(name) == saved
    assert vocab_ops.kernel_config("fwd")["promote"] is False


def test_set_kernel_config_takes_only_what_a_user_sets(own_configs):
    before = vocab_ops.current_kernel_config()
    with pytest.raises(ValueError, match="'fwd_topk' has no settable G, passes; expected"):
        vocab_ops.set_kernel_config("fwd_topk", BM=64, passes=0, G=4)
    with pytest.raises(ValueError, match="'fp32' has no settable promote"):
        vocab_ops.set_kernel_config("fp32", promote=True)
    with pytest.raises(ValueError, match="unknown kernel config 'bwd_topk'"):
        vocab_ops.set_kernel_config("bwd_topk", BM=64)
    with pytest.raises(ValueError, match="unknown kernel config 'tiles'"):
        vocab_ops.kernel_config("tiles")
    # A rejected call changes nothing.
    assert vocab_ops.current_kernel_config() is before


def test_kernel_config_scope_changes_any_entry_and_restores():
    before = vocab_ops.current_kernel_config()
    with vocab_ops.kernel_config_scope("fwd_topk", passes=1, G=4) as inside:
        assert vocab_ops.current_kernel_config() is inside
        assert inside["fwd_topk"]["passes"] == 1 and inside["fwd"] == before["fwd"]
        vocab_ops.set_kernel_config("fwd", promote=True)
        assert vocab_ops.kernel_config("fwd")["promote"] is True
    assert vocab_ops.current_kernel_config() is before
    with pytest.raises(TypeError):
        before["fwd"]["BM"] = 64  # read-only
    with pytest.raises(ValueError, match="'fwd' has no entry pases"):
        with vocab_ops.kernel_config_scope("fwd", pases=2):
            pass
    with pytest.raises(ValueError, match="no config name"):
        with vocab_ops.kernel_config_scope(BM=64):
            pass
    assert vocab_ops.current_kernel_config() is before


def test_kernel_path_without_triton_or_work_is_torch(monkeypatch):
    h, w = torch.zeros(4, 8), torch.zeros(6, 8)
    if vocab_ops.vocab_triton is not None:
        assert vocab_ops._kernel_path("topk", h, w, 65) == "torch"
        assert vocab_ops._kernel_path("stats", h[:0], w) == "torch"
        assert vocab_ops._kernel_path("dlogits", h, w[:0]) == "torch"
        # CPU tensors (the interpreter tests) cannot take the Gluon kernels.
        assert vocab_ops._kernel_path("topk", h.half(), w.half(), 64) == "triton"
    monkeypatch.setattr(vocab_ops, "vocab_triton", None)
    monkeypatch.setattr(vocab_ops, "_WARNED", set())
    with pytest.warns(UserWarning, match="vocab_stats_backward: Triton unavailable"):
        assert vocab_ops._kernel_path("dlogits", h, w) == "torch"


@pytest.mark.skipif(vocab_ops.vocab_triton is None, reason="needs Triton")
def test_split_model_follows_config_changes():
    # The split count is memoised on the config values it reads: a change must reach it.
    before = vocab_ops.forward_splits(20436, 151936, 0, 132)
    assert vocab_ops.forward_splits(20436, 151936, 0, 132) == before
    with vocab_ops.kernel_config_scope("fwd", ctas_per_sm=2):
        assert (before, vocab_ops.forward_splits(20436, 151936, 0, 132)) == (33, 54)
        # With a top-k the model leaves out the ragged end (the merge grows with the splits).
        assert vocab_ops.forward_splits(20436, 151936, 20, 132) == 9
        with vocab_ops.kernel_config_scope("fwd", splits=5):
            assert vocab_ops.forward_splits(20436, 151936, 0, 132) == 5
    # Few row blocks may use more splits than the default cap of 64.
    assert vocab_ops.forward_splits(100, 151936, 0, 132) > 64
    # fp32 inputs: the model sees their tile (64 x 64: 4 times the row blocks and tiles).
    fp32 = vocab_ops.forward_splits(20436, 151936, 0, 132, dtype=torch.float32)
    assert fp32 == vocab_ops.choose_splits(320, 2374, 132, 0)


def test_tma_choice_is_made_in_vocab_ops():
    # Whether the copy engine can address the operands is decided here, with the configuration;
    # the Triton launchers take the decision as ``use_tma`` and never check it themselves.
    import inspect

    cfg = vocab_ops.current_kernel_config()["fwd"]
    hidden, weight = torch.zeros(8, 16, dtype=torch.bfloat16), torch.zeros(4, 16).bfloat16()
    assert not vocab_ops.tma_ok(hidden, weight) and not vocab_ops._use_tma(cfg, hidden, weight)
    assert vocab_ops.tma_ok()  # nothing to address
    if vocab_ops.vocab_triton is not None:
        for launcher in ("launch_stats_fwd", "launch_dlogits", "logit_keys"):
            params = inspect.signature(getattr(vocab_ops.vocab_triton, launcher)).parameters
            assert params["use_tma"].kind is inspect.Parameter.KEYWORD_ONLY, launcher
            assert params["use_tma"].default is inspect.Parameter.empty, launcher
        assert not hasattr(vocab_ops.vocab_triton, "tma_ok")


@pytest.mark.skipif(vocab_ops.vocab_gluon is None, reason="needs Triton's Gluon")
def test_gluon_topk_splits_keep_rows_in_l2_and_balance_the_programs():
    # Enough splits that the row blocks in flight fit the L2 budget; from there the fewest whose
    # busiest persistent program walks at most 5% over an even share (each split adds merge keys
    # per row).
    from megatron.context_parallel.head import vocab_gluon as _vocab_gluon

    cfg = _vocab_gluon.TOPK_CONFIG
    row_bytes = 5120 * 2
    block = cfg["BM"] * row_bytes
    for n, vocab, slots in [
        (8192, 151936, 132),
        (20436, 151936, 132),
        (8192, 37984, 132),
        (20436, 37984, 132),
        (4100, 37984, 132),
    ]:
        num_r, num_c = -(-n // cfg["BM"]), -(-vocab // cfg["BN"])
        even = num_r * num_c / slots

        def busiest(splits, num_r=num_r, num_c=num_c, slots=slots):
            per = -(-num_c // splits)
            return -(-(num_r * -(-num_c // per)) // slots) * per

        def fits(splits, num_r=num_r, slots=slots):
            return min(num_r, slots / splits) * block <= _vocab_gluon._L2_ROWS_BYTES

        least = next(s for s in range(1, 17) if fits(s))
        splits = _vocab_gluon.topk_splits(n, vocab, slots, row_bytes)
        assert splits >= least
        assert busiest(splits) <= 1.05 * even
        assert all(busiest(s) > 1.05 * even for s in range(least, splits))
    # The measured shapes: 8 splits held 10.8 MB of rows at once (RESULTS.md, "top-k splits").
    assert _vocab_gluon.topk_splits(8192, 151936, 132, row_bytes) == 8
    # A few rows: they stay in L2; more splits to fill the device, at most 16.
    assert _vocab_gluon.topk_splits(64, 151936, 132, row_bytes) == 16
    assert _vocab_gluon.topk_splits(1, 10, 132, row_bytes) == 1


@pytest.mark.skipif(vocab_ops.vocab_gluon is None, reason="needs Triton's Gluon")
def test_gluon_tile_configs_change_only_inside_their_scope():
    gluon = vocab_ops.vocab_gluon
    default = dict(gluon.TOPK_CONFIG)
    with pytest.raises(TypeError):
        gluon.TOPK_CONFIG["BM"] = 8  # read-only outside a scope
    with gluon.tile_config_scope("topk", BM=8, BN=16) as cfg:
        assert gluon.TOPK_CONFIG is cfg and (cfg["BM"], cfg["BN"]) == (8, 16)
        assert cfg["G"] == default["G"]
    assert dict(gluon.TOPK_CONFIG) == default
    with pytest.raises(ValueError, match="unknown topk tile settings"):
        with gluon.tile_config_scope("topk", tile=4):
            pass
    assert dict(gluon.TOPK_CONFIG) == default
