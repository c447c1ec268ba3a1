// Row kernels for training on MLX's CPU backend: the exp-heavy steps of attention, the loss and SwiGLU, vectorized.
//
// MLX's CPU element-wise exp/sigmoid run one scalar at a time on x86-64; these primitives compute the same
// functions with a branch-free polynomial exp that the compiler vectorizes for the CPU it is built on (the build
// uses -march=native and is cached per CPU: AVX-512, AVX2, NEON, ...), on float32 rows split over threads. Matrix
// products stay in MLX (BLAS). Each primitive is exact to float32 rounding (exp within about 1 ulp; row sums in
// float32, vector lanes summed at the end).
//
// Rows of length E. A "causal" row r of a score block sees columns [0, first + (r % block) + 1) (clamped to
// [0, E]); the others are outside the mask: probability 0, gradient 0.
//
//   softmax_rows(S, causal, first, block) -> (P, lse)      P = exp(S - lse) on the visible columns, 0 elsewhere;
//                                                           lse = log sum_visible exp(S)  (-inf for an empty row)
//   softmax_rows_grad(S, dP, lse, D, ...) -> (P, dS)        P as above, dS = P * (dP - D)
//   cross_entropy_rows(Z, t) -> (lse, z_t)                  per row: log sum exp(Z), Z[t]
//   cross_entropy_with_grad(Z, t, w) -> (lse, z_t, dZ)      and dZ = w * (exp(Z - lse) - onehot(t)) (a row of
//                                                           weight 0: lse = z_t = 0, dZ = 0)
//   swiglu(g, u) -> g * sigmoid(g) * u                      differentiable (its VJP is swiglu_grad)
//   swiglu_grad(g, u, dy) -> (dg, du)

#include "cpu_common.h"

namespace {

void swiglu_loop(const float* g, const float* u, float* y, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; i++) y[i] = g[i] * sigmoid1(g[i]) * u[i];
}

// dg = dy * u * silu'(g), du = dy * silu(g) (dg may be g, du may be u)
void swiglu_grad_loop(const float* g, const float* u, const float* dy, float* dg, float* du,
                                    int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; i++) {
    float x = g[i], up = u[i], d = dy[i];
    float s = sigmoid1(x);
    dg[i] = d * up * (s * (1.0f + x * (1.0f - s)));
    du[i] = d * x * s;
  }
}

// ------------------------------------------------------------------------------------------- softmax

class SoftmaxRows : public CpuPrimitive {
 public:
  SoftmaxRows(mx::Stream s, Mask mask) : CpuPrimitive(s), mask_(mask) {}
  void eval_cpu(const std::vector<mx::array>& in, std::vector<mx::array>& out) override {
    const mx::array& s = in[0];
    take_or_allocate(s, out[0]);
    allocate(out[1]);
    auto& encoder = encoder_for(stream(), in, out);
    int64_t width = s.shape(-1), rows = s.size() / std::max<int64_t>(width, 1);
    encoder.dispatch([sp = s.data<float>(), pp = out[0].data<float>(), lp = out[1].data<float>(), width, rows,
                      mask = mask_]() {
      parallel_for(rows, width, [&](int64_t begin, int64_t end) {
        for (int64_t r = begin; r < end; r++) {
          const float* x = sp + r * width;
          float* p = pp + r * width;
          int64_t n = mask.visible(r, width);
          if (n == 0) {
            std::fill(p, p + width, 0.0f);
            lp[r] = -std::numeric_limits<float>::infinity();
            continue;
          }
          float m = row_max(x, n);
          float total = exp_shifted(x, p, n, m);
          scale_row(p, n, 1.0f / total);
          std::fill(p + n, p + width, 0.0f);
          lp[r] = m + std::log(total);
        }
      });
    });
  }
  const char* name() const override { return "SoftmaxRows"; }
  bool is_equivalent(const mx::Primitive& other) const override {
    return mask_ == static_cast<const SoftmaxRows&>(other).mask_;
  }
  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& in) override {
    return {in[0].shape(), rows_shape(in[0])};
  }

 private:
  Mask mask_;
};

