// Fused attention for training on MLX's CPU backend: forward and backward in one primitive each, tile by tile.
//
// softmax(scale * Q K^T [causal]) V per head, queries (B, H, Lq, D), keys (B, Hkv, Lk, D), values (B, Hkv, Lk, Dv),
// H = rep * Hkv (the rep query heads of a group share its KV head). Work is split into tiles of `tile` queries of
// one group, its rep heads stacked as R = rep * n rows (Q' = scale * Q):
//
//   forward, tile:   S = Q' K^T (R x seen), P = softmax_rows(S), O = P V, lse = log sum exp S
//   backward, tile:  S again, dP = dO V^T, D = rowsum(dO * O), dS = P * (dP - D),
//                    dQ = scale * dS K,  dK += dS^T Q',  dV += P^T dO
//
// With a causal mask the tile of queries [s, e) reads only the keys [0, e + Lk - Lq), query i the keys
// [0, i + Lk - Lq] (queries aligned bottom-right, as in MLX). The products are single-threaded BLAS calls
// (cblas_sgemm, the BLAS MLX itself calls), the tiles are shared out over threads, costliest first, and each
// thread adds its dK, dV into its own buffers, summed at the end of each group. A tile's scores stay in the
// thread's buffers (R x Lk floats, twice): memory grows with L, not L^2. Where the BLAS cannot be told to use one
// thread for a caller (a threaded BLAS other than MKL), tiles run one after the other and the BLAS threads each
// product.


#include "cpu_common.h"

extern "C" void cblas_sgemm(int layout, int trans_a, int trans_b, int m, int n, int k, float alpha, const float* a,
                            int lda, const float* b, int ldb, float beta, float* c, int ldc);

