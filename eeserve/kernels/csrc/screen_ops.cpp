// eeserve CPU kernel: the screened LM head's int8 pass, reduced to what the screen reads.
//
// Contract: int8_screen(x, w, scale, n, coeff, row_scale) -> (hi [M, T], floor [M]) for x [M, K]
// float32, w and scale an int8 weight [n, K] in int8_linear's layout (int8_ops.cpp), coeff [M]
// and row_scale [n] float32, T = ceil(n / 32). With a = int8_linear(x, w, scale, None, n) and
// b[m, i] = coeff[m] * row_scale[i] (the screen's error bound, kernels/screened_head.py):
//   hi[m, t]  = max over ids i of tile t (i < n) of a[m, i] + b[m, i]
//   floor[m]  = max over every id i of a[m, i] - b[m, i]
// so tile t can hold row m's maximum only if hi[m, t] >= floor[m]. The logits a are computed by
// int8_tiles (the int8 linear's own compiled code) into a small per-task buffer and reduced
// there: the [M, n] logits and bounds are never written to memory, which at 32 rows of a
// 262k-id head cost more than the int8 pass itself.
//
// f32_tiles_at(x, w, ids) -> [M, 32 n] for x [M, K] float32, w a float32 weight in f32_linear's
// layout (f32_ops.cpp, [2 T, K, 16]) and ids [n] int64 tile indices: columns 32 j .. 32 j + 31
// are outputs 32 ids[j] .. of f32_linear(x, w) (zero past its N), computed by f32_tiles, the
// linear's own code, on the same rows: the same bits, without gathering the tiles' weights.
//
// Registered as torch.ops.eeserve.int8_screen and .f32_tiles_at (native.py builds them with the
// other kernels).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "linear_tiles.h"

#include <algorithm>
#include <cstdint>
#include <limits>
#include <tuple>
#include <vector>

namespace {

using eeserve_linear::CHUNK;
using eeserve_linear::TILE;
constexpr int64_t CB = 16;           // output channels per block of the packed layout
constexpr int64_t TASK_TILES = 16;   // 512 ids per task: rows x 512 floats stay in L2

std::tuple<at::Tensor, at::Tensor> int8_screen(const at::Tensor& x, const at::Tensor& w,
                                               const at::Tensor& scale, int64_t n,
                                               const at::Tensor& coeff, const at::Tensor& row_scale) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat, "int8_screen: x [M, K] float32");
  TORCH_CHECK(w.dim() == 4 && w.size(2) == CB && w.size(3) == 2 && w.scalar_type() == at::kChar &&
                  w.is_contiguous(),
              "int8_screen: w [blocks, Kp / 2, 16, 2] contiguous int8");
  const int64_t M = x.size(0), K = x.size(1), Kp = (K + CHUNK - 1) / CHUNK * CHUNK;
  const int64_t T = (n + TILE - 1) / TILE;
  TORCH_CHECK(M > 0 && n > 0 && w.size(1) * 2 == Kp && w.size(0) == T * 2,
              "int8_screen: w holds ", w.size(0) * CB, " channels of ", w.size(1) * 2, " inputs; x ", K,
              " inputs, n ", n);
  const int64_t groups = scale.dim() == 3 ? scale.size(1) : 0;
  TORCH_CHECK(scale.scalar_type() == at::kFloat && groups > 0 && scale.size(0) == w.size(0) &&
                  scale.size(2) == CB && (groups == 1 || groups * CHUNK == K),
              "int8_screen: scale [blocks, groups, 16] float32, groups 1 or K / 32");
  TORCH_CHECK(coeff.dim() == 1 && coeff.size(0) == M && coeff.scalar_type() == at::kFloat,
              "int8_screen: coeff [M] float32");
  TORCH_CHECK(row_scale.dim() == 1 && row_scale.size(0) == n && row_scale.scalar_type() == at::kFloat,
              "int8_screen: row_scale [n] float32");
  const at::Tensor xf = x.contiguous(), sc = scale.contiguous();
  const at::Tensor cf = coeff.contiguous(), rsf = row_scale.contiguous();
  at::Tensor xq = at::empty({M, Kp}, xf.options().dtype(at::kShort));
  at::Tensor xs = at::empty({M, Kp / CHUNK}, xf.options());
  eeserve_linear::int8_quantize_rows(xf.data_ptr<float>(), M, K, Kp, xq.data_ptr<int16_t>(),
                                     xs.data_ptr<float>());
  const int64_t tasks = (T + TASK_TILES - 1) / TASK_TILES;
  at::Tensor hi = at::empty({M, T}, xf.options());
  at::Tensor floors = at::empty({tasks, M}, xf.options());  // each task's floor, reduced below
  const int8_t* wp = w.data_ptr<int8_t>();
  const float* sp = sc.data_ptr<float>();
  const float *c = cf.data_ptr<float>(), *rs = rsf.data_ptr<float>();
  float *hp = hi.data_ptr<float>(), *fp = floors.data_ptr<float>();
  at::parallel_for(0, tasks, 1, [&](int64_t lo, int64_t end) {
    std::vector<float> buf(M * TASK_TILES * TILE);  // [M, ids of the task]
    for (int64_t task = lo; task < end; ++task) {
      const int64_t t0 = task * TASK_TILES, t1 = std::min(T, t0 + TASK_TILES);
      const int64_t n0 = t0 * TILE, ids = std::min(n, t1 * TILE) - n0;
      // The task's channels as a linear of its own: int8_tiles writes y [M, ids].
      const eeserve_linear::Int8Args a{xq.data_ptr<int16_t>(), xs.data_ptr<float>(), wp + n0 * Kp,
                                       sp + n0 * groups, nullptr, buf.data(), M, Kp, ids, groups};
      eeserve_linear::int8_tiles(a, 0, t1 - t0);
      for (int64_t m = 0; m < M; ++m) {
        const float* y = buf.data() + m * ids;
        float floor = -std::numeric_limits<float>::infinity();
        for (int64_t t = t0; t < t1; ++t) {
          float top = -std::numeric_limits<float>::infinity();
          for (int64_t i = (t - t0) * TILE; i < std::min(ids, (t - t0 + 1) * TILE); ++i) {
            const float b = c[m] * rs[n0 + i];
            top = std::max(top, y[i] + b);
            floor = std::max(floor, y[i] - b);
          }
          hp[m * T + t] = top;
        }
        fp[task * M + m] = floor;
      }
    }
  });
  return {hi, std::get<0>(floors.max(0))};
}

