// Fused fp32 -> bf16 Fair Cast on the CPU: one parallel loop over a flat buffer.
//
// The executable spec is faircast_dist/rounding.py + philox.py; this file must give the same
// bits (tests/test_fused.py). Built by faircast_dist/fused.py with torch.utils.cpp_extension
// (-O3 -march=native -fopenmp -ffp-contract=off, never -ffast-math: it would flush subnormals to zero; gcc's
// default contraction would fuse the FP8 error feedback's y - q * s into one rounding).
//
// Multi-tensor: one call casts a list of flat buffers (a ZeRO partition is a list of one; the
// masters of a Megatron optimizer are many small ones), in one parallel loop.
// Segment table: int64 [S, 6], one row per param fragment: (tensor = position in the lists,
// start in that tensor, numel, global index of the fragment's first element in its param, k0, k1).
// Work is cut into tiles of TILE elements aligned to param-global multiples of TILE (a multiple
// of 8), so a fragment that starts mid Philox block still costs one Philox call per 8 elements.
//
// Bits (little-endian): block b = global_index / 8 has counter (b & 0xffffffff, b >> 32, 0, 0);
// its 4 output words stored in order are 8 uint16 lanes, lane i % 8 for element i.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <cmath>
#include <cstring>
#include <vector>

static_assert(__BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__, "lane order assumes a little-endian host");

