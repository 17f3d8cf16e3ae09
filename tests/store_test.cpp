// Rendezvous store tests: the shared semantics run against the TCP, file and
// prefix stores; then each store's own failure modes, including real
// multi-process rendezvous. Tests that fork do so first thing, while the test
// process has no threads (every earlier store, and its server thread, is gone).
#include <arpa/inet.h>
#include <netinet/in.h>
#include <fcntl.h>
#include <signal.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <functional>
#include <string>
#include <thread>
#include <vector>

#include <gtest/gtest.h>

#include "tests/support/expect_error.h"
#include "impl/comm/store/store.h"
#include "impl/common/error.h"
#include "zeroshard/zeroshard.h"

namespace zs {
namespace {

using namespace std::chrono_literals;
using Clock = std::chrono::steady_clock;
using std::chrono::milliseconds;

std::vector<char> bytes(const std::string& s) { return {s.begin(), s.end()}; }
std::string text(const std::vector<char>& v) { return {v.begin(), v.end()}; }

int64_t ms_since(Clock::time_point start) {
  return std::chrono::duration_cast<milliseconds>(Clock::now() - start).count();
}

using zs::test::error_of;

struct TempDir {
  std::string path;
  TempDir() {
    std::string tmpl = (std::filesystem::temp_directory_path() / "zs_store_XXXXXX").string();
    if (!mkdtemp(tmpl.data())) std::abort();
    path = tmpl;
  }
  ~TempDir() {
    std::error_code ec;
    std::filesystem::remove_all(path, ec);
  }
};

// A port that was free a moment ago and has no listener now.
int unused_port() {
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t len = sizeof addr;
  if (bind(fd, reinterpret_cast<sockaddr*>(&addr), len) != 0 ||
      getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len) != 0) {
    std::abort();
  }
  close(fd);
  return ntohs(addr.sin_port);
}

// A raw TCP connection to 127.0.0.1:port (-1 if it cannot be made).
int connect_loopback(int port) {
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_port = htons(static_cast<uint16_t>(port));
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  if (connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof a) != 0) {
    close(fd);
    return -1;
  }
  return fd;
}

// Forks n children that run body(index) and _exit() with its result (0 = ok);
// an exception or a hang (alarm) is a failure too. Call before any thread exists.
std::vector<pid_t> fork_children(int n, const std::function<int(int)>& body) {
  std::vector<pid_t> pids;
  for (int i = 0; i < n; ++i) {
    const pid_t pid = fork();
    if (pid < 0) std::abort();
    if (pid == 0) {
      alarm(20);
      int rc = 1;
      try {
        rc = body(i);
      } catch (const std::exception& e) {
        std::fprintf(stderr, "child %d: %s\n", i, e.what());
        rc = 2;
      }
      _exit(rc);
    }
    pids.push_back(pid);
  }
  return pids;
}

void expect_children_succeed(const std::vector<pid_t>& pids) {
  for (size_t i = 0; i < pids.size(); ++i) {
    int status = 0;
    ASSERT_EQ(waitpid(pids[i], &status, 0), pids[i]);
    ASSERT_TRUE(WIFEXITED(status)) << "child " << i << " died with signal " << WTERMSIG(status);
    EXPECT_EQ(WEXITSTATUS(status), 0) << "child " << i;
  }
}

// Hands an int from the parent to each child (the parent learns the server's
// port only after forking).
struct IntPipe {
  int fds[2];
  IntPipe() {
    if (pipe(fds) != 0) std::abort();
  }
  ~IntPipe() {
    close(fds[0]);
    close(fds[1]);
  }
  void send(int v, int copies = 1) const {
    for (int i = 0; i < copies; ++i) {
      if (write(fds[1], &v, sizeof v) != sizeof v) std::abort();
    }
  }
  int receive() const {
    int v = -1;
    if (read(fds[0], &v, sizeof v) != sizeof v) std::abort();
    return v;
  }
};

// ------------------------------------------------- semantics, every store --

class StoreSemantics : public ::testing::TestWithParam<std::string> {
 protected:
  void SetUp() override {
    const std::string& kind = GetParam();
    int port = 0;
    if (kind == "tcp") {
      store_ = make_tcp_store("127.0.0.1", 0, true, 1000ms, &port);
      peer_ = make_tcp_store("127.0.0.1", port, false, 1000ms);
    } else if (kind == "file") {
      store_ = make_file_store(dir_.path + "/a/b", 1000ms);
      peer_ = make_file_store(dir_.path + "/a/b", 1000ms);
    } else {
      base_ = make_tcp_store("127.0.0.1", 0, true, 1000ms, &port);
      store_ = make_prefix_store(base_, "group");
      peer_ = make_prefix_store(make_tcp_store("127.0.0.1", port, false, 1000ms), "group");
    }
  }
  // A key as error messages quote it.
  std::string quoted(const std::string& key) const {
    return "'" + std::string(base_ ? "group/" : "") + key + "'";
  }
  // A prefix store runs under its base's timeout.
  void set_timeout(milliseconds t) { (base_ ? base_ : store_)->set_timeout(t); }

  TempDir dir_;
  std::shared_ptr<Store> base_;
  std::shared_ptr<Store> store_;
  // Another client of the same data: calls on one TCP store object are
  // serialised, so a thread that sets while another blocks needs its own.
  std::shared_ptr<Store> peer_;
};

