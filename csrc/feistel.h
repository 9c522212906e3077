// Keyed bijections of [0, size) by a Feistel network with cycle-walking: the plan's shuffles
// (streamcache/plan/bijection.py; the twin in streamcache/_twin_bijection.py). One pass of
// native code per batch of points, where the numpy twin spends ~80 us of calls per pass
// whatever the batch's size (an epoch's first batch of ids cost ~0.7 ms).
#pragma once

#include <cstddef>
#include <cstdint>

#include "status.h"

namespace streamcache {

// out[i] = the image of points[i] under the bijection of [0, size_i) with round keys
// keys[r * key_stride + i * per_point_keys] (r < rounds), on `width` bits (2..32, with
// 2**width >= every size). sizes: one per point, or one for all (per_point_sizes false).
// Round r splits a value at `width / 2` bits (even r) or `width - width / 2` (odd r) and
// mixes the low part with its key (multiply-xorshift) into the high part; images outside
// [0, size) are walked through the network again. Errors: a point outside its domain (the
// walk could not end), a size beyond 2**width, a width outside 2..32.
Status feistel_walk(const int64_t* points, size_t n, const uint64_t* sizes, bool per_point_sizes,
                    const uint32_t* keys, size_t key_stride, bool per_point_keys, int rounds,
                    int width, int64_t* out);

}  // namespace streamcache
