// The safetensors container, written and read by our own code: 8 bytes of
// little-endian header length N, N bytes of JSON (padded with spaces to a
// multiple of 8) mapping each tensor to {dtype, shape, data_offsets} within
// the data that follows, plus "__metadata__" (string to string).
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "impl/checkpoint/file_io.h"
#include "impl/common/dtype.h"

namespace zs::ckpt {

struct StTensor {
  std::string key;
  DType dtype = DType::F32;
  std::vector<int64_t> shape;
  uint64_t bytes = 0;
  uint64_t begin = 0;  // absolute file offset, filled by st_header / read
};

// Orders tensors widest dtype first, so every tensor's data starts aligned
// to its element size (safetensors allows no gaps between tensors), lays
// them out and returns the header bytes; tensors[i].begin is filled.
std::string st_header(std::vector<StTensor>& tensors,
                      const std::map<std::string, std::string>& metadata);

struct StHeader {
  uint64_t data_begin = 0;  // 8 + N
  std::vector<StTensor> tensors;  // in file order
  std::map<std::string, std::string> metadata;
};

// Parses and checks a file's header: dtypes, shapes against byte sizes,
// offsets contiguous and within the file, no key twice (Code::Io naming
// the file and the tensor).
StHeader read_st_header(const File& f);

// Elements [first, first + n) of t (from read_st_header of f) into dst, in
// t's dtype; a range past the tensor is Code::Io naming it (name: the
// tensor's name for messages). n == 0 reads nothing, wherever first is.
void read_st_elements(const File& f, const StTensor& t, uint64_t first, uint64_t n, void* dst,
                      const std::string& name);

}  // namespace zs::ckpt
