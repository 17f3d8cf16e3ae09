// A store server's keys kept in a file (store_journal.h).
#include "impl/comm/store/store_journal.h"

#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <cstdint>
#include <cstring>

#include "impl/comm/store/store.h"
#include "impl/comm/store/store_protocol.h"
#include "impl/common/error.h"

namespace zs {
namespace {

constexpr char kMagic[] = "zeroshard-store-journal/1\n";
constexpr size_t kMagicBytes = sizeof kMagic - 1;
constexpr size_t kRecordHeader = 4 + 8;

void append_record(std::string& out, const std::string& key, const std::string& value) {
  store_protocol::put_u32(out, static_cast<uint32_t>(key.size()));
  store_protocol::put_u64(out, value.size());
  out += key;
  out += value;
}

// Writes all of data at fd; "" or why not.
std::string write_all(int fd, const std::string& data) {
  size_t done = 0;
  while (done < data.size()) {
    const ssize_t n = write(fd, data.data() + done, data.size() - done);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return n < 0 ? std::strerror(errno) : "wrote nothing";
    done += static_cast<size_t>(n);
  }
  return "";
}

std::string read_file(const std::string& path) {
  const int fd = open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) {
    if (errno == ENOENT) return "";
    fail(Code::Bootstrap, "the store's journal '", path, "' cannot be opened: ", std::strerror(errno));
  }
  std::string out;
  char buf[1 << 16];
  for (;;) {
    const ssize_t n = read(fd, buf, sizeof buf);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) {
      const int e = errno;
      close(fd);
      fail(Code::Bootstrap, "the store's journal '", path, "' cannot be read: ", std::strerror(e));
    }
    if (n == 0) break;
    out.append(buf, static_cast<size_t>(n));
  }
  close(fd);
  return out;
}

}  // namespace

StoreJournal::StoreJournal(const std::string& path, std::unordered_map<std::string, std::string>* keys)
    : path_(path) {
  const std::string file = read_file(path);
  if (!file.empty()) {
    if (file.size() < kMagicBytes || file.compare(0, kMagicBytes, kMagic) != 0)
      fail(Code::Bootstrap, "'", path, "' is not a store journal (it does not start with \"",
           std::string(kMagic, kMagicBytes - 1), "\"): name a new file or one a store wrote");
    size_t at = kMagicBytes;
    // A record cut short (a kill in its write) ends the journal.
    while (file.size() - at >= kRecordHeader) {
      const uint64_t key_bytes = store_protocol::load_le(file.data() + at, 4);
      const uint64_t value_bytes = store_protocol::load_le(file.data() + at + 4, 8);
      const size_t left = file.size() - at - kRecordHeader;
      if (key_bytes > Store::kMaxKeyBytes || key_bytes > left || value_bytes > left - key_bytes) break;
      const char* p = file.data() + at + kRecordHeader;
      (*keys)[std::string(p, key_bytes)] = std::string(p + key_bytes, value_bytes);
      at += kRecordHeader + key_bytes + value_bytes;
    }
  }
  // Compacted through a temporary file and a rename: a kill here leaves
  // the old journal or the new one, never a part of either.
  std::string compact(kMagic, kMagicBytes);
  for (const auto& [key, value] : *keys) append_record(compact, key, value);
  const std::string tmp = path + ".tmp";
  const int out = open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
  if (out < 0)
    fail(Code::Bootstrap, "the store's journal '", tmp, "' cannot be created: ", std::strerror(errno));
  const std::string why = write_all(out, compact);
  close(out);
  if (!why.empty() || rename(tmp.c_str(), path.c_str()) != 0) {
    const std::string what = why.empty() ? std::strerror(errno) : why;
    unlink(tmp.c_str());
    fail(Code::Bootstrap, "the store's journal '", path, "' cannot be written: ", what);
  }
  fd_ = open(path.c_str(), O_WRONLY | O_APPEND | O_CLOEXEC);
  if (fd_ < 0) fail(Code::Bootstrap, "the store's journal '", path, "' cannot be opened: ", std::strerror(errno));
}

StoreJournal::~StoreJournal() {
  if (fd_ >= 0) close(fd_);
}

std::string StoreJournal::record(const std::vector<std::pair<const std::string*, const std::string*>>& changes) {
  std::string out;
  for (const auto& [key, value] : changes) append_record(out, *key, *value);
  const off_t before = lseek(fd_, 0, SEEK_END);
  const std::string why = write_all(fd_, out);
  if (why.empty()) return "";
  // A part written (the disk filled up) would be read back as the start of
  // the next record: cut it off, so the journal ends at the last whole one.
  if (before >= 0 && ftruncate(fd_, before) != 0) {
    // The next open still drops a record cut short.
  }
  return "the store's journal '" + path_ + "' cannot be written (" + why + ")";
}

}  // namespace zs
