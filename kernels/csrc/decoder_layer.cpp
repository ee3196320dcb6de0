// A target decoder layer in one call on the CPU (kernels/decoder_layer.py): what
// runtime/models/{decoder,attention,mlp,linear}.py do one PyTorch operation at a time (about 15
// a layer), with the same kernels (ops.h) called in the same order on the same tensors, so it
// gives the same bits. What it saves is the Python and PyTorch dispatch between them: about
// 1 ms of an 8 ms one-row step of the real CPU target on Zen 5 (24 layers), and 3 of 31 on a
// slower Intel guest (docs/nvfp4.md).
//
//   layer = torch.classes.hetero_run.TargetLayer(heads, kv_heads, head_dim, eps, qk_eps, scale,
//                                                input_norm, post_norm, qk_norm, k_cache, v_cache)
//   layer.set_product(which, w, codes, block_scale, row_scale, bias)   # 0 qkv, 1 o, 2 gate_up, 3 down
//   y = layer.attention(h, cos, sin, write_slots, key_slots, key_offsets)  # o's product, before its
//                                                                         # all-reduce and bias
//   y = layer.mlp(h)                                                      # down's, likewise
//   h = layer.forward(h, cos, sin, write_slots, key_slots, key_offsets)   # one rank: both, the
//                                                                         # biases and residuals
//
// h [n, hidden] bf16 (forward adds into it); cos, sin [n, 1, head_dim] bf16 (runtime/models/
// rotary.py); the slots and offsets int64 as runtime/models/attention.py's AttentionRows holds
// them. Dense weights are bf16 [out, in]; NVFP4 ones codes uint8 [out, in/2], block scales as
// their bytes (uint8 [out, in/16]) and float32 row scales; activations stay bf16 (W4A16).
#include <ATen/ATen.h>
#include <torch/custom_class.h>
#include <torch/library.h>

#include <optional>

#include "check.h"
#include "ops.h"

namespace hetero_run_layer {
namespace {

using at::Tensor;
namespace ops = hetero_run_cpu::ops;

// One linear layer: x [n, in] bf16 -> x @ W.T [n, out] bf16 (rounded by the kernel, as the
// runtime's weights ask for it); the bias is the caller's.
struct Product {
  Tensor w, codes, scales, row_scale, bias;
  bool set() const { return w.defined() || codes.defined(); }
  Tensor operator()(const Tensor& x) const {
    return w.defined() ? ops::dense_linear(x, w, 0, true) : ops::nvfp4_linear(x, codes, scales, row_scale, 0, true);
  }
};

}  // namespace

struct TargetLayer : torch::CustomClassHolder {
  int64_t heads, kv_heads, head_dim;
  double eps, qk_eps, scale;
  Tensor input_norm, post_norm, qk_norm, k_cache, v_cache;
  Product products[4];  // qkv, o, gate_up, down

  TargetLayer(int64_t heads_, int64_t kv_heads_, int64_t head_dim_, double eps_, double qk_eps_, double scale_,
              Tensor input_norm_, Tensor post_norm_, std::optional<Tensor> qk_norm_, Tensor k_cache_, Tensor v_cache_)
      : heads(heads_), kv_heads(kv_heads_), head_dim(head_dim_), eps(eps_), qk_eps(qk_eps_), scale(scale_),
        input_norm(std::move(input_norm_)), post_norm(std::move(post_norm_)),
        qk_norm(qk_norm_ ? *qk_norm_ : Tensor()), k_cache(std::move(k_cache_)), v_cache(std::move(v_cache_)) {
    HR_CHECK(heads > 0 && kv_heads > 0 && heads % kv_heads == 0 && head_dim > 0, "heads ", heads,
             " must be a positive multiple of kv_heads ", kv_heads);
    for (const Tensor* t : {&input_norm, &post_norm, &k_cache, &v_cache})
      HR_CHECK(t->device().is_cpu() && t->scalar_type() == at::kBFloat16, "a fused layer's norms and caches are bf16");
    HR_CHECK(k_cache.dim() == 3 && v_cache.dim() == 3 && k_cache.size(0) == kv_heads && k_cache.size(2) == head_dim,
             "the caches must be [kv_heads, slots, head_dim]");
  }

