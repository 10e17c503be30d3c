// eeserve CPU kernel: one whole Llama decoder layer for the rows of a pass, in one call.
//
// Contract: decoder_layer(h [R, D] float32, ...) -> the layer's output hidden [R, D], computing
// exactly what models/llama.py's LlamaDecoderLayer does through the engine's other ops (rms_norm,
// rotary_, decode_attention, span_attention, silu_mul and the linear kernels, called through the
// dispatcher), in the same order: h_mid = h + o(attn(rotary(qkv(norm1(h))))), out = h_mid +
// down(silu_mul(gate_up(norm2(h_mid)))). Each projection is either float32 in
// packing.pack_blocks's layout (its scale undefined: f32_linear), int8 in quant.pack_int8's
// layout with its scales (int8_linear), or GGUF blocks with their parts table in the scale's place
// (gguf_stacked_linear, gguf_linear.h). The rows' new K/V are written at slot_mapping before
// attention, which is engine/attention.py's PagedKVCache.attend: the row-wise rows (row_idx, or
// every row when row_idx is undefined and there is no span) attend one query each, row r to
// row_slots[r, :row_lens[r]]; span i (a prompt or a chunk of one) is the consecutive rows from
// span_starts[i], its queries at span_positions[i] over the context span_slots[i].
//
// gemma3_layer(...) is the same for models/gemma3.py's Gemma3DecoderLayer: q and k RMS-normed per
// head (q_norm, k_norm) before the rotation, the attention and MLP outputs normed before their
// residual adds (attn_out_norm, mlp_out_norm), the MLP's input normed by mlp_in_norm, GeGLU with
// tanh GELU (gelu_mul); no bias. Its cos/sin are the layer's own tables (local layers rotate with
// theirs), and a sliding-window layer's row_slots already hold only the window.
//
// Why: a layer is ~15 small operations, each a Python call through the module tree: the default
// model's batch-1 decode step spent 1.5-3 ms in Python between kernels (docs/cpu-performance.md),
// and a pass of a prompt chunk beside decode rows ~5 ms.

#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

namespace {

using OptT = c10::optional<at::Tensor>;

// x [R, K] -> [R, n] through the GGUF kernel for uint8 blocks (scale: their parts table), the int8
// kernel when the projection has scales, else float32.
at::Tensor project(const at::Tensor& x, const at::Tensor& w, const OptT& scale, const OptT& bias,
                   int64_t n) {
  if (w.scalar_type() == at::kByte) {
    static auto op = c10::Dispatcher::singleton()
                         .findSchemaOrThrow("eeserve::gguf_stacked_linear", "")
                         .typed<void(const at::Tensor&, const at::Tensor&, const at::Tensor&, at::Tensor)>();
    TORCH_CHECK(scale.has_value() && !bias.has_value(), "decoder_layer: GGUF blocks need their parts, no bias");
    at::Tensor out = at::empty({x.size(0), n}, x.options());
    op.call(x, w, *scale, out);
    return out;
  }
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

// x [..., n] (rows may be strided) -> RMS-normed over its last dimension, contiguous.
at::Tensor norm(const at::Tensor& x, const at::Tensor& w, double eps) {
  static auto rms = c10::Dispatcher::singleton()
                        .findSchemaOrThrow("eeserve::rms_norm", "")
                        .typed<at::Tensor(const at::Tensor&, const at::Tensor&, double)>();
  return rms.call(x, w, eps);
}

// Attention of the pass's queries q [R, H, hd] (rows strided), as PagedKVCache.attend.
at::Tensor attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                     const OptT& row_idx, const at::Tensor& row_slots, const at::Tensor& row_lens,
                     at::IntArrayRef span_starts, at::TensorList span_slots,
                     at::TensorList span_positions, double scale) {
  using AttnFn = at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                            const at::Tensor&, const at::Tensor&, double);
  static auto rows = c10::Dispatcher::singleton()
                         .findSchemaOrThrow("eeserve::decode_attention", "")
                         .typed<AttnFn>();
  static auto span = c10::Dispatcher::singleton()
                         .findSchemaOrThrow("eeserve::span_attention", "")
                         .typed<AttnFn>();
  const int64_t S = static_cast<int64_t>(span_starts.size());
  TORCH_CHECK(static_cast<int64_t>(span_slots.size()) == S && static_cast<int64_t>(span_positions.size()) == S,
              "decoder_layer: one start, context and positions per span");
  if (S == 0 && !row_idx.has_value()) return rows.call(q, k_cache, v_cache, row_slots, row_lens, scale);
  TORCH_CHECK(row_idx.has_value() || row_slots.size(0) == 0, "decoder_layer: row_idx with spans");
  if (S == 1 && row_slots.size(0) == 0 && span_starts[0] == 0 && span_positions[0].numel() == q.size(0))
    return span.call(q, k_cache, v_cache, span_slots[0], span_positions[0], scale);  // a prompt alone
  at::Tensor out = at::empty({q.size(0), q.size(1), q.size(2)}, q.options());
  if (row_slots.size(0) > 0)
    out.index_copy_(0, *row_idx, rows.call(q.index_select(0, *row_idx), k_cache, v_cache, row_slots, row_lens, scale));
  for (int64_t i = 0; i < S; ++i) {
    const int64_t n = span_positions[i].numel();
    TORCH_CHECK(span_starts[i] >= 0 && span_starts[i] + n <= q.size(0), "decoder_layer: a span past the rows");
    out.narrow(0, span_starts[i], n)
        .copy_(span.call(q.narrow(0, span_starts[i], n), k_cache, v_cache, span_slots[i], span_positions[i], scale));
  }
  return out;
}

