// zsstore — serve a job's rendezvous store from a process of its own
// (zs_store_serve), so that it outlives every rank, rank 0 included: the
// ranks run with ZS_STORE_SERVER=external and connect to it as clients
// (docs/healing.md, section 3). zsrun --restarts starts one per attempt.
//
//   zsstore [--host H] [--port P] [--journal FILE]
//
// With --journal (or ZS_STORE_JOURNAL) it keeps its keys in FILE too, and a
// zsstore started again on the same FILE and port serves them again: zsrun
// restarts a zsstore that died so, and the ranks resend the calls it cut
// short (impl/comm/store/store_journal.h).
// Serves on H (default 127.0.0.1) and port P (default 0: a free one), says
// "zsstore: serving on H:P" on stdout once it listens, and runs until
// SIGTERM, SIGINT or SIGHUP (exit 0). Clients must prove ZS_JOB_SECRET when
// it is set. Exit status: 1 when the address cannot be served (the message
// names it), 2 on bad usage.
#include <signal.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>

#include "zeroshard/zeroshard.h"

namespace {

[[noreturn]] void usage(const std::string& why) {
  std::fprintf(stderr, "zsstore: %s\nusage: zsstore [--host H] [--port P] [--journal FILE]\n", why.c_str());
  std::exit(2);
}

}  // namespace

int main(int argc, char** argv) {
  std::string host = "127.0.0.1";
  long port = 0;
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    if (arg == "-h" || arg == "--help") {
      std::printf("usage: zsstore [--host H] [--port P] [--journal FILE]\n");
      return 0;
    }
    if (i + 1 >= argc) usage("option '" + arg + "' needs a value");
    const char* v = argv[++i];
    if (arg == "--host") {
      host = v;
    } else if (arg == "--port") {
      char* end = nullptr;
      errno = 0;
      port = std::strtol(v, &end, 10);
      if (errno != 0 || *v == '\0' || *end != '\0' || port < 0 || port > 65535)
        usage(std::string("--port expects a port in 0..65535, got '") + v + "'");
    } else if (arg == "--journal") {
      if (*v == '\0') usage("--journal expects a file name");
      setenv("ZS_STORE_JOURNAL", v, 1);  // what zs_store_serve reads
    } else {
      usage("unknown option '" + arg + "'");
    }
  }
  // Signals are taken by sigwait below, not by handlers.
  sigset_t stop;
  sigemptyset(&stop);
  for (int sig : {SIGTERM, SIGINT, SIGHUP}) sigaddset(&stop, sig);
  pthread_sigmask(SIG_BLOCK, &stop, nullptr);
  zs_store_server server = nullptr;
  int bound = 0;
  if (zs_store_serve(&server, host.c_str(), static_cast<int>(port), &bound) != ZS_OK) {
    std::fprintf(stderr, "zsstore: %s\n", zs_last_error());
    return 1;
  }
  std::printf("zsstore: serving on %s:%d\n", host.c_str(), bound);
  std::fflush(stdout);
  int sig = 0;
  sigwait(&stop, &sig);
  zs_store_server_destroy(server);
  return 0;
}
