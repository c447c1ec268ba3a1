// RMSNorm and rotary embedding for training on MLX's CPU backend: one pass over the rows each way.
//
// MLX's CPU backend computes both from several element-wise operations (and reductions), each a pass over
// memory on one thread. These primitives compute the same functions in one pass, rows split over threads:
//
//   rms_norm(x, w, eps) -> y = x * r * w,  r = 1 / sqrt(mean(x^2) + eps) per row of N
//     backward: dx = r * (w * dy) - x * r^3 / N * sum(w * dy * x),  dw = sum over rows of dy * x * r
//   rope(x, cos, sin, dims, traditional, scale) -> x rotated: each pair (a, b) of its first `dims` features
//     (a = x_i, b = x_{i + dims/2}; traditional: a = x_{2i}, b = x_{2i+1}) becomes
//     (s a cos - s b sin, s a sin + s b cos) with s = scale; the other features are copied.
//     cos and sin: (L, dims/2), or (B, L, dims/2) per batch row; x: (B, H, L, D).
//     backward: the rotation by -angle, times s (the primitive itself with `inverse`).

#include "cpu_common.h"

namespace {

// ------------------------------------------------------------------------------------------------- RMSNorm

float sum_squares(const float* x, int64_t n) {
  float total = 0.0f;
#pragma omp simd reduction(+ : total)
  for (int64_t i = 0; i < n; i++) total += x[i] * x[i];
  return total;
}

class RmsNormGrad : public CpuPrimitive {
 public:
  RmsNormGrad(mx::Stream s, float eps) : CpuPrimitive(s), eps_(eps) {}
  void eval_cpu(const std::vector<mx::array>& in, std::vector<mx::array>& out) override {
    const mx::array &x = in[0], &w = in[1], &dy = in[2];
    allocate(out[0]);
    allocate(out[1]);
    auto& encoder = encoder_for(stream(), in, out);
    int64_t n = x.shape(-1), rows = x.size() / std::max<int64_t>(n, 1);
    encoder.dispatch([xp = x.data<float>(), wp = w.data<float>(), dyp = dy.data<float>(), dxp = out[0].data<float>(),
                      dwp = out[1].data<float>(), n, rows, eps = eps_]() {
      int threads = static_cast<int>(std::clamp<int64_t>(rows * n / (1 << 16), 1, max_threads()));
      std::vector<float> partial(threads * n, 0.0f);  // each thread's sum of dy * x * r
      auto work = [&](int thread, int count) {
        float* dw = partial.data() + thread * n;
        int64_t step = (rows + count - 1) / count;
        for (int64_t row = thread * step; row < std::min(rows, (thread + 1) * step); row++) {
          const float *x = xp + row * n, *dy = dyp + row * n;
          float r = 1.0f / std::sqrt(sum_squares(x, n) / n + eps), dot = 0.0f;
#pragma omp simd reduction(+ : dot)
          for (int64_t i = 0; i < n; i++) dot += wp[i] * dy[i] * x[i];
          float c = dot * r * r * r / n;
          float* dx = dxp + row * n;
#pragma omp simd
          for (int64_t i = 0; i < n; i++) {
            dx[i] = r * wp[i] * dy[i] - c * x[i];
            dw[i] += dy[i] * x[i] * r;
          }
        }
      };
      on_threads(threads, work);
      for (int64_t i = 0; i < n; i++) {
        float total = 0.0f;
        for (int t = 0; t < threads; t++) total += partial[t * n + i];
        dwp[i] = total;
      }
    });
  }
  const char* name() const override { return "RmsNormGrad"; }
  bool is_equivalent(const mx::Primitive& other) const override {
    return eps_ == static_cast<const RmsNormGrad&>(other).eps_;
  }
  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& in) override {
    return {in[0].shape(), in[1].shape()};
  }

 private:
  float eps_;
};

class RmsNorm : public CpuPrimitive {
 public:
  RmsNorm(mx::Stream s, float eps) : CpuPrimitive(s), eps_(eps) {}
  void eval_cpu(const std::vector<mx::array>& in, std::vector<mx::array>& out) override {
    const mx::array &x = in[0], &w = in[1];
    allocate(out[0]);
    auto& encoder = encoder_for(stream(), in, out);
    int64_t n = x.shape(-1), rows = x.size() / std::max<int64_t>(n, 1);
    encoder.dispatch([xp = x.data<float>(), wp = w.data<float>(), yp = out[0].data<float>(), n, rows, eps = eps_]() {
      parallel_for(rows, n, [&](int64_t begin, int64_t end) {
        for (int64_t row = begin; row < end; row++) {
          const float* x = xp + row * n;
          float* y = yp + row * n;
          float r = 1.0f / std::sqrt(sum_squares(x, n) / n + eps);
#pragma omp simd
          for (int64_t i = 0; i < n; i++) y[i] = x[i] * r * wp[i];
        }
      });
    });
  }
  std::vector<mx::array> vjp(const std::vector<mx::array>& primals, const std::vector<mx::array>& cotangents,
                             const std::vector<int>& argnums, const std::vector<mx::array>&) override {
    auto dy = mx::contiguous(cotangents[0], false, stream());
    auto grads = mx::array::make_arrays({primals[0].shape(), primals[1].shape()}, {mx::float32, mx::float32},
                                        std::make_shared<RmsNormGrad>(stream(), eps_), {primals[0], primals[1], dy});
    return chosen(grads, argnums);
  }
  const char* name() const override { return "RmsNorm"; }
  bool is_equivalent(const mx::Primitive& other) const override {
    return eps_ == static_cast<const RmsNorm&>(other).eps_;
  }
  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& in) override { return {in[0].shape()}; }

 private:
  float eps_;
};

