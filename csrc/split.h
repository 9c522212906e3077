// The multi-node split's paid moves (streamcache/plan/locality.py): which samples a node with
// a surplus gives away in each step, and which node takes each of them.
#pragma once

#include <cstddef>
#include <cstdint>

#include "status.h"

namespace streamcache {

// Balance `steps` steps of `width` slots over `count` nodes by moving samples off the nodes
// with a surplus; `nodes` (steps * width, each slot's node) is updated in place.
//
// - `candidate` (m, strictly ascending flat slot indices) are the samples that may move, with
//   their chunk hashes `hashed` (m). `surplus` (steps * count) is each node's samples beyond
//   what its ranks take in each step (negative: short); every step's entries sum to 0.
// - Released: in every (step, node) with a surplus s > 0, the s candidates on that node with
//   the lowest priority (the top `priority_bits` bits of the hash), then the lowest slot.
// - Received, in slot order: a released sample goes to its chunk's backup node,
//   (owner + 1 + hash % (count - 1)) % count, while that node is short in the step; the rest
//   fill the step's remaining shortfalls in node order.
//
// Everything is checked before anything is written: a refused call (kInvalid: slots out of
// order or range, a candidate's node out of range, a step whose surpluses do not sum to 0, a
// node with fewer candidates than its surplus) leaves `nodes` as it was.
// The sizes paid_moves needs (nodes = steps * width with steps = surpluses / count, one hash
// per candidate, count >= 1, width >= 0), checked before its arrays are read.
Status paid_moves_sizes(size_t nodes, size_t candidates, size_t hashes, size_t surpluses,
                        int64_t width, int64_t count);

Status paid_moves(int64_t* nodes, size_t steps, size_t width, size_t count,
                  const int64_t* candidate, const uint64_t* hashed, size_t m,
                  const int64_t* surplus, int priority_bits);

}  // namespace streamcache
