// The only file that includes the binding library.
//
// GIL rule for every function below: take the Python buffers and read their pointers while
// holding the GIL, release it for the whole native job, never touch a Python object from a
// pool thread, and take it back only to build the result. Errors come back as values
// (code, item, message); streamcache/_native.py turns them into StreamcacheError subclasses.
//
// Array rule: every array argument is .noconvert(): it must already be a C-contiguous CPU
// array of the exact dtype (writable for outputs), or the call raises TypeError. A converting
// cast would copy silently: an output written into a copy is lost, and int64 values cast to
// uint8 are truncated. streamcache/_native.py explains a refused array in words.
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/pair.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/vector.h>

#include <array>
#include <cstddef>
#include <atomic>
#include <condition_variable>
#include <exception>
#include <mutex>
#include <stdexcept>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "copy.h"
#include "feistel.h"
#include "gather.h"
#include "ipc.h"
#include "scheduler.h"
#include "seeding.h"
#include "backups.h"
#include "split.h"
#include "thread_pool.h"
#include "xxh64.h"

namespace nb = nanobind;
using namespace streamcache;

namespace {

using Bytes = nb::ndarray<const uint8_t, nb::ndim<1>, nb::c_contig, nb::device::cpu>;
using Int32s = nb::ndarray<const int32_t, nb::ndim<1>, nb::c_contig, nb::device::cpu>;
using Int64s = nb::ndarray<const int64_t, nb::ndim<1>, nb::c_contig, nb::device::cpu>;
using MutInt64s = nb::ndarray<int64_t, nb::ndim<1>, nb::c_contig, nb::device::cpu>;
using MutInt32s = nb::ndarray<int32_t, nb::ndim<1>, nb::c_contig, nb::device::cpu>;
using MutAny = nb::ndarray<nb::c_contig, nb::device::cpu>;
using MutBytes = nb::ndarray<uint8_t, nb::ndim<1>, nb::c_contig, nb::device::cpu>;
using MutUint64s = nb::ndarray<uint64_t, nb::ndim<1>, nb::c_contig, nb::device::cpu>;
using Uint64s = nb::ndarray<const uint64_t, nb::ndim<1>, nb::c_contig, nb::device::cpu>;
using Uint32Matrix = nb::ndarray<const uint32_t, nb::ndim<2>, nb::c_contig, nb::device::cpu>;

using StatusTuple = std::tuple<int, int64_t, std::string>;

StatusTuple to_tuple(const Status& s) {
  return {static_cast<int>(s.code), s.item, s.message};
}

// Runs a native job; an exception escaping it (out of memory, say) becomes a status, so Python
// sees the project's exception family and never a bare RuntimeError.
template <typename Job>
Status guarded(Job job) {
  try {
    return job();
  } catch (const std::exception& e) {
    return Status::Error(StatusCode::kInternal, -1, std::string("native job failed: ") + e.what());
  }
}

// Sizes arrive as Python ints: a negative one is an error status, like a zero one.
Status check_positive(int64_t value, const char* name) {
  if (value <= 0) return Status::Error(StatusCode::kInvalid, -1, std::string(name) + " must be positive");
  return Status::Ok();
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

// One shard's column as a gather reads it: the buffers of each of its record batches (one, or
// the chunks of a shard read in place), converted once, when the shard is opened. A gather
// then takes one object per shard instead of one array per chunk: converting an array costs
// about what copying a 1 KB row does, so a batch of small rows from chunked shards would pay
// it for every row. It keeps the arrays, and so the mapping under them, alive.
class ColumnChunks {
 public:
  ColumnChunks(std::vector<Bytes> values, std::vector<Int64s> offsets)
      : values_(std::move(values)), offsets_(std::move(offsets)), spans_(spans_of(values_)) {
    if (!offsets_.empty()) {
      Status s;
      var_ = var_sources(values_, offsets_, &s);
      if (!s.ok()) throw std::invalid_argument(s.message);
    }
  }
  size_t size() const { return values_.size(); }
  bool has_offsets() const { return !offsets_.empty(); }
  const std::vector<Span>& spans() const { return spans_; }
  const std::vector<VarSource>& var() const { return var_; }

 private:
  std::vector<Bytes> values_;
  std::vector<Int64s> offsets_;
  std::vector<Span> spans_;
  std::vector<VarSource> var_;
};

// The columns' chunks one after another, as views (nothing copied): a row's source is its
// shard's first chunk's place in this list plus its chunk (the caller numbers them so). The
// columns must outlive the list (the caller's Python objects hold them for the call).
SpanList flat_spans(const std::vector<ColumnChunks*>& columns) {
  SpanList out;
  for (const auto* c : columns) out.add(c->spans());
  return out;
}

VarList flat_var(const std::vector<ColumnChunks*>& columns, Status* status) {
  VarList out;
  for (size_t i = 0; i < columns.size(); ++i) {
    if (!columns[i]->has_offsets()) {
      *status = Status::Error(StatusCode::kInvalid, static_cast<int64_t>(i),
                              "a column without offsets in a variable-width gather");
      return out;
    }
    out.add(columns[i]->var());
  }
  return out;
}

StatusTuple gather_fixed_from(const SpanList& spans, int64_t stride, const Int32s& which,
                              const Int64s& rows, MutAny& out) {
  Status s = check_batch(which, rows);
  if (s.ok()) s = check_positive(stride, "stride");
  if (!s.ok()) return to_tuple(s);
  auto* out_ptr = static_cast<uint8_t*>(out.data());
  size_t out_size = out.nbytes();
  {
    nb::gil_scoped_release release;
    s = guarded([&] {
      return gather_fixed(spans, static_cast<size_t>(stride), which.data(), rows.data(),
                          which.size(), out_ptr, out_size);
    });
  }
  return to_tuple(s);
}

StatusTuple py_gather_fixed(const std::vector<Bytes>& sources, int64_t stride, const Int32s& which,
                            const Int64s& rows, MutAny& out) {
  const std::vector<Span> spans = spans_of(sources);
  return gather_fixed_from(SpanList(spans), stride, which, rows, out);
}

StatusTuple py_gather_fixed_chunks(const std::vector<ColumnChunks*>& columns, int64_t stride,
                                   const Int32s& which, const Int64s& rows, MutAny& out) {
  return gather_fixed_from(flat_spans(columns), stride, which, rows, out);
}

// `sourced`: how converting the sources went (checked after the batch's shape, as before).
std::tuple<int, int64_t, std::string, int64_t> var_offsets_from(
    const Status& sourced, const VarList& sources, int64_t elem_size,
    const Int32s& which, const Int64s& rows, MutInt64s& out_offsets) {
  Status s = check_batch(which, rows);
  int64_t total = 0;
  if (s.ok() && out_offsets.size() != which.size() + 1) {
    s = Status::Error(StatusCode::kInvalid, -1, "out_offsets must hold len(rows) + 1 entries");
  }
  if (s.ok()) s = sourced;
  if (s.ok()) s = check_positive(elem_size, "elem_size");
  if (s.ok()) {
    nb::gil_scoped_release release;
    s = guarded([&] {
      return var_offsets(sources, static_cast<size_t>(elem_size), which.data(), rows.data(),
                         which.size(), out_offsets.data(), &total);
    });
  }
  return {static_cast<int>(s.code), s.item, s.message, total};
}

std::tuple<int, int64_t, std::string, int64_t> py_var_offsets(const std::vector<Bytes>& values,
                                                              const std::vector<Int64s>& offsets,
                                                              int64_t elem_size, const Int32s& which,
                                                              const Int64s& rows,
                                                              MutInt64s& out_offsets) {
  Status sourced;
  const std::vector<VarSource> sources = var_sources(values, offsets, &sourced);
  return var_offsets_from(sourced, VarList(sources), elem_size, which, rows, out_offsets);
}

std::tuple<int, int64_t, std::string, int64_t> py_var_offsets_chunks(
    const std::vector<ColumnChunks*>& columns, int64_t elem_size, const Int32s& which,
    const Int64s& rows, MutInt64s& out_offsets) {
  Status sourced;
  const VarList sources = flat_var(columns, &sourced);
  return var_offsets_from(sourced, sources, elem_size, which, rows, out_offsets);
}

StatusTuple gather_var_from(const Status& sourced, const VarList& sources,
                            int64_t elem_size, const Int32s& which, const Int64s& rows,
                            const Int64s& out_offsets, MutAny& out_values) {
  Status s = check_batch(which, rows);
  if (s.ok() && out_offsets.size() != which.size() + 1) {
    s = Status::Error(StatusCode::kInvalid, -1, "out_offsets must hold len(rows) + 1 entries");
  }
  if (s.ok()) s = sourced;
  if (s.ok()) s = check_positive(elem_size, "elem_size");
  if (s.ok()) {
    auto* out_ptr = static_cast<uint8_t*>(out_values.data());
    size_t out_size = out_values.nbytes();
    nb::gil_scoped_release release;
    s = guarded([&] {
      return gather_var(sources, static_cast<size_t>(elem_size), which.data(), rows.data(),
                        which.size(), out_offsets.data(), out_ptr, out_size);
    });
  }
  return to_tuple(s);
}

StatusTuple py_gather_var(const std::vector<Bytes>& values, const std::vector<Int64s>& offsets,
                          int64_t elem_size, const Int32s& which, const Int64s& rows,
                          const Int64s& out_offsets, MutAny& out_values) {
  Status sourced;
  const std::vector<VarSource> sources = var_sources(values, offsets, &sourced);
  return gather_var_from(sourced, VarList(sources), elem_size, which, rows, out_offsets, out_values);
}

StatusTuple py_gather_var_chunks(const std::vector<ColumnChunks*>& columns, int64_t elem_size,
                                 const Int32s& which, const Int64s& rows,
                                 const Int64s& out_offsets, MutAny& out_values) {
  Status sourced;
  const VarList sources = flat_var(columns, &sourced);
  return gather_var_from(sourced, sources, elem_size, which, rows, out_offsets, out_values);
}

StatusTuple py_stream_copy(const Bytes& source, MutBytes& out, int64_t threads, bool guard) {
  Status s = check_positive(threads, "threads");
  if (s.ok() && source.size() != out.size()) {
    s = Status::Error(StatusCode::kInvalid, -1,
                      "source holds " + std::to_string(source.size()) + " bytes, out " +
                          std::to_string(out.size()) + ": give buffers of one size");
  }
  if (!s.ok()) return to_tuple(s);
  const uint8_t* src = source.data();
  uint8_t* dst = out.data();
  const size_t n = source.size();
  nb::gil_scoped_release release;
  s = guarded([&] { return stream_copy(dst, src, n, static_cast<size_t>(threads), guard); });
  return to_tuple(s);
}

StatusTuple py_xxh64_pieces(const Bytes& data, int64_t piece, MutUint64s& out, bool guard) {
  Status s = check_positive(piece, "piece");
  const size_t len = data.size();
  const size_t count = s.ok() ? (len + static_cast<size_t>(piece) - 1) / static_cast<size_t>(piece) : 0;
  if (s.ok() && out.size() != count) {
    s = Status::Error(StatusCode::kInvalid, -1,
                      "out holds " + std::to_string(out.size()) + " digests, the data has " +
                          std::to_string(count) + " pieces");
  }
  if (!s.ok()) return to_tuple(s);
  const uint8_t* ptr = data.data();
  uint64_t* digests = out.data();
  nb::gil_scoped_release release;
  s = guarded([&] { return xxh64_pieces(ptr, len, static_cast<size_t>(piece), digests, guard); });
  return to_tuple(s);
}

StatusTuple py_pad_rows(const Bytes& values, const Int64s& offsets, int64_t elem_size,
                        int64_t width, const Bytes& pad, MutAny& out) {
  Status s = check_positive(elem_size, "elem_size");
  if (s.ok() && width < 0) s = Status::Error(StatusCode::kInvalid, -1, "width must not be negative");
  if (s.ok() && offsets.size() == 0) {
    s = Status::Error(StatusCode::kInvalid, -1, "offsets must hold at least one entry");
  }
  if (s.ok() && pad.size() != static_cast<size_t>(elem_size)) {
    s = Status::Error(StatusCode::kInvalid, -1, "pad must hold elem_size bytes");
  }
  if (!s.ok()) return to_tuple(s);
  const uint8_t* values_ptr = values.data();
  const size_t values_size = values.size();
  const int64_t* offsets_ptr = offsets.data();
  const size_t n = offsets.size() - 1;
  const uint8_t* pad_ptr = pad.data();
  auto* out_ptr = static_cast<uint8_t*>(out.data());
  const size_t out_size = out.nbytes();
  nb::gil_scoped_release release;
  s = guarded([&] {
    return pad_rows(values_ptr, values_size, static_cast<size_t>(elem_size), offsets_ptr, n,
                    static_cast<size_t>(width), pad_ptr, out_ptr, out_size);
  });
  return to_tuple(s);
}

StatusTuple py_paid_moves(MutInt64s& nodes, const Int64s& candidate, const Uint64s& hashed,
                          const Int64s& surplus, int64_t width, int64_t count,
                          int priority_bits) {
  Status s = paid_moves_sizes(nodes.size(), candidate.size(), hashed.size(), surplus.size(),
                              width, count);
  if (!s.ok()) return to_tuple(s);
  int64_t* slots = nodes.data();
  const int64_t* cand = candidate.data();
  const uint64_t* hashes = hashed.data();
  const int64_t* need = surplus.data();
  const size_t m = candidate.size();
  const size_t per = static_cast<size_t>(count);
  const size_t steps = surplus.size() / per;
  nb::gil_scoped_release release;
  s = paid_moves(slots, steps, static_cast<size_t>(width), per, cand, hashes, m, need,
                 priority_bits);
  return to_tuple(s);
}

StatusTuple py_owner_nodes(const Int64s& at, const Int64s& rows, const Int64s& offsets,
                           const Int64s& piece_rows, const Int64s& targets, int64_t width,
                           MutInt64s& nodes, MutInt64s& piece, MutInt64s& surplus) {
  const size_t total = at.size(), count = targets.size();
  Status s = Status::Ok();
  if (width < 0) {
    s = Status::Error(StatusCode::kInvalid, -1, "width must not be negative");
  } else if (rows.size() != total || nodes.size() != total || piece.size() != total) {
    s = Status::Error(StatusCode::kInvalid, -1,
                      "at, rows, nodes and piece must hold one entry per slot");
  } else if (offsets.size() != piece_rows.size()) {
    s = Status::Error(StatusCode::kInvalid, -1,
                      "offsets and piece_rows must hold one entry per value");
  } else if (count == 0) {
    s = Status::Error(StatusCode::kInvalid, -1, "count must be at least 1");
  } else if (total != 0 && (width == 0 || total % static_cast<size_t>(width) != 0)) {
    s = Status::Error(StatusCode::kInvalid, -1,
                      std::to_string(total) + " slots are not whole steps of " +
                          std::to_string(width));
  } else if (surplus.size() != (width == 0 ? 0 : total / static_cast<size_t>(width)) * count) {
    s = Status::Error(StatusCode::kInvalid, -1, "surplus must hold steps * count entries");
  }
  if (!s.ok()) return to_tuple(s);
  nb::gil_scoped_release release;
  s = owner_nodes(at.data(), rows.data(), total, offsets.data(), piece_rows.data(),
                  offsets.size(), targets.data(), count, static_cast<size_t>(width),
                  nodes.data(), piece.data(), surplus.data());
  return to_tuple(s);
}

StatusTuple py_release_moves(MutInt64s& nodes, const Int64s& surplus, const Int64s& at,
                             const Int64s& rows, const Int64s& key_base, const Int64s& key_rows,
                             uint64_t release_key, int64_t width, int64_t count,
                             int priority_bits) {
  Status s = Status::Ok();
  if (count < 1) {
    s = Status::Error(StatusCode::kInvalid, -1, "count must be at least 1");
  } else if (at.size() != nodes.size() || rows.size() != nodes.size()) {
    s = Status::Error(StatusCode::kInvalid, -1, "at and rows must hold one entry per slot");
  } else if (key_base.size() != key_rows.size()) {
    s = Status::Error(StatusCode::kInvalid, -1,
                      "key_base and key_rows must hold one entry per value");
  } else {  // (the paid moves' own sizes: nodes = steps * width)
    s = paid_moves_sizes(nodes.size(), 0, 0, surplus.size(), width, count);
  }
  if (!s.ok()) return to_tuple(s);
  const size_t per = static_cast<size_t>(count);
  nb::gil_scoped_release release;
  s = release_moves(nodes.data(), surplus.size() / per, static_cast<size_t>(width), per,
                    surplus.data(), at.data(), rows.data(), key_base.data(), key_rows.data(),
                    key_base.size(), release_key, priority_bits);
  return to_tuple(s);
}

StatusTuple py_choose_backups(const Int64s& bounds, const Int64s& steps, const Int64s& rows,
                              const Int64s& owner, const Int64s& chunks, MutInt64s& surplus,
                              int64_t nodes, int64_t budget, MutInt64s& chosen) {
  const size_t pieces = owner.size();
  Status s = Status::Ok();
  if (nodes < 1) {
    s = Status::Error(StatusCode::kInvalid, -1, "nodes must be at least 1");
  } else if (bounds.size() != pieces + 1 || chunks.size() != pieces || chosen.size() != pieces) {
    s = Status::Error(StatusCode::kInvalid, -1,
                      "bounds must hold pieces + 1 entries; owner, chunks and chosen one per "
                      "piece");
  } else if (steps.size() != rows.size()) {
    s = Status::Error(StatusCode::kInvalid, -1, "steps and rows must hold one value per entry");
  } else if (surplus.size() % static_cast<size_t>(nodes) != 0) {
    s = Status::Error(StatusCode::kInvalid, -1, "surplus must hold steps * nodes entries");
  }
  if (!s.ok()) return to_tuple(s);
  const size_t per = static_cast<size_t>(nodes);
  nb::gil_scoped_release release;
  s = choose_backups(bounds.data(), pieces, steps.data(), rows.data(), steps.size(),
                     owner.data(), chunks.data(), surplus.data(), surplus.size() / per, per,
                     budget, chosen.data());
  return to_tuple(s);
}

using Int64Array = nb::ndarray<nb::numpy, int64_t, nb::ndim<1>>;

// A vector handed to Python as a numpy array that owns it (freed with the array).
Int64Array owned_array(std::vector<int64_t>&& values) {
  auto* held = new std::vector<int64_t>(std::move(values));
  nb::capsule owner(held, [](void* p) noexcept { delete static_cast<std::vector<int64_t>*>(p); });
  return Int64Array(held->data(), {held->size()}, owner);
}

std::tuple<int, int64_t, std::string, Int64Array, Int64Array, Int64Array> py_ipc_record_batches(
    const Bytes& file, size_t nodes_per_batch, size_t buffers_per_batch) {
  std::vector<int64_t> rows, nodes, buffers;
  Status s;
  {
    nb::gil_scoped_release release;
    s = guarded([&] {
      return ipc_record_batches(file.data(), file.size(), nodes_per_batch, buffers_per_batch,
                                &rows, &nodes, &buffers);
    });
  }
  if (!s.ok()) rows.clear(), nodes.clear(), buffers.clear();
  return {static_cast<int>(s.code), s.item, s.message, owned_array(std::move(rows)),
          owned_array(std::move(nodes)), owned_array(std::move(buffers))};
}

StatusTuple py_check_ipc_offsets(const Bytes& file, const Int64s& at, const Int64s& count,
                                 const Int64s& values_bytes, int64_t elem_size) {
  if (count.size() != at.size() || values_bytes.size() != at.size()) {
    return to_tuple(Status::Error(StatusCode::kInvalid, -1,
                                  "at, count and values_bytes must hold one entry per batch"));
  }
  nb::gil_scoped_release release;
  return to_tuple(guarded([&] {
    return check_ipc_offsets(file.data(), file.size(), at.data(), count.data(),
                             values_bytes.data(), at.size(), elem_size);
  }));
}

// Keeps the GIL (an exception to the rule): the job takes a microsecond or two, less than
// releasing and taking back the GIL would cost.
std::tuple<int, int64_t, std::string, int64_t> py_group_shards(const Int64s& shards,
                                                               MutInt64s& unique_out,
                                                               MutInt32s& which_out) {
  const size_t n = shards.size();
  if (unique_out.size() < n || which_out.size() != n) {
    Status s = Status::Error(StatusCode::kInvalid, -1,
                             "unique_out must hold len(shards) entries and which_out exactly as many");
    return {static_cast<int>(s.code), s.item, s.message, 0};
  }
  size_t k = group_values(shards.data(), n, unique_out.data(), which_out.data());
  return {0, -1, std::string(), static_cast<int64_t>(k)};
}

// Keeps the GIL (an exception to the rule): a batch's rows take a microsecond or two.
StatusTuple py_locate_chunks(const Int64s& counts, const Int64s& fixed, const Int32s& which,
                             const Int64s& rows, MutInt32s& flat_out, MutInt64s& local_out) {
  const size_t n = which.size();
  if (fixed.size() != counts.size() || rows.size() != n || flat_out.size() != n ||
      local_out.size() != n) {
    return to_tuple(Status::Error(
        StatusCode::kInvalid, -1,
        "fixed must hold one entry per shard; rows and both outputs one per batch item"));
  }
  return to_tuple(locate_chunks(counts.data(), fixed.data(), counts.size(), which.data(),
                                rows.data(), n, flat_out.data(), local_out.data()));
}

// Releases the GIL only for long arrays: a batch's few hundred points take microseconds,
// less than handing the GIL over and back.
StatusTuple py_feistel_walk(const Int64s& points, const Uint64s& sizes, const Uint32Matrix& keys,
                            int width, MutInt64s& out) {
  const size_t n = points.size();
  const size_t m = keys.shape(1);
  if (out.size() != n || (sizes.size() != 1 && sizes.size() != n) || (m != 1 && m != n)) {
    return to_tuple(Status::Error(
        StatusCode::kInvalid, -1,
        "out must hold one entry per point; sizes and keys' columns one per point or one"));
  }
  auto walk = [&] {
    return feistel_walk(points.data(), n, sizes.data(), sizes.size() == n, keys.data(), m, m == n,
                        static_cast<int>(keys.shape(0)), width, out.data());
  };
  if (n < 4096) return to_tuple(walk());
  nb::gil_scoped_release release;
  return to_tuple(walk());
}

// One Python bytes object per row, each filled by one copy from the shards. The objects are
// made with the GIL held, as empty buffers of the rows' sizes (PyBytes_FromStringAndSize with
// no data), and the pool threads then write only into those buffers, never into an object's
// header or reference count: nothing else can see the objects before this function returns
// them. This is the GIL rule's "allocate outputs with the GIL" with outputs that are objects.
std::tuple<int, int64_t, std::string, nb::list> gather_bytes_from(
    const Status& sourced, const VarList& sources, const Int32s& which,
    const Int64s& rows) {
  Status s = check_batch(which, rows);
  if (s.ok()) s = sourced;
  const size_t n = which.size();
  std::vector<int64_t> out_offsets(n + 1, 0);
  int64_t total = 0;
  if (s.ok()) {
    nb::gil_scoped_release release;
    s = guarded([&] {
      return var_offsets(sources, 1, which.data(), rows.data(), n, out_offsets.data(), &total);
    });
  }
  nb::list result;
  if (!s.ok()) return {static_cast<int>(s.code), s.item, s.message, result};
  std::vector<nb::object> objects;
  std::vector<uint8_t*> dests;
  objects.reserve(n);
  dests.reserve(n);
  for (size_t i = 0; i < n; ++i) {
    PyObject* object = PyBytes_FromStringAndSize(nullptr, out_offsets[i + 1] - out_offsets[i]);
    if (object == nullptr) {  // out of memory: a status, as every other native failure
      PyErr_Clear();
      s = Status::Error(StatusCode::kInternal, static_cast<int64_t>(i),
                        "out of memory for the bytes of batch item " + std::to_string(i));
      return {static_cast<int>(s.code), s.item, s.message, result};
    }
    objects.push_back(nb::steal(object));
    dests.push_back(reinterpret_cast<uint8_t*>(PyBytes_AS_STRING(object)));
  }
  {
    nb::gil_scoped_release release;
    s = guarded([&] {
      return gather_var_rows(sources, 1, which.data(), rows.data(), n, out_offsets.data(),
                             dests.data());
    });
  }
  if (s.ok()) {
    for (auto& object : objects) result.append(object);
  }
  return {static_cast<int>(s.code), s.item, s.message, result};
}

std::tuple<int, int64_t, std::string, nb::list> py_gather_bytes(const std::vector<Bytes>& values,
                                                                const std::vector<Int64s>& offsets,
                                                                const Int32s& which,
                                                                const Int64s& rows) {
  Status sourced;
  const std::vector<VarSource> sources = var_sources(values, offsets, &sourced);
  return gather_bytes_from(sourced, VarList(sources), which, rows);
}

std::tuple<int, int64_t, std::string, nb::list> py_gather_bytes_chunks(
    const std::vector<ColumnChunks*>& columns, const Int32s& which, const Int64s& rows) {
  Status sourced;
  const VarList sources = flat_var(columns, &sourced);
  return gather_bytes_from(sourced, sources, which, rows);
}

// An XXH64 over several buffers (a file checksummed while it is written). update() releases
// the GIL for the hash; a mutex keeps two threads from updating one state at once.
class StreamingXxh64 {
 public:
  explicit StreamingXxh64(uint64_t seed) : state_(seed) {}

  void update(const Bytes& data) {
    const uint8_t* ptr = data.data();
    size_t len = data.size();
    nb::gil_scoped_release release;
    std::lock_guard<std::mutex> lock(mutex_);
    state_.update(ptr, len);
  }

  uint64_t digest() {
    nb::gil_scoped_release release;  // waits for an update in flight on another thread
    std::lock_guard<std::mutex> lock(mutex_);
    return state_.digest();
  }

 private:
  std::mutex mutex_;
  Xxh64 state_;
};

void bind_xxh64(nb::module_& m) {
  nb::class_<StreamingXxh64>(m, "Xxh64", "XXH64 of the concatenation of every buffer given to update().")
      .def(nb::init<uint64_t>(), nb::arg("seed") = 0)
      .def("update", &StreamingXxh64::update, nb::arg("data").noconvert(),
           "Add a contiguous byte buffer (GIL released).")
      .def("digest", &StreamingXxh64::digest,
           "XXH64 of everything added so far (more may be added after).");
}

// ---------------------------------------------------------------- global generators
// GlobalRngs breaks the GIL rule's "never touch a Python object" on purpose, with the GIL
// held: seeding the three global generators per sample through their own seeding functions
// cost about 8 us a sample (Python's init_by_array alone 4.6), more than a light transform.
// It writes the generators' states directly, in the layouts below, which their projects do
// not export: streamcache/_native.py checks every layout once per process against the
// public getstate/get_state of each library (and uses the Python twin, which sets the same
// states through those public functions, if one differs).

// CPython's _random.Random (Modules/_randommodule.c): the head, the index, the state.
struct PyRandomLayout {
  PyObject_HEAD
  int index;
  uint32_t state[kMtStateWords];
};

// numpy's mt19937_state (numpy/random/src/mt19937/mt19937.h), at its ctypes.state_address.
struct NumpyMtLayout {
  uint32_t key[kMtStateWords];
  int pos;
};

// torch's CPUGeneratorImpl (aten/src/ATen/CPUGeneratorImpl.h) from its engine on: the
// mt19937_data_pod of ATen/core/MT19937RNGEngine.h, then the cached normals (std::optional).
struct TorchMtData {
  uint64_t seed;
  int32_t left;
  bool seeded;
  uint32_t next;
  uint32_t state[kMtStateWords];
};
struct TorchEngineLayout {
  TorchMtData data;
  struct {
    float value;
    bool engaged;
  } float_normal;
  struct {
    double value;
    bool engaged;
  } double_normal;
};
static_assert(sizeof(TorchMtData) == 2520 && offsetof(TorchEngineLayout, float_normal) == 2520 &&
              offsetof(TorchEngineLayout, double_normal) == 2528);

// numpy's legacy normal cache (aug_bitgen_t of numpy/random/src/legacy/legacy-distributions.h,
// inside the RandomState object), from has_gauss on.
struct NumpyGaussLayout {
  int has_gauss;
  double gauss;
};

// The bytes torch.Generator.get_state() returns for a CPU generator (CPUGeneratorImplState in
// aten/src/ATen/CPUGeneratorImpl.cpp): a legacy 64-bit-per-word layout plus the float cache.
constexpr size_t kTorchStateBytes = 5056;
constexpr size_t kTorchStateWordsAt = 24;

class GlobalRngs {
 public:
  GlobalRngs(nb::object python_random, nb::object numpy_random_state,
             nb::ndarray<uint8_t, nb::ndim<1>, nb::c_contig, nb::device::cpu> torch_state)
      : python_(std::move(python_random)), torch_state_(std::move(torch_state)) {
    nb::object random_type = nb::module_::import_("random").attr("Random");
    nb::object base_type = nb::module_::import_("_random").attr("Random");
    if (!PyObject_TypeCheck(python_.ptr(), reinterpret_cast<PyTypeObject*>(random_type.ptr())) ||
        reinterpret_cast<PyTypeObject*>(base_type.ptr())->tp_basicsize !=
            static_cast<Py_ssize_t>(sizeof(PyRandomLayout))) {
      throw nb::type_error("python_random must be a random.Random of the expected layout");
    }
    numpy_bit_generator_ = numpy_random_state.attr("_bit_generator");
    if (nb::cast<std::string>(numpy_bit_generator_.type().attr("__name__")) != "MT19937") {
      throw nb::type_error("numpy_random_state must draw from an MT19937 bit generator");
    }
    numpy_ = reinterpret_cast<NumpyMtLayout*>(
        nb::cast<uintptr_t>(numpy_bit_generator_.attr("ctypes").attr("state_address")));
    if (torch_state_.size() != kTorchStateBytes ||
        reinterpret_cast<uintptr_t>(torch_state_.data()) % 8 != 0) {
      throw nb::value_error(
          "torch_state must hold the 5056 bytes of a CPU generator's state, 8-byte aligned");
    }
  }

  // Sets Python's generator (and clears its cached gauss) and the torch state buffer to the
  // states of `seed`, and numpy's when `force_numpy` is true or its state is still what the
  // last call wrote. Else (numpy was drawn from since, which may have left a cached normal
  // that only numpy's own seeding clears) writes nothing and returns false.
  bool seed(uint64_t seed, bool force_numpy) {
    if (torch_engine_ != nullptr) return seed_direct(seed);
    if (!force_numpy && !(numpy_written_ && numpy_->pos == static_cast<int>(kMtStateWords) &&
                          std::memcmp(numpy_->key, numpy_words_.data(), sizeof numpy_->key) == 0)) {
      return false;
    }
    write_python(seed);
    mt_state_words(seed, kStreamNumpy, numpy_words_.data(), kMtStateWords);
    std::memcpy(numpy_->key, numpy_words_.data(), sizeof numpy_->key);
    numpy_->pos = static_cast<int>(kMtStateWords);
    numpy_written_ = true;
    write_torch_state(seed);
    return true;
  }

  // Direct mode, from here on: torch's engine and numpy's normal cache are at these addresses
  // (streamcache/loading/rng_layouts.py finds them and checks this mode against the libraries'
  // public functions before using it). seed() then writes torch's generator itself and clears
  // numpy's cache itself (always writing, always true), and save()/restore() work.
  void attach(uintptr_t torch_engine, uintptr_t numpy_gauss) {
    if (torch_engine == 0 || numpy_gauss == 0 || torch_engine % alignof(TorchEngineLayout) != 0 ||
        numpy_gauss % alignof(NumpyGaussLayout) != 0) {
      throw nb::value_error("attach needs the aligned addresses of torch's engine and numpy's "
                            "normal cache");
    }
    torch_engine_ = reinterpret_cast<TorchEngineLayout*>(torch_engine);
    numpy_gauss_ = reinterpret_cast<NumpyGaussLayout*>(numpy_gauss);
  }

  // Every generator's whole state (cached normals included), for restore(): one copy, where
  // the libraries' get_state/set_state cost ~85 us a batch (numpy's alone ~70).
  std::pair<nb::bytes, nb::object> save() const {
    require_direct();
    Saved saved;
    const auto* random = reinterpret_cast<const PyRandomLayout*>(python_.ptr());
    saved.python_index = random->index;
    std::memcpy(saved.python_state, random->state, sizeof saved.python_state);
    saved.numpy = *numpy_;
    saved.numpy_gauss = *numpy_gauss_;
    saved.torch = *torch_engine_;
    return {nb::bytes(reinterpret_cast<const char*>(&saved), sizeof saved),
            nb::getattr(python_, gauss_next_)};
  }

  void restore(nb::bytes state, nb::object gauss_next) {
    require_direct();
    if (state.size() != sizeof(Saved)) throw nb::value_error("not a state save() returned");
    Saved saved;
    std::memcpy(&saved, state.c_str(), sizeof saved);
    auto* random = reinterpret_cast<PyRandomLayout*>(python_.ptr());
    random->index = saved.python_index;
    std::memcpy(random->state, saved.python_state, sizeof saved.python_state);
    nb::setattr(python_, gauss_next_, gauss_next);
    *numpy_ = saved.numpy;
    *numpy_gauss_ = saved.numpy_gauss;
    *torch_engine_ = saved.torch;
  }

 private:
  struct Saved {
    int python_index;
    uint32_t python_state[kMtStateWords];
    NumpyMtLayout numpy;
    NumpyGaussLayout numpy_gauss;
    TorchEngineLayout torch;
  };

  void require_direct() const {
    if (torch_engine_ == nullptr) throw std::logic_error("save/restore need attach() first");
  }

  // Python's generator to the state of `seed`, its cached gauss cleared (both modes).
  void write_python(uint64_t seed) {
    auto* random = reinterpret_cast<PyRandomLayout*>(python_.ptr());
    mt_state_words(seed, kStreamPython, random->state, kMtStateWords);
    random->index = static_cast<int>(kMtStateWords);
    nb::setattr(python_, gauss_next_, nb::none());
  }

  bool seed_direct(uint64_t seed) {
    write_python(seed);
    mt_state_words(seed, kStreamNumpy, numpy_->key, kMtStateWords);
    numpy_->pos = static_cast<int>(kMtStateWords);
    numpy_gauss_->has_gauss = 0;
    numpy_gauss_->gauss = 0.0;  // as numpy's own seeding leaves it
    TorchMtData& torch = torch_engine_->data;
    torch.seed = seed;
    torch.left = 1;  // as after manual_seed: the next draw twists
    torch.seeded = true;
    torch.next = 0;
    mt_state_words(seed, kStreamTorch, torch.state, kMtStateWords);
    torch_engine_->float_normal.engaged = false;
    torch_engine_->double_normal.engaged = false;
    return true;
  }

  void write_torch_state(uint64_t seed) {
    uint8_t* out = torch_state_.data();
    const int32_t left = 1, seeded = 1;  // as after manual_seed: the next draw twists
    const uint64_t next = 0;
    std::memcpy(out, &seed, 8);
    std::memcpy(out + 8, &left, 4);
    std::memcpy(out + 12, &seeded, 4);
    std::memcpy(out + 16, &next, 8);
    // the buffer is a torch tensor's (64-byte aligned): the words' 64-bit slots are aligned
    mt_state_words64(seed, kStreamTorch, reinterpret_cast<uint64_t*>(out + kTorchStateWordsAt),
                     kMtStateWords);
    const size_t words_end = kTorchStateWordsAt + 8 * kMtStateWords;
    std::memset(out + words_end, 0, kTorchStateBytes - words_end);  // no cached normals
  }

  nb::object python_;
  nb::str gauss_next_{"gauss_next"};  // made once: an attribute name made per call costs more
  nb::object numpy_bit_generator_;  // keeps the state that numpy_ points into alive
  NumpyMtLayout* numpy_ = nullptr;
  nb::ndarray<uint8_t, nb::ndim<1>, nb::c_contig, nb::device::cpu> torch_state_;
  std::array<uint32_t, kMtStateWords> numpy_words_{};
  bool numpy_written_ = false;
  TorchEngineLayout* torch_engine_ = nullptr;  // direct mode (attach)
  NumpyGaussLayout* numpy_gauss_ = nullptr;
};

void bind_global_rngs(nb::module_& m) {
  nb::class_<GlobalRngs>(m, "GlobalRngs",
                         "Sets the global generators of Python, numpy and torch per sample.")
      .def(nb::init<nb::object, nb::object,
                    nb::ndarray<uint8_t, nb::ndim<1>, nb::c_contig, nb::device::cpu>>(),
           nb::arg("python_random"), nb::arg("numpy_random_state"),
           nb::arg("torch_state").noconvert())
      .def("seed", &GlobalRngs::seed, nb::arg("seed"), nb::arg("force_numpy") = true,
           "Set the generators to the states of seed (see csrc/bindings.cpp); False: numpy was "
           "drawn from since the last call and force_numpy is false, nothing written.")
      .def("attach", &GlobalRngs::attach, nb::arg("torch_engine"), nb::arg("numpy_gauss"),
           "Write torch's engine and numpy's normal cache at these addresses from now on "
           "(checked by the caller); enables save/restore.")
      .def("save", &GlobalRngs::save, "Every generator's state: (bytes, Python's gauss_next).")
      .def("restore", &GlobalRngs::restore, nb::arg("state"), nb::arg("gauss_next").none(),
           "Put back a state save() returned.");
}

// ---------------------------------------------------------------- test support
// Pool jobs that the tests steer: a chunk can throw, or wait until the tests open a gate.
// They let tests prove that a throwing chunk reaches the caller and that concurrent jobs
// complete independently, which no gather can be made to do on purpose.

std::mutex g_gate_mutex;
std::condition_variable g_gate_changed;
bool g_gate_open = true;   // guarded by g_gate_mutex
int64_t g_gate_waiters = 0;  // guarded by g_gate_mutex

// Returns how many chunks were waiting at the gate when it was set.
int64_t py_set_test_gate(bool open) {
  std::lock_guard<std::mutex> lock(g_gate_mutex);
  g_gate_open = open;
  g_gate_changed.notify_all();
  return g_gate_waiters;
}

// Runs a pool job over n items; the chunk holding item throw_at throws, the one holding
// block_at waits for the gate. Returns (items visited, the caller's exception message or "").
std::tuple<int64_t, std::string> py_test_pool_job(int64_t n, int64_t throw_at, int64_t block_at) {
  std::atomic<int64_t> visited{0};
  std::string message;
  nb::gil_scoped_release release;
  try {
    global_pool().parallel_for(static_cast<size_t>(n), 1, [&](size_t begin, size_t end) {
      auto holds = [&](int64_t item) {
        return item >= 0 && static_cast<size_t>(item) >= begin && static_cast<size_t>(item) < end;
      };
      if (holds(block_at)) {
        std::unique_lock<std::mutex> lock(g_gate_mutex);
        ++g_gate_waiters;
        g_gate_changed.wait(lock, [] { return g_gate_open; });
        --g_gate_waiters;
      }
      if (holds(throw_at)) throw std::runtime_error("chunk of item " + std::to_string(throw_at));
      visited += static_cast<int64_t>(end - begin);
    });
  } catch (const std::exception& e) {
    message = e.what();
  }
  return {visited.load(), message};
}

using CounterTuple = std::tuple<int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t>;

// The blocking Scheduler calls release the GIL for the whole wait: readers and Python worker
// threads block here while the download threads (Python) keep running.
int64_t py_next_task(Scheduler& s, double timeout_s) {
  nb::gil_scoped_release release;
  return s.next_task(timeout_s);
}

std::tuple<int, std::string> py_wait(Scheduler& s, int64_t shard, double timeout_s,
                                     bool count_access) {
  std::pair<WaitResult, std::string> result;
  {
    nb::gil_scoped_release release;
    result = s.wait(shard, timeout_s, count_access);
  }
  return {static_cast<int>(result.first), result.second};
}

CounterTuple py_counters(const Scheduler& s) {
  SchedulerCounters c = s.counters();
  return {c.hits, c.misses, c.bytes_fetched, c.bytes_evicted, c.wait_ns, c.tasks_done,
          c.tasks_failed};
}

void bind_scheduler(nb::module_& m) {
  // The short methods keep the GIL: they hold the scheduler's mutex for microseconds, and no
  // code that holds that mutex ever asks for the GIL, so the two locks cannot deadlock.
  nb::class_<Scheduler>(m, "Scheduler",
                        "Prefetch queue, in-flight budget, shard states and waits (csrc/scheduler.h).")
      .def(nb::init<int64_t>(), nb::arg("inflight_budget"))
      .def("submit", &Scheduler::submit, nb::arg("shard"), nb::arg("priority"), nb::arg("bytes"))
      .def("cancel", &Scheduler::cancel, nb::arg("shard"))
      .def("next_task", &py_next_task, nb::arg("timeout_s"))
      .def("complete", &Scheduler::complete, nb::arg("shard"), nb::arg("ok"),
           nb::arg("bytes_fetched"), nb::arg("message"))
      .def("mark_ready", &Scheduler::mark_ready, nb::arg("shard"))
      .def("forget", &Scheduler::forget, nb::arg("shard"), nb::arg("bytes_evicted"))
      .def("wait", &py_wait, nb::arg("shard"), nb::arg("timeout_s"), nb::arg("count_access"),
           "(result code, failure message); codes as WaitResult in csrc/scheduler.h.")
      .def("state", [](const Scheduler& s, int64_t shard) { return static_cast<int>(s.state(shard)); },
           nb::arg("shard"))
      .def("note_hit", &Scheduler::note_hit)
      .def("stop", &Scheduler::stop)
      .def("stopped", &Scheduler::stopped)
      .def("counters", &py_counters,
           "(hits, misses, bytes_fetched, bytes_evicted, wait_ns, tasks_done, tasks_failed).")
      .def("inflight_bytes", &Scheduler::inflight_bytes)
      .def("queued", &Scheduler::queued);
}

}  // namespace

NB_MODULE(_core, m) {
  m.doc() = "streamcache native core: checksums and row gathers (GIL released)";

  m.def("xxh64", &py_xxh64, nb::arg("data").noconvert(), nb::arg("seed") = 0,
        "XXH64 of a contiguous byte buffer.");
  m.def("xxh64_file", &py_xxh64_file, nb::arg("path"), nb::arg("seed") = 0,
        "XXH64 of a file: (code, item, message, digest, bytes_read).");
  m.def("gather_fixed", &py_gather_fixed, nb::arg("sources").noconvert(), nb::arg("stride"),
        nb::arg("which").noconvert(), nb::arg("rows").noconvert(), nb::arg("out").noconvert(),
        "Copy fixed-width rows into out; returns (code, item, message).");
  m.def("var_offsets", &py_var_offsets, nb::arg("values").noconvert(),
        nb::arg("offsets").noconvert(), nb::arg("elem_size"), nb::arg("which").noconvert(),
        nb::arg("rows").noconvert(), nb::arg("out_offsets").noconvert(),
        "Output offsets of a variable-width gather; returns (code, item, message, total).");
  m.def("gather_var", &py_gather_var, nb::arg("values").noconvert(),
        nb::arg("offsets").noconvert(), nb::arg("elem_size"), nb::arg("which").noconvert(),
        nb::arg("rows").noconvert(), nb::arg("out_offsets").noconvert(),
        nb::arg("out_values").noconvert(), "Copy variable-width rows; returns (code, item, message).");
  m.def("gather_bytes", &py_gather_bytes, nb::arg("values").noconvert(),
        nb::arg("offsets").noconvert(), nb::arg("which").noconvert(), nb::arg("rows").noconvert(),
        "Rows of byte columns as one bytes object each, one copy per row; returns (code, item, "
        "message, list of bytes).");
  nb::class_<ColumnChunks>(m, "ColumnChunks",
                           "One shard's column: the buffers of each of its record batches.")
      .def(nb::init<std::vector<Bytes>, std::vector<Int64s>>(), nb::arg("values").noconvert(),
           nb::arg("offsets").noconvert())
      .def("__len__", &ColumnChunks::size);
  m.def("gather_fixed_chunks", &py_gather_fixed_chunks, nb::arg("columns"), nb::arg("stride"),
        nb::arg("which").noconvert(), nb::arg("rows").noconvert(), nb::arg("out").noconvert(),
        "gather_fixed over ColumnChunks: which[i] numbers the columns' chunks one after "
        "another; returns (code, item, message).");
  m.def("var_offsets_chunks", &py_var_offsets_chunks, nb::arg("columns"), nb::arg("elem_size"),
        nb::arg("which").noconvert(), nb::arg("rows").noconvert(),
        nb::arg("out_offsets").noconvert(), "var_offsets over ColumnChunks.");
  m.def("gather_var_chunks", &py_gather_var_chunks, nb::arg("columns"), nb::arg("elem_size"),
        nb::arg("which").noconvert(), nb::arg("rows").noconvert(),
        nb::arg("out_offsets").noconvert(), nb::arg("out_values").noconvert(),
        "gather_var over ColumnChunks.");
  m.def("gather_bytes_chunks", &py_gather_bytes_chunks, nb::arg("columns"),
        nb::arg("which").noconvert(), nb::arg("rows").noconvert(),
        "gather_bytes over ColumnChunks.");
  m.def("pad_rows", &py_pad_rows, nb::arg("values").noconvert(), nb::arg("offsets").noconvert(),
        nb::arg("elem_size"), nb::arg("width"), nb::arg("pad").noconvert(),
        nb::arg("out").noconvert(),
        "A variable-width batch (values, offsets) as rows of width elements, cut or filled "
        "with pad; returns (code, item, message).");
  m.def("stream_copy", &py_stream_copy, nb::arg("source").noconvert(),
        nb::arg("out").noconvert(), nb::arg("threads") = 1, nb::arg("guard") = false,
        "Copy source into out (same size, not overlapping) on up to threads threads, large "
        "copies with non-temporal stores; guard: out may be a mapped file another process "
        "truncates (an error, not SIGBUS); returns (code, item, message).");
  m.def("xxh64_pieces", &py_xxh64_pieces, nb::arg("data").noconvert(), nb::arg("piece"),
        nb::arg("out").noconvert(), nb::arg("guard") = false,
        "XXH64 of each piece of piece bytes of data into out (uint64); guard: data may be a "
        "mapped file another process truncates (an error, not SIGBUS); returns (code, item, "
        "message).");
  m.def("ipc_record_batches", &py_ipc_record_batches, nb::arg("file").noconvert(),
        nb::arg("nodes_per_batch"), nb::arg("buffers_per_batch"),
        "The record batches of an Arrow IPC file's bytes (csrc/ipc.h): (code, item, message, "
        "rows, nodes as (length, null_count) pairs, buffers as (file offset, length) pairs).");
  m.def("check_ipc_offsets", &py_check_ipc_offsets, nb::arg("file").noconvert(),
        nb::arg("at").noconvert(), nb::arg("count").noconvert(),
        nb::arg("values_bytes").noconvert(), nb::arg("elem_size"),
        "Each batch's int64 offsets checked in order and within its values (csrc/ipc.h); "
        "returns (code, item, message).");
  m.def("locate_chunks", &py_locate_chunks, nb::arg("counts").noconvert(),
        nb::arg("fixed").noconvert(), nb::arg("which").noconvert(), nb::arg("rows").noconvert(),
        nb::arg("flat_out").noconvert(), nb::arg("local_out").noconvert(),
        "Each row's chunk over a batch's shards and its row inside it (csrc/gather.h); "
        "returns (code, item, message).");
  m.def("feistel_walk", &py_feistel_walk, nb::arg("points").noconvert(),
        nb::arg("sizes").noconvert(), nb::arg("keys").noconvert(), nb::arg("width"),
        nb::arg("out").noconvert(),
        "Keyed Feistel bijections of [0, size) with cycle-walking at points into out (see "
        "csrc/feistel.h); keys: (rounds, 1 or n) uint32; returns (code, item, message).");
  m.def("group_shards", &py_group_shards, nb::arg("shards").noconvert(),
        nb::arg("unique_out").noconvert(), nb::arg("which_out").noconvert(),
        "The distinct shards of a batch in increasing order into unique_out, each row's "
        "position among them into which_out; returns (code, item, message, count).");
  m.def("paid_moves", &py_paid_moves, nb::arg("nodes").noconvert(),
        nb::arg("candidate").noconvert(), nb::arg("hashed").noconvert(),
        nb::arg("surplus").noconvert(), nb::arg("width"), nb::arg("count"),
        nb::arg("priority_bits"),
        "The multi-node split's paid moves (csrc/split.h): nodes (steps * width) updated in "
        "place; returns (code, item, message).");
  m.def("owner_nodes", &py_owner_nodes, nb::arg("at").noconvert(), nb::arg("rows").noconvert(),
        nb::arg("offsets").noconvert(), nb::arg("piece_rows").noconvert(),
        nb::arg("targets").noconvert(), nb::arg("width"), nb::arg("nodes").noconvert(),
        nb::arg("piece").noconvert(), nb::arg("surplus").noconvert(),
        "Each slot's piece, node before balancing and each step's surplus (csrc/split.h) "
        "into nodes, piece and surplus; returns (code, item, message).");
  m.def("release_moves", &py_release_moves, nb::arg("nodes").noconvert(),
        nb::arg("surplus").noconvert(), nb::arg("at").noconvert(), nb::arg("rows").noconvert(),
        nb::arg("key_base").noconvert(), nb::arg("key_rows").noconvert(),
        nb::arg("release_key"), nb::arg("width"), nb::arg("count"), nb::arg("priority_bits"),
        "The paid moves of the slots on nodes with a surplus, hashed by their chunk keys "
        "(csrc/split.h): nodes updated in place; returns (code, item, message).");
  m.def("choose_backups", &py_choose_backups, nb::arg("bounds").noconvert(),
        nb::arg("steps").noconvert(), nb::arg("rows").noconvert(),
        nb::arg("owner").noconvert(), nb::arg("chunks").noconvert(),
        nb::arg("surplus").noconvert(), nb::arg("nodes"), nb::arg("budget"),
        nb::arg("chosen").noconvert(),
        "The pieces held twice chosen greedily (csrc/backups.h): surplus updated and each "
        "piece's second node into chosen; returns (code, item, message).");
  m.def("set_num_threads", [](size_t n) { set_global_pool_size(n); }, nb::arg("threads"),
        "Size of the native thread pool (0 = the cores this process may run on).");
  m.def("get_num_threads", []() { return global_pool_size(); },
        "Size of the native thread pool (the caller's thread counts as one).");
  m.def("set_gather_threads", [](size_t n) { set_gather_threads(n); }, nb::arg("threads"),
        "Gathers called from this thread split over at most this many threads (0 = the "
        "pool's size, 1 = never split).");
  m.def("get_gather_threads", []() { return gather_threads(); },
        "This thread's gather split limit (0 = the pool's size).");
  m.def("_test_pool_job", &py_test_pool_job, nb::arg("n"), nb::arg("throw_at"),
        nb::arg("block_at"), "(tests) A pool job that throws or blocks: (items visited, error).");
  m.def("_set_test_gate", &py_set_test_gate, nb::arg("open"),
        "(tests) Open or close the gate that _test_pool_job's block_at chunk waits for; "
        "returns how many chunks wait at it.");
  bind_scheduler(m);
  bind_global_rngs(m);
  bind_xxh64(m);
}