// ----------------------------------------------------------------------------------------------------- RoPE

struct Rotation {
  int64_t dims;
  bool traditional;
  float scale;
  bool inverse;
  bool operator==(const Rotation& o) const {
    return dims == o.dims && traditional == o.traditional && scale == o.scale && inverse == o.inverse;
  }
};

// One row of D features, its pairs rotated by the angles whose cos and sin are given (dims / 2 of each).
void rotate_row(const float* x, float* y, const float* c, const float* s, int64_t d, const Rotation& r) {
  int64_t half = r.dims / 2, stride = r.traditional ? 2 : 1, second = r.traditional ? 1 : half;
  float sign = r.inverse ? -1.0f : 1.0f;
#pragma omp simd
  for (int64_t i = 0; i < half; i++) {
    float a = x[i * stride] * r.scale, b = x[i * stride + second] * r.scale, sn = sign * s[i];
    y[i * stride] = a * c[i] - b * sn;
    y[i * stride + second] = a * sn + b * c[i];
  }
  for (int64_t i = r.dims; i < d; i++) y[i] = x[i];
}

class Rope : public CpuPrimitive {
 public:
  Rope(mx::Stream s, Rotation rotation) : CpuPrimitive(s), rotation_(rotation) {}
  void eval_cpu(const std::vector<mx::array>& in, std::vector<mx::array>& out) override {
    const mx::array &x = in[0], &c = in[1], &s = in[2];
    take_or_allocate(x, out[0]);
    auto& encoder = encoder_for(stream(), in, out);
    int64_t batch = x.shape(0), heads = x.shape(1), length = x.shape(2), d = x.shape(3);
    bool per_row = c.ndim() == 3;
    encoder.dispatch([xp = x.data<float>(), cp = c.data<float>(), sp = s.data<float>(), yp = out[0].data<float>(),
                      batch, heads, length, d, per_row, r = rotation_]() {
      int64_t half = r.dims / 2;
      parallel_for(batch * heads, length * d, [&](int64_t begin, int64_t end) {
        for (int64_t bh = begin; bh < end; bh++) {
          int64_t table = per_row ? (bh / heads) * length * half : 0;
          for (int64_t l = 0; l < length; l++) {
            int64_t at = (bh * length + l) * d, angle = table + l * half;
            rotate_row(xp + at, yp + at, cp + angle, sp + angle, d, r);
          }
        }
      });
    });
  }
  std::vector<mx::array> vjp(const std::vector<mx::array>& primals, const std::vector<mx::array>& cotangents,
                             const std::vector<int>& argnums, const std::vector<mx::array>&) override {
    Rotation back = rotation_;
    back.inverse = !back.inverse;
    auto dy = mx::contiguous(cotangents[0], false, stream());
    auto dx = mx::array(dy.shape(), mx::float32, std::make_shared<Rope>(stream(), back), {dy, primals[1], primals[2]});
    std::vector<mx::array> chosen;
    for (int arg : argnums) chosen.push_back(arg == 0 ? dx : mx::zeros_like(primals[arg], stream()));
    return chosen;
  }
  const char* name() const override { return "Rope"; }
  bool is_equivalent(const mx::Primitive& other) const override {
    return rotation_ == static_cast<const Rope&>(other).rotation_;
  }
  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& in) override { return {in[0].shape()}; }

 private:
  Rotation rotation_;
};

mx::array rms_norm(const mx::array& x, const mx::array& weight, float eps) {
  auto xs = rows_input(x, "x");
  auto w = rows_input(weight, "weight");
  if (w.ndim() != 1 || xs.ndim() < 1 || w.shape(0) != xs.shape(-1))
    throw std::invalid_argument("rms_norm: the weight must be (N,) for rows of N");
  return mx::array(xs.shape(), mx::float32, std::make_shared<RmsNorm>(cpu_stream(), eps), {xs, w});
}

mx::array rope(const mx::array& x, const mx::array& cos, const mx::array& sin, int64_t dims, bool traditional,
               float scale) {
  auto xs = rows_input(x, "x");
  auto c = rows_input(cos, "cos");
  auto s = rows_input(sin, "sin");
  bool shapes = xs.ndim() == 4 && dims % 2 == 0 && dims <= xs.shape(3) && c.shape() == s.shape() &&
                c.shape(-1) == dims / 2 && c.shape(-2) == xs.shape(2) &&
                (c.ndim() == 2 || (c.ndim() == 3 && c.shape(0) == xs.shape(0)));
  if (!shapes) throw std::invalid_argument("rope: x (B, H, L, D) and cos, sin (L, dims/2) or (B, L, dims/2)");
  return mx::array(xs.shape(), mx::float32, std::make_shared<Rope>(cpu_stream(), Rotation{dims, traditional, scale, false}),
                   {xs, c, s});
}

}  // namespace

void bind_layers(nb::module_& m) {
  m.def("rms_norm", &rms_norm, nb::arg("x"), nb::arg("weight"), nb::arg("eps"));
  m.def("rope", &rope, nb::arg("x"), nb::arg("cos"), nb::arg("sin"), nb::arg("dims"), nb::arg("traditional"),
        nb::arg("scale"));
}
