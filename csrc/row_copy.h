// Row-copy kernels of megatron.context_parallel: the launcher interface.
//
// This header and row_copy.cu include only the CUDA runtime, never torch, so they compile with
// a bare nvcc (CI checks them that way); binding.cpp adapts torch tensors to this interface.
//
// One launch moves rows for up to kMaxFields fields. For field f and output row p:
//
//   slot = index[p]
//   dst_f + p * width_f  <-  src_f + slot * src_stride_f   (width_f bytes)
//
// or zeros when slot < 0. The output rows are dense (row stride width_f). Reading through the
// inverse index means every output row is written exactly once, the zero rows included, and
// the writes are coalesced; the reads are whole rows of the source, gathered.
#pragma once

#include <cstdint>

#include <cuda_runtime.h>

namespace megatron_cp {

constexpr int kMaxFields = 16;

// Threads of one block. A row is copied by a power-of-two group of at most this many threads.
constexpr int kBlockThreads = 256;

// Default cap on the threads that share one row (the launcher's `max_threads_per_row`).
// Measured on an H200 (2026-12-02, a sweep of 32/64/128/256, benchmarks/RESULTS.md): 64 moved
// the bug report's 10 KB hidden rows at 98% of device-copy bandwidth against 90% with a whole
// 256-thread block per row (more rows in flight per block hide the index load), and left the
// 300 KB logits rows unchanged.
constexpr int kDefaultMaxThreadsPerRow = 64;

struct RowField {
  const void* src;     // first byte of the field in source row 0
  void* dst;           // output [num_rows, width] bytes, dense
  int64_t src_stride;  // bytes between consecutive source rows
  int64_t width;       // bytes per row of this field
};

// Launches the copy of `num_fields` fields (any number: the launcher splits into launches of
// kMaxFields) on `stream`. `index` is int64 [num_rows] on the device; a slot >= num_src_rows
// is a caller error (checked with a device assert in debug builds only). At most
// `max_threads_per_row` threads share one row: a power of two in [1, kBlockThreads], else
// cudaErrorInvalidValue and nothing is launched. Returns the launch status; cudaSuccess for an
// empty problem, which launches nothing.
cudaError_t launch_row_copy(const RowField* fields, int num_fields, const int64_t* index,
                            int64_t num_rows, int64_t num_src_rows, cudaStream_t stream,
                            int max_threads_per_row);

}  // namespace megatron_cp
