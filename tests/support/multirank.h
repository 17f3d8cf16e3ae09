// Multi-rank tests on real processes: fork one child per rank, each builds
// its own context over loopback TCP, and the parent checks every exit code.
#pragma once

#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "zeroshard/zeroshard.h"

namespace zs {
class Context;
}

namespace zs::test {

struct RankEnv {
  int rank;
  int world;
  int port;  // a free loopback port for the TCP store
  int replacement = 0;  // run_ranks_replacing: 0 for a rank as started, n for its n-th replacement
};

// Runs body in `world` child processes and waits (at most timeout_s, then
// kills them). A rank fails when body throws or a gtest assertion fails in
// it; every failing rank is reported as a test failure. A rank listed in
// `killed` may end by SIGKILL (a test that stops a rank and kills it).
void run_ranks(int world, const std::function<void(const RankEnv&)>& body, int timeout_s = 90,
               const std::vector<int>& killed = {});

// run_ranks, where a rank listed in `replaced` that dies by SIGKILL is
// started again with its rank id (healing, docs/healing.md section 3): the
// parent forks a replacement running body with env.replacement = n and
// ZS_HEAL_REPLACEMENT=n set, as a launcher would, at most `max_each` times
// per rank. Returns each rank's pids in the order started.
std::vector<std::vector<int>> run_ranks_replacing(int world, const std::function<void(const RankEnv&)>& body,
                                                  int timeout_s, const std::vector<int>& replaced,
                                                  int max_each = 1, int port = 0);

// Sets an environment variable while it lives (the ranks run_ranks forks
// inherit it; a null value unsets it), then puts back what was there.
class ScopedEnv {
 public:
  ScopedEnv(const char* name, const char* value);
  ~ScopedEnv();
  ScopedEnv(const ScopedEnv&) = delete;
  ScopedEnv& operator=(const ScopedEnv&) = delete;

 private:
  std::string name_, old_;
  bool had_ = false;
};

// A rendezvous store served by a process of its own (zs_store_serve), as
// tools/zsstore does, for ranks run with ZS_STORE_SERVER=external (set
// while it lives): rank 0 is then a client too, and may be lost and
// replaced. Killed when it goes.
class ExternalStore {
 public:
  ExternalStore();
  ~ExternalStore();
  ExternalStore(const ExternalStore&) = delete;
  ExternalStore& operator=(const ExternalStore&) = delete;
  int port() const { return port_; }

 private:
  int pid_ = -1;
  int port_ = 0;
  ScopedEnv external_{"ZS_STORE_SERVER", "external"};
};

// ZeRO++ quantizes only what crosses hosts (Context::quantizes), and a
// test's ranks share one host: a test of the quantized collectives holds
// one of these so that they quantize here too.
struct QuantizeWithinHost : ScopedEnv {
  QuantizeWithinHost() : ScopedEnv("ZS_QUANTIZE_WITHIN_HOST", "1") {}
};

// In a rank's body, before its context: this rank plays host `host`
// (ZS_HOST_ID), as if the ranks of one machine were on several.
void play_host(int host);

// A free TCP port on 127.0.0.1.
int free_port();

// Whether process `pid` has ended: gone, or a zombie (whoever reaps orphans
// may not have yet).
bool process_gone(int pid);

// Context options for a rank of run_ranks (explicit rank/world, loopback
// store, short timeout).
zs_context_options rank_options(const RankEnv& env, const char* config_json = nullptr,
                                int timeout_ms = 30000);

// Creates the context or fails the rank with the engine's message.
zs_context make_context(const RankEnv& env, const char* config_json = nullptr,
                        int timeout_ms = 30000);

// The engine's own Context for a rank of run_ranks on the host (no config),
// for tests of internals below the C API (its groups' communicators).
std::shared_ptr<zs::Context> make_engine_context(const RankEnv& env);

}  // namespace zs::test

// ASSERT that a zeroshard call returned ZS_OK, printing zs_last_error().
#define ZS_ASSERT_OK(call)                                                           \
  do {                                                                               \
    zs_status zs_assert_status_ = (call);                                            \
    ASSERT_EQ(zs_assert_status_, ZS_OK)                                              \
        << #call << " -> " << zs_status_string(zs_assert_status_) << ": " << zs_last_error(); \
  } while (0)
#define ZS_EXPECT_OK(call)                                                           \
  do {                                                                               \
    zs_status zs_expect_status_ = (call);                                            \
    EXPECT_EQ(zs_expect_status_, ZS_OK)                                              \
        << #call << " -> " << zs_status_string(zs_expect_status_) << ": " << zs_last_error(); \
  } while (0)