namespace {

constexpr int kRowMajor = 101, kNo = 111, kYes = 112;

// C (m x n, row stride ldc) = alpha * op(A) op(B) + beta * C
void gemm(bool ta, bool tb, int64_t m, int64_t n, int64_t k, float alpha, const float* a, int64_t lda,
          const float* b, int64_t ldb, float beta, float* c, int64_t ldc) {
  cblas_sgemm(kRowMajor, ta ? kYes : kNo, tb ? kYes : kNo, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
}

// ----------------------------------------------------------------------------------------- BLAS threads

using SetLocal = int (*)(int);

// MKL's per-caller thread count (MKL_Set_Num_Threads_Local), or OpenBLAS's where it has one; null if neither.
SetLocal local_threads() {
  static SetLocal found = [] {
    for (const char* name : {"MKL_Set_Num_Threads_Local", "openblas_set_num_threads_local"})
      if (void* f = dlsym(RTLD_DEFAULT, name)) return reinterpret_cast<SetLocal>(f);
    return SetLocal{nullptr};
  }();
  return found;
}

// Whether tiles may run on several threads at once: the BLAS is told one thread per caller, or is not threaded.
bool tiles_in_parallel() {
  static bool ok = local_threads() != nullptr ||
                   (!dlsym(RTLD_DEFAULT, "MKL_Get_Max_Threads") && !dlsym(RTLD_DEFAULT, "openblas_get_num_threads"));
  return ok;
}

// For the scope: this thread's BLAS calls single-threaded (restored on exit).
struct OneBlasThread {
  SetLocal set = local_threads();
  int previous = set ? set(1) : 0;
  ~OneBlasThread() {
    if (set) set(previous);
  }
};

// f(item, thread) for items 0 .. count-1 on up to `threads` threads (this one included): thread t of n takes the
// items t, t + n, t + 2n, ... (the costliest first), the same on every run, so that sums made per thread are too.
template <class F>
void share_out(int64_t count, int threads, F f) {
  if (threads <= 1 && !tiles_in_parallel()) {  // a threaded BLAS that cannot be told otherwise threads each product
    for (int64_t item = 0; item < count; item++) f(item, 0);
    return;
  }
  auto work = [&](int thread, int team) {
    OneBlasThread single;
    for (int64_t item = thread; item < count; item += team) f(item, thread);
  };
  on_threads(threads, work);
}

// ----------------------------------------------------------------------------------------------- shapes

struct Problem {
  int64_t b, heads, kv_heads, rep, lq, lk, d, dv, tile;
  float scale;
  bool causal;

  Problem(const mx::array& q, const mx::array& k, const mx::array& v, float scale_, bool causal_, int64_t tile_)
      : b(q.shape(0)), heads(q.shape(1)), kv_heads(k.shape(1)), rep(q.shape(1) / k.shape(1)), lq(q.shape(2)),
        lk(k.shape(2)), d(q.shape(3)), dv(v.shape(3)), tile(tile_), scale(scale_), causal(causal_) {}
  int64_t tiles() const { return (lq + tile - 1) / tile; }
  int64_t groups() const { return b * kv_heads; }
  int64_t rows(int64_t t) const { return std::min(tile, lq - t * tile); }  // queries in tile t
  int64_t visible(int64_t i) const {  // keys seen by query i
    return causal ? std::clamp<int64_t>(i + lk - lq + 1, 0, lk) : lk;
  }
  int64_t seen(int64_t t) const { return visible(t * tile + rows(t) - 1); }
  int threads() const { return tiles_in_parallel() ? static_cast<int>(std::min<int64_t>(max_threads(), tiles())) : 1; }
  // the first row of head h (of the B * H heads), query i, in an array of row length `width`
  int64_t at(int64_t head, int64_t i, int64_t width) const { return (head * lq + i) * width; }
};

// n floats from MLX's allocator (so that MLX's memory counters see them), freed with the object
class Floats {
 public:
  explicit Floats(int64_t n = 0)
      : data_(mx::allocator::malloc(std::max<int64_t>(n, 1) * sizeof(float))),
        p_(static_cast<float*>(data_.buffer().raw_ptr())) {}
  float* data() { return p_; }
  float& operator[](int64_t i) { return p_[i]; }

 private:
  mx::allocator::Data data_;
  float* p_;
};

// One thread's buffers for a tile: Q' (R x D), the scores (R x Lk), lse and, forward, the output rows (R x Dv);
// backward, dO (R x Dv), the scores' gradient (R x Lk), dQ (R x D) and D = rowsum(dO * O). Each is written before
// it is read.
struct Scratch {
  Floats q, s, lse, out, dout, dp, dq, delta;
  Scratch(const Problem& p, bool backward)
      : q(p.rep * p.tile * p.d), s(p.rep * p.tile * p.lk), lse(p.rep * p.tile),
        out(backward ? 0 : p.rep * p.tile * p.dv), dout(backward ? p.rep * p.tile * p.dv : 0),
        dp(backward ? p.rep * p.tile * p.lk : 0), dq(backward ? p.rep * p.tile * p.d : 0),
        delta(backward ? p.rep * p.tile : 0) {}
};

// Copy the tile's rows of x (B * H heads of Lq rows of `width`) for group g, times `factor`, into rows R x width.
void gather(const Problem& p, const float* x, int64_t g, int64_t t, int64_t width, float factor, float* out) {
  int64_t n = p.rows(t);
  for (int64_t r = 0; r < p.rep; r++) {
    const float* from = x + p.at(g * p.rep + r, t * p.tile, width);
    float* to = out + r * n * width;
    for (int64_t j = 0; j < n * width; j++) to[j] = from[j] * factor;
  }
}

// The inverse: rows R x width of the tile into x's rows.
void scatter(const Problem& p, const float* rows, int64_t g, int64_t t, int64_t width, float* x) {
  int64_t n = p.rows(t);
  for (int64_t r = 0; r < p.rep; r++)
    std::memcpy(x + p.at(g * p.rep + r, t * p.tile, width), rows + r * n * width, n * width * sizeof(float));
}

// (group, tile) of work item `item`: the last tiles (the most keys under a causal mask) first.
std::pair<int64_t, int64_t> item_of(const Problem& p, int64_t item) {
  return {item % p.groups(), p.tiles() - 1 - item / p.groups()};
}

// ------------------------------------------------------------------------------------------------ forward

void forward_tile(const Problem& p, const float* q, const float* k, const float* v, float* o, float* lse,
                  int64_t g, int64_t t, Scratch& w) {
  int64_t n = p.rows(t), rows = p.rep * n, seen = p.seen(t);
  const float* kg = k + g * p.lk * p.d;
  const float* vg = v + g * p.lk * p.dv;
  gather(p, q, g, t, p.d, p.scale, w.q.data());
  gemm(false, true, rows, seen, p.d, 1.0f, w.q.data(), p.d, kg, p.d, 0.0f, w.s.data(), seen);
  for (int64_t r = 0; r < rows; r++) {
    float* x = w.s.data() + r * seen;
    int64_t m = std::min(seen, p.visible(t * p.tile + r % n));
    if (m == 0) {
      std::fill(x, x + seen, 0.0f);
      w.lse[r] = -std::numeric_limits<float>::infinity();
      continue;
    }
    float top = row_max(x, m);
    float total = exp_shifted(x, x, m, top);
    scale_row(x, m, 1.0f / total);
    std::fill(x + m, x + seen, 0.0f);
    w.lse[r] = top + std::log(total);
  }
  gemm(false, false, rows, p.dv, seen, 1.0f, w.s.data(), seen, vg, p.dv, 0.0f, w.out.data(), p.dv);
  scatter(p, w.out.data(), g, t, p.dv, o);
  scatter(p, w.lse.data(), g, t, 1, lse);
}

// -------------------------------------------------------------------------------------------- backward

// dK, dV of one group: `into` (dk, dv rows of the group) for thread 0, the thread's own buffers for the others
struct Sums {
  float* dk;
  float* dv;
};

void backward_tile(const Problem& p, const float* q, const float* k, const float* v, const float* o, const float* lse,
                   const float* dout, float* dq, Sums sums, int64_t g, int64_t t, Scratch& w) {
  int64_t n = p.rows(t), rows = p.rep * n, seen = p.seen(t);
  const float* kg = k + g * p.lk * p.d;
  const float* vg = v + g * p.lk * p.dv;
  gather(p, q, g, t, p.d, p.scale, w.q.data());
  gather(p, dout, g, t, p.dv, 1.0f, w.dout.data());
  gather(p, lse, g, t, 1, 1.0f, w.lse.data());
  for (int64_t r = 0; r < p.rep; r++)  // D = rowsum(dO * O)
    for (int64_t i = 0; i < n; i++) {
      const float* orow = o + p.at(g * p.rep + r, t * p.tile + i, p.dv);
      const float* drow = w.dout.data() + (r * n + i) * p.dv;
      float total = 0.0f;
#pragma omp simd reduction(+ : total)
      for (int64_t j = 0; j < p.dv; j++) total += orow[j] * drow[j];
      w.delta[r * n + i] = total;
    }
  gemm(false, true, rows, seen, p.d, 1.0f, w.q.data(), p.d, kg, p.d, 0.0f, w.s.data(), seen);
  gemm(false, true, rows, seen, p.dv, 1.0f, w.dout.data(), p.dv, vg, p.dv, 0.0f, w.dp.data(), seen);
  for (int64_t r = 0; r < rows; r++) {
    int64_t m = std::min(seen, p.visible(t * p.tile + r % n)), at = r * seen;
    softmax_grad_row(w.s.data() + at, w.dp.data() + at, w.s.data() + at, w.dp.data() + at, m, w.lse[r], w.delta[r]);
    std::fill(w.s.data() + at + m, w.s.data() + at + seen, 0.0f);
    std::fill(w.dp.data() + at + m, w.dp.data() + at + seen, 0.0f);
  }
  gemm(true, false, seen, p.dv, rows, 1.0f, w.s.data(), seen, w.dout.data(), p.dv, 1.0f, sums.dv, p.dv);
  gemm(true, false, seen, p.d, rows, 1.0f, w.dp.data(), seen, w.q.data(), p.d, 1.0f, sums.dk, p.d);
  gemm(false, false, rows, p.d, seen, p.scale, w.dp.data(), seen, kg, p.d, 0.0f, w.dq.data(), p.d);
  scatter(p, w.dq.data(), g, t, p.d, dq);
}

// Every group in turn, its tiles shared out; each thread's dK, dV summed into the group's rows at the end.
void backward(const Problem& p, const float* q, const float* k, const float* v, const float* o, const float* lse,
              const float* dout, float* dq, float* dk, float* dv) {
  int threads = p.threads();
  std::vector<Scratch> scratch;
  for (int t = 0; t < threads; t++) scratch.emplace_back(p, true);
  std::vector<Floats> own;  // the dK, dV sums of threads 1, 2, ...
  for (int t = 1; t < threads; t++) own.emplace_back(p.lk * (p.d + p.dv));
  for (int64_t g = 0; g < p.groups(); g++) {
    float *gk = dk + g * p.lk * p.d, *gv = dv + g * p.lk * p.dv;
    std::fill(gk, gk + p.lk * p.d, 0.0f);
    std::fill(gv, gv + p.lk * p.dv, 0.0f);
    for (auto& buffer : own) std::fill(buffer.data(), buffer.data() + p.lk * (p.d + p.dv), 0.0f);
    share_out(p.tiles(), threads, [&](int64_t item, int thread) {
      Sums sums = thread == 0 ? Sums{gk, gv} : Sums{own[thread - 1].data(), own[thread - 1].data() + p.lk * p.d};
      backward_tile(p, q, k, v, o, lse, dout, dq, sums, g, p.tiles() - 1 - item, scratch[thread]);
    });
    for (auto& buffer : own) {
      for (int64_t j = 0; j < p.lk * p.d; j++) gk[j] += buffer[j];
      for (int64_t j = 0; j < p.lk * p.dv; j++) gv[j] += buffer[p.lk * p.d + j];
    }
  }
}

// ---------------------------------------------------------------------------------------------- primitives

// What both directions share: the attributes, and an evaluation's outputs allocated and its arrays registered.
class AttentionPrimitive : public CpuPrimitive {
 public:
  AttentionPrimitive(mx::Stream s, float scale, bool causal, int64_t tile)
      : CpuPrimitive(s), scale_(scale), causal_(causal), tile_(tile) {}
  bool is_equivalent(const mx::Primitive& other) const override {
    auto& o = static_cast<const AttentionPrimitive&>(other);
    return scale_ == o.scale_ && causal_ == o.causal_ && tile_ == o.tile_;
  }

 protected:
  // the encoder of this evaluation, `out` allocated; the problem of queries, keys and values in[0..2]
  std::pair<mx::cpu::CommandEncoder&, Problem> begin(const std::vector<mx::array>& in, std::vector<mx::array>& out) {
    for (auto& a : out) allocate(a);
    auto& encoder = encoder_for(stream(), in, out);
    return {encoder, Problem(in[0], in[1], in[2], scale_, causal_, tile_)};
  }
  float scale_;
  bool causal_;
  int64_t tile_;
};

class AttentionGrad : public AttentionPrimitive {
 public:
  using AttentionPrimitive::AttentionPrimitive;
  void eval_cpu(const std::vector<mx::array>& in, std::vector<mx::array>& out) override {
    auto [encoder, p] = begin(in, out);
    encoder.dispatch([p, q = in[0].data<float>(), k = in[1].data<float>(), v = in[2].data<float>(),
                      o = in[3].data<float>(), lse = in[4].data<float>(), dout = in[5].data<float>(),
                      dq = out[0].data<float>(), dk = out[1].data<float>(), dv = out[2].data<float>()]() {
      backward(p, q, k, v, o, lse, dout, dq, dk, dv);
    });
  }
  const char* name() const override { return "AttentionGrad"; }
  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& in) override {
    return {in[0].shape(), in[1].shape(), in[2].shape()};
  }
};

class Attention : public AttentionPrimitive {
 public:
  using AttentionPrimitive::AttentionPrimitive;
  void eval_cpu(const std::vector<mx::array>& in, std::vector<mx::array>& out) override {
    auto [encoder, p] = begin(in, out);
    encoder.dispatch([p, q = in[0].data<float>(), k = in[1].data<float>(), v = in[2].data<float>(),
                      o = out[0].data<float>(), lse = out[1].data<float>()]() {
      int threads = p.threads();
      std::vector<Scratch> scratch;
      for (int t = 0; t < threads; t++) scratch.emplace_back(p, false);
      share_out(p.groups() * p.tiles(), threads, [&](int64_t item, int thread) {
        auto [g, t] = item_of(p, item);
        forward_tile(p, q, k, v, o, lse, g, t, scratch[thread]);
      });
    });
  }
  std::vector<mx::array> vjp(const std::vector<mx::array>& primals, const std::vector<mx::array>& cotangents,
                             const std::vector<int>& argnums, const std::vector<mx::array>& outputs) override {
    auto dout = mx::contiguous(cotangents[0], false, stream());
    auto grads = mx::array::make_arrays(
        {primals[0].shape(), primals[1].shape(), primals[2].shape()}, {mx::float32, mx::float32, mx::float32},
        std::make_shared<AttentionGrad>(stream(), scale_, causal_, tile_),
        {primals[0], primals[1], primals[2], outputs[0], outputs[1], dout});
    return chosen(grads, argnums);
  }
  const char* name() const override { return "Attention"; }
  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& in) override {
    auto o = in[0].shape();
    o.back() = in[2].shape(-1);
    return {o, mx::Shape(o.begin(), o.end() - 1)};
  }
};

