// Row gathers from memory-mapped shard columns into contiguous output buffers.
//
// A column of one shard is either fixed-width (every row `stride` bytes, packed) or
// variable-width (int64 offsets of n_rows + 1 entries, counted in elements, over a values
// buffer of elements of `elem_size` bytes). A batch names, for each output row, the shard
// (an index into the list of sources) and the row inside that shard.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <vector>

#include "status.h"

namespace streamcache {

struct Span {
  const uint8_t* data = nullptr;
  size_t size = 0;  // bytes
};

struct VarSource {
  Span values;        // elements, elem_size bytes each
  Span offsets;       // int64, n_rows + 1 entries
};

// A list of sources numbered one after another: one vector, or the vectors of several
// columns (a shard's record batches each) without copying them into one. (A copy made every
// gather: 9,408 record batches of 14 shards are 300 KB, which glibc serves with a fresh
// mmap, and its page faults took 400 us a gather.)
template <typename Source>
class SourceList {
 public:
  SourceList() : starts_{0} {}
  explicit SourceList(const std::vector<Source>& one) : SourceList() { add(one); }
  void add(const std::vector<Source>& part) {
    parts_.push_back(&part);
    starts_.push_back(starts_.back() + part.size());
  }
  size_t size() const { return starts_.back(); }
  // i < size()
  const Source& operator[](size_t i) const {
    if (parts_.size() == 1) return (*parts_[0])[i];
    // the last part that starts at or before i (empty parts start where the next one does)
    const size_t k = static_cast<size_t>(
        std::upper_bound(starts_.begin(), starts_.end(), i) - starts_.begin()) - 1;
    return (*parts_[k])[i - starts_[k]];
  }

 private:
  std::vector<const std::vector<Source>*> parts_;
  std::vector<size_t> starts_;
};

using SpanList = SourceList<Span>;
using VarList = SourceList<VarSource>;

// Gathers called from this thread split a large copy over at most `threads` threads of the
// process-wide pool, the calling thread included (0, the default: the pool's size; 1: never).
// A loader whose reader threads already keep every core busy sets 1 on each of them: there a
// split only adds wake-ups (100 KB rows, batches of 32, 2 cores: 18% fewer samples a second).
void set_gather_threads(size_t threads);
size_t gather_threads();

// out[i*stride : (i+1)*stride] = sources[which[i]][rows[i]*stride : ...]
// Each row's record batch, numbered over a batch's shards one after another (shard k's chunk
// j is sum(counts[:k]) + j), into flat_out, and its row inside that chunk into local_out:
// shard k's chunks hold fixed[k] rows each (its last one fewer or as many). A row outside its
// shard stays in the shard's first or last chunk, outside its rows (the gather refuses it).
// Errors: a shard index outside [0, s), a count or row count below 1, more than 2**31 - 1
// chunks in all.
Status locate_chunks(const int64_t* counts, const int64_t* fixed, size_t s, const int32_t* which,
                     const int64_t* rows, size_t n, int32_t* flat_out, int64_t* local_out);

Status gather_fixed(const SpanList& sources, size_t stride, const int32_t* which,
                    const int64_t* rows, size_t n, uint8_t* out, size_t out_size);

// Fill out_offsets[0..n] with the prefix sums of the chosen rows' lengths (in elements) and
// return the total in *total. Validates every offset it reads against its values buffer.
Status var_offsets(const VarList& sources, size_t elem_size, const int32_t* which,
                   const int64_t* rows, size_t n, int64_t* out_offsets, int64_t* total);

// Copy the chosen rows' elements into out_values at the positions out_offsets gives
// (as produced by var_offsets for the same request).
Status gather_var(const VarList& sources, size_t elem_size, const int32_t* which,
                  const int64_t* rows, size_t n, const int64_t* out_offsets, uint8_t* out_values,
                  size_t out_size);

// Copy the chosen rows' elements into separate destinations: row i into dests[i], which holds
// out_offsets[i + 1] - out_offsets[i] elements (out_offsets as produced by var_offsets for the
// same request). For outputs that are one object per row, such as Python bytes.
Status gather_var_rows(const VarList& sources, size_t elem_size,
                       const int32_t* which, const int64_t* rows, size_t n,
                       const int64_t* out_offsets, uint8_t* const* dests);

// Rows of a variable-width batch (values and offsets as gather_var writes them: offsets[0..n]
// non-decreasing, counted in elements of elem_size bytes) as an n x width matrix: row i's
// first min(length, width) elements, then copies of the elem_size bytes of `pad`. out holds
// exactly n * width * elem_size bytes.
Status pad_rows(const uint8_t* values, size_t values_size, size_t elem_size,
                const int64_t* offsets, size_t n, size_t width, const uint8_t* pad, uint8_t* out,
                size_t out_size);

// The shards of a batch: unique_out[0..k) = the distinct values of values[0..n) in increasing
// order, which[i] = the position of values[i] in it; returns k. (numpy.unique with
// return_inverse, for the few distinct shards a batch holds, in microseconds.)
size_t group_values(const int64_t* values, size_t n, int64_t* unique_out, int32_t* which);

}  // namespace streamcache
