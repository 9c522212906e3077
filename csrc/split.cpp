#include "split.h"

#include <algorithm>
#include <cmath>
#include <string>
#include <vector>

namespace streamcache {

namespace {

// Runs up to this long are ranked by counting (size * size compares, no branches); longer
// ones by nth_element.
constexpr size_t kRankedWhole = 48;

Status invalid(int64_t at, std::string message) {
  return Status::Error(StatusCode::kInvalid, at, std::move(message));
}

// Every check of paid_moves, before it writes anything.
Status check(const int64_t* nodes, size_t steps, size_t width, size_t count,
             const int64_t* candidate, size_t m, const int64_t* surplus, int priority_bits) {
  if (count == 0) return invalid(-1, "count must be at least 1");
  if (priority_bits < 1 || priority_bits > 32) {
    return invalid(-1, "priority_bits must be in [1, 32]");
  }
  if (width >= (size_t{1} << 31)) return invalid(-1, "width must be below 2**31");
  const size_t total = steps * width;
  if (width != 0 && total / width != steps) return invalid(-1, "steps * width overflows");
  std::vector<int64_t> have(count);
  size_t j = 0;
  for (size_t s = 0; s < steps; ++s) {
    const int64_t* need = surplus + s * count;
    int64_t sum = 0;
    for (size_t n = 0; n < count; ++n) sum += need[n];
    if (sum != 0) {
      return invalid(static_cast<int64_t>(s),
                     "step " + std::to_string(s) + "'s surpluses sum to " +
                         std::to_string(sum) + ", not 0");
    }
    std::fill(have.begin(), have.end(), 0);
    const int64_t end = static_cast<int64_t>((s + 1) * width);
    for (; j < m && candidate[j] < end; ++j) {
      if (candidate[j] < 0 || (j > 0 && candidate[j] <= candidate[j - 1])) {
        return invalid(static_cast<int64_t>(j),
                       "candidates must be strictly ascending slots from 0");
      }
      const int64_t owner = nodes[candidate[j]];
      if (owner < 0 || static_cast<size_t>(owner) >= count) {
        return invalid(static_cast<int64_t>(j), "a candidate's node " + std::to_string(owner) +
                                                    " is not below " + std::to_string(count));
      }
      ++have[static_cast<size_t>(owner)];
    }
    for (size_t n = 0; n < count; ++n) {
      if (have[n] < need[n]) {
        return invalid(static_cast<int64_t>(s),
                       "node " + std::to_string(n) + " has a surplus of " +
                           std::to_string(need[n]) + " in step " + std::to_string(s) +
                           " but only " + std::to_string(have[n]) + " candidates");
      }
    }
  }
  if (j < m) {
    return invalid(static_cast<int64_t>(j), "a candidate slot is not below steps * width (" +
                                                std::to_string(total) + ")");
  }
  return Status::Ok();
}

}  // namespace

Status paid_moves_sizes(size_t nodes, size_t candidates, size_t hashes, size_t surpluses,
                        int64_t width, int64_t count) {
  if (count < 1) return invalid(-1, "count must be at least 1");
  if (width < 0) return invalid(-1, "width must not be negative");
  const size_t per = static_cast<size_t>(count);
  if (surpluses % per != 0) {
    return invalid(-1, "surplus holds " + std::to_string(surpluses) +
                           " entries, not a multiple of count (" + std::to_string(count) + ")");
  }
  const size_t steps = surpluses / per;
  const size_t slots = steps * static_cast<size_t>(width);
  if (nodes != slots) {
    return invalid(-1, "nodes holds " + std::to_string(nodes) + " slots, the " +
                           std::to_string(steps) + " steps of surplus " + std::to_string(slots));
  }
  if (hashes != candidates) {
    return invalid(-1, "hashed holds " + std::to_string(hashes) + " entries for " +
                           std::to_string(candidates) + " candidates");
  }
  return Status::Ok();
}

Status paid_moves(int64_t* nodes, size_t steps, size_t width, size_t count,
                  const int64_t* candidate, const uint64_t* hashed, size_t m,
                  const int64_t* surplus, int priority_bits) {
  Status s = check(nodes, steps, width, count, candidate, m, surplus, priority_bits);
  if (!s.ok() || count == 1) return s;  // (one node: balanced sums are all 0, nothing moves)
  const unsigned shift = 64u - static_cast<unsigned>(priority_bits);
  const uint64_t others = static_cast<uint64_t>(count - 1);
  // Per step: each node's candidates as keys (priority, then index among the step's
  // candidates) in one array cut by node (a counting sort: no branches to mispredict), a
  // released flag per candidate, and how many samples each node has taken.
  std::vector<size_t> first(count + 1), fill(count);
  std::vector<uint64_t> keys, pick;
  std::vector<uint8_t> released;
  std::vector<int64_t> taken(count), rest;
  size_t lo = 0;
  for (size_t step = 0; step < steps; ++step) {
    const int64_t* need = surplus + step * count;
    const int64_t end = static_cast<int64_t>((step + 1) * width);
    size_t hi = lo;
    while (hi < m && candidate[hi] < end) ++hi;
    const size_t here = hi - lo;
    std::fill(first.begin(), first.end(), 0);
    for (size_t j = lo; j < hi; ++j) ++first[static_cast<size_t>(nodes[candidate[j]]) + 1];
    for (size_t n = 0; n < count; ++n) first[n + 1] += first[n];
    std::copy(first.begin(), first.end() - 1, fill.begin());
    keys.resize(here);
    pick.resize(here);
    for (size_t j = lo; j < hi; ++j) {
      keys[fill[static_cast<size_t>(nodes[candidate[j]])]++] =
          ((hashed[j] >> shift) << 32) | (j - lo);
    }
    released.assign(here, 0);
    for (size_t n = 0; n < count; ++n) {
      if (need[n] <= 0) continue;
      uint64_t* run = keys.data() + first[n];
      const size_t size = first[n + 1] - first[n];
      const size_t k = static_cast<size_t>(need[n]);
      if (k >= size) {
        for (size_t i = 0; i < size; ++i) released[run[i] & 0xFFFFFFFFu] = 1;
        continue;
      }
      // Priorities are uniform hashes: the k lowest of `size` are almost surely below
      // `bound` (a few times k's share of the range), so only the keys below it are ranked;
      // a run that the bound leaves short is ranked whole. The result is the same.
      const size_t wanted = k + 2 * static_cast<size_t>(std::sqrt(static_cast<double>(k))) + 2;
      const uint64_t bound = (uint64_t{wanted} << priority_bits) / size;  // (a priority)
      const uint64_t* ranked = run;
      size_t picked = size;
      if (bound < (uint64_t{1} << priority_bits)) {
        size_t below = 0;
        for (size_t i = 0; i < size; ++i) {
          pick[below] = run[i];
          below += run[i] < (bound << 32);
        }
        if (below >= k) {
          ranked = pick.data();
          picked = below;
        }
      }
      if (picked <= kRankedWhole) {  // each key's rank among them, without branches
        for (size_t i = 0; i < picked; ++i) {
          size_t below = 0;
          for (size_t j = 0; j < picked; ++j) below += ranked[j] < ranked[i];
          if (below < k) released[ranked[i] & 0xFFFFFFFFu] = 1;
        }
      } else {
        uint64_t* sorted = ranked == run ? run : pick.data();  // (ranked, writable)
        std::nth_element(sorted, sorted + (k - 1), sorted + picked);
        for (size_t i = 0; i < k; ++i) released[sorted[i] & 0xFFFFFFFFu] = 1;
      }
    }
    // received in slot order: the chunk's backup while it is short, else the rest below
    std::fill(taken.begin(), taken.end(), 0);
    rest.clear();
    for (size_t j = 0; j < here; ++j) {
      if (!released[j]) continue;
      const int64_t slot = candidate[lo + j];
      size_t backup = static_cast<size_t>(nodes[slot]) + 1 +
                      static_cast<size_t>(hashed[lo + j] % others);
      if (backup >= count) backup -= count;
      if (taken[backup] < -need[backup]) {
        nodes[slot] = static_cast<int64_t>(backup);
        ++taken[backup];
      } else {
        rest.push_back(slot);
      }
    }
    size_t node = 0;
    for (const int64_t slot : rest) {  // (balanced: the rest are exactly the room left)
      while (node < count && taken[node] >= -need[node]) ++node;
      if (node == count) return Status::Error(StatusCode::kInternal, -1, "paid_moves: no room");
      nodes[slot] = static_cast<int64_t>(node);
      ++taken[node];
    }
    lo = hi;
  }
  return Status::Ok();
}

}  // namespace streamcache
