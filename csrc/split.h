// The multi-node split (streamcache/plan/locality.py) in native code: each slot's node before a
// step is balanced (its piece's owner), and the paid moves: which samples a node with a
// surplus gives away in each step, and which node takes each of them.
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

// Each slot's piece, its node before the steps are balanced (its piece's owner) and each
// step's surplus. With v = at[i] (a slot's entry in the value tables, of `values` entries):
//   piece[i] = rows[i] / piece_rows[v],  nodes[i] = (offsets[v] + piece[i]) % count,
//   surplus[s * count + n] = (slots of step s on node n) - targets[n],
// for the `total` slots, steps of `width` slots (total a multiple of width; width >= 1 unless
// total is 0). Refused (kInvalid, item: the slot) where at[i] is not below `values`,
// rows[i] < 0, piece_rows[v] < 1 or offsets[v] is outside [0, count); the outputs may then be
// partly written.
Status owner_nodes(const int64_t* at, const int64_t* rows, size_t total, const int64_t* offsets,
                   const int64_t* piece_rows, size_t values, const int64_t* targets,
                   size_t count, size_t width, int64_t* nodes, int64_t* piece,
                   int64_t* surplus);

// The paid moves whose candidates are every slot on a node with a surplus in its step and
// whose hashes are those slots' chunk release hashes: with v = at[slot],
//   key = key_base[v] + rows[slot] / key_rows[v],
//   hash = mix64(release_key + (key + 1) * 0x9E3779B97F4A7C15)  (bijection.counter_hash),
// then paid_moves (its rule and checks). Refused, with `nodes` unchanged, where a slot's
// node is outside [0, count), a candidate's at is not below `values`, its row < 0 or its
// key_rows < 1 (item: the slot), or paid_moves refuses.
Status release_moves(int64_t* nodes, size_t steps, size_t width, size_t count,
                     const int64_t* surplus, const int64_t* at, const int64_t* rows,
                     const int64_t* key_base, const int64_t* key_rows, size_t values,
                     uint64_t release_key, int priority_bits);

}  // namespace streamcache
