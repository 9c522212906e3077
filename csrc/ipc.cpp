#include "ipc.h"

#include <cstring>
#include <string>

namespace streamcache {
namespace {

// A flatbuffer inside [base, base + size): every read is bounds-checked, so a hostile file
// gives an error, never a read outside it.
class Flat {
 public:
  Flat(const uint8_t* base, size_t size) : base_(base), size_(size) {}

  bool u8(size_t at, uint8_t* out) const {
    if (at >= size_) return false;
    *out = base_[at];
    return true;
  }
  bool u16(size_t at, uint16_t* out) const { return read(at, out); }
  bool u32(size_t at, uint32_t* out) const { return read(at, out); }
  bool i32(size_t at, int32_t* out) const { return read(at, out); }
  bool i64(size_t at, int64_t* out) const { return read(at, out); }

  // The table at `at`: where its field `id` is (0 when absent). False: malformed.
  bool field(size_t table, int id, size_t* out) const {
    int32_t back;
    if (!i32(table, &back)) return false;
    const int64_t vtable = static_cast<int64_t>(table) - back;
    if (vtable < 0 || static_cast<uint64_t>(vtable) >= size_) return false;
    uint16_t vtable_size;
    if (!u16(static_cast<size_t>(vtable), &vtable_size)) return false;
    const size_t slot = 4 + 2 * static_cast<size_t>(id);
    if (slot + 2 > vtable_size) {
      *out = 0;
      return true;
    }
    uint16_t offset;
    if (!u16(static_cast<size_t>(vtable) + slot, &offset)) return false;
    *out = offset == 0 ? 0 : table + offset;
    return true;
  }

  // Follows the uoffset at `at` (a table, vector or string it refers to).
  bool follow(size_t at, size_t* out) const {
    uint32_t offset;
    if (!u32(at, &offset)) return false;
    const uint64_t target = static_cast<uint64_t>(at) + offset;
    if (target >= size_) return false;
    *out = static_cast<size_t>(target);
    return true;
  }

  // The vector whose uoffset is at `at`: where its elements start and how many there are,
  // checked to fit with `element` bytes each.
  bool vector(size_t at, size_t element, size_t* first, size_t* count) const {
    size_t vec;
    uint32_t n;
    if (!follow(at, &vec) || !u32(vec, &n)) return false;
    if (static_cast<uint64_t>(n) * element > size_ - vec - 4) return false;
    *first = vec + 4;
    *count = n;
    return true;
  }

 private:
  template <typename T>
  bool read(size_t at, T* out) const {
    if (at > size_ || size_ - at < sizeof(T)) return false;
    std::memcpy(out, base_ + at, sizeof(T));  // little-endian, as Arrow writes
    return true;
  }