namespace {

constexpr int64_t TILE = 4096;  // elements per tile: the unit of parallel work (a multiple of SUB)
// Philox runs for SUB elements at a time, then they are rounded: the random words (SUB / 2 bytes)
// stay in L1 next to the data, and the loads overlap the integer work. Measured on a 2-core
// EPYC (AVX-512), 1 thread, 50M and 135M elements, CPU time: SR took 2.0x torch's copy_ into
// bf16 with Philox for a whole 4096-element tile first (8 KiB of words: with the 16 KiB of fp32
// and 8 KiB of bf16 the tile overflows a 32 KiB L1d), 1.55-1.6x with SUB = 256 (a standalone
// microbenchmark: SUB = 128..512 alike, 64 worse; non-temporal stores and prefetching no gain there).
constexpr int64_t SUB = 256;
static_assert(TILE % SUB == 0 && SUB % 8 == 0, "tiles and sub-tiles must hold whole Philox blocks");
// While Philox runs no load is in flight, so the memory stream stalls: each sub-tile first prefetches the masters
// AHEAD elements on. Measured on a 2-core Intel Xeon (AVX-512, family 6 model 207), 1 thread, 10M elements: in a
// standalone copy of these loops SR took 10.1-10.6 ms without, 7.4-7.6 ms with AHEAD = 1024 or 2048 (512 alike,
// 256 worse; prefetching the outputs too 0.3-0.5 ms worse), a round-to-nearest loop 5.2-5.3 ms; in this kernel
// (scripts/bench_export.py, 3 runs each) SR 10.5-10.8 -> 8.4-9.1 ms, FP8 SR 13.4-13.7 -> 11.9-12.6 ms.
constexpr int64_t AHEAD = 2048;
// Prefetch the cache lines of elements [a + AHEAD, b + AHEAD) of x, stopping at end (a hint: it changes no bit).
template <typename T>
inline void prefetch_ahead(const T* x, int64_t a, int64_t b, int64_t end) {
  for (int64_t i = a + AHEAD; i < std::min(b + AHEAD, end); i += 64 / (int64_t)sizeof(T)) __builtin_prefetch(x + i, 0, 3);
}
constexpr uint32_t SIGN = 0x80000000u, MAG = 0x7fffffffu, INF = 0x7f800000u, SAT = 0x7f7f0000u;
constexpr float BF16_MAX = 3.38953139e38f;  // 0x7f7f0000

inline uint32_t f2u(float f) { uint32_t u; std::memcpy(&u, &f, 4); return u; }
inline float u2f(uint32_t u) { float f; std::memcpy(&f, &u, 4); return f; }

// bf16 of a non-finite fp32 pattern: Inf keeps its bits; NaN stays a (quiet) NaN with its sign.
inline uint16_t nonfinite16(uint32_t b) {
  return (uint16_t)((b & 0x007fffffu) ? ((b >> 16) | 0x0040u) : (b >> 16));
}

// Round to nearest even of a finite or infinite fp32 pattern (what torch's .to(bfloat16) does).
inline uint16_t rtn16(uint32_t b) { return (uint16_t)((b + 0x7fffu + ((b >> 16) & 1u)) >> 16); }

// Philox4x32-10 (Salmon et al., SC'11; Random123) of blocks blk0 .. blk0 + nb - 1 with key
// (k0, k1); words[4 * i + w] = output word w of block blk0 + i. A plain loop that gcc vectorises
// over blocks: each uint32 word lives in a 64-bit lane (its high half ignored, masked), so
// ``(c & 0xffffffff) * M`` is the full 32x32 -> 64-bit product, hi = p >> 32, lo = p & mask
// (measured ~2x faster here than uint32 lanes, for which gcc builds the products less well).
void philox_blocks(uint64_t blk0, int64_t nb, uint32_t key0, uint32_t key1, uint32_t* __restrict words) {
  constexpr uint64_t LO = 0xffffffffu;
  for (int64_t i = 0; i < nb; ++i) {
    const uint64_t blk = blk0 + (uint64_t)i;
    uint64_t c0 = blk & LO, c1 = blk >> 32, c2 = 0, c3 = 0, k0 = key0, k1 = key1;
#pragma GCC unroll 10
    for (int r = 0; r < 10; ++r) {
      const uint64_t p0 = (c0 & LO) * 0xD2511F53u, p1 = (c2 & LO) * 0xCD9E8D57u;
      c0 = (p1 >> 32) ^ c1 ^ k0; c2 = (p0 >> 32) ^ c3 ^ k1; c1 = p1 & LO; c3 = p0 & LO;
      k0 = (k0 + 0x9E3779B9u) & LO; k1 = (k1 + 0xBB67AE85u) & LO;
    }
    words[4 * i] = (uint32_t)c0; words[4 * i + 1] = (uint32_t)c1;
    words[4 * i + 2] = (uint32_t)c2; words[4 * i + 3] = (uint32_t)c3;
  }
}

// Stochastic rounding of n elements with 16 random bits each (rounding.py: stochastic_round).
void sr_run(const uint32_t* __restrict x, const uint16_t* __restrict r, uint16_t* __restrict out, int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    const uint32_t b = x[i], mag = b & MAG;
    uint32_t m = (mag + r[i]) & 0xffff0000u;
    m = m > SAT ? SAT : m;
    const uint16_t sr = (uint16_t)(((b & SIGN) | m) >> 16);
    out[i] = mag < INF ? sr : nonfinite16(b);
  }
}

// Branch-free selects (bit masks): gcc if-converts these loops for AVX-512 (masked moves) but not for AVX2,
// where the same loops with ?: stayed scalar ("control flow in loop", -fopt-info-vec); written this way they
// vectorise on both.
inline uint32_t sel(bool c, uint32_t a, uint32_t b) { const uint32_t m = 0u - (uint32_t)c; return (a & m) | (b & ~m); }
inline float self(bool c, float a, float b) { return u2f(sel(c, f2u(a), f2u(b))); }

// Error feedback (rounding.py: cast_error_feedback): y = x + e; q = RTN(y); e = y - q.
// y saturates at bf16 max (a finite y above it, or +-Inf from a finite x + e, becomes +-BF16_MAX; NaN passes).
inline float ef_y(float xi, float e) {
  const float y = self(e == 0.0f, xi, xi + e);  // -0 + 0 would give +0: keep the master's sign
  const uint32_t yb = f2u(y);
  const bool over = ((yb & MAG) > f2u(BF16_MAX)) & ((yb & MAG) <= INF);
  return u2f(sel(over, (yb & SIGN) | f2u(BF16_MAX), yb));
}
inline uint16_t bf16_bits(uint32_t b) {  // RTN of a finite or infinite pattern; NaN a quiet NaN with its sign
  return (uint16_t)sel((b & MAG) > INF, nonfinite16(b), rtn16(b));
}