class SoftmaxRowsGrad : public CpuPrimitive {
 public:
  SoftmaxRowsGrad(mx::Stream s, Mask mask) : CpuPrimitive(s), mask_(mask) {}
  void eval_cpu(const std::vector<mx::array>& in, std::vector<mx::array>& out) override {
    const mx::array &s = in[0], &dp = in[1], &lse = in[2], &d = in[3];
    take_or_allocate(s, out[0]);
    take_or_allocate(dp, out[1]);
    auto& encoder = encoder_for(stream(), in, out);
    int64_t width = s.shape(-1), rows = s.size() / std::max<int64_t>(width, 1);
    encoder.dispatch([sp = s.data<float>(), dpp = dp.data<float>(), lp = lse.data<float>(), dd = d.data<float>(),
                      pp = out[0].data<float>(), dsp = out[1].data<float>(), width, rows, mask = mask_]() {
      parallel_for(rows, width, [&](int64_t begin, int64_t end) {
        for (int64_t r = begin; r < end; r++) {
          int64_t n = mask.visible(r, width), at = r * width;
          softmax_grad_row(sp + at, dpp + at, pp + at, dsp + at, n, lp[r], dd[r]);
          std::fill(pp + at + n, pp + at + width, 0.0f);
          std::fill(dsp + at + n, dsp + at + width, 0.0f);
        }
      });
    });
  }
  const char* name() const override { return "SoftmaxRowsGrad"; }
  bool is_equivalent(const mx::Primitive& other) const override {
    return mask_ == static_cast<const SoftmaxRowsGrad&>(other).mask_;
  }
  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& in) override {
    return {in[0].shape(), in[0].shape()};
  }

 private:
  Mask mask_;
};

// --------------------------------------------------------------------------------------- cross-entropy

class CrossEntropyRows : public CpuPrimitive {
 public:
  using CpuPrimitive::CpuPrimitive;
  void eval_cpu(const std::vector<mx::array>& in, std::vector<mx::array>& out) override {
    const mx::array &z = in[0], &t = in[1];
    allocate(out[0]);
    allocate(out[1]);
    auto& encoder = encoder_for(stream(), in, out);
    int64_t width = z.shape(-1), rows = z.size() / std::max<int64_t>(width, 1);
    encoder.dispatch([zp = z.data<float>(), tp = t.data<int32_t>(), lp = out[0].data<float>(),
                      pk = out[1].data<float>(), width, rows]() {
      parallel_for(rows, width, [&](int64_t begin, int64_t end) {
        std::vector<float> buffer(width);
        for (int64_t r = begin; r < end; r++) {
          const float* x = zp + r * width;
          float m = row_max(x, width);
          float total = exp_shifted(x, buffer.data(), width, m);
          lp[r] = m + std::log(total);
          int64_t target = tp[r];
          pk[r] = (target >= 0 && target < width) ? x[target] : 0.0f;
        }
      });
    });
  }
  const char* name() const override { return "CrossEntropyRows"; }
  bool is_equivalent(const mx::Primitive&) const override { return true; }
  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& in) override {
    return {rows_shape(in[0]), rows_shape(in[0])};
  }
};

class CrossEntropyWithGrad : public CpuPrimitive {
 public:
  using CpuPrimitive::CpuPrimitive;
  void eval_cpu(const std::vector<mx::array>& in, std::vector<mx::array>& out) override {
    const mx::array &z = in[0], &t = in[1], &w = in[2];
    allocate(out[0]);
    allocate(out[1]);
    take_or_allocate(z, out[2]);
    auto& encoder = encoder_for(stream(), in, out);
    int64_t width = z.shape(-1), rows = z.size() / std::max<int64_t>(width, 1);
    encoder.dispatch([zp = z.data<float>(), tp = t.data<int32_t>(), wp = w.data<float>(), lp = out[0].data<float>(),
                      pk = out[1].data<float>(), dp = out[2].data<float>(), width, rows]() {
      parallel_for(rows, width, [&](int64_t begin, int64_t end) {
        for (int64_t r = begin; r < end; r++) {
          const float* x = zp + r * width;
          float* g = dp + r * width;
          float weight = wp[r];
          int64_t target = tp[r];
          bool valid = target >= 0 && target < width;
          if (weight == 0.0f) {  // a masked row adds nothing to the loss and has no gradient
            lp[r] = pk[r] = 0.0f;
            std::fill(g, g + width, 0.0f);
            continue;
          }
          pk[r] = valid ? x[target] : 0.0f;
          float m = row_max(x, width);
          float total = exp_shifted(x, g, width, m);
          lp[r] = m + std::log(total);
          scale_row(g, width, weight / total);
          if (valid) g[target] -= weight;
        }
      });
    });
  }
  const char* name() const override { return "CrossEntropyWithGrad"; }
  bool is_equivalent(const mx::Primitive&) const override { return true; }
  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& in) override {
    return {rows_shape(in[0]), rows_shape(in[0]), in[0].shape()};
  }
};

