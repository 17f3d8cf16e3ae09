// File rendezvous store for ranks that share a directory (one node, or a
// shared file system). One file per key, published with rename() so a reader
// sees a whole value or none; get/wait poll with short sleeps; add() holds an
// flock on <dir>/.lock around its read-modify-write.
//
// File names: "k." + the key with bytes outside [A-Za-z0-9._-] written as
// %HH, which is injective. Keys whose escaped form would pass a safe name
// length use "h." + a 64-bit hash instead, and such a file starts with the
// full key (u32 length + bytes) so a hash collision is detected, not served.
#include <fcntl.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cctype>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <mutex>
#include <thread>
#include <utility>

#include "impl/comm/store/store.h"
#include "impl/common/error.h"

namespace zs {
namespace {

using Clock = std::chrono::steady_clock;
using std::chrono::milliseconds;
using store_detail::quote_key;

constexpr size_t kMaxEscapedName = 200;  // well below NAME_MAX (255)

int64_t elapsed_ms(Clock::time_point start) {
  return std::chrono::duration_cast<milliseconds>(Clock::now() - start).count();
}

// Closes an fd on every path out of a scope.
struct Fd {
  int fd;
  explicit Fd(int f) : fd(f) {}
  ~Fd() {
    if (fd >= 0) close(fd);
  }
  Fd(const Fd&) = delete;
  Fd& operator=(const Fd&) = delete;
};


// Polls ready() with sleeps growing 1 ms -> 10 ms; false once the deadline passes.
template <typename Ready>
bool poll_until(Clock::time_point deadline, Ready ready) {
  auto pause = milliseconds(1);
  for (;;) {
    if (ready()) return true;
    const auto left = deadline - Clock::now();
    if (left <= Clock::duration::zero()) return false;
    std::this_thread::sleep_for(std::min<Clock::duration>(pause, left));
    pause = std::min(pause * 2, milliseconds(10));
  }
}

class FileStore final : public Store {
 public:
  FileStore(std::string dir, milliseconds timeout);

  void set(const std::string& key, const std::vector<char>& value) override;
  std::vector<char> get(const std::string& key) override;
  void wait(const std::vector<std::string>& keys) override;
  int64_t add(const std::string& key, int64_t delta) override;
  bool check(const std::string& key) override;
  void interrupt(const std::string& why) override;
  void discard() override;

 private:
  // Throws Code::Comm if interrupt() was called since `since` was read.
  void check_interrupted(uint64_t since, const std::string& what) const;

  struct Name {
    std::string path;
    bool hashed;
  };
  Name name_of(const std::string& key) const;
  // Reads key's value into *value (may be null); false if the key is absent.
  bool read(const std::string& key, std::string* value) const;
  void write(const std::string& key, const char* data, size_t n);
  bool exists(const std::string& key) const;
  [[noreturn]] void fail_io(const char* op, const std::string& key, const std::string& path,
                            int err) const;

