#include "scheduler.h"

#include <chrono>

namespace streamcache {

namespace {

using Clock = std::chrono::steady_clock;

// Wait on `cv` until `done()` or the deadline; timeout_s < 0 means no deadline.
template <typename Done>
bool wait_until(std::condition_variable& cv, std::unique_lock<std::mutex>& lock,
                double timeout_s, Done done) {
  if (timeout_s < 0) {
    cv.wait(lock, done);
    return true;
  }
  auto deadline = Clock::now() + std::chrono::duration_cast<Clock::duration>(
                                     std::chrono::duration<double>(timeout_s));
  return cv.wait_until(lock, deadline, done);
}

}  // namespace

Scheduler::Scheduler(int64_t inflight_budget) : inflight_budget_(inflight_budget) {}

bool Scheduler::submit(int64_t shard, int64_t priority, int64_t bytes) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (stopping_) return false;
  Entry& entry = entries_[shard];
  if (entry.state == ShardState::kInFlight || entry.state == ShardState::kReady) return false;
  if (entry.state == ShardState::kQueued) {
    if (entry.priority == priority) return true;
    queue_.erase({entry.priority, shard});
  }
  entry.state = ShardState::kQueued;
  entry.priority = priority;
  entry.bytes = bytes;
  entry.message.clear();
  queue_.insert({priority, shard});
  work_.notify_all();
  return true;
}

void Scheduler::unqueue_locked(int64_t shard, const Entry& entry) {
  queue_.erase({entry.priority, shard});
}

bool Scheduler::cancel(int64_t shard) {
  std::lock_guard<std::mutex> lock(mutex_);
  auto it = entries_.find(shard);
  if (it == entries_.end() || it->second.state != ShardState::kQueued) return false;
  unqueue_locked(shard, it->second);
  entries_.erase(it);
  work_.notify_all();  // the head changed: a smaller task may fit now
  return true;
}

bool Scheduler::head_fits_locked() const {
  if (queue_.empty()) return false;
  if (inflight_tasks_ == 0) return true;
  const Entry& head = entries_.at(queue_.begin()->second);
  return inflight_bytes_ + head.bytes <= inflight_budget_;
}

int64_t Scheduler::next_task(double timeout_s) {
  std::unique_lock<std::mutex> lock(mutex_);
  bool ready = wait_until(work_, lock, timeout_s,
                          [this] { return stopping_ || head_fits_locked(); });
  if (stopping_) return kTaskStopped;
  if (!ready) return kTaskTimeout;
  int64_t shard = queue_.begin()->second;
  queue_.erase(queue_.begin());
  Entry& entry = entries_[shard];
  entry.state = ShardState::kInFlight;
  inflight_bytes_ += entry.bytes;
  inflight_tasks_ += 1;
  return shard;
}

void Scheduler::complete(int64_t shard, bool ok, int64_t bytes_fetched,
                         const std::string& message) {
  std::lock_guard<std::mutex> lock(mutex_);
  auto it = entries_.find(shard);
  if (it == entries_.end() || it->second.state != ShardState::kInFlight) return;
  Entry& entry = it->second;
  inflight_bytes_ -= entry.bytes;
  inflight_tasks_ -= 1;
  entry.state = ok ? ShardState::kReady : ShardState::kFailed;
  entry.message = ok ? std::string() : message;
  counters_.bytes_fetched += bytes_fetched;
  (ok ? counters_.tasks_done : counters_.tasks_failed) += 1;
  work_.notify_all();
  done_.notify_all();
}

void Scheduler::mark_ready(int64_t shard) {
  std::lock_guard<std::mutex> lock(mutex_);
  Entry& entry = entries_[shard];
  if (entry.state == ShardState::kInFlight) return;  // its worker will report it
  // Already ready: nothing changes, so nobody is woken. (The prefetcher marks every
  // installed shard of its advice ready on each update, a few times a second with 100 KB
  // samples; waking every download thread and reader each time cost more than the update.)
  if (entry.state == ShardState::kReady) return;
  if (entry.state == ShardState::kQueued) unqueue_locked(shard, entry);
  entry.state = ShardState::kReady;
  entry.message.clear();
  work_.notify_all();
  done_.notify_all();
}

void Scheduler::forget(int64_t shard, int64_t bytes_evicted) {
  std::lock_guard<std::mutex> lock(mutex_);
  counters_.bytes_evicted += bytes_evicted;
  auto it = entries_.find(shard);
  if (it == entries_.end()) return;
  ShardState s = it->second.state;
  if (s == ShardState::kReady || s == ShardState::kFailed) entries_.erase(it);
}

std::pair<WaitResult, std::string> Scheduler::wait(int64_t shard, double timeout_s,
                                                    bool count_access) {
  std::unique_lock<std::mutex> lock(mutex_);
  auto settled = [this, shard] {
    if (stopping_) return true;
    auto it = entries_.find(shard);
    if (it == entries_.end()) return true;
    ShardState s = it->second.state;
    return s == ShardState::kReady || s == ShardState::kFailed || s == ShardState::kUnknown;
  };
  bool ready_on_entry = state_locked_is_ready(shard);
  if (count_access) (ready_on_entry ? counters_.hits : counters_.misses) += 1;
  if (!ready_on_entry) {
    auto started = Clock::now();
    wait_until(done_, lock, timeout_s, settled);
    counters_.wait_ns += std::chrono::duration_cast<std::chrono::nanoseconds>(
                             Clock::now() - started).count();
  }
  auto it = entries_.find(shard);
  ShardState s = it == entries_.end() ? ShardState::kUnknown : it->second.state;
  if (s == ShardState::kReady) return {WaitResult::kReady, {}};
  if (s == ShardState::kFailed) return {WaitResult::kFailed, it->second.message};
  if (stopping_) return {WaitResult::kStopped, {}};
  if (s == ShardState::kUnknown) return {WaitResult::kNotScheduled, {}};
  return {WaitResult::kTimeout, {}};
}

bool Scheduler::state_locked_is_ready(int64_t shard) const {
  auto it = entries_.find(shard);
  return it != entries_.end() && it->second.state == ShardState::kReady;
}

void Scheduler::note_hit() {
  std::lock_guard<std::mutex> lock(mutex_);
  counters_.hits += 1;
}

ShardState Scheduler::state(int64_t shard) const {
  std::lock_guard<std::mutex> lock(mutex_);
  auto it = entries_.find(shard);
  return it == entries_.end() ? ShardState::kUnknown : it->second.state;
}

void Scheduler::stop() {
  std::lock_guard<std::mutex> lock(mutex_);
  stopping_ = true;
  work_.notify_all();
  done_.notify_all();
}

bool Scheduler::stopped() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return stopping_;
}

SchedulerCounters Scheduler::counters() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return counters_;
}

int64_t Scheduler::inflight_bytes() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return inflight_bytes_;
}

int64_t Scheduler::queued() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return static_cast<int64_t>(queue_.size());
}

}  // namespace streamcache
