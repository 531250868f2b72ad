"""cuDNN's fused attention (through ``nvidia-cudnn-frontend``) as the kernel of the run tables.

One cuDNN graph runs every entry of an ``AttentionRuns`` batch: queries, keys and values are
addressed per entry by ragged offsets (element offsets of each entry's first row), entry
lengths by ``seq_len_q`` / ``seq_len_kv`` with the padding mask, and the causal diagonal is
aligned to each entry's bottom-right corner (``runs.causal``; else no mask). Keys of several
entries may overlap: the forward only reads them, and the backward reads them in place and
writes each entry's key gradients to its own rows (``runs.mat_start``). The backward takes the
output and log-sum-exp it is given, so a call over part of a row's keys, given the final ones,
yields that part's share of the gradients.

Shapes (``H`` query heads, ``G`` key/value heads, ``d`` head dim; GQA is native, no repeat):

* forward: ``q`` ``[Tq, H, d]``, ``kv`` ``[N, G, 2d]`` (keys in ``[..., :d]``, values in
  ``[..., d:]``) -> ``o`` ``[Tq, H, d]`` and the softmax log-sum-exp ``[Tq, H]`` fp32.
* backward: the same plus ``do`` -> ``dq`` ``[Tq, H, d]``, ``dkv`` ``[2, M, G, d]`` (key
  gradients, then value gradients: ``sums`` reads them into slot rows).

Graphs are built once per bucketed shape (``AttentionRuns.batch / max_q / max_kv / total_*``)
and cached: a batch with new lengths reuses them. ``graph_builds()`` counts builds.

Requires a CUDA device and ``pip install nvidia-cudnn-frontend`` (the ``attention`` extra);
``available()`` says whether both are there. fp16 / bf16 only.
"""

from __future__ import annotations

import functools
import threading
from dataclasses import dataclass, replace
from typing import Dict, Optional, Tuple

import torch

from megatron.context_parallel.attention.runs import SPLIT_MARGIN

__all__ = [
    "KERNEL",
    "CudnnKernel",
    "CudnnOptions",
    "available",
    "backward_totals",
    "diagonal",
    "graph_builds",
    "reset_graphs",
    "workspace_bytes",
]

# Distinct tensor ids inside one graph.
_Q, _K, _V, _O, _STATS, _DO, _DQ, _DK, _DV = 1, 2, 3, 4, 5, 6, 7, 8, 9
_LEN_Q, _LEN_KV = 10, 11
_OFF_Q, _OFF_K, _OFF_V, _OFF_O, _OFF_STATS, _OFF_DQ, _OFF_DK, _OFF_DV = range(20, 28)