template <typename Res>
void ef_run(const float* __restrict x, Res* __restrict res, uint16_t* __restrict out, int64_t n);

template <>
void ef_run<float>(const float* __restrict x, float* __restrict res, uint16_t* __restrict out, int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    const float xi = x[i], e = res[i];
    const uint32_t xb = f2u(xi);
    const bool finite = (xb & MAG) < INF;
    const float y = ef_y(xi, e);
    const uint16_t q = bf16_bits(f2u(y));
    out[i] = (uint16_t)sel(finite, q, nonfinite16(xb));
    res[i] = self(finite, y - u2f((uint32_t)q << 16), e);
  }
}

template <>
void ef_run<uint16_t>(const float* __restrict x, uint16_t* __restrict res, uint16_t* __restrict out, int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    const float xi = x[i];
    const uint16_t eb = res[i];
    const float e = u2f((uint32_t)eb << 16);
    const uint32_t xb = f2u(xi);
    const bool finite = (xb & MAG) < INF;
    const float y = ef_y(xi, e);
    const uint16_t q = bf16_bits(f2u(y));
    const uint16_t d = bf16_bits(f2u(y - u2f((uint32_t)q << 16)));  // exact; stored rounded to nearest
    out[i] = (uint16_t)sel(finite, q, nonfinite16(xb));
    res[i] = (uint16_t)sel(finite, d, eb);
  }
}

// Segment table columns; FP8 rows add (offset of the param's scales in the flat scales / absmax buffer,
// K = the weight's columns, block columns: 0 for channel scales, else ceil(K / 128)).
enum Col { C_TENSOR, C_START, C_NUMEL, C_INDEX, C_K0, C_K1, COLS, C_SCALE = COLS, C_K, C_NBK, FP8_COLS };

struct Tiles {
  const int64_t* seg;            // [S, cols]
  std::vector<int64_t> prefix;  // prefix[s] = first tile of segment s; prefix[S] = total
  int64_t cols;
  int64_t total() const { return prefix.back(); }
  const int64_t* row(int64_t s) const { return seg + cols * s; }
  // Segment s, and the tile's elements [lo, hi) as offsets into the segment.
  void locate(int64_t t, int64_t& s, int64_t& lo, int64_t& hi) const {
    s = (int64_t)(std::upper_bound(prefix.begin(), prefix.end(), t) - prefix.begin()) - 1;
    const int64_t g0 = seg[cols * s + C_INDEX], n = seg[cols * s + C_NUMEL];
    const int64_t w = (g0 / TILE + (t - prefix[s])) * TILE - g0;  // the tile's window, from g0
    lo = std::max(w, (int64_t)0);
    hi = std::min(w + TILE, n);  // (w + g0 + TILE could pass INT64_MAX)
  }
};

// The tiles of a segment table over tensors of sizes ``size`` (rows checked: a bad row would
// write out of bounds; faircast_dist/fused.py names the row first).
Tiles make_tiles(const torch::Tensor& segments, const std::vector<int64_t>& size, int64_t cols = COLS) {
  TORCH_CHECK(segments.device().is_cpu() && segments.scalar_type() == torch::kInt64 && segments.dim() == 2 &&
              segments.size(1) == cols && segments.is_contiguous(),
              "segments must be a contiguous CPU int64 [S, ", cols, "] table");
  Tiles t{segments.data_ptr<int64_t>(), std::vector<int64_t>(segments.size(0) + 1, 0), cols};
  for (int64_t s = 0; s < segments.size(0); ++s) {
    const int64_t* row = t.row(s);
    const int64_t k = row[C_TENSOR], start = row[C_START], n = row[C_NUMEL], g0 = row[C_INDEX];
    TORCH_CHECK(k >= 0 && k < (int64_t)size.size() && start >= 0 && n >= 0 && start <= size[k] - n && g0 >= 0 &&
                g0 <= INT64_MAX - n, "segment row ", s, " is out of range");
    t.prefix[s + 1] = t.prefix[s] + (n > 0 ? (g0 + n - 1) / TILE - g0 / TILE + 1 : 0);
  }
  return t;
}

