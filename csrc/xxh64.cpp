#include "xxh64.h"

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <vector>

#include "fault_guard.h"

namespace streamcache {
namespace {

constexpr uint64_t kP1 = 0x9E3779B185EBCA87ULL;
constexpr uint64_t kP2 = 0xC2B2AE3D27D4EB4FULL;
constexpr uint64_t kP3 = 0x165667B19E3779F9ULL;
constexpr uint64_t kP4 = 0x85EBCA77C2B2AE63ULL;
constexpr uint64_t kP5 = 0x27D4EB2F165667C5ULL;

inline uint64_t rotl(uint64_t x, int r) { return (x << r) | (x >> (64 - r)); }

inline uint64_t load64(const uint8_t* p) {
  uint64_t v;
  std::memcpy(&v, p, 8);  // little-endian hosts only (x86-64, aarch64)
  return v;
}

inline uint32_t load32(const uint8_t* p) {
  uint32_t v;
  std::memcpy(&v, p, 4);
  return v;
}

inline uint64_t round_(uint64_t acc, uint64_t input) {
  acc += input * kP2;
  acc = rotl(acc, 31);
  return acc * kP1;
}

inline uint64_t merge_round(uint64_t acc, uint64_t val) {
  acc ^= round_(0, val);
  return acc * kP1 + kP4;
}

inline void consume_stripes(uint64_t acc[4], const uint8_t* p, size_t stripes) {
  for (size_t i = 0; i < stripes; ++i, p += 32) {
    acc[0] = round_(acc[0], load64(p));
    acc[1] = round_(acc[1], load64(p + 8));
    acc[2] = round_(acc[2], load64(p + 16));
    acc[3] = round_(acc[3], load64(p + 24));
  }
}

uint64_t finish(uint64_t h, const uint8_t* p, size_t len) {
  while (len >= 8) {
    h ^= round_(0, load64(p));
    h = rotl(h, 27) * kP1 + kP4;
    p += 8;
    len -= 8;
  }
  if (len >= 4) {
    h ^= static_cast<uint64_t>(load32(p)) * kP1;
    h = rotl(h, 23) * kP2 + kP3;
    p += 4;
    len -= 4;
  }
  while (len > 0) {
    h ^= (*p) * kP5;
    h = rotl(h, 11) * kP1;
    ++p;
    --len;
  }
  h ^= h >> 33;
  h *= kP2;
  h ^= h >> 29;
  h *= kP3;
  h ^= h >> 32;
  return h;
}

}  // namespace

Xxh64::Xxh64(uint64_t seed) : seed_(seed) {
  acc_[0] = seed + kP1 + kP2;
  acc_[1] = seed + kP2;
  acc_[2] = seed;
  acc_[3] = seed - kP1;
}

void Xxh64::update(const uint8_t* data, size_t len) {
  total_len_ += len;
  if (buffered_ > 0) {
    size_t take = 32 - buffered_;
    if (take > len) take = len;
    std::memcpy(buffer_ + buffered_, data, take);
    buffered_ += take;
    data += take;
    len -= take;
    if (buffered_ < 32) return;
    consume_stripes(acc_, buffer_, 1);
    buffered_ = 0;
  }
  size_t stripes = len / 32;
  consume_stripes(acc_, data, stripes);
  data += stripes * 32;
  len -= stripes * 32;
  std::memcpy(buffer_, data, len);
  buffered_ = len;
}

uint64_t Xxh64::digest() const {
  uint64_t h;
  if (total_len_ >= 32) {
    h = rotl(acc_[0], 1) + rotl(acc_[1], 7) + rotl(acc_[2], 12) + rotl(acc_[3], 18);
    for (uint64_t a : acc_) h = merge_round(h, a);
  } else {
    h = seed_ + kP5;
  }
  h += total_len_;
  return finish(h, buffer_, buffered_);
}

uint64_t xxh64(const uint8_t* data, size_t len, uint64_t seed) {
  Xxh64 state(seed);
  state.update(data, len);
  return state.digest();
}

namespace {

struct Pieces {
  const uint8_t* data;
  size_t len;
  size_t piece;
  uint64_t* out;
};

void hash_pieces(void* p) {
  const Pieces* a = static_cast<const Pieces*>(p);
  for (size_t start = 0, i = 0; start < a->len; start += a->piece, ++i) {
    const size_t n = a->len - start < a->piece ? a->len - start : a->piece;
    a->out[i] = xxh64(a->data + start, n, 0);
  }
}

}  // namespace

Status xxh64_pieces(const uint8_t* data, size_t len, size_t piece, uint64_t* out, bool guard) {
  Pieces args{data, len, piece, out};
  if (!guard) {
    hash_pieces(&args);
    return Status::Ok();
  }
  if (run_fault_guarded(hash_pieces, &args)) return Status::Ok();
  return Status::Error(StatusCode::kIo, -1,
                       "the mapped file was cut short while it was read (SIGBUS): another "
                       "process truncated it");
}

Status xxh64_file(const std::string& path, uint64_t seed, uint64_t* out, uint64_t* bytes_read) {
  FILE* f = std::fopen(path.c_str(), "rb");
  if (f == nullptr) {
    return Status::Error(StatusCode::kIo, -1, path + ": " + os_error_message(errno));
  }
  std::vector<uint8_t> block(4 << 20);
  Xxh64 state(seed);
  uint64_t total = 0;
  for (;;) {
    size_t got = std::fread(block.data(), 1, block.size(), f);
    state.update(block.data(), got);
    total += got;
    if (got < block.size()) break;
  }
  bool failed = std::ferror(f) != 0;
  int read_errno = errno;  // meaningful only when failed
  std::fclose(f);
  if (failed) return Status::Error(StatusCode::kIo, -1, path + ": " + os_error_message(read_errno));
  *out = state.digest();
  *bytes_read = total;
  return Status::Ok();
}

}  // namespace streamcache
