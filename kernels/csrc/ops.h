// The registered ops' entry points (cpu_linear.cpp, decode_ops.cpp) for the library's compound
// ops (decoder_layer.cpp): the functions torch.ops.hetero_run calls, so a compound op gives the
// bits the ops give one call at a time. Arguments as the ops document them.
#pragma once

#include <ATen/core/Tensor.h>

namespace hetero_run_cpu::ops {

at::Tensor nvfp4_linear(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& block_scale,
                        const at::Tensor& row_scale, int64_t path, bool bf16_out);
at::Tensor dense_linear(const at::Tensor& x, const at::Tensor& w, int64_t path, bool bf16_out);
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& w, double eps);
at::Tensor silu_mul(const at::Tensor& gate_up);
at::Tensor rope_write(const at::Tensor& qk, const at::Tensor& v, const at::Tensor& cos, const at::Tensor& sin,
                      const at::Tensor& k_cache, const at::Tensor& v_cache, const at::Tensor& write_slots,
                      int64_t heads);
at::Tensor paged_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& key_slots,
                           const at::Tensor& key_offsets, double scale);

}  // namespace hetero_run_cpu::ops
