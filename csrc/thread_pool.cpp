#include "thread_pool.h"

#include <pthread.h>
#include <sched.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <exception>

namespace streamcache {

// Chunks are claimed with an atomic counter by the caller and by the helpers it queued, so
// a chunk runs exactly once and a caller never waits on a queue another job is clogging.
struct ThreadPool::Job {
  const std::function<void(size_t, size_t)>* fn = nullptr;  // dereferenced for claimed chunks only
  size_t n = 0;
  size_t per = 0;
  size_t chunks = 0;
  std::atomic<size_t> next{0};
  std::atomic<bool> failed{false};
  std::mutex mutex;
  std::condition_variable finished;
  size_t done = 0;           // guarded by mutex
  std::exception_ptr error;  // guarded by mutex: the first exception thrown by fn

  // Claim and run chunks until none is left. Never throws: fn's exceptions are kept.
  void help() {
    for (size_t c = next.fetch_add(1); c < chunks; c = next.fetch_add(1)) {
      if (!failed.load(std::memory_order_relaxed)) {
        try {
          (*fn)(c * per, std::min(n, (c + 1) * per));
        } catch (...) {
          std::lock_guard<std::mutex> lock(mutex);
          if (!error) error = std::current_exception();
          failed.store(true, std::memory_order_relaxed);
        }
      }
      // Notify while holding the lock: once it is released the caller may return and end
      // fn's lifetime; this helper touches only the job (which it co-owns) afterwards.
      std::lock_guard<std::mutex> lock(mutex);
      if (++done == chunks) finished.notify_all();
    }
  }
};

ThreadPool::ThreadPool(size_t threads) {
  size_t extra = threads > 1 ? threads - 1 : 0;
  workers_.reserve(extra);
  for (size_t i = 0; i < extra; ++i) workers_.emplace_back([this] { worker_loop(); });
}

ThreadPool::~ThreadPool() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stopping_ = true;
  }
  wake_.notify_all();
  for (auto& t : workers_) t.join();
}

void ThreadPool::worker_loop() {
  for (;;) {
    std::shared_ptr<Job> job;
    {
      std::unique_lock<std::mutex> lock(mutex_);
      wake_.wait(lock, [this] { return stopping_ || !queue_.empty(); });
      if (stopping_ && queue_.empty()) return;
      job = std::move(queue_.front());
      queue_.pop_front();
    }
    job->help();
  }
}

void ThreadPool::parallel_for(size_t n, size_t grain,
                              const std::function<void(size_t, size_t)>& fn, size_t max_threads) {
  if (n == 0) return;
  grain = std::max<size_t>(grain, 1);
  const size_t threads = max_threads > 0 ? std::min(max_threads, size()) : size();
  size_t chunks = std::min(threads * kChunksPerThread, (n + grain - 1) / grain);
  if (threads <= 1 || chunks <= 1) {
    fn(0, n);
    return;
  }
  auto job = std::make_shared<Job>();
  job->fn = &fn;
  job->n = n;
  job->per = (n + chunks - 1) / chunks;
  job->chunks = (n + job->per - 1) / job->per;  // every chunk non-empty
  {
    std::lock_guard<std::mutex> lock(mutex_);
    // one helper per other thread allowed (each claims chunks until none is left)
    const size_t helpers = std::min(job->chunks, threads) - 1;
    for (size_t h = 0; h < helpers; ++h) queue_.push_back(job);
    if (helpers == 1) {
      wake_.notify_one();
    } else {
      wake_.notify_all();
    }
  }
  job->help();
  std::unique_lock<std::mutex> lock(job->mutex);
  job->finished.wait(lock, [&job] { return job->done == job->chunks; });
  if (job->error) std::rethrow_exception(job->error);
}

namespace {

std::mutex g_pool_mutex;
ThreadPool* g_pool = nullptr;  // intentionally leaked at exit: joining during teardown can deadlock
pid_t g_pool_pid = 0;
size_t g_requested = 0;

// fork() copies a mutex in whatever state it is in. Holding g_pool_mutex across fork means
// the child gets it unlocked (and owned by its only thread, which unlocks it), never held by
// a thread that does not exist there.
struct ForkGuard {
  ForkGuard() {
    pthread_atfork([] { g_pool_mutex.lock(); }, [] { g_pool_mutex.unlock(); },
                   [] { g_pool_mutex.unlock(); });
  }
} g_fork_guard;

// The cores this process may run on (its affinity mask: a rank pinned to a node's share, a
// container's CPU set), not every core of the machine.
size_t usable_cores() {
  cpu_set_t set;
  CPU_ZERO(&set);
  if (sched_getaffinity(0, sizeof(set), &set) == 0) {
    const int count = CPU_COUNT(&set);
    if (count > 0) return static_cast<size_t>(count);
  }
  return std::max<unsigned>(1, std::thread::hardware_concurrency());
}

// Read once per process (a forked child reads its own): a pool is rebuilt when its size
// changes, so a mask changed later (by another library) does not abandon pools.
size_t g_cores = 0;
pid_t g_cores_pid = 0;

size_t effective_size() {
  if (g_requested > 0) return g_requested;
  const pid_t pid = getpid();
  if (g_cores == 0 || g_cores_pid != pid) {
    g_cores = usable_cores();
    g_cores_pid = pid;
  }
  return g_cores;
}

}  // namespace

ThreadPool& global_pool() {
  std::lock_guard<std::mutex> lock(g_pool_mutex);
  pid_t pid = getpid();
  if (g_pool == nullptr || g_pool_pid != pid || g_pool->size() != effective_size()) {
    // The old pool is abandoned, never destroyed: in a forked child its threads do not exist
    // (and its lock may have been copied held), and after a resize another thread may still
    // be running a job on it. Both are rare.
    g_pool = new ThreadPool(effective_size());
    g_pool_pid = pid;
  }
  return *g_pool;
}

void set_global_pool_size(size_t threads) {
  std::lock_guard<std::mutex> lock(g_pool_mutex);
  g_requested = threads;
}

size_t global_pool_size() {
  std::lock_guard<std::mutex> lock(g_pool_mutex);
  return effective_size();
}

}  // namespace streamcache