// Data pointers of a list of contiguous 1-D CPU tensors of one dtype (and their sizes).
template <typename T>
std::vector<T*> pointers(const std::vector<torch::Tensor>& ts, torch::ScalarType dtype, const char* what,
                         std::vector<int64_t>* size) {
  std::vector<T*> out;
  for (size_t i = 0; i < ts.size(); ++i) {
    const torch::Tensor& t = ts[i];
    TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == dtype && t.dim() == 1 && t.is_contiguous(),
                what, "[", i, "] must be a contiguous 1-D CPU tensor of ", c10::toString(dtype));
    out.push_back(static_cast<T*>(t.data_ptr()));
    if (size->size() <= i) size->push_back(t.numel());
    else (*size)[i] = std::min((*size)[i], t.numel());
  }
  return out;
}

}  // namespace

void cast_stochastic_multi(const std::vector<torch::Tensor>& masters, std::vector<torch::Tensor>& outs,
                           const torch::Tensor& segments) {
  TORCH_CHECK(masters.size() == outs.size(), "masters and outs must be lists of one length");
  std::vector<int64_t> size;
  const auto x = pointers<const uint32_t>(masters, torch::kFloat32, "masters", &size);
  const auto o = pointers<uint16_t>(outs, torch::kBFloat16, "outs", &size);
  const Tiles tiles = make_tiles(segments, size);
  at::parallel_for(0, tiles.total(), 4, [&](int64_t begin, int64_t end) {
    alignas(64) uint32_t words[4 * SUB / 8];
    for (int64_t t = begin; t < end; ++t) {
      int64_t s, lo, hi;
      tiles.locate(t, s, lo, hi);
      const int64_t* row = tiles.row(s);
      const uint32_t k0 = (uint32_t)row[C_K0], k1 = (uint32_t)row[C_K1];
      const uint32_t* xs = x[row[C_TENSOR]] + row[C_START];
      uint16_t* os = o[row[C_TENSOR]] + row[C_START];
      for (int64_t a = lo, b; a < hi; a = b) {  // sub-tiles at param-global multiples of SUB
        const int64_t g = row[C_INDEX] + a;
        b = std::min(hi, a + SUB - g % SUB);
        prefetch_ahead(xs, a, b, row[C_NUMEL]);
        const int64_t blk0 = g / 8;
        philox_blocks((uint64_t)blk0, (g + (b - a) - 1) / 8 - blk0 + 1, k0, k1, words);
        sr_run(xs + a, reinterpret_cast<const uint16_t*>(words) + (g - 8 * blk0), os + a, b - a);
      }
    }
  });
}

void cast_error_feedback_multi(const std::vector<torch::Tensor>& masters, std::vector<torch::Tensor>& residuals,
                               std::vector<torch::Tensor>& outs, const torch::Tensor& segments) {
  TORCH_CHECK(masters.size() == outs.size() && masters.size() == residuals.size(),
              "masters, residuals and outs must be lists of one length");
  TORCH_CHECK(!residuals.empty() || segments.size(0) == 0, "error feedback needs residuals");
  const bool fp32_res = residuals.empty() || residuals[0].scalar_type() == torch::kFloat32;
  std::vector<int64_t> size;
  const auto x = pointers<const float>(masters, torch::kFloat32, "masters", &size);
  const auto o = pointers<uint16_t>(outs, torch::kBFloat16, "outs", &size);
  const auto r = pointers<void>(residuals, fp32_res ? torch::kFloat32 : torch::kBFloat16, "residuals", &size);
  const Tiles tiles = make_tiles(segments, size);
  at::parallel_for(0, tiles.total(), 4, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      int64_t s, lo, hi;
      tiles.locate(t, s, lo, hi);
      const int64_t* row = tiles.row(s);
      const int64_t k = row[C_TENSOR], off = row[C_START] + lo;
      if (fp32_res)
        ef_run<float>(x[k] + off, static_cast<float*>(r[k]) + off, o[k] + off, hi - lo);
      else
        ef_run<uint16_t>(x[k] + off, static_cast<uint16_t*>(r[k]) + off, o[k] + off, hi - lo);
    }
  });
}


