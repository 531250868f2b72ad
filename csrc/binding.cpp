// CUDA implementations of the megatron_cp row ops, registered with the torch dispatcher.
//
// The op schemas are defined once, in megatron/context_parallel/ops.py (which also registers
// the CPU, fake and autograd implementations), because CPU users must get the ops without this
// extension. This file only adds the CUDA kernels to those schemas; importing the extension
// after ops.py has defined them is what ops.py does.

#include <Python.h>

#include <optional>
#include <vector>

#include <ATen/ATen.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include "row_copy.h"

namespace megatron_cp {
namespace {

void check_index(const at::Tensor& index, const at::Tensor& data, const char* what) {
  TORCH_CHECK(index.dim() == 1, what, ": index must be 1-D, got ", index.dim(), " dims");
  TORCH_CHECK(index.scalar_type() == at::kLong, what, ": index must be int64, got ",
              index.scalar_type());
  TORCH_CHECK(index.device() == data.device(), what, ": index on ", index.device(),
              " but data on ", data.device());
}

// The threads-per-row cap for a call: the kernel's measured default unless the caller (the
// benchmark's tuning sweep) names one. Checked here so a bad value raises a readable error.
int threads_per_row_cap(const std::optional<int64_t>& requested) {
  if (!requested.has_value()) return kDefaultMaxThreadsPerRow;
  const int64_t v = *requested;
  TORCH_CHECK(v >= 1 && v <= kBlockThreads && (v & (v - 1)) == 0,
              "max_threads_per_row must be a power of two in [1, ", kBlockThreads, "], got ", v);
  return static_cast<int>(v);
}

void launch(const std::vector<RowField>& fields, const at::Tensor& index, int64_t num_src_rows,
            int max_threads_per_row) {
  const cudaError_t err = launch_row_copy(
      fields.data(), static_cast<int>(fields.size()), index.data_ptr<int64_t>(), index.numel(),
      num_src_rows, c10::cuda::getCurrentCUDAStream(), max_threads_per_row);
  TORCH_CHECK(err == cudaSuccess, "megatron_cp row copy launch failed: ", cudaGetErrorString(err));
}

std::vector<at::Tensor> scatter_rows_cuda(const at::Tensor& packed, const at::Tensor& row_source,
                                          at::IntArrayRef offsets, at::IntArrayRef widths,
                                          std::optional<int64_t> max_threads_per_row) {
  TORCH_CHECK(packed.dim() == 2 && packed.scalar_type() == at::kByte,
              "scatter_rows: packed must be uint8 [slots, W], got ", packed.scalar_type(), " ",
              packed.sizes());
  TORCH_CHECK(offsets.size() == widths.size(), "scatter_rows: ", offsets.size(), " offsets but ",
              widths.size(), " widths");
  check_index(row_source, packed, "scatter_rows");
  const int cap = threads_per_row_cap(max_threads_per_row);
  const c10::cuda::CUDAGuard guard(packed.device());
  // A row-strided view (a column slice of a wider buffer) is read in place; anything else is
  // made dense first.
  const at::Tensor src = packed.stride(1) == 1 ? packed : packed.contiguous();
  const at::Tensor index = row_source.contiguous();
  const int64_t row_bytes = src.size(1);
  const int64_t rows = index.numel();
  std::vector<at::Tensor> outs;
  std::vector<RowField> fields;
  outs.reserve(widths.size());
  fields.reserve(widths.size());
  for (size_t f = 0; f < widths.size(); ++f) {
    TORCH_CHECK(offsets[f] >= 0 && widths[f] >= 0 && offsets[f] + widths[f] <= row_bytes,
                "scatter_rows: field ", f, " bytes [", offsets[f], ", ", offsets[f] + widths[f],
                ") outside the ", row_bytes, "-byte row");
    at::Tensor out = at::empty({rows, widths[f]}, packed.options());
    RowField field;
    field.src = static_cast<const unsigned char*>(src.data_ptr()) + offsets[f];
    field.dst = out.data_ptr();
    field.src_stride = src.stride(0);
    field.width = widths[f];
    fields.push_back(field);
    outs.push_back(std::move(out));
  }
  launch(fields, index, src.size(0), cap);
  return outs;
}

// True when every dimension after the first is dense (dim 0 may have any stride).
bool rows_are_dense(const at::Tensor& t) {
  int64_t expected = 1;
  for (int64_t d = t.dim() - 1; d >= 1; --d) {
    if (t.size(d) != 1 && t.stride(d) != expected) return false;
    expected *= t.size(d);
  }
  return true;
}

at::Tensor gather_rows_cuda(const at::Tensor& src_in, const at::Tensor& index_in) {
  TORCH_CHECK(src_in.dim() >= 1, "gather_rows: src must have a row dimension");
  check_index(index_in, src_in, "gather_rows");
  const c10::cuda::CUDAGuard guard(src_in.device());
  // A slice of rows is read in place; rows that are not dense inside are made dense first.
  const at::Tensor src = rows_are_dense(src_in) ? src_in : src_in.contiguous();
  const at::Tensor index = index_in.contiguous();
  std::vector<int64_t> out_shape(src.sizes().begin(), src.sizes().end());
  out_shape[0] = index.numel();
  at::Tensor out = at::empty(out_shape, src.options().memory_format(at::MemoryFormat::Contiguous));
  int64_t inner = 1;
  for (int64_t d = 1; d < src.dim(); ++d) inner *= src.size(d);
  const int64_t elem = static_cast<int64_t>(src.element_size());
  RowField field;
  field.src = src.data_ptr();
  field.dst = out.data_ptr();
  field.src_stride = src.stride(0) * elem;
  field.width = inner * elem;
  launch({field}, index, src.size(0), kDefaultMaxThreadsPerRow);
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(megatron_cp, CUDA, m) {
  m.impl("scatter_rows", &scatter_rows_cuda);
  m.impl("gather_rows", &gather_rows_cuda);
}

}  // namespace megatron_cp

// A plain Python module with no functions: importing megatron.context_parallel._C loads this
// library, whose static initializers above register the kernels. No pybind11 needed.
extern "C" PyObject* PyInit__C(void) {
  static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_C", nullptr, -1, nullptr};
  return PyModule_Create(&module);
}
