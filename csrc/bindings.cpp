// The only file that includes the binding library.
//
// GIL rule for every function below: take the Python buffers and read their pointers while
// holding the GIL, release it for the whole native job, never touch a Python object from a
// pool thread, and take it back only to build the result. Errors come back as values
// (code, item, message); streamcache/_native.py turns them into StreamcacheError subclasses.
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/vector.h>

#include <string>
#include <tuple>
#include <vector>

#include "gather.h"
#include "thread_pool.h"
#include "xxh64.h"

namespace nb = nanobind;
using namespace streamcache;

namespace {

using Bytes = nb::ndarray<const uint8_t, nb::ndim<1>, nb::c_contig, nb::device::cpu>;
using Int32s = nb::ndarray<const int32_t, nb::ndim<1>, nb::c_contig, nb::device::cpu>;
using Int64s = nb::ndarray<const int64_t, nb::ndim<1>, nb::c_contig, nb::device::cpu>;
using MutInt64s = nb::ndarray<int64_t, nb::ndim<1>, nb::c_contig, nb::device::cpu>;
using MutAny = nb::ndarray<nb::c_contig, nb::device::cpu>;

using StatusTuple = std::tuple<int, int64_t, std::string>;

StatusTuple to_tuple(const Status& s) {
  return {static_cast<int>(s.code), s.item, s.message};
}

Span span_of(const Bytes& a) { return {a.data(), a.size()}; }

std::vector<Span> spans_of(const std::vector<Bytes>& arrays) {
  std::vector<Span> out;
  out.reserve(arrays.size());
  for (const auto& a : arrays) out.push_back(span_of(a));
  return out;
}

std::vector<VarSource> var_sources(const std::vector<Bytes>& values,
                                   const std::vector<Int64s>& offsets, Status* status) {
  std::vector<VarSource> out;
  if (values.size() != offsets.size()) {
    *status = Status::Error(StatusCode::kInvalid, -1, "values and offsets lists differ in length");
    return out;
  }
  out.reserve(values.size());
  for (size_t i = 0; i < values.size(); ++i) {
    if (offsets[i].size() == 0) {
      *status = Status::Error(StatusCode::kCorrupt, static_cast<int64_t>(i),
                              "an offsets buffer must hold at least one entry");
      return out;
    }
    out.push_back({span_of(values[i]),
                   {reinterpret_cast<const uint8_t*>(offsets[i].data()), offsets[i].size() * 8}});
  }
  return out;
}

Status check_batch(const Int32s& which, const Int64s& rows) {
  if (which.size() != rows.size()) {
    return Status::Error(StatusCode::kInvalid, -1, "which and rows differ in length");
  }
  return Status::Ok();
}

uint64_t py_xxh64(const Bytes& data, uint64_t seed) {
  const uint8_t* ptr = data.data();
  size_t len = data.size();
  nb::gil_scoped_release release;
  return xxh64(ptr, len, seed);
}

std::tuple<int, int64_t, std::string, uint64_t, uint64_t> py_xxh64_file(const std::string& path,
                                                                        uint64_t seed) {
  uint64_t digest = 0, bytes = 0;
  Status s;
  {
    nb::gil_scoped_release release;
    s = xxh64_file(path, seed, &digest, &bytes);
  }
  return {static_cast<int>(s.code), s.item, s.message, digest, bytes};
}

StatusTuple py_gather_fixed(const std::vector<Bytes>& sources, size_t stride, const Int32s& which,
                            const Int64s& rows, MutAny& out) {
  Status s = check_batch(which, rows);
  if (!s.ok()) return to_tuple(s);
  std::vector<Span> spans = spans_of(sources);
  auto* out_ptr = static_cast<uint8_t*>(out.data());
  size_t out_size = out.nbytes();
  {
    nb::gil_scoped_release release;
    s = gather_fixed(spans, stride, which.data(), rows.data(), which.size(), out_ptr, out_size);
  }
  return to_tuple(s);
}

std::tuple<int, int64_t, std::string, int64_t> py_var_offsets(const std::vector<Bytes>& values,
                                                              const std::vector<Int64s>& offsets,
                                                              size_t elem_size, const Int32s& which,
                                                              const Int64s& rows,
                                                              MutInt64s& out_offsets) {
  Status s = check_batch(which, rows);
  int64_t total = 0;
  if (s.ok() && out_offsets.size() != which.size() + 1) {
    s = Status::Error(StatusCode::kInvalid, -1, "out_offsets must hold len(rows) + 1 entries");
  }
  std::vector<VarSource> sources;
  if (s.ok()) sources = var_sources(values, offsets, &s);
  if (s.ok()) {
    nb::gil_scoped_release release;
    s = var_offsets(sources, elem_size, which.data(), rows.data(), which.size(),
                    out_offsets.data(), &total);
  }
  return {static_cast<int>(s.code), s.item, s.message, total};
}

StatusTuple py_gather_var(const std::vector<Bytes>& values, const std::vector<Int64s>& offsets,
                          size_t elem_size, const Int32s& which, const Int64s& rows,
                          const Int64s& out_offsets, MutAny& out_values) {
  Status s = check_batch(which, rows);
  if (s.ok() && out_offsets.size() != which.size() + 1) {
    s = Status::Error(StatusCode::kInvalid, -1, "out_offsets must hold len(rows) + 1 entries");
  }
  std::vector<VarSource> sources;
  if (s.ok()) sources = var_sources(values, offsets, &s);
  if (s.ok()) {
    auto* out_ptr = static_cast<uint8_t*>(out_values.data());
    size_t out_size = out_values.nbytes();
    nb::gil_scoped_release release;
    s = gather_var(sources, elem_size, which.data(), rows.data(), which.size(),
                   out_offsets.data(), out_ptr, out_size);
  }
  return to_tuple(s);
}

}  // namespace

NB_MODULE(_core, m) {
  m.doc() = "streamcache native core: checksums and row gathers (GIL released)";

  m.def("xxh64", &py_xxh64, nb::arg("data"), nb::arg("seed") = 0,
        "XXH64 of a contiguous byte buffer.");
  m.def("xxh64_file", &py_xxh64_file, nb::arg("path"), nb::arg("seed") = 0,
        "XXH64 of a file: (code, item, message, digest, bytes_read).");
  m.def("gather_fixed", &py_gather_fixed, nb::arg("sources"), nb::arg("stride"),
        nb::arg("which"), nb::arg("rows"), nb::arg("out"),
        "Copy fixed-width rows into out; returns (code, item, message).");
  m.def("var_offsets", &py_var_offsets, nb::arg("values"), nb::arg("offsets"),
        nb::arg("elem_size"), nb::arg("which"), nb::arg("rows"), nb::arg("out_offsets"),
        "Output offsets of a variable-width gather; returns (code, item, message, total).");
  m.def("gather_var", &py_gather_var, nb::arg("values"), nb::arg("offsets"),
        nb::arg("elem_size"), nb::arg("which"), nb::arg("rows"), nb::arg("out_offsets"),
        nb::arg("out_values"), "Copy variable-width rows; returns (code, item, message).");
  m.def("set_num_threads", [](size_t n) { set_global_pool_size(n); }, nb::arg("threads"),
        "Size of the native thread pool (0 = hardware concurrency).");
  m.def("get_num_threads", []() { return global_pool_size(); });
}