TEST_P(StoreSemantics, SetGetCheckOverwrite) {
  EXPECT_EQ(store_->timeout(), 1000ms);
  EXPECT_FALSE(store_->check("k"));
  store_->set("k", bytes("one"));
  EXPECT_TRUE(store_->check("k"));
  EXPECT_EQ(text(store_->get("k")), "one");
  peer_->set("k", bytes("two"));
  EXPECT_EQ(text(store_->get("k")), "two");
  store_->set("empty", {});
  EXPECT_TRUE(store_->check("empty"));
  EXPECT_TRUE(store_->get("empty").empty());
}

TEST_P(StoreSemantics, AddCountsFromZeroAndReadsAsText) {
  EXPECT_EQ(store_->add("c", 1), 1);
  EXPECT_EQ(store_->add("c", 5), 6);
  EXPECT_EQ(store_->add("c", -10), -4);
  EXPECT_EQ(text(store_->get("c")), "-4");
  EXPECT_EQ(store_->add("c", 0), -4);
  store_->set("word", bytes("abc"));
  const std::string msg = error_of(Code::InvalidArgument, [&] { store_->add("word", 1); });
  EXPECT_NE(msg.find(quoted("word")), std::string::npos) << msg;
  store_->set("big", bytes(std::to_string(INT64_MAX)));
  error_of(Code::InvalidArgument, [&] { store_->add("big", 1); });
}

TEST_P(StoreSemantics, WaitReturnsOnceAllKeysExist) {
  store_->wait({});
  store_->set("a", bytes("1"));
  store_->wait({"a", "a"});
  std::thread setter([&] {
    std::this_thread::sleep_for(50ms);
    peer_->set("b", bytes("2"));
  });
  const auto start = Clock::now();
  store_->wait({"a", "b"});
  EXPECT_GE(ms_since(start), 30);
  setter.join();
}

TEST_P(StoreSemantics, GetBlocksUntilAnotherThreadSets) {
  std::thread setter([&] {
    std::this_thread::sleep_for(50ms);
    peer_->add("late", 7);
  });
  EXPECT_EQ(text(store_->get("late")), "7");
  setter.join();
}

TEST_P(StoreSemantics, GetOfMissingKeyTimesOutNamingIt) {
  set_timeout(300ms);
  const auto start = Clock::now();
  const std::string msg = error_of(Code::Timeout, [&] { store_->get("no-such-key"); });
  const auto elapsed = ms_since(start);
  EXPECT_GE(elapsed, 295);
  EXPECT_LT(elapsed, 1500);
  EXPECT_NE(msg.find(quoted("no-such-key")), std::string::npos) << msg;
  EXPECT_NE(msg.find("300 ms"), std::string::npos) << msg;
  // The store is still usable afterwards.
  store_->set("after", bytes("ok"));
  EXPECT_EQ(text(store_->get("after")), "ok");
}

TEST_P(StoreSemantics, WaitTimeoutNamesOnlyMissingKeys) {
  set_timeout(200ms);
  store_->set("present", bytes("x"));
  const std::string msg = error_of(Code::Timeout, [&] { store_->wait({"present", "absent"}); });
  EXPECT_NE(msg.find(quoted("absent")), std::string::npos) << msg;
  EXPECT_EQ(msg.find(quoted("present")), std::string::npos) << msg;
  EXPECT_NE(msg.find("200 ms"), std::string::npos) << msg;
}

// set_many / get_many: values in the order asked, a get that waits for
// keys another client sets later, a timeout naming only the missing keys,
// and lists longer than one request holds (kMaxWaitKeys: 1,024).
TEST_P(StoreSemantics, ManyKeysAtOnce) {
  store_->set_many({}, {});
  EXPECT_TRUE(store_->get_many({}).empty());
  store_->set_many({"x", "y", "x"}, {bytes("1"), bytes(""), bytes("3")});
  auto got = store_->get_many({"y", "x", "x"});
  ASSERT_EQ(got.size(), 3u);
  EXPECT_EQ(text(got[0]), "");
  EXPECT_EQ(text(got[1]), "3");
  EXPECT_EQ(text(got[2]), "3");
  std::thread setter([&] {
    std::this_thread::sleep_for(50ms);
    peer_->set_many({"late1", "late2"}, {bytes("a"), bytes("b")});
  });
  got = store_->get_many({"x", "late2", "late1"});
  setter.join();
  ASSERT_EQ(got.size(), 3u);
  EXPECT_EQ(text(got[1]), "b");
  EXPECT_EQ(text(got[2]), "a");
  std::vector<std::string> keys;
  std::vector<std::vector<char>> values;
  for (int i = 0; i < 2500; ++i) {
    keys.push_back("k" + std::to_string(i));
    values.push_back(bytes(std::to_string(i * 7)));
  }
  peer_->set_many(keys, values);
  got = store_->get_many(keys);
  ASSERT_EQ(got.size(), keys.size());
  for (size_t i = 0; i < keys.size(); i += 499) EXPECT_EQ(text(got[i]), std::to_string(i * 7));
  error_of(Code::InvalidArgument, [&] { store_->set_many({"a", "b"}, {bytes("1")}); });
  set_timeout(200ms);
  const std::string msg = error_of(Code::Timeout, [&] { store_->get_many({"x", "never"}); });
  EXPECT_NE(msg.find(quoted("never")), std::string::npos) << msg;
  EXPECT_EQ(msg.find(quoted("x")), std::string::npos) << msg;
}

