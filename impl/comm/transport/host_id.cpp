#include "impl/comm/transport/host_id.h"

#include <unistd.h>

#include <cctype>
#include <cstdlib>
#include <fstream>

#include "impl/common/error.h"

namespace zs {

std::string host_id() {
  if (const char* v = std::getenv("ZS_HOST_ID"); v != nullptr && *v != '\0') {
    const std::string id(v);
    if (id.size() > kHostIdMax)
      fail(Code::Bootstrap, "environment variable ZS_HOST_ID='", id, "' is ", id.size(),
           " characters: at most ", kHostIdMax);
    for (const char c : id)
      if (!std::isalnum(static_cast<unsigned char>(c)) && std::string("._:/-").find(c) == std::string::npos)
        fail(Code::Bootstrap, "environment variable ZS_HOST_ID='", id, "': character '", c,
             "' is not allowed (letters, digits and . _ : / -)");
    return id;
  }
  std::string boot;
  std::ifstream("/proc/sys/kernel/random/boot_id") >> boot;
  if (boot.empty()) return "";
  char ns[64] = {};
  const ssize_t n = readlink("/proc/self/ns/net", ns, sizeof(ns) - 1);
  // "net:[4026531833]": the inode names the namespace.
  std::string net = n > 0 ? std::string(ns, static_cast<size_t>(n)) : std::string("net:?");
  std::string inode;
  for (const char c : net)
    if (std::isdigit(static_cast<unsigned char>(c))) inode += c;
  return boot + "/net:" + (inode.empty() ? "?" : inode);
}

}  // namespace zs
