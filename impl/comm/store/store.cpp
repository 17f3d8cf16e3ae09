// The Store's many-key calls, for stores that have no cheaper way: one
// set or get per key.
#include "impl/comm/store/store.h"

#include "impl/common/error.h"

namespace zs {

void Store::set_many(const std::vector<std::string>& keys, const std::vector<std::vector<char>>& values) {
  if (keys.size() != values.size())
    fail(Code::InvalidArgument, "set_many: ", keys.size(), " keys but ", values.size(), " values");
  for (size_t i = 0; i < keys.size(); ++i) set(keys[i], values[i]);
}

std::vector<std::vector<char>> Store::get_many(const std::vector<std::string>& keys) {
  std::vector<std::vector<char>> values;
  values.reserve(keys.size());
  for (const std::string& key : keys) values.push_back(get(key));
  return values;
}

}  // namespace zs
