"""Local building blocks of the vocab-parallel head: one tensor-parallel shard, no communication.

Two torch custom ops in the ``megatron_cp`` namespace, wrapped by two functions:

``vocab_stats(hidden, weight, target, k, chunk_size) -> (row_max, sum_exp, target_logit,
topk_values, topk_ids)``
    ``hidden`` ``[n, H]`` and ``weight`` ``[Vs, H]`` (this rank's vocabulary shard), both bf16,
    fp16 or fp32; ``target`` int64 ``[n]`` of shard-local ids or None (ids outside ``[0, Vs)``
    are not in this shard). The logits ``l = hidden @ weight.T`` are accumulated in fp32 and
    KEPT in fp32, never rounded to the input dtype. Returns fp32 ``[n]`` ``row_max = max_j l``,
    fp32 ``[n]`` ``sum_exp = sum_j exp(l - row_max)``, fp32 ``[n]`` ``target_logit = l[i,
    target_i]`` (0.0 where the target is not in the shard), fp32 ``[n, k]`` top-k values
    (descending) and int64 ``[n, k]`` their shard-local ids (exact where values are not tied).
    Not differentiable by itself: the head's autograd Function calls the backward below.

``vocab_stats_backward(hidden, weight, row_max, grad_sum_exp, ids, grad_ids, chunk_size,
want_hidden, want_weight, *, main_grad=None) -> (grad_hidden, grad_weight)``
    The gradient of any loss that reaches the forward's outputs through ``sum_exp`` (as
    ``grad_sum_exp`` fp32 ``[n]``) and through logits picked at ``ids`` (int64 ``[n, m]``
    shard-local, ids outside ``[0, Vs)`` ignored, duplicates adding up) with gradients
    ``grad_ids`` fp32 ``[n, m]``::

        d_logits[i, j] = grad_sum_exp[i] * exp(l[i, j] - row_max[i])
                         + sum_c [ids[i, c] == j] * grad_ids[i, c]
        grad_hidden = d_logits @ weight        # [n, H], hidden's dtype
        grad_weight = d_logits.T @ hidden      # [Vs, H], weight's dtype

    with ``l`` recomputed (nothing of size ``n x Vs`` is kept between forward and backward).
    ``main_grad`` (fp32 ``[Vs, H]``, megatron's gradient-accumulation-fusion buffer): when given,
    ``grad_weight`` is ADDED into it in fp32 and None is returned in its place.

Logit precision on CUDA: the tensor cores accumulate in fp32 but not as IEEE round-to-nearest
(H200, H = 5,120: 4.4e-5 max error on |logit| <= 8 against fp64, the same as cuBLAS bf16 GEMMs
with fp32 output; cuBLAS fp32 SGEMM: 1.3e-5). ``set_kernel_config("fwd", promote=True)`` (and
"fwd_topk", "bwd") adds each 64-wide K block's product with IEEE fp32 adds instead: 2.4e-6, at
about 1.8x the forward time. The CPU path is IEEE fp32 on exact products.

Precision rule (both directions, every path): logits in fp32; ``d_logits`` rounded ONCE to the
input dtype (as autograd of a bf16 matmul does); each of the two gradient products accumulated
in fp32 over its whole reduction dimension and rounded once. The backward walks the vocabulary
in slices: each slice's ``grad_weight`` rows are one product over all ``n`` rows, and
``grad_hidden`` is summed over the slices in an fp32 ``[n, H]`` accumulator, so no bf16 partial
sum is ever added to.

Paths (``_kernel_path`` picks the CUDA one):
    * CPU: torch, on inputs upcast to fp32 (bf16 and fp16 products are exact in fp32), exact and
      deterministic; the reference for the GPU path.
    * CUDA: Triton kernels (``vocab_triton``). The forward is one fused matmul whose epilogue
      folds each logits tile into the row statistics; the logits never reach memory. The backward
      recomputes the logits of a vocabulary slice in a fused kernel that writes ``d_logits`` in
      the input dtype, then cuBLAS forms the slice's ``grad_weight`` rows (one GEMM, K = n) and
      adds its ``grad_hidden`` share into the fp32 accumulator. On Hopper the forward without a
      top-k and the ``d_logits`` kernel are warp-specialised Gluon kernels (``vocab_gluon``),
      whose epilogue runs under the other consumer warpgroup's matmul (``d_logits``: the same
      bits); so is the forward with a top-k (``set_kernel_config("fwd_topk", pingpong=False)``
      keeps the Triton one). Everything runs on the current stream without host
      syncs, so CUDA graphs capture it. With ``k > 0`` the forward's top-k is taken over grouped
      candidates; the rows where that could miss something (random logits, k = 20: 0.01-0.1% of
      rows) are selected again over every element, with launches that do not depend on how many
      rows that is (``_reselect_into``: the host never reads it).
    * CUDA fallback: ``k > 64`` in the forward (the kernel keeps the running top-k in
      registers) runs the torch path on the GPU, on cuBLAS logits with fp32 output, in chunks of
      rows; so does everything when Triton cannot be imported (one warning).

``chunk_size`` bounds working memory and never changes results beyond fp32 rounding order:
    * forward: rows per chunk of the torch paths (the Triton kernel keeps no logits and ignores
      it); None picks chunks of at most 256 MiB of fp32 logits.
    * backward: vocabulary columns per slice on every path; None picks the widest balanced
      slices whose ``d_logits`` (``[n, cols]``, input dtype) fit 512 MiB on CUDA (plus, when
      ``grad_hidden`` is wanted over several slices, the fp32 ``[n, H]`` accumulator). Few,
      wide slices are faster: each slice re-reads and re-writes that accumulator.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import warnings
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Iterator, Mapping, Optional, Tuple

import torch

__all__ = [
    "vocab_stats",
    "vocab_stats_backward",
    "KernelConfig",
    "current_kernel_config",
    "kernel_config",
    "kernel_config_scope",
    "set_kernel_config",
]

_NAMESPACE = "megatron_cp"
_lib = torch.library.Library(_NAMESPACE, "FRAGMENT")
_lib.define(
    "vocab_stats(Tensor hidden, Tensor weight, Tensor? target, int k, int chunk_size)"
    " -> (Tensor, Tensor, Tensor, Tensor, Tensor)"
)
_lib.define(
    "vocab_stats_backward(Tensor hidden, Tensor weight, Tensor row_max, Tensor grad_sum_exp,"
    " Tensor ids, Tensor grad_ids, int chunk_size, bool want_hidden, bool want_weight,"
    " Tensor(a!)? main_grad) -> (Tensor, Tensor)"
)

_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
_KERNEL_MAX_K = 64
_FWD_CHUNK_BYTES = 256 << 20
_BWD_SLICE_BYTES = 512 << 20
# The exact re-selection of the grouped top-k's leftover rows: int64 logit keys of at most this
# many bytes (the first flagged rows), then per-split top-k slots of at most this many bytes for
# the every-element kernel's row-list launch (any further rows).
_RESELECT_BYTES = 128 << 20
_LISTED_BYTES = 64 << 20
# The re-selection's floor sits this far (absolute, relative) under the forward's k-th value:
# far above the few fp32 units in the last place by which two kernels' logits differ, and in
# the sparse tail of a row's logits, so it lets few extra keys through.
_FLOOR_MARGIN = (1e-3, 1e-4)

# Kernel configurations, chosen on an H200 (bf16, H = 5,120): the Triton kernels' tile
# (128x256x64, 8 warps, 3 stages, operands through tensor descriptors for fp16 / bf16; fp32
# inputs take the "fp32" tile instead), and whether the warp-specialised Gluon kernels of
# vocab_gluon (their own tiles) run where they can (pingpong). set_kernel_config changes the
# keys in _USER_KEYS (kernel_config_scope any key, for a with block); the others are measured
# choices:
#   ctas_per_sm: programs of the tile that fit one SM (shared memory), for the split model.
#   GROUP: row blocks per launch group (programs running together share L2; 4 or 16 instead of 8
#     in the forward: never more than 0.01 GEMMs faster, up to 0.10 slower).
#   tma: load the operands through tensor descriptors where the copy engine can address them.
#   grouped, G, passes: the top-k takes each of G column groups' two largest logits per tile as
#     candidates, in exactly `passes` selection passes per tile (kernel 1.16-1.19 GEMMs, against
#     1.24-1.32 with as many passes as needed, which keeps Triton from fusing the tile loop).
#   pass_cost: one grouped selection pass in tiles of matmul, for the split model.
#   reselect_ahead: flagged rows re-selected through logit keys before the row-list launch.
#   splits (absent: the split model): vocabulary splits per row block of the forward.
_TILE = dict(
    BM=128, BN=256, BK=64, warps=8, stages=3, ctas_per_sm=1, tma=True, promote=False, pingpong=False
)
_DEFAULTS = {
    "fwd": dict(_TILE, GROUP=8, pingpong=True),
    "fwd_topk": dict(
        _TILE,
        GROUP=8,
        grouped=True,
        # The Gluon top-k kernel has its own 64 x 256 tile; its column groups must be these G.
        G=8,
        passes=3,
        pass_cost=0.01,
        reselect_ahead=128,
        pingpong=True,
    ),
    "bwd": dict(_TILE, GROUP=16, pingpong=True),
    # fp32 inputs: replaces the tile entries of the three above. Their products run on the CUDA
    # cores (IEEE fp32 fmas), where Triton 3.6 takes ~150 s to build the 128x256 forward with a
    # top-k (it spills heavily) and ~8 s for this tile. The forward, the logit keys and the row
    # list all take it, so the re-selection still gives the forward's bits.
    "fp32": dict(BM=64, BN=64, BK=32, warps=4, stages=3, tma=False),
}
_TILE_KEYS = ("BM", "BN", "BK", "warps", "stages")
_USER_KEYS = {
    "fwd": _TILE_KEYS + ("promote", "pingpong"),
    "fwd_topk": _TILE_KEYS + ("promote", "pingpong"),
    "bwd": _TILE_KEYS + ("promote", "pingpong"),
    "fp32": _TILE_KEYS,
}
# Entries a configuration may take beyond its defaults (absent: the split model decides).
_OPTIONAL_KEYS = ("splits",)


@dataclass(frozen=True)
class KernelConfig:
    """The configurations of the head's kernels, one read-only mapping per kernel: ``fwd`` (the
    forward without a top-k), ``fwd_topk`` (with one), ``bwd`` (the backward's ``d_logits``) and
    ``fp32`` (the tile that replaces the others' for fp32 inputs). Entries: see the notes above
    ``_DEFAULTS``; ``current_kernel_config()`` is the one in effect."""

    fwd: Mapping[str, object] = field(default_factory=lambda: _DEFAULTS["fwd"])
    fwd_topk: Mapping[str, object] = field(default_factory=lambda: _DEFAULTS["fwd_topk"])
    bwd: Mapping[str, object] = field(default_factory=lambda: _DEFAULTS["bwd"])
    fp32: Mapping[str, object] = field(default_factory=lambda: _DEFAULTS["fp32"])

    def __post_init__(self):
        for name in _DEFAULTS:
            object.__setattr__(self, name, MappingProxyType(dict(getattr(self, name))))

    def __getitem__(self, name: str) -> Mapping[str, object]:
        _check_config_name(name)
        return getattr(self, name)

    def replace(self, name: str, **changes) -> "KernelConfig":
        """A copy with entries of kernel ``name`` changed: any entry of the kernel configurations
        (``fp32`` replaces the others' entries, so it may take any of theirs), or ``splits``.

        Raises:
            ValueError: on an unknown ``name`` or entry.
        """
        config = self[name]
        known = set(_OPTIONAL_KEYS).union(*(getattr(self, n) for n in _DEFAULTS))
        unknown = sorted(set(changes) - known)
        if unknown:
            raise ValueError(f"kernel config {name!r} has no entry {', '.join(unknown)}")
        return dataclasses.replace(self, **{name: dict(config, **changes)})


_CURRENT = [KernelConfig()]


def current_kernel_config() -> KernelConfig:
    """The kernel configuration in effect (the process default, or the innermost
    ``kernel_config_scope``)."""
    return _CURRENT[0]


@contextlib.contextmanager
def kernel_config_scope(name: Optional[str] = None, **changes) -> Iterator[KernelConfig]:
    """Runs a ``with`` block with entries of kernel configuration ``name`` changed (any entry,
    measured ones too: tests and probes; no ``name``: none); yields the configuration and
    restores the one before on exit, whatever ``set_kernel_config`` did inside. Process-wide,
    as the kernels' launches (and the backward's autograd thread) read it.

    Raises:
        ValueError: on an unknown ``name`` or entry (before anything changes).
    """
    before = _CURRENT[0]
    if name is not None:
        _CURRENT[0] = before.replace(name, **changes)
    elif changes:
        raise ValueError(f"kernel_config_scope got entries {sorted(changes)} but no config name")
    try:
        yield _CURRENT[0]
    finally:
        _CURRENT[0] = before


def kernel_config(name: str) -> dict:
    """The settable entries of kernel configuration ``name`` ("fwd", "fwd_topk", "bwd" or
    "fp32"), as a new dict: ``set_kernel_config(name, **saved)`` restores a saved copy."""
    cfg = current_kernel_config()[name]
    return {key: cfg[key] for key in _USER_KEYS[name]}


def _config(name: str, dtype: torch.dtype) -> Mapping[str, object]:
    """The configuration kernel ``name`` runs with for inputs of ``dtype``."""
    config = current_kernel_config()
    if dtype == torch.float32:
        return dict(config[name], **config["fp32"])
    return config[name]


def _check_config_name(name) -> None:
    if name not in _DEFAULTS:
        raise ValueError(f"unknown kernel config {name!r}; expected one of {sorted(_DEFAULTS)}")


def set_kernel_config(name: str, **cfg) -> None:
    """Overrides entries of kernel configuration ``name`` for every later call (the process
    default; a ``kernel_config_scope`` around the call restores its own on exit).

    ``name``: "fwd" (the forward without a top-k), "fwd_topk" (with one), "bwd" (the backward's
    ``d_logits``) or "fp32" (the tile that replaces the others' for fp32 inputs). Keys: BM, BN,
    BK (the Triton kernels' tile), warps, stages; and, except for "fp32", promote (sum each BK
    block's product with IEEE fp32 adds: logits 2.4e-6 from fp64 instead of 4.4e-5, at about
    1.8x the forward time; only the Triton kernels do this, see ``vocab_triton._tile_logits``)
    and pingpong (where they can run, the warp-specialised Gluon kernels of ``vocab_gluon``
    rather than the Triton ones; False keeps the Triton kernels).

    Raises:
        ValueError: on an unknown ``name`` or key.
    """
    _check_config_name(name)
    unknown = sorted(set(cfg) - set(_USER_KEYS[name]))
    if unknown:
        raise ValueError(
            f"kernel config {name!r} has no settable {', '.join(unknown)}; "
            f"expected some of {', '.join(_USER_KEYS[name])}"
        )
    _CURRENT[0] = _CURRENT[0].replace(name, **cfg)


# --- fp32 products of low-precision operands -----------------------------------------------------

# None until first tried on a CUDA device: whether cuBLAS bf16/fp16 products with fp32 output
# (aten mm / addmm ``out_dtype``, torch >= 2.8) are available.
_DTYPE_OUT_OK: Optional[bool] = None


def _low_precision_cuda(a: torch.Tensor) -> bool:
    return a.is_cuda and a.dtype in (torch.bfloat16, torch.float16) and _DTYPE_OUT_OK is not False


def _mm_fp32(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """fp32 ``a @ b`` accumulated in fp32, without rounding the product to the inputs' dtype."""
    global _DTYPE_OUT_OK
    if _low_precision_cuda(a):
        try:
            out = torch.ops.aten.mm.dtype(a, b, torch.float32)
            _DTYPE_OUT_OK = True
            return out
        except (RuntimeError, AttributeError, TypeError):
            _DTYPE_OUT_OK = False
    return torch.mm(a.float(), b.float())


def _mm_fp32_out(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """``out = a @ b`` into the fp32 ``out``, with no fp32 temporary of ``out``'s size."""
    global _DTYPE_OUT_OK
    if _low_precision_cuda(a):
        try:
            torch.ops.aten.mm.dtype_out(a, b, torch.float32, out=out)
            _DTYPE_OUT_OK = True
            return out
        except (RuntimeError, AttributeError, TypeError):
            _DTYPE_OUT_OK = False
    return _addmm_fp32_(out.zero_(), a, b)


def _addmm_fp32_(acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``acc += a @ b`` in place, ``acc`` fp32, the product accumulated in fp32."""
    global _DTYPE_OUT_OK
    if a.dtype == torch.float32:
        return acc.addmm_(a, b)
    if _low_precision_cuda(a):
        try:
            torch.ops.aten.addmm.dtype_out(acc, a, b, torch.float32, out=acc)
            _DTYPE_OUT_OK = True
            return acc
        except (RuntimeError, AttributeError, TypeError):
            _DTYPE_OUT_OK = False
    # Upcast: bf16 / fp16 products are exact in fp32, so this is the same fp32 product.
    return acc.addmm_(a.float(), b.float())


# --- torch path (CPU, and CUDA fallback) ---------------------------------------------------------


def _forward_chunk_rows(n: int, vocab: int, chunk_size: int) -> int:
    if chunk_size > 0:
        return chunk_size
    return max(1, _FWD_CHUNK_BYTES // (4 * max(vocab, 1)))


def _stats_torch(hidden, weight, target, k, chunk_size):
    n, vocab = hidden.shape[0], weight.shape[0]
    dev = hidden.device
    row_max = torch.full((n,), float("-inf"), dtype=torch.float32, device=dev)
    sum_exp = torch.zeros(n, dtype=torch.float32, device=dev)
    target_logit = torch.zeros(n, dtype=torch.float32, device=dev)
    top_v = torch.empty(n, k, dtype=torch.float32, device=dev)
    top_i = torch.empty(n, k, dtype=torch.int64, device=dev)
    if n == 0 or vocab == 0:
        return row_max, sum_exp, target_logit, top_v, top_i
    # On a CPU the weight is upcast once; on CUDA cuBLAS writes fp32 logits from bf16 operands.
    weight_t = weight.t() if _low_precision_cuda(hidden) else weight.float().t()
    if target is not None:
        here = (target >= 0) & (target < vocab)
        safe_target = torch.where(here, target, 0)
    rows = _forward_chunk_rows(n, vocab, chunk_size)
    for start in range(0, n, rows):
        end = min(start + rows, n)
        logits = _mm_fp32(hidden[start:end], weight_t)
        chunk_max = logits.amax(dim=1)
        row_max[start:end] = chunk_max
        if target is not None:
            picked = logits.gather(1, safe_target[start:end, None]).squeeze(1)
            target_logit[start:end] = torch.where(here[start:end], picked, 0.0)
        if k:
            values, ids = logits.topk(k, dim=1)
            top_v[start:end] = values
            top_i[start:end] = ids
        # The chunk's logits buffer becomes exp(l - max) in place: one [rows, Vs] fp32 tensor.
        sum_exp[start:end] = logits.sub_(chunk_max[:, None]).exp_().sum(dim=1)
    return row_max, sum_exp, target_logit, top_v, top_i


def _slice_width(n: int, vocab: int, chunk_size: int, elem_bytes: int, align: int) -> int:
    """Vocabulary columns per backward slice (explicit, or the widest balanced one in budget)."""
    if chunk_size > 0:
        return max(1, min(chunk_size, vocab))
    widest = max(align, _BWD_SLICE_BYTES // (elem_bytes * max(n, 1)))
    slices = -(-vocab // widest)
    width = -(-vocab // slices)
    width = -(-width // align) * align
    return max(1, min(width, vocab))


def _backward_outputs(hidden, weight, want_hidden, want_weight, main_grad):
    """The gradient tensors to return: zero-filled only when no slice will write them (n or Vs
    is 0), else left uninitialised (every row is written)."""
    empty = hidden.shape[0] == 0 or weight.shape[0] == 0
    make = torch.zeros if empty else torch.empty
    grad_h = (
        make(hidden.shape, dtype=hidden.dtype, device=hidden.device)
        if want_hidden
        else hidden.new_empty((0,))
    )
    if want_weight and main_grad is None:
        grad_w = make(weight.shape, dtype=weight.dtype, device=weight.device)
    else:
        grad_w = weight.new_empty((0,))
    return grad_h, grad_w


def _backward_torch(
    hidden, weight, row_max, grad_sum_exp, ids, grad_ids, chunk_size, want_h, want_w, main_grad
):
    n, vocab = hidden.shape[0], weight.shape[0]
    grad_h, grad_w = _backward_outputs(hidden, weight, want_h, want_w, main_grad)
    if n == 0 or vocab == 0 or not (want_h or want_w):
        return grad_h, grad_w
    width = _slice_width(n, vocab, chunk_size, 4, 1)
    cuda_lp = _low_precision_cuda(hidden)
    h32 = None if cuda_lp else hidden.float()
    w32 = None if cuda_lp else weight.float()
    inside = (ids >= 0) & (ids < vocab)
    grad_ids = grad_ids.float()
    acc = torch.zeros(hidden.shape, dtype=torch.float32, device=hidden.device) if want_h else None
    for v0 in range(0, vocab, width):
        v1 = min(v0 + width, vocab)
        w_slice = weight[v0:v1]
        logits = _mm_fp32(hidden, w_slice.t()) if cuda_lp else h32 @ w32[v0:v1].t()
        d = logits.sub_(row_max[:, None]).exp_().mul_(grad_sum_exp[:, None])
        local = ids - v0
        here = inside & (local >= 0) & (local < v1 - v0)
        # scatter_add_ sums duplicate ids; ids of other slices add 0.0 at a clamped column.
        d.scatter_add_(1, local.clamp(0, v1 - v0 - 1), torch.where(here, grad_ids, 0.0))
        d = d.to(hidden.dtype)  # the one rounding of d_logits
        if want_w:
            if main_grad is not None:
                _addmm_fp32_(main_grad[v0:v1], d.t(), hidden)
            elif cuda_lp:
                grad_w[v0:v1] = torch.mm(d.t(), hidden)
            else:
                grad_w[v0:v1] = (d.float().t() @ h32).to(weight.dtype)
        if want_h:
            if cuda_lp:
                _addmm_fp32_(acc, d, w_slice)
            else:
                acc.addmm_(d.float(), w32[v0:v1])
    if want_h:
        grad_h.copy_(acc)
    return grad_h, grad_w


# --- CUDA path -----------------------------------------------------------------------------------

try:
    from megatron.context_parallel.head import vocab_triton

    _TRITON_ERROR: Optional[BaseException] = None
except Exception as exc:  # noqa: BLE001 - any import failure means "no kernels"
    vocab_triton = None
    _TRITON_ERROR = exc

try:
    from megatron.context_parallel.head import vocab_gluon
except Exception:  # noqa: BLE001 - no Gluon (older Triton): the Triton d_logits kernel
    vocab_gluon = None

_WARNED = set()
_SM_COUNT = {}


def _warn_once(what: str, why: str) -> None:
    if what not in _WARNED:
        _WARNED.add(what)
        warnings.warn(f"megatron_cp::{what}: {why}; using the torch path", stacklevel=3)


def _sm_count(device: torch.device) -> int:
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _SM_COUNT:
        _SM_COUNT[index] = torch.cuda.get_device_properties(index).multi_processor_count
    return _SM_COUNT[index]


def _row_major(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def _tma_ok_tensor(t: torch.Tensor) -> bool:
    """Whether the copy engine can address the 2-D tensor ``t``: a 2-byte dtype on the GPU,
    16-byte aligned base and row stride, unit column stride."""
    return (
        t.element_size() == 2
        and t.is_cuda
        and t.data_ptr() % 16 == 0
        and (t.stride(0) * 2) % 16 == 0
        and t.stride(1) == 1
    )


def tma_ok(*tensors: torch.Tensor) -> bool:
    """Whether the copy engine (TMA) can address every one of the 2-D ``tensors``: what the
    Gluon kernels need of their operands, and the Triton kernels of theirs to take ``use_tma``."""
    return all(_tma_ok_tensor(t) for t in tensors)


def _use_tma(cfg, *tensors: torch.Tensor) -> bool:
    """The ``use_tma`` of a Triton launch of configuration ``cfg`` over ``tensors``: configured
    (``tma``) and every tensor addressable by the copy engine."""
    return bool(cfg.get("tma")) and tma_ok(*tensors)


def _kernel_path(kernel: str, hidden: torch.Tensor, weight: torch.Tensor, k: int = 0) -> str:
    """Which implementation runs ``kernel`` on CUDA inputs: "gluon", "triton" or "torch".

    ``kernel``: "stats" (the forward without a top-k), "topk" (the forward with top-k ``k``) or
    "dlogits" (the backward's ``d_logits``). The one place the choice is made:

    * "torch" (``_stats_torch`` / ``_backward_torch`` on cuBLAS products): Triton cannot be
      imported (warned once), an empty product, or ``k > 64`` (the kernels keep the running
      top-k in registers);
    * "gluon" (the warp-specialised Hopper kernels of ``vocab_gluon``): configured
      (``pingpong``), no ``promote`` (only the Triton kernels add blocks with IEEE fp32),
      operands the copy engine can load (bf16 / fp16 on the GPU, 16-byte aligned rows), and
      the kernel builds for this device and dtype (Hopper; tried once, warned on failure); the
      top-k also needs the grouped selection over the Gluon kernel's column groups;
    * "triton" (``vocab_triton``): everything else: fp32 inputs, ``promote``, unaligned
      operands, other GPUs.
    """
    if vocab_triton is None:
        op = "vocab_stats_backward" if kernel == "dlogits" else "vocab_stats"
        _warn_once(op, f"Triton unavailable ({_TRITON_ERROR})")
        return "torch"
    if hidden.shape[0] == 0 or weight.shape[0] == 0 or k > _KERNEL_MAX_K:
        return "torch"
    cfg = _config({"stats": "fwd", "topk": "fwd_topk", "dlogits": "bwd"}[kernel], hidden.dtype)
    if not cfg["pingpong"] or cfg["promote"] or not cfg["tma"] or vocab_gluon is None:
        return "triton"
    if kernel == "topk" and not (cfg["grouped"] and cfg["G"] == vocab_gluon.TOPK_CONFIG["G"]):
        return "triton"
    # The kernels read row-major copies of operands that are not (see _stats_kernel).
    loadable = hidden.is_cuda and tma_ok(_row_major(hidden), _row_major(weight))
    if loadable and vocab_gluon.builds(hidden.device, hidden.dtype, kernel, k):
        return "gluon"
    return "triton"


def choose_splits(
    row_blocks: int,
    tiles: int,
    slots: int,
    k: int = 0,
    max_splits: int = 64,
    pass_cost: float = 0.05,
    ragged_end: bool = True,
) -> int:
    """Vocabulary splits per row block that minimise the modelled run time.

    Every program walks ``L = ceil(tiles / S)`` tiles; ``ceil(row_blocks * S / slots)`` waves of
    them run one after another. With a top-k each split also restarts the running top-k: its first
    tiles need up to ``k`` selection passes each, later ones one or two. A simulation on random
    logits (128 rows, 256 columns, k = 20) gives about ``2.2 * k * sqrt(L)`` passes per split of
    ``L`` tiles; one pass over a whole tile costs about 5% of its matmul (H200, H = 5120), one
    over grouped candidates about 1% (``pass_cost``). Starting a program (pipeline fill,
    partial-result stores) is counted as a quarter tile. ``ragged_end``: the waves do not run in
    lockstep; programs finish at scattered times, and the launch ends about one program's length
    after its work would fill the slots evenly, so one program is counted on top (H200, the
    kernel alone: with it the model picks the fastest measured split count, or one within 0.5%
    of it, at all four benchmark shapes with and without a top-k; without it, counts 1-5% slower
    at three of them). Ties go to fewer splits.
    """
    best, best_cost = 1, None
    for splits in range(1, max(1, min(tiles, max_splits)) + 1):
        per = -(-tiles // splits)
        waves = -(-(row_blocks * splits) // slots)
        passes = min(per * k, 2.2 * k * per**0.5)
        program = per + pass_cost * passes
        cost = waves * (program + 0.25) + (program if ragged_end else 0.0)
        if best_cost is None or cost < best_cost - 1e-9:
            best, best_cost = splits, cost
    return best


def forward_splits(
    n: int,
    vocab: int,
    k: int,
    slots: int,
    grouped: Optional[bool] = None,
    dtype: torch.dtype = torch.bfloat16,
) -> int:
    """Vocabulary splits per row block the forward kernel uses for this shape (``grouped``: the
    top-k selection over grouped candidates or over every element; None for the configured
    one; ``dtype``: the inputs', which picks the tile)."""
    cfg = _config("fwd_topk" if k else "fwd", dtype)
    if cfg.get("splits"):
        return int(cfg["splits"])
    if grouped is None:
        grouped = _grouped_topk(k)
    # The model's search costs ~40-70 us of Python, which a GPU waiting on the launch would see:
    # memoised on everything it reads.
    return _splits_for(
        n,
        vocab,
        k,
        slots * cfg["ctas_per_sm"],
        bool(grouped),
        cfg["BM"],
        cfg["BN"],
        cfg.get("pass_cost"),
        int(cfg.get("passes", 0)),
    )


@functools.lru_cache(maxsize=4096)
def _splits_for(n, vocab, k, slots, grouped, bm, bn, pass_cost, passes):
    row_blocks = -(-n // bm)
    tiles = -(-vocab // bn)
    # Grouped passes are cheaper than choose_splits' default (a pass over a whole tile); a fixed
    # number of them per tile costs the same whatever the split, like no top-k at all.
    extra = {"pass_cost": pass_cost} if grouped and pass_cost is not None else {}
    # The ragged end favours many short programs, but with a top-k every split adds k slots a
    # row to the merge, which the model does not count: measured on an H200, the top-20 call at
    # 8,192 x 37,984 ran 0.04-0.06 GEMMs slower with the 30 splits it then picked than with 2,
    # so the top-k is modelled without it.
    extra["ragged_end"] = not k
    if grouped and passes:
        k = 0
    # A few row blocks (small batches) may use more splits than the default cap, to fill the
    # device.
    extra["max_splits"] = max(64, slots // row_blocks)
    splits = choose_splits(row_blocks, tiles, slots, k, **extra)
    per = -(-tiles // splits)
    return -(-tiles // per)


def _grouped_topk(k: int) -> bool:
    """Whether the forward's top-k takes grouped candidates (the configured default) or every
    element."""
    return bool(k) and bool(current_kernel_config()["fwd_topk"].get("grouped"))


def _split_buffers(splits: int, parts: int, n: int, k: int, device):
    """The forward kernel's per-split outputs for ``n`` rows: fp32 ``[splits, parts, n]`` (max |
    sum_exp | target (| largest logit not offered)), then the top-k slots, fp32 and int32
    ``[splits, n, KP]`` (``KP`` the power of two the kernel keeps, 0 without a top-k)."""
    kp = vocab_triton._next_pow2(max(k, 2)) if k else 0
    return (
        torch.empty(splits, parts, n, dtype=torch.float32, device=device),
        torch.empty(splits, n, kp, dtype=torch.float32, device=device),
        torch.empty(splits, n, kp, dtype=torch.int32, device=device),
    )


def _stats_kernel(hidden, weight, target, k, slots, grouped=None, gluon=False):
    """The forward kernel (``gluon``: the Gluon one, else the Triton one; ``_kernel_path``
    chooses) plus the tiny combine of its partial results (per split, or per column tile for the
    Gluon k = 0 kernel). ``grouped``: the top-k over grouped candidates or over every element
    (Triton only); None for the configured one.

    With grouped top-k candidates (see ``vocab_triton._offer_grouped``) the merged top-k is
    exact unless a logit left out of the selection (a column group's third largest or lower in a
    tile, or with a fixed number of passes per tile, one they did not reach) is at or above the
    row's k-th value: the kernel reports the largest one per row, and those rows (random logits,
    k = 20, H200: 0.010% at 151,936 columns, 0.09% at 37,984) are selected again over every
    element by ``_reselect_into``.
    """
    n, vocab = hidden.shape[0], weight.shape[0]
    cfg = _config("fwd_topk" if k else "fwd", hidden.dtype)
    hidden, weight = _row_major(hidden), _row_major(weight)
    if gluon and not k:
        part = torch.empty(
            vocab_gluon.stats_tiles(vocab), 3, n, dtype=torch.float32, device=hidden.device
        )
        vocab_gluon.launch_stats_pingpong(hidden, weight, target, part, slots)
        return _combine_splits(part, None, None, 0, vocab)[:5]
    if grouped is None:
        grouped = _grouped_topk(k)
    if gluon and grouped:
        row_bytes = hidden.shape[1] * hidden.element_size()
        splits = vocab_gluon.topk_splits(n, vocab, slots, row_bytes)
        part, top_v, top_i = vocab_gluon.topk_buffers(n, vocab, k, splits, hidden.device)
        vocab_gluon.launch_topk_pingpong(
            hidden, weight, target, k, part, top_v, top_i, splits, slots, passes=cfg["passes"]
        )
    else:
        splits = forward_splits(n, vocab, k, slots, grouped, hidden.dtype)
        part, top_v, top_i = _split_buffers(splits, 4 if grouped else 3, n, k, hidden.device)
        use_tma = _use_tma(cfg, hidden, weight)
        vocab_triton.launch_stats_fwd(
            hidden, weight, target, k, part, top_v, top_i, splits, cfg, grouped, use_tma=use_tma
        )
    row_max, sum_exp, target_logit, values, ids, redo = _combine_splits(
        part, top_v, top_i, k, vocab
    )
    if redo is not None:
        _reselect_into(hidden, weight, redo, values, ids, k, slots, cfg)
    return row_max, sum_exp, target_logit, values, ids


def _reselect_into(hidden, weight, redo, values, ids, k, slots, cfg) -> torch.Tensor:
    """Overwrites the top-k ``values`` / ``ids`` of the rows flagged in the bool ``[n]`` mask
    ``redo`` with their exact top-k over every element; returns the int32 ``[1]`` device count
    of those rows. No host read: whatever the count, the launches are the same.

    * the first ``ahead = min(n, cfg["reselect_ahead"], what fits _RESELECT_BYTES of keys)``
      flagged rows: the forward's tile code writes their logits' order keys and a chunked top-k
      picks the k largest, written straight into their rows (one read of the weight for all of
      them; kernels that stop at the device-side count);
    * any further ones (``_select_listed``): the every-element forward kernel over a list of
      rows whose length only the device knows.
    """
    n, vocab = hidden.shape[0], weight.shape[0]
    width = vocab_triton.key_columns(vocab, cfg)
    ahead = min(n, int(cfg.get("reselect_ahead", 0)), _RESELECT_BYTES // (8 * width))
    count = redo.sum(dtype=torch.int32).reshape(1)
    flagged = torch.nonzero_static(redo, size=n, fill_value=0).squeeze(1)
    if ahead:
        first = flagged[:ahead]
        keys = torch.empty(ahead, width, dtype=torch.int64, device=hidden.device)
        rows = hidden.index_select(0, first)
        tile = _keys_tile(cfg)
        use_tma = _use_tma(tile, rows, weight)
        vocab_triton.logit_keys(rows, weight, keys, tile, slots, count, use_tma=use_tma)
        # The grouped selection's k-th value is a floor for the exact one: k logits reach it.
        # Lowered by a margin, as these logits are computed again, by another kernel than the
        # forward's when that was the Gluon one: a last-place difference must not put the k-th
        # logit under the floor (it would be lost: -inf and id -1 in its place).
        kth = values[:, k - 1]
        floor = kth - (_FLOOR_MARGIN[0] + _FLOOR_MARGIN[1] * kth.abs())
        vocab_triton.topk_of_keys(keys, count, k, vocab, first, values, ids, floor)
    if ahead < n:
        more = (count - ahead).clamp_(min=0).to(torch.int64)
        _select_listed(hidden, weight, torch.cat([more, flagged[ahead:]]), values, ids, k, cfg)
    return count


def _keys_tile(cfg):
    """The logit-keys kernel's tile: the forward's with one warpgroup on 64 rows (few rows to
    compute; each warpgroup of the forward's 128-row tile runs the same wgmma instructions on
    its 64 rows, so the logits keep their bits)."""
    if cfg["BM"] == 128 and cfg["warps"] == 8:
        return dict(cfg, BM=64, warps=4)
    return cfg


def _listed_splits(m: int, vocab: int, k: int, cfg) -> int:
    """Vocabulary splits of a row-list launch for up to ``m`` rows: as many as keep its per-split
    top-k slots within ``_LISTED_BYTES`` (at most 16), so the few rows it usually has still
    spread over many programs."""
    kp = vocab_triton._next_pow2(max(k, 2))
    tiles = -(-vocab // cfg["BN"])
    return max(1, min(16, tiles, _LISTED_BYTES // max(1, m * kp * 8)))


def _select_listed(hidden, weight, row_list, values, ids, k, cfg) -> None:
    """The exact top-k over every element of the rows ``row_list[1 : 1 + c]`` (int64 ``[1 + m]``,
    ``c = row_list[0]`` known only to the device), into those rows of ``values`` / ``ids``: the
    every-element forward kernel over the listed rows, launched for all ``m`` (blocks past ``c``
    stop at once), then the split merge straight into the rows."""
    m, vocab = row_list.shape[0] - 1, weight.shape[0]
    splits = _listed_splits(m, vocab, k, cfg)
    part, top_v, top_i = _split_buffers(splits, 3, m, k, hidden.device)
    # A listed row block is not a run of rows a descriptor could load: pointer loads.
    vocab_triton.launch_stats_fwd(
        hidden, weight, None, k, part, top_v, top_i, splits, cfg, False, row_list, use_tma=False
    )
    vocab_triton.merge_topk(top_v, top_i, k, vocab, row_list, values, ids)


def _combine_splits(part, top_v, top_i, k, vocab):
    """Merges the forward kernel's per-split results (a few torch ops and ``merge_topk``'s
    kernel, no host sync).

    ``part``: fp32 ``[S, 3 or 4, n]`` (max, sum_exp, target logit, and with grouped candidates the
    largest logit left out); ``top_v`` / ``top_i``: fp32 / int32 ``[S, n, KP]`` slots. Returns
    fp32 ``row_max``, ``sum_exp``, ``target_logit`` ``[n]``, fp32 ``[n, k]`` values, int64
    ``[n, k]`` ids, and a bool ``[n]`` mask of the rows whose top-k must be selected again (None
    without grouped candidates).
    """
    n = part.shape[2]
    split_max = part[:, 0]
    row_max = split_max.amax(dim=0)
    sum_exp = (part[:, 1] * torch.exp(split_max - row_max)).sum(dim=0)
    target_logit = part[:, 2].sum(dim=0)
    if not k:
        values = torch.empty(n, 0, dtype=torch.float32, device=part.device)
        ids = torch.empty(n, 0, dtype=torch.int64, device=part.device)
        return row_max, sum_exp, target_logit, values, ids, None
    # torch.topk over the [n, S * KP] candidates took 0.4-0.9 ms (H200, n = 8,192-20,436).
    values, ids = vocab_triton.merge_topk(top_v, top_i, k, vocab)
    # ">=": a value tied with the k-th may precede it (lower column) and was left out.
    redo = part[:, 3].amax(dim=0) >= values[:, k - 1] if part.shape[1] > 3 else None
    return row_max, sum_exp, target_logit, values, ids, redo


def _stats_cuda(hidden, weight, target, k, chunk_size):
    path = _kernel_path("topk" if k else "stats", hidden, weight, k)
    if path == "torch":
        return _stats_torch(hidden, weight, target, k, chunk_size)
    slots = _sm_count(hidden.device)
    return _stats_kernel(hidden, weight, target, k, slots, gluon=path == "gluon")


def _sorted_ids(ids, grad_ids, vocab: int):
    """Each row's ids sorted (int32), those outside the shard moved to the end as ``vocab`` (a
    column no tile holds), and their gradients (fp32) in that order: the d_logits kernels find
    each tile's run of ids from per-tile search positions (``_tile_positions``)."""
    n = ids.shape[0]
    if ids.shape[1] == 0:
        keys = torch.full((n, 1), vocab, dtype=torch.int32, device=ids.device)
        return keys, torch.zeros(n, 1, dtype=torch.float32, device=ids.device)
    inside = (ids >= 0) & (ids < vocab)
    keys, order = torch.where(inside, ids, vocab).to(torch.int32).sort(dim=1)
    return keys, grad_ids.float().gather(1, order)


def _tile_positions(keys, edges_base, v0: int, v1: int, bn: int):
    """int32 ``[n, tiles + 1]``: per row, where each ``bn``-column tile of the slice ``v0 ..
    v1`` starts in the sorted ``keys`` (``edges_base``: the tile edges of a slice at 0)."""
    tiles = -(-(v1 - v0) // bn)
    edges = (edges_base[: tiles + 1] + v0).clamp_(max=v1)
    n = keys.shape[0]
    return torch.searchsorted(keys, edges.expand(n, tiles + 1).contiguous(), out_int32=True)


def _dlogits_launcher(hidden, weight, d_buf, cfg, gluon: bool):
    """The d_logits launch of every slice, called with ``vocab_triton.launch_dlogits``'s
    arguments up to ``v0``: the Gluon kernel, or the Triton one with ``cfg``, its program count
    and ``use_tma`` (operands and the ``d_buf`` it writes slices of) chosen here."""
    if gluon:
        sms = _sm_count(hidden.device)
        return lambda *args: vocab_gluon.launch_dlogits_pingpong(*args, sms)
    # Programs of a persistent d_logits launch; CPU tensors only reach here under Triton's
    # interpreter (tests), where a few programs exercise the tile walk.
    slots = _sm_count(hidden.device) * cfg["ctas_per_sm"] if hidden.is_cuda else 4
    use_tma = _use_tma(cfg, hidden, weight, d_buf)
    return functools.partial(vocab_triton.launch_dlogits, cfg=cfg, slots=slots, use_tma=use_tma)


def _slice_products(d, hidden, weight, v0, v1, grads, acc, main_grad, want_h, want_w) -> None:
    """The cuBLAS products of one slice's ``d`` (``[n, v1 - v0]``): with ``want_w`` its
    ``grad_weight`` rows (added into ``main_grad`` when given, else into ``grads[1]``); with
    ``want_h`` its share of ``grad_hidden``: straight into ``grads[0]`` when ``acc`` is None (one
    slice), else into the fp32 accumulator ``acc``."""
    grad_h, grad_w = grads
    if want_w:
        if main_grad is not None:
            _addmm_fp32_(main_grad[v0:v1], d.t(), hidden)
        else:
            torch.mm(d.t(), hidden, out=grad_w[v0:v1])
    if want_h:
        if acc is None:
            torch.mm(d, weight, out=grad_h)
        elif v0 == 0:
            _mm_fp32_out(d, weight[v0:v1], acc)
        else:
            _addmm_fp32_(acc, d, weight[v0:v1])


def _backward_kernel(
    hidden,
    weight,
    row_max,
    grad_sum,
    ids,
    grad_ids,
    chunk_size,
    want_h,
    want_w,
    main_grad,
    gluon=False,
):
    """The backward on the kernels: per vocabulary slice, the ``d_logits`` kernel (``gluon``:
    the Gluon one, else the Triton one; ``_kernel_path`` chooses), then cuBLAS products."""
    n, vocab = hidden.shape[0], weight.shape[0]
    grad_h, grad_w = _backward_outputs(hidden, weight, want_h, want_w, main_grad)
    if n == 0 or vocab == 0 or not (want_h or want_w):
        return grad_h, grad_w
    cfg = _config("bwd", hidden.dtype)
    hidden, weight = _row_major(hidden), _row_major(weight)
    bn = vocab_gluon.CONFIG["BN"] if gluon else cfg["BN"]
    width = _slice_width(n, vocab, chunk_size, hidden.element_size(), bn)
    keys, key_grads = _sorted_ids(ids, grad_ids, vocab)
    row_max = row_max.float().contiguous()
    grad_sum = grad_sum.float().contiguous()

    # Rows padded to 16 bytes, so the copy engine can store any slice's d_logits.
    pitch = -(-width * hidden.element_size() // 16) * 16 // hidden.element_size()
    d_buf = torch.empty(n, pitch, dtype=hidden.dtype, device=hidden.device)[:, :width]
    launch = _dlogits_launcher(hidden, weight, d_buf, cfg, gluon)
    acc = (
        torch.empty(n, hidden.shape[1], dtype=torch.float32, device=hidden.device)
        if want_h and width < vocab
        else None
    )
    edges_base = torch.arange(0, -(-width // bn) + 1, device=hidden.device, dtype=torch.int32) * bn
    grads = (grad_h, grad_w)
    for v0 in range(0, vocab, width):
        v1 = min(v0 + width, vocab)
        pos = _tile_positions(keys, edges_base, v0, v1, bn)
        d = d_buf[:, : v1 - v0]
        launch(hidden, weight, row_max, grad_sum, keys, key_grads, pos, d, v0)
        _slice_products(d, hidden, weight, v0, v1, grads, acc, main_grad, want_h, want_w)
    if acc is not None:
        grad_h.copy_(acc)
    return grad_h, grad_w


def _backward_cuda(
    hidden, weight, row_max, grad_sum_exp, ids, grad_ids, chunk_size, want_h, want_w, main_grad
):
    args = (hidden, weight, row_max, grad_sum_exp, ids, grad_ids, chunk_size, want_h, want_w)
    path = _kernel_path("dlogits", hidden, weight)
    if path == "torch":
        return _backward_torch(*args, main_grad)
    return _backward_kernel(*args, main_grad, gluon=path == "gluon")


_lib.impl("vocab_stats", _stats_torch, "CPU")
_lib.impl("vocab_stats", _stats_cuda, "CUDA")
_lib.impl("vocab_stats_backward", _backward_torch, "CPU")
_lib.impl("vocab_stats_backward", _backward_cuda, "CUDA")


@torch.library.register_fake(f"{_NAMESPACE}::vocab_stats", lib=_lib)
def _stats_fake(hidden, weight, target, k, chunk_size):
    n = hidden.shape[0]
    vec = hidden.new_empty((n,), dtype=torch.float32)
    return (
        vec,
        hidden.new_empty((n,), dtype=torch.float32),
        hidden.new_empty((n,), dtype=torch.float32),
        hidden.new_empty((n, k), dtype=torch.float32),
        hidden.new_empty((n, k), dtype=torch.int64),
    )


@torch.library.register_fake(f"{_NAMESPACE}::vocab_stats_backward", lib=_lib)
def _backward_fake(
    hidden, weight, row_max, grad_sum_exp, ids, grad_ids, chunk_size, want_h, want_w, main_grad
):
    grad_h = hidden.new_empty(hidden.shape) if want_h else hidden.new_empty((0,))
    wants_tensor = want_w and main_grad is None
    grad_w = weight.new_empty(weight.shape) if wants_tensor else weight.new_empty((0,))
    return grad_h, grad_w


# --- public functions ----------------------------------------------------------------------------


def _check_matrix(name: str, t, dtype=None) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a tensor, got {type(t).__name__}")
    if t.dim() != 2:
        raise ValueError(f"{name} must be 2-D, got shape {tuple(t.shape)}")
    if dtype is not None and t.dtype != dtype:
        raise ValueError(f"{name} must be {dtype}, got {t.dtype}")


def _check_pair(hidden, weight) -> None:
    _check_matrix("hidden", hidden)
    _check_matrix("weight", weight)
    if hidden.dtype not in _DTYPES:
        raise ValueError(f"hidden must be bf16, fp16 or fp32, got {hidden.dtype}")
    if weight.dtype != hidden.dtype:
        raise ValueError(f"weight is {weight.dtype} but hidden is {hidden.dtype}")
    if weight.shape[1] != hidden.shape[1]:
        raise ValueError(
            f"weight has {weight.shape[1]} columns but hidden has {hidden.shape[1]} (H must match)"
        )
    if weight.device != hidden.device:
        raise ValueError(f"weight is on {weight.device} but hidden is on {hidden.device}")


def _check_rows(name: str, t, n: int, device, dtype, width=None) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a tensor, got {type(t).__name__}")
    shape = (n,) if width is None else (n, width)
    if tuple(t.shape) != shape or t.dtype != dtype:
        raise ValueError(f"{name} must be {dtype} {list(shape)}, got {t.dtype} {list(t.shape)}")
    if t.device != device:
        raise ValueError(f"{name} is on {t.device} but hidden is on {device}")


def _chunk_arg(chunk_size) -> int:
    if chunk_size is None:
        return 0
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1:
        raise ValueError(f"chunk_size must be a positive int or None, got {chunk_size!r}")
    return chunk_size


def vocab_stats(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    target: Optional[torch.Tensor],
    k: int,
    chunk_size: Optional[int] = None,
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-row statistics of the fp32 logits ``hidden @ weight.T`` of one vocabulary shard.

    Args:
        hidden: ``[n, H]`` bf16, fp16 or fp32; n may be 0.
        weight: ``[Vs, H]``, hidden's dtype and device (this rank's vocabulary shard).
        target: int64 ``[n]`` shard-local ids, or None. Ids outside ``[0, Vs)`` are "not in this
            shard" and give ``target_logit`` 0.0.
        k: top-k width, ``0 <= k <= Vs``.
        chunk_size: rows per chunk on the torch paths (CPU; CUDA with ``k > 64``); None picks
            chunks of at most 256 MiB of fp32 logits. The CUDA kernel ignores it.

    Returns:
        ``(row_max, sum_exp, target_logit, topk_values, topk_ids)``: fp32 ``[n]`` max logit,
        fp32 ``[n]`` ``sum_j exp(l_ij - row_max_i)``, fp32 ``[n]`` target logit, fp32 ``[n, k]``
        descending logits, int64 ``[n, k]`` their shard-local ids. No autograd: the head's
        Function calls ``vocab_stats_backward``.

    Raises:
        TypeError, ValueError: on wrong types, shapes, dtypes, devices or ``k``.
    """
    _check_pair(hidden, weight)
    n, vocab = hidden.shape[0], weight.shape[0]
    if target is not None:
        _check_rows("target", target, n, hidden.device, torch.int64)
    if isinstance(k, bool) or not isinstance(k, int) or not 0 <= k <= vocab:
        raise ValueError(f"k must be an int in [0, {vocab}] (the shard's vocabulary), got {k!r}")
    return torch.ops.megatron_cp.vocab_stats(hidden, weight, target, k, _chunk_arg(chunk_size))


def _check_backward_args(hidden, weight, row_max, grad_sum_exp, ids, grad_ids, main_grad) -> None:
    """``vocab_stats_backward``'s argument checks (raises as it documents)."""
    _check_pair(hidden, weight)
    n, dev = hidden.shape[0], hidden.device
    _check_rows("row_max", row_max, n, dev, torch.float32)
    _check_rows("grad_sum_exp", grad_sum_exp, n, dev, torch.float32)
    _check_matrix("ids", ids, torch.int64)
    m = ids.shape[1]
    _check_rows("ids", ids, n, dev, torch.int64, m)
    _check_rows("grad_ids", grad_ids, n, dev, torch.float32, m)
    if main_grad is not None:
        _check_rows("main_grad", main_grad, weight.shape[0], dev, torch.float32, weight.shape[1])


def vocab_stats_backward(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    row_max: torch.Tensor,
    grad_sum_exp: torch.Tensor,
    ids: torch.Tensor,
    grad_ids: torch.Tensor,
    chunk_size: Optional[int] = None,
    want_hidden: bool = True,
    want_weight: bool = True,
    *,
    main_grad: Optional[torch.Tensor] = None,
) -> Tuple[Optional[torch.Tensor], Optional[torch.Tensor]]:
    """Gradients of hidden and weight from gradients of ``sum_exp`` and of picked logits.

    Args:
        hidden, weight: the forward's inputs (``[n, H]``, ``[Vs, H]``, same dtype).
        row_max: fp32 ``[n]``, the forward's ``row_max`` (the logits are recomputed).
        grad_sum_exp: fp32 ``[n]``, the gradient reaching ``sum_exp``.
        ids: int64 ``[n, m]`` shard-local ids of logits with a direct gradient (target, top-k);
            ids outside ``[0, Vs)`` contribute nothing, repeated ids add up.
        grad_ids: fp32 ``[n, m]``, their gradients.
        chunk_size: vocabulary columns per backward slice; None picks the widest balanced
            slices within a 512 MiB ``d_logits`` budget.
        want_hidden, want_weight: which gradients to form.
        main_grad: optional fp32 ``[Vs, H]`` buffer; ``grad_weight`` is added into it (fp32) and
            None returned in its place.

    Returns:
        ``(grad_hidden, grad_weight)``: ``[n, H]`` in hidden's dtype and ``[Vs, H]`` in weight's
        dtype, each None when not wanted. ``d_logits`` is rounded once to the input dtype; each
        product is accumulated in fp32 over its whole reduction dimension and rounded once.

    Raises:
        TypeError, ValueError: on wrong types, shapes, dtypes or devices.
    """
    _check_backward_args(hidden, weight, row_max, grad_sum_exp, ids, grad_ids, main_grad)
    grad_h, grad_w = torch.ops.megatron_cp.vocab_stats_backward(
        hidden,
        weight,
        row_max,
        grad_sum_exp,
        ids,
        grad_ids,
        _chunk_arg(chunk_size),
        bool(want_hidden),
        bool(want_weight),
        main_grad,
    )
    return (
        grad_h if want_hidden else None,
        grad_w if want_weight and main_grad is None else None,
    )
