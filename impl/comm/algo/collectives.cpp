#include "impl/comm/algo/collectives.h"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <memory>
#include <vector>

#include "impl/comm/algo/sparse_collectives.h"
#include "impl/common/copy_tally.h"
#include "impl/common/reduce.h"
#include "impl/device/buffer.h"

namespace zs::collectives {
namespace {

// Sums and reductions of 16-bit floats run in fp32; u8 stays bytes. A
// reduce-scatter of 16-bit floats carries 16-bit partial sums
// (reduce_scatter_16); the other reductions carry fp32 between ranks.
size_t wire_elem(DType dtype) { return dtype == DType::U8 ? 1 : 4; }

void reduce_into(void* dst, const void* src, size_t count, DType dtype, ReduceOp op) {
  if (dtype == DType::U8) {
    reduce_u8(static_cast<uint8_t*>(dst), static_cast<const uint8_t*>(src), count, op);
  } else {
    reduce_f32(static_cast<float*>(dst), static_cast<const float*>(src), count, op);
  }
}

// Widens count elements of send into wire elements.
void widen(const void* send, DType dtype, void* out, size_t count) {
  if (dtype == DType::U8) {
    std::memcpy(out, send, count);
  } else {
    widen_to_f32(send, dtype, static_cast<float*>(out), count);
  }
}

// Averages over `members` and narrows count wire elements into recv.
void finish(void* wire, DType dtype, ReduceOp op, int members, void* recv, size_t count) {
  if (dtype == DType::U8) {
    if (wire != recv) std::memcpy(recv, wire, count);
    return;
  }
  auto* f = static_cast<float*>(wire);
  if (op == ReduceOp::Avg) scale_f32(f, count, static_cast<float>(members));
  narrow_from_f32(f, dtype, recv, count);
}

// Every member's vector (vector_of(m), wire elements) reduced in rank order
// into member 0's, so that all members compute bitwise the same result, then
// finished into recv. Member 0's vector is overwritten.
template <typename VectorOf>
void reduce_in_rank_order(VectorOf vector_of, int n, size_t count, DType dtype, ReduceOp op, void* recv) {
  void* acc = vector_of(0);
  for (int member = 1; member < n; ++member) reduce_into(acc, vector_of(member), count, dtype, op);
  finish(acc, dtype, op, n, recv, count);
}

// Ring reduce-scatter over n blocks of acc (wire elements), block b at
// offsets[b] with counts[b] elements. After n-1 steps block rank() holds the
// full reduction: each step sends the block just accumulated to the right
// and accumulates the one arriving from the left.
void ring_reduce_blocks(PointToPoint& p2p, uint8_t* acc, const std::vector<size_t>& offsets,
                        const std::vector<size_t>& counts, DType dtype, ReduceOp op) {
  const int n = p2p.size();
  const int me = p2p.rank();
  const size_t elem = wire_elem(dtype);
  const size_t largest = *std::max_element(counts.begin(), counts.end());
  Buffer incoming(std::max<size_t>(largest * elem, 1), MemKind::CommStaging);
  const int right = (me + 1) % n;
  const int left = (me + n - 1) % n;
  auto block = [n](int b) { return static_cast<size_t>(((b % n) + n) % n); };
  for (int step = 0; step < n - 1; ++step) {
    const size_t send_block = block(me - step - 1);
    const size_t recv_block = block(me - step - 2);
    const auto index = static_cast<uint32_t>(step);
    if (counts[recv_block] > 0) p2p.recv(left, index, incoming.data(), counts[recv_block] * elem);
    if (counts[send_block] > 0)
      p2p.send(right, index, acc + offsets[send_block] * elem, counts[send_block] * elem);
    p2p.wait();
    reduce_into(acc + offsets[recv_block] * elem, incoming.data(), counts[recv_block], dtype, op);
  }
}

// fp32: the ring reads its blocks straight from send and keeps one
// block-sized partial sum, so a gradient bucket is neither copied nor
// doubled in memory; the last step receives into recv (unless recv lies
// within send) and sums (and averages) there, so 2 ranks need no block of
// their own at all. The sums are ring_reduce_blocks' (own block + what
// arrives), bit for bit.
void reduce_scatter_f32(PointToPoint& p2p, const float* send, float* recv, size_t count,
                        ReduceOp op, size_t stride, const Communicator::ReducedBlock* take = nullptr) {
  const int n = p2p.size();
  const int me = p2p.rank();
  if (take != nullptr) {  // the last hop to the caller: recv is unused
    if (n == 1) return (*take)(send, nullptr, 1.0f);
    recv = nullptr;
  }
  if (n == 1) {
    if (recv != send) {
      std::memmove(recv, send, count * sizeof(float));
      copy_tally::add(CopyKind::GroupOfOne, count * sizeof(float));
    }
    return;
  }
  const float scale = op == ReduceOp::Avg ? 1.0f / static_cast<float>(n) : 1.0f;
  auto block = [n, send, stride](int b) { return send + static_cast<size_t>((b + n) % n) * stride; };
  const size_t bytes = count * sizeof(float);
  const auto at = [](const float* p) { return reinterpret_cast<uintptr_t>(p); };
  const size_t span = static_cast<size_t>(n - 1) * stride + count;
  const bool recv_apart = take == nullptr && (at(recv + count) <= at(send) || at(recv) >= at(send + span));
  std::unique_ptr<Buffer> incoming;  // what arrives, on the steps before the last
  if (n > 2 || !recv_apart) incoming = std::make_unique<Buffer>(bytes, MemKind::CommStaging);
  std::unique_ptr<Buffer> partial;  // the sum so far, sent on at the next step
  if (n > 2) partial = std::make_unique<Buffer>(bytes, MemKind::CommStaging);
  const int right = (me + 1) % n;
  const int left = (me + n - 1) % n;
  for (int step = 0; step < n - 1; ++step) {
    const bool last = step == n - 2;
    const auto index = static_cast<uint32_t>(step);
    float* in = last && recv_apart ? recv : static_cast<float*>(incoming->data());
    p2p.recv(left, index, in, bytes);
    p2p.send(right, index, step == 0 ? block(me - 1) : partial->data(), bytes);
    p2p.wait();
    if (last && take != nullptr) {
      (*take)(block(me - step - 2), in, scale);
      continue;
    }
    float* out = last ? recv : static_cast<float*>(partial->data());
    reduce_f32_into(out, block(me - step - 2), in, count, op, last ? scale : 1.0f);
  }
}

// 16-bit floats: the ring carries 16-bit partial sums, half of fp32's bytes
// (what communication_data_type bf16/fp16 asks for, and what NCCL's bf16
// reductions move); each hop adds in fp32 and rounds its partial sum once.
// An fp16 Avg divides every term by n before it joins the sum, as NCCL does
// for floats (PreMulSum) and DeepSpeed before its reduce-scatter: the
// partial sums stay within the terms' range, so the sum overflows only
// where the mean would, not at n - 1 terms of a loss-scaled gradient. bf16
// has fp32's range and divides the sum once at the end: dividing each term
// first would round each of them (8 bits) for no gain. Max and min are
// exact either way.
void reduce_scatter_16(PointToPoint& p2p, const void* send, void* recv, size_t count, DType dtype,
                       ReduceOp op, size_t stride) {
  const int n = p2p.size();
  const int me = p2p.rank();
  const size_t bytes = count * dtype_size(dtype);
  const size_t apart = stride * dtype_size(dtype);
  const auto* base = static_cast<const uint8_t*>(send);
  auto block = [n, base, apart](int b) { return base + static_cast<size_t>((b + n) % n) * apart; };
  if (n == 1) {
    if (recv != send) {
      std::memmove(recv, send, bytes);
      copy_tally::add(CopyKind::GroupOfOne, bytes);
    }
    return;
  }
  const bool pre = op == ReduceOp::Avg && dtype == DType::F16;
  const float scale = 1.0f / static_cast<float>(n);
  Buffer incoming(bytes, MemKind::CommStaging), partial(bytes, MemKind::CommStaging);
  std::vector<float> sum(count), own(count);
  if (pre) {  // the first block sent is a term too
    widen_to_f32(block(me - 1), dtype, own.data(), count);
    for (size_t i = 0; i < count; ++i) own[i] *= scale;
    narrow_from_f32(own.data(), dtype, partial.data(), count);
  }
  const int right = (me + 1) % n;
  const int left = (me + n - 1) % n;
  for (int step = 0; step < n - 1; ++step) {
    const bool last = step == n - 2;
    const auto index = static_cast<uint32_t>(step);
    p2p.recv(left, index, incoming.data(), bytes);
    p2p.send(right, index, step == 0 && !pre ? block(me - 1) : partial.data(), bytes);
    p2p.wait();
    widen_to_f32(incoming.data(), dtype, sum.data(), count);
    widen_to_f32(block(me - step - 2), dtype, own.data(), count);
    if (pre) {
      for (size_t i = 0; i < count; ++i) sum[i] += own[i] * scale;
    } else {
      reduce_f32_into(sum.data(), own.data(), sum.data(), count, op,
                      last && op == ReduceOp::Avg ? scale : 1.0f);
    }
    narrow_from_f32(sum.data(), dtype, last ? recv : partial.data(), count);
  }
}

}  // namespace

namespace {

// Past the full mesh: every segment's part packed into one block, gathered
// in log N rounds (sparse::rotated_all_gather), then unpacked in place.
void sparse_all_gather(PointToPoint& p2p, const std::vector<GatherSegment>& segments) {
  const int n = p2p.size();
  const int me = p2p.rank();
  size_t block = 0;
  for (const auto& s : segments) block += s.bytes;
  if (block == 0) return;
  Buffer all(block * static_cast<size_t>(n), MemKind::CommStaging);
  auto* base = static_cast<uint8_t*>(all.data());
  size_t off = 0;
  for (const auto& s : segments) {
    if (s.bytes > 0) std::memcpy(base + off, s.send, s.bytes);
    off += s.bytes;
  }
  // Packed in, and every member's part unpacked (but this rank's own, in place).
  copy_tally::add(CopyKind::GatherStaging, block * static_cast<size_t>(n));
  sparse::rotated_all_gather(p2p, base, block);
  for (int i = 0; i < n; ++i) {
    const auto member = static_cast<size_t>((me + i) % n);
    const uint8_t* src = base + static_cast<size_t>(i) * block;
    for (const auto& s : segments) {
      auto* dst = static_cast<uint8_t*>(s.recv) + member * s.bytes;
      if (s.bytes > 0 && dst != s.send) std::memcpy(dst, src, s.bytes);
      src += s.bytes;
    }
  }
}

}  // namespace

void all_gather(PointToPoint& p2p, const std::vector<GatherSegment>& segments) {
  if (!p2p.full_mesh()) return sparse_all_gather(p2p, segments);
  const int n = p2p.size();
  const int me = p2p.rank();
  std::vector<const GatherSegment*> small;
  std::vector<const GatherSegment*> large;
  size_t packed_bytes = 0;
  for (const auto& s : segments) {
    if (s.bytes == 0) continue;
    if (s.bytes >= kDirectSegmentBytes) {
      large.push_back(&s);
    } else {
      small.push_back(&s);
      packed_bytes += s.bytes;
    }
  }

  // Packed small segments: one send buffer, one staging area per peer.
  std::unique_ptr<Buffer> pack, staging;
  if (packed_bytes > 0) {
    pack = std::make_unique<Buffer>(packed_bytes, MemKind::CommStaging);
    staging = std::make_unique<Buffer>(packed_bytes * static_cast<size_t>(n), MemKind::CommStaging);
    size_t off = 0;
    for (const auto* s : small) {
      std::memcpy(static_cast<uint8_t*>(pack->data()) + off, s->send, s->bytes);
      off += s->bytes;
    }
    // Packed in here, the peers' parts unpacked below.
    copy_tally::add(CopyKind::GatherStaging, packed_bytes * static_cast<size_t>(n));
    for (int peer = 0; peer < n; ++peer) {
      if (peer == me) continue;
      p2p.recv(peer, 0,
               static_cast<uint8_t*>(staging->data()) + static_cast<size_t>(peer) * packed_bytes,
               packed_bytes);
      p2p.send(peer, 0, pack->data(), packed_bytes);
    }
  }

  // Large segments: post every receive and send before waiting on any.
  uint32_t index = 1;
  for (const auto* s : large) {
    for (int peer = 0; peer < n; ++peer) {
      if (peer == me) continue;
      p2p.recv(peer, index, static_cast<uint8_t*>(s->recv) + static_cast<size_t>(peer) * s->bytes,
               s->bytes);
      p2p.send(peer, index, s->send, s->bytes);
    }
    ++index;
  }

  // Our own part needs no network; copy it while the transfers run.
  for (const auto& s : segments) {
    auto* dst = static_cast<uint8_t*>(s.recv) + static_cast<size_t>(me) * s.bytes;
    if (s.bytes > 0 && dst != s.send) std::memcpy(dst, s.send, s.bytes);
  }
  p2p.wait();

  if (packed_bytes == 0) return;
  for (int peer = 0; peer < n; ++peer) {
    if (peer == me) continue;
    const auto* src =
        static_cast<const uint8_t*>(staging->data()) + static_cast<size_t>(peer) * packed_bytes;
    for (const auto* s : small) {
      std::memcpy(static_cast<uint8_t*>(s->recv) + static_cast<size_t>(peer) * s->bytes, src,
                  s->bytes);
      src += s->bytes;
    }
  }
}

void reduce_scatter(PointToPoint& p2p, const void* send, void* recv, size_t count, DType dtype,
                    ReduceOp op, size_t stride) {
  if (count == 0) return;
  if (stride == 0) stride = count;
  if (dtype == DType::F32) {
    reduce_scatter_f32(p2p, static_cast<const float*>(send), static_cast<float*>(recv), count, op, stride);
    return;
  }
  if (dtype == DType::BF16 || dtype == DType::F16) {
    reduce_scatter_16(p2p, send, recv, count, dtype, op, stride);
    return;
  }
  const int n = p2p.size();
  const size_t elem = wire_elem(dtype);
  Buffer acc(count * elem * static_cast<size_t>(n), MemKind::CommStaging);
  for (int b = 0; b < n; ++b)
    widen(static_cast<const uint8_t*>(send) + static_cast<size_t>(b) * stride * dtype_size(dtype), dtype,
          static_cast<uint8_t*>(acc.data()) + static_cast<size_t>(b) * count * elem, count);
  std::vector<size_t> offsets, counts(static_cast<size_t>(n), count);
  for (int b = 0; b < n; ++b) offsets.push_back(static_cast<size_t>(b) * count);
  auto* bytes = static_cast<uint8_t*>(acc.data());
  ring_reduce_blocks(p2p, bytes, offsets, counts, dtype, op);
  finish(bytes + static_cast<size_t>(p2p.rank()) * count * elem, dtype, op, n, recv, count);
}

void reduce_scatter_into(PointToPoint& p2p, const float* send, size_t count, size_t stride, ReduceOp op,
                         const Communicator::ReducedBlock& take) {
  if (count == 0) return;
  reduce_scatter_f32(p2p, send, nullptr, count, op, stride == 0 ? count : stride, &take);
}

void all_reduce(PointToPoint& p2p, const void* send, void* recv, size_t count, DType dtype,
                ReduceOp op) {
  if (count == 0) return;
  const int n = p2p.size();
  const int me = p2p.rank();
  const size_t elem = wire_elem(dtype);
  const size_t bytes = count * elem;
  if (!p2p.full_mesh() && bytes * static_cast<size_t>(n) <= kSparseGatherReduceBytes) {
    // Everyone's vector gathered in log N rounds, reduced in member order
    // as below: the same bits as the full mesh.
    Buffer all(bytes * static_cast<size_t>(n), MemKind::CommStaging);
    auto* base = static_cast<uint8_t*>(all.data());
    widen(send, dtype, base, count);
    sparse::rotated_all_gather(p2p, base, bytes);
    reduce_in_rank_order(
        [&](int member) { return base + static_cast<size_t>((member - me + n) % n) * bytes; }, n, count,
        dtype, op, recv);
    return;
  }
  if (p2p.full_mesh() && bytes <= kDirectAllReduceBytes) {
    // Everyone's vector to everyone; each member reduces in rank order, so
    // all compute bitwise the same result.
    Buffer all(bytes * static_cast<size_t>(n), MemKind::CommStaging);
    auto* base = static_cast<uint8_t*>(all.data());
    widen(send, dtype, base + static_cast<size_t>(me) * bytes, count);
    for (int peer = 0; peer < n; ++peer) {
      if (peer == me) continue;
      p2p.recv(peer, 0, base + static_cast<size_t>(peer) * bytes, bytes);
      p2p.send(peer, 0, base + static_cast<size_t>(me) * bytes, bytes);
    }
    p2p.wait();
    reduce_in_rank_order([&](int member) { return base + static_cast<size_t>(member) * bytes; }, n,
                         count, dtype, op, recv);
    return;
  }
  // Ring reduce-scatter into n nearly equal blocks, then each member sends
  // its reduced block to every peer.
  Buffer acc(bytes, MemKind::CommStaging);
  auto* base = static_cast<uint8_t*>(acc.data());
  widen(send, dtype, base, count);
  std::vector<size_t> offsets, counts;
  const auto members = static_cast<size_t>(n);
  size_t off = 0;
  for (size_t b = 0; b < members; ++b) {
    const size_t c = count / members + (b < count % members ? 1 : 0);
    offsets.push_back(off);
    counts.push_back(c);
    off += c;
  }
  ring_reduce_blocks(p2p, base, offsets, counts, dtype, op);
  const auto mine = static_cast<size_t>(me);
  constexpr uint32_t kGatherIndex = 1u << 20;  // after the ring's steps
  if (!p2p.full_mesh()) {
    // The reduced blocks to everyone in log N rounds, each padded to the
    // largest.
    const size_t largest = *std::max_element(counts.begin(), counts.end()) * elem;
    Buffer all(largest * members, MemKind::CommStaging);
    auto* gathered = static_cast<uint8_t*>(all.data());
    std::memcpy(gathered, base + offsets[mine] * elem, counts[mine] * elem);
    sparse::rotated_all_gather(p2p, gathered, largest, kGatherIndex);
    for (size_t i = 1; i < members; ++i) {
      const size_t member = (mine + i) % members;
      std::memcpy(base + offsets[member] * elem, gathered + i * largest, counts[member] * elem);
    }
    finish(base, dtype, op, n, recv, count);
    return;
  }
  for (int peer = 0; peer < n; ++peer) {
    if (peer == me) continue;
    const auto p = static_cast<size_t>(peer);
    if (counts[p] > 0) p2p.recv(peer, kGatherIndex, base + offsets[p] * elem, counts[p] * elem);
    if (counts[mine] > 0)
      p2p.send(peer, kGatherIndex, base + offsets[mine] * elem, counts[mine] * elem);
  }
  p2p.wait();
  finish(base, dtype, op, n, recv, count);
}

void all_to_all(PointToPoint& p2p, const void* send, void* recv, size_t bytes_per_rank) {
  if (!p2p.full_mesh()) return sparse::all_to_all(p2p, send, recv, bytes_per_rank);
  if (bytes_per_rank == 0) return;
  const int me = p2p.rank();
  const auto* in = static_cast<const uint8_t*>(send);
  auto* out = static_cast<uint8_t*>(recv);
  auto at = [bytes_per_rank](int r) { return static_cast<size_t>(r) * bytes_per_rank; };
  for (int peer = 0; peer < p2p.size(); ++peer) {
    if (peer == me) continue;
    p2p.recv(peer, 0, out + at(peer), bytes_per_rank);
    p2p.send(peer, 0, in + at(peer), bytes_per_rank);
  }
  if (out + at(me) != in + at(me)) std::memcpy(out + at(me), in + at(me), bytes_per_rank);
  p2p.wait();
}

void broadcast(PointToPoint& p2p, void* buf, size_t bytes, int root) {
  if (!p2p.full_mesh()) return sparse::broadcast(p2p, buf, bytes, root);
  if (bytes == 0) return;
  if (p2p.rank() == root) {
    for (int peer = 0; peer < p2p.size(); ++peer)
      if (peer != root) p2p.send(peer, 0, buf, bytes);
  } else {
    p2p.recv(root, 0, buf, bytes);
  }
  p2p.wait();
}

void scatter(PointToPoint& p2p, const std::vector<const void*>& inputs, void* recv, size_t bytes,
             int root) {
  if (!p2p.full_mesh()) return sparse::scatter(p2p, inputs, recv, bytes, root);
  if (bytes == 0) return;
  if (p2p.rank() == root) {
    for (int peer = 0; peer < p2p.size(); ++peer)
      if (peer != root) p2p.send(peer, 0, inputs[static_cast<size_t>(peer)], bytes);
    const void* own = inputs[static_cast<size_t>(root)];
    if (recv != own) std::memcpy(recv, own, bytes);
  } else {
    p2p.recv(root, 0, recv, bytes);
  }
  p2p.wait();
}

void barrier(PointToPoint& p2p) {
  if (!p2p.full_mesh()) return sparse::barrier(p2p);
  // One byte to and from every peer: nobody leaves before all arrived.
  std::vector<uint8_t> in(static_cast<size_t>(p2p.size()));
  const uint8_t out = 1;
  for (int peer = 0; peer < p2p.size(); ++peer) {
    if (peer == p2p.rank()) continue;
    p2p.recv(peer, 0, &in[static_cast<size_t>(peer)], 1);
    p2p.send(peer, 0, &out, 1);
  }
  p2p.wait();
}

}  // namespace zs::collectives