TEST_P(StoreSemantics, BinaryKeysAndValuesRoundTrip) {
  std::vector<char> all(512);
  for (size_t i = 0; i < all.size(); ++i) all[i] = static_cast<char>(i);
  const std::string key("a\0b/../c%2F", 11);
  store_->set(key, all);
  store_->set(std::string("a\0b", 3), bytes("other"));
  EXPECT_EQ(store_->get(key), all);
  EXPECT_EQ(text(store_->get(std::string("a\0b", 3))), "other");
  EXPECT_FALSE(store_->check("a"));
}

TEST_P(StoreSemantics, OneMiBValueRoundTrips) {
  std::vector<char> value(1 << 20);
  uint32_t x = 12345;
  for (char& c : value) c = static_cast<char>((x = x * 1103515245u + 12345u) >> 24);
  store_->set("big", value);
  EXPECT_EQ(store_->get("big"), value);
}

TEST_P(StoreSemantics, SizeLimits) {
  const size_t prefix = base_ ? 6 : 0;  // "group/"
  const std::string longest(Store::kMaxKeyBytes - prefix, 'k');
  store_->set(longest, bytes("fits"));
  EXPECT_EQ(text(store_->get(longest)), "fits");

  const std::string too_long(Store::kMaxKeyBytes + 1 - prefix, 'k');
  std::string msg = error_of(Code::InvalidArgument, [&] { store_->set(too_long, bytes("v")); });
  EXPECT_NE(msg.find("(4097 bytes) is over the limit of 4096 bytes"), std::string::npos) << msg;
  error_of(Code::InvalidArgument, [&] { store_->get(too_long); });
  error_of(Code::InvalidArgument, [&] { store_->wait({"ok", too_long}); });
  error_of(Code::InvalidArgument, [&] { store_->add(too_long, 1); });
  error_of(Code::InvalidArgument, [&] { store_->check(too_long); });

  const std::vector<char> huge(Store::kMaxValueBytes + 1);
  msg = error_of(Code::InvalidArgument, [&] { store_->set("v", huge); });
  EXPECT_NE(msg.find(std::to_string(huge.size())), std::string::npos) << msg;
  EXPECT_NE(msg.find(quoted("v")), std::string::npos) << msg;
  EXPECT_FALSE(store_->check("v"));
}

TEST_P(StoreSemantics, ConcurrentAddsFromThreadsAreAtomic) {
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&] {
      for (int i = 0; i < 50; ++i) store_->add("n", 1);
    });
  }
  for (auto& t : threads) t.join();
  EXPECT_EQ(store_->add("n", 0), 200);
}

INSTANTIATE_TEST_SUITE_P(Stores, StoreSemantics, ::testing::Values("tcp", "file", "prefix"),
                         [](const auto& param_info) { return param_info.param; });

// ----------------------------------------------------------------- TCP ----

// Out of descriptors, the server neither spins on its listening socket (a
// pending connection it cannot accept keeps it readable) nor dies: the
// server process, limited to a few fds, uses little CPU while strangers
// hold more connections than it may accept, and serves its own client.
TEST(TcpStore, OutOfDescriptorsDoesNotSpin) {
  int ready[2], go[2];
  ASSERT_EQ(pipe(ready), 0);
  ASSERT_EQ(pipe(go), 0);
  const pid_t child = fork();
  ASSERT_GE(child, 0);
  if (child == 0) {
    int port = 0;
    auto store = make_tcp_store("127.0.0.1", 0, true, 2000ms, &port);
    rlimit lim{};
    getrlimit(RLIMIT_NOFILE, &lim);
    long open_fds = 0;
    for (int fd = 0; fd < 1024; ++fd) open_fds += fcntl(fd, F_GETFD) != -1;
    lim.rlim_cur = static_cast<rlim_t>(open_fds + 4);
    setrlimit(RLIMIT_NOFILE, &lim);
    if (write(ready[1], &port, sizeof port) != sizeof port) _exit(2);
    char c;
    if (read(go[0], &c, 1) != 1) _exit(3);  // the strangers are connected
    rusage before{}, after{};
    getrusage(RUSAGE_SELF, &before);
    std::this_thread::sleep_for(1000ms);
    getrusage(RUSAGE_SELF, &after);
    const double cpu = (after.ru_utime.tv_sec - before.ru_utime.tv_sec) +
                       (after.ru_stime.tv_sec - before.ru_stime.tv_sec) +
                       1e-6 * ((after.ru_utime.tv_usec - before.ru_utime.tv_usec) +
                               (after.ru_stime.tv_usec - before.ru_stime.tv_usec));
    if (cpu > 0.3) {
      std::fprintf(stderr, "server used %.2f s of CPU in 1 s while out of descriptors\n", cpu);
      _exit(4);
    }
    store->set("still", {'1'});
    _exit(store->get("still") == std::vector<char>{'1'} ? 0 : 5);
  }
  int port = 0;
  ASSERT_EQ(read(ready[0], &port, sizeof port), static_cast<ssize_t>(sizeof port));
  std::vector<int> strangers;
  for (int i = 0; i < 32; ++i) {
    const int fd = connect_loopback(port);
    ASSERT_GE(fd, 0);
    strangers.push_back(fd);
  }
  std::this_thread::sleep_for(100ms);
  ASSERT_EQ(write(go[1], "g", 1), 1);
  int status = 0;
  ASSERT_EQ(waitpid(child, &status, 0), child);
  for (int fd : strangers) close(fd);
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << "status " << status;
}

