#include "backups.h"

#include <algorithm>
#include <queue>
#include <string>
#include <utility>
#include <vector>

namespace streamcache {

namespace {

Status invalid(int64_t at, std::string message) {
  return Status::Error(StatusCode::kInvalid, at, std::move(message));
}

// The checks of choose_backups, in the twin's order.
Status check(const int64_t* bounds, size_t pieces, const int64_t* steps, const int64_t* rows,
             size_t entries, const int64_t* owner, const int64_t* chunks, size_t num_steps,
             size_t nodes) {
  if (bounds[0] != 0 || bounds[pieces] != static_cast<int64_t>(entries)) {
    return invalid(-1, "bounds must rise from 0 to the " + std::to_string(entries) +
                           " entries");
  }
  for (size_t p = 0; p < pieces; ++p) {
    if (bounds[p + 1] < bounds[p]) {
      return invalid(-1, "bounds must rise from 0 to the " + std::to_string(entries) +
                             " entries");
    }
  }
  for (size_t e = 0; e < entries; ++e) {
    if (steps[e] < 0 || static_cast<uint64_t>(steps[e]) >= num_steps || rows[e] < 0) {
      return invalid(static_cast<int64_t>(e),
                     "entry " + std::to_string(e) + "'s step " + std::to_string(steps[e]) +
                         " or rows " + std::to_string(rows[e]) + " is out of range (step below " +
                         std::to_string(num_steps) + ", rows >= 0)");
    }
  }
  for (size_t p = 0; p < pieces; ++p) {
    if (owner[p] < 0 || static_cast<uint64_t>(owner[p]) >= nodes || chunks[p] < 0) {
      return invalid(static_cast<int64_t>(p),
                     "piece " + std::to_string(p) + "'s owner " + std::to_string(owner[p]) +
                         " or chunks " + std::to_string(chunks[p]) +
                         " is out of range (owner below " + std::to_string(nodes) +
                         ", chunks >= 0)");
    }
  }
  return Status::Ok();
}

// A queued candidate: its last count and the piece; the largest count first, then the
// lowest piece (the twin's heap of (-count, piece)).
struct Queued {
  int64_t count;
  int64_t piece;
  bool operator<(const Queued& other) const {
    return count != other.count ? count < other.count : piece > other.piece;
  }
};

}  // namespace

Status choose_backups(const int64_t* bounds, size_t pieces, const int64_t* steps,
                      const int64_t* rows, size_t entries, const int64_t* owner,
                      const int64_t* chunks, int64_t* surplus, size_t num_steps, size_t nodes,
                      int64_t budget, int64_t* chosen) {
  Status s = check(bounds, pieces, steps, rows, entries, owner, chunks, num_steps, nodes);
  if (!s.ok()) return s;
  std::fill(chosen, chosen + pieces, int64_t{-1});
  if (budget <= 0 || pieces == 0) return Status::Ok();
  auto over = [&](int64_t step, int64_t node) {
    return std::max<int64_t>(surplus[static_cast<size_t>(step) * nodes + node], 0);
  };
  auto under = [&](int64_t step, int64_t node) {
    return std::max<int64_t>(-surplus[static_cast<size_t>(step) * nodes + node], 0);
  };
  std::vector<int64_t> gains(nodes);
  // each pair's count now, into gains (the owner's entry -1)
  auto count_pairs = [&](size_t p) {
    std::fill(gains.begin(), gains.end(), int64_t{0});
    const int64_t home = owner[p];
    for (int64_t e = bounds[p]; e < bounds[p + 1]; ++e) {
      const int64_t moves = std::min(rows[e], over(steps[e], home));
      if (moves == 0) continue;
      for (size_t n = 0; n < nodes; ++n) gains[n] += std::min(moves, under(steps[e], n));
    }
    gains[home] = -1;
  };
  std::priority_queue<Queued> queue;
  for (size_t p = 0; p < pieces; ++p) {
    if (chunks[p] <= 0) continue;
    count_pairs(p);
    const int64_t best = *std::max_element(gains.begin(), gains.end());
    if (best > chunks[p]) queue.push({best, static_cast<int64_t>(p)});
  }
  std::vector<int64_t> held(nodes, 0);  // chunks each node holds twice so far
  int64_t held_sum = 0, taken = 0;
  while (!queue.empty() && taken < budget) {
    const size_t p = static_cast<size_t>(queue.top().piece);
    queue.pop();
    count_pairs(p);
    size_t node = 0;
    int64_t best_score = 0;
    for (size_t n = 0; n < nodes; ++n) {  // (the twin: argmax of gains * (held_sum + 1) - held)
      const int64_t score = gains[n] * (held_sum + 1) - held[n];
      if (n == 0 || score > best_score) {
        best_score = score;
        node = n;
      }
    }
    const int64_t gain = gains[node];
    if (gain <= chunks[p]) continue;
    if (!queue.empty() && gain < queue.top().count) {
      queue.push({gain, static_cast<int64_t>(p)});
      continue;
    }
    const int64_t home = owner[p];
    for (int64_t e = bounds[p]; e < bounds[p + 1]; ++e) {
      const int64_t moved = std::min({rows[e], over(steps[e], home), under(steps[e], node)});
      surplus[static_cast<size_t>(steps[e]) * nodes + home] -= moved;
      surplus[static_cast<size_t>(steps[e]) * nodes + node] += moved;
    }
    held[node] += chunks[p];
    held_sum += chunks[p];
    chosen[p] = static_cast<int64_t>(node);
    ++taken;
  }
  return Status::Ok();
}

}  // namespace streamcache
