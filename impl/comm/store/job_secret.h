// The job secret: a string every rank of one job shares (ZS_JOB_SECRET;
// zsrun makes one per launch), never sent over the network. The store asks
// each connection to prove it knows the secret (an HMAC-SHA-256 of a fresh
// challenge), and the ranks of a group prove it to each other over every
// transport pair before the first collective, so a stranger that connects
// first, to the store or to a rank's listener, is dropped and named instead
// of adopted. Without a secret nothing is checked, as before.
#pragma once

#include <string>

namespace zs {

// ZS_JOB_SECRET, or "" when unset. Throws Code::Bootstrap when set but
// shorter than kMinJobSecret characters.
constexpr size_t kMinJobSecret = 16;
std::string job_secret();

constexpr size_t kChallengeBytes = 32;
constexpr size_t kProofBytes = 32;
// kChallengeBytes from the system's random source.
std::string make_challenge();
// HMAC-SHA-256 over (context, challenge) keyed with the secret; `context`
// says who proves what to whom, so a proof is good for one purpose only.
std::string job_proof(const std::string& secret, const std::string& context,
                      const std::string& challenge);
// Constant-time comparison of two proofs.
bool proofs_equal(const std::string& a, const std::string& b);

}  // namespace zs