TEST(TcpStore, PortZeroReportsBoundPortAndClientsShareState) {
  int port = 0;
  auto server = make_tcp_store("127.0.0.1", 0, true, 1000ms, &port);
  ASSERT_GT(port, 0);
  int client_port = 0;
  auto client = make_tcp_store("127.0.0.1", port, false, 1000ms, &client_port);
  EXPECT_EQ(client_port, port);
  server->set("from-server", bytes("s"));
  client->set("from-client", bytes("c"));
  EXPECT_EQ(text(client->get("from-server")), "s");
  EXPECT_EQ(text(server->get("from-client")), "c");
  EXPECT_EQ(client->add("n", 2), 2);
  EXPECT_EQ(server->add("n", 3), 5);
}

TEST(TcpStore, ResolvesLocalhostByName) {
  int port = 0;
  auto server = make_tcp_store("localhost", 0, true, 1000ms, &port);
  auto client = make_tcp_store("localhost", port, false, 1000ms);
  client->set("k", bytes("v"));
  EXPECT_EQ(text(server->get("k")), "v");
}

TEST(TcpStore, Ipv6Loopback) {
  int port = 0;
  std::unique_ptr<Store> server;
  try {
    server = make_tcp_store("::1", 0, true, 1000ms, &port);
  } catch (const Error& e) {
    GTEST_SKIP() << "no IPv6 loopback here: " << e.what();
  }
  auto client = make_tcp_store("::1", port, false, 1000ms);
  client->set("k", bytes("v6"));
  EXPECT_EQ(text(server->get("k")), "v6");
}

TEST(TcpStore, ServerOnEveryInterface) {
  int port = 0;
  auto server = make_tcp_store("", 0, true, 1000ms, &port);
  auto client = make_tcp_store("127.0.0.1", port, false, 1000ms);
  client->set("k", bytes("any"));
  EXPECT_EQ(text(server->get("k")), "any");
}

// A port held by something that is not a zeroshard store (a previous job's
// process, another program) is named as such at connect, within the
// timeout, whether it stays silent or answers in another protocol.
TEST(TcpStore, PortHeldByAnotherProgramIsNamed) {
  for (const bool talks : {false, true}) {
    const int listener = socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    ASSERT_EQ(bind(listener, reinterpret_cast<sockaddr*>(&a), sizeof a), 0);
    ASSERT_EQ(listen(listener, 4), 0);
    socklen_t len = sizeof a;
    getsockname(listener, reinterpret_cast<sockaddr*>(&a), &len);
    const int port = ntohs(a.sin_port);
    std::thread other([&] {
      const int fd = accept(listener, nullptr, nullptr);
      if (fd >= 0 && talks) {
        const char http[] = "HTTP/1.1 400 Bad Request\r\n\r\n";
        (void)!write(fd, http, sizeof http - 1);
      }
      std::this_thread::sleep_for(700ms);
      if (fd >= 0) close(fd);
    });
    const auto start = Clock::now();
    const std::string msg =
        error_of(Code::Bootstrap, [&] { make_tcp_store("127.0.0.1", port, false, 500ms); });
    EXPECT_LT(ms_since(start), 2000);
    EXPECT_NE(msg.find("store at 127.0.0.1:" + std::to_string(port) + " accepted the connection but"),
              std::string::npos) << msg;
    EXPECT_NE(msg.find("another program (a previous job?) holds that port"), std::string::npos) << msg;
    other.join();
    close(listener);
  }
}

// A stranger who connects and SETs without the handshake is dropped and
// stores nothing; the store holds at most 256 MiB, and a SET past that is
// refused with both figures, leaving what it held.
TEST(TcpStore, StrangersAreDroppedAndMemoryIsCapped) {
  int port = 0;
  // Four 60 MiB SETs over loopback take seconds under TSan: the timeout is
  // not what this test is about.
  auto server = make_tcp_store("127.0.0.1", 0, true, 30000ms, &port);
  {
    const int fd = connect_loopback(port);
    ASSERT_GE(fd, 0);
    std::string frame = std::string(4, '\0') + '\x01' + std::string("\x03\0\0\0key", 7) +
                        std::string("\x02\0\0\0\0\0\0\0hi", 10);
    frame[0] = static_cast<char>(frame.size() - 4);
    ASSERT_EQ(write(fd, frame.data(), frame.size()), static_cast<ssize_t>(frame.size()));
    char c;
    EXPECT_EQ(read(fd, &c, 1), 0) << "the server answered a stranger instead of dropping it";
    close(fd);
  }
  EXPECT_FALSE(server->check("key"));
  const std::vector<char> big(60u << 20, 'x');
  for (int i = 0; i < 4; ++i) server->set("big" + std::to_string(i), big);
  const std::string msg = error_of(Code::InvalidArgument, [&] { server->set("big4", big); });
  EXPECT_NE(msg.find("would take the store past its limit of 268435456 bytes"), std::string::npos) << msg;
  EXPECT_FALSE(server->check("big4"));
  server->set("big0", std::vector<char>(1, 'y'));  // replacing frees room
  server->set("big4", big);
  EXPECT_EQ(server->get("big4").size(), big.size());
}

