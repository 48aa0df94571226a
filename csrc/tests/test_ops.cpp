// C++ tests of the ops, through the dispatcher as any caller would reach them, against plain
// double-precision loops. Built by CMakeLists.txt and run by ctest (`make ctest`).
#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>

#include <cfloat>
#include <cmath>
#include <cstdio>
#include <algorithm>
#include <limits>
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "adamw_slice_hparams.h"

namespace {

int failures = 0;

void check(bool ok, const std::string& what) {
  std::printf("%s %s\n", ok ? "PASS" : "FAIL", what.c_str());
  if (!ok) ++failures;
}

bool throws(const std::function<void()>& f) {
  try {
    f();
  } catch (const c10::Error&) {
    return true;
  }
  return false;
}

using AdamWFn = void(at::TensorList, at::TensorList, at::TensorList, at::TensorList, const at::Tensor&,
                     at::ArrayRef<double>, at::ArrayRef<double>);

auto adamw_op() {
  return c10::Dispatcher::singleton()
      .findSchemaOrThrow("nanochat_fast::adamw_slice_update", "")
      .typed<AdamWFn>();
}

// Ten AdamW steps over tensors of odd sizes, fp32 and bf16, against a double-precision loop.
void test_adamw_matches_double_loop(at::ScalarType dtype) {
  const std::vector<int64_t> sizes = {1, 7, 1023, 70000, 0};
  const double lr_mul[] = {1.0, 2.0, 0.5, 1.0, 1.0}, wd_mul[] = {1.0, 0.0, 1.0, 2.0, 1.0};
  const double beta1 = 0.8, beta2 = 0.95, eps = 1e-10, wd = 0.1;
  at::manual_seed(0);
  std::vector<at::Tensor> p, m, v;
  std::vector<std::vector<double>> P, M, V;
  for (int64_t n : sizes) {
    p.push_back(at::randn({n}).to(dtype));
    m.push_back(at::zeros({n}));
    v.push_back(at::zeros({n}));
    const at::Tensor p64 = p.back().to(at::kDouble);
    P.emplace_back(p64.data_ptr<double>(), p64.data_ptr<double>() + n);
    M.emplace_back(n, 0.0);
    V.emplace_back(n, 0.0);
  }
  // error in units of the allowed tolerance |got - ref| <= atol + rtol*|ref| (allclose)
  const double rtol = dtype == at::kFloat ? 1e-5 : 1e-2, atol = dtype == at::kFloat ? 1e-5 : 1e-2;
  double max_err = 0.0;
  for (int step = 1; step <= 10; ++step) {
    const double lr = 1e-2 * step;
    std::vector<at::Tensor> g;
    for (int64_t n : sizes) g.push_back(at::randn({n}).to(dtype));
    const double bc1 = 1 - std::pow(beta1, step), bc2_sqrt = std::sqrt(1 - std::pow(beta2, step));
    const at::Tensor hp = at::tensor({lr, beta1, beta2, eps, wd, bc1, bc2_sqrt}, at::kDouble);
    adamw_op().call(p, g, m, v, hp, lr_mul, wd_mul);
    for (size_t t = 0; t < sizes.size(); ++t) {
      const at::Tensor g64 = g[t].to(at::kDouble), p_now = p[t].to(at::kDouble);
      for (int64_t i = 0; i < sizes[t]; ++i) {
        const double gi = g64.data_ptr<double>()[i];
        P[t][i] *= 1 - lr * lr_mul[t] * wd * wd_mul[t];
        M[t][i] = beta1 * M[t][i] + (1 - beta1) * gi;
        V[t][i] = beta2 * V[t][i] + (1 - beta2) * gi * gi;
        P[t][i] -= lr * lr_mul[t] / bc1 * M[t][i] / (std::sqrt(V[t][i]) / bc2_sqrt + eps);
        const double got = p_now.data_ptr<double>()[i];
        max_err = std::max(max_err, std::abs(got - P[t][i]) / (atol + rtol * std::abs(P[t][i])));
        // bf16 params: continue the reference from the stored (rounded) value, as the op does
        if (dtype == at::kBFloat16) P[t][i] = got;
      }
    }
  }
  check(max_err <= 1.0, std::string("adamw_slice_update ") + c10::toString(dtype) +
                            " matches a double loop (max error " + std::to_string(max_err) +
                            " x tolerance)");
}

void test_adamw_rejects_bad_input() {
  const at::Tensor hp = at::zeros({nanochat_fast::kNumAdamWHParams}, at::kDouble);
  const double one[] = {1.0};
  check(throws([&] {
          at::Tensor p = at::zeros({4, 4}).t();
          adamw_op().call({p}, {at::zeros({4, 4})}, {at::zeros({4, 4})}, {at::zeros({4, 4})}, hp, one, one);
        }),
        "adamw_slice_update rejects a non-contiguous param");
  check(throws([&] {
          adamw_op().call({at::zeros({4})}, {at::zeros({5})}, {at::zeros({4})}, {at::zeros({4})}, hp, one, one);
        }),
        "adamw_slice_update rejects mismatched shapes");
  check(throws([&] {
          adamw_op().call({at::zeros({4})}, {at::zeros({4})}, {at::zeros({4}, at::kDouble)}, {at::zeros({4})}, hp, one, one);
        }),
        "adamw_slice_update rejects non-fp32 state");
  check(throws([&] {
          adamw_op().call({at::zeros({4})}, {at::zeros({4})}, {at::zeros({4})}, {at::zeros({4})},
                          at::zeros({3}, at::kDouble), one, one);
        }),
        "adamw_slice_update rejects a short hparams tensor");
}

using PackRowsFn = std::tuple<at::Tensor, c10::SymInt, c10::SymInt>(const at::Tensor&, const at::Tensor&,
                                                                    const at::Tensor&, int64_t);

// Two rows of T+1 = 6 from documents of 4, 2, 5 and 3 tokens (BOS = 0), worked by hand: row 0
// takes the 5-token document, then nothing fits its last slot, so the shortest (2 tokens) is cropped
// to 1; row 1 takes the 4-token one, and the 3-token one cropped to 2.
void test_pack_rows_by_hand() {
  auto op = c10::Dispatcher::singleton().findSchemaOrThrow("nanochat_fast::pack_rows", "").typed<PackRowsFn>();
  const at::Tensor tokens = at::tensor({0, 1, 2, 3, 0, 4, 0, 5, 6, 7, 8, 0, 9, 10}, at::kInt);
  const at::Tensor offsets = at::tensor({0, 4, 6, 11, 14}, at::kLong);
  const at::Tensor out = at::full({2, 6}, -1, at::kLong);
  auto [used, n_tokens, cropped] = op.call(tokens, offsets, out, 0);
  const at::Tensor expected = at::tensor({0, 5, 6, 7, 8, 0, 0, 1, 2, 3, 0, 9}, at::kLong).view({2, 6});
  check(at::equal(out, expected), "pack_rows fills rows by best fit and crops the shortest document");
  check(used.all().item<bool>() && n_tokens == 12 && cropped == 2, "pack_rows reports used documents and counts");
  check(throws([&] { op.call(tokens, offsets, at::zeros({4, 6}, at::kLong), 0); }),
        "pack_rows refuses to pack more rows than the documents fill");
  check(throws([&] { op.call(tokens, offsets, out, 7); }), "pack_rows refuses documents that do not start with BOS");
}

using SoftcapCEFn = std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor>(
    const at::Tensor&, const at::Tensor&, const at::Tensor&, double, int64_t, const std::optional<at::Tensor>&,
    int64_t);

auto softcap_ce_op() {
  return c10::Dispatcher::singleton()
      .findSchemaOrThrow("nanochat_fast::softcap_cross_entropy", "")
      .typed<SoftcapCEFn>();
}

// The op's hand-written tanh and exp over the whole input range: rows of logits [x, -x] for a
// dense sweep of x (both polynomial branches of tanh, its saturation, exp's clamps, infinities),
// loss and gradient against double precision; NaN logits must give NaN (the NaN guard relies on it).
void test_softcap_ce_sweep(double softcap) {
  std::vector<double> xs;
  for (int i = -4000; i <= 4000; ++i) xs.push_back(i * 1e-3 * std::abs(i) / 4.0);  // |x| up to 4000, dense near 0
  xs.push_back(INFINITY);
  xs.push_back(-INFINITY);
  const int64_t M = static_cast<int64_t>(xs.size());
  const at::Tensor hidden = at::tensor(xs, at::kDouble).to(at::kFloat).view({M, 1});
  const at::Tensor weight = at::tensor({1.0f, -1.0f}).view({2, 1});
  const at::Tensor targets = at::arange(M, at::kLong).remainder(2);
  auto [losses, total, dhidden, dweight] = softcap_ce_op().call(hidden, weight, targets, softcap, -1,
                                                                at::ones({}, at::kFloat), 1000);
  // The loss is a difference of numbers up to 2 softcap in size, so fp32 (ours and stock PyTorch's
  // log_softmax alike) cannot do better than a few ulps of 2 softcap; dlogits are O(1).
  const double loss_tol = 4 * softcap * FLT_EPSILON, grad_tol = 1e-6;
  double max_err = 0.0;  // in units of the tolerance
  for (int64_t i = 0; i < M; ++i) {
    const double x = hidden[i][0].item<double>();
    const double t = std::tanh(x / softcap), y0 = softcap * t, y1 = -y0;
    const double m = std::max(y0, y1), lse = m + std::log(std::exp(y0 - m) + std::exp(y1 - m));
    const int64_t target = i % 2;
    const double loss = lse - (target == 0 ? y0 : y1);
    const double p0 = std::exp(y0 - lse), p1 = std::exp(y1 - lse);
    const double grad = (1 - t * t) * ((p0 - (target == 0)) - (p1 - (target == 1)));
    max_err = std::max(max_err, std::abs(losses[i].item<double>() - loss) / loss_tol);
    max_err = std::max(max_err, std::abs(dhidden[i][0].item<double>() - grad) / grad_tol);
  }
  check(max_err <= 1.0, "softcap_cross_entropy (softcap " + std::to_string(softcap) +
                            ") matches double over x in [-4000, 4000] and +-inf (max error " +
                            std::to_string(max_err) + " x tolerance)");
  const at::Tensor nan_row = at::full({1, 1}, NAN);
  auto nan_out = softcap_ce_op().call(nan_row, weight, at::zeros({1}, at::kLong), softcap, -1, at::ones({}), 1);
  check(std::isnan(std::get<0>(nan_out).item<float>()) && std::isnan(std::get<2>(nan_out).item<float>()),
        "softcap_cross_entropy turns a NaN logit into a NaN loss and gradient");
}

void test_softcap_ce_rejects_bad_input() {
  const at::Tensor h = at::zeros({3, 4}), w = at::zeros({5, 4});
  check(throws([&] { softcap_ce_op().call(h, w, at::tensor({0, 5, 1}, at::kLong), 15.0, -1, std::nullopt, 2); }),
        "softcap_cross_entropy rejects a target outside [0, V)");
  check(throws([&] { softcap_ce_op().call(h, w.to(at::kBFloat16), at::zeros({3}, at::kLong), 15.0, -1, std::nullopt, 2); }),
        "softcap_cross_entropy rejects mixed dtypes");
  check(throws([&] { softcap_ce_op().call(h, w, at::zeros({3}, at::kLong), 15.0, -1, at::ones({2}), 2); }),
        "softcap_cross_entropy rejects a grad_scale of the wrong length");
}

auto packed_linear_ops() {
  auto& d = c10::Dispatcher::singleton();
  return std::make_pair(d.findSchemaOrThrow("nanochat_fast::pack_linear_weight", "").typed<at::Tensor(const at::Tensor&)>(),
                        d.findSchemaOrThrow("nanochat_fast::packed_linear", "")
                            .typed<at::Tensor(const at::Tensor&, const at::Tensor&, int64_t)>());
}

// packed_linear against a double loop, for 1..17 rows (two 8-row tiles and a tail) and a last panel
// of 6 columns; each row alone must give bitwise its row of the batch.
void test_packed_linear_matches_double_loop() {
  auto [pack, linear] = packed_linear_ops();
  const int64_t K = 100, N = 70;
  const at::Tensor w = at::randn({N, K}), x = at::randn({17, K});
  const at::Tensor packed = pack.call(w);
  const at::Tensor xd = x.to(at::kDouble), wd = w.to(at::kDouble);
  const auto xa = xd.accessor<double, 2>(), wa = wd.accessor<double, 2>();
  double max_err = 0.0;
  bool invariant = true;
  for (const int64_t rows : {1, 2, 3, 8, 9, 16, 17}) {
    const at::Tensor y = linear.call(x.narrow(0, 0, rows), packed, N);
    const at::Tensor yd = y.to(at::kDouble);
    const auto ya = yd.accessor<double, 2>();
    for (int64_t m = 0; m < rows; ++m) {
      for (int64_t n = 0; n < N; ++n) {
        double ref = 0.0;
        for (int64_t k = 0; k < K; ++k) ref += xa[m][k] * wa[n][k];
        max_err = std::max(max_err, std::abs(ya[m][n] - ref));
      }
      invariant = invariant && at::equal(y[m], linear.call(x.narrow(0, m, 1), packed, N)[0]);
    }
  }
  check(max_err < 1e-4, "packed_linear matches a double loop (max error " + std::to_string(max_err) + ")");
  check(invariant, "packed_linear: each row alone is bitwise its row in the batch");
  check(throws([&] { linear.call(x, packed, N + 40); }), "packed_linear rejects packs of another width");
}

// decode_attention against a double loop: 4 query heads over 2 key heads, rows in slots 2, 0, 1 of
// a strided cache view with their new tokens at positions 0, 8 and 3, from their first entry and
// with a window of 2 (rows then from 0, 6 and 1); rotary by random angles, QK-norm times 1.2.
void test_decode_attention_matches_double_loop() {
  using Fn = at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                        double, at::Tensor&, const at::Tensor&, const at::Tensor&, std::optional<int64_t>, double);
  auto attention = c10::Dispatcher::singleton().findSchemaOrThrow("nanochat_fast::decode_attention", "").typed<Fn>();
  const int64_t B = 3, H = 4, Hkv = 2, L = 9, D = 8;
  const double scale = 0.3, qk_scale = 1.2;
  const at::Tensor q = at::randn({B, 1, H, D}), k = at::randn({B, 1, Hkv, D}), v = at::randn({B, 1, Hkv, D});
  const at::Tensor angles = at::randn({B, 1, 1, D / 2}), cos = angles.cos(), sin = angles.sin();
  // rows 0 and 2 share slot 2 (a prompt's positions 0 and 3): row 2 reads the key row 0 writes
  const std::vector<int64_t> rows = {2, 0, 2}, positions = {0, 8, 3};
  // one head of x (row b) rotated and normed, in double
  auto rotate_and_norm = [&](const at::Tensor& x, int64_t b) {
    std::vector<double> out(D);
    double squares = 0.0;
    for (int64_t i = 0; i < D / 2; ++i) {
      const double x1 = x[i].item<double>(), x2 = x[i + D / 2].item<double>();
      const double c = cos[b][0][0][i].item<double>(), s = sin[b][0][0][i].item<double>();
      out[i] = x1 * c + x2 * s;
      out[i + D / 2] = -x1 * s + x2 * c;
    }
    for (double o : out) squares += o * o;
    for (double& o : out) o *= qk_scale / std::sqrt(squares / D + std::numeric_limits<float>::epsilon());
    return out;
  };
  for (const std::optional<int64_t> window : {std::optional<int64_t>(), std::optional<int64_t>(2)}) {
    at::Tensor storage = at::randn({2, 3, Hkv, 12, D}), cache = storage.narrow(3, 0, L);
    const at::Tensor out = attention.call(q, k, v, cos, sin, qk_scale, cache, at::tensor(rows, at::kLong),
                                          at::tensor(positions, at::kLong), window, scale);
    double max_err = 0.0;
    for (int64_t b = 0; b < B; ++b) {
      const int64_t p = positions[b], start = window ? std::max<int64_t>(0, p - *window) : 0;
      for (int64_t h = 0; h < Hkv; ++h) {  // the new key and value, written at the row's position
        const std::vector<double> key = rotate_and_norm(k[b][0][h], b);
        for (int64_t d = 0; d < D; ++d) {
          max_err = std::max(max_err, std::abs(cache[0][rows[b]][h][p][d].item<double>() - key[d]));
          max_err = std::max(max_err, std::abs(cache[1][rows[b]][h][p][d].item<double>() - v[b][0][h][d].item<double>()));
        }
      }
      for (int64_t h = 0; h < H; ++h) {
        const std::vector<double> query = rotate_and_norm(q[b][0][h], b);
        const at::Tensor keys = cache[0][rows[b]][h / 2].to(at::kDouble), values = cache[1][rows[b]][h / 2].to(at::kDouble);
        std::vector<double> w(p + 1, 0.0);
        double top = -INFINITY, total = 0.0;
        for (int64_t l = start; l <= p; ++l) {
          for (int64_t d = 0; d < D; ++d) w[l] += scale * query[d] * keys[l][d].item<double>();
          top = std::max(top, w[l]);
        }
        for (int64_t l = start; l <= p; ++l) total += (w[l] = std::exp(w[l] - top));
        for (int64_t d = 0; d < D; ++d) {
          double ref = 0.0;
          for (int64_t l = start; l <= p; ++l) ref += w[l] / total * values[l][d].item<double>();
          max_err = std::max(max_err, std::abs(out[b][0][h * D + d].item<double>() - ref));
        }
      }
    }
    check(max_err < 1e-5, "decode_attention matches a double loop with window " +
                              std::to_string(window.value_or(-1)) + " (max error " + std::to_string(max_err) + ")");
  }
  at::Tensor cache = at::randn({2, 3, Hkv, L, D});
  check(throws([&] {
          attention.call(q, k, v, cos, sin, qk_scale, cache, at::tensor(rows, at::kLong), at::tensor({0, 9, 3}, at::kLong),
                         std::nullopt, scale);
        }),
        "decode_attention rejects a position past the cache");
  check(throws([&] {
          attention.call(q, k, v, cos, sin, qk_scale, cache, at::tensor({1, 0, 1}, at::kLong),
                         at::tensor({3, 8, 3}, at::kLong), std::nullopt, scale);
        }),
        "decode_attention rejects two rows writing one position of a slot");
}

}  // namespace

int main() {
  test_adamw_matches_double_loop(at::kFloat);
  test_adamw_matches_double_loop(at::kBFloat16);
  test_adamw_rejects_bad_input();
  test_pack_rows_by_hand();
  test_softcap_ce_sweep(15.0);
  test_softcap_ce_sweep(60.0);
  test_softcap_ce_rejects_bad_input();
  test_packed_linear_matches_double_loop();
  test_decode_attention_matches_double_loop();
  std::printf("%s\n", failures ? "SOME TESTS FAILED" : "all C++ op tests passed");
  return failures ? 1 : 0;
}
