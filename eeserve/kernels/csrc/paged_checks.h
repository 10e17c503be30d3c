// eeserve CPU kernels: the argument checks that the paged attention kernels share.
//
// Contract: check_paged_attention(q, k_cache, v_cache, index1, index2, index_names) raises (through
// TORCH_CHECK) unless q is [rows, H, D] with contiguous heads (rows may be strided), the K/V pools
// are contiguous [slots, Hkv, D] of q's dtype with H a multiple of Hkv, and both index tensors
// are int64 (index_names names them in the message). Shared by decode_attention (cpu_ops.cpp)
// and span_attention (span_attention.cpp), which check their own index shapes after it.

#pragma once

#include <ATen/ATen.h>

namespace eeserve_checks {

inline void check_paged_attention(const at::Tensor& q, const at::Tensor& k_cache,
                                  const at::Tensor& v_cache, const at::Tensor& index1,
                                  const at::Tensor& index2, const char* index_names) {
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 3 && v_cache.dim() == 3, "bad ranks");
  TORCH_CHECK(q.stride(2) == 1 && q.stride(1) == q.size(2), "q's heads must be contiguous");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "the K/V pool must be contiguous");
  TORCH_CHECK(index1.scalar_type() == at::kLong && index2.scalar_type() == at::kLong, index_names,
              " must be int64");
  TORCH_CHECK(q.scalar_type() == k_cache.scalar_type() && q.scalar_type() == v_cache.scalar_type(),
              "q and the K/V pool must share a dtype");
  TORCH_CHECK(k_cache.size(2) == q.size(2) && q.size(1) % k_cache.size(1) == 0,
              "head shapes do not match");
}

}  // namespace eeserve_checks
