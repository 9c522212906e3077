#include "copy.h"

#include <algorithm>
#include <atomic>
#include <cstring>
#include <functional>

#include "fault_guard.h"
#include "thread_pool.h"

#if defined(__SSE2__)
#include <emmintrin.h>
#endif

namespace streamcache {
namespace {

// Each thread's part is at least this long: a smaller one costs more to hand out than to copy.
constexpr size_t kMinPartBytes = 4 << 20;

void copy_part(uint8_t* dst, const uint8_t* src, size_t n) {
#if defined(__SSE2__)
  if (n >= kStreamCopyBytes) {
    const size_t head = std::min(n, (16 - reinterpret_cast<uintptr_t>(dst) % 16) % 16);
    std::memcpy(dst, src, head);
    size_t i = head;
    for (; i + 64 <= n; i += 64) {  // stores aligned to 16, loads as they come
      const __m128i a = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i));
      const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i + 16));
      const __m128i c = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i + 32));
      const __m128i d = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i + 48));
      _mm_stream_si128(reinterpret_cast<__m128i*>(dst + i), a);
      _mm_stream_si128(reinterpret_cast<__m128i*>(dst + i + 16), b);
      _mm_stream_si128(reinterpret_cast<__m128i*>(dst + i + 32), c);
      _mm_stream_si128(reinterpret_cast<__m128i*>(dst + i + 48), d);
    }
    _mm_sfence();  // the streamed lines are visible to other threads before we return
    std::memcpy(dst + i, src + i, n - i);
    return;
  }
#endif
  std::memcpy(dst, src, n);
}

struct Part {
  uint8_t* dst;
  const uint8_t* src;
  size_t n;
};

// One part, guarded or not; false when the guard caught a fault.
bool copy_one(const Part& part, bool guard) {
  if (!guard) {
    copy_part(part.dst, part.src, part.n);
    return true;
  }
  Part args = part;
  const bool whole = run_fault_guarded(
      [](void* p) {
        const Part* a = static_cast<const Part*>(p);
        copy_part(a->dst, a->src, a->n);
      },
      &args);
#if defined(__SSE2__)
  if (!whole) _mm_sfence();  // the jump skipped the part's own fence
#endif
  return whole;
}

Status cut_short() {
  return Status::Error(StatusCode::kIo, -1,
                       "the destination's mapped file was cut short while it was written "
                       "(SIGBUS): another process truncated it");
}

}  // namespace

Status stream_copy(uint8_t* dst, const uint8_t* src, size_t n, size_t threads, bool guard) {
  if (n == 0) return Status::Ok();
  const uintptr_t d = reinterpret_cast<uintptr_t>(dst), s = reinterpret_cast<uintptr_t>(src);
  if (d < s + n && s < d + n) {
    return Status::Error(StatusCode::kInvalid, -1,
                         "source and destination overlap: copy into a separate buffer");
  }
  const size_t parts = std::max<size_t>(1, std::min(threads, n / kMinPartBytes));
  if (parts == 1) return copy_one({dst, src, n}, guard) ? Status::Ok() : cut_short();
  const size_t part = (n + parts - 1) / parts;
  std::atomic<bool> faulted{false};
  global_pool().parallel_for(parts, 1, [&](size_t begin, size_t end) {
    for (size_t p = begin; p < end; ++p) {
      const size_t start = p * part;
      if (!copy_one({dst + start, src + start, std::min(part, n - start)}, guard)) {
        faulted.store(true);
      }
    }
  });
  return faulted.load() ? cut_short() : Status::Ok();
}

}  // namespace streamcache