TEST(TcpStore, ConnectToClosedPortFailsWithinTimeout) {
  const int port = unused_port();
  const auto start = Clock::now();
  const std::string msg =
      error_of(Code::Bootstrap, [&] { make_tcp_store("127.0.0.1", port, false, 300ms); });
  const auto elapsed = ms_since(start);
  EXPECT_GE(elapsed, 290);
  EXPECT_LT(elapsed, 2000);
  EXPECT_NE(msg.find("cannot connect to store at 127.0.0.1:" + std::to_string(port)),
            std::string::npos)
      << msg;
  EXPECT_NE(msg.find("refused"), std::string::npos) << msg;
}

TEST(TcpStore, BadArgumentsAndBusyPort) {
  error_of(Code::InvalidArgument, [] { make_tcp_store("127.0.0.1", -1, true, 100ms); });
  error_of(Code::InvalidArgument, [] { make_tcp_store("127.0.0.1", 65536, true, 100ms); });
  error_of(Code::InvalidArgument, [] { make_tcp_store("127.0.0.1", 0, false, 100ms); });
  error_of(Code::InvalidArgument, [] { make_tcp_store("", 1234, false, 100ms); });
  error_of(Code::InvalidArgument, [] { make_tcp_store("127.0.0.1", 0, true, 0ms); });
  int port = 0;
  auto server = make_tcp_store("127.0.0.1", 0, true, 1000ms, &port);
  const std::string msg =
      error_of(Code::Bootstrap, [&] { make_tcp_store("127.0.0.1", port, true, 100ms); });
  EXPECT_NE(msg.find("127.0.0.1:" + std::to_string(port)), std::string::npos) << msg;
}

TEST(TcpStore, LateReplyAfterTimeoutIsNotMistakenForTheNextAnswer) {
  int port = 0;
  auto server = make_tcp_store("127.0.0.1", 0, true, 1000ms, &port);
  auto client = make_tcp_store("127.0.0.1", port, false, 150ms);
  error_of(Code::Timeout, [&] { client->get("late"); });
  server->set("late", bytes("LATE"));
  server->set("other", bytes("OTHER"));
  EXPECT_EQ(text(client->get("other")), "OTHER");
  EXPECT_EQ(text(client->get("late")), "LATE");
}

TEST(TcpStore, WaitOnMoreThan1024Keys) {
  auto store = make_tcp_store("127.0.0.1", 0, true, 1000ms);
  std::vector<std::string> keys;
  for (int i = 0; i < 1500; ++i) keys.push_back("k" + std::to_string(i));
  for (const auto& k : keys) {
    if (k != "k1400") store->set(k, bytes("x"));
  }
  store->set_timeout(200ms);
  const std::string msg = error_of(Code::Timeout, [&] { store->wait(keys); });
  EXPECT_NE(msg.find("'k1400'"), std::string::npos) << msg;
  EXPECT_EQ(msg.find("'k1399'"), std::string::npos) << msg;
  store->set("k1400", bytes("x"));
  store->wait(keys);
}

// Opens a raw connection, sends bytes, and reports whether the server hung up.
bool server_drops(int port, const std::string& data) {
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(static_cast<uint16_t>(port));
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  timeval tv{2, 0};
  setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
  bool dropped = false;
  if (connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr) == 0 &&
      send(fd, data.data(), data.size(), MSG_NOSIGNAL) == static_cast<ssize_t>(data.size())) {
    char buf[64];
    ssize_t n;
    while ((n = recv(fd, buf, sizeof buf, 0)) > 0) {
    }
    dropped = n == 0 || errno == ECONNRESET;
  }
  close(fd);
  return dropped;
}

std::string le32(uint32_t v) {
  std::string s;
  for (int i = 0; i < 4; ++i) s += static_cast<char>((v >> (8 * i)) & 0xff);
  return s;
}
std::string frame(const std::string& body) {
  return le32(static_cast<uint32_t>(body.size())) + body;
}

TEST(TcpStore, MalformedFramesDropOnlyThatClient) {
  int port = 0;
  auto store = make_tcp_store("127.0.0.1", 0, true, 1000ms, &port);
  auto other = make_tcp_store("127.0.0.1", port, false, 1000ms);
  // A client parked in a half-sent frame must not hold up the others.
  const int idle = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(static_cast<uint16_t>(port));
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  ASSERT_EQ(connect(idle, reinterpret_cast<sockaddr*>(&addr), sizeof addr), 0);
  ASSERT_EQ(send(idle, "\x10\x00", 2, MSG_NOSIGNAL), 2);

  const std::string set_k = std::string(1, '\x01') + le32(1) + "k";
  const std::vector<std::pair<const char*, std::string>> bad = {
      {"length beyond the limit", le32(0xffffffffu)},
      {"zero length", le32(0)},
      {"unknown command", frame("\x63")},
      {"key longer than the body", frame(std::string(1, '\x02') + le32(100) + "k")},
      {"key over the limit", frame(std::string(1, '\x02') + le32(5000) + std::string(5000, 'k'))},
      {"trailing bytes", frame(std::string(1, '\x02') + le32(1) + "kXX")},
      {"value longer than the body", frame(set_k + le32(50) + le32(0) + "v")},
      {"too many wait keys", frame(std::string(1, '\x03') + le32(1025))},
      {"short add", frame(std::string(1, '\x04') + le32(1) + "k" + "\x01")},
  };
  for (const auto& [what, data] : bad) {
    EXPECT_TRUE(server_drops(port, data)) << what;
    store->set("alive", bytes(what));
    EXPECT_EQ(text(other->get("alive")), what);
  }
  EXPECT_FALSE(other->check("k"));
  close(idle);
}

