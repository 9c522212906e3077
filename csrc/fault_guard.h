// Reads and writes of a file's shared mapping that another process may cut short: touching a
// mapped page past the file's end raises SIGBUS, which would kill the process. A guarded call
// turns that fault into a false return (the memory tier copies checkpoints into mapped tmpfs
// files; a truncation by another process of the user must cost a snapshot, not the job).
#pragma once

namespace streamcache {

// Runs fn(arg) on the calling thread. Returns false when fn touched a mapped page past its
// file's end (SIGBUS): fn was then left where it faulted. fn must hold nothing that needs a
// destructor or an unlock (it is left by a jump): plain loops over raw memory only.
//
// Each call makes sure a process-wide SIGBUS handler is installed (again, where something
// replaced it since: the replacement then counts as the handler before it). The handler hands
// every fault outside a guarded call to the handler installed before it, or to the default
// action (the process dies, as without the guard).
bool run_fault_guarded(void (*fn)(void*), void* arg);

}  // namespace streamcache
