// Errors travel out of native code as values, never as C++ exceptions across threads.
#pragma once

#include <cstdint>
#include <cstring>
#include <string>
#include <utility>

namespace streamcache {

enum class StatusCode : int {
  kOk = 0,
  kOutOfRange = 1,  // a row or shard index outside its table
  kCorrupt = 2,     // a buffer whose structure contradicts itself (offsets, sizes)
  kIo = 3,          // an operating-system I/O failure
  kInvalid = 4,     // an argument that can never be valid
  kInternal = 5,    // an unexpected failure inside native code (e.g. out of memory)
};

struct Status {
  StatusCode code = StatusCode::kOk;
  int64_t item = -1;  // the position in the request that failed, when there is one
  std::string message;

  static Status Ok() { return {}; }
  static Status Error(StatusCode c, int64_t at, std::string msg) {
    Status s;
    s.code = c;
    s.item = at;
    s.message = std::move(msg);
    return s;
  }
  bool ok() const { return code == StatusCode::kOk; }
};

namespace detail {
// strerror_r comes in two flavours (XSI returns int, GNU returns char*); each overload takes
// one of them.
inline std::string strerror_text(int result, const char* buffer) {
  return result == 0 ? std::string(buffer) : std::string("unknown error");
}
inline std::string strerror_text(const char* result, const char* /*buffer*/) {
  return std::string(result);
}
}  // namespace detail

// The text of an errno value. Thread-safe, unlike strerror(), which may share one static
// buffer between threads.
inline std::string os_error_message(int err) {
  char buffer[256] = {0};
  return detail::strerror_text(strerror_r(err, buffer, sizeof buffer), buffer);
}

}  // namespace streamcache
