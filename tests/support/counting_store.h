// A view of a store that counts the calls made through it and the bytes
// they read: how the tests assert what a rank asks of the store.
#pragma once

#include <atomic>
#include <cstdint>
#include <string>
#include <vector>

#include "impl/comm/store/store.h"

namespace zs::test {

// Safe to share between threads.
class CountingStore final : public zs::Store {
 public:
  explicit CountingStore(zs::Store& inner) : inner_(inner) {}
  void set(const std::string& key, const std::vector<char>& value) override {
    ++calls;
    inner_.set(key, value);
  }
  std::vector<char> get(const std::string& key) override {
    ++calls;
    auto v = inner_.get(key);
    bytes_read += v.size();
    return v;
  }
  void wait(const std::vector<std::string>& keys) override {
    ++calls;
    inner_.wait(keys);
  }
  int64_t add(const std::string& key, int64_t delta) override {
    ++calls;
    return inner_.add(key, delta);
  }
  bool check(const std::string& key) override {
    ++calls;
    return inner_.check(key);
  }
  void set_many(const std::vector<std::string>& keys, const std::vector<std::vector<char>>& values) override {
    ++calls;
    inner_.set_many(keys, values);
  }
  std::vector<std::vector<char>> get_many(const std::vector<std::string>& keys) override {
    ++calls;
    auto vs = inner_.get_many(keys);
    for (const auto& v : vs) bytes_read += v.size();
    return vs;
  }

  std::atomic<uint64_t> calls{0}, bytes_read{0};

 private:
  zs::Store& inner_;
};

}  // namespace zs::test