  void set_product(int64_t which, std::optional<Tensor> w, std::optional<Tensor> codes,
                   std::optional<Tensor> scales, std::optional<Tensor> row_scale, std::optional<Tensor> bias) {
    HR_CHECK(which >= 0 && which < 4, "product must be 0 (qkv), 1 (o), 2 (gate_up) or 3 (down), got ", which);
    HR_CHECK(w.has_value() != codes.has_value(), "a product is dense (w) or NVFP4 (codes, scales, row_scale)");
    Product p;
    if (w) {
      HR_CHECK(w->dim() == 2 && w->scalar_type() == at::kBFloat16 && w->is_contiguous(),
               "a fused layer's dense weights are contiguous 2-D bf16");
      p.w = *w;
    } else {
      HR_CHECK(scales && row_scale && codes->scalar_type() == at::kByte && scales->scalar_type() == at::kByte,
               "NVFP4 needs codes and block scales as uint8, and row scales");
      p.codes = *codes;
      p.scales = *scales;
      p.row_scale = *row_scale;
    }
    if (bias) p.bias = *bias;
    products[which] = std::move(p);
  }

  Tensor attention(const Tensor& h, const Tensor& cos, const Tensor& sin, const Tensor& write_slots,
                   const Tensor& key_slots, const Tensor& key_offsets) {
    check_ready(h);
    const Product& qkv = products[0];
    const int64_t n = h.size(0), qk_size = (heads + kv_heads) * head_dim;
    Tensor y = qkv(ops::rms_norm(h, input_norm, eps));  // [n, (heads + 2 kv_heads) head_dim]
    if (qkv.bias.defined()) y.add_(qkv.bias);
    Tensor qk = y.narrow(1, 0, qk_size).view({n, heads + kv_heads, head_dim});
    const Tensor v = y.narrow(1, qk_size, kv_heads * head_dim).view({n, kv_heads, head_dim});
    if (qk_norm.defined()) qk = at::rms_norm(qk, {head_dim}, std::nullopt, qk_eps).mul(qk_norm);
    const Tensor q = ops::rope_write(qk, v, cos.reshape({n, head_dim}).contiguous(),
                                     sin.reshape({n, head_dim}).contiguous(), k_cache, v_cache,
                                     write_slots.contiguous(), heads);
    const Tensor out = ops::paged_attention(q, k_cache, v_cache, key_slots, key_offsets, scale);
    return products[1](out.reshape({n, heads * head_dim}));
  }

  Tensor mlp(const Tensor& h) {
    check_ready(h);
    const Product& gate_up = products[2];
    Tensor y = gate_up(ops::rms_norm(h, post_norm, eps));
    if (gate_up.bias.defined()) y.add_(gate_up.bias);
    return products[3](ops::silu_mul(y));
  }

  Tensor forward(Tensor h, const Tensor& cos, const Tensor& sin, const Tensor& write_slots, const Tensor& key_slots,
                 const Tensor& key_offsets) {
    Tensor y = attention(h, cos, sin, write_slots, key_slots, key_offsets);
    if (products[1].bias.defined()) y.add_(products[1].bias);
    h.add_(y);
    y = mlp(h);
    if (products[3].bias.defined()) y.add_(products[3].bias);
    h.add_(y);
    return h;
  }

 private:
  void check_ready(const Tensor& h) const {
    for (const Product& p : products) HR_CHECK(p.set(), "a fused layer needs all four products set");
    HR_CHECK(h.dim() == 2 && h.is_contiguous() && h.scalar_type() == at::kBFloat16 &&
                 h.size(1) == input_norm.size(0),
             "h must be contiguous bf16 [n, ", input_norm.size(0), "]");
  }
};

}  // namespace hetero_run_layer

TORCH_LIBRARY_FRAGMENT(hetero_run, m) {
  m.class_<hetero_run_layer::TargetLayer>("TargetLayer")
      .def(torch::init<int64_t, int64_t, int64_t, double, double, double, at::Tensor, at::Tensor,
                       std::optional<at::Tensor>, at::Tensor, at::Tensor>())
      .def("set_product", &hetero_run_layer::TargetLayer::set_product)
      .def("attention", &hetero_run_layer::TargetLayer::attention)
      .def("mlp", &hetero_run_layer::TargetLayer::mlp)
      .def("forward", &hetero_run_layer::TargetLayer::forward);
}
