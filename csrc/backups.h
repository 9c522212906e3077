// Choosing the pieces two nodes hold from a small epoch's order (streamcache/plan/
// backup_plan.py), in native code; its twin is streamcache/_twin_split.choose_backups.
#pragma once

#include <cstddef>
#include <cstdint>

#include "status.h"

namespace streamcache {

// A greedy choice of (piece, second node) pairs. Piece p's entries are [bounds[p],
// bounds[p + 1]): its rows rows[e] in step steps[e]; owner[p] its node, chunks[p] its chunks
// (0: never chosen). surplus (num_steps * nodes) is each node's samples beyond its share in
// each step (negative: short), updated as pairs are chosen. chosen (pieces) receives each
// piece's second node, -1 where none.
//
// A pair's count is sum over p's steps of min(rows, over(step, owner), under(step, node)),
// over = max(surplus, 0), under = max(-surplus, 0). A piece is a candidate where chunks > 0
// and its best count before any choice exceeds its chunks. Candidates are kept in a queue by
// their last count (largest first, then the lowest piece); the first is recounted against
// the surpluses now: its node is the one of the largest count (among equal counts, the one
// holding the fewest chunks twice so far, then the lowest); it is dropped where that count
// is at most its chunks, put back where it is below the next one's last count, else chosen
// (its moves applied to surplus) until `budget` pieces are chosen or the queue is empty.
//
// Everything is checked before anything is written: a refused call (kInvalid: bounds that do
// not rise from 0 to the entries, an entry's step out of range or rows negative (item: the
// entry), a piece's owner out of [0, nodes) or chunks negative (item: the piece)) leaves
// surplus and chosen as they were.
Status choose_backups(const int64_t* bounds, size_t pieces, const int64_t* steps,
                      const int64_t* rows, size_t entries, const int64_t* owner,
                      const int64_t* chunks, int64_t* surplus, size_t num_steps, size_t nodes,
                      int64_t budget, int64_t* chosen);

}  // namespace streamcache
