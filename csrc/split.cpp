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

// A slot whose entry in the value tables is not below their size (kInvalid, item: the slot).
Status bad_entry(size_t slot, int64_t entry, size_t values) {
  return invalid(static_cast<int64_t>(slot), "slot " + std::to_string(slot) + "'s entry " +
                                                 std::to_string(entry) + " is not below " +
                                                 std::to_string(values));
}

// A step whose surpluses do not sum to 0 (kInvalid, item: the step), else Ok.
Status unbalanced(const int64_t* need, size_t count, size_t step) {
  int64_t sum = 0;
  for (size_t n = 0; n < count; ++n) sum += need[n];
  if (sum == 0) return Status::Ok();
  return invalid(static_cast<int64_t>(step), "step " + std::to_string(step) +
                                                 "'s surpluses sum to " + std::to_string(sum) +
                                                 ", not 0");
}

// The first node of a step with fewer candidates (have) than its surplus (need), else Ok.
Status too_few(const std::vector<int64_t>& have, const int64_t* need, size_t step) {
  for (size_t n = 0; n < have.size(); ++n) {
    if (have[n] < need[n]) {
      return invalid(static_cast<int64_t>(step),
                     "node " + std::to_string(n) + " has a surplus of " +
                         std::to_string(need[n]) + " in step " + std::to_string(step) +
                         " but only " + std::to_string(have[n]) + " candidates");
    }
  }
  return Status::Ok();
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
    Status sums = unbalanced(need, count, s);
    if (!sums.ok()) return sums;
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
    Status few = too_few(have, need, s);
    if (!few.ok()) return few;
  }
  if (j < m) {
    return invalid(static_cast<int64_t>(j), "a candidate slot is not below steps * width (" +
                                                std::to_string(total) + ")");
  }
  return Status::Ok();
}

// The SplitMix64 finalizer (plan/bijection.py's mix64; csrc/seeding.h has the same).
inline uint64_t mix64(uint64_t z) {
  z = (z ^ (z >> 30)) * 0xBF58'476D'1CE4'E5B9ULL;
  z = (z ^ (z >> 27)) * 0x94D0'49BB'1331'11EBULL;
  return z ^ (z >> 31);
}

constexpr uint64_t kGamma = 0x9E37'79B9'7F4A'7C15ULL;

// One step's paid moves (paid_moves' rule), with scratch kept from step to step.
class Mover {
 public:
  Mover(size_t count, int priority_bits)
      : count_(count),
        priority_bits_(priority_bits),
        shift_(64u - static_cast<unsigned>(priority_bits)),
        others_(static_cast<uint64_t>(count - 1)),
        first_(count + 1),
        fill_(count),
        taken_(count) {}

  // The step's candidates `candidate` (here of them, ascending slots) and their hashes;
  // `need` is the step's surplus per node (checked: balanced, enough candidates).
  Status step(int64_t* nodes, const int64_t* need, const int64_t* candidate,
              const uint64_t* hashed, size_t here) {
    const size_t count = count_;
    // Each node's candidates as keys (priority, then index among the step's candidates) in
    // one array cut by node (a counting sort: no branches to mispredict), a released flag
    // per candidate, and how many samples each node has taken.
    std::fill(first_.begin(), first_.end(), 0);
    for (size_t j = 0; j < here; ++j) ++first_[static_cast<size_t>(nodes[candidate[j]]) + 1];
    for (size_t n = 0; n < count; ++n) first_[n + 1] += first_[n];
    std::copy(first_.begin(), first_.end() - 1, fill_.begin());
    keys_.resize(here);
    pick_.resize(here);
    for (size_t j = 0; j < here; ++j) {
      keys_[fill_[static_cast<size_t>(nodes[candidate[j]])]++] =
          ((hashed[j] >> shift_) << 32) | j;
    }
    released_.assign(here, 0);
    for (size_t n = 0; n < count; ++n) {
      if (need[n] > 0) release(first_[n], first_[n + 1] - first_[n], static_cast<size_t>(need[n]));
    }
    // received in slot order: the chunk's backup while it is short, else the rest below
    std::fill(taken_.begin(), taken_.end(), 0);
    rest_.clear();
    for (size_t j = 0; j < here; ++j) {
      if (!released_[j]) continue;
      const int64_t slot = candidate[j];
      size_t backup = static_cast<size_t>(nodes[slot]) + 1 +
                      static_cast<size_t>(hashed[j] % others_);
      if (backup >= count) backup -= count;
      if (taken_[backup] < -need[backup]) {
        nodes[slot] = static_cast<int64_t>(backup);
        ++taken_[backup];
      } else {
        rest_.push_back(slot);
      }
    }
    size_t node = 0;
    for (const int64_t slot : rest_) {  // (balanced: the rest are exactly the room left)
      while (node < count && taken_[node] >= -need[node]) ++node;
      if (node == count) return Status::Error(StatusCode::kInternal, -1, "paid_moves: no room");
      nodes[slot] = static_cast<int64_t>(node);
      ++taken_[node];
    }
    return Status::Ok();
  }

