// libFuzzer target: a user's safetensors file (hostile bytes) through what
// load_pretrained and zsckpt verify read it with: the input becomes a file
// (a memfd, opened by its /proc path as any file is), read_st_header parses
// it, and read_st_elements reads each tensor, whole and a shard of it, then
// casts to fp32 as load_pretrained does.
//
// Whatever the input, the header is parsed or Code::Io is thrown with a
// message. A header that parses must describe the file exactly (tensors in
// file order, without gaps, from the end of the header to the end of the
// file, each shape's product in 128 bits matching its bytes), a read past a
// tensor must be refused, and st_header must write the same tensors back in
// a file that parses again.
#include <sys/mman.h>
#include <unistd.h>

#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <string>
#include <vector>

#include "impl/checkpoint/file_io.h"
#include "impl/checkpoint/format.h"
#include "impl/checkpoint/safetensors.h"
#include "impl/common/error.h"
#include "impl/device/device.h"
#include "impl/device/ops.h"

namespace {

using zs::ckpt::File;
using zs::ckpt::StHeader;
using zs::ckpt::StTensor;

[[noreturn]] void finding(const char* what, const std::string& detail) {
  std::fprintf(stderr, "safetensors fuzz finding: %s: %s\n", what, detail.c_str());
  std::abort();
}

void expect_io(const zs::Error& e, const char* during) {
  if (e.code() != zs::Code::Io) finding(during, std::string("error code other than Io: ") + e.what());
  if (std::string(e.what()).empty()) finding(during, "error without a message");
}

// One memfd per process, rewritten for each input; its path reads as a file.
struct MemFile {
  int fd;
  std::string path;
  MemFile() : fd(memfd_create("zs-fuzz-safetensors", 0)) {
    if (fd < 0) finding("memfd_create", "");
    path = "/proc/self/fd/" + std::to_string(fd);
  }
  void set(const void* data, size_t size) const {
    if (ftruncate(fd, 0) != 0 || (size > 0 && pwrite(fd, data, size, 0) != static_cast<ssize_t>(size)))
      finding("memfd write", "");
  }
};

const MemFile& input_file() {
  static const MemFile f;
  return f;
}

const MemFile& rewritten_file() {
  static const MemFile f;
  return f;
}

void check_sane(const StHeader& h, uint64_t size) {
  uint64_t at = h.data_begin;
  for (const StTensor& t : h.tensors) {
    if (t.begin != at) finding("a gap or an overlap", t.key);
    unsigned __int128 n = zs::dtype_size(t.dtype);
    for (int64_t d : t.shape) {
      if (d < 0) finding("negative dim", t.key);
      n *= static_cast<uint64_t>(d);
      if (n > UINT64_MAX) n = static_cast<unsigned __int128>(UINT64_MAX) + 1;  // stays unequal
    }
    if (n != t.bytes) finding("shape against bytes", t.key);
    if (t.bytes > size - at) finding("tensor past the end", t.key);
    at += t.bytes;
  }
  if (at != size) finding("trailing bytes accepted", std::to_string(size - at));
}

// What load_pretrained does with each tensor: the whole of it (rank 0
// reading for a scatter), a shard of it (one rank of two), cast to fp32.
void read_tensors(const File& f, const StHeader& h) {
  std::vector<char> raw;
  std::vector<float> f32;
  for (const StTensor& t : h.tensors) {
    const uint64_t numel = t.bytes / zs::dtype_size(t.dtype);
    for (auto [first, n] : {std::pair<uint64_t, uint64_t>{0, numel}, {numel / 2, numel - numel / 2}}) {
      raw.assign(n * zs::dtype_size(t.dtype), 0);
      zs::ckpt::read_st_elements(f, t, first, n, raw.data(), t.key);
      f32.resize(n);
      zs::ops::cast_to_f32(*zs::host_device(), raw.data(), t.dtype, f32.data(), n);
    }
    try {
      zs::ckpt::read_st_elements(f, t, numel, 1, raw.data(), t.key);
      finding("a read past the tensor was allowed", t.key);
    } catch (const zs::Error& e) {
      expect_io(e, "read_st_elements past the end");
    }
  }
}

// st_header of the parsed tensors, over zero data, must parse to them.
void check_rewrite(const StHeader& h) {
  std::vector<StTensor> tensors = h.tensors;
  const std::string header = zs::ckpt::st_header(tensors, h.metadata);
  uint64_t data = 0;
  for (const auto& t : tensors) data += t.bytes;
  std::string bytes = header;
  bytes.resize(header.size() + data, '\0');
  const MemFile& mf = rewritten_file();
  mf.set(bytes.data(), bytes.size());
  StHeader again;
  try {
    again = zs::ckpt::read_st_header(File::open_read(mf.path));
  } catch (const zs::Error& e) {
    finding("a rewritten header does not parse", e.what());
  }
  std::map<std::string, const StTensor*> want;
  for (const auto& t : h.tensors) want[t.key] = &t;
  if (again.tensors.size() != want.size() || again.metadata != h.metadata) finding("rewrite differs", "");
  for (const auto& t : again.tensors) {
    auto it = want.find(t.key);
    if (it == want.end() || it->second->dtype != t.dtype || it->second->shape != t.shape ||
        it->second->bytes != t.bytes)
      finding("rewritten tensor differs", t.key);
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const MemFile& mf = input_file();
  mf.set(data, size);
  File f;
  StHeader h;
  try {
    f = File::open_read(mf.path);
    h = zs::ckpt::read_st_header(f);
  } catch (const zs::Error& e) {
    expect_io(e, "read_st_header");
    if (std::getenv("ZS_FUZZ_VERBOSE") != nullptr) std::fprintf(stderr, "refused: %s\n", e.what());
    return 0;
  }
  check_sane(h, size);
  read_tensors(f, h);
  check_rewrite(h);
  return 0;
}