  const uint8_t* base_;
  size_t size_;
};

constexpr uint32_t kContinuation = 0xFFFFFFFFu;
constexpr uint8_t kRecordBatchHeader = 3;  // MessageHeader { NONE, Schema, Dictionary, RecordBatch }
constexpr size_t kBlockBytes = 24;         // Block { offset: long; metaDataLength: int; bodyLength: long }

Status corrupt(int64_t batch, const std::string& what) {
  return Status::Error(StatusCode::kCorrupt, batch, what);
}

// One record batch message: its rows, nodes and buffers (made absolute) into the outputs.
Status read_batch(const uint8_t* file, int64_t b, int64_t offset, int32_t meta,
                  int64_t body, size_t want_nodes, size_t want_buffers, int64_t* rows,
                  int64_t* nodes, int64_t* buffers) {
  // The encapsulated message: [0xFFFFFFFF] int32 length, the flatbuffer, padding.
  const Flat prefix(file + offset, static_cast<size_t>(meta));
  uint32_t first = 0;
  if (!prefix.u32(0, &first)) return corrupt(b, "its message is shorter than its prefix");
  size_t start = 4;
  int32_t length = static_cast<int32_t>(first);
  if (first == kContinuation) {
    if (!prefix.i32(4, &length)) return corrupt(b, "its message is shorter than its prefix");
    start = 8;
  }
  if (length <= 0 || static_cast<uint64_t>(length) > static_cast<uint64_t>(meta) - start) {
    return corrupt(b, "its message length does not fit its block");
  }
  const Flat msg(file + offset + start, static_cast<size_t>(length));
  size_t root, type_at, header_at, body_at;
  uint8_t type = 0;
  if (!msg.follow(0, &root) || !msg.field(root, 1, &type_at) || !msg.field(root, 2, &header_at) ||
      !msg.field(root, 3, &body_at)) {
    return corrupt(b, "its message is malformed");
  }
  if (type_at == 0 || !msg.u8(type_at, &type) || header_at == 0) {
    return corrupt(b, "its message has no header");
  }
  if (type != kRecordBatchHeader) {
    return Status::Error(StatusCode::kInvalid, kIpcUnsupported, "a message that is not a record batch");
  }
  int64_t body_length = 0;
  if (body_at != 0 && !msg.i64(body_at, &body_length)) return corrupt(b, "its message is malformed");
  if (body_length != body) return corrupt(b, "its body length differs from the footer's");
  size_t batch, length_at, nodes_at, buffers_at, compression_at;
  if (!msg.follow(header_at, &batch) || !msg.field(batch, 0, &length_at) ||
      !msg.field(batch, 1, &nodes_at) || !msg.field(batch, 2, &buffers_at) ||
      !msg.field(batch, 3, &compression_at)) {
    return corrupt(b, "its record batch header is malformed");
  }
  if (compression_at != 0) {
    return Status::Error(StatusCode::kInvalid, kIpcUnsupported, "a compressed record batch");
  }
  int64_t n_rows = 0;
  if (length_at != 0 && !msg.i64(length_at, &n_rows)) return corrupt(b, "its row count is malformed");
  if (n_rows < 0) return corrupt(b, "a negative row count");
  size_t first_node = 0, node_count = 0, first_buffer = 0, buffer_count = 0;
  if ((nodes_at != 0 && !msg.vector(nodes_at, 16, &first_node, &node_count)) ||
      (buffers_at != 0 && !msg.vector(buffers_at, 16, &first_buffer, &buffer_count))) {
    return corrupt(b, "its node or buffer list does not fit its message");
  }
  if (node_count != want_nodes || buffer_count != want_buffers) {
    return corrupt(b, "it has " + std::to_string(node_count) + " field nodes and " +
                          std::to_string(buffer_count) + " buffers; the schema has " +
                          std::to_string(want_nodes) + " and " + std::to_string(want_buffers));
  }
  *rows = n_rows;
  for (size_t i = 0; i < node_count; ++i) {
    int64_t len = 0, nulls = 0;
    msg.i64(first_node + 16 * i, &len);  // (inside: the vector was checked to fit)
    msg.i64(first_node + 16 * i + 8, &nulls);
    if (len < 0 || nulls < 0 || nulls > len) return corrupt(b, "a field node's counts are impossible");
    nodes[2 * i] = len;
    nodes[2 * i + 1] = nulls;
  }
  const int64_t body_start = offset + meta;
  for (size_t i = 0; i < buffer_count; ++i) {
    int64_t at = 0, len = 0;
    msg.i64(first_buffer + 16 * i, &at);
    msg.i64(first_buffer + 16 * i + 8, &len);
    if (at < 0 || len < 0 || at > body || len > body - at) {
      return corrupt(b, "a buffer lies outside its batch's body");
    }
    if (at % 8 != 0) return corrupt(b, "a buffer is not 8-byte aligned in its batch's body");
    buffers[2 * i] = body_start + at;
    buffers[2 * i + 1] = len;
  }
  return Status::Ok();
}

}  // namespace

Status ipc_record_batches(const uint8_t* file, size_t size, size_t nodes_per_batch,
                          size_t buffers_per_batch, std::vector<int64_t>* rows,
                          std::vector<int64_t>* nodes, std::vector<int64_t>* buffers) {
  static const char kMagic[6] = {'A', 'R', 'R', 'O', 'W', '1'};
  if (size < 18 || std::memcmp(file, kMagic, 6) != 0 || std::memcmp(file + size - 6, kMagic, 6) != 0) {
    return corrupt(-1, "it does not begin and end like an Arrow IPC file");
  }
  int32_t footer_length;
  std::memcpy(&footer_length, file + size - 10, 4);
  if (footer_length <= 0 || static_cast<uint64_t>(footer_length) > size - 18) {
    return corrupt(-1, "its footer length does not fit the file");
  }
  const size_t footer_start = size - 10 - static_cast<size_t>(footer_length);
  const Flat footer(file + footer_start, static_cast<size_t>(footer_length));
  size_t root, dictionaries_at, batches_at;
  if (!footer.follow(0, &root) || !footer.field(root, 2, &dictionaries_at) ||
      !footer.field(root, 3, &batches_at)) {
    return corrupt(-1, "its footer is malformed");
  }
  size_t first = 0, count = 0;
  if (dictionaries_at != 0) {
    if (!footer.vector(dictionaries_at, kBlockBytes, &first, &count)) {
      return corrupt(-1, "its footer's dictionary list does not fit it");
    }
    if (count != 0) {
      return Status::Error(StatusCode::kInvalid, kIpcUnsupported, "dictionary batches");
    }
  }
  count = 0;
  if (batches_at != 0 && !footer.vector(batches_at, kBlockBytes, &first, &count)) {
    return corrupt(-1, "its footer's record batch list does not fit it");
  }
  rows->assign(count, 0);
  nodes->assign(count * nodes_per_batch * 2, 0);
  buffers->assign(count * buffers_per_batch * 2, 0);
  for (size_t b = 0; b < count; ++b) {
    int64_t offset = 0, body = 0;
    int32_t meta = 0;
    footer.i64(first + kBlockBytes * b, &offset);
    footer.i32(first + kBlockBytes * b + 8, &meta);
    footer.i64(first + kBlockBytes * b + 16, &body);
    const auto batch = static_cast<int64_t>(b);
    if (offset < 8 || meta < 8 || body < 0 || static_cast<uint64_t>(offset) > footer_start ||
        static_cast<uint64_t>(meta) > footer_start - static_cast<uint64_t>(offset) ||
        static_cast<uint64_t>(body) > footer_start - static_cast<uint64_t>(offset) - static_cast<uint64_t>(meta)) {
      return corrupt(batch, "its block lies outside the file's data");
    }
    Status s = read_batch(file, batch, offset, meta, body, nodes_per_batch, buffers_per_batch,
                          rows->data() + b, nodes->data() + b * nodes_per_batch * 2,
                          buffers->data() + b * buffers_per_batch * 2);
    if (!s.ok()) return s;
  }
  return Status::Ok();
}

Status check_ipc_offsets(const uint8_t* file, size_t size, const int64_t* at,
                         const int64_t* count, const int64_t* values_bytes, size_t batches,
                         int64_t elem_size) {
  if (elem_size <= 0) return Status::Error(StatusCode::kInvalid, -1, "elem_size must be positive");
  for (size_t b = 0; b < batches; ++b) {
    const auto batch = static_cast<int64_t>(b);
    const int64_t n = count[b];
    if (at[b] < 0 || at[b] % 8 != 0 || n < 0 || values_bytes[b] < 0 ||
        static_cast<uint64_t>(at[b]) > size ||
        static_cast<uint64_t>(n) + 1 > (size - static_cast<uint64_t>(at[b])) / 8) {
      return corrupt(batch, "its offsets do not fit the file or are not aligned");
    }
    const int64_t limit = values_bytes[b] / elem_size;
    int64_t previous = 0;
    for (int64_t i = 0; i <= n; ++i) {
      int64_t value = 0;
      std::memcpy(&value, file + at[b] + 8 * i, 8);
      if (value < previous) return corrupt(batch, "its offsets decrease or start below 0");
      previous = value;
    }
    if (previous > limit) return corrupt(batch, "its offsets run past its values");
  }
  return Status::Ok();
}

}  // namespace streamcache
