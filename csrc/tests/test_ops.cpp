// C++ tests of the ops, through the dispatcher as any caller would reach them, against plain
// double-precision loops. Built by CMakeLists.txt and run by ctest (`make ctest`).
#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>

#include <cmath>
#include <cstdio>
#include <functional>
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

}  // namespace

int main() {
  test_adamw_matches_double_loop(at::kFloat);
  test_adamw_matches_double_loop(at::kBFloat16);
  test_adamw_rejects_bad_input();
  test_pack_rows_by_hand();
  std::printf("%s\n", failures ? "SOME TESTS FAILED" : "all C++ op tests passed");
  return failures ? 1 : 0;
}
