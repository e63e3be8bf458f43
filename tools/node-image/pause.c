/* The sandbox ("pause") process of a pod: holds the namespaces, reaps orphans, exits on SIGINT/SIGTERM.
 * Same behaviour as kubernetes/kubernetes:build/pause/linux/pause.c, written for the real-node tests;
 * built static into a scratch image by tools/node-image/build.sh. */
#include <signal.h>
#include <stdlib.h>
#include <sys/wait.h>
#include <unistd.h>

static void on_term(int sig) { _exit(sig == SIGINT || sig == SIGTERM ? 0 : 1); }

static void on_child(int sig) {
  (void)sig;
  while (waitpid(-1, NULL, WNOHANG) > 0) {
  }
}

int main(void) {
  struct sigaction term = {.sa_handler = on_term};
  struct sigaction child = {.sa_handler = on_child, .sa_flags = SA_NOCLDSTOP};
  if (getpid() != 1) return 1; /* only as a container's init */
  if (sigaction(SIGINT, &term, NULL) < 0 || sigaction(SIGTERM, &term, NULL) < 0 ||
      sigaction(SIGCHLD, &child, NULL) < 0)
    return 2;
  for (;;) pause();
}
