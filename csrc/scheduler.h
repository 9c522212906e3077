// The prefetch scheduler: a re-prioritizable queue of shards to fetch, an in-flight byte
// budget, per-shard state and a blocking wait for a shard, plus counters.
//
// It decides nothing about *what* to fetch (Python's prefetch policy submits shards with their
// first-use position as priority) and does not fetch (the download is fsspec, i.e. Python).
// Worker threads owned by the caller loop on next_task() / complete(); readers block in
// wait(). Every blocking call takes a timeout and returns early once stop() is called, so the
// caller can release its interpreter lock around them and still shut down promptly.
//
// Thread safety: every method may be called from any number of threads at once.
// Fork: a child must not use a Scheduler created by its parent (a parent's thread may have
// held the mutex at fork time); the Python owner abandons it and makes a new one.
#pragma once

#include <condition_variable>
#include <cstdint>
#include <mutex>
#include <set>
#include <string>
#include <unordered_map>
#include <utility>

namespace streamcache {

enum class ShardState : int {
  kUnknown = 0,   // never submitted, cancelled, or forgotten after an eviction
  kQueued = 1,    // waiting in the queue for a worker
  kInFlight = 2,  // handed to a worker by next_task()
  kReady = 3,     // installed (complete(ok) or mark_ready())
  kFailed = 4,    // the last attempt failed; message() says why; submit() retries
};

enum class WaitResult : int {
  kReady = 0,
  kFailed = 1,
  kTimeout = 2,
  kStopped = 3,
  kNotScheduled = 4,  // unknown to the scheduler: nobody would ever make it ready
};

// next_task() sentinels (shard ids are >= 0).
constexpr int64_t kTaskStopped = -1;
constexpr int64_t kTaskTimeout = -2;

struct SchedulerCounters {
  int64_t hits = 0;           // wait(count_access) found the shard ready
  int64_t misses = 0;         // wait(count_access) found it not ready
  int64_t bytes_fetched = 0;  // reported by complete()
  int64_t bytes_evicted = 0;  // reported by forget()
  int64_t wait_ns = 0;        // time spent blocked in wait()
  int64_t tasks_done = 0;     // complete(ok = true)
  int64_t tasks_failed = 0;   // complete(ok = false)
};

class Scheduler {
 public:
  // inflight_budget: bytes that may be in flight at once; one task always may, however big.
  explicit Scheduler(int64_t inflight_budget);
  Scheduler(const Scheduler&) = delete;
  Scheduler& operator=(const Scheduler&) = delete;

  // Queue `shard` at `priority` (lower runs first) with an estimated size, or move it if it is
  // queued already. A failed or unknown shard is queued; one in flight or ready is left as it
  // is. Returns whether the shard is queued afterwards.
  bool submit(int64_t shard, int64_t priority, int64_t bytes);
  // Take a queued shard out of the queue (state unknown). Returns whether it was queued.
  bool cancel(int64_t shard);

  // Block until the first queued shard fits the in-flight budget (or nothing is in flight),
  // mark it in flight and return it; kTaskTimeout after timeout_s (< 0: no limit),
  // kTaskStopped once stop() was called.
  int64_t next_task(double timeout_s);
  // A worker's outcome for a shard it got from next_task(); wakes its waiters.
  void complete(int64_t shard, bool ok, int64_t bytes_fetched, const std::string& message);

  // The shard is installed without a task of ours (found in the cache); wakes its waiters.
  void mark_ready(int64_t shard);
  // The shard was evicted: forget it (unless queued or in flight) and count the bytes.
  void forget(int64_t shard, int64_t bytes_evicted);

  // Block until `shard` is ready or failed, or timeout_s passes (< 0: no limit), or stop().
  // With count_access, a shard ready on entry counts a hit and any other a miss. The time
  // spent blocked is always counted. The message is the failure's, if any.
  std::pair<WaitResult, std::string> wait(int64_t shard, double timeout_s, bool count_access);

  // Count a hit that needed no wait() (the reader found the shard installed by itself).
  void note_hit();

  ShardState state(int64_t shard) const;
  // Wake and end every blocking call; later calls return at once. Idempotent.
  void stop();
  bool stopped() const;

  SchedulerCounters counters() const;
  int64_t inflight_bytes() const;
  int64_t queued() const;

 private:
  struct Entry {
    ShardState state = ShardState::kUnknown;
    int64_t priority = 0;
    int64_t bytes = 0;
    std::string message;
  };

  bool head_fits_locked() const;
  bool state_locked_is_ready(int64_t shard) const;
  void unqueue_locked(int64_t shard, const Entry& entry);

  const int64_t inflight_budget_;
  mutable std::mutex mutex_;
  std::condition_variable work_;  // next_task(): the queue or the budget changed
  std::condition_variable done_;  // wait(): a shard became ready or failed
  std::unordered_map<int64_t, Entry> entries_;
  std::set<std::pair<int64_t, int64_t>> queue_;  // (priority, shard)
  int64_t inflight_bytes_ = 0;
  int64_t inflight_tasks_ = 0;
  bool stopping_ = false;
  SchedulerCounters counters_;
};

}  // namespace streamcache