@dataclass(frozen=True)
class CudnnOptions:
    """How the cuDNN kernel lays out its backward and builds its graphs (every field measured).

    Attributes:
        shared_keys_in_backward: the backward reads each entry's keys where the forward did
            (overlapping ranges of the compact keys) and writes their gradients to separate
            rows, rather than being given per-entry copies of the keys: checked against the
            oracle on a GPU (tests/attention/test_fused_cuda.py), no slower, and it saves one
            copy of the keys per layer.
        separate_key_gradients: the backward writes dK and dV to two dense ``[M, G, d]``
            buffers (returned as one ``[2, M, G, d]``), not into the interleaved ``[M, G, 2d]``
            layout of the keys. With GQA cuDNN's backward workspace holds per-query-head fp32 dK
            and dV laid out with the outputs' token stride times ``H / G``, so the interleaved
            layout (False) doubles them: on an H100 at S = 20,436, 40 / 8 heads, d = 128, one
            call's workspace was 2.23 GiB against 1.21, at the same time.
        exact_key_workspace: cuDNN's frontend (1.32) sizes a ragged GQA backward's per-query-head
            dK / dV workspace at four bytes an element while the backend writes them in the
            inputs' 16-bit type, so the second half of each is never touched. With this set,
            the key total the graph is given (it sizes nothing else) is halved, plus one row, so
            that those two buffers are the size they are used at. A GPU test puts a guard region
            after every workspace to hold the backend to that.
        graph_options: extra ``cudnn.pygraph`` keyword arguments for every graph built, as
            ``(name, value)`` pairs (probes try cuDNN's dynamic shapes and kernel cache).
        square_top_left: a causal call whose entries are all square (each entry's rows run
            from its sequence's first key, ``q_len == kv_len``) aligns the diagonal to the
            top-left corner, which for a square is the same mask. cuDNN's ragged backward skips
            the masked tiles so and not with the diagonal bottom-right: on an H100 a
            16,384-row square's backward took 14.7 ms against 27.6 (0.98-1.10x the floor's
            per-pair time against 1.95-2.07x), the GRPO trees' attention 1.16x / 1.42x the
            floor fwd+bwd against 1.57x / 1.61x (``probes/probe_tree_calls.py``,
            ``bench_tree.py``). The forward is the same either way.
        split_backward: with ``square_top_left``, a causal call of non-square entries runs its
            backward as an unmasked call of their key prefixes and a top-left call of their
            square diagonals (``AttentionRuns.backward_split``, where its rectangles exceed
            its visible pairs by ``split_margin``), so no masked tile is computed.
        split_margin: how much the rectangles of a causal call's entries must exceed their
            visible pairs for the split (``runs.SPLIT_MARGIN`` by default).
        backward_workspace: bytes of fp32 accumulators one backward call may size (None: no
            bound). cuDNN's backward sizes them by the rows its buffers span, 4 H d bytes per
            query row (dQ) and, with GQA, per key-gradient row (dK and dV per query head,
            ``exact_key_workspace``), not by the rows its entries use: by that count one call
            over THD's 65,536 rows and 163,840 key-gradient rows at S = 131,072 (40 heads,
            d = 128) sizes 4.7 GB. Calls beyond this run over windows of their rows
            (``AttentionRuns.backward_windows``).
        level_workspace: the same bound for the blocked layout's level calls
            (``AttentionBlocks.levels``, through ``CudnnKernel.for_levels``), when smaller.
            Those calls run beside the blocked backward's fp32 sums of the query and key
            gradients, which a run layout's call does not hold: at S = 20,436, every row dealt
            at random over CP 2, the first level call's 31,744 rows under 768 MiB put the
            backward's peak at 1.04 GiB beyond the inputs, and 0.96 GiB cut at 512 MiB
            (``probes/probe_backward_memory.py``). None: ``backward_workspace``.
    """

    shared_keys_in_backward: bool = True
    separate_key_gradients: bool = True
    exact_key_workspace: bool = True
    graph_options: Tuple[Tuple[str, object], ...] = ()
    square_top_left: bool = True
    split_backward: bool = True
    split_margin: float = SPLIT_MARGIN
    backward_workspace: Optional[int] = 3 << 28
    level_workspace: Optional[int] = 1 << 29


def diagonal(runs, options: CudnnOptions) -> Optional[str]:
    """The causal diagonal of a call's graph: ``"bottom_right"`` (each entry's last row sees its
    last key), ``"top_left"`` (``options.square_top_left`` on a call of square entries: the same
    mask), or None (unmasked)."""
    if not runs.causal:
        return None
    if options.square_top_left and runs.entries and torch.equal(runs.q_len, runs.kv_len):
        return "top_left"
    return "bottom_right"


_GRAPHS: Dict[tuple, tuple] = {}
_TOTALS: Dict[tuple, list] = {}  # backward graph key -> the (total_q, total_mat) built for it
# The largest row totals any backward graph of this process was built for. A new backward graph
# is built for at least these: the totals only size its workspace, which is allocated per call,
# so no call's workspace exceeds the largest a batch of this process has needed, while a graph
# sized for its first batch alone is built again by every later batch of larger totals.
# Replayed over 200 random uneven plans at S = 20,436 (probe_build_policy): 31 graph builds
# against 42.
_LARGEST_TOTALS = [0, 0]
_BUILDS = [0]
_LOCK = threading.Lock()
_HANDLES = threading.local()


@functools.lru_cache(maxsize=1)
def _cudnn():
    """The ``cudnn`` module, or None when the frontend (or cuDNN itself) cannot load."""
    try:
        import cudnn

        cudnn.backend_version()
    except Exception:  # noqa: BLE001 - any failure to load means the backend is unavailable
        return None
    return cudnn


