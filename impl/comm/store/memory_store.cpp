// A store inside one process, for a world of one whose groups still run a
// real backend that rendezvouses through a store (NCCL chosen explicitly).
#include <condition_variable>
#include <map>
#include <mutex>

#include "impl/comm/store/store.h"

namespace zs {
namespace {

class MemoryStore final : public Store {
 public:
  explicit MemoryStore(std::chrono::milliseconds timeout) { timeout_ = timeout; }

  void set(const std::string& key, const std::vector<char>& value) override {
    store_detail::check_key("set", key);
    store_detail::check_value(key, value.size());
    {
      std::lock_guard<std::mutex> lock(mu_);
      data_[key] = value;
    }
    cv_.notify_all();
  }
  std::vector<char> get(const std::string& key) override {
    wait({key});
    std::lock_guard<std::mutex> lock(mu_);
    return data_.at(key);
  }
  void wait(const std::vector<std::string>& keys) override {
    std::unique_lock<std::mutex> lock(mu_);
    for (const auto& key : keys) {
      store_detail::check_key("wait", key);
      if (!cv_.wait_for(lock, timeout_, [&] { return data_.count(key) > 0; }))
        fail(Code::Timeout, "store key ", store_detail::quote_key(key), " did not appear within ",
             timeout_.count(), " ms");
    }
  }
  int64_t add(const std::string& key, int64_t delta) override {
    store_detail::check_key("add", key);
    std::lock_guard<std::mutex> lock(mu_);
    int64_t v = 0;
    auto it = data_.find(key);
    if (it != data_.end() &&
        !store_detail::parse_int64(std::string(it->second.begin(), it->second.end()), &v))
      fail(Code::InvalidArgument, "add: key ", store_detail::quote_key(key),
           " does not hold an integer");
    v += delta;
    const std::string s = std::to_string(v);
    data_[key] = std::vector<char>(s.begin(), s.end());
    cv_.notify_all();
    return v;
  }
  bool check(const std::string& key) override {
    std::lock_guard<std::mutex> lock(mu_);
    return data_.count(key) > 0;
  }

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  std::map<std::string, std::vector<char>> data_;
};

}  // namespace

std::unique_ptr<Store> make_memory_store(std::chrono::milliseconds timeout) {
  return std::make_unique<MemoryStore>(timeout);
}

}  // namespace zs
