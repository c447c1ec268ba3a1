// Shared by pose_mlx's CPU kernels (`cpu_kernels.cpp`, `cpu_attention.cpp`): the vectorized exp, row loops,
// threads, and the helpers of MLX primitives that run on the CPU only.

#pragma once

#include <nanobind/nanobind.h>
#include <nanobind/stl/tuple.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <dlfcn.h>
#include <limits>
#include <sched.h>
#include <stdexcept>
#include <thread>
#include <vector>

#include "mlx/backend/cpu/encoder.h"
#include "mlx/ops.h"
#include "mlx/primitives.h"

namespace mx = mlx::core;
namespace nb = nanobind;

namespace {

// ------------------------------------------------------------------------------------------------ exp

constexpr float kLowest = -87.33654f;  // exp below this is under float32's normal range: 0
constexpr float kHighest = 88.72283f;  // exp above this overflows

// exp(x) = 2^n * p(r), n = round(x / ln 2) (by the 1.5 * 2^23 rounding trick), r = x - n ln 2 (ln 2 in two parts),
// p a degree-7 fit of e^r on |r| <= ln2 / 2 (Cephes' expf coefficients), 2^n built in the exponent bits. Max
// relative error about 1 ulp. Branch-free, so that loops over it vectorize.
__attribute__((always_inline)) inline float exp1(float x) {
  float xc = std::min(std::max(x, kLowest), kHighest);
  constexpr float kRound = 12582912.0f;  // 1.5 * 2^23
  float n = (xc * 1.44269504088896341f + kRound) - kRound;
  float r = xc - n * 0.693359375f + n * 2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  float scale = std::bit_cast<float>((static_cast<int32_t>(n) + 127) << 23);
  return static_cast<float>(x >= kLowest) * (p * scale);
}

__attribute__((always_inline)) inline float sigmoid1(float x) {
  return 1.0f / (1.0f + exp1(-x));
}

// ------------------------------------------------------------------------------------- vectorized loops
// (`omp simd` with -fopenmp-simd: vector loops and reductions, no OpenMP runtime)

float row_max(const float* x, int64_t n) {
  float m = -std::numeric_limits<float>::infinity();
#pragma omp simd reduction(max : m)
  for (int64_t i = 0; i < n; i++) m = x[i] > m ? x[i] : m;
  return m;
}

// y[i] = exp(x[i] - shift) (y may be x); returns sum_i y[i]
float exp_shifted(const float* x, float* y, int64_t n, float shift) {
  float total = 0.0f;
#pragma omp simd reduction(+ : total)
  for (int64_t i = 0; i < n; i++) {
    float e = exp1(x[i] - shift);
    y[i] = e;
    total += e;
  }
  return total;
}

void scale_row(float* y, int64_t n, float factor) {
#pragma omp simd
  for (int64_t i = 0; i < n; i++) y[i] *= factor;
}

// p becomes exp(s - lse) and ds becomes p * (dp - d) (p may be s, ds may be dp)
void softmax_grad_row(const float* s, const float* dp, float* p, float* ds, int64_t n, float lse,
                                    float d) {
#pragma omp simd
  for (int64_t i = 0; i < n; i++) {
    float e = exp1(s[i] - lse);
    float g = e * (dp[i] - d);
    p[i] = e;
    ds[i] = g;
  }
}

// -------------------------------------------------------------------------------------------- threads

int max_threads() {
  static int count = [] {
    if (const char* env = std::getenv("POSE_MLX_KERNEL_THREADS")) {
      int n = std::atoi(env);
      if (n > 0) return n;
    }
    cpu_set_t set;
    if (sched_getaffinity(0, sizeof(set), &set) == 0) return std::max(1, CPU_COUNT(&set));
    return std::max(1, static_cast<int>(std::thread::hardware_concurrency()));
  }();
  return count;
}

// The OpenMP runtime the BLAS threads with (MKL's libiomp5, or libgomp), once the process has loaded it: its
// GOMP_parallel, omp_get_thread_num and omp_get_num_threads (both runtimes export them). Null where there is none.
struct OpenMP {
  void (*parallel)(void (*)(void*), void*, unsigned, unsigned) = nullptr;
  int (*thread_num)() = nullptr;
  int (*num_threads)() = nullptr;
};

const OpenMP& openmp() {
  static OpenMP found;
  if (found.parallel) return found;
  for (const char* library : {static_cast<const char*>(nullptr), "libiomp5.so", "libgomp.so.1"}) {
    void* handle = library ? dlopen(library, RTLD_NOW | RTLD_NOLOAD) : RTLD_DEFAULT;  // never loads one
    if (!handle) continue;
    OpenMP candidate;
    candidate.parallel = reinterpret_cast<decltype(OpenMP::parallel)>(dlsym(handle, "GOMP_parallel"));
    candidate.thread_num = reinterpret_cast<decltype(OpenMP::thread_num)>(dlsym(handle, "omp_get_thread_num"));
    candidate.num_threads = reinterpret_cast<decltype(OpenMP::num_threads)>(dlsym(handle, "omp_get_num_threads"));
    if (candidate.parallel && candidate.thread_num && candidate.num_threads) {
      found.thread_num = candidate.thread_num;
      found.num_threads = candidate.num_threads;
      found.parallel = candidate.parallel;
      break;
    }
  }
  return found;
}

// f(thread, count) on up to `threads` threads, this one thread 0, `count` the threads that run (an OpenMP team may
// be given fewer than asked). In the BLAS's OpenMP team where there is one: a team that has just run a product
// spins, waiting for the next, and threads of our own would share the cores with it.
template <class F>
void on_threads(int threads, F& f) {
  if (threads <= 1) {
    f(0, 1);
    return;
  }
  if (const OpenMP& omp = openmp(); omp.parallel) {
    struct Call {
      F* f;
      const OpenMP* omp;
    } call{&f, &omp};
    omp.parallel([](void* data) {
      auto* c = static_cast<Call*>(data);
      (*c->f)(c->omp->thread_num(), c->omp->num_threads());
    }, &call, static_cast<unsigned>(threads), 0);
    return;
  }
  std::vector<std::thread> pool;
  for (int t = 1; t < threads; t++) pool.emplace_back([&f, t, threads] { f(t, threads); });
  f(0, threads);
  for (auto& thread : pool) thread.join();
}

// f(begin, end) over [0, items) in contiguous ranges, one per thread; one thread for little work.
template <class F>
void parallel_for(int64_t items, int64_t work_per_item, F f) {
  constexpr int64_t kWorkPerThread = 1 << 17;
  int64_t threads = std::min<int64_t>(max_threads(), std::max<int64_t>(1, items * work_per_item / kWorkPerThread));
  threads = std::max<int64_t>(1, std::min(threads, items));
  auto range = [&](int thread, int count) {
    int64_t step = (items + count - 1) / count, begin = thread * step, end = std::min(items, begin + step);
    if (begin < end) f(begin, end);
  };
  on_threads(static_cast<int>(threads), range);
}

// -------------------------------------------------------------------------------------------- helpers

void check_float32(const mx::array& a, const char* what) {
  if (a.dtype() != mx::float32) throw std::invalid_argument(std::string(what) + " must be float32");
}

mx::Stream cpu_stream() {
  return mx::default_stream(mx::Device::cpu);
}

// out takes `in`'s buffer when MLX may donate it (no other reader), else fresh memory. The kernels read each
// element before writing the same element, so an output may share its input's buffer.
void take_or_allocate(const mx::array& in, mx::array& out) {
  if (in.is_donatable() && in.flags().row_contiguous && in.itemsize() == out.itemsize() &&
      in.data_size() == out.size()) {
    out.copy_shared_buffer(in);
  } else {
    out.set_data(mx::allocator::malloc(out.nbytes()));
  }
}

void allocate(mx::array& out) {
  out.set_data(mx::allocator::malloc(out.nbytes()));
}

struct Mask {
  bool causal;
  int64_t first;
  int64_t block;
  int64_t visible(int64_t row, int64_t width) const {
    if (!causal) return width;
    return std::clamp<int64_t>(first + row % block + 1, 0, width);
  }
  bool operator==(const Mask& o) const {
    return causal == o.causal && first == o.first && block == o.block;
  }
};

mx::Shape rows_shape(const mx::array& a) {
  return mx::Shape(a.shape().begin(), a.shape().end() - 1);
}

class CpuPrimitive : public mx::Primitive {
 public:
  using mx::Primitive::Primitive;
  void eval_gpu(const std::vector<mx::array>&, std::vector<mx::array>&) override {
    throw std::runtime_error(std::string(name()) + " runs on the CPU only");
  }
};

// The CPU command encoder of `stream`, every input and output of the evaluation registered with it.
mx::cpu::CommandEncoder& encoder_for(mx::Stream stream, const std::vector<mx::array>& in,
                                     std::vector<mx::array>& out) {
  auto& encoder = mx::cpu::get_command_encoder(stream);
  for (auto& a : in) encoder.set_input_array(a);
  for (auto& a : out) encoder.set_output_array(a);
  return encoder;
}

// A VJP's gradients for the arguments asked for (`argnums`), from all of them.
std::vector<mx::array> chosen(const std::vector<mx::array>& grads, const std::vector<int>& argnums) {
  std::vector<mx::array> out;
  for (int arg : argnums) out.push_back(grads[arg]);
  return out;
}

mx::array rows_input(const mx::array& a, const char* what) {
  check_float32(a, what);
  return mx::contiguous(a, false, cpu_stream());
}

}  // namespace

// The fused attention primitives (cpu_attention.cpp) and the layers' (cpu_layers.cpp), added to the module by the
// module itself.
void bind_attention(nb::module_& m);
void bind_layers(nb::module_& m);