def available(device: torch.device) -> bool:
    """Whether the cuDNN backend can run on ``device`` (CUDA, frontend importable)."""
    return device.type == "cuda" and _cudnn() is not None


def graph_builds() -> int:
    """How many cuDNN graphs this process has built (one per new bucketed shape)."""
    return _BUILDS[0]


def workspace_bytes() -> Dict[str, int]:
    """The largest workspace of the built forward and backward graphs (for benchmarks)."""
    out = {"fwd": 0, "bwd": 0}
    for key, (_, ws) in list(_GRAPHS.items()):
        out[key[0]] = max(out[key[0]], int(ws))
    return out


def _handle(device: torch.device):
    handles = getattr(_HANDLES, "by_device", None)
    if handles is None:
        handles = _HANDLES.by_device = {}
    cudnn = _cudnn()
    handle = handles.get(device)
    if handle is None:
        with torch.cuda.device(device):
            handle = handles[device] = cudnn.create_handle()
    cudnn.set_stream(handle=handle, stream=torch.cuda.current_stream(device).cuda_stream)
    return handle


def _graph(key: tuple, build):
    entry = _GRAPHS.get(key)
    if entry is None:
        with _LOCK:
            entry = _GRAPHS.get(key)
            if entry is None:
                entry = _GRAPHS[key] = build()
                _BUILDS[0] += 1
    return entry


def _io_type(dtype: torch.dtype):
    cudnn = _cudnn()
    if dtype == torch.bfloat16:
        return cudnn.data_type.BFLOAT16
    if dtype == torch.float16:
        return cudnn.data_type.HALF
    raise ValueError(f"cuDNN attention takes fp16 / bf16, got {dtype}")


def _ragged(g, name: str, uid: int, batch: int):
    cudnn = _cudnn()
    return g.tensor(
        name=name, dim=[batch + 1, 1, 1, 1], stride=[1, 1, 1, 1],
        data_type=cudnn.data_type.INT64, uid=uid,
    )  # fmt: skip


def _lengths(g, batch: int):
    cudnn = _cudnn()
    return tuple(
        g.tensor(
            name=name, dim=[batch, 1, 1, 1], stride=[1, 1, 1, 1],
            data_type=cudnn.data_type.INT32, uid=uid,
        )  # fmt: skip
        for name, uid in (("seq_len_q", _LEN_Q), ("seq_len_kv", _LEN_KV))
    )


def _rows(g, name, uid, batch, heads, seq, dim, token_stride, head_stride, io, offsets):
    """A ``[batch, heads, seq, dim]`` descriptor of a row-major ``[T, heads, *]`` buffer whose
    entries start at ragged offsets (the batch stride is a placeholder)."""
    t = g.tensor(
        name=name,
        dim=[batch, heads, seq, dim],
        stride=[seq * token_stride, head_stride, token_stride, 1],
        data_type=io,
        uid=uid,
    )
    t.set_ragged_offset(offsets)
    return t


def _finish(g):
    cudnn = _cudnn()
    g.validate()
    g.build_operation_graph()
    g.create_execution_plans([cudnn.heur_mode.A, cudnn.heur_mode.FALLBACK])
    g.check_support()
    g.build_plans()
    return g, g.get_workspace_size()


def _start_graph(handle, dtype, runs, heads, groups, dim, options: CudnnOptions):
    """A graph with the inputs every pass reads: (graph, io type, the sdpa arguments of the
    entry lengths and the diagonal, q, k, v descriptors)."""
    cudnn = _cudnn()
    io = _io_type(dtype)
    b, sq, skv = runs.batch, runs.max_q, runs.max_kv
    q_tok, kv_tok = heads * dim, groups * 2 * dim
    g = cudnn.pygraph(
        handle=handle, io_data_type=io,
        intermediate_data_type=cudnn.data_type.FLOAT, compute_data_type=cudnn.data_type.FLOAT,
        **dict(options.graph_options),
    )  # fmt: skip
    len_q, len_kv = _lengths(g, b)
    mask = dict(use_padding_mask=True, seq_len_q=len_q, seq_len_kv=len_kv)
    corner = diagonal(runs, options)
    if corner is not None:
        alignment = cudnn.diagonal_alignment
        mask.update(
            diagonal_alignment=(
                alignment.TOP_LEFT if corner == "top_left" else alignment.BOTTOM_RIGHT
            ),
            diagonal_band_right_bound=0,
        )
    q = _rows(g, "q", _Q, b, heads, sq, dim, q_tok, dim, io, _ragged(g, "off_q", _OFF_Q, b))
    k = _rows(g, "k", _K, b, groups, skv, dim, kv_tok, 2 * dim, io, _ragged(g, "off_k", _OFF_K, b))
    v = _rows(g, "v", _V, b, groups, skv, dim, kv_tok, 2 * dim, io, _ragged(g, "off_v", _OFF_V, b))
    return g, io, mask, q, k, v