at::Tensor decoder_layer(const at::Tensor& h, const at::Tensor& norm1, const at::Tensor& norm2, double eps,
                         const at::Tensor& qkv_w, const OptT& qkv_s, const OptT& qkv_b, const at::Tensor& o_w,
                         const OptT& o_s, const at::Tensor& gate_up_w, const OptT& gate_up_s,
                         const at::Tensor& down_w, const OptT& down_s, const at::Tensor& cos,
                         const at::Tensor& sin, const at::Tensor& k_cache, const at::Tensor& v_cache,
                         const at::Tensor& slot_mapping, const OptT& row_idx, const at::Tensor& row_slots,
                         const at::Tensor& row_lens, at::IntArrayRef span_starts, at::TensorList span_slots,
                         at::TensorList span_positions, int64_t num_heads, int64_t num_kv_heads,
                         int64_t intermediate, double scale) {
  static auto rot = c10::Dispatcher::singleton()
                        .findSchemaOrThrow("eeserve::rotary_", "")
                        .typed<void(at::Tensor&, const at::Tensor&, const at::Tensor&)>();
  static auto act = c10::Dispatcher::singleton()
                        .findSchemaOrThrow("eeserve::silu_mul", "")
                        .typed<at::Tensor(const at::Tensor&)>();
  TORCH_CHECK(h.dim() == 2 && h.scalar_type() == at::kFloat, "decoder_layer: h [R, D] float32");
  const int64_t R = h.size(0), D = h.size(1), hd = k_cache.size(2);
  const int64_t heads = num_heads + 2 * num_kv_heads;
  at::Tensor qkv = project(norm(h, norm1, eps), qkv_w, qkv_s, qkv_b, heads * hd).view({R, heads, hd});
  at::Tensor qk = qkv.narrow(1, 0, num_heads + num_kv_heads);
  rot.call(qk, cos, sin);
  const at::Tensor k = qkv.narrow(1, num_heads, num_kv_heads);
  const at::Tensor v = qkv.narrow(1, num_heads + num_kv_heads, num_kv_heads);
  k_cache.index_copy_(0, slot_mapping, k);
  v_cache.index_copy_(0, slot_mapping, v);
  const at::Tensor q = qkv.narrow(1, 0, num_heads);
  const at::Tensor o = attention(q, k_cache, v_cache, row_idx, row_slots, row_lens, span_starts, span_slots,
                                 span_positions, scale)
                           .view({R, num_heads * hd});
  // Residuals added into the projections' fresh outputs: no extra allocation per layer.
  const at::Tensor mid = project(o, o_w, o_s, c10::nullopt, D).add_(h);
  const at::Tensor gu = project(norm(mid, norm2, eps), gate_up_w, gate_up_s, c10::nullopt, 2 * intermediate);
  return project(act.call(gu), down_w, down_s, c10::nullopt, D).add_(mid);
}

