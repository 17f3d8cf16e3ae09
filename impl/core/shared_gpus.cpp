#include "impl/core/shared_gpus.h"

#include <unordered_map>

namespace zs {

std::string first_shared_gpu(const std::vector<std::string>& gpus) {
  std::unordered_map<std::string, size_t> first;
  for (size_t r = 0; r < gpus.size(); ++r) {
    const std::string& id = gpus[r];
    if (id.empty() || id == "-") continue;
    const auto [at, fresh] = first.emplace(id, r);
    if (fresh) continue;
    const size_t cut = id.find('#');
    const std::string host = cut == std::string::npos ? std::string() : id.substr(0, cut);
    const std::string bus = cut == std::string::npos ? id : id.substr(cut + 1);
    return "ranks " + std::to_string(at->second) + " and " + std::to_string(r) + " share GPU " + bus +
           (host.empty() ? "" : " on " + host);
  }
  return {};
}

}  // namespace zs
