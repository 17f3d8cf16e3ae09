// The optimizer steps on the GPU: AdamW/Adam and SGD over fp32 master
// shards, with the working-dtype write-back; and the _mixed variants over
// masters and moments kept in fp32 or bf16 (bf16.bf16_master_weights_and_
// grads, bf16.bf16_optimizer_states). Each element runs
// kernels/elementwise.h's adam_elem / sgd_elem with the constants of
// adam_consts / sgd_consts (computed on the host, as for the CPU), so the
// results are bit-identical to kernels::adam_step_scalar / sgd_step_scalar.
//
// adam_step_many / sgd_step_many (and the _mixed_many twins over masters and
// moments in F32 or BF16, one launch per pair of dtypes): the same element
// updates over a list of
// tensors (a rank's shards), one launch per working dtype of the list (at
// most kStepTensorsPerLaunch tensors a launch). As in apex's and torch's
// multi_tensor_apply, the tensors are cut into chunks of kChunk elements
// and the blocks share them out; unlike them, the table (pointers, sizes,
// each tensor's constants and each chunk's tensor by prefix sums) travels
// as the kernel's parameter, as batched_copy's does (copy.cu: no
// allocation, no upload, capturable in a graph), and block b runs chunks b,
// b + G, ... (G blocks, at most kBlocksPerSm a multiprocessor), finding a
// chunk's tensor by binary search. A chunk runs the op of the per-tensor
// kernel, four elements at a time where that tensor's pointers allow it:
// each element sees the same adam_elem / sgd_elem with the same constants
// as under adam_step / sgd_step, so the results are theirs bit for bit.
#include <vector>

#include "kernels/cuda/common.cuh"

namespace zs::kernels::cuda {
namespace {

using detail::kInvalid;
using detail::kThreads;

// HasWork: also write the updated master into w in dtype T.
template <bool HasWork, WorkDtype T>
struct AdamOp {
  float* p;
  float* m;
  float* v;
  const float* g;
  void* w;
  AdamC c;

  template <int V>
  __device__ __forceinline__ void run(size_t i) const {
    float pp[V], mm[V], vv[V], gg[V];
    detail::ld<V>(p + i, pp);
    detail::ld<V>(m + i, mm);
    detail::ld<V>(v + i, vv);
    detail::ld<V>(g + i, gg);
#pragma unroll
    for (int k = 0; k < V; ++k) adam_elem(pp[k], mm[k], vv[k], gg[k], c);
    detail::st<V>(p + i, pp);
    detail::st<V>(m + i, mm);
    detail::st<V>(v + i, vv);
    if constexpr (HasWork) detail::st_work<T, V>(w, i, pp);
  }
};

// buf is read and written only when c.has_mom (it may be null otherwise).
template <bool HasWork, WorkDtype T>
struct SgdOp {
  float* p;
  float* buf;
  const float* g;
  void* w;
  SgdC c;

  template <int V>
  __device__ __forceinline__ void run(size_t i) const {
    float pp[V], gg[V], bb[V] = {};  // bb: read only when c.has_mom && !c.first
    detail::ld<V>(p + i, pp);
    detail::ld<V>(g + i, gg);
    if (c.has_mom && !c.first) detail::ld<V>(buf + i, bb);
#pragma unroll
    for (int k = 0; k < V; ++k) sgd_elem(pp[k], &bb[k], gg[k], c);
    detail::st<V>(p + i, pp);
    if (c.has_mom) detail::st<V>(buf + i, bb);
    if constexpr (HasWork) detail::st_work<T, V>(w, i, pp);
  }
};

// The master in PT, the moments in ST (F32 or BF16 each): widened, updated
// by adam_elem, rounded once on store (the master is the working copy).
template <WorkDtype PT, WorkDtype ST>
struct AdamMixedOp {
  void* p;
  void* m;
  void* v;
  const float* g;
  AdamC c;