def _forward_graph(handle, dtype, runs, heads, groups, dim, scale, want_stats, options):
    cudnn = _cudnn()
    g, io, mask, q, k, v = _start_graph(handle, dtype, runs, heads, groups, dim, options)
    b, sq = runs.batch, runs.max_q
    o, stats = g.sdpa(
        name="attention", q=q, k=k, v=v, generate_stats=want_stats, attn_scale=scale, **mask
    )
    o.set_uid(_O).set_output(True).set_dim([b, heads, sq, dim])
    o.set_stride([sq * heads * dim, dim, heads * dim, 1]).set_data_type(io)
    o.set_ragged_offset(_ragged(g, "off_o", _OFF_O, b))
    if want_stats:
        stats.set_uid(_STATS).set_output(True).set_dim([b, heads, sq, 1])
        stats.set_stride([sq * heads, 1, heads, 1]).set_data_type(cudnn.data_type.FLOAT)
        stats.set_ragged_offset(_ragged(g, "off_stats", _OFF_STATS, b))
    return _finish(g)


def _backward_graph(
    handle, dtype, runs, totals, heads, groups, dim, scale, deterministic, options: CudnnOptions
):
    cudnn = _cudnn()
    g, io, mask, q, k, v = _start_graph(handle, dtype, runs, heads, groups, dim, options)
    b, sq, skv = runs.batch, runs.max_q, runs.max_kv
    q_tok, kv_tok = heads * dim, groups * 2 * dim
    off_o = _ragged(g, "off_o", _OFF_O, b)
    o = _rows(g, "o", _O, b, heads, sq, dim, q_tok, dim, io, off_o)
    do = _rows(g, "do", _DO, b, heads, sq, dim, q_tok, dim, io, off_o)
    # The backward takes the statistics padded per entry (no ragged offsets).
    stats = g.tensor(
        name="stats", dim=[b, heads, sq, 1], stride=[heads * sq, sq, 1, 1],
        data_type=cudnn.data_type.FLOAT, uid=_STATS,
    )  # fmt: skip
    dq, dk, dv = g.sdpa_backward(
        name="attention_backward",
        q=q,
        k=k,
        v=v,
        o=o,
        dO=do,
        stats=stats,
        attn_scale=scale,
        max_total_seq_len_q=totals[0],
        max_total_seq_len_kv=_key_total(totals[1], heads, groups, options),
        use_deterministic_algorithm=deterministic,
        **mask,
    )
    # dK / dV: dense [M, G, d] buffers or the interleaved [M, G, 2d] (separate_key_gradients).
    separate = options.separate_key_gradients
    out_tok, out_hs = (groups * dim, dim) if separate else (kv_tok, 2 * dim)
    for t, uid, h, tok, hs, name, off in (
        (dq, _DQ, heads, q_tok, dim, "off_dq", _OFF_DQ),
        (dk, _DK, groups, out_tok, out_hs, "off_dk", _OFF_DK),
        (dv, _DV, groups, out_tok, out_hs, "off_dv", _OFF_DV),
    ):
        t.set_uid(uid).set_output(True).set_dim([b, h, sq if t is dq else skv, dim])
        t.set_stride([(sq if t is dq else skv) * tok, hs, tok, 1]).set_data_type(io)
        t.set_ragged_offset(_ragged(g, name, off, b))
    return _finish(g)