// (O, lse) of softmax(scale * Q K^T [causal]) V: float32 (B, H, Lq, D), (B, Hkv, Lk, D), (B, Hkv, Lk, Dv)
std::tuple<mx::array, mx::array> attention(const mx::array& queries, const mx::array& keys, const mx::array& values,
                                           float scale, bool causal, int64_t tile) {
  auto q = rows_input(queries, "queries");
  auto k = rows_input(keys, "keys");
  auto v = rows_input(values, "values");
  if (q.ndim() != 4 || k.ndim() != 4 || v.ndim() != 4 || k.shape(0) != q.shape(0) || v.shape(0) != q.shape(0) ||
      k.shape(1) != v.shape(1) || q.shape(1) % k.shape(1) != 0 || k.shape(3) != q.shape(3) ||
      v.shape(2) != k.shape(2) || tile < 1 || (causal && q.shape(2) > k.shape(2)))
    throw std::invalid_argument("attention: shapes disagree (see cpu_attention.cpp)");
  auto o_shape = q.shape();
  o_shape.back() = v.shape(3);
  auto outputs = mx::array::make_arrays({o_shape, mx::Shape(o_shape.begin(), o_shape.end() - 1)},
                                        {mx::float32, mx::float32},
                                        std::make_shared<Attention>(cpu_stream(), scale, causal, tile), {q, k, v});
  return {outputs[0], outputs[1]};
}

}  // namespace

void bind_attention(nb::module_& m) {
  m.def("attention", &attention, nb::arg("queries"), nb::arg("keys"), nb::arg("values"), nb::arg("scale"),
        nb::arg("causal"), nb::arg("tile"));
  m.def("attention_in_parallel", &tiles_in_parallel);
}