 private:
  // Flags the k lowest keys of the node's run keys_[at, at + size) as released.
  void release(size_t at, size_t size, size_t k) {
    uint64_t* run = keys_.data() + at;
    if (k >= size) {
      for (size_t i = 0; i < size; ++i) released_[run[i] & 0xFFFFFFFFu] = 1;
      return;
    }
    // Priorities are uniform hashes: the k lowest of `size` are almost surely below `bound`
    // (a few times k's share of the range), so only the keys below it are ranked; a run that
    // the bound leaves short is ranked whole. The result is the same.
    const size_t wanted = k + 2 * static_cast<size_t>(std::sqrt(static_cast<double>(k))) + 2;
    const uint64_t bound = (uint64_t{wanted} << priority_bits_) / size;  // (a priority)
    const uint64_t* ranked = run;
    size_t picked = size;
    if (bound < (uint64_t{1} << priority_bits_)) {
      size_t below = 0;
      for (size_t i = 0; i < size; ++i) {
        pick_[below] = run[i];
        below += run[i] < (bound << 32);
      }
      if (below >= k) {
        ranked = pick_.data();
        picked = below;
      }
    }
    if (picked <= kRankedWhole) {  // each key's rank among them, without branches
      for (size_t i = 0; i < picked; ++i) {
        size_t below = 0;
        for (size_t j = 0; j < picked; ++j) below += ranked[j] < ranked[i];
        if (below < k) released_[ranked[i] & 0xFFFFFFFFu] = 1;
      }
    } else {
      uint64_t* sorted = ranked == run ? run : pick_.data();  // (ranked, writable)
      std::nth_element(sorted, sorted + (k - 1), sorted + picked);
      for (size_t i = 0; i < k; ++i) released_[sorted[i] & 0xFFFFFFFFu] = 1;
    }
  }

  size_t count_;
  int priority_bits_;
  unsigned shift_;
  uint64_t others_;
  std::vector<size_t> first_, fill_;
  std::vector<uint64_t> keys_, pick_;
  std::vector<uint8_t> released_;
  std::vector<int64_t> taken_, rest_;
};

// release_moves' checks, in order, for a call known to be wrong: the first problem.
Status release_problem(const int64_t* nodes, size_t steps, size_t width, size_t count,
                       const int64_t* surplus, const int64_t* at, const int64_t* rows,
                       const int64_t* key_rows, size_t values) {
  std::vector<int64_t> have(count);
  for (size_t step = 0; step < steps; ++step) {
    const int64_t* need = surplus + step * count;
    Status sums = unbalanced(need, count, step);
    if (!sums.ok()) return sums;
    std::fill(have.begin(), have.end(), 0);
    for (size_t i = step * width; i < (step + 1) * width; ++i) {
      const int64_t node = nodes[i];
      if (node < 0 || static_cast<uint64_t>(node) >= count) {
        return invalid(static_cast<int64_t>(i), "slot " + std::to_string(i) + "'s node " +
                                                    std::to_string(node) + " is not below " +
                                                    std::to_string(count));
      }
      if (need[node] <= 0) continue;
      ++have[static_cast<size_t>(node)];
      const int64_t v = at[i];
      if (v < 0 || static_cast<uint64_t>(v) >= values) {
        return bad_entry(i, v, values);
      }
      if (rows[i] < 0 || key_rows[v] < 1) {
        return invalid(static_cast<int64_t>(i),
                       "slot " + std::to_string(i) + "'s row " + std::to_string(rows[i]) +
                           " or key rows " + std::to_string(key_rows[v]) +
                           " is out of range (row >= 0, key rows >= 1)");
      }
    }
    Status few = too_few(have, need, step);
    if (!few.ok()) return few;
  }
  return Status::Error(StatusCode::kInternal, -1, "release_moves: a check failed unexplained");
}

}  // namespace