// Must fork before this process starts a server thread.
TEST(TcpStore, DeadServerMidCallIsBootstrapErrorNotHang) {
  IntPipe port_pipe;
  const auto children = fork_children(1, [&](int) {
    int port = 0;
    auto server = make_tcp_store("127.0.0.1", 0, true, 2000ms, &port);
    port_pipe.send(port);
    std::this_thread::sleep_for(400ms);
    _exit(0);  // dies with the server thread running and a client parked on it
    return 0;
  });
  const int port = port_pipe.receive();
  auto client = make_tcp_store("127.0.0.1", port, false, 2000ms);
  const auto start = Clock::now();
  const std::string msg = error_of(Code::Bootstrap, [&] { client->get("never"); });
  EXPECT_LT(ms_since(start), 1500);
  EXPECT_NE(msg.find("'never'"), std::string::npos) << msg;
  EXPECT_NE(msg.find("127.0.0.1:" + std::to_string(port)), std::string::npos) << msg;
  expect_children_succeed(children);
  // Later calls find nobody to reconnect to, within the timeout.
  client->set_timeout(200ms);
  error_of(Code::Bootstrap, [&] { client->set("k", bytes("v")); });
}

// Must fork before this process starts a server thread.
TEST(TcpStore, FourProcessesRendezvous) {
  constexpr int kWorld = 4;
  IntPipe port_pipe;
  const auto children = fork_children(kWorld, [&](int rank) {
    const int port = port_pipe.receive();
    auto store = make_tcp_store("127.0.0.1", port, false, 2000ms);
    const int64_t arrived = store->add("arrived", 1);
    if (arrived < 1 || arrived > kWorld) return 10;
    store->set("addr/" + std::to_string(rank), bytes("rank" + std::to_string(rank)));
    std::vector<std::string> keys;
    for (int r = 0; r < kWorld; ++r) keys.push_back("addr/" + std::to_string(r));
    store->wait(keys);
    for (int r = 0; r < kWorld; ++r) {
      if (text(store->get(keys[r])) != "rank" + std::to_string(r)) return 11;
    }
    if (text(store->get("arrived")) != std::to_string(kWorld)) return 12;
    return 0;
  });
  int port = 0;
  auto server = make_tcp_store("127.0.0.1", 0, true, 2000ms, &port);
  port_pipe.send(port, kWorld);
  expect_children_succeed(children);
  EXPECT_EQ(server->add("arrived", 0), kWorld);
}

// ---------------------------------------------------------------- file ----

TEST(FileStore, UnusableDirectoryIsBootstrapErrorNamingIt) {
  TempDir dir;
  const std::string file = dir.path + "/plain-file";
  std::ofstream(file) << "x";
  const std::string msg =
      error_of(Code::Bootstrap, [&] { make_file_store(file + "/store", 100ms); });
  EXPECT_NE(msg.find(file + "/store"), std::string::npos) << msg;
  error_of(Code::Bootstrap, [&] { make_file_store(file, 100ms); });
  error_of(Code::InvalidArgument, [&] { make_file_store("", 100ms); });
}

TEST(FileStore, KeysStayInsideTheDirectory) {
  TempDir dir;
  auto store = make_file_store(dir.path + "/s", 500ms);
  store->set("../escape", bytes("x"));
  store->set("/abs", bytes("y"));
  store->set("", bytes("empty key"));
  EXPECT_FALSE(std::filesystem::exists(dir.path + "/escape"));
  EXPECT_EQ(text(store->get("../escape")), "x");
  EXPECT_EQ(text(store->get("")), "empty key");
  for (const auto& entry : std::filesystem::directory_iterator(dir.path)) {
    EXPECT_EQ(entry.path().filename(), "s");
  }
}

TEST(FileStore, LongKeysDifferingAtTheEndAreDistinct) {
  TempDir dir;
  auto store = make_file_store(dir.path, 500ms);
  std::string a(Store::kMaxKeyBytes, '/');
  std::string b = a;
  b.back() = 'b';
  store->set(a, bytes("A"));
  store->set(b, bytes("B"));
  EXPECT_EQ(text(store->get(a)), "A");
  EXPECT_EQ(text(store->get(b)), "B");
  const std::string c(300, 'c');  // just over the escaped-name limit
  EXPECT_EQ(store->add(c, 3), 3);
  EXPECT_EQ(store->add(c, 3), 6);
  store->wait({a, b, c});
}

// Forks first; flock must serialise add() across processes.
TEST(FileStore, FourProcessesAddAndRendezvous) {
  constexpr int kWorld = 4;
  constexpr int kAdds = 25;
  TempDir dir;
  const auto children = fork_children(kWorld, [&](int rank) {
    auto store = make_file_store(dir.path + "/rdzv", 2000ms);
    for (int i = 0; i < kAdds; ++i) store->add("counter", 1);
    store->set("rank/" + std::to_string(rank), bytes(std::to_string(rank)));
    std::vector<std::string> keys;
    for (int r = 0; r < kWorld; ++r) keys.push_back("rank/" + std::to_string(r));
    store->wait(keys);
    for (int r = 0; r < kWorld; ++r) {
      if (text(store->get(keys[r])) != std::to_string(r)) return 10;
    }
    return 0;
  });
  expect_children_succeed(children);
  auto store = make_file_store(dir.path + "/rdzv", 500ms);
  EXPECT_EQ(text(store->get("counter")), std::to_string(kWorld * kAdds));
}

