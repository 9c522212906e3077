// The record batches of an Arrow IPC file read from its own bytes: where each batch's buffers
// lie, without building an Arrow object per batch (a shard of 672 batches took 12-30 ms to
// open through pyarrow, most of it per-batch objects; this walk takes well under 1 ms).
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "status.h"

namespace streamcache {

// kUnsupported is returned as kInvalid with this item: the file is well formed but uses what
// this walk does not read (compressed bodies, dictionaries); the caller reads it otherwise.
constexpr int64_t kIpcUnsupported = -2;

// Every record batch of the Arrow IPC file `file` (its whole `size` bytes), from the footer
// the file ends with. The file is untrusted: every offset is checked before it is followed,
// every buffer must lie inside its batch's body at an 8-byte aligned offset (as Arrow's reader
// requires), and each batch must have exactly
// `nodes_per_batch` field nodes and `buffers_per_batch` buffers (what the schema's flattened
// columns have). Outputs, per batch b: rows[b]; nodes[b * nodes_per_batch + i] = (length,
// null_count) as two int64; buffers[b * buffers_per_batch + i] = (offset in the file, length).
// Errors: kCorrupt (item: the batch, or -1 for the footer) for a malformed file; kInvalid
// with item kIpcUnsupported for compressed bodies or dictionary batches.
Status ipc_record_batches(const uint8_t* file, size_t size, size_t nodes_per_batch,
                          size_t buffers_per_batch, std::vector<int64_t>* rows,
                          std::vector<int64_t>* nodes, std::vector<int64_t>* buffers);

// Checks the int64 offsets of each batch of a variable-width column: count[b] + 1 entries at
// file offset at[b] (8-byte aligned), non-decreasing from a non-negative first, the last
// times elem_size within values_bytes[b]. Error: kCorrupt, item the batch.
Status check_ipc_offsets(const uint8_t* file, size_t size, const int64_t* at,
                         const int64_t* count, const int64_t* values_bytes, size_t batches,
                         int64_t elem_size);

}  // namespace streamcache
