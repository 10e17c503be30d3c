// eeserve CPU kernel: one whole Llama decoder layer for decode rows, in one call.
//
// Contract: decode_layer(h [R, D] float32, ...) -> the layer's output hidden [R, D], computing
// exactly what models/llama.py's LlamaDecoderLayer does through the engine's other ops (rms_norm,
// rotary_, decode_attention, silu_mul and the linear kernels, called through the dispatcher), in
// the same order: h_mid = h + o(attn(rotary(qkv(norm1(h))))), out = h_mid + down(silu_mul(
// gate_up(norm2(h_mid)))). Each projection is either float32 in packing.pack_blocks's layout
// (its scale undefined: f32_linear) or int8 in quant.pack_int8's layout with its scales
// (int8_linear). The rows' new K/V are written at slot_mapping before attention; row r attends to
// row_slots[r, :row_lens[r]] (every row is a decode row: one query, context in the pool).
//
// Why: at one decode row a layer is ~15 small operations, each a Python call through the module
// tree, so the default model's batch-1 step spent 1.5-3 ms in Python between kernels (measured
// with the torch profiler, docs/cpu-performance.md): as much as all its attention and norms.

#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

namespace {

using OptT = c10::optional<at::Tensor>;

// x [R, K] -> [R, n] through the int8 kernel when the projection has scales, else float32.
at::Tensor project(const at::Tensor& x, const at::Tensor& w, const OptT& scale, const OptT& bias,
                   int64_t n) {
  if (scale.has_value()) {
    static auto op = c10::Dispatcher::singleton()
                         .findSchemaOrThrow("eeserve::int8_linear", "")
                         .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                           const OptT&, int64_t)>();
    return op.call(x, w, *scale, bias, n);
  }
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("eeserve::f32_linear", "")
                       .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const OptT&, int64_t)>();
  return op.call(x, w, bias, n);
}

at::Tensor decode_layer(const at::Tensor& h, const at::Tensor& norm1, const at::Tensor& norm2, double eps,
                        const at::Tensor& qkv_w, const OptT& qkv_s, const OptT& qkv_b, const at::Tensor& o_w,
                        const OptT& o_s, const at::Tensor& gate_up_w, const OptT& gate_up_s,
                        const at::Tensor& down_w, const OptT& down_s, const at::Tensor& cos,
                        const at::Tensor& sin, const at::Tensor& k_cache, const at::Tensor& v_cache,
                        const at::Tensor& slot_mapping, const at::Tensor& row_slots,
                        const at::Tensor& row_lens, int64_t num_heads, int64_t num_kv_heads,
                        int64_t intermediate, double scale) {
  static auto rms = c10::Dispatcher::singleton()
                        .findSchemaOrThrow("eeserve::rms_norm", "")
                        .typed<at::Tensor(const at::Tensor&, const at::Tensor&, double)>();
  static auto rot = c10::Dispatcher::singleton()
                        .findSchemaOrThrow("eeserve::rotary_", "")
                        .typed<void(at::Tensor&, const at::Tensor&, const at::Tensor&)>();
  static auto attn = c10::Dispatcher::singleton()
                         .findSchemaOrThrow("eeserve::decode_attention", "")
                         .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                           const at::Tensor&, const at::Tensor&, double)>();
  static auto act = c10::Dispatcher::singleton()
                        .findSchemaOrThrow("eeserve::silu_mul", "")
                        .typed<at::Tensor(const at::Tensor&)>();
  TORCH_CHECK(h.dim() == 2 && h.scalar_type() == at::kFloat, "decode_layer: h [R, D] float32");
  const int64_t R = h.size(0), D = h.size(1), hd = k_cache.size(2);
  const int64_t heads = num_heads + 2 * num_kv_heads;
  at::Tensor qkv = project(rms.call(h, norm1, eps), qkv_w, qkv_s, qkv_b, heads * hd).view({R, heads, hd});
  at::Tensor qk = qkv.narrow(1, 0, num_heads + num_kv_heads);
  rot.call(qk, cos, sin);
  const at::Tensor k = qkv.narrow(1, num_heads, num_kv_heads);
  const at::Tensor v = qkv.narrow(1, num_heads + num_kv_heads, num_kv_heads);
  k_cache.index_copy_(0, slot_mapping, k);
  v_cache.index_copy_(0, slot_mapping, v);
  const at::Tensor q = qkv.narrow(1, 0, num_heads);
  const at::Tensor o = attn.call(q, k_cache, v_cache, row_slots, row_lens, scale).view({R, num_heads * hd});
  // Residuals added into the projections' fresh outputs: no extra allocation per layer.
  const at::Tensor mid = project(o, o_w, o_s, c10::nullopt, D).add_(h);
  const at::Tensor gu = project(rms.call(mid, norm2, eps), gate_up_w, gate_up_s, c10::nullopt, 2 * intermediate);
  return project(act.call(gu), down_w, down_s, c10::nullopt, D).add_(mid);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(eeserve, m) {
  m.def(
      "decode_layer(Tensor h, Tensor norm1, Tensor norm2, float eps, Tensor qkv_w, Tensor? qkv_s, "
      "Tensor? qkv_b, Tensor o_w, Tensor? o_s, Tensor gate_up_w, Tensor? gate_up_s, Tensor down_w, "
      "Tensor? down_s, Tensor cos, Tensor sin, Tensor(a!) k_cache, Tensor(b!) v_cache, "
      "Tensor slot_mapping, Tensor row_slots, Tensor row_lens, int num_heads, int num_kv_heads, "
      "int intermediate, float scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(eeserve, CPU, m) { m.impl("decode_layer", &decode_layer); }
