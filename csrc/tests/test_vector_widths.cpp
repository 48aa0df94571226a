// The kernels written once per vector width (packed_linear's tiles, decode_attention's per-head
// loop: 4 floats on the x86-64 baseline, 8 with AVX2, 16 with AVX-512) at every width, against
// double-precision loops. A CPU runs only its own width's copy, so without this test the AVX-512
// copies would be checked only on AVX-512 machines: here each width's template is compiled for the
// build machine's baseline target (GCC lowers the wider vectors to what it has), the same
// arithmetic in the same order. The sources are included, not linked: their kernels are internal.
// Built by CMakeLists.txt and run by ctest (`make ctest`).
#include "../decode_attention_cpu.cpp"
#include "../packed_linear_cpu.cpp"

#include <cmath>
#include <cstdio>
#include <random>
#include <string>
#include <vector>

namespace {

int failures = 0;

void check(bool ok, const std::string& what) {
  std::printf("%s %s\n", ok ? "PASS" : "FAIL", what.c_str());
  if (!ok) ++failures;
}

std::vector<float> normal(int64_t n, std::mt19937& g, float scale = 1.0f) {
  std::normal_distribution<float> dist(0.0f, scale);
  std::vector<float> v(n);
  for (float& x : v) x = dist(g);
  return v;
}

// attend<W> for one head: heads of D floats (whole vectors, and a tail of D % W), L keys (fewer
// than the four scored at once, and not a multiple of four), scores spread from ~1 to ~100 (softmax
// weights below float32's range).
template <int W>
void test_attend(std::mt19937& g) {
  double max_err = 0.0;
  for (const int64_t D : {8, 16, 44, 128})
    for (const int64_t L : {1, 3, 4, 5, 17, 135})
      for (const float q_scale : {1.0f, 30.0f}) {
        const std::vector<float> q = normal(D, g, q_scale), k = normal(L * D, g), v = normal(L * D, g);
        std::vector<double> s(L), ref(D, 0.0);
        double top = -INFINITY, total = 0.0;
        for (int64_t l = 0; l < L; ++l) {
          double dot = 0.0;
          for (int64_t d = 0; d < D; ++d) dot += double(q[d]) * k[l * D + d];
          s[l] = dot * 0.25;
          top = std::max(top, s[l]);
        }
        for (double& x : s) total += (x = std::exp(x - top));
        for (int64_t d = 0; d < D; ++d) {
          for (int64_t l = 0; l < L; ++l) ref[d] += s[l] * v[l * D + d] / total;
        }
        std::vector<float> scores(L), out(D);
        nanochat_fast::attend<W>(q.data(), k.data(), v.data(), {0, 0, D}, L, D, 0.25f, scores.data(), out.data());
        for (int64_t d = 0; d < D; ++d) max_err = std::max(max_err, std::abs(out[d] - ref[d]) / q_scale);
      }
  check(max_err < 1e-5, "decode attention, " + std::to_string(W) +
                            "-float vectors, matches a double loop (max error " + std::to_string(max_err) + ")");
}

// panels_of<W, MR> over every row count up to 2 MR + 1 (whole tiles and each shorter one), K around
// the 64-wide k block, N not a multiple of the 32-column panel; each row alone bitwise its row in
// the batch (the prefetch of the next panel, which depends on the row count, changes no sum).
template <int W, int MR>
void test_panels(std::mt19937& g) {
  const int64_t K = 100, N = 70, P = (N + nanochat_fast::kPanel - 1) / nanochat_fast::kPanel;
  const std::vector<float> w = normal(N * K, g), x = normal((2 * MR + 1) * K, g);
  std::vector<float> packed(P * K * nanochat_fast::kPanel, 0.0f);
  for (int64_t n = 0; n < N; ++n)
    for (int64_t k = 0; k < K; ++k) packed[(n / 32) * K * 32 + k * 32 + n % 32] = w[n * K + k];
  double max_err = 0.0;
  bool invariant = true;
  for (int64_t M = 1; M <= 2 * MR + 1; ++M) {
    std::vector<float> y(M * N), alone(N);
    nanochat_fast::panels_of<W, MR>(x.data(), M, K, packed.data(), N, y.data(), 0, P);
    for (int64_t m = 0; m < M; ++m) {
      for (int64_t n = 0; n < N; ++n) {
        double ref = 0.0;
        for (int64_t k = 0; k < K; ++k) ref += double(x[m * K + k]) * w[n * K + k];
        max_err = std::max(max_err, std::abs(y[m * N + n] - ref));
      }
      nanochat_fast::panels_of<W, MR>(x.data() + m * K, 1, K, packed.data(), N, alone.data(), 0, P);
      invariant = invariant && std::equal(alone.begin(), alone.end(), y.begin() + m * N);
    }
  }
  const std::string name =
      "packed products, " + std::to_string(W) + "-float vectors, " + std::to_string(MR) + "-row tiles";
  check(max_err < 1e-4, name + ", match a double loop (max error " + std::to_string(max_err) + ")");
  check(invariant, name + ": each row alone is bitwise its row in the batch");
}

}  // namespace

int main() {
  std::mt19937 g(0);
  test_attend<4>(g);
  test_attend<8>(g);
  test_attend<16>(g);
  test_panels<4, 3>(g);
  test_panels<8, 3>(g);
  test_panels<16, 8>(g);
  std::printf("%s\n", failures ? "SOME TESTS FAILED" : "every vector width passed");
  return failures ? 1 : 0;
}
