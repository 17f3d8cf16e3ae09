#include "impl/checkpoint/json_text.h"

#include <set>
#include <vector>

#include "impl/common/error.h"

namespace zs::ckpt {

using nlohmann::json;

namespace {

// A value for a message: short, whatever it holds.
std::string shown(const json& v) {
  std::string s = v.dump();
  return s.size() > 60 ? s.substr(0, 57) + "..." : s;
}

}  // namespace

json parse_json_text(const std::string& text, const std::string& where, int max_depth) {
  // One set of keys per object being parsed, innermost last.
  std::vector<std::set<std::string>> keys;
  auto check = [&](int depth, json::parse_event_t event, json& parsed) {
    switch (event) {
      case json::parse_event_t::object_start:
      case json::parse_event_t::array_start:
        if (depth >= max_depth) fail(Code::Io, where, " is nested deeper than ", max_depth, " levels");
        if (event == json::parse_event_t::object_start) keys.emplace_back();
        break;
      case json::parse_event_t::key:
        if (!keys.back().insert(parsed.get<std::string>()).second)
          fail(Code::Io, where, ": key '", parsed.get<std::string>(), "' appears twice in one object");
        break;
      case json::parse_event_t::object_end:
        keys.pop_back();
        break;
      default:
        break;
    }
    return true;
  };
  try {
    return json::parse(text, check);
  } catch (const json::exception& e) {
    fail(Code::Io, where, " is not valid JSON: ", e.what());
  }
}

int64_t json_int(const json& v, const std::string& where, int64_t lo, int64_t hi) {
  if (!v.is_number_integer()) fail(Code::Io, where, ": ", shown(v), " is not an integer");
  // nlohmann holds a non-negative literal as unsigned, a negative one as
  // signed: each compared in its own type.
  if (v.is_number_unsigned()) {
    const uint64_t u = v.get<uint64_t>();
    if (u > static_cast<uint64_t>(hi)) fail(Code::Io, where, ": ", u, " is above ", hi);
    if (lo > 0 && u < static_cast<uint64_t>(lo)) fail(Code::Io, where, ": ", u, " is below ", lo);
    return static_cast<int64_t>(u);
  }
  const int64_t i = v.get<int64_t>();
  if (i > hi) fail(Code::Io, where, ": ", i, " is above ", hi);
  if (i < lo) fail(Code::Io, where, ": ", i, " is below ", lo);
  return i;
}

uint64_t json_uint(const json& v, const std::string& where) {
  if (!v.is_number_integer() || (!v.is_number_unsigned() && v.get<int64_t>() < 0))
    fail(Code::Io, where, ": ", shown(v), " is not a non-negative integer");
  return v.get<uint64_t>();
}

}  // namespace zs::ckpt
