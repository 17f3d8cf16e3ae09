// What the heal layer posts to and reads from the store: text, and lists
// of world ranks as "1 3 5".
#pragma once

#include <algorithm>
#include <sstream>
#include <string>
#include <vector>

namespace zs::heal {

inline std::vector<char> bytes(const std::string& s) { return std::vector<char>(s.begin(), s.end()); }
inline std::string text(const std::vector<char>& v) { return std::string(v.begin(), v.end()); }

inline std::string list(const std::vector<int>& ranks) {
  std::string s;
  for (const int r : ranks) s += (s.empty() ? "" : " ") + std::to_string(r);
  return s;
}

// A posted list, ascending.
inline std::vector<int> parse_list(const std::string& s) {
  std::vector<int> out;
  std::istringstream in(s);
  for (int r; in >> r;) out.push_back(r);
  std::sort(out.begin(), out.end());
  return out;
}

}  // namespace zs::heal
