// A cached fp32 decode step's blocks (glm_lightning/model/model.py, Block) as one op each.
//
// Why: a decode step is bound by Python and dispatch. After its ops became C++ (site read, RMSNorm, panel_matmul, the
// KDA core, the MoE layer, the stream write), a KDA block was still ~13 calls from Python with module calls, views
// and checks between them (~0.2-0.3 ms of Python per block at 1 thread). Here the same kernels run in the same order
// as C++ function calls, so the values are those of the ops one by one bit for bit (tests/test_block_decode.py):
//
//   kda_block_decode(x [B, 1, n, C], conv_state, state, valid [B, 1] or None, w, f, i) -> streams [B, 1, n, C]
//       (h, post, res) = site_read_decode(x);  h = rms_norm(h)
//       raw = h W_qkv^T;  [f1 | g1 | b] = h [W_f1; W_g1; W_b]^T;  f = f1 W_f2^T + dt_bias;  gate = g1 W_g2^T + b_g2
//       o = kda_decode_core(raw, f, b, ..., conv_state, state, gate, ...) (with padding rows: its ops one by one,
//       kda_padded_core);  x = stream_write(res, x, post, o W_o^T);  then the MoE half below
//   dsa_block_decode(x, k, v, index_k, key_valid, start, valid or None, cpp_attention, w, f, i) -> streams
//       the site read and RMSNorm, DSA's decode step (dsa_mixer: sparse, or dense within top-k keys) writing the cache at start, the stream write,
//       then the MoE half below
//   moe_half_decode(x [B, 1, n, C], w, f, i) -> streams [B, 1, n, C]
//       (h, post, res) = site_read_decode(x);  h = rms_norm(h);  x = stream_write(res, x, post, moe_decode(h))
//
// The parameters come as three flat lists, read in order (ops/block_decode.py builds them in the same order): per
// half its mHC site (w: phi, alpha, alpha_index, bias, gate scale, gate shift, the sub-layer's RMSNorm weight; f: the
// site's norm eps, Sinkhorn eps, the RMSNorm's eps; i: Sinkhorn iterations), then the sub-layer's (kda_mixer,
// moe_layer below). The matrices are panel_pack's panels (fp32 or bf16).
#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

#include <cmath>
#include <limits>
#include <optional>
#include <tuple>

// The kernels these ops call, defined in their own sources (one library, several translation units).
namespace panel_ops {
at::Tensor panel_matmul(const at::Tensor& x_in, const at::Tensor& P_in, int64_t out,
                        const std::optional<at::Tensor>& counts_in, const std::optional<at::Tensor>& bias_in);
}
namespace site_read_ops {
std::tuple<at::Tensor, at::Tensor, at::Tensor> site_read_decode(
    const at::Tensor& x, const at::Tensor& phi, const at::Tensor& alpha, const at::Tensor& alpha_index,
    const at::Tensor& bias, const at::Tensor& scale, const at::Tensor& shift, double norm_eps, int64_t iters,
    double eps);
}
namespace streams_ops {
at::Tensor stream_write(const at::Tensor& res, const at::Tensor& x, const at::Tensor& post, const at::Tensor& y);
}
namespace norm_ops {
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& w, double eps);
}
namespace kda_decode_ops {
at::Tensor kda_decode_core(const at::Tensor& raw, const at::Tensor& f, const at::Tensor& b, const at::Tensor& A_log,
                           const at::Tensor& rescale, double lb, at::Tensor conv_state, const at::Tensor& conv_weight,
                           at::Tensor S, const at::Tensor& gate, const at::Tensor& norm_weight, double eps);
at::Tensor conv_step_(at::Tensor conv_state, const at::Tensor& raw, const at::Tensor& weight);
at::Tensor delta_step_(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& g,
                       const at::Tensor& beta, at::Tensor S);
using FeaturesOp = c10::TypedOperatorHandle<std::tuple<at::Tensor, at::Tensor, at::Tensor>(
    const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&, double)>;
using HeadNormOp = c10::TypedOperatorHandle<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, double)>;
const FeaturesOp& features_op();
const HeadNormOp& head_norm_op();
}
namespace rotary_ops {
at::Tensor rotary_one(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin);
}
namespace decode_attention_ops {
at::Tensor index_scores_one(const at::Tensor& q, const at::Tensor& w, const at::Tensor& k);
at::Tensor topk_mask_one(const at::Tensor& scores, const at::Tensor& allowed, int64_t top_k);
at::Tensor single_query_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                  const at::Tensor& mask, double scale);
}
namespace moe_decode_ops {
at::Tensor moe_decode(const at::Tensor& x_in, const at::Tensor& router, int64_t E, const at::Tensor& bias, int64_t K,
                      double scale, const at::Tensor& gate_up, int64_t h2, const at::Tensor& down,
                      const std::optional<at::Tensor>& shared_gate_up, int64_t hs2,
                      const std::optional<at::Tensor>& shared_down);
}

