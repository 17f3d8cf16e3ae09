#include "impl/checkpoint/file_io.h"

#include <dirent.h>
#include <fcntl.h>
#include <linux/fs.h>
#include <stdio.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <filesystem>

#include "impl/common/error.h"

namespace zs::ckpt {
namespace {

[[noreturn]] void io_fail(const char* op, const std::string& path, int err) {
  fail(Code::Io, op, " '", path, "': ", std::strerror(err));
}

}  // namespace

File File::open_read(const std::string& path) {
  File f;
  f.path_ = path;
  f.fd_ = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (f.fd_ < 0) io_fail("cannot open", path, errno);
  return f;
}

File File::create(const std::string& path) {
  File f;
  f.path_ = path;
  f.fd_ = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (f.fd_ < 0) io_fail("cannot create", path, errno);
  return f;
}

File::~File() {
  if (fd_ >= 0) ::close(fd_);
}

File& File::operator=(File&& o) noexcept {
  if (this != &o) {
    if (fd_ >= 0) ::close(fd_);
    fd_ = o.fd_;
    path_ = std::move(o.path_);
    o.fd_ = -1;
  }
  return *this;
}

uint64_t File::size() const {
  struct stat st;
  if (::fstat(fd_, &st) != 0) io_fail("cannot stat", path_, errno);
  return static_cast<uint64_t>(st.st_size);
}

void File::write_all(const void* data, size_t bytes) {
  const char* p = static_cast<const char*>(data);
  while (bytes > 0) {
    const ssize_t n = ::write(fd_, p, bytes);
    if (n < 0) {
      if (errno == EINTR) continue;
      io_fail("cannot write", path_, errno);
    }
    p += n;
    bytes -= static_cast<size_t>(n);
  }
}

void File::pread_all(void* data, size_t bytes, uint64_t offset, const std::string& what) const {
  char* p = static_cast<char*>(data);
  uint64_t at = offset;
  while (bytes > 0) {
    const ssize_t n = ::pread(fd_, p, bytes, static_cast<off_t>(at));
    if (n < 0) {
      if (errno == EINTR) continue;
      io_fail("cannot read", path_, errno);
    }
    if (n == 0)
      fail(Code::Io, "file '", path_, "' is truncated: ", what, " needs bytes up to ",
           at + bytes, ", the file has ", size());
    p += n;
    at += static_cast<uint64_t>(n);
    bytes -= static_cast<size_t>(n);
  }
}

void File::sync() {
  if (::fsync(fd_) != 0) io_fail("cannot fsync", path_, errno);
}

void File::close() {
  if (fd_ < 0) return;
  const int fd = fd_;
  fd_ = -1;
  if (::close(fd) != 0) io_fail("cannot close", path_, errno);
}

bool exists(const std::string& path) {
  struct stat st;
  return ::lstat(path.c_str(), &st) == 0;
}

bool is_dir(const std::string& path) {
  struct stat st;
  return ::stat(path.c_str(), &st) == 0 && S_ISDIR(st.st_mode);
}

void make_dir(const std::string& path) {
  if (::mkdir(path.c_str(), 0755) != 0 && errno != EEXIST) io_fail("cannot create directory", path, errno);
}

bool make_dirs(const std::string& path) {
  std::error_code ec;
  const bool made = std::filesystem::create_directories(path, ec);
  if (ec) io_fail("cannot create directory", path, ec.value());
  return made;
}

void sync_dir(const std::string& path) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd < 0) io_fail("cannot open directory", path, errno);
  const int rc = ::fsync(fd);
  const int err = errno;
  ::close(fd);
  if (rc != 0) io_fail("cannot fsync directory", path, err);
}

std::vector<std::string> list_dir(const std::string& path) {
  DIR* d = ::opendir(path.c_str());
  if (d == nullptr) io_fail("cannot open directory", path, errno);
  std::vector<std::string> names;
  while (dirent* e = ::readdir(d)) {
    const std::string n = e->d_name;
    if (n != "." && n != "..") names.push_back(n);
  }
  ::closedir(d);
  return names;
}

int64_t mtime_ns(const std::string& path) {
  struct stat st;
  if (::stat(path.c_str(), &st) != 0) io_fail("cannot stat", path, errno);
  return static_cast<int64_t>(st.st_mtim.tv_sec) * 1000000000 + st.st_mtim.tv_nsec;
}

void remove_tree(const std::string& path) {
  struct stat st;
  if (::lstat(path.c_str(), &st) != 0) {
    if (errno == ENOENT) return;
    io_fail("cannot stat", path, errno);
  }
  if (S_ISDIR(st.st_mode)) {
    for (const auto& n : list_dir(path)) remove_tree(join(path, n));
    if (::rmdir(path.c_str()) != 0 && errno != ENOENT) io_fail("cannot remove directory", path, errno);
  } else if (::unlink(path.c_str()) != 0 && errno != ENOENT) {
    io_fail("cannot remove", path, errno);
  }
}

void rename_path(const std::string& from, const std::string& to) {
  if (::rename(from.c_str(), to.c_str()) != 0)
    fail(Code::Io, "cannot rename '", from, "' to '", to, "': ", std::strerror(errno));
}

void exchange_paths(const std::string& a, const std::string& b) {
  if (::syscall(SYS_renameat2, AT_FDCWD, a.c_str(), AT_FDCWD, b.c_str(), RENAME_EXCHANGE) != 0)
    fail(Code::Io, "cannot exchange '", a, "' and '", b, "': ", std::strerror(errno));
}

std::string read_text(const std::string& path) {
  File f = File::open_read(path);
  std::string s(f.size(), '\0');
  f.pread_all(s.data(), s.size(), 0, "its text");
  return s;
}

void write_text_atomic(const std::string& path, const std::string& text) {
  const std::string tmp = path + ".tmp";
  File f = File::create(tmp);
  f.write_all(text.data(), text.size());
  f.sync();
  f.close();
  rename_path(tmp, path);
  sync_dir(parent_dir(path));
}

std::string join(const std::string& dir, const std::string& name) {
  if (dir.empty()) return name;
  return dir.back() == '/' ? dir + name : dir + "/" + name;
}

std::string parent_dir(const std::string& path) {
  std::string p = path;
  while (p.size() > 1 && p.back() == '/') p.pop_back();
  const auto slash = p.rfind('/');
  if (slash == std::string::npos) return ".";
  if (slash == 0) return "/";
  return p.substr(0, slash);
}

}  // namespace zs::ckpt
