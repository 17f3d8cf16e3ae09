// Comparing the effective configs of two ranks, key by key: what the
// context reports when ranks were started with different configs.
#include <nlohmann/json.hpp>

#include "impl/config/config.h"

namespace zs {
namespace {

using Json = nlohmann::json;

void compare(const Json& mine, const Json& other, const std::string& path,
             const std::string& where, std::vector<std::string>& out) {
  if (mine.is_object() && other.is_object()) {
    for (const auto& [key, value] : mine.items()) {
      const std::string child = path.empty() ? key : path + "." + key;
      if (path.empty() && key == "device") continue;  // one GPU per rank is the point
      auto it = other.find(key);
      if (it == other.end())
        out.push_back(child + " = " + value.dump() + " where " + where + " has none");
      else
        compare(value, *it, child, where, out);
    }
    for (const auto& [key, value] : other.items()) {
      if (path.empty() && key == "device") continue;
      if (!mine.contains(key))
        out.push_back((path.empty() ? key : path + "." + key) + " is unset where " + where + " has " +
                      value.dump());
    }
    return;
  }
  if (mine != other) out.push_back(path + " = " + mine.dump() + " where " + where + " has " + other.dump());
}

}  // namespace

std::vector<std::string> config_differences(const std::string& mine, const std::string& other,
                                            const std::string& other_name) {
  std::vector<std::string> out;
  compare(Json::parse(mine), Json::parse(other), "", other_name, out);
  return out;
}

}  // namespace zs