at::Tensor gemma3_layer(const at::Tensor& h, const at::Tensor& in_norm, const at::Tensor& attn_out_norm,
                        const at::Tensor& mlp_in_norm, const at::Tensor& mlp_out_norm, const at::Tensor& q_norm,
                        const at::Tensor& k_norm, double eps, const at::Tensor& qkv_w, const OptT& qkv_s,
                        const at::Tensor& o_w, const OptT& o_s, const at::Tensor& gate_up_w, const OptT& gate_up_s,
                        const at::Tensor& down_w, const OptT& down_s, const at::Tensor& cos, const at::Tensor& sin,
                        const at::Tensor& k_cache, const at::Tensor& v_cache, const at::Tensor& slot_mapping,
                        const OptT& row_idx, const at::Tensor& row_slots, const at::Tensor& row_lens,
                        at::IntArrayRef span_starts, at::TensorList span_slots, at::TensorList span_positions,
                        int64_t num_heads, int64_t num_kv_heads, int64_t intermediate, double scale) {
  static auto rot = c10::Dispatcher::singleton()
                        .findSchemaOrThrow("eeserve::rotary_", "")
                        .typed<void(at::Tensor&, const at::Tensor&, const at::Tensor&)>();
  static auto geglu = c10::Dispatcher::singleton()
                          .findSchemaOrThrow("eeserve::gelu_mul", "")
                          .typed<at::Tensor(const at::Tensor&)>();
  TORCH_CHECK(h.dim() == 2 && h.scalar_type() == at::kFloat, "gemma3_layer: h [R, D] float32");
  const int64_t R = h.size(0), D = h.size(1), hd = k_cache.size(2);
  const int64_t H = num_heads, Hkv = num_kv_heads, heads = H + 2 * Hkv;
  at::Tensor qkv = project(norm(h, in_norm, eps), qkv_w, qkv_s, c10::nullopt, heads * hd).view({R, heads, hd});
  // q and k heads normed apart, then rotated together (one pass of the rotary kernel).
  at::Tensor qk = at::cat({norm(qkv.narrow(1, 0, H), q_norm, eps), norm(qkv.narrow(1, H, Hkv), k_norm, eps)}, 1);
  rot.call(qk, cos, sin);
  k_cache.index_copy_(0, slot_mapping, qk.narrow(1, H, Hkv));
  v_cache.index_copy_(0, slot_mapping, qkv.narrow(1, H + Hkv, Hkv));
  const at::Tensor o = attention(qk.narrow(1, 0, H), k_cache, v_cache, row_idx, row_slots, row_lens, span_starts,
                                 span_slots, span_positions, scale)
                           .view({R, H * hd});
  const at::Tensor mid = norm(project(o, o_w, o_s, c10::nullopt, D), attn_out_norm, eps).add_(h);
  const at::Tensor gu = project(norm(mid, mlp_in_norm, eps), gate_up_w, gate_up_s, c10::nullopt, 2 * intermediate);
  return norm(project(geglu.call(gu), down_w, down_s, c10::nullopt, D), mlp_out_norm, eps).add_(mid);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(eeserve, m) {
  m.def(
      "decoder_layer(Tensor h, Tensor norm1, Tensor norm2, float eps, Tensor qkv_w, Tensor? qkv_s, "
      "Tensor? qkv_b, Tensor o_w, Tensor? o_s, Tensor gate_up_w, Tensor? gate_up_s, Tensor down_w, "
      "Tensor? down_s, Tensor cos, Tensor sin, Tensor(a!) k_cache, Tensor(b!) v_cache, "
      "Tensor slot_mapping, Tensor? row_idx, Tensor row_slots, Tensor row_lens, int[] span_starts, "
      "Tensor[] span_slots, Tensor[] span_positions, int num_heads, int num_kv_heads, "
      "int intermediate, float scale) -> Tensor");
}

TORCH_LIBRARY_FRAGMENT(eeserve, m) {
  m.def(
      "gemma3_layer(Tensor h, Tensor in_norm, Tensor attn_out_norm, Tensor mlp_in_norm, "
      "Tensor mlp_out_norm, Tensor q_norm, Tensor k_norm, float eps, Tensor qkv_w, Tensor? qkv_s, "
      "Tensor o_w, Tensor? o_s, Tensor gate_up_w, Tensor? gate_up_s, Tensor down_w, Tensor? down_s, "
      "Tensor cos, Tensor sin, Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor slot_mapping, "
      "Tensor? row_idx, Tensor row_slots, Tensor row_lens, int[] span_starts, Tensor[] span_slots, "
      "Tensor[] span_positions, int num_heads, int num_kv_heads, int intermediate, float scale) "
      "-> Tensor");
}

TORCH_LIBRARY_IMPL(eeserve, CPU, m) {
  m.impl("decoder_layer", &decoder_layer);
  m.impl("gemma3_layer", &gemma3_layer);
}