// ------------------------------------------------------------------------------------------ fp32 -> FP8 E4M3
// The spec is rounding.py's e4m3_round / cast_fp8_* and fp8.py's partial_absmax (docs/design.md "FP8 exports").
// Element g = index + offset of a row has scale C_SCALE + (channel) g / K, or (block) (g / K / 128) * NBK +
// (g % K) / 128; elements are handled in runs that share one scale, so the inner loops see a constant scale.
// Needs -ffp-contract=off (error feedback's y - q * s is two roundings, no fused multiply-add).
namespace {

constexpr float E4M3_MAX = 448.0f, FP32_MAX = 3.40282347e38f;
enum Fp8Mode { F_NEAREST, F_STOCHASTIC, F_ERROR_FEEDBACK };  // the codes of faircast_dist.fused.KERNEL_CODES

inline bool finite32(float v) { return (f2u(v) & MAG) < INF; }
inline float bf16_value(float v) {  // .to(bfloat16).float(): RTN for finite v, non-finite v as is
  return self(finite32(v), u2f((uint32_t)rtn16(f2u(v)) << 16), v);
}
// The length of the run of elements from global index g that share one scale (its index: sidx), at most n.
inline int64_t scale_run(const int64_t* row, int64_t g, int64_t n, int64_t& sidx) {
  const int64_t K = row[C_K], r = g / K, c = g % K;
  if (row[C_NBK] == 0) { sidx = row[C_SCALE] + r; return std::min(n, K - c); }
  sidx = row[C_SCALE] + (r / 128) * row[C_NBK] + c / 128;
  return std::min(n, std::min(128 - c % 128, K - c));
}

// E4M3 code (sign bit 0x80 | magnitude code) of y / s (or y * s with MUL: a scale rule whose codes multiply,
// fp8.py's ScaleRule): rounding.py's _scaled then e4m3_round, for a finite factor s > 0 (fused.py checks). Then y finite gives a finite or infinite quotient, saturated at 448 by a min on
// its magnitude bits, and y not finite gives NaN (0x7f). Where |q| >= 2**-6 the rounding is integer work on the
// fp32 pattern, as for bf16: code = (bits >> 20) - 960 (4 bits of exponent, 3 of mantissa), ties to even by
// + 0x7ffff + lsb, stochastic rounding by + r << 4 (it carries iff floor(f * 2**16) + r >= 2**16). Below 2**-6
// (the subnormal grid, spacing 2**-9): nearest adds 2**14, whose fp32 spacing is 2**-9, so the addition rounds
// |q| to the grid, ties to even (the default rounding mode); stochastic rounding takes floor(|q| * 2**25)
// (k * 2**16 + floor(f * 2**16), from the significand by a shift: gcc leaves the float form scalar on AVX2)
// + r, >> 16.
template <int MODE, bool MUL>
inline uint32_t e4m3_code(float y, float s, uint32_t r) {
  const uint32_t qb = f2u(MUL ? y * s : y / s);
  const uint32_t ab = std::min(qb & MAG, 0x43e00000u);  // |q| saturated at 448
  const uint32_t normal = MODE == F_STOCHASTIC ? ((ab + (r << 4)) >> 20) - 960u
                                               : ((ab + 0x7ffffu + ((ab >> 20) & 1u)) >> 20) - 960u;
  uint32_t sub;
  if (MODE == F_STOCHASTIC) {  // floor(|q| * 2**25) = the 24-bit significand >> (125 - exponent), in integers
    const uint32_t e = std::min(ab >> 23, 120u);
    const uint32_t m = (ab & 0x7fffffu) | sel(e != 0, 0x800000u, 0u);
    sub = ((m >> std::min(125u - std::max(e, 1u), 31u)) + r) >> 16;
  } else {
    sub = f2u(u2f(ab) + 16384.0f) - 0x46800000u;
  }
  const uint32_t code = sel(ab >= 0x3c800000u, normal, sub);
  return ((f2u(y) & SIGN) >> 24) | sel(finite32(y), code, 0x7fu);  // (y's sign: s > 0; a NaN keeps its own)
}

// The fp32 value of an E4M3 code (a NaN for 0x7f / 0xff; payloads may differ from the spec's).
inline float e4m3_value(uint32_t code) {
  const uint32_t m = code & 0x7fu;
  const uint32_t v = sel(m >= 8, (m + 960u) << 20, f2u((float)(int32_t)m * 0.001953125f)) | ((code & 0x80u) << 24);
  return u2f(sel(m == 0x7fu, 0x7fc00000u, v));
}

// n elements sharing one scale: s the served scale, f what y is divided by (or, with MUL, multiplied with);
// f == s for rules whose codes divide by the scale.
template <int MODE, bool VIA_BF16, bool MUL>
void fp8_run(const float* __restrict x, const uint16_t* __restrict r, float* __restrict res, uint8_t* __restrict out,
             int64_t n, float s, float f) {
  if (MODE == F_ERROR_FEEDBACK) {
    for (int64_t i = 0; i < n; ++i) {
      const float xi = x[i], e = res[i];
      const bool finite = finite32(xi);
      float y = self(e == 0.0f || !finite, xi, xi + e);  // -0 + 0 would give +0, NaN + e any NaN: the master
      y = self(finite & ((f2u(y) & MAG) == INF), u2f((f2u(y) & SIGN) | 0x7f7fffffu), y);  // saturate at fp32 max
      const uint32_t code = e4m3_code<F_NEAREST, MUL>(y, f, 0);
      out[i] = (uint8_t)code;
      res[i] = self(finite, y - e4m3_value(code) * s, e);
    }
  } else if (MODE == F_STOCHASTIC) {
    for (int64_t i = 0; i < n; ++i) out[i] = (uint8_t)e4m3_code<F_STOCHASTIC, MUL>(x[i], f, r[i]);
  } else {
    for (int64_t i = 0; i < n; ++i) out[i] = (uint8_t)e4m3_code<F_NEAREST, MUL>(VIA_BF16 ? bf16_value(x[i]) : x[i], f, 0);
  }
}

template <bool MUL>
void fp8_run_mode(int64_t mode, bool via_bf16, const float* x, const uint16_t* r, float* res, uint8_t* out, int64_t n,
                  float s, float f) {
  if (mode == F_STOCHASTIC) fp8_run<F_STOCHASTIC, false, MUL>(x, r, nullptr, out, n, s, f);
  else if (mode == F_ERROR_FEEDBACK) fp8_run<F_ERROR_FEEDBACK, false, MUL>(x, nullptr, res, out, n, s, f);
  else if (via_bf16) fp8_run<F_NEAREST, true, MUL>(x, nullptr, nullptr, out, n, s, f);
  else fp8_run<F_NEAREST, false, MUL>(x, nullptr, nullptr, out, n, s, f);
}

// The largest finite |y| of n elements (fp8.py: partial_absmax): y = x, bf16(x) or x + res (Y_*; a finite x whose
// x + res overflows counts as fp32 max, where error feedback's cast saturates it). A max of the magnitude bits
// (non-negative floats order as their patterns).
enum AbsY { Y_MASTER, Y_BF16, Y_RESIDUAL };
template <int Y>
float absmax_run(const float* __restrict x, const float* __restrict res, int64_t n) {
  uint32_t m = 0;
  for (int64_t i = 0; i < n; ++i) {
    const float y = Y == Y_RESIDUAL ? x[i] + res[i] : (Y == Y_BF16 ? bf16_value(x[i]) : x[i]);
    uint32_t a = f2u(y) & MAG;
    if (Y == Y_RESIDUAL) a = sel(finite32(x[i]) & (a == INF), 0x7f7fffffu, a);  // saturated, as the cast does
    m = std::max(m, sel(a < INF, a, 0u));
  }
  return u2f(m);
}

// The FP8 rows' scale columns, checked against the scales buffer (a bad row would read out of bounds).
void check_fp8_rows(const Tiles& tiles, int64_t segments, int64_t num_scales) {
  for (int64_t s = 0; s < segments; ++s) {
    const int64_t* row = tiles.row(s);
    const int64_t K = row[C_K], n = row[C_NUMEL], g1 = row[C_INDEX] + n - 1;
    TORCH_CHECK(K > 0 && row[C_SCALE] >= 0 && row[C_NBK] >= 0, "segment row ", s, " has a bad scale layout");
    if (n == 0) continue;
    const int64_t last = row[C_NBK] == 0 ? g1 / K : (g1 / K / 128) * row[C_NBK] + (K - 1) / 128;
    TORCH_CHECK(row[C_NBK] == 0 || row[C_NBK] == (K + 127) / 128, "segment row ", s, ": block columns must be ceil(K / 128)");
    TORCH_CHECK(last < num_scales - row[C_SCALE], "segment row ", s, " reaches past the scales");  // (no overflow)
  }
}

}  // namespace