at::Tensor f32_tiles_at(const at::Tensor& x, const at::Tensor& w, const at::Tensor& ids) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat, "f32_tiles_at: x [M, K] float32");
  TORCH_CHECK(w.dim() == 3 && w.size(2) == CB && w.size(1) == x.size(1) && w.size(0) % 2 == 0 &&
                  w.scalar_type() == at::kFloat && w.is_contiguous(),
              "f32_tiles_at: w [2 T, K, 16] contiguous float32");
  TORCH_CHECK(ids.dim() == 1 && ids.scalar_type() == at::kLong, "f32_tiles_at: ids [n] int64");
  const at::Tensor xf = x.contiguous(), tid = ids.contiguous();
  const int64_t M = x.size(0), K = x.size(1), n = ids.numel(), T = w.size(0) / 2;
  const int64_t* t = tid.data_ptr<int64_t>();
  for (int64_t j = 0; j < n; ++j) TORCH_CHECK(t[j] >= 0 && t[j] < T, "f32_tiles_at: tile ", t[j], " of ", T);
  at::Tensor y = at::empty({M, n * TILE}, xf.options());
  const float *xp = xf.data_ptr<float>(), *wp = w.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, n, 1, [&](int64_t lo, int64_t hi) {
    std::vector<float> buf(M * TILE);  // [M, 32]: one tile's outputs
    for (int64_t j = lo; j < hi; ++j) {
      const eeserve_linear::F32Args a{xp, wp + t[j] * 2 * K * CB, nullptr, buf.data(), M, K, TILE};
      eeserve_linear::f32_tiles(a, 0, 1);
      for (int64_t m = 0; m < M; ++m) std::copy(buf.data() + m * TILE, buf.data() + (m + 1) * TILE, yp + (m * n + j) * TILE);
    }
  });
  return y;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(eeserve, m) {
  m.def("int8_screen(Tensor x, Tensor w, Tensor scale, int n, Tensor coeff, Tensor row_scale) -> (Tensor, Tensor)");
  m.def("f32_tiles_at(Tensor x, Tensor w, Tensor ids) -> Tensor");
}

TORCH_LIBRARY_IMPL(eeserve, CPU, m) {
  m.impl("int8_screen", &int8_screen);
  m.impl("f32_tiles_at", &f32_tiles_at);
}