// -------------------------------------------------------------- prefix ----

TEST(PrefixStore, PrefixesIsolateGroupsOnOneBase) {
  std::shared_ptr<Store> base = make_tcp_store("127.0.0.1", 0, true, 500ms);
  auto a = make_prefix_store(base, "a");
  auto b = make_prefix_store(base, "b");
  a->set("k", bytes("in a"));
  b->set("k", bytes("in b"));
  EXPECT_EQ(text(a->get("k")), "in a");
  EXPECT_EQ(text(b->get("k")), "in b");
  EXPECT_EQ(text(base->get("a/k")), "in a");
  EXPECT_FALSE(b->check("only-a"));
  a->set("only-a", {});
  EXPECT_FALSE(b->check("only-a"));
  EXPECT_EQ(a->add("n", 2), 2);
  EXPECT_EQ(b->add("n", 5), 5);
  a->wait({"k", "n", "only-a"});
  EXPECT_EQ(a->timeout(), 500ms);
  base->set_timeout(100ms);
  const std::string msg = error_of(Code::Timeout, [&] { b->get("missing"); });
  EXPECT_NE(msg.find("'b/missing'"), std::string::npos) << msg;
}

TEST(PrefixStore, RejectsNullBaseAndEmptyPrefix) {
  error_of(Code::InvalidArgument, [] { make_prefix_store(nullptr, "g"); });
  std::shared_ptr<Store> base = make_tcp_store("127.0.0.1", 0, true, 500ms);
  error_of(Code::InvalidArgument, [&] { make_prefix_store(base, ""); });
}

// ------------------------------------------ a server started again on its journal --

// What zsrun does when its zsstore dies: another server on the same port and
// journal (ZS_STORE_JOURNAL) takes over. Store A, a real process, is killed
// (ZS_FAULT_STORE) at an ADD it applied and journaled but did not answer,
// while another client's GET is parked on it; store B waits for the port
// and starts from the journal. The clients (server_restarts) resend: the ADD
// is not applied twice, the GET is answered by B, every key A took is there.
// Forks first, with no thread in this process.
TEST(StoreJournal, AServerKilledAndStartedAgainOnItsJournalLosesNoKeyAndAppliesNoAddTwice) {
  unsetenv("ZS_JOB_SECRET");  // no AUTH round trips: the requests below are counted
  TempDir dir;
  const std::string journal = dir.path + "/store.journal";
  const int port = unused_port();
  IntPipe a_up, b_up, b_end;
  // A's requests: two HELLOs, SET, SETS, the parked GET, then the ADD (6th).
  const auto a = fork_children(1, [&](int) {
    setenv("ZS_STORE_JOURNAL", journal.c_str(), 1);
    setenv("ZS_FAULT_STORE", "6", 1);
    zs_store_server server = nullptr;
    if (zs_store_serve(&server, "127.0.0.1", port, nullptr) != ZS_OK) return 3;
    a_up.send(1);
    for (;;) pause();  // until the fault (or fork_children's alarm)
  });
  ASSERT_EQ(a_up.receive(), 1);
  const auto b = fork_children(1, [&](int) {
    setenv("ZS_STORE_JOURNAL", journal.c_str(), 1);
    zs_store_server server = nullptr;
    const auto deadline = Clock::now() + 15s;
    while (zs_store_serve(&server, "127.0.0.1", port, nullptr) != ZS_OK) {  // A holds the port
      if (Clock::now() > deadline) return 3;
      std::this_thread::sleep_for(10ms);
    }
    b_up.send(1);
    b_end.receive();
    return zs_store_server_destroy(server) == ZS_OK ? 0 : 4;
  });
  auto one = make_tcp_store("127.0.0.1", port, false, 10000ms, nullptr, "rank 0", true);
  auto two = make_tcp_store("127.0.0.1", port, false, 10000ms, nullptr, "rank 1", true);
  one->set("a", bytes("1"));
  one->set_many({"b", "c"}, {bytes("2"), bytes("3")});
  std::string late;
  std::thread parked([&] { late = text(two->get("late")); });
  std::this_thread::sleep_for(300ms);  // the GET parked on A before the ADD kills it
  EXPECT_EQ(one->add("n", 5), 5);      // answered by B, from A's journal: not 10
  ASSERT_EQ(b_up.receive(), 1);
  EXPECT_EQ(text(one->get("a")), "1");
  EXPECT_EQ(text(one->get("c")), "3");  // (two is held by its parked GET)
  EXPECT_EQ(one->add("n", 1), 6);
  one->set("late", bytes("from B"));
  parked.join();
  EXPECT_EQ(late, "from B");
  one.reset();
  two.reset();
  b_end.send(1);
  int status = 0;
  ASSERT_EQ(waitpid(a[0], &status, 0), a[0]);
  EXPECT_TRUE(WIFSIGNALED(status) && WTERMSIG(status) == SIGKILL) << "store A was not killed by its fault: " << status;
  expect_children_succeed(b);
}