void fp8_absmax_multi(const std::vector<torch::Tensor>& masters, const std::vector<torch::Tensor>& residuals,
                      const torch::Tensor& segments, torch::Tensor& absmax, bool via_bf16) {
  TORCH_CHECK(residuals.empty() || residuals.size() == masters.size(), "residuals: one per master, or none");
  TORCH_CHECK(absmax.device().is_cpu() && absmax.scalar_type() == torch::kFloat32 && absmax.dim() == 1 &&
              absmax.is_contiguous(), "absmax must be a contiguous 1-D CPU float32 tensor");
  std::vector<int64_t> size;
  const auto x = pointers<const float>(masters, torch::kFloat32, "masters", &size);
  const auto r = pointers<const float>(residuals, torch::kFloat32, "residuals", &size);
  const Tiles tiles = make_tiles(segments, size, FP8_COLS);
  check_fp8_rows(tiles, segments.size(0), absmax.numel());
  uint32_t* maxima = reinterpret_cast<uint32_t*>(absmax.data_ptr<float>());  // >= 0 floats order as uint32
  at::parallel_for(0, tiles.total(), 4, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      int64_t s, lo, hi, sidx;
      tiles.locate(t, s, lo, hi);
      const int64_t* row = tiles.row(s);
      const float* xs = x[row[C_TENSOR]] + row[C_START];
      const float* rs = r.empty() ? nullptr : r[row[C_TENSOR]] + row[C_START];
      for (int64_t a = lo, n; a < hi; a += n) {
        n = scale_run(row, row[C_INDEX] + a, hi - a, sidx);
        const uint32_t m = f2u(rs ? absmax_run<Y_RESIDUAL>(xs + a, rs + a, n)
                                  : via_bf16 ? absmax_run<Y_BF16>(xs + a, nullptr, n) : absmax_run<Y_MASTER>(xs + a, nullptr, n));
        uint32_t old = __atomic_load_n(maxima + sidx, __ATOMIC_RELAXED);
        while (m > old && !__atomic_compare_exchange_n(maxima + sidx, &old, m, true, __ATOMIC_RELAXED, __ATOMIC_RELAXED)) {
        }
      }
    }
  });
}

