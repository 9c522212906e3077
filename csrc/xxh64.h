// XXH64, implemented from the published xxHash specification (XXH64 section).
// Used to checksum shards; the Python twin in streamcache/_twin.py computes the same values.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

#include "status.h"

namespace streamcache {

class Xxh64 {
 public:
  explicit Xxh64(uint64_t seed = 0);
  void update(const uint8_t* data, size_t len);
  uint64_t digest() const;

 private:
  uint64_t acc_[4];
  uint64_t seed_;
  uint64_t total_len_ = 0;
  uint8_t buffer_[32];
  size_t buffered_ = 0;
};

uint64_t xxh64(const uint8_t* data, size_t len, uint64_t seed = 0);

// The XXH64 (seed 0) of each consecutive piece of `piece` bytes of data (the last one may be
// shorter) into out, which holds ceil(len / piece) values. With `guard`, data may be a shared
// mapping of a file another process can cut short: a read past the file's end returns an kIo
// status instead of killing the process with SIGBUS (fault_guard.h).
Status xxh64_pieces(const uint8_t* data, size_t len, size_t piece, uint64_t* out, bool guard);

// Hash a whole file, reading it in large blocks. Returns a non-ok status on I/O failure.
Status xxh64_file(const std::string& path, uint64_t seed, uint64_t* out, uint64_t* bytes_read);

}  // namespace streamcache