// ---------------------------------------------------------------------------------------------- SwiGLU

class SwiGLUGrad : public CpuPrimitive {
 public:
  using CpuPrimitive::CpuPrimitive;
  void eval_cpu(const std::vector<mx::array>& in, std::vector<mx::array>& out) override {
    const mx::array &g = in[0], &u = in[1], &dy = in[2];
    take_or_allocate(g, out[0]);
    take_or_allocate(u, out[1]);
    auto& encoder = encoder_for(stream(), in, out);
    int64_t n = g.size();
    encoder.dispatch([gp = g.data<float>(), up = u.data<float>(), dyp = dy.data<float>(), dgp = out[0].data<float>(),
                      dup = out[1].data<float>(), n]() {
      parallel_for(n, 1, [&](int64_t begin, int64_t end) {
        swiglu_grad_loop(gp + begin, up + begin, dyp + begin, dgp + begin, dup + begin, end - begin);
      });
    });
  }
  const char* name() const override { return "SwiGLUGrad"; }
  bool is_equivalent(const mx::Primitive&) const override { return true; }
  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& in) override {
    return {in[0].shape(), in[0].shape()};
  }
};

class SwiGLU : public CpuPrimitive {
 public:
  using CpuPrimitive::CpuPrimitive;
  void eval_cpu(const std::vector<mx::array>& in, std::vector<mx::array>& out) override {
    const mx::array &g = in[0], &u = in[1];
    allocate(out[0]);
    auto& encoder = encoder_for(stream(), in, out);
    int64_t n = g.size();
    encoder.dispatch([gp = g.data<float>(), up = u.data<float>(), yp = out[0].data<float>(), n]() {
      parallel_for(n, 1, [&](int64_t begin, int64_t end) {
        swiglu_loop(gp + begin, up + begin, yp + begin, end - begin);
      });
    });
  }
  std::vector<mx::array> vjp(const std::vector<mx::array>& primals, const std::vector<mx::array>& cotangents,
                             const std::vector<int>& argnums, const std::vector<mx::array>&) override {
    auto dy = mx::contiguous(cotangents[0], false, stream());
    auto grads = mx::array::make_arrays({primals[0].shape(), primals[0].shape()}, {mx::float32, mx::float32},
                                        std::make_shared<SwiGLUGrad>(stream()), {primals[0], primals[1], dy});
    return chosen(grads, argnums);
  }
  const char* name() const override { return "SwiGLU"; }
  bool is_equivalent(const mx::Primitive&) const override { return true; }
  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& in) override { return {in[0].shape()}; }
};

// ----------------------------------------------------------------------------------------------- ops

std::tuple<mx::array, mx::array> softmax_rows(const mx::array& scores, bool causal, int64_t first, int64_t block) {
  auto s = rows_input(scores, "scores");
  auto outputs = mx::array::make_arrays({s.shape(), rows_shape(s)}, {mx::float32, mx::float32},
                                        std::make_shared<SoftmaxRows>(cpu_stream(), Mask{causal, first, block}), {s});
  return {outputs[0], outputs[1]};
}

std::tuple<mx::array, mx::array> softmax_rows_grad(const mx::array& scores, const mx::array& dprobs,
                                                   const mx::array& lse, const mx::array& delta, bool causal,
                                                   int64_t first, int64_t block) {
  auto s = rows_input(scores, "scores");
  auto dp = rows_input(dprobs, "dprobs");
  auto l = rows_input(lse, "lse");
  auto d = rows_input(delta, "delta");
  if (dp.shape() != s.shape() || l.shape() != rows_shape(s) || d.shape() != rows_shape(s))
    throw std::invalid_argument("softmax_rows_grad: shapes disagree");
  auto outputs = mx::array::make_arrays({s.shape(), s.shape()}, {mx::float32, mx::float32},
                                        std::make_shared<SoftmaxRowsGrad>(cpu_stream(), Mask{causal, first, block}),
                                        {s, dp, l, d});
  return {outputs[0], outputs[1]};
}