void cast_fp8_multi(int64_t mode, const std::vector<torch::Tensor>& masters, std::vector<torch::Tensor>& residuals,
                    std::vector<torch::Tensor>& outs, const torch::Tensor& segments, const torch::Tensor& scales,
                    bool via_bf16, const torch::Tensor& multipliers) {
  TORCH_CHECK(mode >= F_NEAREST && mode <= F_ERROR_FEEDBACK, "mode must be 0 (nearest), 1 (stochastic), 2 (error feedback)");
  TORCH_CHECK(masters.size() == outs.size(), "masters and outs must be lists of one length");
  TORCH_CHECK(mode != F_ERROR_FEEDBACK || residuals.size() == masters.size(), "error feedback needs one residual per master");
  TORCH_CHECK(scales.device().is_cpu() && scales.scalar_type() == torch::kFloat32 && scales.dim() == 1 &&
              scales.is_contiguous(), "scales must be a contiguous 1-D CPU float32 tensor");
  std::vector<int64_t> size;
  const auto x = pointers<const float>(masters, torch::kFloat32, "masters", &size);
  const auto o = pointers<uint8_t>(outs, torch::kUInt8, "outs", &size);
  const auto r = pointers<float>(mode == F_ERROR_FEEDBACK ? residuals : std::vector<torch::Tensor>{},
                                 torch::kFloat32, "residuals", &size);
  const Tiles tiles = make_tiles(segments, size, FP8_COLS);
  check_fp8_rows(tiles, segments.size(0), scales.numel());
  const bool mul = multipliers.numel() > 0;  // codes y * multiplier (else y / scale)
  TORCH_CHECK(!mul || (multipliers.device().is_cpu() && multipliers.scalar_type() == torch::kFloat32 &&
                       multipliers.is_contiguous() && multipliers.numel() == scales.numel()),
              "multipliers must be empty or a contiguous CPU float32 tensor shaped like scales");
  const float* sc = scales.data_ptr<float>();
  const float* mc = mul ? multipliers.data_ptr<float>() : sc;
  at::parallel_for(0, tiles.total(), 4, [&](int64_t begin, int64_t end) {
    alignas(64) uint32_t words[4 * SUB / 8];
    for (int64_t t = begin; t < end; ++t) {
      int64_t s, lo, hi, sidx;
      tiles.locate(t, s, lo, hi);
      const int64_t* row = tiles.row(s);
      const int64_t k = row[C_TENSOR], g0 = row[C_INDEX];
      const float* xs = x[k] + row[C_START];
      uint8_t* os = o[k] + row[C_START];
      float* rs = r.empty() ? nullptr : r[k] + row[C_START];
      for (int64_t a = lo, b; a < hi; a = b) {  // sub-tiles at param-global multiples of SUB
        const int64_t g = g0 + a;
        b = std::min(hi, a + SUB - g % SUB);
        const uint16_t* bits = nullptr;
        if (mode == F_STOCHASTIC) {
          prefetch_ahead(xs, a, b, row[C_NUMEL]);
          const int64_t blk0 = g / 8;
          philox_blocks((uint64_t)blk0, (g + (b - a) - 1) / 8 - blk0 + 1, (uint32_t)row[C_K0], (uint32_t)row[C_K1], words);
          bits = reinterpret_cast<const uint16_t*>(words) + (g - 8 * blk0);  // element a's bits
        }
        for (int64_t c = a, n; c < b; c += n) {  // runs sharing one scale
          n = scale_run(row, g0 + c, b - c, sidx);
          const uint16_t* rb = bits ? bits + (c - a) : nullptr;
          if (mul) fp8_run_mode<true>(mode, via_bf16, xs + c, rb, rs ? rs + c : nullptr, os + c, n, sc[sidx], mc[sidx]);
          else fp8_run_mode<false>(mode, via_bf16, xs + c, rb, rs ? rs + c : nullptr, os + c, n, sc[sidx], sc[sidx]);
        }
      }
    }
  });
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("cast_stochastic_multi", &cast_stochastic_multi, "fused stochastic rounding of tensor lists over a segment table");
  m.def("cast_error_feedback_multi", &cast_error_feedback_multi, "fused error feedback of tensor lists over a segment table");
  m.def("fp8_absmax_multi", &fp8_absmax_multi, "per-scale partial absmax of FP8 rows (max into absmax)");
  m.def("cast_fp8_multi", &cast_fp8_multi, "fused fp32 -> FP8 E4M3 casts of tensor lists over an FP8 segment table");
}
