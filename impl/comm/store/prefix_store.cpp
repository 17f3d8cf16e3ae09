// A view of a store with every key under "prefix/", so sub-groups can run
// their own rendezvous through the world's store without key clashes.
#include <utility>

#include "impl/comm/store/store.h"
#include "impl/common/error.h"

namespace zs {
namespace {

class PrefixStore final : public Store {
 public:
  PrefixStore(std::shared_ptr<Store> base, const std::string& prefix)
      : base_(std::move(base)), prefix_(prefix + "/") {
    timeout_ = base_->timeout();
  }

  void set(const std::string& key, const std::vector<char>& value) override {
    base_->set(prefix_ + key, value);
  }
  std::vector<char> get(const std::string& key) override { return base_->get(prefix_ + key); }
  void wait(const std::vector<std::string>& keys) override { base_->wait(prefixed(keys)); }
  void set_many(const std::vector<std::string>& keys, const std::vector<std::vector<char>>& values) override {
    base_->set_many(prefixed(keys), values);
  }
  std::vector<std::vector<char>> get_many(const std::vector<std::string>& keys) override {
    return base_->get_many(prefixed(keys));
  }
  int64_t add(const std::string& key, int64_t delta) override {
    return base_->add(prefix_ + key, delta);
  }
  bool check(const std::string& key) override { return base_->check(prefix_ + key); }
  void interrupt(const std::string& why) override { base_->interrupt(why); }
  bool server_lost() const override { return base_->server_lost(); }

 private:
  std::vector<std::string> prefixed(const std::vector<std::string>& keys) const {
    std::vector<std::string> full;
    full.reserve(keys.size());
    for (const std::string& key : keys) full.push_back(prefix_ + key);
    return full;
  }

  std::shared_ptr<Store> base_;
  std::string prefix_;
};

}  // namespace

std::unique_ptr<Store> make_prefix_store(std::shared_ptr<Store> base, const std::string& prefix) {
  if (!base) fail(Code::InvalidArgument, "prefix store '", prefix, "': base store is null");
  if (prefix.empty()) fail(Code::InvalidArgument, "prefix store: prefix is empty");
  return std::make_unique<PrefixStore>(std::move(base), prefix);
}

}  // namespace zs