std::tuple<mx::array, mx::array> cross_entropy_rows(const mx::array& logits, const mx::array& targets) {
  auto z = rows_input(logits, "logits");
  auto t = mx::contiguous(mx::astype(targets, mx::int32, cpu_stream()), false, cpu_stream());
  if (t.shape() != rows_shape(z)) throw std::invalid_argument("cross_entropy_rows: one target per row");
  auto outputs = mx::array::make_arrays({rows_shape(z), rows_shape(z)}, {mx::float32, mx::float32},
                                        std::make_shared<CrossEntropyRows>(cpu_stream()), {z, t});
  return {outputs[0], outputs[1]};
}

std::tuple<mx::array, mx::array, mx::array> cross_entropy_with_grad(const mx::array& logits, const mx::array& targets,
                                                                   const mx::array& weights) {
  auto z = rows_input(logits, "logits");
  auto t = mx::contiguous(mx::astype(targets, mx::int32, cpu_stream()), false, cpu_stream());
  auto w = rows_input(weights, "weights");
  if (t.shape() != rows_shape(z) || w.shape() != t.shape())
    throw std::invalid_argument("cross_entropy_with_grad: one target and one weight per row");
  auto outputs = mx::array::make_arrays({rows_shape(z), rows_shape(z), z.shape()}, {mx::float32, mx::float32, mx::float32},
                                        std::make_shared<CrossEntropyWithGrad>(cpu_stream()), {z, t, w});
  return {outputs[0], outputs[1], outputs[2]};
}

mx::array swiglu(const mx::array& gate, const mx::array& up) {
  auto g = rows_input(gate, "gate");
  auto u = rows_input(up, "up");
  if (g.shape() != u.shape()) throw std::invalid_argument("swiglu: gate and up differ in shape");
  return mx::array(g.shape(), mx::float32, std::make_shared<SwiGLU>(cpu_stream()), {g, u});
}

std::tuple<mx::array, mx::array> swiglu_grad(const mx::array& gate, const mx::array& up, const mx::array& dy) {
  auto g = rows_input(gate, "gate");
  auto u = rows_input(up, "up");
  auto d = rows_input(dy, "dy");
  if (g.shape() != u.shape() || d.shape() != g.shape()) throw std::invalid_argument("swiglu_grad: shapes differ");
  auto outputs = mx::array::make_arrays({g.shape(), g.shape()}, {mx::float32, mx::float32},
                                        std::make_shared<SwiGLUGrad>(cpu_stream()), {g, u, d});
  return {outputs[0], outputs[1]};
}

}  // namespace

NB_MODULE(_cpu_kernels, m) {
  m.doc() = "pose_mlx's vectorized CPU row kernels (see pose_mlx/kernels/cpu_kernels.cpp)";
  m.def("softmax_rows", &softmax_rows, nb::arg("scores"), nb::arg("causal"), nb::arg("first"), nb::arg("block"));
  m.def("softmax_rows_grad", &softmax_rows_grad, nb::arg("scores"), nb::arg("dprobs"), nb::arg("lse"),
        nb::arg("delta"), nb::arg("causal"), nb::arg("first"), nb::arg("block"));
  m.def("cross_entropy_rows", &cross_entropy_rows, nb::arg("logits"), nb::arg("targets"));
  m.def("cross_entropy_with_grad", &cross_entropy_with_grad, nb::arg("logits"), nb::arg("targets"),
        nb::arg("weights"));
  m.def("swiglu", &swiglu, nb::arg("gate"), nb::arg("up"));
  m.def("swiglu_grad", &swiglu_grad, nb::arg("gate"), nb::arg("up"), nb::arg("dy"));
  m.def("threads", &max_threads);
  bind_attention(m);
  bind_layers(m);
}
