// POSIX file access for checkpoints: every failure is Code::Io naming the
// path and the errno text, short reads are told apart from errors, and
// durability (fsync of files and of the directories that name them) is
// explicit, because a checkpoint is only safe once its directory entry is.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

namespace zs::ckpt {

class File {
 public:
  // O_RDONLY, or O_WRONLY|O_CREAT|O_TRUNC for write.
  static File open_read(const std::string& path);
  static File create(const std::string& path);
  File() = default;
  ~File();
  File(File&& o) noexcept : fd_(o.fd_), path_(std::move(o.path_)) { o.fd_ = -1; }
  File& operator=(File&& o) noexcept;
  File(const File&) = delete;
  File& operator=(const File&) = delete;

  const std::string& path() const { return path_; }
  uint64_t size() const;
  // Writes all bytes at the current end (ENOSPC and friends name the path).
  void write_all(const void* data, size_t bytes);
  // Reads exactly bytes at offset; a file that ends first is Code::Io
  // "truncated" with the size it has (what names the data wanted).
  void pread_all(void* data, size_t bytes, uint64_t offset, const std::string& what) const;
  void sync();
  void close();

 private:
  int fd_ = -1;
  std::string path_;
};

bool exists(const std::string& path);
bool is_dir(const std::string& path);
void make_dir(const std::string& path);  // EEXIST is fine
// With its missing parents (mkdir -p); whether it made `path` itself.
bool make_dirs(const std::string& path);
// fsync of a directory, so the entries created or renamed in it persist.
void sync_dir(const std::string& path);
// rm -rf; a missing path is fine.
void remove_tree(const std::string& path);
void rename_path(const std::string& from, const std::string& to);
// Atomically swaps two existing paths (renameat2 RENAME_EXCHANGE).
void exchange_paths(const std::string& a, const std::string& b);
std::string read_text(const std::string& path);
// Write text durably under path: temp file, fsync, rename, fsync the dir.
void write_text_atomic(const std::string& path, const std::string& text);
std::string join(const std::string& dir, const std::string& name);
// The names in a directory ("." and ".." left out).
std::vector<std::string> list_dir(const std::string& path);
// A file's modification time in nanoseconds since the epoch (Io if missing).
int64_t mtime_ns(const std::string& path);
std::string parent_dir(const std::string& path);

}  // namespace zs::ckpt
