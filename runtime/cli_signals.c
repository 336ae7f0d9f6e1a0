// ferry's signals: the first SIGINT, SIGTERM or SIGHUP asks a run to stop after its step, a
// second ends the process.
#include <pthread.h>
#include <signal.h>
#include <stdatomic.h>
#include <unistd.h>

#include "fy_config.h"
#include "runtime/cli.h"

// Stopping a run. The first SIGINT, SIGTERM or SIGHUP (its terminal closed; unless ignored, as
// under nohup) asks the trainer to stop after the current step (and checkpoint); a second one ends
// the process at once, by the signal's own default action, as an unhandled signal would.
// Checkpoints are renamed into place whole, so nothing is left half-written.
//
// The signals are taken by one thread of ours in sigwait(), blocked in every other thread (which
// inherit the mask: it is set before the run starts any). A handler instead would run on whatever
// thread the kernel picks, on that thread's stack pointer as it is at that instant, and oneDNN's
// JIT GEMM kernels point rsp into heap memory while they run: the signal frame landed there
// (AddressSanitizer caught it in about one second signal of seven during a GEMM).
atomic_int stop_requested = 0;
atomic_bool stop_armed = false;  // a run has started: the first signal asks it to stop

static void stop_or_exit(int sig) {
  if (atomic_load(&stop_armed) && !atomic_exchange(&stop_requested, 1)) {
    static const char msg[] = "\nferry: stopping after this step (again to stop now)\n";
    ssize_t w = write(STDERR_FILENO, msg, sizeof msg - 1);
    (void)w;
    return;
  }
  signal(sig, SIG_DFL);  // end as the signal ends a process that does not handle it
  sigset_t one;
  sigemptyset(&one);
  sigaddset(&one, sig);
  pthread_sigmask(SIG_UNBLOCK, &one, NULL);
  raise(sig);
  _exit(128 + sig);
}

static void *stop_signal_thread(void *arg) {
  const sigset_t *set = arg;
  for (;;) {
    int sig;
    if (sigwait(set, &sig) == 0) stop_or_exit(sig);
  }
  return NULL;
}

// Blocks SIGINT, SIGTERM and SIGHUP in this thread (and so in every thread it starts from now on)
// and starts the thread that takes them; stop_or_exit is also their handler, for a thread that was
// started before the mask was set (by a library: none is now). Until a run sets stop_armed, a
// signal ends the process at once. A SIGHUP that is ignored (nohup) stays ignored.
void stop_signals_start(void) {
  static sigset_t set;
  sigemptyset(&set);
  struct sigaction sa = {.sa_handler = stop_or_exit}, hup;
  sigemptyset(&sa.sa_mask);
  const int sigs[] = {SIGINT, SIGTERM, SIGHUP};
  for (int i = 0; i < 3; i++) {
    if (sigs[i] == SIGHUP && (sigaction(SIGHUP, NULL, &hup) != 0 || hup.sa_handler == SIG_IGN)) continue;
    sigaddset(&set, sigs[i]);
    sigaction(sigs[i], &sa, NULL);
  }
  pthread_t t;
  if (pthread_sigmask(SIG_BLOCK, &set, NULL) != 0 || pthread_create(&t, NULL, stop_signal_thread, &set) != 0) {
    pthread_sigmask(SIG_UNBLOCK, &set, NULL);  // no thread: the handler takes them where they land
    return;
  }
  pthread_detach(t);
}