def _key_total(total: int, heads: int, groups: int, options: CudnnOptions) -> int:
    """The key total a backward graph is given for ``total`` gradient rows
    (``exact_key_workspace``: halved with GQA, where it only sizes the 16-bit per-head buffers)."""
    if options.exact_key_workspace and heads != groups:
        return -(-int(total) // 2) + 1
    return int(total)


def backward_totals(
    key: tuple, total_q: int, total_mat: int, cap: Optional[int] = None
) -> Tuple[Tuple[int, int], bool]:
    """The row totals of the backward graph that serves a call of ``key`` needing
    ``(total_q, total_mat)``, and whether that graph is new: the smallest recorded for ``key``
    that holds them, else (recorded now) the process's largest totals so far, raised to
    these. With ``cap`` (query plus key-gradient rows, ``CudnnKernel.backward_window_rows``)
    no graph beyond the cap (or beyond the call, for a call larger than the cap) serves it, and
    a new one is sized for the call alone where the largest totals would pass that: else every
    later window's workspace would be sized by the largest call the process has run."""
    with _LOCK:
        limit = None if cap is None else max(int(cap), total_q + total_mat)
        fits = [
            t for t in _TOTALS.get(key, ())
            if t[0] >= total_q and t[1] >= total_mat and (limit is None or sum(t) <= limit)
        ]  # fmt: skip
        if fits:
            return min(fits), False
        largest = _LARGEST_TOTALS
        largest[:] = max(largest[0], total_q), max(largest[1], total_mat)
        totals = (largest[0], largest[1])
        if limit is not None and sum(totals) > limit:
            totals = (total_q, total_mat)
        _TOTALS.setdefault(key, []).append(totals)
        return totals, True


def reset_graphs() -> None:
    """Forget every built graph and recorded total (benchmarks start each policy afresh)."""
    with _LOCK:
        _GRAPHS.clear()
        _TOTALS.clear()
        _LARGEST_TOTALS[:] = 0, 0


def _workspace(size: int, device) -> torch.Tensor:
    return torch.empty(max(int(size), 1), dtype=torch.uint8, device=device)


class CudnnKernel:
    """cuDNN's fused attention as an ``AttentionKernel`` (``kernel.py``), under ``options``.

    Graphs are shared by every kernel object of the process: their keys hold the options that
    shape them.
    """

    def __init__(self, options: CudnnOptions = CudnnOptions()):
        self.options = options

    @property
    def shared_keys_in_backward(self) -> bool:
        """Whether the backward reads the compact keys in place (``CudnnOptions``)."""
        return self.options.shared_keys_in_backward

    @property
    def split_backward(self) -> bool:
        """Whether ``fused`` splits a causal call's backward (``CudnnOptions.split_backward``)."""
        return self.options.split_backward and self.options.square_top_left

    @property
    def split_margin(self) -> float:
        """``CudnnOptions.split_margin``."""
        return self.options.split_margin

    def backward_window_rows(self, heads: int, dim: int) -> Optional[int]:
        """Query plus key-gradient rows one backward call may span
        (``CudnnOptions.backward_workspace``: four bytes per head and dimension a row)."""
        budget = self.options.backward_workspace
        return None if budget is None else max(int(budget) // (4 * heads * dim), 1)

    def for_levels(self) -> "CudnnKernel":
        """The kernel of the blocked layout's level calls: these options under
        ``level_workspace`` (``CudnnOptions``), or this kernel."""
        options = self.options
        level, whole = options.level_workspace, options.backward_workspace
        if level is None or (whole is not None and whole <= level):
            return self
        kernel = _LEVEL_KERNELS.get(options)
        if kernel is None:
            kernel = _LEVEL_KERNELS[options] = CudnnKernel(
                replace(options, backward_workspace=level)
            )
        return kernel

    def key_gradients(self, kv: torch.Tensor, runs) -> torch.Tensor:
        """The ``[2, M, G, d]`` buffer a call's backward writes its key gradients into, zero
        where no entry writes (given to the call's pieces as ``dkv_out``)."""
        _, _, dkv = _key_gradient_buffers(kv, runs, self.options.separate_key_gradients)
        return dkv if dkv.dim() == 4 else _as_split(dkv, runs, kv.shape[2] // 2)

    def __repr__(self) -> str:
        return f"CudnnKernel({self.options})"

    def forward(
        self, q: torch.Tensor, kv: torch.Tensor, runs, dev, scale: float, want_stats: bool
    ) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
        """Attention of every entry; see the module docstring for shapes.

        ``q`` and ``kv`` must be contiguous. Returns ``o`` (rows outside every entry are zero)
        and the fp32 log-sum-exp ``[Tq, H]`` when ``want_stats`` (else None).
        """
        tq, heads, dim = q.shape
        groups = kv.shape[1]
        if not runs.entries:  # a rank that owns nothing: its padding row attends to nothing
            zeros = torch.zeros((tq, heads), dtype=torch.float32, device=q.device)
            return torch.zeros_like(q), (zeros if want_stats else None)
        options = self.options
        key = ("fwd", q.dtype, runs.batch, runs.max_q, runs.max_kv, heads, groups, dim, scale,
               want_stats, diagonal(runs, options), q.device, options.graph_options)  # fmt: skip
        handle = _handle(q.device)
        g, ws = _graph(
            key,
            lambda: _forward_graph(
                handle, q.dtype, runs, heads, groups, dim, scale, want_stats, options
            ),
        )
        # Only an empty rank's padding row lies outside every entry: it must read zero.
        alloc = torch.empty if runs.rows_covered else torch.zeros
        o = alloc((tq, heads, dim), dtype=q.dtype, device=q.device)
        stats = None
        if want_stats:
            stats = torch.empty((tq, heads), dtype=torch.float32, device=q.device)
        kv_tok = groups * 2 * dim
        buffers = [q, kv, kv[..., dim:], o, dev.seq_len_q, dev.seq_len_kv]
        uids = [_Q, _K, _V, _O, _LEN_Q, _LEN_KV]
        offsets = [
            (_OFF_Q, dev.offsets("q_rows", heads * dim)),
            (_OFF_K, dev.offsets("kv_rows", kv_tok)),
            (_OFF_V, dev.offsets("kv_rows", kv_tok)),
            (_OFF_O, dev.offsets("q_rows", heads * dim)),
        ]
        if want_stats:
            buffers.append(stats)
            uids.append(_STATS)
            offsets.append((_OFF_STATS, dev.offsets("q_rows", heads)))
        for uid, t in offsets:
            buffers.append(t)
            uids.append(uid)
        g.execute(buffers, _workspace(ws, q.device), handle=handle, tensor_uids=uids)
        return o, stats

    def backward(
        self,
        q: torch.Tensor,
        kv: torch.Tensor,
        o: torch.Tensor,
        do: torch.Tensor,
        stats: torch.Tensor,
        runs,
        dev,
        scale: float,
        deterministic: bool,
        dkv_out: Optional[torch.Tensor] = None,
        dq_out: Optional[torch.Tensor] = None,
    ) -> Tuple[torch.Tensor, torch.Tensor]:
        """Gradients of every entry: ``dq`` ``[Tq, H, d]`` and ``dkv`` ``[2, M, G, d]`` (dK, dV;
        M = ``runs.mat_rows``). ``kv`` is the backward key buffer (entries do not overlap in it)
        or, with ``shared_keys_in_backward``, the compact keys themselves. Inputs contiguous.
        ``dkv_out``: a ``dkv`` this kernel returned before, written into; ``dq_out``: the
        query gradient's buffer, written whole (``kernel.py``)."""
        tq, heads, dim = q.shape
        groups = kv.shape[1]
        if dq_out is not None and (
            dq_out.shape != q.shape or dq_out.dtype != q.dtype or not dq_out.is_contiguous()
        ):
            raise ValueError(
                f"dq_out must be contiguous {tuple(q.shape)} {q.dtype}, got "
                f"{tuple(dq_out.shape)} {dq_out.dtype}"
            )
        if not runs.entries:
            dq = torch.zeros_like(q) if dq_out is None else dq_out.zero_()
            return dq, kv.new_zeros((2, runs.mat_rows, groups, dim))
        options = self.options
        key = ("bwd", q.dtype, runs.batch, runs.max_q, runs.max_kv, heads, groups, dim, scale,
               deterministic, options.separate_key_gradients, options.exact_key_workspace,
               diagonal(runs, options), q.device, options.graph_options)  # fmt: skip
        handle = _handle(q.device)
        # The row totals only size the backward's accumulators: a graph built for larger totals
        # serves this batch, so batches of new lengths reuse the graphs they fit.
        cap = self.backward_window_rows(heads, dim)
        totals, _ = backward_totals(key, runs.total_q, runs.total_mat, cap)
        g, ws = _graph(
            key + totals,
            lambda: _backward_graph(
                handle, q.dtype, runs, totals, heads, groups, dim, scale, deterministic, options
            ),
        )
        # cuDNN writes the entries' rows only: the others must read zero.
        if dq_out is None:
            dq = (torch.empty if runs.rows_covered else torch.zeros)(
                (tq, heads, dim), dtype=q.dtype, device=q.device
            )
        else:
            dq = dq_out if runs.rows_covered else dq_out.zero_()
        separate = options.separate_key_gradients
        if dkv_out is None:
            dk, dv, dkv = _key_gradient_buffers(kv, runs, separate)
        else:  # either layout: dK and dV are the returned tensor's two halves
            dk, dv, dkv = dkv_out[0], dkv_out[1], None
        kv_tok = groups * 2 * dim
        q_off = dev.offsets("q_rows", heads * dim)
        out_off = dev.offsets("mat_rows", groups * dim if separate else kv_tok)
        # Keys are read where the forward read them unless the caller passed per-entry copies.
        copies = runs.materialize and not options.shared_keys_in_backward
        in_off = dev.offsets("mat_rows" if copies else "kv_rows", kv_tok)
        uids = [_Q, _K, _V, _O, _DO, _STATS, _DQ, _DK, _DV]
        uids += [_LEN_Q, _LEN_KV, _OFF_Q, _OFF_K, _OFF_V, _OFF_O, _OFF_DQ, _OFF_DK, _OFF_DV]
        tables = [dev.seq_len_q, dev.seq_len_kv, q_off, in_off, in_off, q_off, q_off]
        tables += [out_off, out_off]
        padded = _padded_stats(stats, dev, runs, heads)
        buffers = [q, kv, kv[..., dim:], o, do, padded, dq, dk, dv]
        g.execute(buffers + tables, _workspace(ws, q.device), handle=handle, tensor_uids=uids)
        if dkv_out is not None:
            return dq, dkv_out
        if separate:
            return dq, dkv
        return dq, _as_split(dkv, runs, dim)


def _as_split(dkv: torch.Tensor, runs, dim: int) -> torch.Tensor:
    """The interleaved ``[M, G, 2d]`` key gradients viewed as ``[2, M, G, d]``."""
    return dkv.view(runs.mat_rows, dkv.shape[1], 2, dim).permute(2, 0, 1, 3)


def _key_gradient_buffers(kv: torch.Tensor, runs, separate: bool):
    """The backward's dK and dV outputs and the one tensor holding both: ``[2, M, G, d]``
    (``separate_key_gradients``: dK then dV, read in place by ``sums``) or the interleaved
    ``[M, G, 2d]``. Zero-filled unless every row is written (copies, or every key attended)."""
    groups, dim = kv.shape[1], kv.shape[2] // 2
    covered = runs.materialize or runs.keys_covered
    alloc = torch.empty if covered else torch.zeros
    if separate:
        split = alloc((2, runs.mat_rows, groups, dim), dtype=kv.dtype, device=kv.device)
        return split[0], split[1], split
    dkv = alloc((runs.mat_rows, groups, 2 * dim), dtype=kv.dtype, device=kv.device)
    return dkv, dkv[..., dim:], dkv


# The kernel ``fused_attention`` runs by default.
KERNEL = CudnnKernel()
# ``CudnnKernel.for_levels`` of each options seen (their graphs are shared anyway).
_LEVEL_KERNELS: Dict[CudnnOptions, CudnnKernel] = {}


def _padded_stats(stats: torch.Tensor, dev, runs, heads: int) -> torch.Tensor:
    """fp32 ``[batch, H, max_q, 1]`` from the forward's packed ``[Tq, H]`` statistics."""
    from megatron.context_parallel.comm import row_ops

    rows = row_ops.gather_rows(stats, dev.stats_index(runs.max_q))  # [batch * max_q, H]
    return rows.view(runs.batch, runs.max_q, heads).permute(0, 2, 1).contiguous().unsqueeze(-1)
