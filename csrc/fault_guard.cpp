#include "fault_guard.h"

#include <pthread.h>

#include <atomic>
#include <csetjmp>
#include <csignal>
#include <mutex>

namespace streamcache {
namespace {

// The threads inside a guarded call and where a fault there jumps to. A plain table, not a
// thread_local: the handler must not call into the dynamic linker (a thread_local of a
// dlopen'ed module is reached through __tls_get_addr, which may allocate).
constexpr int kSlots = 256;
struct Guarded {
  std::atomic<bool> taken{false};
  std::atomic<pthread_t> thread{};        // written before jump is published
  std::atomic<sigjmp_buf*> jump{nullptr};  // non-null: `thread` is inside a guarded call
};
Guarded g_guarded[kSlots];

std::mutex g_install_mutex;  // taken outside the handler only
struct sigaction g_previous {};

sigjmp_buf* jump_of_this_thread() {
  const pthread_t self = pthread_self();
  for (Guarded& slot : g_guarded) {
    sigjmp_buf* jump = slot.jump.load(std::memory_order_acquire);
    if (jump != nullptr && pthread_equal(slot.thread.load(std::memory_order_relaxed), self)) {
      return jump;
    }
  }
  return nullptr;
}

void on_sigbus(int sig, siginfo_t* info, void* context) {
  sigjmp_buf* jump = jump_of_this_thread();
  if (jump != nullptr) siglongjmp(*jump, 1);  // restores the signal mask sigsetjmp saved
  // Not ours: what was there before (Python's faulthandler, say), else the default action.
  if ((g_previous.sa_flags & SA_SIGINFO) != 0 && g_previous.sa_sigaction != nullptr) {
    g_previous.sa_sigaction(sig, info, context);
    return;
  }
  if ((g_previous.sa_flags & SA_SIGINFO) == 0 && g_previous.sa_handler == SIG_IGN) return;
  if ((g_previous.sa_flags & SA_SIGINFO) == 0 && g_previous.sa_handler != SIG_DFL &&
      g_previous.sa_handler != nullptr) {
    g_previous.sa_handler(sig);
    return;
  }
  signal(sig, SIG_DFL);
  raise(sig);  // blocked while this handler runs: delivered, with the default action, on return
}

// Installs the handler, or installs it again where something replaced it since (the
// replacement becomes the previous handler that faults outside guarded calls go to).
void ensure_installed() {
  struct sigaction current {};
  sigaction(SIGBUS, nullptr, &current);
  if ((current.sa_flags & SA_SIGINFO) != 0 && current.sa_sigaction == on_sigbus) return;
  std::lock_guard<std::mutex> lock(g_install_mutex);
  sigaction(SIGBUS, nullptr, &current);
  if ((current.sa_flags & SA_SIGINFO) != 0 && current.sa_sigaction == on_sigbus) return;
  struct sigaction action {};
  action.sa_sigaction = on_sigbus;
  sigemptyset(&action.sa_mask);
  action.sa_flags = SA_SIGINFO | SA_ONSTACK;
  g_previous = current;
  sigaction(SIGBUS, &action, nullptr);
}

// A free slot for this thread, or -1 when every slot is taken.
int claim(sigjmp_buf* jump) {
  for (int i = 0; i < kSlots; ++i) {
    bool expected = false;
    if (g_guarded[i].taken.compare_exchange_strong(expected, true, std::memory_order_acquire)) {
      g_guarded[i].thread.store(pthread_self(), std::memory_order_relaxed);
      g_guarded[i].jump.store(jump, std::memory_order_release);
      return i;
    }
  }
  return -1;
}

void release(int slot) {
  g_guarded[slot].jump.store(nullptr, std::memory_order_release);
  g_guarded[slot].taken.store(false, std::memory_order_release);
}

}  // namespace

bool run_fault_guarded(void (*fn)(void*), void* arg) {
  ensure_installed();
  sigjmp_buf jump;
  volatile const int slot = claim(&jump);  // volatile: read again after the jump
  if (slot < 0) {  // 256 threads inside guarded calls at once: run it unguarded
    fn(arg);
    return true;
  }
  if (sigsetjmp(jump, 1) != 0) {
    release(slot);
    return false;
  }
  fn(arg);
  release(slot);
  return true;
}

}  // namespace streamcache
