// Large memory copies whose destination is not read again soon (a checkpoint's staging
// buffers: the writer reads them back long after they have left the caches).
#pragma once

#include <cstddef>
#include <cstdint>

#include "status.h"

namespace streamcache {

// Copies below this many bytes use memcpy (the destination may still be hot when read).
constexpr size_t kStreamCopyBytes = 256 << 10;

// Copy n bytes from src to dst (which must not overlap), split into at most `threads` parts
// run on the process-wide pool (the calling thread takes a part too). From
// kStreamCopyBytes up, on x86-64, with non-temporal stores: the destination's lines are
// not read first and do not evict the caller's working set (about 1.7x a plain copy of a
// 256 MB state here); elsewhere, and below that size, memcpy.
//
// With `guard`, dst may be a shared mapping of a file that another process can cut short: a
// store past the file's end returns an kIo status instead of killing the process with
// SIGBUS (fault_guard.h); the destination's bytes are then partly written.
Status stream_copy(uint8_t* dst, const uint8_t* src, size_t n, size_t threads,
                   bool guard = false);

}  // namespace streamcache