namespace block_decode_ops {

// The three parameter lists, read front to back.
class Args {
 public:
  Args(at::TensorList w, at::ArrayRef<double> f, at::IntArrayRef i) : w_(w), f_(f), i_(i) {}
  const at::Tensor& tensor() {
    TORCH_CHECK(tw_ < w_.size(), "block decode: too few tensors");
    return w_[tw_++];
  }
  double real() {
    TORCH_CHECK(tf_ < f_.size(), "block decode: too few floats");
    return f_[tf_++];
  }
  int64_t integer() {
    TORCH_CHECK(ti_ < i_.size(), "block decode: too few ints");
    return i_[ti_++];
  }
  void check_done() const {
    TORCH_CHECK(tw_ == w_.size() && tf_ == f_.size() && ti_ == i_.size(), "block decode: parameters left over");
  }

 private:
  at::TensorList w_;
  at::ArrayRef<double> f_;
  at::IntArrayRef i_;
  size_t tw_ = 0, tf_ = 0, ti_ = 0;
};

struct Read {
  at::Tensor h, post, res;  // the sub-layer's normed input [rows, C] and the maps the stream write takes
};

// A site's read half (mhc.py HyperConnection.read) and the sub-layer's RMSNorm (Block's mixer_norm / moe_norm).
Read read_normed(const at::Tensor& x, Args& a) {
  const at::Tensor& phi = a.tensor();
  const at::Tensor& alpha = a.tensor();
  const at::Tensor& alpha_index = a.tensor();
  const at::Tensor& bias = a.tensor();
  const at::Tensor& scale = a.tensor();
  const at::Tensor& shift = a.tensor();
  const at::Tensor& norm_weight = a.tensor();
  const double site_eps = a.real(), sinkhorn_eps = a.real(), norm_eps = a.real();
  const int64_t iters = a.integer();
  auto [h, post, res] =
      site_read_ops::site_read_decode(x, phi, alpha, alpha_index, bias, scale, shift, site_eps, iters, sinkhorn_eps);
  return {norm_ops::rms_norm(h, norm_weight, norm_eps), post, res};  // [rows, C]: rms_norm's rows, no view
}

// ops/kda_decode.py _kda_decode_step with padding rows (valid [B] False: an identity step of the state): the raw
// projections zeroed at pads, the conv step, the features, the pads' k, g and beta zeroed, the delta step and the
// gated head norm, the separate C++ ops in that order (kda_decode_core has no pads) -> [rows, HK].
at::Tensor kda_padded_core(const at::Tensor& raw, const at::Tensor& f, const at::Tensor& b, const at::Tensor& A_log,
                           const at::Tensor& rescale, double lb, const at::Tensor& conv_state,
                           const at::Tensor& conv_weight, const at::Tensor& S, const at::Tensor& gate,
                           const at::Tensor& norm_weight, double eps, const at::Tensor& valid) {
  const auto& features = kda_decode_ops::features_op();
  const auto& head_norm = kda_decode_ops::head_norm_op();
  const int64_t B = S.size(0), H = S.size(1), K = S.size(2);
  const at::Tensor pad = valid.logical_not().view({B, 1}), pad3 = pad.view({B, 1, 1});
  const at::Tensor y = kda_decode_ops::conv_step_(conv_state, raw.masked_fill(pad, 0.0), conv_weight);  // [B, 3HK]
  auto [qk, g, beta] = features.call(y, f, b, A_log.exp(), rescale, lb);
  const at::Tensor qk3 = qk.view({B, 2 * H, K});
  const at::Tensor o = kda_decode_ops::delta_step_(
      qk3.slice(1, 0, H), qk3.slice(1, H, 2 * H).masked_fill(pad3, 0.0), y.view({B, 3 * H, K}).slice(1, 2 * H),
      g.view({B, H, K}).masked_fill(pad3, 0.0), beta.view({B, H}).masked_fill(pad, 0.0), S);  // [B, H, K]
  return head_norm.call(o, gate, norm_weight, eps).view({B, H * K});
}

// KDA's decode step (kda.py KDAttention.forward: _projections, ops.kda_decode_step's core, o_proj) on the normed h
// [rows, C]; conv_state and state updated in place. w: [W_q; W_k; W_v], [W_f1; W_g1; W_b], W_f2, dt_bias, W_g2, b_g2
// (panels and vectors), the conv weight [3HK, ks], A_log, the q/k rescale, the head norm's weight, W_o; f: the gate's
// lower bound, the head norm's eps; i: H, K, C.
at::Tensor kda_mixer(const at::Tensor& h, const at::Tensor& conv_state, const at::Tensor& state,
                     const std::optional<at::Tensor>& valid, Args& a) {
  const at::Tensor& qkv = a.tensor();
  const at::Tensor& small = a.tensor();
  const at::Tensor& f_b = a.tensor();
  const at::Tensor& dt_bias = a.tensor();
  const at::Tensor& g_b = a.tensor();
  const at::Tensor& g_bias = a.tensor();
  const at::Tensor& conv_weight = a.tensor();
  const at::Tensor& A_log = a.tensor();
  const at::Tensor& rescale = a.tensor();
  const at::Tensor& norm_weight = a.tensor();
  const at::Tensor& o_proj = a.tensor();
  const double lb = a.real(), norm_eps = a.real();
  const int64_t H = a.integer(), K = a.integer(), C = a.integer();
  const at::Tensor raw = panel_ops::panel_matmul(h, qkv, 3 * H * K, std::nullopt, std::nullopt);
  const at::Tensor fgb = panel_ops::panel_matmul(h, small, 2 * K + H, std::nullopt, std::nullopt);  // [f1 | g1 | b]
  const at::Tensor f = panel_ops::panel_matmul(fgb.slice(-1, 0, K), f_b, H * K, std::nullopt, dt_bias);
  const at::Tensor gate = panel_ops::panel_matmul(fgb.slice(-1, K, 2 * K), g_b, H * K, std::nullopt, g_bias);
  const at::Tensor b = fgb.slice(-1, 2 * K, 2 * K + H);
  const at::Tensor o =
      valid.has_value()
          ? kda_padded_core(raw, f, b, A_log, rescale, lb, conv_state, conv_weight, state, gate, norm_weight, norm_eps,
                            *valid)
          : kda_decode_ops::kda_decode_core(raw, f, b, A_log, rescale, lb, conv_state, conv_weight, state, gate,
                                            norm_weight, norm_eps);
  return panel_ops::panel_matmul(o, o_proj, C, std::nullopt, std::nullopt);
}

// The MoE layer (moe.py MoE.forward's decode branch) on the normed h [rows, C]. w: router, expert bias, gate_up, down
// panels, then the shared expert's gate_up and down panels where hs2 > 0; f: the routed scaling; i: E, top-k, 2h, 2hs.
at::Tensor moe_layer(const at::Tensor& h, Args& a) {
  const at::Tensor& router = a.tensor();
  const at::Tensor& expert_bias = a.tensor();
  const at::Tensor& gate_up = a.tensor();
  const at::Tensor& down = a.tensor();
  const double scale = a.real();
  const int64_t E = a.integer(), K = a.integer(), h2 = a.integer(), hs2 = a.integer();
  std::optional<at::Tensor> shared_gate_up, shared_down;
  if (hs2 > 0) {
    shared_gate_up = a.tensor();
    shared_down = a.tensor();
  }
  return moe_decode_ops::moe_decode(h, router, E, expert_bias, K, scale, gate_up, h2, down, shared_gate_up, hs2,
                                    shared_down);
}

// ops/dsa.py single_query_attention's PyTorch form (the op table's choice where its C++ op is slower): q [B, H, D],
// k and v [B, Hkv, S, D] (slices of the cache), mask [B, S] -> [B, H, D], the same ATen calls in the same order.
at::Tensor attention_aten(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& mask) {
  const int64_t B = q.size(0), H = q.size(1), D = q.size(2), Hkv = k.size(1), S = k.size(2), G = H / Hkv;
  at::Tensor logits = at::bmm(q.reshape({B * Hkv, G, D}), k.reshape({B * Hkv, S, D}).transpose(1, 2))
                          .view({B, Hkv, G, S});
  logits.mul_(std::pow(static_cast<double>(D), -0.5))
      .masked_fill_(mask.logical_not().view({B, 1, 1, S}), -std::numeric_limits<double>::infinity());
  return at::bmm(at::softmax(logits, -1).view({B * Hkv, G, S}), v.reshape({B * Hkv, S, D})).view({B, H, D});
}

// DSA's decode step (dsa.py SparseAttention._forward_cached for one token below the gathered form, no RoPE on the
// main attention) on the normed h [rows, C]: q/k/v projections and their RMSNorms, the indexer's key (LayerNorm,
// RoPE), the new token written into the cache at `start` (its key_valid from `valid`: False for a padding row); past
// top-k keys the indexer's query (RoPE, scaled head weights), its scores and the top-k key mask, within them (the
// dense bypass) the allowed keys; the single-query attention over the first start + 1 keys, o_proj. w: W_q, q_norm,
// W_k, k_norm, W_v, W_o, indexer W_q, W_w, W_k (panels), its LayerNorm's weight and bias, its RoPE table's cos and
// sin; f: q_norm, k_norm, LayerNorm eps, the head weights' scale; i: H, Hkv, D, H_I, D_I, top-k, C.
at::Tensor dsa_mixer(const at::Tensor& h, const at::Tensor& k_cache, const at::Tensor& v_cache,
                     const at::Tensor& index_k, const at::Tensor& key_valid, int64_t start,
                     const std::optional<at::Tensor>& valid, bool cpp_attention, Args& a) {
  const at::Tensor& wq = a.tensor();
  const at::Tensor& q_norm = a.tensor();
  const at::Tensor& wk = a.tensor();
  const at::Tensor& k_norm = a.tensor();
  const at::Tensor& wv = a.tensor();
  const at::Tensor& wo = a.tensor();
  const at::Tensor& iwq = a.tensor();
  const at::Tensor& iww = a.tensor();
  const at::Tensor& iwk = a.tensor();
  const at::Tensor& ik_weight = a.tensor();
  const at::Tensor& ik_bias = a.tensor();
  const at::Tensor& cos_table = a.tensor();
  const at::Tensor& sin_table = a.tensor();
  const double q_eps = a.real(), k_eps = a.real(), ik_eps = a.real(), w_scale = a.real();
  const int64_t H = a.integer(), Hkv = a.integer(), D = a.integer(), HI = a.integer(), DI = a.integer(),
                top_k = a.integer(), C = a.integer();
  const int64_t B = h.size(0), S = start + 1;
  const auto none = std::nullopt;
  const at::Tensor q = norm_ops::rms_norm(panel_ops::panel_matmul(h, wq, H * D, none, none), q_norm, q_eps);
  const at::Tensor k = norm_ops::rms_norm(panel_ops::panel_matmul(h, wk, Hkv * D, none, none), k_norm, k_eps);
  const at::Tensor v = panel_ops::panel_matmul(h, wv, Hkv * D, none, none);
  const at::Tensor cos = cos_table.slice(0, start, S), sin = sin_table.slice(0, start, S);
  const at::Tensor ik = rotary_ops::rotary_one(
      at::layer_norm(panel_ops::panel_matmul(h, iwk, DI, none, none), {DI}, ik_weight, ik_bias, ik_eps), cos, sin);
  k_cache.select(2, start).copy_(k.view({B, Hkv, D}));  // DSACache.append
  v_cache.select(2, start).copy_(v.view({B, Hkv, D}));
  index_k.select(1, start).copy_(ik);
  if (valid.has_value())  // a padding row's key is masked (its query keeps its own slot: topk_mask_one)
    key_valid.select(1, start).copy_(valid->reshape({B}));
  else
    key_valid.select(1, start).fill_(true);
  const at::Tensor allowed = key_valid.slice(1, 0, S);
  at::Tensor mask;
  if (S <= top_k) {  // the dense bypass: every allowed key, no indexer query or scores
    mask = allowed;
    if (valid.has_value()) {  // ops.fill_empty_rows: a query with no allowed key attends its own slot
      mask = allowed.clone();
      mask.select(1, start).logical_or_(allowed.any(1).logical_not());
    }
  } else {
    const at::Tensor iq = rotary_ops::rotary_one(
        panel_ops::panel_matmul(h, iwq, HI * DI, none, none).view({B, HI, DI}), cos, sin);
    const at::Tensor iw = panel_ops::panel_matmul(h, iww, HI, none, none) * w_scale;
    const at::Tensor scores = decode_attention_ops::index_scores_one(iq, iw, index_k.slice(1, 0, S));
    mask = decode_attention_ops::topk_mask_one(scores, allowed, top_k);
  }
  const at::Tensor keys = k_cache.slice(2, 0, S), values = v_cache.slice(2, 0, S), q3 = q.view({B, H, D});
  const at::Tensor out =
      cpp_attention
          ? decode_attention_ops::single_query_attention(q3, keys, values, mask, std::pow(static_cast<double>(D), -0.5))
          : attention_aten(q3, keys, values, mask);
  return panel_ops::panel_matmul(out.view({B, H * D}), wo, C, none, none);
}

void check_streams(const at::Tensor& x) {
  TORCH_CHECK(x.dim() == 4 && x.size(1) == 1 && x.scalar_type() == at::kFloat && x.is_contiguous(),
              "x must be contiguous fp32 streams [B, 1, n, C]");
}

at::Tensor moe_half(const at::Tensor& x, Args& a) {
  const Read r = read_normed(x, a);
  return streams_ops::stream_write(r.res, x, r.post, moe_layer(r.h, a));
}

at::Tensor moe_half_decode(const at::Tensor& x, at::TensorList w, at::ArrayRef<double> f, at::IntArrayRef i) {
  check_streams(x);
  Args a(w, f, i);
  at::Tensor out = moe_half(x, a);
  a.check_done();
  return out;
}

at::Tensor kda_block_decode(const at::Tensor& x, const at::Tensor& conv_state, const at::Tensor& state,
                            const std::optional<at::Tensor>& valid, at::TensorList w, at::ArrayRef<double> f,
                            at::IntArrayRef i) {
  check_streams(x);
  TORCH_CHECK(!valid.has_value() || (valid->scalar_type() == at::kBool && valid->numel() == x.size(0)),
              "valid must be bool [B, 1]");
  Args a(w, f, i);
  const Read r = read_normed(x, a);
  const at::Tensor mid = streams_ops::stream_write(r.res, x, r.post, kda_mixer(r.h, conv_state, state, valid, a));
  at::Tensor out = moe_half(mid, a);
  a.check_done();
  return out;
}

at::Tensor dsa_block_decode(const at::Tensor& x, const at::Tensor& k_cache, const at::Tensor& v_cache,
                            const at::Tensor& index_k, const at::Tensor& key_valid, int64_t start,
                            const std::optional<at::Tensor>& valid, bool cpp_attention, at::TensorList w,
                            at::ArrayRef<double> f, at::IntArrayRef i) {
  check_streams(x);
  TORCH_CHECK(start >= 0 && start < k_cache.size(2) && k_cache.size(0) == x.size(0), "the cache has no slot here");
  TORCH_CHECK(!valid.has_value() || (valid->scalar_type() == at::kBool && valid->numel() == x.size(0)),
              "valid must be bool [B, 1]");
  Args a(w, f, i);
  const Read r = read_normed(x, a);
  const at::Tensor y = dsa_mixer(r.h, k_cache, v_cache, index_k, key_valid, start, valid, cpp_attention, a);
  at::Tensor out = moe_half(streams_ops::stream_write(r.res, x, r.post, y), a);
  a.check_done();
  return out;
}

}  // namespace block_decode_ops

TORCH_LIBRARY_FRAGMENT(glm_lightning, m) {
  m.def("kda_block_decode(Tensor x, Tensor(a!) conv_state, Tensor(b!) state, Tensor? valid, Tensor[] w, float[] f, "
        "int[] i) -> Tensor");
  m.def("moe_half_decode(Tensor x, Tensor[] w, float[] f, int[] i) -> Tensor");
  m.def("dsa_block_decode(Tensor x, Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor(c!) index_k, Tensor(d!) key_valid, "
        "int start, Tensor? valid, bool cpp_attention, Tensor[] w, float[] f, int[] i) -> Tensor");
}

TORCH_LIBRARY_IMPL(glm_lightning, CPU, m) {
  m.impl("kda_block_decode", &block_decode_ops::kda_block_decode);
  m.impl("moe_half_decode", &block_decode_ops::moe_half_decode);
  m.impl("dsa_block_decode", &block_decode_ops::dsa_block_decode);
}
