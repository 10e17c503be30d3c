// eeserve CPU kernel internals: the layout of decode_stack's and decode_stack_checked's tensor
// lists and codes (decode_stack.cpp), as one table per list. Included by stack_pass.h.
//
// Contract: each table below is an X-macro listing names in their order. It expands to an enum
// of named positions (what the readers index with: LlamaW::qkv_w, CheckW::norm, Measure::...) and
// to a constexpr array of the names, which the op stack_layout() returns; kernels/stack_layout.py
// checks its dataclasses' fields and its enums against those names when a decoder is built.
//
// Why: the Python side hands the tensors over as flat lists (a layer's tensors, layer after
// layer; a check's, check after check) and the measure as a code. Positions written twice, once
// per language, drift apart silently; one table per list, exported by name, makes a drift an
// error at load rather than a wrong tensor read as another.

#pragma once

#include <cstdint>
#include <iterator>

namespace eeserve_stack {

// The layer types of a call (its `arch` code: the position here).
#define EESERVE_STACK_ARCHS(X) X(Llama, llama) X(Gemma3, gemma3)

// A Llama layer's tensors in `weights`: decoder_layer's (layer_ops.cpp) without eps.
#define EESERVE_LLAMA_TENSORS(X) \
  X(norm1) X(norm2) X(qkv_w) X(qkv_s) X(qkv_b) X(o_w) X(o_s) X(gate_up_w) X(gate_up_s) X(down_w) X(down_s)

// A Gemma 3 layer's tensors in `weights`: gemma3_layer's (layer_ops.cpp) without eps.
#define EESERVE_GEMMA3_TENSORS(X)                                                                       \
  X(in_norm) X(attn_out_norm) X(mlp_in_norm) X(mlp_out_norm) X(q_norm) X(k_norm) X(qkv_w) X(qkv_s) X(o_w) \
      X(o_s) X(gate_up_w) X(gate_up_s) X(down_w) X(down_s)

// An exit check's tensors in `check_weights` (its eps travels in `check_eps`). A shortlist check
// reads pre_* (the tuned head's adapter, or three None), norm and rows_*; a classifier probe_*.
#define EESERVE_CHECK_TENSORS(X) X(pre_w) X(pre_s) X(pre_b) X(norm) X(rows_w) X(rows_s) X(probe_w) X(probe_b)

// The confidence measures decode_stack_checked computes (its `measure` code: the position here).
#define EESERVE_STACK_MEASURES(X) \
  X(ShortlistMaxProb, shortlist_max_prob) X(ShortlistMargin, shortlist_margin) X(Classifier, classifier)

#define EESERVE_POSITION(name) name,
#define EESERVE_NAME(name) #name,
#define EESERVE_CODE(enumerator, name) enumerator,
#define EESERVE_CODE_NAME(enumerator, name) #name,

enum class Arch : int64_t { EESERVE_STACK_ARCHS(EESERVE_CODE) count };
inline constexpr const char* ARCH_NAMES[] = {EESERVE_STACK_ARCHS(EESERVE_CODE_NAME)};

struct LlamaW {
  enum : int64_t { EESERVE_LLAMA_TENSORS(EESERVE_POSITION) count };
};
inline constexpr const char* LLAMA_TENSORS[] = {EESERVE_LLAMA_TENSORS(EESERVE_NAME)};

struct Gemma3W {
  enum : int64_t { EESERVE_GEMMA3_TENSORS(EESERVE_POSITION) count };
};
inline constexpr const char* GEMMA3_TENSORS[] = {EESERVE_GEMMA3_TENSORS(EESERVE_NAME)};

struct CheckW {
  enum : int64_t { EESERVE_CHECK_TENSORS(EESERVE_POSITION) count };
};
inline constexpr const char* CHECK_TENSORS[] = {EESERVE_CHECK_TENSORS(EESERVE_NAME)};

enum class Measure : int64_t { EESERVE_STACK_MEASURES(EESERVE_CODE) count };
inline constexpr const char* MEASURE_NAMES[] = {EESERVE_STACK_MEASURES(EESERVE_CODE_NAME)};

#undef EESERVE_POSITION
#undef EESERVE_NAME
#undef EESERVE_CODE
#undef EESERVE_CODE_NAME

static_assert(std::size(ARCH_NAMES) == static_cast<size_t>(Arch::count));
static_assert(std::size(LLAMA_TENSORS) == LlamaW::count);
static_assert(std::size(GEMMA3_TENSORS) == Gemma3W::count);
static_assert(std::size(CHECK_TENSORS) == CheckW::count);
static_assert(std::size(MEASURE_NAMES) == static_cast<size_t>(Measure::count));

// A layer's tensors in `weights` for its type.
inline int64_t per_layer(Arch a) {
  return a == Arch::Llama ? static_cast<int64_t>(LlamaW::count) : static_cast<int64_t>(Gemma3W::count);
}

}  // namespace eeserve_stack
