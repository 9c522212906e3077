#include "feistel.h"

#include <string>

namespace streamcache {
namespace {

struct Round {
  uint32_t mask;      // the low part's bits
  uint32_t split;     // the low part's width
  uint32_t other;     // the high part's width
  uint32_t keep_top;  // the shift that keeps a hash's top `other` bits
};

inline uint32_t round_of(uint32_t x, uint32_t key, const Round& round) {
  const uint32_t low = x & round.mask;
  const uint32_t high = x >> round.split;
  uint32_t z = low ^ key;
  z *= 0x9E3779B1u;
  z ^= z >> 16;
  z *= 0x85EBCA77u;
  z >>= round.keep_top;
  z ^= high;
  return (low << round.other) | z;
}

constexpr size_t kBlock = 256;  // points in flight: one round over all of them at a time

// One pass of the network over the `count` values of xs, whose points are base + at[t]:
// round by round over all of them (independent lanes, which the compiler vectorizes), not
// point by point (a chain of dependent multiplies).
inline void run_block_generic(uint32_t* xs, const uint32_t* at, size_t count, size_t base,
                              const Round* rounds, int round_count, const uint32_t* keys,
                              size_t key_stride, bool per_point_keys) {
  for (int r = 0; r < round_count; ++r) {
    const Round round = rounds[r];
    const uint32_t* row = keys + static_cast<size_t>(r) * key_stride;
    if (!per_point_keys) {
      const uint32_t key = row[0];
      for (size_t t = 0; t < count; ++t) xs[t] = round_of(xs[t], key, round);
    } else {
      const uint32_t* mine = row + base;
      for (size_t t = 0; t < count; ++t) xs[t] = round_of(xs[t], mine[at[t]], round);
    }
  }
}

#if defined(__GNUC__) && defined(__x86_64__)
// The same loops where the CPU has AVX2 (8 lanes of 32-bit multiplies; the baseline x86-64
// has no packed 32-bit multiply): 23.5 -> 19.3 ms for a reader thread's ids of an epoch of a
// million samples, the rest of it numpy around the pass.
__attribute__((target("avx2"))) void run_block_avx2(uint32_t* xs, const uint32_t* at,
                                                    size_t count, size_t base,
                                                    const Round* rounds, int round_count,
                                                    const uint32_t* keys, size_t key_stride,
                                                    bool per_point_keys) {
  run_block_generic(xs, at, count, base, rounds, round_count, keys, key_stride, per_point_keys);
}

bool has_avx2() {
  static const bool has = __builtin_cpu_supports("avx2");
  return has;
}
#endif

void run_block(uint32_t* xs, const uint32_t* at, size_t count, size_t base, const Round* rounds,
               int round_count, const uint32_t* keys, size_t key_stride, bool per_point_keys) {
#if defined(__GNUC__) && defined(__x86_64__)
  if (has_avx2()) {
    return run_block_avx2(xs, at, count, base, rounds, round_count, keys, key_stride,
                          per_point_keys);
  }
#endif
  run_block_generic(xs, at, count, base, rounds, round_count, keys, key_stride, per_point_keys);
}

}  // namespace

Status feistel_walk(const int64_t* points, size_t n, const uint64_t* sizes, bool per_point_sizes,
                    const uint32_t* keys, size_t key_stride, bool per_point_keys, int rounds,
                    int width, int64_t* out) {
  if (width < 2 || width > 32) {
    return Status::Error(StatusCode::kInvalid, -1,
                         "width must be 2..32, got " + std::to_string(width));
  }
  if (rounds < 0 || rounds > 64) {
    return Status::Error(StatusCode::kInvalid, -1,
                         "rounds must be 0..64, got " + std::to_string(rounds));
  }
  Round table[64];
  const uint32_t low = static_cast<uint32_t>(width) / 2;
  for (int r = 0; r < rounds; ++r) {
    const uint32_t split = (r % 2 == 0) ? low : static_cast<uint32_t>(width) - low;
    const uint32_t other = static_cast<uint32_t>(width) - split;
    table[r] = {(1u << split) - 1u, split, other, 32u - other};
  }
  const uint64_t limit = uint64_t{1} << width;
  uint32_t xs[kBlock];
  uint32_t at[kBlock];
  for (size_t base = 0; base < n; base += kBlock) {
    const size_t m = n - base < kBlock ? n - base : kBlock;
    for (size_t j = 0; j < m; ++j) {
      const size_t i = base + j;
      const uint64_t size = sizes[per_point_sizes ? i : 0];
      if (size > limit) {
        return Status::Error(StatusCode::kInvalid, static_cast<int64_t>(i),
                             "domain size " + std::to_string(size) + " of point " +
                                 std::to_string(i) + " exceeds 2**" + std::to_string(width));
      }
      const int64_t point = points[i];
      if (point < 0 || static_cast<uint64_t>(point) >= size) {
        return Status::Error(StatusCode::kInvalid, static_cast<int64_t>(i),
                             "point " + std::to_string(i) + " (" + std::to_string(point) +
                                 ") is outside its domain [0, " + std::to_string(size) + ")");
      }
      xs[j] = static_cast<uint32_t>(point);
      at[j] = static_cast<uint32_t>(j);
    }
    // Walk: the images outside their domains go through the network again, together. Each
    // walk ends: the cycle of the network's permutation through a point holds the point.
    size_t count = m;
    while (count > 0) {
      run_block(xs, at, count, base, table, rounds, keys, key_stride, per_point_keys);
      size_t kept = 0;
      for (size_t t = 0; t < count; ++t) {
        const size_t i = base + at[t];
        if (xs[t] < sizes[per_point_sizes ? i : 0]) {
          out[i] = xs[t];
        } else {
          xs[kept] = xs[t];
          at[kept] = at[t];
          ++kept;
        }
      }
      count = kept;
    }
  }
  return Status::Ok();
}

}  // namespace streamcache
