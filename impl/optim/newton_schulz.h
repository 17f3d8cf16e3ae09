// Muon's Newton-Schulz iteration: the orthogonal factor U V^T of a matrix's
// SVD, approximated by pushing its singular values toward 1, in fp32 on the
// device's BLAS (impl/device/blas.h). The two methods and the coefficients
// are DeepSpeed 0.19's (zeroshard/torch/muon.py has the same in torch):
// "standard" runs the quintic step on the matrix itself; "gram" runs it on
// the small Gram matrix R = X X^T and applies the product of the steps to X
// only at a restart (after two steps) and at the end, fewer flops when the
// matrix is far from square. The matrix is taken wide (rows <= cols); a
// tall one is worked on as its transpose without moving it: X X^T is
// G^T G, and a left product M X is G M^T.
#pragma once

#include <cstdint>

#include "impl/device/device.h"

namespace zs {

enum class NsMethod : int { Gram = 0, Standard = 1 };

// g (rows x cols, row-major, memory of dev) is replaced by its orthogonal
// factor's approximation after `steps` steps. Scratch comes from dev's pool.
void newton_schulz(Device& dev, float* g, int64_t rows, int64_t cols, NsMethod method, int steps);

// The iteration's flops for a rows x cols matrix (to balance owners).
double newton_schulz_cost(int64_t rows, int64_t cols);

}  // namespace zs
