// Fused fp32 -> bf16 Fair Cast on the CPU: one parallel loop over a flat buffer.
//
// The executable spec is faircast_dist/rounding.py + philox.py; this file must give the same
// bits (tests/test_fused.py). Built by faircast_dist/fused.py with torch.utils.cpp_extension
// (-O3 -march=native -fopenmp, never -ffast-math: it would flush subnormals to zero).
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
// microbenchmark: SUB = 128..512 alike, 64 worse; non-temporal stores and prefetching no gain).
constexpr int64_t SUB = 256;
static_assert(TILE % SUB == 0 && SUB % 8 == 0, "tiles and sub-tiles must hold whole Philox blocks");
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

// Error feedback (rounding.py: cast_error_feedback): y = x + e; q = RTN(y); e = y - q.
template <typename Res>
void ef_run(const float* __restrict x, Res* __restrict res, uint16_t* __restrict out, int64_t n);

template <>
void ef_run<float>(const float* __restrict x, float* __restrict res, uint16_t* __restrict out, int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    const float xi = x[i], e = res[i];
    const uint32_t xb = f2u(xi);
    const bool finite = (xb & MAG) < INF;
    float y = e == 0.0f ? xi : xi + e;  // -0 + 0 would give +0: keep the master's sign
    y = y > BF16_MAX ? BF16_MAX : (y < -BF16_MAX ? -BF16_MAX : y);  // saturate; NaN passes
    const uint32_t yb = f2u(y);
    const uint16_t q = (yb & MAG) > INF ? nonfinite16(yb) : rtn16(yb);
    out[i] = finite ? q : nonfinite16(xb);
    res[i] = finite ? y - u2f((uint32_t)q << 16) : e;
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
    float y = e == 0.0f ? xi : xi + e;
    y = y > BF16_MAX ? BF16_MAX : (y < -BF16_MAX ? -BF16_MAX : y);
    const uint32_t yb = f2u(y);
    const uint16_t q = (yb & MAG) > INF ? nonfinite16(yb) : rtn16(yb);
    const uint32_t db = f2u(y - u2f((uint32_t)q << 16));  // exact; stored rounded to nearest
    const uint16_t d = (db & MAG) > INF ? nonfinite16(db) : rtn16(db);
    out[i] = finite ? q : nonfinite16(xb);
    res[i] = finite ? d : eb;
  }
}

enum Col { C_TENSOR, C_START, C_NUMEL, C_INDEX, C_K0, C_K1, COLS };

struct Tiles {
  const int64_t* seg;            // [S, COLS]
  std::vector<int64_t> prefix;  // prefix[s] = first tile of segment s; prefix[S] = total
  int64_t total() const { return prefix.back(); }
  // Segment s, and the tile's elements [lo, hi) as offsets into the segment.
  void locate(int64_t t, int64_t& s, int64_t& lo, int64_t& hi) const {
    s = (int64_t)(std::upper_bound(prefix.begin(), prefix.end(), t) - prefix.begin()) - 1;
    const int64_t g0 = seg[COLS * s + C_INDEX], n = seg[COLS * s + C_NUMEL];
    const int64_t w = (g0 / TILE + (t - prefix[s])) * TILE - g0;  // the tile's window, from g0
    lo = std::max(w, (int64_t)0);
    hi = std::min(w + TILE, n);  // (w + g0 + TILE could pass INT64_MAX)
  }
};

// The tiles of a segment table over tensors of sizes ``size`` (rows checked: a bad row would
// write out of bounds; faircast_dist/fused.py names the row first).
Tiles make_tiles(const torch::Tensor& segments, const std::vector<int64_t>& size) {
  TORCH_CHECK(segments.device().is_cpu() && segments.scalar_type() == torch::kInt64 && segments.dim() == 2 &&
              segments.size(1) == COLS && segments.is_contiguous(),
              "segments must be a contiguous CPU int64 [S, 6] table");
  Tiles t{segments.data_ptr<int64_t>(), std::vector<int64_t>(segments.size(0) + 1, 0)};
  for (int64_t s = 0; s < segments.size(0); ++s) {
    const int64_t* row = t.seg + COLS * s;
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
      const int64_t* row = tiles.seg + COLS * s;
      const uint32_t k0 = (uint32_t)row[C_K0], k1 = (uint32_t)row[C_K1];
      const uint32_t* xs = x[row[C_TENSOR]] + row[C_START];
      uint16_t* os = o[row[C_TENSOR]] + row[C_START];
      for (int64_t a = lo, b; a < hi; a = b) {  // sub-tiles at param-global multiples of SUB
        const int64_t g = row[C_INDEX] + a;
        b = std::min(hi, a + SUB - g % SUB);
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
      const int64_t* row = tiles.seg + COLS * s;
      const int64_t k = row[C_TENSOR], off = row[C_START] + lo;
      if (fp32_res)
        ef_run<float>(x[k] + off, static_cast<float*>(r[k]) + off, o[k] + off, hi - lo);
      else
        ef_run<uint16_t>(x[k] + off, static_cast<uint16_t*>(r[k]) + off, o[k] + off, hi - lo);
    }
  });
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("cast_stochastic_multi", &cast_stochastic_multi, "fused stochastic rounding of tensor lists over a segment table");
  m.def("cast_error_feedback_multi", &cast_error_feedback_multi, "fused error feedback of tensor lists over a segment table");
}
