// Parsing JSON that comes from files a user hands us (a checkpoint's
// manifest, a safetensors header): nlohmann keeps the last of two equal
// keys without a word, which would let a file say two things about one
// tensor, and copies and dumps values recursively, so an input nested
// thousands deep could exhaust the stack after it parsed. Both are refused
// here, and numbers are read strictly (nlohmann's get<int> of 1e300 is a
// float-to-int conversion out of range, and of -1 as uint64_t a wrap).
#pragma once

#include <cstdint>
#include <string>

#include <nlohmann/json.hpp>

namespace zs::ckpt {

// Code::Io "<where> is not valid JSON: ..." / "...: key 'k' appears twice" /
// "...: nested deeper than max_depth".
nlohmann::json parse_json_text(const std::string& text, const std::string& where, int max_depth);

// v must be an integer JSON number within [lo, hi]; else Code::Io naming
// where (the field) and the value.
int64_t json_int(const nlohmann::json& v, const std::string& where, int64_t lo, int64_t hi);
// v must be a non-negative integer JSON number.
uint64_t json_uint(const nlohmann::json& v, const std::string& where);

}  // namespace zs::ckpt
