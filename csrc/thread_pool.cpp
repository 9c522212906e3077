#include "thread_pool.h"

#include <unistd.h>

#include <algorithm>
#include <memory>

namespace streamcache {

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
    std::function<void()> task;
    {
      std::unique_lock<std::mutex> lock(mutex_);
      wake_.wait(lock, [this] { return stopping_ || !tasks_.empty(); });
      if (stopping_ && tasks_.empty()) return;
      task = std::move(tasks_.back());
      tasks_.pop_back();
    }
    task();
    {
      std::lock_guard<std::mutex> lock(mutex_);
      --pending_;
    }
    done_.notify_all();
  }
}

void ThreadPool::parallel_for(size_t n, size_t grain,
                              const std::function<void(size_t, size_t)>& fn) {
  if (n == 0) return;
  grain = std::max<size_t>(grain, 1);
  size_t chunks = std::min(size(), (n + grain - 1) / grain);
  if (chunks <= 1) {
    fn(0, n);
    return;
  }
  size_t per = (n + chunks - 1) / chunks;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    for (size_t c = 1; c < chunks; ++c) {
      size_t begin = c * per;
      size_t end = std::min(n, begin + per);
      if (begin >= end) continue;
      tasks_.emplace_back([&fn, begin, end] { fn(begin, end); });
      ++pending_;
    }
  }
  wake_.notify_all();
  fn(0, std::min(n, per));
  std::unique_lock<std::mutex> lock(mutex_);
  done_.wait(lock, [this] { return pending_ == 0; });
}

namespace {

std::mutex g_pool_mutex;
ThreadPool* g_pool = nullptr;  // intentionally leaked at exit: joining during teardown can deadlock
pid_t g_pool_pid = 0;
size_t g_requested = 0;

size_t effective_size() {
  if (g_requested > 0) return g_requested;
  return std::max<unsigned>(1, std::thread::hardware_concurrency());
}

}  // namespace

ThreadPool& global_pool() {
  std::lock_guard<std::mutex> lock(g_pool_mutex);
  pid_t pid = getpid();
  if (g_pool == nullptr || g_pool_pid != pid || g_pool->size() != effective_size()) {
    // The old pool is abandoned, never destroyed: in a forked child its threads do not exist,
    // and after a resize another thread may still be running a job on it. Both are rare.
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
