#include "impl/core/context.h"

#include <algorithm>
#include <cmath>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <set>
#include <sstream>
#include <thread>
#include <unordered_map>

#include <nlohmann/json.hpp>

#include "impl/comm/algo/mesh_peers.h"
#include "impl/comm/transport/gloo_communicator.h"
#include "impl/comm/transport/heartbeat.h"
#include "impl/comm/transport/host_id.h"
#include "impl/comm/transport/local_communicator.h"
#include "impl/comm/transport/nccl_library.h"
#include "impl/comm/transport/staged_communicator.h"
#include "impl/comm/transport/timed_communicator.h"
#ifdef ZS_WITH_CUDA
#include "impl/comm/transport/cuda/nccl_communicator.h"
#endif
#include "impl/common/env.h"
#include "impl/common/fault_point.h"
#include "impl/common/process_fence.h"
#include "impl/core/launcher_watch.h"
#include "impl/core/shared_gpus.h"

namespace zs {
namespace {

std::atomic<uint64_t> g_next_context_id{1};

std::chrono::milliseconds resolve_timeout(int timeout_ms) {
  if (timeout_ms < 0) fail(Code::InvalidArgument, "timeout_ms ", timeout_ms, ": expected >= 0");
  if (timeout_ms > 0) return std::chrono::milliseconds(timeout_ms);
  return std::chrono::milliseconds(env_int("ZS_TIMEOUT_MS", 300000));
}

// ZS_HEAL_REPLACEMENT_WAIT_S: seconds, as the config key; unset or empty: 0.
double replacement_wait_from_env() {
  const char* v = std::getenv("ZS_HEAL_REPLACEMENT_WAIT_S");
  if (v == nullptr || *v == '\0') return 0;
  char* end = nullptr;
  const double w = std::strtod(v, &end);
  if (end == v || *end != '\0' || !std::isfinite(w) || w < 0 || w > 86400)
    fail(Code::InvalidArgument, "ZS_HEAL_REPLACEMENT_WAIT_S='", v, "': expected seconds in [0, 86400] (0 or unset: "
         "the survivors shrink at once under healing.min_ranks)");
  return w;
}

// The deadline means something only where a loss may shrink, and the other
// survivors wait for the lowest one's decision within the store's timeout.
void check_replacement_wait(const Config& c, std::chrono::milliseconds timeout) {
  const double w = c.heal_replacement_wait_s;
  if (w <= 0) return;
  if (c.heal_min_ranks == 0)
    fail(Code::InvalidConfig, "zeroshard.healing.replacement_wait_s = ", w, " s is how long the survivors wait for a "
         "replacement before they shrink, but nothing lets them shrink: set zeroshard.healing.min_ranks (or run "
         "under zsrun --min-nproc M --shrink), or remove it (without min_ranks they wait for a replacement until the "
         "store's timeout)");
  if (w * 1000 >= static_cast<double>(timeout.count()))
    fail(Code::InvalidConfig, "zeroshard.healing.replacement_wait_s = ", w, " s is not below the store's timeout (",
         timeout.count(), " ms, ZS_TIMEOUT_MS), which bounds the other survivors' wait for the decision: lower it "
         "or raise ZS_TIMEOUT_MS");
}

std::string inactive_json(const std::vector<InactiveKey>& keys) {
  nlohmann::ordered_json out = nlohmann::ordered_json::array();
  for (const InactiveKey& k : keys)
    out.push_back({{"key", k.path},
                   {"value", nlohmann::ordered_json::parse(k.value)},
                   {"reason", k.reason}});
  return out.dump();
}

}  // namespace

std::shared_ptr<Context> Context::create(const ContextOptions& options) {
  std::shared_ptr<Context> ctx(new Context());
  ctx->id_ = g_next_context_id.fetch_add(1);
  ctx->ranks_ = resolve_ranks(options.rank, options.world_size, options.local_rank,
                              options.local_world_size);
  if (!options.config_json.empty() && !options.config_path.empty())
    fail(Code::InvalidArgument,
         "config_json and config_path are both set: pass the config one way only");
  // The config is checked against the world size before any socket opens,
  // so an impossible topology is refused up front on every rank.
  const int world = ctx->ranks_.world_size;
  if (!options.config_path.empty()) {
    ctx->config_ = parse_config_file(options.config_path, world);
  } else if (!options.config_json.empty()) {
    ctx->config_ = parse_config(options.config_json, world);
  } else {
    ctx->config_ = parse_config("{}", world);
  }
  // zeroshard.healing.peer_copy "auto" is on when ZS_HEAL=1 or auto;
  // resolved here, so the effective config carries what acts and the ready
  // round compares it across ranks. ZS_HEAL=auto (what zsrun --restarts exports) is on where the copy can
  // act and off, with a note, where it cannot (a config it refuses, a CUDA
  // context, an optimizer it cannot replay): a job that cannot heal still
  // runs, and its launcher restarts it from disk as before. ZS_HEAL=1
  // refuses those by name.
  const bool heal_from_env = ctx->config_.heal_peer_copy < 0;
  const char* heal_env = std::getenv("ZS_HEAL");
  ctx->heal_soft_ = heal_from_env && heal_env != nullptr && std::string(heal_env) == "auto";
  const auto heal_off = [&](std::string why) {
    const std::string strict = "on because ZS_HEAL=1";
    if (const size_t at = why.find(strict); at != std::string::npos) why.replace(at, strict.size(), "ZS_HEAL=auto");
    ctx->config_.heal_peer_copy = 0;
    ctx->heal_soft_ = false;
    if (ctx->ranks_.rank == 0)
      std::fprintf(stderr, "zeroshard: ZS_HEAL=auto leaves healing off: %s\n", why.c_str());
  };
  if (heal_from_env) ctx->config_.heal_peer_copy = ctx->heal_soft_ || env_int("ZS_HEAL", 0) != 0 ? 1 : 0;
  if (heal_from_env && ctx->config_.heal_peer_copy == 1) {
    try {
      check_healing(ctx->config_, true, world);
    } catch (const Error& e) {
      if (!ctx->heal_soft_) throw;
      heal_off(e.what());
    }
  }
  if (ctx->config_.heal_min_ranks == 0) {  // zsrun --min-nproc M --shrink
    const int64_t m = env_int("ZS_HEAL_MIN_RANKS", 0);
    if (m < 0 || m > (int64_t{1} << 20))
      fail(Code::InvalidArgument, "ZS_HEAL_MIN_RANKS=", m, ": expected a number of ranks >= 1 (0 or unset: off)");
    ctx->config_.heal_min_ranks = static_cast<int>(m);
  }
  if (ctx->config_.heal_replacement_wait_s == 0)  // zsrun --replacement-wait S
    ctx->config_.heal_replacement_wait_s = replacement_wait_from_env();
  TopologyShape shape;
  shape.rank = ctx->ranks_.rank;
  shape.world_size = ctx->ranks_.world_size;
  shape.local_world_size = ctx->ranks_.local_world_size;
  shape.mics_shard_size = static_cast<int>(ctx->config_.mics_shard_size);
  shape.mics_hierarchical = ctx->config_.mics_hierarchical_params_gather;
  shape.hpz_partition_size = static_cast<int>(ctx->config_.zero_hpz_partition_size);
  shape.quantized_gradients = ctx->config_.zero_quantized_gradients;
  Topology::check(shape);
  Context* raw = ctx.get();
  ctx->topology_ = std::make_unique<Topology>(
      shape, [raw](const std::string& name, int id, const std::vector<int>& ranks) {
        return raw->make_group(name, id, ranks);
      });
  ctx->config_json_ = config_to_json(ctx->config_);
  ctx->unused_keys_json_ = nlohmann::json(ctx->config_.unused_keys).dump();
  ctx->inactive_keys_ = zs::inactive_keys(ctx->config_);
  ctx->inactive_keys_json_ = inactive_json(ctx->inactive_keys_);
  ctx->timeout_ = resolve_timeout(options.timeout_ms);
  check_replacement_wait(ctx->config_, ctx->timeout_);
  // Malformed values are refused before any socket opens.
  ctx->host_ = host_id();
  ctx->quantize_within_host_ = env_int("ZS_QUANTIZE_WITHIN_HOST", 0) != 0;
  ctx->full_mesh_max_ = ctx->groups_full_mesh_max_ = full_mesh_max_from_env();
  ctx->trace_ = Trace::from_env(ctx->ranks_.rank);
  ctx->replacement_ = env_int("ZS_HEAL_REPLACEMENT", 0);
  if (ctx->replacement_ < 0)
    fail(Code::InvalidArgument, "ZS_HEAL_REPLACEMENT=", ctx->replacement_,
         ": expected the replacement's number for its rank id (1 for the first), or 0 for none");
  if (ctx->replacement_ > 0 && (ctx->config_.heal_peer_copy != 1 || world == 1))
    fail(Code::InvalidConfig, "ZS_HEAL_REPLACEMENT=", ctx->replacement_, " (this process replaces a lost rank ",
         ctx->ranks_.rank, ") needs zeroshard.healing.peer_copy on (or \"auto\" with ZS_HEAL=1 or auto) and a world of "
         "more than one rank; this one's peer_copy is ", ctx->config_.heal_peer_copy == 1 ? "on" : "off",
         " and its world size ", world);
  ctx->replacing_ = ctx->replacement_ > 0;
  if (const char* join = std::getenv("ZS_HEAL_JOIN"); join != nullptr && *join != '\0') {
    if (std::string(join) != "grow")
      fail(Code::InvalidArgument, "ZS_HEAL_JOIN='", join, "': expected \"grow\" (this process comes back for a rank "
           "the survivors shrank without: docs/healing.md, section 4) or unset");
    if (!ctx->replacing_)
      fail(Code::InvalidArgument, "ZS_HEAL_JOIN=grow for rank ", ctx->ranks_.rank, " needs ZS_HEAL_REPLACEMENT=<n> as "
           "well (the n-th process started for that rank id; zsrun --regrow-after sets both)");
    ctx->grow_wanted_ = true;
  }
  configure_fault_points(ctx->ranks_.rank);
  ctx->choose_device(options);
  if (ctx->config_.heal_peer_copy == 1 && ctx->device_->is_cuda() && ctx->heal_soft_)
    heal_off("the peer copy runs on CPU contexts only so far, and this one is " + ctx->device_->ref().str());
  if (ctx->config_.heal_peer_copy == 1 && ctx->device_->is_cuda())
    fail(Code::NotSupported, heal_config_key(heal_from_env), " on a CUDA context (", ctx->device_->ref().str(),
         "): the peer copy runs on CPU contexts only so far (the GPU's staging of gradients into host "
         "memory is landing step 8 of docs/healing.md); set zeroshard.healing.peer_copy false, or unset ZS_HEAL");
  ctx->connect(options);
  ctx->topology_->build();
  ctx->wait_for_every_rank();
  // After the ready round, which has compared the effective configs (and
  // so peer_copy): every rank makes it, or none.
  if (ctx->config_.heal_peer_copy == 1) ctx->topology_->make_heal();
  if (ctx->config_.heal_peer_copy == 1 && ctx->store_) ctx->post_process_identity();
  if (ctx->config_.heal_peer_copy == 1 && ctx->heartbeat_) ctx->start_loss_watch();
  return ctx;
}

// Gloo's full-mesh connect finishes on each rank in its own time: a rank can
// return from create while a peer is still reading its handshake. Waiting
// here for every rank's "ready" means create returns only once all of them
// are connected, so a rank that fails later shows up as a failed collective,
// not as a failed create on some peer.
//
// The "ready" each rank posts is its effective config: rank 0 compares every
// rank's with its own and posts a verdict that every rank waits for, so
// ranks started with different configs (a bucket size, fp16 or clipping on
// one rank only) all fail here, naming each differing key with both values,
// instead of training on with silently different numbers.
//
// The ready also carries the rank's host (host_id.h) and the environment
// variables every rank must agree on (ready_environment), and the verdict
// every rank's host, in rank order: how each group learns whether it spans
// hosts, without a request more. Ranks that disagree on such a variable
// (ZS_QUANTIZE_WITHIN_HOST would quantize different traffic) fail here as
// differing configs do.
namespace {

// "NAME=value NAME=value", as ready_environment writes it, by name.
std::map<std::string, std::string> parse_environment(const std::string& text) {
  std::map<std::string, std::string> vars;
  std::istringstream in(text);
  for (std::string item; in >> item;) {
    const size_t eq = item.find('=');
    if (eq != std::string::npos) vars[item.substr(0, eq)] = item.substr(eq + 1);
  }
  return vars;
}

// Every rank's host as the verdict carries it: the distinct hosts, one a
// line, then each rank's index among them (a host's name once, not once
// per rank: a world of 16,384 ranks on 2,048 hosts sends each rank 180 KB,
// not 800 KB).
std::string encode_hosts(const std::vector<std::string>& hosts) {
  std::unordered_map<std::string, size_t> index;
  std::string names, ranks;
  for (const std::string& h : hosts) {
    const auto [it, added] = index.try_emplace(h, index.size());
    if (added) names += h + "\n";
    ranks += (ranks.empty() ? "" : " ") + std::to_string(it->second);
  }
  return std::to_string(index.size()) + "\n" + names + ranks;
}

std::vector<std::string> decode_hosts(const std::string& text, int world_size) {
  std::istringstream in(text);
  size_t distinct = 0;
  in >> distinct;
  in.ignore(1);
  std::vector<std::string> names(distinct);
  for (auto& name : names) std::getline(in, name);
  std::vector<std::string> hosts;
  for (size_t i = 0; in >> i;) {
    if (i >= names.size()) break;
    hosts.push_back(names[i]);
  }
  if (hosts.size() != static_cast<size_t>(world_size))
    fail(Code::Internal, "the ready round's verdict names ", hosts.size(), " ranks' hosts, expected ", world_size);
  return hosts;
}

}  // namespace

std::string Context::ready_environment() const {
  return std::string("ZS_QUANTIZE_WITHIN_HOST=") + (quantize_within_host_ ? "1" : "0") +
         " ZS_FULL_MESH_MAX=" + std::to_string(full_mesh_max_);
}

std::vector<std::string> Context::environment_differences(const std::string& theirs,
                                                          const std::string& mine) {
  const auto a = parse_environment(theirs), b = parse_environment(mine);
  std::vector<std::string> diffs;
  for (const auto& [name, value] : b) {
    const auto it = a.find(name);
    const std::string their = it == a.end() ? "?" : it->second;
    if (their != value) diffs.push_back("environment " + name + "=" + their + " (rank 0: " + value + ")");
  }
  return diffs;
}

void Context::wait_for_every_rank() {
  if (!store_ || ranks_.world_size == 1) {
    learn_hosts(std::vector<std::string>(static_cast<size_t>(ranks_.world_size), host_));
    return;
  }
  if (replacing_) {
    // The survivors are not in a ready round: the first generation's
    // verdict gives the hosts (the lost rank's is taken for this one's),
    // and zs_heal_join compares the config.
    const std::vector<char> v = store_->get("zs/config_verdict");
    const std::string verdict(v.begin(), v.end());
    if (verdict.rfind("ok\n", 0) != 0)
      fail(Code::Bootstrap, "a replacement found no accepted ready round in the store: '", verdict, "'");
    learn_hosts(decode_hosts(verdict.substr(3), ranks_.world_size));
    return;
  }
  const auto as_bytes = [](const std::string& s) { return std::vector<char>(s.begin(), s.end()); };
  const std::string environment = ready_environment();
  store_->set("zs/ready/" + std::to_string(ranks_.rank),
              as_bytes(host_ + "\n" + environment + "\n" + config_json_));
  std::vector<std::string> keys;
  std::vector<int> all;
  keys.reserve(static_cast<size_t>(ranks_.world_size));
  for (int r = 0; r < ranks_.world_size; ++r) {
    keys.push_back("zs/ready/" + std::to_string(r));
    all.push_back(r);
  }
  // Rank 0 reads every ready in one request; the others only wait for them.
  std::vector<std::vector<char>> readies;
  rendezvous_with(all, "context creation (every rank's ready)", [&] {
    if (ranks_.rank == 0)
      readies = store_->get_many(keys);
    else
      store_->wait(keys);
  });
  constexpr int kRanksShown = 4;
  constexpr size_t kKeysShown = 6;
  if (ranks_.rank == 0) {
    std::string verdict;
    std::vector<std::string> hosts{host_};
    int differing = 0;
    for (int r = 1; r < ranks_.world_size; ++r) {
      const std::vector<char>& ready = readies[static_cast<size_t>(r)];
      // host \n environment \n config
      const std::string theirs(ready.begin(), ready.end());
      const size_t cut = theirs.find('\n');
      const size_t cut2 = cut == std::string::npos ? cut : theirs.find('\n', cut + 1);
      hosts.push_back(theirs.substr(0, cut));
      auto diffs = config_differences(
          cut2 == std::string::npos ? std::string() : theirs.substr(cut2 + 1), config_json_, "rank 0");
      const auto env_diffs = environment_differences(
          cut2 == std::string::npos ? std::string() : theirs.substr(cut + 1, cut2 - cut - 1), environment);
      diffs.insert(diffs.begin(), env_diffs.begin(), env_diffs.end());
      if (diffs.empty()) continue;
      if (++differing > kRanksShown) continue;
      verdict += (verdict.empty() ? "" : "; ") + std::string("rank ") + std::to_string(r) + " has ";
      for (size_t i = 0; i < diffs.size() && i < kKeysShown; ++i)
        verdict += (i ? ", " : "") + diffs[i];
      if (diffs.size() > kKeysShown) verdict += ", and " + std::to_string(diffs.size() - kKeysShown) + " more keys";
    }
    if (differing > kRanksShown)
      verdict += "; and " + std::to_string(differing - kRanksShown) + " more ranks";
    store_->set("zs/config_verdict", as_bytes(verdict.empty() ? "ok\n" + encode_hosts(hosts) : verdict));
  }
  store_->wait({"zs/config_verdict"});
  const std::vector<char> v = store_->get("zs/config_verdict");
  const std::string verdict(v.begin(), v.end());
  if (verdict.rfind("ok\n", 0) != 0)
    fail(Code::InvalidConfig,
         "the ranks' effective configs differ (every rank must be given the same config): ", verdict);
  const std::vector<std::string> hosts = decode_hosts(verdict.substr(3), ranks_.world_size);
  learn_hosts(hosts);
}

// Quantizing (qwZ, qgZ) pays only on traffic that crosses hosts; where the
// whole job is on one host a quantization key the config sets moves nothing
// and is listed with the inactive keys, saying why.
void Context::learn_hosts(const std::vector<std::string>& hosts) {
  topology_->set_hosts(hosts);
  if (ranks_.world_size == 1 || quantize_within_host_ || topology_->host_count() > 1) return;
  const std::string why =
      "every rank of this job is on one host, where traffic moves at memory speed and is not "
      "worth quantizing (ZS_QUANTIZE_WITHIN_HOST=1 quantizes it anyway)";
  const std::pair<const char*, bool> keys[] = {
      {"zero_optimization.zero_quantized_weights", config_.zero_quantized_weights},
      {"zero_optimization.zero_quantized_gradients", config_.zero_quantized_gradients}};
  for (const auto& [key, on] : keys)
    if (on) inactive_keys_.push_back({key, "true", why});
  inactive_keys_json_ = inactive_json(inactive_keys_);
}

bool Context::quantizes(const Group& group) const {
  return quantize_within_host_ || topology_->spans_hosts(group);
}

void Context::connect(const ContextOptions& options) {
  watch_launcher();
  if (ranks_.world_size == 1) {
    // No sockets, unless NCCL was asked for by name: then even a world of
    // one runs it (through a store in this process), which is how NCCL is
    // proved on a machine with one GPU.
    if (nccl_for_one_) store_ = make_memory_store(timeout_);
    topology_->make_world();
    return;
  }
  // Read before any socket opens: a bad value fails every rank alike.
  const auto period = heartbeat_period();
  const auto limit = period.count() > 0 ? heartbeat_limit() : std::chrono::milliseconds(0);
  if (!options.file_store_path.empty()) {
    store_ = make_file_store(options.file_store_path, timeout_);
  } else {
    const StoreAddress addr = resolve_store_address(
        options.store_host.empty() ? nullptr : options.store_host.c_str(), options.store_port);
    store_address_ = addr.host + ":" + std::to_string(addr.port);
    // ZS_STORE_SERVER=external: a process of its own serves the store
    // (tools/zsstore, zs_store_serve; zsrun --restarts starts one), and
    // rank 0 is a client like the others, so its loss leaves the store.
    const char* server = std::getenv("ZS_STORE_SERVER");
    const std::string where = server ? server : "";
    if (!where.empty() && where != "external" && where != "rank0")
      fail(Code::InvalidArgument, "ZS_STORE_SERVER='", where, "': expected \"external\" (a process of its own "
           "serves the store, e.g. tools/zsstore) or \"rank0\" (the default: rank 0 serves it)");
    external_store_ = where == "external";
    if (replacing_ && ranks_.rank == 0 && !external_store_)
      fail(Code::NotSupported, "ZS_HEAL_REPLACEMENT=", replacement_, " for rank 0: rank 0 served the job's store (",
           store_address_, "), which was lost with it; a replacement of rank 0 needs an external store "
           "(ZS_STORE_SERVER=external with tools/zsstore, as zsrun --restarts runs it)");
    // An external store (zsstore) is started again by zsrun if it dies:
    // calls it cut short resend to the next one.
    store_ = make_tcp_store(addr.host, addr.port, ranks_.rank == 0 && !external_store_, timeout_, nullptr,
                            "rank " + std::to_string(ranks_.rank), external_store_);
    tcp_store_ = true;
  }
  if (replacing_) find_generation();
  check_store_is_fresh(options);
  const std::string store_host = options.store_host.empty()
                                     ? resolve_store_address(nullptr, options.store_port).host
                                     : options.store_host;
  const std::string transport_host = resolve_transport_host(
      options.transport_host.empty() ? nullptr : options.transport_host.c_str(), store_host);
  transport_ = make_gloo_device(transport_host);
  if (period.count() > 0) {
    heartbeat_ = std::make_shared<Heartbeat>(ranks_.rank, ranks_.world_size, transport_host,
                                             *store_, period, limit, key_prefix());
    // A stopped rank 0 never answers the store: a call waiting on it (a
    // collective's identity check, a goodbye) ends instead of holding the
    // store's lock until the timeout.
    if (store_served_by_rank0() && ranks_.rank != 0)
      store_server_watch_ = heartbeat_->watch({0}, [store = store_.get()](const std::string& why) {
        store->interrupt(why + ", and it serves the store");
      });
  }
  if (replacing_ && heartbeat_) await_heal_decision();
  if (growing_) claim_arrival();  // its heartbeat address posted in the generation it joins
  agree_on_backend();
  // A replacement beats from the start: the survivors readmitted it before
  // they reconnect, and judge it from then on.
  if (heartbeat_ && replacing_) heartbeat_->start(*store_, regrow_absent_);
  topology_->make_world();
  if (heartbeat_ && !replacing_) heartbeat_->start(*store_);
}

// options.device, else the config's "device", else ZS_DEVICE, else the GPU
// of this rank's LOCAL_RANK when there is one, else the host. Backend:
// options.backend or ZS_BACKEND, else NCCL for a GPU when libnccl loads,
// else Gloo (staging GPU memory through pinned host memory).
void Context::choose_device(const ContextOptions& options) {
  DeviceRef ref;
  if (!options.device.empty()) {
    ref = parse_device(options.device, "context option device");
  } else if (!config_.device.empty()) {
    ref = parse_device(config_.device, "config key device");
  } else if (const char* env = std::getenv("ZS_DEVICE"); env && *env) {
    ref = parse_device(env, "ZS_DEVICE");
  } else if (const int gpus = cuda_device_count(); gpus > 0) {
    ref = {DeviceKind::Cuda, std::max(ranks_.local_rank, 0) % gpus};
  }
  device_ = open_device(ref);
  stage_all_ = env_int("ZS_STAGE_ALL", 0) != 0;

  std::string backend = options.backend;
  const char* backend_what = "context option backend";
  if (backend.empty()) {
    const char* env = std::getenv("ZS_BACKEND");
    backend = env ? env : "";
    backend_what = "ZS_BACKEND";
  }
  if (backend.empty()) {
    backend_ = ref.is_cuda() && nccl_available(nullptr) ? Backend::Nccl : Backend::Gloo;
    backend_defaulted_ = true;
  } else if (backend == "gloo") {
    backend_ = Backend::Gloo;
  } else if (backend == "nccl") {
    if (!ref.is_cuda())
      fail(Code::InvalidArgument, backend_what, " \"nccl\" needs a CUDA device, but the device is ",
           ref.str());
    std::string why;
    if (!nccl_available(&why)) fail(Code::NotSupported, backend_what, " \"nccl\": ", why);
    backend_ = Backend::Nccl;
    nccl_for_one_ = true;
  } else {
    fail(Code::InvalidArgument, backend_what, " \"", backend, "\": expected \"gloo\" or \"nccl\"");
  }
}

// A store that this rank number joined before belongs to an earlier job:
// its keys (peers' addresses, verdicts) would be read as this job's, and
// the rendezvous would wait out the timeout or meet processes long gone.
// Each rank counts its joins; a second is refused at once. A job that ends
// with every rank destroying its context leaves a file store empty
// (finalize_store), so only an unfinished job's directory is refused.
void Context::check_store_is_fresh(const ContextOptions& options) {
  const std::string rank = std::to_string(ranks_.rank);
  if (store_->add(key_prefix() + "joined/" + rank, 1) == 1) {
    store_joined_ = true;
    return;
  }
  if (!options.file_store_path.empty())
    fail(Code::Bootstrap, "file store '", options.file_store_path, "' was joined by a rank ", rank,
         " before: it holds the keys of an earlier job that did not finish (a rank died or did "
         "not destroy its context), or two processes were started as rank ",
         rank, "; empty the directory or give each job its own");
  fail(Code::Bootstrap, "the store at ", store_address_, " was joined by a rank ", rank,
       " before: it is an earlier job's store (that job's rank 0 still runs and holds the port), "
       "or two processes were started as rank ",
       rank, "; stop that job or choose a free port");
}

// Every rank must run the same backend, or the first collective would hang:
// each compares its choice with rank 0's through the store. Groups connect
// by rank 0's ZS_FULL_MESH_MAX (which pairs, which algorithms), so that a
// rank given another value still connects and fails in the ready round
// with the others, naming it, instead of leaving them waiting for pairs.
//
// NCCL refuses two ranks on one GPU, so each rank posts its GPU (host and
// PCI bus id) and rank 0, where it defaulted to NCCL, turns to Gloo for
// every rank when two share one; a rank that also defaulted follows it,
// one that named NCCL is refused with the pair that share.
void Context::agree_on_backend() {
  char mine = backend_ == Backend::Nccl ? 'n' : 'g';
  const std::string key = "zs/backend";
  const std::string gpu = device_->is_cuda() ? host_ + "#" + cuda_device_pci_bus_id(device_->ref().ordinal) : "-";
  store_->set("zs/gpu/" + std::to_string(ranks_.rank), std::vector<char>(gpu.begin(), gpu.end()));
  std::string shared;
  if (ranks_.rank == 0) {
    if (mine == 'n') {
      std::vector<std::string> keys, gpus;
      for (int r = 0; r < ranks_.world_size; ++r) keys.push_back("zs/gpu/" + std::to_string(r));
      for (const auto& v : store_->get_many(keys)) gpus.emplace_back(v.begin(), v.end());
      shared = first_shared_gpu(gpus);
      if (!shared.empty() && backend_defaulted_) {
        backend_ = Backend::Gloo;
        mine = 'g';
      }
    }
    const std::string value = mine + std::to_string(full_mesh_max_) + "\n" + shared;
    store_->set(key, std::vector<char>(value.begin(), value.end()));
  }
  const auto raw = store_->get(key);
  const std::string theirs(raw.begin(), raw.end());
  const size_t cut = theirs.find('\n');
  if (ranks_.rank != 0) shared = cut == std::string::npos ? "" : theirs.substr(cut + 1);
  if (!theirs.empty() && theirs[0] == 'g' && mine == 'n' && backend_defaulted_ && !shared.empty()) {
    backend_ = Backend::Gloo;
    mine = 'g';
  }
  if (mine == 'n' && !shared.empty())
    fail(Code::Bootstrap, "NCCL cannot run two ranks on one GPU, and ", shared,
         ": give each rank its own GPU (LOCAL_RANK picks it), or run Gloo (ZS_BACKEND=gloo), which "
         "stages GPU memory through pinned host memory");
  if (theirs.empty() || theirs[0] != mine)
    fail(Code::Bootstrap, "rank ", ranks_.rank, " would run its collectives over ",
         mine == 'n' ? "nccl" : "gloo", " but rank 0 over ",
         !theirs.empty() && theirs[0] == 'n' ? "nccl" : "gloo",
         ": give every rank the same device kind and backend (ZS_BACKEND)");
  groups_full_mesh_max_ = std::atoi(theirs.substr(1, cut == std::string::npos ? std::string::npos : cut - 1).c_str());
  if (groups_full_mesh_max_ < 1)
    fail(Code::Bootstrap, "rank 0's ZS_FULL_MESH_MAX as read from the store is not a number >= 1");
}

std::unique_ptr<Communicator> Context::make_communicator(const std::string& name, int id,
                                                         const std::vector<int>& ranks, int my) {
  std::unique_ptr<Communicator> comm;
  if (my >= 0 && ranks.size() == 1 && !nccl_for_one_) {
    comm = make_local_communicator(device_);
  } else if (my >= 0) {
    std::shared_ptr<Store> prefixed = make_prefix_store(store_, key_prefix() + "group" + std::to_string(id));
    const int size = static_cast<int>(ranks.size());
    BackendMemory side = BackendMemory::Host;
#ifdef ZS_WITH_CUDA
    if (backend_ == Backend::Nccl) {
      // The unique id travels through the store: a silent member ends that
      // wait (rendezvous_with), and NCCL's own init and every collective,
      // polled, ask the heartbeat about the members too. The world group is
      // made before the heartbeat starts (Heartbeat::start), so no member
      // counts as silent during its init, which stays bounded by its
      // timeout; its collectives, later, are checked.
      std::function<std::string()> silent_member;
      if (heartbeat_)
        silent_member = [heartbeat = heartbeat_, ranks] { return heartbeat->silence(ranks); };
      rendezvous_with(ranks, "creating group '" + name + "'", [&] {
        comm = make_nccl_communicator(name, my, size, *prefixed, device_->ref().ordinal,
                                      device_->stream(), timeout_, silent_member);
      });
      side = BackendMemory::Device;
    }
#endif
    if (!comm)
      rendezvous_with(ranks, "creating group '" + name + "'", [&] {
        comm = make_gloo_communicator(name, my, size, *prefixed, transport_, timeout_, prefixed,
                                      heartbeat_, ranks, groups_full_mesh_max_);
      });
    // Buffers on the other side of the backend (GPU memory for Gloo, host
    // scalars for NCCL) are staged; a CPU context has nothing to stage.
    if (device_->is_cuda() || stage_all_)
      comm = make_staged_communicator(std::move(comm), device_, side, stage_all_);
  }
  if (comm) comm = make_timed_communicator(std::move(comm), comm_stats_, trace_, name);
  return comm;
}

std::shared_ptr<Group> Context::make_group(const std::string& name, int id,
                                           const std::vector<int>& ranks) {
  const auto it = std::find(ranks.begin(), ranks.end(), ranks_.rank);
  const int my = it == ranks.end() ? -1 : static_cast<int>(it - ranks.begin());
  std::unique_ptr<Communicator> comm = make_communicator(name, id, ranks, my);
  auto group = std::make_shared<Group>(name, ranks, my, std::move(comm),
                                       [this](Code& c, const std::string& m) {
                                         // Healing: a collective cut short by a
                                         // lost rank (or by a survivor that
                                         // failed first) is the loss.
                                         if (std::string note; as_loss(c, m, &note)) return note;
                                         // A silent peer is named already, and
                                         // may be rank 0 that serves the store.
                                         std::string note =
                                             silence().empty() ? departed_note() : "";
                                         record_async_error(c, m + note);
                                         return note;
                                       });
  return group;
}

std::shared_ptr<Group> Context::create_group(const std::vector<int>& ranks) {
  topology_->validate_group(ranks);
  check_async_error();
  const auto held = lock();
  return topology_->create_group(ranks);
}

bool Context::as_loss(Code& code, const std::string& message, std::string* note) {
  if (!heals() || (code != Code::Comm && code != Code::Timeout)) return false;
  end_if_fenced();  // the peers closed their pairs because they healed without this rank
  std::string why;
  if (await_loss(loss_grace(), &why).empty()) return false;
  code = Code::RankLost;
  *note = message.find(why) == std::string::npos ? "; " + why : "";
  record_async_error(code, message + *note);
  return true;
}

void Context::record_async_error(Code code, const std::string& message) {
  std::lock_guard<std::mutex> lock(error_mu_);
  const bool consequence = async_code_ == Code::Comm || async_code_ == Code::Timeout;
  const bool replaces = (code == Code::RankLost && consequence) ||
                        (code == Code::StateLost && (consequence || async_code_ == Code::RankLost ||
                                                     async_code_ == Code::InvalidState));
  if (async_code_ != Code::Ok && !replaces) return;
  async_code_ = code;
  async_message_ = message;
}

bool Context::async_error(Code* code, std::string* message) const {
  std::lock_guard<std::mutex> lock(error_mu_);
  if (async_code_ == Code::Ok) return false;
  *code = async_code_;
  *message = async_message_;
  return true;
}

void Context::check_async_error() const {
  Code code;
  std::string message;
  if (async_error(&code, &message))
    throw Error(code, "the context failed earlier and refuses new work: " + message);
}

void Context::gave_up_on_goodbyes(const std::string& why) const {
  std::fprintf(stderr, "zeroshard: rank %d: destroy does not wait for every rank's goodbye: %s\n",
               ranks_.rank, why.c_str());
}

// Rank 0 serves the store: it stays up until every rank has said goodbye
// (or the timeout passes), so no peer loses the store while still using it.
//
// A stopped peer keeps its connection open: rank 0 stops waiting once the
// heartbeat finds one silent, and the others do not wait on a stopped rank
// 0 for their goodbye (store_server_watch_ ends the call; rank 0 sees their
// connections close either way).
void Context::finalize_store() {
  // A store refused as an earlier job's is left as it was: no goodbye
  // counted there, nothing removed.
  if (!store_joined_) return;
  if (store_ && !tcp_store_ && ranks_.world_size > 1) {
    // A file store outlives the job: the last rank to leave empties it,
    // since every other rank is past its last use of it.
    try {
      if (store_->add("zs/finalize", 1) == ranks_.world_size) store_->discard();
    } catch (const Error&) {
    }
    return;
  }
  if (!store_ || !tcp_store_) return;
  // A goodbye to a server that exited would only retry connecting until the
  // timeout (3 s in a test, 300 by default) before the process can exit.
  if (store_->server_lost()) {
    if (!external_store_) gave_up_on_goodbyes("the store's server (rank 0) has exited");
    return;
  }
  if (external_store_) {
    // The store outlives every rank: nobody waits for the others' goodbyes.
    try {
      store_->add("zs/finalize", 1);
    } catch (const Error&) {
    }
    return;
  }
  try {
    if (ranks_.rank != 0)
      if (const std::string why = silence({0}); !why.empty()) return gave_up_on_goodbyes(why);
    store_->add("zs/finalize", 1);
    if (ranks_.rank != 0) return;
    // Until every rank said goodbye, or no peer is connected any more (the
    // others closed their clients after their goodbye, or died): a dead
    // peer does not hold destroy for the whole timeout.
    const auto deadline = std::chrono::steady_clock::now() + timeout_;
    while (store_->add("zs/finalize", 0) < ranks_.world_size &&
           store_->clients_connected() != 1 && std::chrono::steady_clock::now() < deadline) {
      if (const std::string why = silence(); !why.empty()) return gave_up_on_goodbyes(why);
      std::this_thread::sleep_for(std::chrono::milliseconds(2));
    }
  } catch (const Error&) {
    // The server is gone, a peer died, or a stopped rank 0 did not answer.
  }
}

// A member already silent fails at once; one that falls silent meanwhile
// interrupts the store call in flight (the heartbeat thread calls back
// after each check that finds it silent, so a call that starts after one
// interrupt is interrupted again). Other threads' store calls cut short
// meanwhile (a collective watch's notes) are best effort anyway.
void Context::rendezvous_with(const std::vector<int>& ranks, const std::string& what,
                              const std::function<void()>& fn) {
  if (!heartbeat_ || !store_) return fn();
  if (const std::string why = heartbeat_->silence(ranks); !why.empty())
    fail(Code::Comm, why, "; ", what, " cannot complete");
  const auto watching = heartbeat_->watch(ranks, [store = store_.get(), what](const std::string& why) {
    store->interrupt(why + "; " + what + " cannot complete");
  });
  fn();
}

std::string Context::silence(std::vector<int> ranks) const {
  if (!heartbeat_) return "";
  if (ranks.empty())
    for (int r = 0; r < ranks_.world_size; ++r) ranks.push_back(r);
  return heartbeat_->silence(ranks);
}

// Which ranks' store connections closed (they died, or left), to name them
// in a failed collective's message: one read of the store's list of
// departures (kGoneKey), whatever the world size. The store may see a close
// a moment after the transport does, so it looks a few times before giving up.
std::string Context::departed_note() {
  if (!tcp_store_ || !store_) return "";
  for (int attempt = 0; attempt < 5; ++attempt) {
    std::set<int> gone;
    try {
      if (store_->check(kGoneKey)) {
        const std::vector<char> list = store_->get(kGoneKey);
        std::istringstream lines(std::string(list.begin(), list.end()));
        for (std::string who; std::getline(lines, who);) {
          int r = -1;
          if (std::sscanf(who.c_str(), "rank %d", &r) == 1 && r >= 0 && r < ranks_.world_size &&
              r != ranks_.rank)
            gone.insert(r);
        }
      }
    } catch (const Error&) {
      return ranks_.rank == 0 ? ""
                              : "; rank 0, which serves the store, is unreachable: it may have died";
    } catch (const std::exception&) {
      return "";  // only a note: the failure itself is reported either way
    }
    if (!gone.empty()) {
      std::string names;
      for (const int r : gone) names += (names.empty() ? "" : ", ") + std::to_string(r);
      const bool many = gone.size() > 1;
      return std::string("; rank") + (many ? "s " : " ") + names + (many ? " are" : " is") +
             " gone (its connection to the store closed: the process died or exited)";
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(200));
  }
  return "";
}

// The heartbeat's callback only signals; this thread acts, once per new
// set of lost ranks: the error every later call gets, every group's
// collective in flight ended, the store call in flight interrupted.
void Context::start_loss_watch() {
  heals_.store(true);
  loss_thread_ = std::thread([this] { loss_loop(); });
  loss_sub_ = std::shared_ptr<Heartbeat::Subscription>(
      heartbeat_->on_loss([this](const std::vector<int>& lost, const std::string& sentence) {
        std::lock_guard<std::mutex> held(loss_mu_);
        std::vector<int> all = lost_;
        all.insert(all.end(), lost.begin(), lost.end());
        std::sort(all.begin(), all.end());
        all.erase(std::unique(all.begin(), all.end()), all.end());
        if (all == lost_) return;
        std::string names;
        for (const int r : all) names += (names.empty() ? "" : ", ") + std::to_string(r);
        lost_why_ = (all.size() > 1 ? "ranks " + names + " are lost: " : "rank " + names + " is lost: ") +
                    sentence;
        lost_ = std::move(all);
        loss_cv_.notify_all();
      }));
}

void Context::loss_loop() {
  std::unique_lock<std::mutex> lock(loss_mu_);
  for (;;) {
    loss_cv_.wait(lock, [&] { return loss_stop_ || lost_ != lost_handled_; });
    if (loss_stop_) return;
    lost_handled_ = lost_;
    const std::string why = lost_why_;
    lock.unlock();
    record_async_error(Code::RankLost, why);
    topology_->abort(Code::RankLost, why);
    if (store_) store_->interrupt(why);
    lock.lock();
    lost_acted_ = lost_handled_;
    loss_cv_.notify_all();
  }
}

std::vector<int> Context::lost_ranks(std::string* why) const {
  std::lock_guard<std::mutex> held(loss_mu_);
  if (why) *why = lost_why_;
  return lost_;
}

std::vector<int> Context::await_loss(std::chrono::milliseconds within, std::string* why) const {
  std::unique_lock<std::mutex> lock(loss_mu_);
  loss_cv_.wait_for(lock, within, [&] { return loss_stop_ || !lost_.empty(); });
  if (why) *why = lost_why_;
  return lost_;
}

std::vector<int> Context::settle_loss(std::chrono::milliseconds within, std::string* why,
                                      const std::vector<int>& known) const {
  std::unique_lock<std::mutex> lock(loss_mu_);
  loss_cv_.wait_for(lock, within,
                    [&] { return loss_stop_ || (!lost_.empty() && lost_ != known && lost_acted_ == lost_); });
  if (why) *why = lost_why_;
  return lost_;
}

// A dead rank's silence is judged after the limit, plus a tick or two of
// the heartbeat thread; twice the limit leaves room for a loaded machine.
std::chrono::milliseconds Context::loss_grace() const {
  return heartbeat_ ? 2 * heartbeat_->limit() + std::chrono::milliseconds(500) : std::chrono::milliseconds(0);
}

std::string Context::key_prefix_of(int64_t generation) {
  return generation == 0 ? std::string("zs/") : "zs/gen" + std::to_string(generation) + "/";
}

namespace {
// How many times rank `rank` was lost (its replacements' count).
std::string losses_key(int rank) { return "zs/heal/rank" + std::to_string(rank) + "/losses"; }

std::string loss_key(int rank, int64_t n) {
  return "zs/heal/rank" + std::to_string(rank) + "/loss" + std::to_string(n);
}
}  // namespace

void Context::find_generation() {
  const std::string key = loss_key(ranks_.rank, replacement_);
  std::vector<char> raw;
  try {
    raw = store_->get(key);
  } catch (const Error& e) {
    fail(e.code(), "replacement ", replacement_, " of rank ", ranks_.rank, " (ZS_HEAL_REPLACEMENT) waited for the "
         "survivors to post its generation under '", key, "': ", e.what(), "; were ", replacement_,
         " losses of rank ", ranks_.rank, " agreed by the survivors (zs_heal_agree, then zs_heal_join)?");
  }
  const std::string text(raw.begin(), raw.end());
  if (text == "shrunk" && grow_wanted_) return await_regrow();
  if (text == "shrunk")
    fail(Code::NotTaken, "replacement ", replacement_, " of rank ", ranks_.rank, " (ZS_HEAL_REPLACEMENT): the "
         "survivors went on without rank ", ranks_.rank, " (they shrank in memory: zeroshard.healing.min_ranks, or "
         "zsrun --min-nproc M --shrink, at once or past healing.replacement_wait_s), so this replacement is not "
         "taken and has nothing to do (exit with ZS_EXIT_NOT_TAKEN)");
  char* end = nullptr;
  const long long g = std::strtoll(text.c_str(), &end, 10);
  if (g < 1 || end == text.c_str() || *end != '\0')
    fail(Code::Bootstrap, "the store's '", key, "' holds '", text, "', not a generation >= 1");
  generation_ = g;
}

std::string Context::heal_decision_key(int64_t generation) { return key_prefix_of(generation) + "heal/decision"; }

void Context::await_heal_decision() {
  const double wait_s = config_.heal_replacement_wait_s;
  // With a deadline, min_ranks is set (check_replacement_wait); a joiner
  // find_generation admitted has its answer already.
  if (wait_s <= 0 || growing_) return;
  const std::string key = heal_decision_key(generation_);
  std::vector<char> raw;
  try {
    raw = store_->get(key);
  } catch (const Error& e) {
    fail(e.code(), "replacement ", replacement_, " of rank ", ranks_.rank, " (ZS_HEAL_REPLACEMENT) waited for the "
         "survivors' decision under '", key, "' (zeroshard.healing.replacement_wait_s = ", wait_s, " s): ", e.what());
  }
  const std::string decision(raw.begin(), raw.end());
  if (decision == "join") return;
  if (decision == "shrink" && grow_wanted_) {
    await_regrow();
    heartbeat_->republish(*store_, key_prefix());
    return;
  }
  if (decision == "shrink")
    fail(Code::NotTaken, "replacement ", replacement_, " of rank ", ranks_.rank, " (ZS_HEAL_REPLACEMENT) came too "
         "late: the survivors waited zeroshard.healing.replacement_wait_s = ", wait_s, " s for it and went on "
         "without rank ", ranks_.rank, " (they shrank in memory: healing.min_ranks ", config_.heal_min_ranks,
         "), so it has nothing to do (exit with ZS_EXIT_NOT_TAKEN); raise the deadline for replacements that start "
         "slower than that");
  fail(Code::Bootstrap, "the store's '", key, "' holds '", decision, "', not join or shrink");
}

std::string Context::regrow_admission_key(int rank, int64_t incarnation) {
  return "zs/heal/rank" + std::to_string(rank) + "/grow" + std::to_string(incarnation);
}

std::string Context::regrow_request_key(int64_t k) { return "zs/heal/grow/request" + std::to_string(k); }

int64_t Context::losses_of(int rank) { return store_->add(losses_key(rank), 0); }

void Context::await_regrow() {
  const std::string mine = std::to_string(ranks_.rank) + " " + std::to_string(replacement_);
  store_->set(regrow_request_key(store_->add(kRegrowRequests, 1)), std::vector<char>(mine.begin(), mine.end()));
  const std::string key = regrow_admission_key(ranks_.rank, replacement_);
  // The answer, or the survivors' end (kRegrowEnded: they set it before
  // they answer the requests left, so one of the two comes).
  std::string text;
  try {
    const auto deadline = std::chrono::steady_clock::now() + timeout_;
    for (;;) {
      fault_point("grow_wait");
      if (store_->check(key)) {
        const std::vector<char> raw = store_->get(key);
        text.assign(raw.begin(), raw.end());
        break;
      }
      if (store_->check(kRegrowEnded)) {
        text = "ended";
        break;
      }
      if (std::chrono::steady_clock::now() >= deadline)
        fail(Code::Timeout, "no answer within the store's timeout (", timeout_.count(), " ms)");
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
  } catch (const Error& e) {
    fail(e.code(), "rank ", ranks_.rank, " (ZS_HEAL_JOIN=grow, ZS_HEAL_REPLACEMENT=", replacement_, ") asked the "
         "survivors to grow back and waited for their answer under '", key, "': ", e.what(), "; they answer at "
         "their next optimizer step");
  }
  if (text == "ended")
    fail(Code::NotTaken, "rank ", ranks_.rank, " (ZS_HEAL_JOIN=grow): the survivors finished their run before they "
         "could take this process back, so it has nothing to do (exit with ZS_EXIT_NOT_TAKEN)");
  if (text.rfind("refused: ", 0) == 0)
    fail(Code::NotTaken, "rank ", ranks_.rank, " (ZS_HEAL_JOIN=grow): the survivors do not take this process back: ",
         text.substr(9), "; the run goes on without it (exit with ZS_EXIT_NOT_TAKEN)");
  char* end = nullptr;
  const long long g = std::strtoll(text.c_str(), &end, 10);
  if (g <= generation_ || end == text.c_str() || *end != '\0')
    fail(Code::Bootstrap, "the store's '", key, "' holds '", text, "', not a generation after ", generation_);
  // The ranks live in the generation it joins (a shrink may have left
  // others out that do not come back now): its world and heartbeat.
  std::vector<int> live;
  {
    const std::vector<char> raw = store_->get(key_prefix_of(g) + "heal/live");
    std::istringstream in(std::string(raw.begin(), raw.end()));
    for (int r; in >> r;) live.push_back(r);
  }
  fault_point("grow_arrive");
  topology_->start_live(live);
  regrow_absent_.clear();
  for (int r = 0; r < ranks_.world_size; ++r)
    if (!std::binary_search(live.begin(), live.end(), r)) regrow_absent_.push_back(r);
  generation_ = g;
  growing_ = true;
}

// A joiner stopped or starved past the survivors' arrival deadline (its
// answer read, its claim not yet made) finds that they went on without it,
// rather than wait for their addresses in a generation they left.
void Context::claim_arrival() {
  if (store_->add(arrival_key(generation_, ranks_.rank, replacement_), 1) == 1) return;
  fail(Code::NotTaken, "rank ", ranks_.rank, " (ZS_HEAL_JOIN=grow, ZS_HEAL_REPLACEMENT=", replacement_, ") was "
       "admitted into generation ", generation_, " but arrived after the survivors stopped waiting for it (it was "
       "stopped or starved between their answer and its heartbeat); they went on without it and count it lost, so "
       "it has nothing to do (exit with ZS_EXIT_NOT_TAKEN); the next process for rank ", ranks_.rank,
       " may ask again");
}

namespace {
std::string process_key(int rank, int64_t incarnation) {
  return "zs/heal/process/" + std::to_string(rank) + "/" + std::to_string(incarnation);
}
}  // namespace

void Context::post_process_identity() {
  const std::string id = process_identity();
  store_->set(process_key(ranks_.rank, replacement_), std::vector<char>(id.begin(), id.end()));
}

// After the agreement, rank r's process may still live: stopped, or starved
// past the heartbeat's limit. Taken for lost, it must not come back into a
// run that healed without it (its stale state, its messages), nor hold a
// launcher that waits for it to exit: it is killed here when it runs on this
// host (a launcher that heals then starts its replacement). Its incarnation
// `incarnation` is the lost process's replacement number.
void Context::fence(int r, int64_t incarnation) {
  const std::string key = process_key(r, incarnation);
  const std::vector<int>& host_of = topology_->host_of();
  if (host_of[static_cast<size_t>(r)] != host_of[static_cast<size_t>(ranks_.rank)] || !store_->check(key)) return;
  const std::vector<char> raw = store_->get(key);
  const std::string done = fence_process(std::string(raw.begin(), raw.end()));
  if (done.empty()) return;
  std::fprintf(stderr, "zeroshard: rank %d: healing: rank %d was taken for lost while its process lives: %s, so "
               "that it cannot come back into the run\n", ranks_.rank, r, done.c_str());
}

// The other side of fence(), for a process no survivor could kill (on
// another host): back from a stop, it finds its collectives failing and
// nobody silent. When the store counts a loss of this incarnation, its
// peers have healed without it; it must not go on (its state is stale and
// its messages would reach the next generation), nor exit with an error a
// launcher takes for a failed job: it dies as a lost rank does, and a
// launcher that heals starts its replacement.
void Context::end_if_fenced() {
  if (!store_ || !heals()) return;
  int64_t losses = 0;
  try {
    losses = store_->add(losses_key(ranks_.rank), 0);
  } catch (const Error&) {
    return;  // no store to ask: the failure stands as it is
  }
  if (losses <= replacement_) return;
  std::fprintf(stderr, "zeroshard: rank %d: this process (incarnation %lld of rank %d) was taken for lost by its "
               "peers, who healed without it (it was silent past the heartbeat's limit: stopped or starved); it ends "
               "itself (SIGKILL) so that it cannot come back into the run, and a launcher that heals starts its "
               "replacement\n", ranks_.rank, static_cast<long long>(replacement_), ranks_.rank);
  raise(SIGKILL);
}

void Context::post_losses(const std::vector<int>& lost, bool shrunk) {
  const int64_t g = generation_ + 1;
  const std::string mark = shrunk ? std::string("shrunk") : std::to_string(g);
  const std::vector<char> value(mark.begin(), mark.end());
  if (losses_posted_for_ == g) {  // counted already: only what a replacement reads changes
    for (const int r : lost) store_->set(loss_key(r, store_->add(losses_key(r), 0)), value);
    return;
  }
  std::string list;
  std::vector<int64_t> losses;
  for (const int r : lost) {
    losses.push_back(store_->add(losses_key(r), 1));
    store_->set(loss_key(r, losses.back()), value);
    list += (list.empty() ? "" : " ") + std::to_string(r);
  }
  store_->set(key_prefix_of(g) + "heal/lost", std::vector<char>(list.begin(), list.end()));
  for (size_t i = 0; i < lost.size(); ++i) fence(lost[i], losses[i] - 1);  // the incarnation just lost
  losses_posted_for_ = g;
}

void Context::regroup(const std::vector<int>& lost) {
  if (!heartbeat_ || !store_ || !heals())
    fail(Code::InvalidState, "regroup needs healing on (zeroshard.healing.peer_copy) with heartbeats");
  const int64_t g = generation_ + 1;
  const std::string prefix = key_prefix_of(g);
  int lowest_live = -1;
  for (int r = 0; r < ranks_.world_size && lowest_live < 0; ++r)
    if (!std::binary_search(lost.begin(), lost.end(), r)) lowest_live = r;
  if (ranks_.rank == lowest_live) post_losses(lost, false);
  heartbeat_->republish(*store_, prefix);
  for (const int r : lost) {
    try {
      heartbeat_->readmit(r, *store_);
    } catch (const Error& e) {
      fail(e.code(), "healing: no replacement of rank ", r, " joined generation ", g, " within the store's timeout (",
           timeout_.count(), " ms): ", e.what(), "; start one with the same rank id and ZS_HEAL_REPLACEMENT set "
           "(zsrun --restarts does)");
    }
  }
  forget_losses();
  generation_ = g;
  for (const auto& [id, group] : topology_->groups())
    group->reconnect(make_communicator(group->name(), id, group->world_ranks(), group->rank()));
}

void Context::shrink(const std::vector<int>& lost) {
  if (!heartbeat_ || !store_ || !heals())
    fail(Code::InvalidState, "a shrink needs healing on (zeroshard.healing.peer_copy) with heartbeats");
  std::vector<int> live;
  for (const int r : topology_->live())
    if (!std::binary_search(lost.begin(), lost.end(), r)) live.push_back(r);
  topology_->check_live(live);
  const int64_t g = generation_ + 1;
  const std::string prefix = key_prefix_of(g);
  // A replacement a launcher starts anyway learns at once that none is
  // taken (find_generation).
  if (ranks_.rank == live.front()) post_losses(lost, true);
  for (const int r : lost) heartbeat_->drop(r);
  heartbeat_->reform(*store_);  // past 8 peers: no live rank left with its monitors all dropped
  heartbeat_->republish(*store_, prefix);
  forget_losses();
  generation_ = g;
  topology_->shrink(live, [&](Group& group, int id, const std::vector<int>& members) { rejoin(group, id, members); });
}

void Context::regrow(const std::vector<int>& joined) {
  if (!heartbeat_ || !store_ || !heals())
    fail(Code::InvalidState, "a regrow needs healing on (zeroshard.healing.peer_copy) with heartbeats");
  const int64_t g = generation_ + 1;
  heartbeat_->republish(*store_, key_prefix_of(g));
  for (const int r : joined) {
    try {
      heartbeat_->readmit(r, *store_);
    } catch (const Error& e) {
      fail(e.code(), "healing: the process admitted back for rank ", r, " (ZS_HEAL_JOIN=grow) posted no heartbeat "
           "address in generation ", g, " within the store's timeout (", timeout_.count(), " ms): ", e.what());
    }
  }
  heartbeat_->reform(*store_);
  generation_ = g;
  std::vector<int> live = topology_->live();
  live.insert(live.end(), joined.begin(), joined.end());
  std::sort(live.begin(), live.end());
  topology_->regrow(live, [&](Group& group, int id, const std::vector<int>& members) { rejoin(group, id, members); });
}

std::string Context::arrival_key(int64_t generation, int rank, int64_t incarnation) {
  return key_prefix_of(generation) + "heal/arrived/" + std::to_string(rank) + "/" + std::to_string(incarnation);
}

std::vector<int> Context::missing_joiners(const std::vector<int>& joined, std::chrono::milliseconds wait) {
  const auto deadline = std::chrono::steady_clock::now() + wait;
  std::vector<int> missing;
  for (const int r : joined) {
    const std::string key = arrival_key(generation_ + 1, r, losses_of(r));  // as admitted (regrow.cpp)
    while (!store_->check(key) && std::chrono::steady_clock::now() < deadline)
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    // First to claim: the joiner did not come in time (its own claim, if it
    // ever makes one, finds this one).
    if (store_->add(key, 1) == 1) missing.push_back(r);
  }
  // Nothing to fence: a joiner posts its process identity after its address.
  const std::string mark = "shrunk";
  for (const int r : missing)
    store_->set(loss_key(r, store_->add(losses_key(r), 1)), std::vector<char>(mark.begin(), mark.end()));
  return missing;
}

void Context::rejoin(Group& group, int id, const std::vector<int>& members) {
  const int my = static_cast<int>(std::find(members.begin(), members.end(), ranks_.rank) - members.begin());
  group.reconnect(members, my, make_communicator(group.name(), id, members, my));
}

void Context::forget_losses() {
  {
    std::lock_guard<std::mutex> held(loss_mu_);
    lost_.clear();
    lost_handled_.clear();
    lost_acted_.clear();
    lost_why_.clear();
  }
  std::lock_guard<std::mutex> held(error_mu_);
  if (async_code_ == Code::RankLost) {
    async_code_ = Code::Ok;
    async_message_.clear();
  }
}

Context::Attachment* Context::find_locked(std::type_index type) {
  for (auto& a : attachments_)
    if (a.first == type) return a.second.get();
  return nullptr;
}

Context::~Context() {
  // The heal thread first: it calls into the groups and the store.
  loss_sub_.reset();
  {
    std::lock_guard<std::mutex> held(loss_mu_);
    loss_stop_ = true;
  }
  loss_cv_.notify_all();
  if (loss_thread_.joinable()) loss_thread_.join();
  while (!attachments_.empty()) attachments_.pop_back();
  if (topology_) topology_->shutdown("the context was destroyed");
  // From here this rank's silence is no failure of its peers'.
  if (heartbeat_) heartbeat_->leave();
  finalize_store();
  store_server_watch_.reset();
  heartbeat_.reset();
}

}  // namespace zs
