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

// Hash a whole file, reading it in large blocks. Returns a non-ok status on I/O failure.
Status xxh64_file(const std::string& path, uint64_t seed, uint64_t* out, uint64_t* bytes_read);

}  // namespace streamcache
