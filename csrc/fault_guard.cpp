#include "fault_guard.h"

#include <csetjmp>
#include <csignal>
#include <mutex>

namespace streamcache {
namespace {

// Where a fault inside this thread's guarded call jumps to; null outside guarded calls.
thread_local sigjmp_buf* t_jump = nullptr;
struct sigaction g_previous {};
std::once_flag g_installed;

void on_sigbus(int sig, siginfo_t* info, void* context) {
  sigjmp_buf* jump = t_jump;
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

void install() {
  struct sigaction action {};
  action.sa_sigaction = on_sigbus;
  sigemptyset(&action.sa_mask);
  action.sa_flags = SA_SIGINFO | SA_ONSTACK;
  sigaction(SIGBUS, &action, &g_previous);
}

}  // namespace

bool run_fault_guarded(void (*fn)(void*), void* arg) {
  std::call_once(g_installed, install);
  sigjmp_buf jump;
  if (sigsetjmp(jump, 1) != 0) {
    t_jump = nullptr;
    return false;
  }
  t_jump = &jump;
  fn(arg);
  t_jump = nullptr;
  return true;
}

}  // namespace streamcache
