"""A dense stand-in for the fused attention kernel, and an oracle written from positions alone.

``ReferenceKernel`` meets ``megatron.context_parallel.attention.kernel.AttentionKernel``, as the
cuDNN kernel (``cudnn.CudnnKernel``) does, with the same contract: each entry is a bottom-right
causal (or, for a call with ``causal`` False, unmasked) block of its ``q_len`` query rows over its
``kv_len`` keys; the backward differentiates against the output and log-sum-exp it is given and
writes each entry's key gradients whole (no accumulation across entries). Plugged into the fused
path on the CPU, it checks every table (spans, dummies, key copies, compact keys) against
``oracle_attention``, which knows nothing of runs: each local row attends the owned positions of its
sequence up to its own.
"""

from __future__ import annotations

import weakref

import torch

from megatron.context_parallel.attention.fused import fused_attention
from megatron.context_parallel.attention.runs import SPLIT_MARGIN


def _stats_dtype(q):
    return torch.promote_types(q.dtype, torch.float32)


def _scores(q, k, scale, causal):
    """Scaled float64 scores ``[H, n, m]`` of one entry, bottom-right causal or unmasked."""
    n, heads, _ = q.shape
    m, groups = k.shape[0], k.shape[1]
    k = k.double().repeat_interleave(heads // groups, dim=1)
    scores = torch.einsum("nhd,mhd->hnm", q.double(), k) * scale
    if causal:
        rows = torch.arange(n, device=q.device)[:, None]
        cols = torch.arange(m, device=q.device)[None, :]
        scores = scores.masked_fill(cols > rows + (m - n), float("-inf"))
    return scores


class ReferenceKernel:
    """The fused kernel's contract in plain torch (float64 math, any device).

    Forward: each entry's softmax attention and log-sum-exp. Backward: each entry's share of
    the gradients *given* the output and log-sum-exp (which may cover more keys than the
    entry's, when the caller split a row's keys over calls): ``P = exp(S - lse)``,
    ``dS = P * (dO V^T - rowsum(dO * O))``; key gradients written to the entry's own rows.
    """

    # Read each entry's keys where the forward did (tests switch it on to check that path).
    shared_keys_in_backward = False
    # Run a causal call's backward as its prefix and diagonal calls (the split kernels below).
    split_backward = False
    split_margin = SPLIT_MARGIN
    # Query plus key-gradient rows one backward call may span before the fused path cuts it
    # into windows (the windowed kernels below); None: never.
    window_rows = None

    @classmethod
    def backward_window_rows(cls, heads, dim):
        return cls.window_rows

    @classmethod
    def for_levels(cls):
        return cls

    @staticmethod
    def key_gradients(kv, runs):
        d = kv.shape[-1] // 2
        return kv.new_zeros((2, runs.mat_rows, kv.shape[1], d))

    @staticmethod
    def forward(q, kv, runs, dev, scale, want_stats):
        d = q.shape[-1]
        heads = q.shape[1]
        o = torch.zeros_like(q)
        # float64 statistics for float64 tests (cuDNN's are fp32 for its fp16 / bf16 inputs).
        stats = torch.zeros(q.shape[:2], dtype=_stats_dtype(q), device=q.device)
        for e in range(runs.entries):
            qs, ql = int(runs.q_start[e]), int(runs.q_len[e])
            ks, kl = int(runs.k_start[e]), int(runs.kv_len[e])
            keys = kv[ks : ks + kl]
            scores = _scores(q[qs : qs + ql], keys[..., :d], scale, runs.causal)
            v = keys[..., d:].double().repeat_interleave(heads // kv.shape[1], dim=1)
            out = torch.einsum("hnm,mhd->nhd", torch.softmax(scores, dim=-1), v)
            o[qs : qs + ql] = out.to(o.dtype)
            stats[qs : qs + ql] = torch.logsumexp(scores, dim=-1).transpose(0, 1).to(stats.dtype)
        return o, (stats if want_stats else None)

    @classmethod
    def backward(
        cls, q, kv, o, do, stats, runs, dev, scale, deterministic, dkv_out=None, dq_out=None
    ):
        d = q.shape[-1]
        heads, groups = q.shape[1], kv.shape[1]
        # Written whole: rows outside every entry zero.
        dq = torch.zeros_like(q) if dq_out is None else dq_out.zero_()
        # Rows no entry writes stay zero, as the cuDNN kernel's zero-initialised buffers do
        # (or keep what an earlier call of a split backward wrote there).
        dkv = cls.key_gradients(kv, runs) if dkv_out is None else dkv_out
        copies = runs.materialize and not cls.shared_keys_in_backward
        for e in range(runs.entries):
            qs, ql = int(runs.q_start[e]), int(runs.q_len[e])
            ms, kl = int(runs.mat_start[e]), int(runs.kv_len[e])
            ks = ms if copies else int(runs.k_start[e])
            keys = kv[ks : ks + kl].double()
            k = keys[..., :d].repeat_interleave(heads // groups, dim=1)
            v = keys[..., d:].repeat_interleave(heads // groups, dim=1)
            qe = q[qs : qs + ql].double()
            oe, doe = o[qs : qs + ql].double(), do[qs : qs + ql].double()
            lse = stats[qs : qs + ql].double().transpose(0, 1)  # [H, n]
            p = (_scores(qe, keys[..., :d], scale, runs.causal) - lse[..., None]).exp()
            dp = torch.einsum("nhd,mhd->hnm", doe, v)
            ds = p * (dp - (doe * oe).sum(-1).transpose(0, 1)[..., None])
            gq = torch.einsum("hnm,mhd->nhd", ds, k) * scale
            gk = torch.einsum("hnm,nhd->mhd", ds, qe) * scale
            gv = torch.einsum("hnm,nhd->mhd", p, doe)
            fold = (kl, groups, heads // groups, d)
            dq[qs : qs + ql] = gq.to(dq.dtype)
            # Written, not added: entries do not share gradient rows.
            dkv[0, ms : ms + kl] = gk.reshape(fold).sum(2).to(dkv.dtype)
            dkv[1, ms : ms + kl] = gv.reshape(fold).sum(2).to(dkv.dtype)
        return dq, dkv


class SharedKeysReferenceKernel(ReferenceKernel):
    """The same, reading overlapping key ranges in the backward (no per-entry copies)."""

    shared_keys_in_backward = True


class SplitReferenceKernel(ReferenceKernel):
    """The same, with causal calls' backward split into prefix and diagonal calls
    (``AttentionRuns.backward_split``) wherever the fused path splits it for cuDNN."""

    split_backward = True


class SplitSharedKeysReferenceKernel(SharedKeysReferenceKernel):
    """Shared keys and the split backward."""

    split_backward = True


class WindowedReferenceKernel(ReferenceKernel):
    """Key copies, every backward call cut into windows of at most 24 query plus key-gradient
    rows (``AttentionRuns.backward_windows``): the tests' plans are small, so windows of the
    size cuDNN's budget gives (tens of thousands of rows) never happen in them."""

    window_rows = 24


class WindowedSplitSharedKeysReferenceKernel(SplitSharedKeysReferenceKernel):
    """Shared keys and the split backward, each of its calls cut into windows of at most 24
    rows."""

    window_rows = 24


class FreedBuffersReferenceKernel(ReferenceKernel):
    """The reference kernel, checking at each backward call that the previous call's buffers
    are freed: the gradients it returned (other than a ``dkv_out`` or ``dq_out`` it was given)
    and the inputs its caller made for it. A buffer of the current call's inputs, or one in
    ``keep`` (the forward's saved tensors, the incoming gradient), may stay. On a GPU a call's
    workspace on top of whatever is still alive is the backward's peak memory.

    One instance serves one backward pass (``backward_keeping``); ``calls`` counts its backward
    calls."""

    def __init__(self):
        self.keep = set()
        self.previous = []
        self.calls = 0

    def for_levels(self):
        return self  # one instance sees every call of the pass

    def backward(
        self, q, kv, o, do, stats, runs, dev, scale, deterministic, dkv_out=None, dq_out=None
    ):
        given = (q, kv, o, do, stats) + tuple(t for t in (dkv_out, dq_out) if t is not None)
        current = {_storage(t) for t in given}
        for name, ref, storage in self.previous:
            if ref() is not None and storage not in current and storage not in self.keep:
                raise AssertionError(
                    f"backward call {self.calls}: the previous call's {name} is alive"
                )
        dq, dkv = super().backward(
            q, kv, o, do, stats, runs, dev, scale, deterministic, dkv_out, dq_out
        )
        tracked = {"q": q, "o": o, "do": do, "stats": stats}
        if dq_out is None:
            tracked["dq"] = dq
        if dkv_out is None:
            tracked["dkv"] = dkv
        self.previous = [(n, weakref.ref(t), _storage(t)) for n, t in tracked.items()]
        self.calls += 1
        return dq, dkv


class FreedBuffersWindowedReferenceKernel(FreedBuffersReferenceKernel):
    """The same, every backward call cut into windows of at most 24 rows."""

    window_rows = 24


def _storage(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


def backward_keeping(tables, kernel, heads=4, groups=2, dim=8):
    """One fused fwd+bwd (float64, seeded inputs) on ``tables`` with a
    ``FreedBuffersReferenceKernel`` that may keep only the forward's saved tensors and the
    incoming gradient across its backward calls; returns the number of backward calls."""
    g = torch.Generator().manual_seed(5)
    query = torch.randn(tables.rows, heads, dim, generator=g, dtype=torch.float64)
    kv = torch.randn(tables.slots, groups, 2 * dim, generator=g, dtype=torch.float64)
    out = fused_attention(
        query.requires_grad_(), kv.requires_grad_(), tables, dim**-0.5, kernel=kernel
    )
    grad = torch.randn(out.shape, generator=g, dtype=out.dtype)
    kernel.keep = {_storage(t) for t in (*out.grad_fn.saved_tensors, grad)}
    out.backward(grad)
    return kernel.calls


# Every kernel contract the fused path supports: key copies or shared key ranges, one backward
# call, the split one, or either cut into windows.
REFERENCE_KERNELS = (
    ReferenceKernel,
    SharedKeysReferenceKernel,
    SplitReferenceKernel,
    SplitSharedKeysReferenceKernel,
    WindowedReferenceKernel,
    WindowedSplitSharedKeysReferenceKernel,
)


def oracle_attention(query, keys, values, positions, sequence, owned, scale):
    """Causal attention by source position, from positions alone (float64).

    Args:
        query: ``[n, H, d]`` for the local rows at ``positions`` (int64 ``[n]``).
        keys, values: ``[S, G, d]`` in source order (rows nobody owns are ignored).
        sequence: int64 ``[S]``, the packed sequence of each position.
        owned: bool ``[S]``, whether some rank owns each position.
    """
    heads, groups = query.shape[1], keys.shape[1]
    k = keys.double().repeat_interleave(heads // groups, dim=1)
    v = values.double().repeat_interleave(heads // groups, dim=1)
    source = torch.arange(keys.shape[0], device=keys.device)
    allowed = (
        (sequence[None, :] == sequence[positions][:, None])
        & (source[None, :] <= positions[:, None])
        & owned[None, :]
    )
    scores = torch.einsum("nhd,shd->hns", query.double(), k) * scale
    scores = scores.masked_fill(~allowed[None], float("-inf"))
    return torch.einsum("hns,shd->nhd", torch.softmax(scores, dim=-1), v)
