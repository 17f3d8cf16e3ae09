#include "impl/common/fault_point.h"

#include <signal.h>
#include <unistd.h>

#include <atomic>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <mutex>
#include <sstream>
#include <string>
#include <vector>

#include "impl/common/error.h"

namespace zs {
namespace {

struct Point {
  std::string name;
  long long count = 0;
  bool fails = false;  // ":fail": throw instead of dying
  bool stops = false;  // ":stop": stop (SIGSTOP) instead of dying, as a hung or starved process
  std::atomic<long long> passes{0};
};

std::atomic<bool> g_armed{false};
std::mutex g_mu;
// Replaced by each configure (under g_mu); never freed, so a pass that read
// an older list may finish with it (a test knob).
std::atomic<std::deque<Point>*> g_points{nullptr};

}  // namespace

void configure_fault_points(int rank) {
  const char* env = std::getenv("ZS_FAULT_POINT");
  std::lock_guard<std::mutex> held(g_mu);
  g_armed.store(false);
  if (env == nullptr || *env == '\0') return;
  const char* attempt = std::getenv("TORCHELASTIC_RESTART_COUNT");
  if (attempt != nullptr && std::atol(attempt) > 0) return;
  auto* points = new std::deque<Point>();
  std::istringstream in(env);
  for (std::string item; std::getline(in, item, ',');) {
    bool fails = false, stops = false;
    if (item.size() > 5 && item.compare(item.size() - 5, 5, ":fail") == 0) {
      fails = true;
      item.resize(item.size() - 5);
    } else if (item.size() > 5 && item.compare(item.size() - 5, 5, ":stop") == 0) {
      stops = true;
      item.resize(item.size() - 5);
    }
    const size_t a = item.find(':'), b = a == std::string::npos ? a : item.find(':', a + 1);
    char* end = nullptr;
    const long r = b == std::string::npos ? -1 : std::strtol(item.c_str() + a + 1, &end, 10);
    const long long n = b == std::string::npos ? 0 : std::strtoll(item.c_str() + b + 1, &end, 10);
    if (b == std::string::npos || a == 0 || r < 0 || n < 1 || (end && *end != '\0'))
      fail(Code::InvalidArgument, "ZS_FAULT_POINT='", env, "': expected name:rank:count[:fail|:stop][,...] with rank >= 0 "
           "and count >= 1 (", item, ")");
    if (r != rank) continue;
    points->emplace_back();
    points->back().name = item.substr(0, a);
    points->back().count = n;
    points->back().fails = fails;
    points->back().stops = stops;
  }
  g_points.store(points, std::memory_order_release);
  g_armed.store(!points->empty(), std::memory_order_release);
}

void fault_point(const char* name) {
  if (!g_armed.load(std::memory_order_acquire)) return;
  for (Point& p : *g_points.load(std::memory_order_acquire))
    if (p.name == name && p.passes.fetch_add(1) + 1 == p.count) {
      if (p.fails)
        fail(Code::Comm, "ZS_FAULT_POINT: ", name, " fails here (a test's stand-in for a collective that failed on "
             "this rank only)");
      kill(getpid(), p.stops ? SIGSTOP : SIGKILL);
    }
}

}  // namespace zs
