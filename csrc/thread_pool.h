// A fixed pool of worker threads for data-parallel native jobs (row gathers).
//
// One process-wide pool, created on first use. After fork() the child does not inherit the
// parent's threads, so the pool notices a changed process id and builds a fresh one; the
// parent's pool object is abandoned in the child (its threads do not exist there).
#pragma once

#include <condition_variable>
#include <cstddef>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

namespace streamcache {

class ThreadPool {
 public:
  explicit ThreadPool(size_t threads);
  ~ThreadPool();
  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;

  size_t size() const { return workers_.size() + 1; }

  // Run fn(begin, end) over [0, n) split into at most size() contiguous chunks of at least
  // `grain` items; the calling thread takes one chunk. Returns when every chunk is done.
  void parallel_for(size_t n, size_t grain, const std::function<void(size_t, size_t)>& fn);

 private:
  void worker_loop();

  std::vector<std::thread> workers_;
  std::mutex mutex_;
  std::condition_variable wake_;
  std::condition_variable done_;
  std::vector<std::function<void()>> tasks_;
  size_t pending_ = 0;
  bool stopping_ = false;
};

// The process-wide pool (fork-aware). Thread safety: callable from any thread.
ThreadPool& global_pool();

// Set the size of the process-wide pool (0 = hardware concurrency). Takes effect for the
// next job; a running job finishes on the old pool.
void set_global_pool_size(size_t threads);
size_t global_pool_size();

}  // namespace streamcache
