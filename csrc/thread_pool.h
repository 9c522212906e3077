// A fixed pool of worker threads for data-parallel native jobs (row gathers).
//
// One process-wide pool, created on first use. After fork() the child does not inherit the
// parent's threads, so the pool notices a changed process id and builds a fresh one; the
// parent's pool object is abandoned in the child (its threads do not exist there), and the
// lock that guards the process-wide pointer is held across fork() (pthread_atfork), so the
// child never inherits it locked.
#pragma once

#include <condition_variable>
#include <cstddef>
#include <deque>
#include <functional>
#include <memory>
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

  static constexpr size_t kChunksPerThread = 4;

  // Run fn(begin, end) over [0, n) split into contiguous chunks of at least `grain` items,
  // at most kChunksPerThread per thread. Threads claim chunks one at a time, the calling
  // thread too, so a job finishes even when every worker is busy with another caller's job,
  // and a worker the OS leaves unscheduled (a loaded machine) holds up one small chunk. Returns when every chunk of *this* call is done
  // (concurrent calls do not wait for each other). An exception thrown by fn in any thread is
  // rethrown here, after every chunk has finished; the chunks not yet started are skipped.
  // `max_threads` > 0: at most that many threads (the caller's included) work on it.
  void parallel_for(size_t n, size_t grain, const std::function<void(size_t, size_t)>& fn,
                    size_t max_threads = 0);

  struct Job;  // one parallel_for call: its chunks, completion count and first exception

 private:
  void worker_loop();

  std::vector<std::thread> workers_;
  std::mutex mutex_;
  std::condition_variable wake_;
  // One entry per helper a job asked for. A helper that arrives after its job is finished
  // finds no chunk left and drops it; shared ownership keeps the job alive until then.
  std::deque<std::shared_ptr<Job>> queue_;
  bool stopping_ = false;
};

// The process-wide pool (fork-aware). Thread safety: callable from any thread.
ThreadPool& global_pool();

// Set the size of the process-wide pool (0 = the cores of the process's affinity mask). Takes effect for the
// next job; a running job finishes on the old pool.
void set_global_pool_size(size_t threads);
size_t global_pool_size();

}  // namespace streamcache