  template <int V>
  __device__ __forceinline__ void run(size_t i) const {
    float pp[V], mm[V], vv[V], gg[V];
    detail::ld_work<PT, V>(p, i, pp);
    detail::ld_work<ST, V>(m, i, mm);
    detail::ld_work<ST, V>(v, i, vv);
    detail::ld<V>(g + i, gg);
#pragma unroll
    for (int k = 0; k < V; ++k) adam_elem(pp[k], mm[k], vv[k], gg[k], c);
    detail::st_work<ST, V>(m, i, mm);
    detail::st_work<ST, V>(v, i, vv);
    detail::st_work<PT, V>(p, i, pp);
  }
};

// buf is read and written only when c.has_mom (it may be null otherwise).
template <WorkDtype PT, WorkDtype ST>
struct SgdMixedOp {
  void* p;
  void* buf;
  const float* g;
  SgdC c;

  template <int V>
  __device__ __forceinline__ void run(size_t i) const {
    float pp[V], gg[V], bb[V] = {};  // bb: read only when c.has_mom && !c.first
    detail::ld_work<PT, V>(p, i, pp);
    detail::ld<V>(g + i, gg);
    if (c.has_mom && !c.first) detail::ld_work<ST, V>(buf, i, bb);
#pragma unroll
    for (int k = 0; k < V; ++k) sgd_elem(pp[k], &bb[k], gg[k], c);
    if (c.has_mom) detail::st_work<ST, V>(buf, i, bb);
    detail::st_work<PT, V>(p, i, pp);
  }
};

bool mixed_dtype(WorkDtype t) { return t == WorkDtype::F32 || t == WorkDtype::BF16; }

// Calls f(master dtype, state dtype) as compile-time constants (F32 or BF16).
template <class F>
int with_mixed(WorkDtype pt, WorkDtype st, F&& f) {
  using F32 = std::integral_constant<WorkDtype, WorkDtype::F32>;
  using BF16 = std::integral_constant<WorkDtype, WorkDtype::BF16>;
  if (pt == WorkDtype::F32) return st == WorkDtype::F32 ? f(F32{}, F32{}) : f(F32{}, BF16{});
  return st == WorkDtype::F32 ? f(BF16{}, F32{}) : f(BF16{}, BF16{});
}

// Calls f(has_work, dtype) as compile-time constants.
template <class F>
int with_work(const void* w, WorkDtype t, F&& f) {
  if (w == nullptr)
    return f(std::false_type{}, std::integral_constant<WorkDtype, WorkDtype::F32>{});
  return detail::with_dtype(t, [&](auto dt) { return f(std::true_type{}, dt); });
}

bool work_vec4_ok(const void* w, WorkDtype t) {
  return w == nullptr || detail::aligned(w, detail::vec4_align(t));
}

// ---- multi-tensor ----------------------------------------------------------

constexpr size_t kChunk = 16384;  // elements of one work unit (a block's, at a time)
constexpr size_t kK = kStepTensorsPerLaunch;

// Where chunk k's tensor is: chunk_begin[i] <= k < chunk_begin[i + 1].
template <class Table>
__device__ __forceinline__ unsigned chunk_tensor(const Table& t, size_t k) {
  unsigned lo = 0, hi = t.count;
  while (hi - lo > 1) {
    const unsigned mid = lo + (hi - lo) / 2;
    if (t.chunk_begin[mid] <= k)
      lo = mid;
    else
      hi = mid;
  }
  return lo;
}

// Elements [base, min(base + kChunk, n)) of one tensor by op, the block's
// threads interleaved. base is a multiple of kChunk (of 4), so a tensor
// whose pointers allow 4-element access at 0 allows it at base.
template <class Op>
__device__ __forceinline__ void run_chunk(const Op& op, size_t base, size_t n, bool vec4) {
  const size_t end = n - base < kChunk ? n : base + kChunk;
  if (vec4) {
    const size_t nv = (end - base) / 4;
    for (size_t j = threadIdx.x; j < nv; j += kThreads) op.template run<4>(base + 4 * j);
    for (size_t i = base + 4 * nv + threadIdx.x; i < end; i += kThreads) op.template run<1>(i);
  } else {
    for (size_t i = base + threadIdx.x; i < end; i += kThreads) op.template run<1>(i);
  }
}

struct AdamTable {
  size_t chunk_begin[kK + 1];  // first chunk of each tensor; [count]: all chunks
  float* p[kK];
  float* m[kK];
  float* v[kK];
  const float* g[kK];
  void* w[kK];
  size_t n[kK];
  AdamC c[kK];
  bool vec4[kK];
  unsigned count;  // tensors, each of n > 0
};
static_assert(sizeof(AdamTable) <= 32764, "kernel parameters are limited to 32,764 bytes");

struct SgdTable {
  size_t chunk_begin[kK + 1];
  float* p[kK];
  float* buf[kK];  // null where !c.has_mom
  const float* g[kK];
  void* w[kK];
  size_t n[kK];
  SgdC c[kK];
  bool vec4[kK];
  unsigned count;
};
static_assert(sizeof(SgdTable) <= 32764, "kernel parameters are limited to 32,764 bytes");

template <bool HasWork, WorkDtype T>
__global__ void __launch_bounds__(kThreads) adam_many_kernel(const __grid_constant__ AdamTable t) {
  const size_t chunks = t.chunk_begin[t.count];
  for (size_t k = blockIdx.x; k < chunks; k += gridDim.x) {
    const unsigned i = chunk_tensor(t, k);
    const AdamOp<HasWork, T> op{t.p[i], t.m[i], t.v[i], t.g[i], t.w[i], t.c[i]};
    run_chunk(op, (k - t.chunk_begin[i]) * kChunk, t.n[i], t.vec4[i]);
  }
}

template <bool HasWork, WorkDtype T>
__global__ void __launch_bounds__(kThreads) sgd_many_kernel(const __grid_constant__ SgdTable t) {
  const size_t chunks = t.chunk_begin[t.count];
  for (size_t k = blockIdx.x; k < chunks; k += gridDim.x) {
    const unsigned i = chunk_tensor(t, k);
    const SgdOp<HasWork, T> op{t.p[i], t.buf[i], t.g[i], t.w[i], t.c[i]};
    run_chunk(op, (k - t.chunk_begin[i]) * kChunk, t.n[i], t.vec4[i]);
  }
}

struct AdamMixedTable {
  size_t chunk_begin[kK + 1];
  void* p[kK];
  void* m[kK];
  void* v[kK];
  const float* g[kK];
  size_t n[kK];
  AdamC c[kK];
  bool vec4[kK];
  unsigned count;
};
static_assert(sizeof(AdamMixedTable) <= 32764, "kernel parameters are limited to 32,764 bytes");

struct SgdMixedTable {
  size_t chunk_begin[kK + 1];
  void* p[kK];
  void* buf[kK];  // null where !c.has_mom
  const float* g[kK];
  size_t n[kK];
  SgdC c[kK];
  bool vec4[kK];
  unsigned count;
};
static_assert(sizeof(SgdMixedTable) <= 32764, "kernel parameters are limited to 32,764 bytes");

template <WorkDtype PT, WorkDtype ST>
__global__ void __launch_bounds__(kThreads) adam_mixed_many_kernel(const __grid_constant__ AdamMixedTable t) {
  const size_t chunks = t.chunk_begin[t.count];
  for (size_t k = blockIdx.x; k < chunks; k += gridDim.x) {
    const unsigned i = chunk_tensor(t, k);
    const AdamMixedOp<PT, ST> op{t.p[i], t.m[i], t.v[i], t.g[i], t.c[i]};
    run_chunk(op, (k - t.chunk_begin[i]) * kChunk, t.n[i], t.vec4[i]);
  }
}

template <WorkDtype PT, WorkDtype ST>
__global__ void __launch_bounds__(kThreads) sgd_mixed_many_kernel(const __grid_constant__ SgdMixedTable t) {
  const size_t chunks = t.chunk_begin[t.count];
  for (size_t k = blockIdx.x; k < chunks; k += gridDim.x) {
    const unsigned i = chunk_tensor(t, k);
    const SgdMixedOp<PT, ST> op{t.p[i], t.buf[i], t.g[i], t.c[i]};
    run_chunk(op, (k - t.chunk_begin[i]) * kChunk, t.n[i], t.vec4[i]);
  }
}

// The mixed launches' groups: (master, state) dtypes, each F32 or BF16.
int mixed_group(WorkDtype pt, WorkDtype st) {
  return (pt == WorkDtype::BF16 ? 2 : 0) + (st == WorkDtype::BF16 ? 1 : 0);
}
WorkDtype mixed_group_master(int g) { return g & 2 ? WorkDtype::BF16 : WorkDtype::F32; }
WorkDtype mixed_group_state(int g) { return g & 1 ? WorkDtype::BF16 : WorkDtype::F32; }

// The launches' groups: no working copy, or one of each working dtype.
constexpr int kGroups = 4;
int work_group(const void* w, WorkDtype t) { return w == nullptr ? 0 : 1 + static_cast<int>(t); }

// Calls f(has_work, dtype) as compile-time constants for group g.
template <class F>
int with_group(int g, F&& f) {
  if (g == 0) return f(std::false_type{}, std::integral_constant<WorkDtype, WorkDtype::F32>{});
  return detail::with_dtype(static_cast<WorkDtype>(g - 1), [&](auto dt) { return f(std::true_type{}, dt); });
}

// Fills table b from the tensors of group g that `add` accepts, kK at a
// time, and launches each table (Launch(b, blocks)); Add(b, k, i) writes
// tensor i into slot k and returns its element count (0: skipped).
template <class Table, class Add, class Launch>
int launch_tables(size_t count, Add&& add, Launch&& launch) {
  int sms = 0;
  const cudaError_t e = detail::sm_count(&sms);
  if (e != cudaSuccess) return detail::api_result(e);
  const size_t max_blocks = static_cast<size_t>(sms) * detail::kBlocksPerSm;
  Table b{};
  size_t i = 0;
  while (i < count) {
    unsigned k = 0;
    size_t chunks = 0;
    for (; i < count && k < kK; ++i) {
      const size_t n = add(b, k, i);
      if (n == 0) continue;
      b.chunk_begin[k] = chunks;
      b.n[k] = n;
      chunks += (n + kChunk - 1) / kChunk;
      ++k;
    }
    if (k == 0) break;
    b.chunk_begin[k] = chunks;
    b.count = k;
    const int r = launch(b, static_cast<unsigned>(chunks < max_blocks ? chunks : max_blocks));
    if (r != 0) return r;
  }
  return 0;
}

}  // namespace

int adam_step_many(const AdamTensor* t, size_t count, float grad_scale, void* stream) {
  if (count == 0) return 0;
  if (!t) return kInvalid;
  // Every argument checked before anything is enqueued.
  std::vector<AdamC> c(count);
  bool present[kGroups] = {};
  for (size_t i = 0; i < count; ++i) {
    const AdamTensor& x = t[i];
    if (x.n == 0) continue;
    if (!x.master || !x.exp_avg || !x.exp_avg_sq || !x.grad) return kInvalid;
    if (x.working && !detail::valid_dtype(x.working_dtype)) return kInvalid;
    if (x.h.bias_correction && x.h.step < 1) return kInvalid;  // adam_consts would throw
    c[i] = adam_consts(x.h, grad_scale);
    present[work_group(x.working, x.working_dtype)] = true;
  }
  for (int g = 0; g < kGroups; ++g) {
    if (!present[g]) continue;
    const int r = with_group(g, [&](auto has_work, auto dt) {
      auto add = [&](AdamTable& b, unsigned k, size_t i) -> size_t {
        const AdamTensor& x = t[i];
        if (x.n == 0 || work_group(x.working, x.working_dtype) != g) return 0;
        b.p[k] = x.master;
        b.m[k] = x.exp_avg;
        b.v[k] = x.exp_avg_sq;
        b.g[k] = x.grad;
        b.w[k] = x.working;
        b.c[k] = c[i];
        b.vec4[k] = detail::aligned(x.master, 16) && detail::aligned(x.exp_avg, 16) &&
                    detail::aligned(x.exp_avg_sq, 16) && detail::aligned(x.grad, 16) &&
                    work_vec4_ok(x.working, x.working_dtype);
        return x.n;
      };
      auto launch = [&](const AdamTable& b, unsigned blocks) {
        adam_many_kernel<decltype(has_work)::value, decltype(dt)::value>
            <<<blocks, kThreads, 0, detail::as_stream(stream)>>>(b);
        return detail::launch_result();
      };
      return launch_tables<AdamTable>(count, add, launch);
    });
    if (r != 0) return r;
  }
  return 0;
}

int sgd_step_many(const SgdTensor* t, size_t count, float grad_scale, void* stream) {
  if (count == 0) return 0;
  if (!t) return kInvalid;
  std::vector<SgdC> c(count);
  bool present[kGroups] = {};
  for (size_t i = 0; i < count; ++i) {
    const SgdTensor& x = t[i];
    if (x.n == 0) continue;
    if (!x.master || !x.grad) return kInvalid;
    if (x.working && !detail::valid_dtype(x.working_dtype)) return kInvalid;
    c[i] = sgd_consts(x.h, grad_scale);
    if (c[i].has_mom && !x.momentum_buf) return kInvalid;
    present[work_group(x.working, x.working_dtype)] = true;
  }
  for (int g = 0; g < kGroups; ++g) {
    if (!present[g]) continue;
    const int r = with_group(g, [&](auto has_work, auto dt) {
      auto add = [&](SgdTable& b, unsigned k, size_t i) -> size_t {
        const SgdTensor& x = t[i];
        if (x.n == 0 || work_group(x.working, x.working_dtype) != g) return 0;
        float* buf = c[i].has_mom ? x.momentum_buf : nullptr;
        b.p[k] = x.master;
        b.buf[k] = buf;
        b.g[k] = x.grad;
        b.w[k] = x.working;
        b.c[k] = c[i];
        b.vec4[k] = detail::aligned(x.master, 16) && detail::aligned(x.grad, 16) &&
                    (buf == nullptr || detail::aligned(buf, 16)) && work_vec4_ok(x.working, x.working_dtype);
        return x.n;
      };
      auto launch = [&](const SgdTable& b, unsigned blocks) {
        sgd_many_kernel<decltype(has_work)::value, decltype(dt)::value>
            <<<blocks, kThreads, 0, detail::as_stream(stream)>>>(b);
        return detail::launch_result();
      };
      return launch_tables<SgdTable>(count, add, launch);
    });
    if (r != 0) return r;
  }
  return 0;
}

int adam_step_mixed_many(const AdamMixedTensor* t, size_t count, float grad_scale, void* stream) {
  if (count == 0) return 0;
  if (!t) return kInvalid;
  std::vector<AdamC> c(count);
  bool present[4] = {};
  for (size_t i = 0; i < count; ++i) {
    const AdamMixedTensor& x = t[i];
    if (x.n == 0) continue;
    if (!x.master || !x.exp_avg || !x.exp_avg_sq || !x.grad) return kInvalid;
    if (!mixed_dtype(x.master_dtype) || !mixed_dtype(x.state_dtype)) return kInvalid;
    if (x.h.bias_correction && x.h.step < 1) return kInvalid;  // adam_consts would throw
    c[i] = adam_consts(x.h, grad_scale);
    present[mixed_group(x.master_dtype, x.state_dtype)] = true;
  }
  for (int g = 0; g < 4; ++g) {
    if (!present[g]) continue;
    const int r = with_mixed(mixed_group_master(g), mixed_group_state(g), [&](auto pt, auto st) {
      auto add = [&](AdamMixedTable& b, unsigned k, size_t i) -> size_t {
        const AdamMixedTensor& x = t[i];
        if (x.n == 0 || mixed_group(x.master_dtype, x.state_dtype) != g) return 0;
        b.p[k] = x.master;
        b.m[k] = x.exp_avg;
        b.v[k] = x.exp_avg_sq;
        b.g[k] = x.grad;
        b.c[k] = c[i];
        b.vec4[k] = detail::aligned(x.master, detail::vec4_align(x.master_dtype)) &&
                    detail::aligned(x.exp_avg, detail::vec4_align(x.state_dtype)) &&
                    detail::aligned(x.exp_avg_sq, detail::vec4_align(x.state_dtype)) &&
                    detail::aligned(x.grad, 16);
        return x.n;
      };
      auto launch = [&](const AdamMixedTable& b, unsigned blocks) {
        adam_mixed_many_kernel<decltype(pt)::value, decltype(st)::value>
            <<<blocks, kThreads, 0, detail::as_stream(stream)>>>(b);
        return detail::launch_result();
      };
      return launch_tables<AdamMixedTable>(count, add, launch);
    });
    if (r != 0) return r;
  }
  return 0;
}

int sgd_step_mixed_many(const SgdMixedTensor* t, size_t count, float grad_scale, void* stream) {
  if (count == 0) return 0;
  if (!t) return kInvalid;
  std::vector<SgdC> c(count);
  bool present[4] = {};
  for (size_t i = 0; i < count; ++i) {
    const SgdMixedTensor& x = t[i];
    if (x.n == 0) continue;
    if (!x.master || !x.grad) return kInvalid;
    if (!mixed_dtype(x.master_dtype) || !mixed_dtype(x.state_dtype)) return kInvalid;
    c[i] = sgd_consts(x.h, grad_scale);
    if (c[i].has_mom && !x.momentum_buf) return kInvalid;
    present[mixed_group(x.master_dtype, x.state_dtype)] = true;
  }
  for (int g = 0; g < 4; ++g) {
    if (!present[g]) continue;
    const int r = with_mixed(mixed_group_master(g), mixed_group_state(g), [&](auto pt, auto st) {
      auto add = [&](SgdMixedTable& b, unsigned k, size_t i) -> size_t {
        const SgdMixedTensor& x = t[i];
        if (x.n == 0 || mixed_group(x.master_dtype, x.state_dtype) != g) return 0;
        void* buf = c[i].has_mom ? x.momentum_buf : nullptr;
        b.p[k] = x.master;
        b.buf[k] = buf;
        b.g[k] = x.grad;
        b.c[k] = c[i];
        b.vec4[k] = detail::aligned(x.master, detail::vec4_align(x.master_dtype)) && detail::aligned(x.grad, 16) &&
                    (buf == nullptr || detail::aligned(buf, detail::vec4_align(x.state_dtype)));
        return x.n;
      };
      auto launch = [&](const SgdMixedTable& b, unsigned blocks) {
        sgd_mixed_many_kernel<decltype(pt)::value, decltype(st)::value>
            <<<blocks, kThreads, 0, detail::as_stream(stream)>>>(b);
        return detail::launch_result();
      };
      return launch_tables<SgdMixedTable>(count, add, launch);
    });
    if (r != 0) return r;
  }
  return 0;
}

int adam_step(float* master, float* exp_avg, float* exp_avg_sq, const float* grad, size_t n,
              const AdamHyper& h, float grad_scale, void* working, WorkDtype working_dtype,
              void* stream) {
  if (n == 0) return 0;
  if (!master || !exp_avg || !exp_avg_sq || !grad) return kInvalid;
  if (working && !detail::valid_dtype(working_dtype)) return kInvalid;
  if (h.bias_correction && h.step < 1) return kInvalid;  // adam_consts would throw
  const AdamC c = adam_consts(h, grad_scale);
  const bool vec4 = detail::aligned(master, 16) && detail::aligned(exp_avg, 16) &&
                    detail::aligned(exp_avg_sq, 16) && detail::aligned(grad, 16) &&
                    work_vec4_ok(working, working_dtype);
  return with_work(working, working_dtype, [&](auto has_work, auto dt) {
    using Op = AdamOp<decltype(has_work)::value, decltype(dt)::value>;
    return detail::launch_elementwise(Op{master, exp_avg, exp_avg_sq, grad, working, c}, n, vec4,
                                      stream);
  });
}

int sgd_step(float* master, float* momentum_buf, const float* grad, size_t n, const SgdHyper& h,
             float grad_scale, void* working, WorkDtype working_dtype, void* stream) {
  if (n == 0) return 0;
  if (!master || !grad) return kInvalid;
  if (working && !detail::valid_dtype(working_dtype)) return kInvalid;
  const SgdC c = sgd_consts(h, grad_scale);
  if (c.has_mom && !momentum_buf) return kInvalid;
  float* buf = c.has_mom ? momentum_buf : nullptr;
  const bool vec4 = detail::aligned(master, 16) && detail::aligned(grad, 16) &&
                    (buf == nullptr || detail::aligned(buf, 16)) &&
                    work_vec4_ok(working, working_dtype);
  return with_work(working, working_dtype, [&](auto has_work, auto dt) {
    using Op = SgdOp<decltype(has_work)::value, decltype(dt)::value>;
    return detail::launch_elementwise(Op{master, buf, grad, working, c}, n, vec4, stream);
  });
}

int adam_step_mixed(void* master, WorkDtype master_dtype, void* exp_avg, void* exp_avg_sq,
                    WorkDtype state_dtype, const float* grad, size_t n, const AdamHyper& h,
                    float grad_scale, void* stream) {
  if (n == 0) return 0;
  if (!master || !exp_avg || !exp_avg_sq || !grad) return kInvalid;
  if (!mixed_dtype(master_dtype) || !mixed_dtype(state_dtype)) return kInvalid;
  if (h.bias_correction && h.step < 1) return kInvalid;  // adam_consts would throw
  const AdamC c = adam_consts(h, grad_scale);
  const bool vec4 = detail::aligned(master, detail::vec4_align(master_dtype)) &&
                    detail::aligned(exp_avg, detail::vec4_align(state_dtype)) &&
                    detail::aligned(exp_avg_sq, detail::vec4_align(state_dtype)) &&
                    detail::aligned(grad, 16);
  return with_mixed(master_dtype, state_dtype, [&](auto pt, auto st) {
    using Op = AdamMixedOp<decltype(pt)::value, decltype(st)::value>;
    return detail::launch_elementwise(Op{master, exp_avg, exp_avg_sq, grad, c}, n, vec4, stream);
  });
}

int sgd_step_mixed(void* master, WorkDtype master_dtype, void* momentum_buf, WorkDtype state_dtype,
                   const float* grad, size_t n, const SgdHyper& h, float grad_scale, void* stream) {
  if (n == 0) return 0;
  if (!master || !grad) return kInvalid;
  if (!mixed_dtype(master_dtype) || !mixed_dtype(state_dtype)) return kInvalid;
  const SgdC c = sgd_consts(h, grad_scale);
  if (c.has_mom && !momentum_buf) return kInvalid;
  void* buf = c.has_mom ? momentum_buf : nullptr;
  const bool vec4 = detail::aligned(master, detail::vec4_align(master_dtype)) &&
                    detail::aligned(grad, 16) &&
                    (buf == nullptr || detail::aligned(buf, detail::vec4_align(state_dtype)));
  return with_mixed(master_dtype, state_dtype, [&](auto pt, auto st) {
    using Op = SgdMixedOp<decltype(pt)::value, decltype(st)::value>;
    return detail::launch_elementwise(Op{master, buf, grad, c}, n, vec4, stream);
  });
}

}  // namespace zs::kernels::cuda