  std::string dir_;
  // interrupt(): counted, and seen by the get/wait polling at its next look.
  std::atomic<uint64_t> interrupts_{0};
  mutable std::mutex why_mu_;
  std::string why_;
};

FileStore::FileStore(std::string dir, milliseconds timeout) : dir_(std::move(dir)) {
  timeout_ = timeout;
  std::error_code ec;
  std::filesystem::create_directories(dir_, ec);
  if (ec) {
    fail(Code::Bootstrap, "cannot create file store directory '", dir_, "': ", ec.message());
  }
  struct stat st{};
  if (stat(dir_.c_str(), &st) != 0 || !S_ISDIR(st.st_mode)) {
    fail(Code::Bootstrap, "file store directory '", dir_, "' is not a directory");
  }
  if (access(dir_.c_str(), R_OK | W_OK | X_OK) != 0) {
    fail(Code::Bootstrap, "file store directory '", dir_, "' is not usable: ",
         std::strerror(errno));
  }
}

FileStore::Name FileStore::name_of(const std::string& key) const {
  static const char kHex[] = "0123456789ABCDEF";
  std::string escaped;
  for (unsigned char c : key) {
    if (std::isalnum(c) || c == '.' || c == '_' || c == '-') {
      escaped += static_cast<char>(c);
    } else {
      escaped += '%';
      escaped += kHex[c >> 4];
      escaped += kHex[c & 15];
    }
    if (escaped.size() > kMaxEscapedName) break;
  }
  if (escaped.size() <= kMaxEscapedName) return {dir_ + "/k." + escaped, false};
  uint64_t h = 0xcbf29ce484222325ull;  // FNV-1a
  for (unsigned char c : key) h = (h ^ c) * 0x100000001b3ull;
  std::string name = "h.";
  for (int shift = 60; shift >= 0; shift -= 4) name += kHex[(h >> shift) & 15];
  return {dir_ + "/" + name, true};
}

void FileStore::fail_io(const char* op, const std::string& key, const std::string& path,
                        int err) const {
  fail(Code::Bootstrap, op, " of key ", quote_key(key), " in file store '", dir_, "': '", path,
       "': ", std::strerror(err));
}

bool FileStore::read(const std::string& key, std::string* value) const {
  const Name name = name_of(key);
  Fd f(open(name.path.c_str(), O_RDONLY | O_CLOEXEC));
  if (f.fd < 0) {
    if (errno == ENOENT) return false;
    fail_io("read", key, name.path, errno);
  }
  std::string data;
  char buf[65536];
  for (;;) {
    const ssize_t n = ::read(f.fd, buf, sizeof buf);
    if (n == 0) break;
    if (n < 0) {
      if (errno == EINTR) continue;
      fail_io("read", key, name.path, errno);
    }
    data.append(buf, static_cast<size_t>(n));
  }
  size_t offset = 0;
  if (name.hashed) {
    uint32_t len = 0;
    for (size_t i = 0; i < 4 && i < data.size(); ++i) {
      len |= uint32_t(static_cast<unsigned char>(data[i])) << (8 * i);
    }
    if (data.size() < 4 || data.size() - 4 < len || data.compare(4, len, key) != 0) {
      fail(Code::Internal, "file store '", dir_, "': key ", quote_key(key),
           " hashes to the file '", name.path, "' that holds another key");
    }
    offset = 4 + len;
  }
  if (value) value->assign(data, offset, std::string::npos);
  return true;
}

bool FileStore::exists(const std::string& key) const {
  const Name name = name_of(key);
  if (name.hashed) return read(key, nullptr);
  if (access(name.path.c_str(), F_OK) == 0) return true;
  if (errno != ENOENT) fail_io("check", key, name.path, errno);
  return false;
}

// Writes a temp file beside the target and renames it over the target.
// No fsync: visibility to other processes is what matters, not durability.
void FileStore::write(const std::string& key, const char* data, size_t n) {
  const Name name = name_of(key);
  std::string header;
  if (name.hashed) {
    for (int i = 0; i < 4; ++i) header += static_cast<char>((key.size() >> (8 * i)) & 0xff);
    header += key;
  }
  std::string tmp = dir_ + "/.tmp.XXXXXX";
  Fd f(mkostemp(tmp.data(), O_CLOEXEC));
  if (f.fd < 0) fail_io("set", key, tmp, errno);
  const std::pair<const char*, size_t> parts[] = {{header.data(), header.size()}, {data, n}};
  for (const auto& part : parts) {
    size_t done = 0;
    while (done < part.second) {
      const ssize_t w = ::write(f.fd, part.first + done, part.second - done);
      if (w < 0) {
        if (errno == EINTR) continue;
        const int err = errno;
        unlink(tmp.c_str());
        fail_io("set", key, tmp, err);
      }
      done += static_cast<size_t>(w);
    }
  }
  if (rename(tmp.c_str(), name.path.c_str()) != 0) {
    const int err = errno;
    unlink(tmp.c_str());
    fail_io("set", key, name.path, err);
  }
}

void FileStore::set(const std::string& key, const std::vector<char>& value) {
  store_detail::check_key("set", key);
  store_detail::check_value(key, value.size());
  write(key, value.data(), value.size());
}

// Only the store's own files (keys, hashed keys, temp files, the lock):
// the directory is the user's.
void FileStore::discard() {
  std::error_code ec;
  for (const auto& entry : std::filesystem::directory_iterator(dir_, ec)) {
    const std::string name = entry.path().filename().string();
    if (name.rfind("k.", 0) == 0 || name.rfind("h.", 0) == 0 || name.rfind(".tmp.", 0) == 0 ||
        name == ".lock")
      unlink(entry.path().c_str());
  }
}

void FileStore::interrupt(const std::string& why) {
  {
    std::lock_guard<std::mutex> lock(why_mu_);
    why_ = why;
  }
  interrupts_.fetch_add(1);
}

void FileStore::check_interrupted(uint64_t since, const std::string& what) const {
  if (interrupts_.load() == since) return;
  std::string why;
  {
    std::lock_guard<std::mutex> lock(why_mu_);
    why = why_;
  }
  fail(Code::Comm, what, " in file store '", dir_, "' was abandoned: ", why);
}

std::vector<char> FileStore::get(const std::string& key) {
  store_detail::check_key("get", key);
  const uint64_t since = interrupts_.load();
  const auto start = Clock::now();
  std::string value;
  if (!poll_until(start + timeout_, [&] {
        if (read(key, &value)) return true;
        check_interrupted(since, "get of key " + quote_key(key));
        return false;
      })) {
    fail(Code::Timeout, "get of key ", quote_key(key), ": timed out after ", elapsed_ms(start),
         " ms (timeout ", timeout_.count(), " ms) in file store '", dir_, "'");
  }
  return std::vector<char>(value.begin(), value.end());
}

void FileStore::wait(const std::vector<std::string>& keys) {
  for (const std::string& key : keys) store_detail::check_key("wait", key);
  const uint64_t since = interrupts_.load();
  const auto start = Clock::now();
  size_t next = 0;  // keys before next are known to exist
  const bool all = poll_until(start + timeout_, [&] {
    while (next < keys.size() && exists(keys[next])) ++next;
    if (next == keys.size()) return true;
    check_interrupted(since, "wait for " + std::to_string(keys.size()) + " key(s)");
    return false;
  });
  if (all) return;
  constexpr size_t kShown = 10;
  std::string missing;
  size_t count = 0;
  for (size_t i = next; i < keys.size(); ++i) {
    if (exists(keys[i])) continue;
    if (count++ < kShown) missing += (missing.empty() ? "" : ", ") + quote_key(keys[i]);
  }
  if (count > kShown) missing += " and " + std::to_string(count - kShown) + " more";
  fail(Code::Timeout, "wait for ", keys.size(), " key(s): timed out after ", elapsed_ms(start),
       " ms (timeout ", timeout_.count(), " ms) in file store '", dir_, "'; missing: ", missing);
}

int64_t FileStore::add(const std::string& key, int64_t delta) {
  store_detail::check_key("add", key);
  const std::string lock_path = dir_ + "/.lock";
  // A fresh open per call: flock is per open file description, so threads of
  // one process sharing an fd would not exclude each other.
  Fd lock(open(lock_path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0644));
  if (lock.fd < 0) fail_io("add", key, lock_path, errno);
  while (flock(lock.fd, LOCK_EX) != 0) {
    if (errno != EINTR) fail_io("add", key, lock_path, errno);
  }
  std::string current;
  int64_t value = 0;
  if (read(key, &current) && !store_detail::parse_int64(current, &value)) {
    fail(Code::InvalidArgument, "add to key ", quote_key(key), " in file store '", dir_,
         "': it holds ", current.size(), " bytes that are not a decimal integer");
  }
  if (__builtin_add_overflow(value, delta, &value)) {
    fail(Code::InvalidArgument, "add to key ", quote_key(key), " in file store '", dir_, "': ",
         current, " plus ", delta, " overflows int64");
  }
  const std::string text = std::to_string(value);
  write(key, text.data(), text.size());
  return value;  // the lock is released when lock closes
}

bool FileStore::check(const std::string& key) {
  store_detail::check_key("check", key);
  return exists(key);
}

}  // namespace

std::unique_ptr<Store> make_file_store(const std::string& dir, std::chrono::milliseconds timeout) {
  if (dir.empty()) fail(Code::InvalidArgument, "file store directory is empty");
  if (timeout.count() <= 0) {
    fail(Code::InvalidArgument, "file store timeout = ", timeout.count(), " ms: expected > 0");
  }
  return std::make_unique<FileStore>(dir, timeout);
}

}  // namespace zs
