// Row-copy kernels of megatron.context_parallel (see row_copy.h). Torch-free on purpose.
//
// Work split: a field's rows are copied by groups of `tpr` threads (a power of two, at most
// the block), one group per row, so a block covers kBlock / tpr consecutive output rows of one
// field. Narrow rows (a 4-byte per-token field) put one row on each thread and keep both the
// index loads and the stores coalesced; wide rows (10 KB hidden states, 300 KB logits rows)
// put up to a block on a row (the launcher's max_threads_per_row caps it) and stride it with
// 16-byte vectors. Blocks of all fields of a launch are numbered one after another, so a block
// finds its field by a short scan of the block offsets, which is uniform across the block and
// costs no divisions.

#include "row_copy.h"

#include <cassert>

namespace megatron_cp {
namespace {

constexpr int kBlockShift = 8;
constexpr int kBlock = 1 << kBlockShift;
static_assert(kBlock == kBlockThreads, "row_copy.h's kBlockThreads must match the kernel");
// Loads each thread issues before its first store: enough bytes in flight per SM to cover
// HBM latency without spilling registers.
constexpr int kUnroll = 4;

struct FieldPlan {
  const unsigned char* src;
  unsigned char* dst;
  int64_t src_stride;
  int64_t width;
  int64_t num_vec;      // width >> vec_shift
  int64_t first_block;  // first block number of this field in the launch
  int vec_shift;        // log2 of the widest vector that the bases and width allow
  int tpr_shift;        // log2 of the threads per row
  int per_row_align;    // 1 when the source row stride allows less than vec_shift
};

struct LaunchParams {
  FieldPlan fields[kMaxFields];
  const int64_t* index;
  int64_t num_rows;
  int64_t num_src_rows;
  int64_t total_blocks;
  int num_fields;
};

template <typename V>
__device__ __forceinline__ V zero_vec() {
  return V(0);
}
template <>
__device__ __forceinline__ uint4 zero_vec<uint4>() {
  return make_uint4(0u, 0u, 0u, 0u);
}
template <>
__device__ __forceinline__ uint2 zero_vec<uint2>() {
  return make_uint2(0u, 0u);
}

template <typename V>
__device__ __forceinline__ void copy_row(const unsigned char* src_row, unsigned char* dst_row,
                                         int64_t num_vec, int lane, int tpr) {
  V* dst = reinterpret_cast<V*>(dst_row);
  if (src_row == nullptr) {
    const V z = zero_vec<V>();
    for (int64_t j = lane; j < num_vec; j += tpr) dst[j] = z;
    return;
  }
  const V* src = reinterpret_cast<const V*>(src_row);
  for (int64_t j = lane; j < num_vec; j += int64_t(kUnroll) * tpr) {
    V v[kUnroll];
#pragma unroll
    for (int k = 0; k < kUnroll; ++k) {
      if (j + int64_t(k) * tpr < num_vec) v[k] = src[j + int64_t(k) * tpr];
    }
#pragma unroll
    for (int k = 0; k < kUnroll; ++k) {
      if (j + int64_t(k) * tpr < num_vec) dst[j + int64_t(k) * tpr] = v[k];
    }
  }
}

__global__ void __launch_bounds__(kBlock) row_copy_kernel(const __grid_constant__ LaunchParams p) {
  for (int64_t b = blockIdx.x; b < p.total_blocks; b += gridDim.x) {
    int f = 0;
    while (f + 1 < p.num_fields && b >= p.fields[f + 1].first_block) ++f;
    const FieldPlan& fp = p.fields[f];
    const int tpr_shift = fp.tpr_shift;
    const int64_t row =
        ((b - fp.first_block) << (kBlockShift - tpr_shift)) + (threadIdx.x >> tpr_shift);
    if (row >= p.num_rows) continue;
    const int lane = threadIdx.x & ((1 << tpr_shift) - 1);
    const int64_t slot = p.index[row];
    assert(slot < p.num_src_rows);
    const unsigned char* src_row = slot < 0 ? nullptr : fp.src + slot * fp.src_stride;
    unsigned char* dst_row = fp.dst + row * fp.width;
    // The host capped the vector width by everything but the source row stride. When that
    // stride is coarser-aligned than the cap, each source row's own address sets the width,
    // so a packed row of, say, 10484 bytes still moves one row in four with 16-byte vectors.
    int vec_shift = fp.vec_shift;
    if (fp.per_row_align && src_row != nullptr) {
      const unsigned long long addr = reinterpret_cast<uintptr_t>(src_row);
      const unsigned long long bits = addr | (1ull << vec_shift);
      vec_shift = __ffsll(static_cast<long long>(bits)) - 1;
    }
    const int64_t num_vec = fp.width >> vec_shift;
    const int tpr = 1 << tpr_shift;
    switch (vec_shift) {
      case 4:
        copy_row<uint4>(src_row, dst_row, num_vec, lane, tpr);
        break;
      case 3:
        copy_row<uint2>(src_row, dst_row, num_vec, lane, tpr);
        break;
      case 2:
        copy_row<uint32_t>(src_row, dst_row, num_vec, lane, tpr);
        break;
      case 1:
        copy_row<uint16_t>(src_row, dst_row, num_vec, lane, tpr);
        break;
      default:
        copy_row<unsigned char>(src_row, dst_row, num_vec, lane, tpr);
        break;
    }
  }
}

int lowest_bit_shift(uint64_t bits) {
  int shift = 0;
  while (shift < 4 && ((bits >> shift) & 1u) == 0) ++shift;
  return shift;
}

// Widest vector (log2 bytes, at most 16 bytes) dividing both base pointers and the width
// (which is also the output row stride), i.e. every address except source rows past the first.
int base_vector_shift(const RowField& field) {
  return lowest_bit_shift(reinterpret_cast<uintptr_t>(field.src) |
                          reinterpret_cast<uintptr_t>(field.dst) |
                          static_cast<uint64_t>(field.width));
}

// Widest vector every row of the field can use.
int vector_shift(const RowField& field) {
  return lowest_bit_shift((uint64_t(1) << base_vector_shift(field)) |
                          static_cast<uint64_t>(field.src_stride));
}

// log2 of a power of two in [1, kBlock], or -1 for anything else.
int power_of_two_shift(int value) {
  for (int shift = 0; shift <= kBlockShift; ++shift) {
    if (value == (1 << shift)) return shift;
  }
  return -1;
}

// Threads per row, log2: enough to give each its own vector, capped at `cap_shift` (log2 of
// the caller's max_threads_per_row; its default and why: row_copy.h).
int threads_per_row_shift(int64_t num_vec, int cap_shift) {
  int shift = 0;
  while (shift < cap_shift && (int64_t(1) << shift) < num_vec) ++shift;
  return shift;
}

}  // namespace

cudaError_t launch_row_copy(const RowField* fields, int num_fields, const int64_t* index,
                            int64_t num_rows, int64_t num_src_rows, cudaStream_t stream,
                            int max_threads_per_row) {
  const int cap_shift = power_of_two_shift(max_threads_per_row);
  if (cap_shift < 0) return cudaErrorInvalidValue;
  if (num_rows <= 0 || num_fields <= 0) return cudaSuccess;
  for (int start = 0; start < num_fields; start += kMaxFields) {
    LaunchParams p{};
    p.index = index;
    p.num_rows = num_rows;
    p.num_src_rows = num_src_rows;
    int n = 0;
    int64_t blocks = 0;
    for (int i = start; i < num_fields && i < start + kMaxFields; ++i) {
      const RowField& in = fields[i];
      if (in.width <= 0) continue;  // an empty field has nothing to write
      FieldPlan& fp = p.fields[n++];
      fp.src = static_cast<const unsigned char*>(in.src);
      fp.dst = static_cast<unsigned char*>(in.dst);
      fp.src_stride = in.src_stride;
      fp.width = in.width;
      fp.vec_shift = base_vector_shift(in);
      fp.per_row_align = vector_shift(in) < fp.vec_shift ? 1 : 0;
      // Threads per row follow the widest vector; rows that must use narrower ones loop more.
      fp.num_vec = in.width >> fp.vec_shift;
      fp.tpr_shift = threads_per_row_shift(fp.num_vec, cap_shift);
      fp.first_block = blocks;
      const int64_t rows_per_block = int64_t(1) << (kBlockShift - fp.tpr_shift);
      blocks += (num_rows + rows_per_block - 1) / rows_per_block;
    }
    if (n == 0) continue;
    p.num_fields = n;
    p.total_blocks = blocks;
    // The kernel strides over blocks, so the grid may be smaller than the block count; cap
    // it well under the 2^31 - 1 grid limit.
    const int64_t grid = blocks < (int64_t(1) << 30) ? blocks : (int64_t(1) << 30);
    row_copy_kernel<<<static_cast<unsigned int>(grid), kBlock, 0, stream>>>(p);
    const cudaError_t err = cudaGetLastError();
    if (err != cudaSuccess) return err;
  }
  return cudaSuccess;
}

}  // namespace megatron_cp
