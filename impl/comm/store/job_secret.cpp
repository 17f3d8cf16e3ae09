#include "impl/comm/store/job_secret.h"

#include <sodium.h>

#include <cstdlib>

#include "impl/common/error.h"

namespace zs {
namespace {

void init_sodium() {
  static const int ok = sodium_init();  // thread-safe, idempotent
  if (ok < 0) fail(Code::Internal, "libsodium could not be initialised");
}

}  // namespace

std::string job_secret() {
  const char* v = std::getenv("ZS_JOB_SECRET");
  if (v == nullptr || *v == '\0') return "";
  const std::string s(v);
  if (s.size() < kMinJobSecret)
    fail(Code::Bootstrap, "ZS_JOB_SECRET has ", s.size(), " characters: expected at least ",
         kMinJobSecret, " (zsrun makes one of 64 when it is unset)");
  return s;
}

std::string make_challenge() {
  init_sodium();
  std::string c(kChallengeBytes, '\0');
  randombytes_buf(c.data(), c.size());
  return c;
}

std::string job_proof(const std::string& secret, const std::string& context,
                      const std::string& challenge) {
  init_sodium();
  crypto_auth_hmacsha256_state st;
  crypto_auth_hmacsha256_init(&st, reinterpret_cast<const unsigned char*>(secret.data()),
                              secret.size());
  const std::string msg = context + '\0' + challenge;
  crypto_auth_hmacsha256_update(&st, reinterpret_cast<const unsigned char*>(msg.data()),
                                msg.size());
  std::string out(kProofBytes, '\0');
  crypto_auth_hmacsha256_final(&st, reinterpret_cast<unsigned char*>(out.data()));
  return out;
}

bool proofs_equal(const std::string& a, const std::string& b) {
  return a.size() == b.size() && a.size() == kProofBytes &&
         sodium_memcmp(a.data(), b.data(), a.size()) == 0;
}

}  // namespace zs