// A record cut short (a kill in its write) is dropped and the rest kept; a
// file that is not a journal is refused by name, not read as one. A client
// without server_restarts is told the server is gone, as before.
TEST(StoreJournal, ARecordCutShortIsDroppedAndAFileThatIsNotAJournalIsNamed) {
  TempDir dir;
  const std::string journal = dir.path + "/store.journal";
  setenv("ZS_STORE_JOURNAL", journal.c_str(), 1);
  zs_store_server server = nullptr;
  int port = 0;
  ASSERT_EQ(zs_store_serve(&server, "127.0.0.1", 0, &port), ZS_OK) << zs_last_error();
  {
    auto client = make_tcp_store("127.0.0.1", port, false, 2000ms, nullptr, "rank 0");
    client->set("k", bytes("v"));
    client->set("k", bytes("v2"));
    EXPECT_EQ(client->add("c", 2), 2);
    ASSERT_EQ(zs_store_server_destroy(server), ZS_OK);
    client->set_timeout(200ms);
    const std::string msg = error_of(Code::Bootstrap, [&] { client->get("k"); });
    EXPECT_NE(msg.find("may have exited"), std::string::npos) << msg;
  }
  {
    std::ofstream torn(journal, std::ios::binary | std::ios::app);
    torn.write("\x01\x00\x00\x00\x05\x00\x00\x00\x00\x00\x00\x00kv", 14);  // a 5-byte value cut after 1
  }
  ASSERT_EQ(zs_store_serve(&server, "127.0.0.1", 0, &port), ZS_OK) << zs_last_error();
  {
    auto client = make_tcp_store("127.0.0.1", port, false, 2000ms, nullptr, "rank 0");
    EXPECT_EQ(text(client->get("k")), "v2");
    EXPECT_EQ(client->add("c", 0), 2);
    EXPECT_FALSE(client->check("kv"));
  }
  ASSERT_EQ(zs_store_server_destroy(server), ZS_OK);
  // Compacted at the open: one record per key (k, c, and the departures).
  EXPECT_LT(std::filesystem::file_size(journal), 120u);
  { std::ofstream(journal) << "not a journal\n"; }
  EXPECT_EQ(zs_store_serve(&server, "127.0.0.1", 0, &port), ZS_ERR_BOOTSTRAP);
  const std::string msg = zs_last_error();
  EXPECT_NE(msg.find(journal), std::string::npos) << msg;
  EXPECT_NE(msg.find("is not a store journal"), std::string::npos) << msg;
  unsetenv("ZS_STORE_JOURNAL");
}

// A journal that cannot be written (here the file-size limit; a full disk
// alike) is said and removed, and the store goes on in memory: the job
// loses its store's restart, not its store. zsrun then restarts no store
// (there is no journal to start from). Forks first, with no thread here.
TEST(StoreJournal, AJournalThatCannotBeWrittenIsRemovedAndTheStoreGoesOnInMemory) {
  TempDir dir;
  const std::string journal = dir.path + "/store.journal";
  IntPipe port_pipe, done;
  const auto server = fork_children(1, [&](int) {
    signal(SIGXFSZ, SIG_IGN);  // a write past the limit fails with EFBIG instead
    const rlimit limit{256, 256};
    if (setrlimit(RLIMIT_FSIZE, &limit) != 0) return 3;
    setenv("ZS_STORE_JOURNAL", journal.c_str(), 1);
    zs_store_server s = nullptr;
    int port = 0;
    if (zs_store_serve(&s, "127.0.0.1", 0, &port) != ZS_OK) return 4;
    port_pipe.send(port);
    done.receive();
    return zs_store_server_destroy(s) == ZS_OK ? 0 : 5;
  });
  const int port = port_pipe.receive();
  auto client = make_tcp_store("127.0.0.1", port, false, 5000ms, nullptr, "rank 0", true);
  client->set("small", bytes("fits"));
  EXPECT_TRUE(std::filesystem::exists(journal));
  client->set("large", bytes(std::string(1024, 'x')));  // past the file's limit
  EXPECT_FALSE(std::filesystem::exists(journal)) << "the journal that missed a change is still there";
  EXPECT_EQ(text(client->get("large")), std::string(1024, 'x'));
  EXPECT_EQ(text(client->get("small")), "fits");
  EXPECT_EQ(client->add("n", 3), 3);
  client.reset();
  done.send(1);
  expect_children_succeed(server);
}

}  // namespace
}  // namespace zs

// zs_store_serve: the store in a process of its own (tools/zsstore). A
// client of the engine's TCP store reads and writes through it; a port
// outside 0..65535 and a destroyed handle are named errors.
TEST(StoreServe, ServesClientsUntilDestroyedAndNamesBadArguments) {
  zs_store_server server = nullptr;
  int port = 0;
  ASSERT_EQ(zs_store_serve(&server, "127.0.0.1", 0, &port), ZS_OK) << zs_last_error();
  ASSERT_GT(port, 0);
  {
    auto client = zs::make_tcp_store("127.0.0.1", port, false, std::chrono::milliseconds(5000), nullptr, "client");
    client->set("k", {'v'});
    EXPECT_EQ(client->get("k"), std::vector<char>{'v'});
  }
  EXPECT_EQ(zs_store_server_destroy(server), ZS_OK) << zs_last_error();
  EXPECT_EQ(zs_store_server_destroy(server), ZS_ERR_INVALID_HANDLE);
  EXPECT_NE(std::string(zs_last_error()).find("is not a live store server handle"), std::string::npos)
      << zs_last_error();
  EXPECT_EQ(zs_store_serve(&server, "127.0.0.1", 70000, nullptr), ZS_ERR_INVALID_ARGUMENT);
  EXPECT_NE(std::string(zs_last_error()).find("store port 70000"), std::string::npos) << zs_last_error();
  EXPECT_EQ(server, nullptr);
}
