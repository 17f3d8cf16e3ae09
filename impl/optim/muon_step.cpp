#include "impl/optim/muon_step.h"

#include <algorithm>
#include <cmath>
#include <numeric>

#include "impl/comm/algo/communicator.h"
#include "impl/common/copy_tally.h"
#include "impl/device/blas.h"
#include "impl/device/buffer.h"

namespace zs {
namespace {

// A param's matrix as Muon sees it: its first dim by the rest.
std::pair<int64_t, int64_t> matrix_shape(const Param& p) {
  const int64_t rows = p.shape.at(0);
  return {rows, rows == 0 ? 0 : static_cast<int64_t>(p.layout.numel) / rows};
}

// Owner (rank in the group) of each param of a bucket: the largest first,
// each to the least loaded rank (the lowest on a tie).
std::vector<int> owners(const std::vector<const MuonParam*>& bucket, int group_size) {
  std::vector<size_t> order(bucket.size());
  std::iota(order.begin(), order.end(), 0);
  std::vector<double> cost(bucket.size());
  for (size_t i = 0; i < bucket.size(); ++i) {
    const auto [rows, cols] = matrix_shape(*bucket[i]->param);
    cost[i] = newton_schulz_cost(rows, cols);
  }
  std::stable_sort(order.begin(), order.end(), [&](size_t a, size_t b) { return cost[a] > cost[b]; });
  std::vector<double> load(static_cast<size_t>(group_size), 0.0);
  std::vector<int> out(bucket.size(), 0);
  for (size_t i : order) {
    const auto r = static_cast<size_t>(std::min_element(load.begin(), load.end()) - load.begin());
    out[i] = static_cast<int>(r);
    load[r] += cost[i];
  }
  return out;
}

void step_bucket(Context& ctx, const std::vector<const MuonParam*>& bucket, float grad_scale) {
  Device& dev = *ctx.device();
  Group& group = *bucket.front()->param->group;
  const int size = group.size(), me = group.rank();
  const std::vector<int> owner = owners(bucket, size);
  std::vector<BufferPtr> shard(bucket.size()), whole(bucket.size());
  std::vector<GatherSegment> segments;
  for (size_t i = 0; i < bucket.size(); ++i) {
    const MuonParam& m = *bucket[i];
    const uint64_t n = m.param->layout.shard_numel;
    // momentum = beta m + (1 - beta) g; update = beta momentum + (1 - beta) g
    // (torch's lerp_(g, 1 - beta), then g.lerp(momentum, beta)).
    const float g_weight = (1.0f - m.beta) * grad_scale;
    blas::scal(dev, n, m.beta, m.momentum);
    blas::axpy(dev, n, g_weight, m.grad, 1, m.momentum, 1);
    shard[i] = std::make_shared<Buffer>(dev.device_shared(), n * sizeof(float), MemKind::Scratch);
    auto* update = static_cast<float*>(shard[i]->data());
    dev.copy(update, m.momentum, n * sizeof(float));
    copy_tally::add(CopyKind::Other, n * sizeof(float));
    blas::scal(dev, n, m.beta, update);
    blas::axpy(dev, n, g_weight, m.grad, 1, update, 1);
    if (size > 1) {
      whole[i] = std::make_shared<Buffer>(dev.device_shared(), n * size * sizeof(float), MemKind::Scratch);
      segments.push_back({update, whole[i]->data(), n * sizeof(float)});
    } else {
      whole[i] = shard[i];
    }
  }
  if (size > 1) {
    dev.synchronize();  // the updates are written before the transport reads them
    group.run("muon gather", [&](Communicator& c) { c.allgather_coalesced(segments); });
  }
  for (size_t i = 0; i < bucket.size(); ++i) {
    if (owner[i] != me) continue;
    const MuonParam& m = *bucket[i];
    const auto [rows, cols] = matrix_shape(*m.param);
    newton_schulz(dev, static_cast<float*>(whole[i]->data()), rows, cols, m.method, m.ns_steps);
  }
  if (size > 1) {
    dev.synchronize();
    group.run("muon scatter", [&](Communicator& c) {
      for (size_t i = 0; i < bucket.size(); ++i) {
        const uint64_t n = bucket[i]->param->layout.shard_numel;
        std::vector<const void*> inputs;
        if (owner[i] == me)
          for (int r = 0; r < size; ++r)
            inputs.push_back(static_cast<const float*>(whole[i]->data()) + static_cast<uint64_t>(r) * n);
        c.scatter(inputs, shard[i]->data(), n * sizeof(float), owner[i]);
      }
    });
  }
  for (size_t i = 0; i < bucket.size(); ++i) {
    const MuonParam& m = *bucket[i];
    const uint64_t n = m.param->layout.shard_numel;
    const auto [rows, cols] = matrix_shape(*m.param);
    // Every row's update at the scale of a square matrix's.
    const double scale = rows > cols ? std::sqrt(static_cast<double>(rows) / static_cast<double>(cols)) : 1.0;
    blas::scal(dev, n, static_cast<float>(1.0 - static_cast<double>(m.lr) * m.weight_decay), m.master);
    blas::axpy(dev, n, static_cast<float>(-m.lr * scale), static_cast<const float*>(shard[i]->data()), 1,
               m.master, 1);
  }
  dev.synchronize();
}

}  // namespace

void muon_step(Context& ctx, const std::vector<MuonParam>& params, float grad_scale) {
  const auto cap = static_cast<uint64_t>(std::max<int64_t>(ctx.config().reduce_bucket_size, 1));
  std::vector<const MuonParam*> bucket;
  uint64_t elements = 0;
  auto flush = [&] {
    if (!bucket.empty()) step_bucket(ctx, bucket, grad_scale);
    bucket.clear();
    elements = 0;
  };
  for (const auto& m : params) {
    const uint64_t padded = m.param->layout.padded_numel;
    if (!bucket.empty() && (bucket.front()->param->group != m.param->group || elements + padded > cap)) flush();
    bucket.push_back(&m);
    elements += padded;
  }
  flush();
}

}  // namespace zs
