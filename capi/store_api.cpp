// The rendezvous store served outside the ranks (zs_store_serve): what
// tools/zsstore runs, so that the store outlives any rank, rank 0 included
// (docs/healing.md, section 3).
#include <cstdlib>

#include "capi/handles.h"
#include "impl/comm/store/job_secret.h"
#include "impl/comm/store/tcp_store_server.h"

using namespace zs;
using namespace zs::capi;

extern "C" {

ZS_API zs_status zs_store_serve(zs_store_server* out, const char* host, int port, int* bound_port) {
  return guarded([&] {
    checked_out(out, "out");
    *out = nullptr;
    if (port < 0 || port > 65535)
      fail(Code::InvalidArgument, "store port ", port, ": expected 0 (any free port) or 1..65535");
    tcp_wire::ServerOptions options;
    if (const char* journal = std::getenv("ZS_STORE_JOURNAL"); journal && *journal) options.journal = journal;
    // A test's kill point, one failure of the job as ZS_FAULT_POINT's: not
    // armed in a job zsrun restarted whole.
    const char* attempt = std::getenv("TORCHELASTIC_RESTART_COUNT");
    if (const char* n = std::getenv("ZS_FAULT_STORE"); n && *n && !(attempt && std::atol(attempt) > 0)) {
      char* end = nullptr;
      const unsigned long long v = std::strtoull(n, &end, 10);
      if (*end != '\0' || v == 0 || n[0] == '-')
        fail(Code::InvalidArgument, "ZS_FAULT_STORE='", n, "': expected a request count >= 1");
      options.die_at_request = v;
    }
    auto server = std::make_shared<tcp_wire::Server>(host ? host : "", port, job_secret(), std::move(options));
    if (bound_port) *bound_port = server->port();
    *out = reinterpret_cast<zs_store_server>(add_handle(Kind::StoreServer, 0, std::move(server)));
  });
}

ZS_API zs_status zs_store_server_destroy(zs_store_server server) {
  if (server == nullptr) return ZS_OK;
  return guarded([&] {
    if (!take_handle(Kind::StoreServer, reinterpret_cast<uintptr_t>(server), nullptr))
      fail(Code::InvalidHandle, "server (0x", std::hex, reinterpret_cast<uintptr_t>(server), std::dec,
           ") is not a live store server handle: destroyed, or never created");
  });
}

}  // extern "C"
