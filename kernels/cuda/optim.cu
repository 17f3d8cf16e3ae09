// The optimizer steps on the GPU: AdamW/Adam and SGD over fp32 master
// shards, with the working-dtype write-back; and the _mixed variants over
// masters and moments kept in fp32 or bf16 (bf16.bf16_master_weights_and_
// grads, bf16.bf16_optimizer_states). Each element runs
// kernels/elementwise.h's adam_elem / sgd_elem with the constants of
// adam_consts / sgd_consts (computed on the host, as for the CPU), so the
// results are bit-identical to kernels::adam_step_scalar / sgd_step_scalar.
#include "kernels/cuda/common.cuh"

namespace zs::kernels::cuda {
namespace {

using detail::kInvalid;

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

}  // namespace

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
