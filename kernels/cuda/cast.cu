// The casts and element-wise arithmetic of the gradient path on the GPU,
// through the shared conversions and float operations of
// kernels/elementwise.h: bit-identical to the CPU kernels, except that a
// NaN produced by arithmetic (scale, divide, add) is the GPU's canonical NaN
// where the CPU keeps an input NaN's payload and sign.
#include "kernels/cuda/common.cuh"

namespace zs::kernels::cuda {
namespace {

using detail::kInvalid;

template <WorkDtype T>
struct FromF32Op {
  const float* src;
  void* dst;
  template <int V>
  __device__ __forceinline__ void run(size_t i) const {
    float a[V];
    detail::ld<V>(src + i, a);
    detail::st_work<T, V>(dst, i, a);
  }
};

// Divide: dst = widen(src) / divisor.
template <WorkDtype T, bool Divide>
struct ToF32Op {
  const void* src;
  float* dst;
  float divisor;
  template <int V>
  __device__ __forceinline__ void run(size_t i) const {
    float a[V];
    detail::ld_work<T, V>(src, i, a);
    if constexpr (Divide) {
#pragma unroll
      for (int k = 0; k < V; ++k) a[k] = f_div(a[k], divisor);
    }
    detail::st<V>(dst + i, a);
  }
};

// Narrow: dst = round_to(D, widen(src) / divisor), one rounding (a gradient
// into a 16-bit reduction bucket).
template <WorkDtype S, WorkDtype D, bool Divide>
struct CastScaledOp {
  const void* src;
  void* dst;
  float divisor;
  template <int V>
  __device__ __forceinline__ void run(size_t i) const {
    float a[V];
    detail::ld_work<S, V>(src, i, a);
    if constexpr (Divide) {
#pragma unroll
      for (int k = 0; k < V; ++k) a[k] = f_div(a[k], divisor);
    }
    detail::st_work<D, V>(dst, i, a);
  }
};

template <WorkDtype T>
struct AddToOp {
  const void* src;
  float* dst;
  template <int V>
  __device__ __forceinline__ void run(size_t i) const {
    float a[V], d[V];
    detail::ld_work<T, V>(src, i, a);
    detail::ld<V>(dst + i, d);
#pragma unroll
    for (int k = 0; k < V; ++k) d[k] = f_add(d[k], a[k]);
    detail::st<V>(dst + i, d);
  }
};

template <WorkDtype T>
struct RefreshMasterOp {
  const void* working;
  float* master;
  template <int V>
  __device__ __forceinline__ void run(size_t i) const {
    float w[V], m[V];
    detail::ld_work<T, V>(working, i, w);
    detail::ld<V>(master + i, m);
#pragma unroll
    for (int k = 0; k < V; ++k) m[k] = refreshed_master(m[k], w[k], T);
    detail::st<V>(master + i, m);
  }
};

struct ScaleOp {
  float* x;
  float s;
  template <int V>
  __device__ __forceinline__ void run(size_t i) const {
    float a[V];
    detail::ld<V>(x + i, a);
#pragma unroll
    for (int k = 0; k < V; ++k) a[k] = f_mul(a[k], s);
    detail::st<V>(x + i, a);
  }
};

bool vec4_ok(const float* f, const void* w, WorkDtype t) {
  return detail::aligned(f, 16) && detail::aligned(w, detail::vec4_align(t));
}

int to_f32(const void* src, WorkDtype t, float* dst, size_t n, float divisor, bool divide,
           void* stream) {
  if (n == 0) return 0;
  if (!src || !dst || !detail::valid_dtype(t)) return kInvalid;
  const bool vec4 = vec4_ok(dst, src, t);
  return detail::with_dtype(t, [&](auto dt) {
    constexpr WorkDtype T = decltype(dt)::value;
    if (divide)
      return detail::launch_elementwise(ToF32Op<T, true>{src, dst, divisor}, n, vec4, stream);
    return detail::launch_elementwise(ToF32Op<T, false>{src, dst, divisor}, n, vec4, stream);
  });
}

}  // namespace

int scale_inplace(float* x, size_t n, float s, void* stream) {
  if (n == 0) return 0;
  if (!x) return kInvalid;
  return detail::launch_elementwise(ScaleOp{x, s}, n, detail::aligned(x, 16), stream);
}

int cast_from_f32(const float* src, void* dst, WorkDtype t, size_t n, void* stream) {
  if (n == 0) return 0;
  if (!src || !dst || !detail::valid_dtype(t)) return kInvalid;
  const bool vec4 = vec4_ok(src, dst, t);
  return detail::with_dtype(t, [&](auto dt) {
    return detail::launch_elementwise(FromF32Op<decltype(dt)::value>{src, dst}, n, vec4, stream);
  });
}

int cast_to_f32(const void* src, WorkDtype t, float* dst, size_t n, void* stream) {
  return to_f32(src, t, dst, n, 1.0f, false, stream);
}

// divisor 1 skips the division: x / 1 is x, but a NaN would come out as the
// canonical NaN instead of keeping its bits, as the CPU's widen does.
int cast_to_f32_scaled(const void* src, WorkDtype t, float* dst, size_t n, float divisor,
                       void* stream) {
  return to_f32(src, t, dst, n, divisor, divisor != 1.0f, stream);
}

// divisor 1 skips the division, as cast_to_f32_scaled does.
int cast_scaled(const void* src, WorkDtype st, void* dst, WorkDtype dt, size_t n, float divisor,
                void* stream) {
  if (n == 0) return 0;
  if (!src || !dst || !detail::valid_dtype(st) || !detail::valid_dtype(dt)) return kInvalid;
  const bool vec4 = detail::aligned(src, detail::vec4_align(st)) &&
                    detail::aligned(dst, detail::vec4_align(dt));
  const bool divide = divisor != 1.0f;
  return detail::with_dtype(st, [&](auto s) {
    return detail::with_dtype(dt, [&](auto d) {
      constexpr WorkDtype S = decltype(s)::value, D = decltype(d)::value;
      if (divide)
        return detail::launch_elementwise(CastScaledOp<S, D, true>{src, dst, divisor}, n, vec4,
                                          stream);
      return detail::launch_elementwise(CastScaledOp<S, D, false>{src, dst, divisor}, n, vec4,
                                        stream);
    });
  });
}

int add_to_f32(const void* src, WorkDtype t, float* dst, size_t n, void* stream) {
  if (n == 0) return 0;
  if (!src || !dst || !detail::valid_dtype(t)) return kInvalid;
  const bool vec4 = vec4_ok(dst, src, t);
  return detail::with_dtype(t, [&](auto dt) {
    return detail::launch_elementwise(AddToOp<decltype(dt)::value>{src, dst}, n, vec4, stream);
  });
}

int refresh_master(const void* working, WorkDtype t, float* master, size_t n, void* stream) {
  if (n == 0) return 0;
  if (!working || !master || !detail::valid_dtype(t)) return kInvalid;
  const bool vec4 = vec4_ok(master, working, t);
  return detail::with_dtype(t, [&](auto dt) {
    return detail::launch_elementwise(RefreshMasterOp<decltype(dt)::value>{working, master}, n, vec4,
                                      stream);
  });
}

int add_f32(float* dst, const float* src, size_t n, void* stream) {
  return add_to_f32(src, WorkDtype::F32, dst, n, stream);
}

}  // namespace zs::kernels::cuda