Status owner_nodes(const int64_t* at, const int64_t* rows, size_t total, const int64_t* offsets,
                   const int64_t* piece_rows, size_t values, const int64_t* targets,
                   size_t count, size_t width, int64_t* nodes, int64_t* piece,
                   int64_t* surplus) {
  if (count == 0) return invalid(-1, "count must be at least 1");
  if (total != 0 && (width == 0 || total % width != 0)) {
    return invalid(-1, std::to_string(total) + " slots are not whole steps of " +
                           std::to_string(width));
  }
  const size_t steps = width == 0 ? 0 : total / width;
  const uint64_t nodes_count = count;
  for (size_t step = 0; step < steps; ++step) {
    int64_t* need = surplus + step * count;
    for (size_t n = 0; n < count; ++n) need[n] = -targets[n];
    for (size_t i = step * width; i < (step + 1) * width; ++i) {
      const int64_t v = at[i];
      if (v < 0 || static_cast<uint64_t>(v) >= values) {
        return bad_entry(i, v, values);
      }
      const int64_t row = rows[i], size = piece_rows[v], offset = offsets[v];
      if (row < 0) {
        return invalid(static_cast<int64_t>(i), "slot " + std::to_string(i) + "'s row " +
                                                    std::to_string(row) + " is negative");
      }
      if (size < 1 || offset < 0 || static_cast<uint64_t>(offset) >= nodes_count) {
        return invalid(static_cast<int64_t>(i),
                       "slot " + std::to_string(i) + "'s piece rows " + std::to_string(size) +
                           " or offset " + std::to_string(offset) +
                           " is out of range (rows >= 1, offset below " +
                           std::to_string(count) + ")");
      }
      const int64_t index = row / size;
      piece[i] = index;
      // (both non-negative: their sum fits 64 unsigned bits)
      const uint64_t node = (static_cast<uint64_t>(offset) + static_cast<uint64_t>(index)) %
                            nodes_count;
      nodes[i] = static_cast<int64_t>(node);
      ++need[node];
    }
  }
  return Status::Ok();
}

Status release_moves(int64_t* nodes, size_t steps, size_t width, size_t count,
                     const int64_t* surplus, const int64_t* at, const int64_t* rows,
                     const int64_t* key_base, const int64_t* key_rows, size_t values,
                     uint64_t release_key, int priority_bits) {
  if (count == 0) return invalid(-1, "count must be at least 1");
  if (priority_bits < 1 || priority_bits > 32) {
    return invalid(-1, "priority_bits must be in [1, 32]");
  }
  if (width >= (size_t{1} << 31)) return invalid(-1, "width must be below 2**31");
  // Every check first (nothing is written before): each step balances, every slot's node is
  // a node, every candidate's numbers are in range, and each node with a surplus has as
  // many candidates (slots) as it gives. A pass without branches finds whether anything is
  // wrong; only then does release_problem find the first problem and say what it is.
  std::vector<int64_t> have(count);
  bool wrong = false;
  for (size_t step = 0; step < steps && !wrong; ++step) {
    const int64_t* need = surplus + step * count;
    int64_t sum = 0;
    for (size_t n = 0; n < count; ++n) sum += need[n];
    wrong |= sum != 0;
    std::fill(have.begin(), have.end(), 0);
    for (size_t i = step * width; i < (step + 1) * width; ++i) {
      const uint64_t node = static_cast<uint64_t>(nodes[i]);
      const bool known = node < count;
      const size_t n = known ? node : 0;
      const bool taken = known && need[n] > 0;
      have[n] += taken;
      const uint64_t v = static_cast<uint64_t>(at[i]);
      const bool listed = v < values;
      const size_t entry = listed ? v : 0;
      const bool in_range = listed && rows[i] >= 0 && key_rows[entry] >= 1;
      wrong |= (!known) | (taken & (!in_range));
    }
    for (size_t n = 0; n < count; ++n) wrong |= have[n] < need[n];
  }
  if (wrong) {
    return release_problem(nodes, steps, width, count, surplus, at, rows, key_rows, values);
  }
  if (count == 1) return Status::Ok();  // (one node: its surplus is 0, nothing moves)
  Mover mover(count, priority_bits);
  std::vector<int64_t> candidate(width);
  std::vector<uint64_t> hashed(width);
  for (size_t step = 0; step < steps; ++step) {
    const int64_t* need = surplus + step * count;
    const int64_t* step_nodes = nodes + step * width;
    const int64_t base = static_cast<int64_t>(step * width);
    size_t here = 0;
    for (size_t i = 0; i < width; ++i) {  // (no branch: half of the slots are candidates)
      candidate[here] = base + static_cast<int64_t>(i);
      here += need[step_nodes[i]] > 0;
    }
    for (size_t j = 0; j < here; ++j) {
      const int64_t slot = candidate[j];
      const int64_t v = at[slot];
      // (wrapping arithmetic, as the numpy uint64 version)
      const uint64_t key =
          static_cast<uint64_t>(key_base[v]) + static_cast<uint64_t>(rows[slot] / key_rows[v]);
      hashed[j] = mix64(release_key + (key + 1) * kGamma);
    }
    Status s = mover.step(nodes, need, candidate.data(), hashed.data(), here);
    if (!s.ok()) return s;
  }
  return Status::Ok();
}

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
  Mover mover(count, priority_bits);
  size_t lo = 0;
  for (size_t step = 0; step < steps; ++step) {
    const int64_t end = static_cast<int64_t>((step + 1) * width);
    size_t hi = lo;
    while (hi < m && candidate[hi] < end) ++hi;
    s = mover.step(nodes, surplus + step * count, candidate + lo, hashed + lo, hi - lo);
    if (!s.ok()) return s;
    lo = hi;
  }
  return Status::Ok();
}

}  // namespace streamcache
