// tqbench native CPU decode attention straight from the packed KV store.
//
// One call (`attend`) attends the queries of B sequences over each sequence's own store: sequence s reads
// side K[s] and side V[s] (a `Side`: kind, bits, codes, norms/scales/zeros, codebook, rotation, centring mean,
// dense row chunks). A side may cover several batch rows (one padded store, as the model hands it) or one
// sequence (the ragged batch of serving: own length, own dense rows, own mask; no padding of codes to the
// longest, no dense history built). Rows are in store order: [dense before (sinks) | packed run | dense after
// (tail + this call's rows)], K and V each with their own packed range. Packed rows are decoded one row at a
// time into registers/L1 (never a decoded copy of the history): TurboQuant keys score in the rotated domain
// (n * <R q, c[idx]> + <q, mu>), TurboQuant values accumulate in the rotated domain and are rotated back once
// per query at the end (+ p * mu for centred values); affine int1-8 rows dequantize in place (per-token
// groups or KIVI per-channel blocks). One decoded row serves every query head of its KV head (GQA) and every
// query token of the call.
//
// Work is split over (sequence, kv head, token block) with at::parallel_for (torch's own thread pool); every
// block keeps an online-softmax partial (max, sum, accumulators) that is merged at the end (split-K), so
// the workspace is the partials, not the scores. Sparse-V skips value rows whose softmax weight (an upper
// bound of it, from the block's partial softmax) is below a threshold for every query of the block.
//
// Every size, dtype and stride the caller passes is checked here (`check_side`, `attend`): a bad argument is a
// Python exception that names it, never an out-of-bounds read. The SIMD rules (which widths decode in SIMD
// order, the head-dim multiple, the token block) live in this file only; `rules()` and `simd_order()` expose
// them to Python.
//
// Code layout (tqbench/kernels/packing.py): an LSB-first bit stream per row, value i at bits
// [i*bits, (i+1)*bits).

#include <torch/extension.h>
#include <ATen/Parallel.h>

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define TQ_AVX512 1
#else
#define TQ_AVX512 0
#endif
#if !TQ_AVX512 && defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define TQ_AVX2 1
#else
#define TQ_AVX2 0
#endif
#if defined(__AVX512VBMI__) && TQ_AVX512
#define TQ_VBMI 1
#else
#define TQ_VBMI 0
#endif
#if TQ_AVX512 || TQ_AVX2
#include <immintrin.h>
#endif

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <optional>
#include <string>
#include <vector>

namespace {

// -- the rules (one place; Python asks `rules()`) ----------------------------------------------------------
constexpr int64_t MIN_BLOCK = 32;          // the smallest token block of a work item
constexpr int64_t MAX_BLOCK = 2048;        // the largest (its scores stay in L2)
constexpr int64_t BLOCKS_PER_THREAD = 8;   // work items per thread the split aims for (keeps threads busy at batch 1)
constexpr int64_t SIMD_DIM_MULTIPLE = 64;  // turbo rows decode in SIMD order when head_dim % 64 == 0 (fp32)
constexpr int64_t MAX_DENSE_CHUNKS = 8;    // dense row chunks per side
constexpr int64_t MAX_HEAD_DIM = 512;      // the widest row (a row's scales and zeros fit one stack buffer)

const char* isa_name() {
#if TQ_AVX512 && TQ_VBMI
  return "avx512+vbmi";
#elif TQ_AVX512
  return "avx512";
#elif TQ_AVX2
  return "avx2";
#else
  return "generic";
#endif
}

enum Kind : int64_t { DENSE = 0, TURBO = 1, AFFINE_TOKEN = 2, AFFINE_CHANNEL = 3 };

// turbo widths decoded in SIMD order (fp32, head_dim % 64 == 0)
inline bool simd_turbo(int64_t bits, int64_t D) {
#if TQ_AVX512 || TQ_AVX2
  return D % SIMD_DIM_MULTIPLE == 0 && bits >= 1 && bits <= 4;
#else
  (void)bits;
  (void)D;
  return false;
#endif
}

// Position p of a 64-code chunk holds coordinate simd_pos(bits, p) of the chunk (the unpack's natural output).
inline int64_t simd_pos(int64_t bits, int64_t p) {
#if TQ_AVX512
  if (bits == 4) return p < 32 ? 2 * p : 2 * (p - 32) + 1;
  if (bits == 2) return 4 * (p % 16) + p / 16;
#if TQ_VBMI
  if (bits == 3) return p;  // VBMI multishift unpacks 3-bit codes in their natural order
#else
  if (bits == 3) return 8 * (p % 8) + p / 8;
#endif
  return p;
#elif TQ_AVX2
  if (bits == 4) return p < 32 ? 2 * p : 2 * (p - 32) + 1;
  if (bits == 2) return 4 * (p % 16) + p / 16;
  if (bits == 3) return 8 * (p % 8) + p / 8;
  return p;
#else
  (void)bits;
  return p;
#endif
}

// What the caller describes, one per side per store (bound to Python as `Side`).
struct SideDesc {
  std::string kind = "dense";  // "dense", "turbo", "affine-token", "affine-channel"
  int64_t bits = 0, group = 1, head_dim = 0, n_before = 0, n_packed = 0;
  std::optional<torch::Tensor> codes, norms, scales, zeros, levels, rotation, mu;
  std::vector<torch::Tensor> dense;  // full-precision row chunks [Bs, H, n_i, head_dim], in token order
};

// The checked, pointer form the kernel reads.
template <typename T>
struct Side {
  int64_t kind = DENSE, bits = 0, group = 1, D = 0;
  int64_t nb = 0, np = 0, nd = 0;  // dense rows before the packed run; packed tokens; dense rows in all
  const uint8_t* codes = nullptr;
  int64_t c_b = 0, c_h = 0, c_r = 0;  // codes [Bs, H, R, bytes] (R = tokens, or blocks for KIVI)
  const at::Half* a = nullptr;  // turbo: norm [Bs, H, N, 1]; affine: scale [Bs, H, R, G | D]
  int64_t a_b = 0, a_h = 0, a_r = 0;
  const at::Half* z = nullptr;  // affine: zero, same shape as scale
  int64_t z_b = 0, z_h = 0, z_r = 0;
  T lut[256];  // value of each code: turbo codebook, or 0..2^bits-1 for affine
  float lutpad[16] = {0};
  std::vector<T> btab;  // [256][per_byte] decoded values of every byte (bits 1, 2, 4, 8)
  int64_t per_byte = 0;
  const T* rot = nullptr;  // turbo rotation [D, D] (natural row order)
  const at::Half* mu = nullptr;  // turbo centring [Bs|1, H, 1, D]
  int64_t mu_b = 0, mu_h = 0;
  std::vector<int32_t> order;  // SIMD decode order of the rotated coordinates (empty: natural)
  int nchunks = 0;
  const T* dptr[MAX_DENSE_CHUNKS];
  int64_t dend[MAX_DENSE_CHUNKS], db[MAX_DENSE_CHUNKS], dh[MAX_DENSE_CHUNKS], dr[MAX_DENSE_CHUNKS];
};

inline void half_to(const at::Half* src, int64_t n, float* out) {
  int64_t i = 0;
#if TQ_AVX512
  for (; i + 16 <= n; i += 16)
    _mm512_storeu_ps(out + i, _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + i))));
#elif TQ_AVX2
  for (; i + 8 <= n; i += 8)
    _mm256_storeu_ps(out + i, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i))));
#endif
  for (; i < n; ++i) out[i] = static_cast<float>(src[i]);
}
inline void half_to(const at::Half* src, int64_t n, double* out) {
  for (int64_t i = 0; i < n; ++i) out[i] = static_cast<double>(static_cast<float>(src[i]));
}

// codes of one row -> lut values (n codes starting at bit `bitoff` of p)
template <typename T>
inline void decode_codes(const Side<T>& s, const uint8_t* p, int64_t bitoff, int64_t n, T* out) {
  const int64_t bits = s.bits;
  if (s.kind != TURBO && (bitoff & 7) == 0 && (bits == 8 || bits == 4 || bits == 2) && n % (8 / bits) == 0) {
    // affine codes are their own values: unpack and convert (vectorizes), no table
    const uint8_t* q = p + (bitoff >> 3);
    if (bits == 8) {
#pragma omp simd
      for (int64_t i = 0; i < n; ++i) out[i] = static_cast<T>(q[i]);
    } else if (bits == 4) {
#pragma omp simd
      for (int64_t i = 0; i < n / 2; ++i) {
        out[2 * i] = static_cast<T>(q[i] & 15);
        out[2 * i + 1] = static_cast<T>(q[i] >> 4);
      }
    } else {
#pragma omp simd
      for (int64_t i = 0; i < n / 4; ++i) {
        out[4 * i] = static_cast<T>(q[i] & 3);
        out[4 * i + 1] = static_cast<T>((q[i] >> 2) & 3);
        out[4 * i + 2] = static_cast<T>((q[i] >> 4) & 3);
        out[4 * i + 3] = static_cast<T>(q[i] >> 6);
      }
    }
    return;
  }
  if (s.per_byte && (bitoff & 7) == 0 && n % s.per_byte == 0) {
    p += bitoff >> 3;
    const int64_t nbytes = n / s.per_byte;
    const int64_t pb = s.per_byte;
    const T* tab = s.btab.data();
    if (pb == 2) {
      for (int64_t i = 0; i < nbytes; ++i) {
        const T* e = tab + 2 * p[i];
        out[2 * i] = e[0];
        out[2 * i + 1] = e[1];
      }
    } else if (pb == 1) {
      for (int64_t i = 0; i < nbytes; ++i) out[i] = s.lut[p[i]];
    } else {
      for (int64_t i = 0; i < nbytes; ++i) std::memcpy(out + pb * i, tab + pb * p[i], pb * sizeof(T));
    }
    return;
  }
  const uint32_t mask = (1u << bits) - 1u;
  if ((bitoff & 7) == 0 && n % 8 == 0) {  // 8 codes in `bits` whole bytes: one little-endian word per group
    p += bitoff >> 3;
    for (int64_t g = 0; g < n / 8; ++g) {
      uint64_t w = 0;
      std::memcpy(&w, p + g * bits, bits);
      for (int k = 0; k < 8; ++k) out[8 * g + k] = s.lut[(w >> (k * bits)) & mask];
    }
    return;
  }
  for (int64_t j = 0; j < n; ++j) {
    const int64_t bit = bitoff + j * bits;
    const int64_t byte = bit >> 3, sh = bit & 7;
    uint32_t w = p[byte];
    if (sh + bits > 8) w |= uint32_t(p[byte + 1]) << 8;
    out[j] = s.lut[(w >> sh) & mask];
  }
}

// -- TurboQuant rows in SIMD order ------------------------------------------------------------------------
// fp32 turbo rows with D % 64 == 0 decode 64 codes at a time, each position holding the coordinate
// simd_pos() names (the unpack's natural output; the kernel reads the rotation's rows in that order, so
// queries and rotated-domain sums are already in it and nothing is shuffled per row).
#if TQ_AVX512
inline __attribute__((always_inline)) void decode_turbo_simd(const uint8_t* p, int64_t bits, int64_t D, const float* lut, float* out) {
  const __m512 cb = _mm512_loadu_ps(lut);  // 2**bits <= 16 entries (the table is padded to 16)
  for (int64_t c = 0; c < D / 64; ++c, out += 64) {
    if (bits == 1) {  // bit j of the stream picks level 1 for code j: a mask blend per 16 codes, natural order
      const uint8_t* q = p + 8 * c;
      const __m512 c0 = _mm512_set1_ps(lut[0]), c1 = _mm512_set1_ps(lut[1]);
      for (int k = 0; k < 4; ++k) {
        const __mmask16 m = static_cast<__mmask16>(q[2 * k] | (q[2 * k + 1] << 8));
        _mm512_storeu_ps(out + 16 * k, _mm512_mask_blend_ps(m, c0, c1));
      }
    } else if (bits == 4) {
      const uint8_t* q = p + 32 * c;
      const __m512i x0 = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q)));
      const __m512i x1 = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q + 16)));
      const __m512i m = _mm512_set1_epi32(15);
      _mm512_storeu_ps(out, _mm512_permutexvar_ps(_mm512_and_si512(x0, m), cb));
      _mm512_storeu_ps(out + 16, _mm512_permutexvar_ps(_mm512_and_si512(x1, m), cb));
      _mm512_storeu_ps(out + 32, _mm512_permutexvar_ps(_mm512_srli_epi32(x0, 4), cb));
      _mm512_storeu_ps(out + 48, _mm512_permutexvar_ps(_mm512_srli_epi32(x1, 4), cb));
    } else if (bits == 2) {
      const __m512i x = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 16 * c)));
      const __m512i m = _mm512_set1_epi32(3);
      for (int k = 0; k < 4; ++k)
        _mm512_storeu_ps(out + 16 * k, _mm512_permutexvar_ps(_mm512_and_si512(_mm512_srli_epi32(x, 2 * k), m), cb));
    } else {  // 3 bits: 8 groups of 3 bytes hold 8 codes each
      const uint8_t* q = p + 24 * c;
#if TQ_VBMI
      // bytes 3L..3L+2 into 64-bit lane L, then one multishift cuts the 8 codes of every lane: natural order
      const __m512i raw = _mm512_castsi256_si512(_mm256_inserti128_si256(  // 16 + 8 bytes (a masked load is slow)
          _mm256_castsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q))),
          _mm_loadl_epi64(reinterpret_cast<const __m128i*>(q + 16)), 1));
      const __m512i idx = _mm512_set_epi64(0x1717171717171615LL, 0x1414141414141312LL, 0x111111111111100FLL, 0x0E0E0E0E0E0E0D0CLL, 0x0B0B0B0B0B0B0A09LL, 0x0808080808080706LL, 0x0505050505050403LL, 0x0202020202020100LL);  // lane L: bytes 3L, 3L+1, 3L+2
      const __m512i g = _mm512_permutexvar_epi8(idx, raw);
      const __m512i codes = _mm512_and_si512(_mm512_multishift_epi64_epi8(_mm512_set1_epi64(0x15120F0C09060300LL), g),
                                             _mm512_set1_epi8(7));
      _mm512_storeu_ps(out, _mm512_permutexvar_ps(_mm512_cvtepu8_epi32(_mm512_castsi512_si128(codes)), cb));
      _mm512_storeu_ps(out + 16, _mm512_permutexvar_ps(_mm512_cvtepu8_epi32(_mm512_extracti32x4_epi32(codes, 1)), cb));
      _mm512_storeu_ps(out + 32, _mm512_permutexvar_ps(_mm512_cvtepu8_epi32(_mm512_extracti32x4_epi32(codes, 2)), cb));
      _mm512_storeu_ps(out + 48, _mm512_permutexvar_ps(_mm512_cvtepu8_epi32(_mm512_extracti32x4_epi32(codes, 3)), cb));
#else
      alignas(32) int32_t w[8];
      for (int g = 0; g < 8; ++g) w[g] = int32_t(q[3 * g]) | int32_t(q[3 * g + 1]) << 8 | int32_t(q[3 * g + 2]) << 16;
      const __m256i wv = _mm256_load_si256(reinterpret_cast<const __m256i*>(w));
      const __m256 cb8 = _mm256_loadu_ps(lut);
      const __m256i m = _mm256_set1_epi32(7);
      for (int k = 0; k < 8; ++k)
        _mm256_storeu_ps(out + 8 * k, _mm256_permutevar8x32_ps(cb8, _mm256_and_si256(_mm256_srli_epi32(wv, 3 * k), m)));
#endif
    }
  }
}
#elif TQ_AVX2
// 16-entry lookup of 8 codes (0..15): two 8-entry permutes and a blend on bit 3.
inline __m256 lut16(__m256i x, __m256 lo, __m256 hi) {
  const __m256 a = _mm256_permutevar8x32_ps(lo, x), b = _mm256_permutevar8x32_ps(hi, x);
  return _mm256_blendv_ps(a, b, _mm256_castsi256_ps(_mm256_slli_epi32(x, 28)));
}

inline __attribute__((always_inline)) void decode_turbo_simd(const uint8_t* p, int64_t bits, int64_t D, const float* lut, float* out) {
  const __m256 lo = _mm256_loadu_ps(lut), hi = _mm256_loadu_ps(lut + 8);
  for (int64_t c = 0; c < D / 64; ++c, out += 64) {
    if (bits == 1) {  // natural order: lane k of byte i takes bit k
      const uint8_t* q = p + 8 * c;
      const __m256 c0 = _mm256_set1_ps(lut[0]), c1 = _mm256_set1_ps(lut[1]);
      const __m256i sel = _mm256_setr_epi32(1, 2, 4, 8, 16, 32, 64, 128);
      for (int k = 0; k < 8; ++k) {
        const __m256i on = _mm256_cmpeq_epi32(_mm256_and_si256(_mm256_set1_epi32(q[k]), sel), sel);
        _mm256_storeu_ps(out + 8 * k, _mm256_blendv_ps(c0, c1, _mm256_castsi256_ps(on)));
      }
    } else if (bits == 4) {  // position i < 32: low nibble of byte i; i >= 32: high nibble of byte i - 32
      const uint8_t* q = p + 32 * c;
      const __m256i m = _mm256_set1_epi32(15);
      for (int k = 0; k < 4; ++k) {
        const __m256i x = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(q + 8 * k)));
        _mm256_storeu_ps(out + 8 * k, lut16(_mm256_and_si256(x, m), lo, hi));
        _mm256_storeu_ps(out + 32 + 8 * k, lut16(_mm256_srli_epi32(x, 4), lo, hi));
      }
    } else if (bits == 2) {  // position 16k + i: code 4i + k (byte i, shift 2k)
      const uint8_t* q = p + 16 * c;
      const __m256i m = _mm256_set1_epi32(3);
      const __m256i x0 = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(q)));
      const __m256i x1 = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(q + 8)));
      for (int k = 0; k < 4; ++k) {
        _mm256_storeu_ps(out + 16 * k, _mm256_permutevar8x32_ps(lo, _mm256_and_si256(_mm256_srli_epi32(x0, 2 * k), m)));
        _mm256_storeu_ps(out + 16 * k + 8, _mm256_permutevar8x32_ps(lo, _mm256_and_si256(_mm256_srli_epi32(x1, 2 * k), m)));
      }
    } else {  // 3 bits: position 8k + g: code 8g + k
      const uint8_t* q = p + 24 * c;
      alignas(32) int32_t w[8];
      for (int g = 0; g < 8; ++g) w[g] = int32_t(q[3 * g]) | int32_t(q[3 * g + 1]) << 8 | int32_t(q[3 * g + 2]) << 16;
      const __m256i wv = _mm256_load_si256(reinterpret_cast<const __m256i*>(w));
      const __m256i m = _mm256_set1_epi32(7);
      for (int k = 0; k < 8; ++k)
        _mm256_storeu_ps(out + 8 * k, _mm256_permutevar8x32_ps(lo, _mm256_and_si256(_mm256_srli_epi32(wv, 3 * k), m)));
    }
  }
}
#endif

template <typename T>
inline bool decode_turbo_fast(const Side<T>&, const uint8_t*, T*) { return false; }

#if TQ_AVX512 || TQ_AVX2
template <>
inline bool decode_turbo_fast<float>(const Side<float>& s, const uint8_t* p, float* out) {
  if (s.order.empty()) return false;
  decode_turbo_simd(p, s.bits, s.D, s.lutpad, out);
  return true;
}
#endif

#define TQ_INLINE inline __attribute__((always_inline))

// Row `t` (store order) of one side for batch row b of the side, head h: a pointer to D values, `scale`
// (turbo norm, else 1) and whether it lives in the rotated domain (turbo packed rows).
template <typename T>
TQ_INLINE const T* fetch_row(const Side<T>& s, int64_t b, int64_t h, int64_t t, T* buf, T& scale, bool& rot) {
  scale = T(1);
  rot = false;
  if (t < s.nb || t >= s.nb + s.np) {
    const int64_t r = t < s.nb ? t : t - s.np;
    int k = 0;
    while (r >= s.dend[k]) ++k;
    const int64_t r0 = k ? s.dend[k - 1] : 0;
    return s.dptr[k] + b * s.db[k] + h * s.dh[k] + (r - r0) * s.dr[k];
  }
  const int64_t n = t - s.nb;
  const int64_t D = s.D;
  if (s.kind == TURBO) {
    const uint8_t* p = s.codes + b * s.c_b + h * s.c_h + n * s.c_r;
    if (!decode_turbo_fast(s, p, buf)) decode_codes(s, p, 0, D, buf);
    scale = static_cast<T>(static_cast<float>(s.a[b * s.a_b + h * s.a_h + n * s.a_r]));
    rot = true;
    return buf;
  }
  T sc[2 * MAX_HEAD_DIM];  // scale then zero of this row (affine-token: D / group values; KIVI: D values)
  if (s.kind == AFFINE_TOKEN) {
    decode_codes(s, s.codes + b * s.c_b + h * s.c_h + n * s.c_r, 0, D, buf);
    const int64_t gs = s.group, ng = D / gs;
    half_to(s.a + b * s.a_b + h * s.a_h + n * s.a_r, ng, sc);
    half_to(s.z + b * s.z_b + h * s.z_h + n * s.z_r, ng, sc + ng);
    for (int64_t g = 0; g < ng; ++g) {
      const T a = sc[g], z = sc[ng + g];
      T* bg = buf + g * gs;
#pragma omp simd
      for (int64_t j = 0; j < gs; ++j) bg[j] = bg[j] * a + z;
    }
    return buf;
  }
  // AFFINE_CHANNEL (KIVI): blocks of `group` tokens, token-major codes, scale/zero per (block, channel)
  const int64_t u = n / s.group, k = n % s.group;
  decode_codes(s, s.codes + b * s.c_b + h * s.c_h + u * s.c_r, k * D * s.bits, D, buf);
  half_to(s.a + b * s.a_b + h * s.a_h + u * s.a_r, D, sc);
  half_to(s.z + b * s.z_b + h * s.z_h + u * s.z_r, D, sc + D);
#pragma omp simd
  for (int64_t j = 0; j < D; ++j) buf[j] = buf[j] * sc[j] + sc[D + j];
  return buf;
}

// Rows [t, t + nt) of one side when they all lie in its packed turbo run and decode in SIMD order: one tight
// loop (no per-row branches); false otherwise (the caller fetches row by row).
template <typename T>
TQ_INLINE bool fetch_tile_turbo(const Side<T>& s, int64_t b, int64_t h, int64_t t, int64_t nt, T* buf, int64_t ld,
                                const T** rows, T* scale, bool* rot) {
  if (s.kind != TURBO || s.order.empty() || t < s.nb || t + nt > s.nb + s.np) return false;
  const int64_t n = t - s.nb;
  const uint8_t* p = s.codes + b * s.c_b + h * s.c_h + n * s.c_r;
  const at::Half* a = s.a + b * s.a_b + h * s.a_h + n * s.a_r;
  for (int64_t j = 0; j < nt; ++j) {
    decode_turbo_fast(s, p + j * s.c_r, buf + j * ld);
    rows[j] = buf + j * ld;
    scale[j] = static_cast<T>(static_cast<float>(a[j * s.a_r]));
    rot[j] = true;
  }
  return true;
}

// exp for the softmax: float uses a vectorizable 2^x polynomial (relative error ~2e-7; exactly 0 below
// -87, so masked scores give weight 0), double uses std::exp (the float64 path is the exact reference).
inline float fast_exp(float x) {
  const float y = std::max(x, -87.0f) * 1.4426950408889634f;
  const float n = std::nearbyint(y);
  const float f = y - n;  // [-0.5, 0.5]
  float p = 1.5353362e-4f;
  p = p * f + 1.3398874e-3f;
  p = p * f + 9.6181291e-3f;
  p = p * f + 5.5504109e-2f;
  p = p * f + 2.4022650e-1f;
  p = p * f + 6.9314718e-1f;
  p = p * f + 1.0f;
  int32_t bits;
  std::memcpy(&bits, &p, 4);
  bits += static_cast<int32_t>(n) << 23;
  float r;
  std::memcpy(&r, &bits, 4);
  return x < -87.0f ? 0.0f : r;
}
inline double fast_exp(double x) { return std::exp(x); }

template <typename T>
inline void exp_shift(T* s, int64_t n, T shift, T& sum) {
  T acc = 0;
#pragma omp simd reduction(+ : acc)
  for (int64_t i = 0; i < n; ++i) {
    s[i] = fast_exp(s[i] - shift);
    acc += s[i];
  }
  sum = acc;
}

template <typename T>
inline T dot(const T* __restrict a, const T* __restrict b, int64_t n) {
  T s = 0;
#pragma omp simd reduction(+ : s)
  for (int64_t j = 0; j < n; ++j) s += a[j] * b[j];
  return s;
}

template <typename T>
inline void axpy(T w, const T* __restrict x, T* __restrict y, int64_t n) {
#pragma omp simd
  for (int64_t j = 0; j < n; ++j) y[j] += w * x[j];
}

constexpr int64_t TILE = 16;  // rows per tile: scores of a tile reduce together (one vector of 16 sums)

// Scores of one tile: s[m * ld + j] = scale_j * <q_m or qr_m, row_j> + (rot_j ? qmu_m : 0).
template <typename T>
inline void tile_scores_generic(const T* const* rows, const T* scale, const bool* rot, int64_t nt, const T* q,
                        const T* qr, const T* qmu, int64_t M, int64_t D, T* s, int64_t ld) {
  for (int64_t m = 0; m < M; ++m)
    for (int64_t j = 0; j < nt; ++j)
      s[m * ld + j] = rot[j] ? scale[j] * dot(qr + m * D, rows[j], D) + (qmu ? qmu[m] : T(0))
                             : dot(q + m * D, rows[j], D);
}

// Values of one tile: acc_m += w_mj * row_j, w_mj = p_mj * scale_j, into accP (rotated rows) or accD.
template <typename T>
inline void tile_values_generic(const T* const* rows, const T* scale, const bool* rot, int64_t nt, const T* p,
                        int64_t ld, int64_t M, int64_t Dv, T* accD, T* accP, T* ps) {
  for (int64_t m = 0; m < M; ++m)
    for (int64_t j = 0; j < nt; ++j) {
      const T w = p[m * ld + j];
      if (rows[j] == nullptr || w == 0) continue;
      if (rot[j]) {
        axpy(w * scale[j], rows[j], accP + m * Dv, Dv);
        ps[m] += w;
      } else {
        axpy(w, rows[j], accD + m * Dv, Dv);
      }
    }
}

template <typename T>
inline void tile_scores(const T* const* rows, const T* scale, const bool* rot, int64_t nt, const T* q,
                        const T* qr, const T* qmu, int64_t M, int64_t D, T* s, int64_t ld) {
  tile_scores_generic(rows, scale, rot, nt, q, qr, qmu, M, D, s, ld);
}

template <typename T>
inline void tile_values(const T* const* rows, const T* scale, const bool* rot, int64_t nt, const T* p,
                        int64_t ld, int64_t M, int64_t Dv, T* accD, T* accP, T* ps) {
  tile_values_generic(rows, scale, rot, nt, p, ld, M, Dv, accD, accP, ps);
}

#if TQ_AVX512
// 16 vectors -> one vector of their 16 horizontal sums (lane j = sum of a[j]).
inline __m512 reduce16(__m512* a) {
  alignas(64) static const int32_t i1lo[16] = {0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23};
  alignas(64) static const int32_t i1hi[16] = {8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31};
  alignas(64) static const int32_t i2lo[16] = {0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27};
  alignas(64) static const int32_t i2hi[16] = {4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31};
  alignas(64) static const int32_t i3lo[16] = {0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29};
  alignas(64) static const int32_t i3hi[16] = {2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22, 23, 26, 27, 30, 31};
  alignas(64) static const int32_t i4lo[16] = {0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30};
  alignas(64) static const int32_t i4hi[16] = {1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31};
  const int32_t* lo[4] = {i1lo, i2lo, i3lo, i4lo};
  const int32_t* hi[4] = {i1hi, i2hi, i3hi, i4hi};
  int n = 16;
  for (int level = 0; level < 4; ++level) {
    const __m512i il = _mm512_load_si512(lo[level]), ih = _mm512_load_si512(hi[level]);
    for (int i = 0; i < n / 2; ++i)
      a[i] = _mm512_add_ps(_mm512_permutex2var_ps(a[2 * i], il, a[2 * i + 1]),
                           _mm512_permutex2var_ps(a[2 * i], ih, a[2 * i + 1]));
    n /= 2;
  }
  return a[0];
}

// Scores of a full-width tile whose rows all use the same query side, NV = D / 16 vectors per row (kept in
// registers), four rows in flight so the FMA chains overlap.
template <int NV>
inline __m512 tile_scores_nv(const float* const* rows, const float* qv_ptr, int64_t nt) {
  __m512 qv[NV];
  for (int c = 0; c < NV; ++c) qv[c] = _mm512_loadu_ps(qv_ptr + 16 * c);
  __m512 acc[16];
  for (int j = 0; j < 16; j += 4) {
    __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
    if (j + 3 < nt) {
      for (int c = 0; c < NV; ++c) {
        a0 = _mm512_fmadd_ps(qv[c], _mm512_loadu_ps(rows[j] + 16 * c), a0);
        a1 = _mm512_fmadd_ps(qv[c], _mm512_loadu_ps(rows[j + 1] + 16 * c), a1);
        a2 = _mm512_fmadd_ps(qv[c], _mm512_loadu_ps(rows[j + 2] + 16 * c), a2);
        a3 = _mm512_fmadd_ps(qv[c], _mm512_loadu_ps(rows[j + 3] + 16 * c), a3);
      }
    } else {
      for (int c = 0; c < NV; ++c) {
        if (j < nt) a0 = _mm512_fmadd_ps(qv[c], _mm512_loadu_ps(rows[j] + 16 * c), a0);
        if (j + 1 < nt) a1 = _mm512_fmadd_ps(qv[c], _mm512_loadu_ps(rows[j + 1] + 16 * c), a1);
        if (j + 2 < nt) a2 = _mm512_fmadd_ps(qv[c], _mm512_loadu_ps(rows[j + 2] + 16 * c), a2);
      }
    }
    acc[j] = a0;
    acc[j + 1] = a1;
    acc[j + 2] = a2;
    acc[j + 3] = a3;
  }
  return reduce16(acc);
}

// Values of a tile for one query: acc += sum_j w_j row_j, two accumulator sets (even / odd rows).
template <int NV>
inline void tile_values_nv(const float* const* rows, const float* w, int64_t nt, float* acc) {
  __m512 e[NV], o[NV];
  for (int c = 0; c < NV; ++c) {
    e[c] = _mm512_loadu_ps(acc + 16 * c);
    o[c] = _mm512_setzero_ps();
  }
  int64_t j = 0;
  for (; j + 1 < nt; j += 2) {
    const __m512 w0 = _mm512_set1_ps(w[j]), w1 = _mm512_set1_ps(w[j + 1]);
    for (int c = 0; c < NV; ++c) {
      e[c] = _mm512_fmadd_ps(w0, _mm512_loadu_ps(rows[j] + 16 * c), e[c]);
      o[c] = _mm512_fmadd_ps(w1, _mm512_loadu_ps(rows[j + 1] + 16 * c), o[c]);
    }
  }
  if (j < nt) {
    const __m512 w0 = _mm512_set1_ps(w[j]);
    for (int c = 0; c < NV; ++c) e[c] = _mm512_fmadd_ps(w0, _mm512_loadu_ps(rows[j] + 16 * c), e[c]);
  }
  for (int c = 0; c < NV; ++c) _mm512_storeu_ps(acc + 16 * c, _mm512_add_ps(e[c], o[c]));
}

template <>
inline void tile_scores<float>(const float* const* rows, const float* scale, const bool* rot, int64_t nt,
                               const float* q, const float* qr, const float* qmu, int64_t M, int64_t D,
                               float* s, int64_t ld) {
  if (D % 16) return tile_scores_generic(rows, scale, rot, nt, q, qr, qmu, M, D, s, ld);
  bool same = true;
  for (int64_t j = 1; j < nt; ++j) same = same && rot[j] == rot[0];
  if (same && (D == 64 || D == 128)) {
    const bool rr = rot[0];
    const __mmask16 keep = static_cast<__mmask16>((1u << nt) - 1u);
    const __m512 scv = _mm512_maskz_loadu_ps(keep, scale);
    for (int64_t m = 0; m < M; ++m) {
      const float* qq = rr ? qr + m * D : q + m * D;
      __m512 r = D == 64 ? tile_scores_nv<4>(rows, qq, nt) : tile_scores_nv<8>(rows, qq, nt);
      if (rr) r = _mm512_fmadd_ps(r, scv, _mm512_set1_ps(qmu ? qmu[m] : 0.f));
      _mm512_mask_storeu_ps(s + m * ld, keep, r);
    }
    return;
  }
  alignas(64) float sc[16], rm[16];
  for (int j = 0; j < 16; ++j) {
    sc[j] = j < nt && rot[j] ? scale[j] : 1.f;
    rm[j] = j < nt && rot[j] ? 1.f : 0.f;
  }
  const __m512 scv = _mm512_load_ps(sc), rmv = _mm512_load_ps(rm);
  const __mmask16 keep = static_cast<__mmask16>((1u << nt) - 1u);
  __m512 acc[16];
  for (int64_t m = 0; m < M; ++m) {
    const float* qm = q + m * D;
    const float* qrm = qr ? qr + m * D : qm;
    for (int64_t j = 0; j < 16; ++j) {
      __m512 a = _mm512_setzero_ps();
      if (j < nt) {
        const float* qq = rot[j] ? qrm : qm;
        for (int64_t c = 0; c < D; c += 16) a = _mm512_fmadd_ps(_mm512_loadu_ps(qq + c), _mm512_loadu_ps(rows[j] + c), a);
      }
      acc[j] = a;
    }
    __m512 r = _mm512_mul_ps(reduce16(acc), scv);
    if (qmu) r = _mm512_fmadd_ps(rmv, _mm512_set1_ps(qmu[m]), r);
    _mm512_mask_storeu_ps(s + m * ld, keep, r);
  }
}

template <>
inline void tile_values<float>(const float* const* rows, const float* scale, const bool* rot, int64_t nt,
                               const float* p, int64_t ld, int64_t M, int64_t Dv, float* accD, float* accP,
                               float* ps) {
  if (Dv % 16 || Dv > 256) return tile_values_generic(rows, scale, rot, nt, p, ld, M, Dv, accD, accP, ps);
  if (Dv == 64 || Dv == 128) {  // compact the rows that carry weight, then one register pass per query
    const float* live[TILE];
    int64_t idx[TILE];
    int64_t nl = 0;
    bool rr = false, same = true;
    for (int64_t j = 0; j < nt; ++j) {
      if (rows[j] == nullptr) continue;
      if (nl == 0) rr = rot[j]; else same = same && rot[j] == rr;
      live[nl] = rows[j];
      idx[nl++] = j;
    }
    if (nl == 0) return;
    if (same && nl == nt) {  // every row of the tile weighs: vector weights and sums
      alignas(64) float w[TILE];
      const __mmask16 keep = static_cast<__mmask16>((1u << nt) - 1u);
      const __m512 scv = _mm512_maskz_loadu_ps(keep, scale);
      for (int64_t m = 0; m < M; ++m) {
        const __m512 pv = _mm512_maskz_loadu_ps(keep, p + m * ld);
        _mm512_store_ps(w, rr ? _mm512_mul_ps(pv, scv) : pv);
        float* acc = (rr ? accP : accD) + m * Dv;
        if (Dv == 64) tile_values_nv<4>(live, w, nl, acc); else tile_values_nv<8>(live, w, nl, acc);
        if (rr) ps[m] += _mm512_reduce_add_ps(pv);
      }
      return;
    }
    if (same) {
      alignas(64) float w[TILE];
      for (int64_t m = 0; m < M; ++m) {
        const float* pm = p + m * ld;
        float psum = 0.f;
        for (int64_t k = 0; k < nl; ++k) {
          w[k] = rr ? pm[idx[k]] * scale[idx[k]] : pm[idx[k]];
          psum += pm[idx[k]];
        }
        float* acc = (rr ? accP : accD) + m * Dv;
        if (Dv == 64) tile_values_nv<4>(live, w, nl, acc); else tile_values_nv<8>(live, w, nl, acc);
        if (rr) ps[m] += psum;
      }
      return;
    }
  }
  const int64_t nv = Dv / 16;
  __m512 ad[16], ap[16];
  for (int64_t m = 0; m < M; ++m) {
    for (int64_t c = 0; c < nv; ++c) {
      ad[c] = _mm512_loadu_ps(accD + m * Dv + 16 * c);
      ap[c] = _mm512_loadu_ps(accP + m * Dv + 16 * c);
    }
    float psum = 0.f;
    for (int64_t j = 0; j < nt; ++j) {
      const float w = p[m * ld + j];
      if (rows[j] == nullptr || w == 0) continue;
      if (rot[j]) {
        const __m512 wv = _mm512_set1_ps(w * scale[j]);
        for (int64_t c = 0; c < nv; ++c) ap[c] = _mm512_fmadd_ps(wv, _mm512_loadu_ps(rows[j] + 16 * c), ap[c]);
        psum += w;
      } else {
        const __m512 wv = _mm512_set1_ps(w);
        for (int64_t c = 0; c < nv; ++c) ad[c] = _mm512_fmadd_ps(wv, _mm512_loadu_ps(rows[j] + 16 * c), ad[c]);
      }
    }
    ps[m] += psum;
    for (int64_t c = 0; c < nv; ++c) {
      _mm512_storeu_ps(accD + m * Dv + 16 * c, ad[c]);
      _mm512_storeu_ps(accP + m * Dv + 16 * c, ap[c]);
    }
  }
}
#endif


// -- packed turbo tiles without a decoded copy (fp32, SIMD order, AVX-512) ------------------------------------
// A tile of rows that all lie in a side's packed turbo run is scored / accumulated 16 coordinates at a time: each
// 16-code chunk is unpacked into a register and used by every query of the KV head at once (no decoded row is
// stored and read back). Chunk k of a row is positions [16k, 16k + 16) of its SIMD order (simd_pos).
#if TQ_AVX512
template <int BITS>
TQ_INLINE __m512 turbo_chunk(const uint8_t* p, int k, __m512 cb) {
  const int g = k >> 2, c = k & 3;  // 64-code group, chunk within it
  if (BITS == 4) {
    const __m512i x = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 32 * g + 16 * (c & 1))));
    return _mm512_permutexvar_ps(c < 2 ? _mm512_and_si512(x, _mm512_set1_epi32(15)) : _mm512_srli_epi32(x, 4), cb);
  } else if (BITS == 2) {
    const __m512i x = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 16 * g)));
    return _mm512_permutexvar_ps(_mm512_and_si512(_mm512_srli_epi32(x, 2 * c), _mm512_set1_epi32(3)), cb);
  } else if (BITS == 1) {
    const uint8_t* q = p + 8 * g + 2 * c;
    const __mmask16 m = static_cast<__mmask16>(q[0] | (q[1] << 8));
    return _mm512_permutexvar_ps(_mm512_maskz_set1_epi32(m, 1), cb);
  } else {
#if TQ_VBMI
    // one byte permute puts the two bytes holding code 16c + j into lane j, a shift and a mask cut it out
    alignas(64) static const int32_t sel[4][16] = {
      {522125568, 522125568, 522125568, 522125825, 522125825, 522125825, 522126082, 522126082, 522126339, 522126339, 522126339, 522126596, 522126596, 522126596, 522126853, 522126853},
      {522127110, 522127110, 522127110, 522127367, 522127367, 522127367, 522127624, 522127624, 522127881, 522127881, 522127881, 522128138, 522128138, 522128138, 522128395, 522128395},
      {522128652, 522128652, 522128652, 522128909, 522128909, 522128909, 522129166, 522129166, 522129423, 522129423, 522129423, 522129680, 522129680, 522129680, 522129937, 522129937},
      {522130194, 522130194, 522130194, 522130451, 522130451, 522130451, 522130708, 522130708, 522130965, 522130965, 522130965, 522131222, 522131222, 522131222, 522131479, 522131479}};
    alignas(64) static const int32_t shv[4][16] = {
      {0, 3, 6, 1, 4, 7, 2, 5, 0, 3, 6, 1, 4, 7, 2, 5},
      {0, 3, 6, 1, 4, 7, 2, 5, 0, 3, 6, 1, 4, 7, 2, 5},
      {0, 3, 6, 1, 4, 7, 2, 5, 0, 3, 6, 1, 4, 7, 2, 5},
      {0, 3, 6, 1, 4, 7, 2, 5, 0, 3, 6, 1, 4, 7, 2, 5}};
    const uint8_t* q = p + 24 * g;
    const __m512i raw = _mm512_castsi256_si512(_mm256_inserti128_si256(
        _mm256_castsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q))),
        _mm_loadl_epi64(reinterpret_cast<const __m128i*>(q + 16)), 1));
    const __m512i two = _mm512_permutexvar_epi8(_mm512_load_si512(sel[c]), raw);
    return _mm512_permutexvar_ps(
        _mm512_and_si512(_mm512_srlv_epi32(two, _mm512_load_si512(shv[c])), _mm512_set1_epi32(7)), cb);
#else
    return cb;  // not used: 3-bit rows take the row path without VBMI
#endif
  }
}

inline bool tile_fast(int64_t bits) {
  return bits == 4 || bits == 2 || bits == 1 || (bits == 3 && TQ_VBMI);
}

// scores s[m * ld + j] = norm_j * <qr_m, c[idx_j]> + qmu_m for nt rows starting at packed row n
template <int BITS, int NV, int MB>
TQ_INLINE void turbo_scores_mb(const uint8_t* const* rp, const float* norm, int64_t nt, const float* qr,
                               const float* qmu, int64_t D, __m512 cb, float* s, int64_t ld) {
  for (int64_t j0 = 0; j0 < nt; j0 += 4) {
    __m512 acc[16];
    for (int i = 0; i < 16; ++i) acc[i] = _mm512_setzero_ps();
    const int64_t nj = std::min<int64_t>(4, nt - j0);
    for (int k = 0; k < NV; ++k) {
      __m512 qv[MB];
      for (int m = 0; m < MB; ++m) qv[m] = _mm512_loadu_ps(qr + m * D + 16 * k);
      for (int jj = 0; jj < 4; ++jj) {
        if (jj >= nj) break;
        const __m512 x = turbo_chunk<BITS>(rp[j0 + jj], k, cb);
        for (int m = 0; m < MB; ++m) acc[4 * m + jj] = _mm512_fmadd_ps(qv[m], x, acc[4 * m + jj]);
      }
    }
    alignas(64) float r[16];
    _mm512_store_ps(r, reduce16(acc));
    for (int m = 0; m < MB; ++m)
      for (int64_t jj = 0; jj < nj; ++jj) s[m * ld + j0 + jj] = norm[j0 + jj] * r[4 * m + jj] + (qmu ? qmu[m] : 0.f);
  }
}

template <int BITS, int NV>
void turbo_scores(const uint8_t* const* rp, const float* norm, int64_t nt, const float* qr, const float* qmu,
                  int64_t M, int64_t D, __m512 cb, float* s, int64_t ld) {
  for (int64_t m0 = 0; m0 < M; m0 += 4) {
    const float* q = qr + m0 * D;
    const float* mu = qmu ? qmu + m0 : nullptr;
    float* o = s + m0 * ld;
    switch (std::min<int64_t>(4, M - m0)) {
      case 4: turbo_scores_mb<BITS, NV, 4>(rp, norm, nt, q, mu, D, cb, o, ld); break;
      case 3: turbo_scores_mb<BITS, NV, 3>(rp, norm, nt, q, mu, D, cb, o, ld); break;
      case 2: turbo_scores_mb<BITS, NV, 2>(rp, norm, nt, q, mu, D, cb, o, ld); break;
      default: turbo_scores_mb<BITS, NV, 1>(rp, norm, nt, q, mu, D, cb, o, ld); break;
    }
  }
}

// accP_m += sum_j p_mj norm_j c[idx_j], ps_m += sum_j p_mj for nt rows
template <int BITS, int NV, int MB>
TQ_INLINE void turbo_values_mb(const uint8_t* const* rp, const float* norm, int64_t nt, const float* p, int64_t ld,
                               int64_t Dv, __m512 cb, float* accP, float* ps) {
  alignas(64) float w[MB][16];
  const __mmask16 keep = static_cast<__mmask16>((1u << nt) - 1u);
  const __m512 nv = _mm512_maskz_loadu_ps(keep, norm);
  for (int m = 0; m < MB; ++m) {
    const __m512 pv = _mm512_maskz_loadu_ps(keep, p + m * ld);
    _mm512_store_ps(w[m], _mm512_mul_ps(pv, nv));
    ps[m] += _mm512_reduce_add_ps(pv);
  }
  for (int k = 0; k < NV; ++k) {
    __m512 acc[MB];
    for (int m = 0; m < MB; ++m) acc[m] = _mm512_loadu_ps(accP + m * Dv + 16 * k);
    for (int64_t j = 0; j < nt; ++j) {
      const __m512 x = turbo_chunk<BITS>(rp[j], k, cb);
      for (int m = 0; m < MB; ++m) acc[m] = _mm512_fmadd_ps(_mm512_set1_ps(w[m][j]), x, acc[m]);
    }
    for (int m = 0; m < MB; ++m) _mm512_storeu_ps(accP + m * Dv + 16 * k, acc[m]);
  }
}

template <int BITS, int NV>
void turbo_values(const uint8_t* const* rp, const float* norm, int64_t nt, const float* p, int64_t ld, int64_t M,
                  int64_t Dv, __m512 cb, float* accP, float* ps) {
  for (int64_t m0 = 0; m0 < M; m0 += 4) {
    const float* pm = p + m0 * ld;
    float* a = accP + m0 * Dv;
    float* pp = ps + m0;
    switch (std::min<int64_t>(4, M - m0)) {
      case 4: turbo_values_mb<BITS, NV, 4>(rp, norm, nt, pm, ld, Dv, cb, a, pp); break;
      case 3: turbo_values_mb<BITS, NV, 3>(rp, norm, nt, pm, ld, Dv, cb, a, pp); break;
      case 2: turbo_values_mb<BITS, NV, 2>(rp, norm, nt, pm, ld, Dv, cb, a, pp); break;
      default: turbo_values_mb<BITS, NV, 1>(rp, norm, nt, pm, ld, Dv, cb, a, pp); break;
    }
  }
}

template <int NV>
bool turbo_tile_dispatch(bool scores, int64_t bits, const uint8_t* const* rp, const float* norm, int64_t nt,
                         const float* q, const float* qmu, const float* p, int64_t ld, int64_t M, int64_t D,
                         __m512 cb, float* out, float* accP, float* ps) {
#define TQ_TILE(B)                                                          \
  if (scores) turbo_scores<B, NV>(rp, norm, nt, q, qmu, M, D, cb, out, ld); \
  else turbo_values<B, NV>(rp, norm, nt, p, ld, M, D, cb, accP, ps);        \
  return true;
  if (bits == 4) { TQ_TILE(4) }
  if (bits == 2) { TQ_TILE(2) }
  if (bits == 1) { TQ_TILE(1) }
#if TQ_VBMI
  if (bits == 3) { TQ_TILE(3) }
#endif
#undef TQ_TILE
  return false;
}
#endif

// A whole tile of packed turbo rows scored (scores = true) or accumulated without a decoded copy; false when the
// tile does not qualify (the caller takes the row path).
template <typename T>
inline bool turbo_tile(const Side<T>&, bool, int64_t, int64_t, int64_t, int64_t, const T*, const T*, const T*,
                       int64_t, int64_t, T*, T*, T*) {
  return false;
}

#if TQ_AVX512
template <>
inline bool turbo_tile<float>(const Side<float>& s, bool scores, int64_t b, int64_t h, int64_t t, int64_t nt,
                              const float* q, const float* qmu, const float* p, int64_t ld, int64_t M, float* out,
                              float* accP, float* ps) {
  if (s.kind != TURBO || s.order.empty() || !tile_fast(s.bits) || (s.D != 64 && s.D != 128) || t < s.nb ||
      t + nt > s.nb + s.np)
    return false;
  const int64_t n = t - s.nb;
  const uint8_t* rp[TILE];
  alignas(64) float norm[TILE];
  const uint8_t* base = s.codes + b * s.c_b + h * s.c_h + n * s.c_r;
  const at::Half* a = s.a + b * s.a_b + h * s.a_h + n * s.a_r;
  for (int64_t j = 0; j < nt; ++j) {
    rp[j] = base + j * s.c_r;
    norm[j] = static_cast<float>(a[j * s.a_r]);
  }
  const __m512 cb = _mm512_loadu_ps(s.lutpad);
  if (s.D == 64) return turbo_tile_dispatch<4>(scores, s.bits, rp, norm, nt, q, qmu, p, ld, M, s.D, cb, out, accP, ps);
  return turbo_tile_dispatch<8>(scores, s.bits, rp, norm, nt, q, qmu, p, ld, M, s.D, cb, out, accP, ps);
}
#endif

// -- the boundary: every argument checked, with its name ------------------------------------------------

int64_t kind_code(const std::string& k, const std::string& nm) {
  if (k == "dense") return DENSE;
  if (k == "turbo") return TURBO;
  if (k == "affine-token") return AFFINE_TOKEN;
  if (k == "affine-channel") return AFFINE_CHANNEL;
  TORCH_CHECK(false, nm, ".kind must be one of dense, turbo, affine-token, affine-channel; got '", k, "'");
  return DENSE;
}

// A 4-D [Bs, H, rows, cols] CPU tensor of dtype dt with unit last stride (or a checked broadcast batch).
void check_rows(const torch::Tensor& t, const std::string& nm, at::ScalarType dt, int64_t Bs, int64_t H,
                int64_t rows, int64_t cols, const char* rows_what, bool batch_may_broadcast = false) {
  TORCH_CHECK(t.device().is_cpu(), nm, " must be a CPU tensor, got one on ", t.device());
  TORCH_CHECK(t.scalar_type() == dt, nm, " must be ", c10::toString(dt), ", got ", c10::toString(t.scalar_type()));
  TORCH_CHECK(t.dim() == 4, nm, " must be 4-D [batch, kv_heads, rows, ", cols, "], got shape ", t.sizes());
  TORCH_CHECK(t.size(0) == Bs || (batch_may_broadcast && t.size(0) == 1), nm, " has batch ", t.size(0),
              ", expected ", Bs, " (the side's batch)");
  TORCH_CHECK(t.size(1) == H, nm, " has ", t.size(1), " kv heads, expected ", H);
  TORCH_CHECK(t.size(2) == rows, nm, " has ", t.size(2), " rows, expected ", rows, " (", rows_what, ")");
  TORCH_CHECK(t.size(3) == cols, nm, " has ", t.size(3), " values per row, expected ", cols);
  TORCH_CHECK(cols <= 1 || t.stride(3) == 1, nm, " must have unit stride along its last dimension, got strides ",
              t.strides());
}

void check_absent(const std::optional<torch::Tensor>& t, const std::string& nm, const char* why) {
  TORCH_CHECK(!t.has_value(), nm, " must be None for ", why);
}

template <typename T>
Side<T> build_side(const SideDesc& d, const std::string& nm, int64_t H, int64_t Bs) {
  const at::ScalarType dt = c10::CppTypeToScalarType<T>::value;
  Side<T> s;
  s.kind = kind_code(d.kind, nm);
  s.bits = d.bits;
  s.group = d.group;
  s.D = d.head_dim;
  s.nb = d.n_before;
  s.np = d.n_packed;
  const int64_t D = s.D;
  TORCH_CHECK(D >= 1 && D <= MAX_HEAD_DIM, nm, ".head_dim must be in 1..", MAX_HEAD_DIM, ", got ", D);
  TORCH_CHECK(s.np >= 0, nm, ".n_packed must be >= 0, got ", s.np);
  TORCH_CHECK(s.kind != DENSE || s.np == 0, nm, ": a dense side has n_packed 0, got ", s.np);
  if (s.kind == DENSE) {  // a dense side reads only its row chunks: a packed field given to it is a caller's mistake
    const std::pair<const std::optional<torch::Tensor>*, const char*> packed_fields[] = {
        {&d.codes, ".codes"}, {&d.norms, ".norms"}, {&d.scales, ".scales"}, {&d.zeros, ".zeros"},
        {&d.levels, ".levels"}, {&d.rotation, ".rotation"}, {&d.mu, ".mu"}};
    for (const auto& f : packed_fields) check_absent(*f.first, nm + f.second, "a dense side (kind 'dense')");
  }
  TORCH_CHECK(static_cast<int64_t>(d.dense.size()) <= MAX_DENSE_CHUNKS, nm, ".dense takes at most ",
              MAX_DENSE_CHUNKS, " chunks, got ", d.dense.size());
  for (size_t i = 0; i < d.dense.size(); ++i) {
    const auto& t = d.dense[i];
    const std::string cn = nm + ".dense[" + std::to_string(i) + "]";
    check_rows(t, cn, dt, Bs, H, t.dim() == 4 ? t.size(2) : -1, D, "its own", false);
    if (t.size(2) == 0) continue;
    s.dptr[s.nchunks] = t.data_ptr<T>();
    s.db[s.nchunks] = t.stride(0);
    s.dh[s.nchunks] = t.stride(1);
    s.dr[s.nchunks] = t.stride(2);
    s.nd += t.size(2);
    s.dend[s.nchunks++] = s.nd;
  }
  for (int k = s.nchunks; k < MAX_DENSE_CHUNKS; ++k) s.dend[k] = std::numeric_limits<int64_t>::max();
  TORCH_CHECK(s.nb >= 0 && s.nb <= s.nd, nm, ".n_before must be in 0..", s.nd, " (the dense rows), got ", s.nb);
  if (s.kind == DENSE || s.np == 0) {
    s.kind = DENSE;
    s.np = 0;
    return s;
  }
  TORCH_CHECK(s.bits >= 1 && s.bits <= 8, nm, ".bits must be in 1..8, got ", s.bits);
  TORCH_CHECK(d.codes.has_value(), nm, ".codes is required for a packed side");
  const int64_t bits = s.bits;
  int64_t rows = s.np, row_bytes = (D * bits + 7) / 8;
  const char* rows_what = "n_packed";
  if (s.kind == AFFINE_CHANNEL) {
    TORCH_CHECK(s.group >= 1, nm, ".group (tokens per KIVI block) must be >= 1, got ", s.group);
    TORCH_CHECK(s.np % s.group == 0, nm, ".n_packed ", s.np, " is not a whole number of blocks of ", s.group, " tokens");
    rows = s.np / s.group;
    row_bytes = (s.group * D * bits + 7) / 8;
    rows_what = "n_packed / group blocks";
  }
  const auto& codes = *d.codes;
  check_rows(codes, nm + ".codes", torch::kUInt8, Bs, H, rows, row_bytes, rows_what);
  s.codes = codes.data_ptr<uint8_t>();
  s.c_b = codes.stride(0);
  s.c_h = codes.stride(1);
  s.c_r = codes.stride(2);
  const int64_t nlev = int64_t(1) << bits;
  if (s.kind == TURBO) {
    TORCH_CHECK(d.norms.has_value(), nm, ".norms is required for a turbo side");
    check_absent(d.scales, nm + ".scales", "a turbo side");
    check_absent(d.zeros, nm + ".zeros", "a turbo side");
    check_rows(*d.norms, nm + ".norms", torch::kHalf, Bs, H, s.np, 1, "n_packed");
    s.a = d.norms->data_ptr<at::Half>();
    s.a_b = d.norms->stride(0);
    s.a_h = d.norms->stride(1);
    s.a_r = d.norms->stride(2);
    TORCH_CHECK(d.levels.has_value(), nm, ".levels (the codebook) is required for a turbo side");
    const auto& lv = *d.levels;
    TORCH_CHECK(lv.device().is_cpu() && lv.scalar_type() == dt && lv.dim() == 1 && lv.size(0) == nlev &&
                    lv.is_contiguous(),
                nm, ".levels must be a contiguous CPU ", c10::toString(dt), " vector of 2**bits = ", nlev,
                " values, got ", c10::toString(lv.scalar_type()), " ", lv.sizes());
    for (int64_t i = 0; i < nlev; ++i) s.lut[i] = lv.data_ptr<T>()[i];
    TORCH_CHECK(d.rotation.has_value(), nm, ".rotation is required for a turbo side");
    const auto& r = *d.rotation;
    TORCH_CHECK(r.device().is_cpu() && r.scalar_type() == dt && r.dim() == 2 && r.size(0) == D && r.size(1) == D &&
                    r.is_contiguous(),
                nm, ".rotation must be a contiguous CPU ", c10::toString(dt), " [", D, ", ", D, "] matrix, got ",
                c10::toString(r.scalar_type()), " ", r.sizes(), r.is_contiguous() ? "" : " (not contiguous)");
    s.rot = r.data_ptr<T>();
    if (d.mu.has_value()) {
      check_rows(*d.mu, nm + ".mu", torch::kHalf, Bs, H, 1, D, "one centring mean per head", true);
      s.mu = d.mu->data_ptr<at::Half>();
      s.mu_b = d.mu->size(0) == 1 ? 0 : d.mu->stride(0);
      s.mu_h = d.mu->stride(1);
    }
    if (std::is_same<T, float>::value && simd_turbo(bits, D)) {
      for (int64_t i = 0; i < nlev; ++i) s.lutpad[i] = static_cast<float>(s.lut[i]);
      s.order.resize(D);
      for (int64_t i = 0; i < D; ++i) s.order[i] = static_cast<int32_t>(64 * (i / 64) + simd_pos(bits, i % 64));
    }
  } else {
    check_absent(d.norms, nm + ".norms", "an affine side");
    check_absent(d.levels, nm + ".levels", "an affine side (codes are their own values)");
    check_absent(d.rotation, nm + ".rotation", "an affine side");
    check_absent(d.mu, nm + ".mu", "an affine side");
    TORCH_CHECK(d.scales.has_value() && d.zeros.has_value(), nm, ".scales and ", nm, ".zeros are required for an affine side");
    int64_t cols = D;
    if (s.kind == AFFINE_TOKEN) {
      TORCH_CHECK(s.group >= 1 && D % s.group == 0, nm, ".group (channels per group) must divide head_dim ", D,
                  ", got ", s.group);
      cols = D / s.group;
    }
    check_rows(*d.scales, nm + ".scales", torch::kHalf, Bs, H, rows, cols, rows_what);
    check_rows(*d.zeros, nm + ".zeros", torch::kHalf, Bs, H, rows, cols, rows_what);
    s.a = d.scales->data_ptr<at::Half>();
    s.a_b = d.scales->stride(0);
    s.a_h = d.scales->stride(1);
    s.a_r = d.scales->stride(2);
    s.z = d.zeros->data_ptr<at::Half>();
    s.z_b = d.zeros->stride(0);
    s.z_h = d.zeros->stride(1);
    s.z_r = d.zeros->stride(2);
    for (int64_t i = 0; i < nlev; ++i) s.lut[i] = static_cast<T>(i);
  }
  if (8 % bits == 0) {
    s.per_byte = 8 / bits;
    s.btab.resize(256 * s.per_byte);
    for (int64_t v = 0; v < 256; ++v)
      for (int64_t i = 0; i < s.per_byte; ++i) s.btab[v * s.per_byte + i] = s.lut[(v >> (i * bits)) & (nlev - 1)];
  }
  return s;
}

int64_t side_batch(const SideDesc& d, const std::string& nm) {
  if (d.kind != "dense" && d.n_packed > 0 && d.codes.has_value() && d.codes->dim() == 4) return d.codes->size(0);
  for (const auto& t : d.dense)
    if (t.dim() == 4) return t.size(0);
  TORCH_CHECK(false, nm, " holds no rows: give its dense rows (dense=[...]) or its packed codes");
  return 0;
}

int64_t side_heads(const SideDesc& d) {
  if (d.kind != "dense" && d.n_packed > 0 && d.codes.has_value() && d.codes->dim() == 4) return d.codes->size(1);
  for (const auto& t : d.dense)
    if (t.dim() == 4) return t.size(1);
  return -1;
}

struct Seq {
  int64_t side, row, total;
  const bool* mask;
  int64_t m_l, m_t;
};

struct Item {
  int64_t s, h, t0, t1;
};

template <typename T>
std::tuple<torch::Tensor, std::vector<int64_t>, std::vector<int64_t>, int64_t> attend_impl(
    const torch::Tensor& query, double qscale, const std::vector<SideDesc>& kd, const std::vector<SideDesc>& vd,
    const std::vector<std::optional<torch::Tensor>>& masks, double softcap, const std::optional<torch::Tensor>& sinks,
    double sparse_v) {
  const at::ScalarType dt = c10::CppTypeToScalarType<T>::value;
  const int64_t B = query.size(0), Hq = query.size(1), L = query.size(2), D = query.size(3);
  const int64_t H = side_heads(kd[0]);
  TORCH_CHECK(H >= 1, "k_sides[0] holds no rows");
  TORCH_CHECK(Hq % H == 0, "query has ", Hq, " heads, not a multiple of the ", H, " kv heads of k_sides[0]");
  const int64_t G = Hq / H, M = G * L;
  const int64_t Dv = vd[0].head_dim;
  std::vector<Side<T>> K, V;
  std::vector<Seq> seqs;
  int64_t nseq = 0;
  for (size_t i = 0; i < kd.size(); ++i) {
    const std::string kn = "k_sides[" + std::to_string(i) + "]", vn = "v_sides[" + std::to_string(i) + "]";
    const int64_t Bs = side_batch(kd[i], kn);
    TORCH_CHECK(side_batch(vd[i], vn) == Bs, vn, " has batch ", side_batch(vd[i], vn), ", ", kn, " has ", Bs);
    TORCH_CHECK(kd[i].head_dim == D, kn, ".head_dim is ", kd[i].head_dim, ", the query's head_dim is ", D);
    TORCH_CHECK(vd[i].head_dim == Dv, vn, ".head_dim is ", vd[i].head_dim, ", v_sides[0].head_dim is ", Dv);
    K.push_back(build_side<T>(kd[i], kn, H, Bs));
    V.push_back(build_side<T>(vd[i], vn, H, Bs));
    const int64_t total = K.back().nd + K.back().np;
    TORCH_CHECK(V.back().nd + V.back().np == total, vn, " holds ", V.back().nd + V.back().np, " rows (",
                V.back().nd, " dense + ", V.back().np, " packed), ", kn, " holds ", total);
    TORCH_CHECK(total >= L, kn, " holds ", total, " rows, fewer than the query's ", L, " tokens");
    const bool* mp = nullptr;
    int64_t m_b = 0, m_l = 0, m_t = 0;
    if (!masks.empty() && masks[i].has_value()) {
      const auto& m = *masks[i];
      const std::string mn = "masks[" + std::to_string(i) + "]";
      TORCH_CHECK(m.device().is_cpu() && m.scalar_type() == torch::kBool, mn, " must be a bool CPU tensor, got ",
                  c10::toString(m.scalar_type()));
      TORCH_CHECK(m.dim() == 3 && (m.size(0) == Bs || m.size(0) == 1) && m.size(1) == L && m.size(2) == total, mn,
                  " must be [", Bs, ", ", L, ", ", total, "] (batch, query tokens, the side's rows), got ", m.sizes());
      mp = m.data_ptr<bool>();
      m_b = m.size(0) == 1 ? 0 : m.stride(0);
      m_l = m.stride(1);
      m_t = m.stride(2);
    }
    for (int64_t r = 0; r < Bs; ++r) seqs.push_back({static_cast<int64_t>(i), r, total, mp ? mp + r * m_b : nullptr, m_l, m_t});
    nseq += Bs;
  }
  TORCH_CHECK(nseq == B, "query has batch ", B, ", the sides hold ", nseq, " sequences");
  const T* sinkp = nullptr;
  if (sinks.has_value()) {
    const auto& s = *sinks;
    TORCH_CHECK(s.device().is_cpu() && s.scalar_type() == dt && s.dim() == 1 && s.size(0) == Hq && s.is_contiguous(),
                "sinks must be a contiguous CPU ", c10::toString(dt), " vector of ", Hq, " logits (one per query head), got ",
                c10::toString(s.scalar_type()), " ", s.sizes());
    sinkp = s.data_ptr<T>();
  }
  TORCH_CHECK(softcap >= 0 && std::isfinite(softcap), "softcap must be a finite number >= 0 (0 = off), got ", softcap);
  TORCH_CHECK(sparse_v >= 0 && sparse_v < 1, "sparse_v must be a softmax-weight threshold in [0, 1), got ", sparse_v);
  TORCH_CHECK(std::isfinite(qscale), "scale must be finite, got ", qscale);

  // the split: token blocks of MIN_BLOCK..MAX_BLOCK rows, about BLOCKS_PER_THREAD items per thread
  const int64_t threads = std::max<int64_t>(1, at::get_num_threads());
  int64_t work = 0;
  for (const auto& s : seqs) work += s.total * H;
  const int64_t blk_len = std::min(MAX_BLOCK, std::max(MIN_BLOCK, (work + BLOCKS_PER_THREAD * threads - 1) /
                                                                       (BLOCKS_PER_THREAD * threads)));
  std::vector<Item> items;
  int64_t blk_max = 1;
  for (int64_t s = 0; s < B; ++s) {
    const int64_t tot = seqs[s].total, nblk = (tot + blk_len - 1) / blk_len, blk = (tot + nblk - 1) / nblk;
    blk_max = std::max(blk_max, blk);
    for (int64_t h = 0; h < H; ++h)
      for (int64_t c = 0; c < nblk; ++c) items.push_back({s, h, c * blk, std::min(tot, (c + 1) * blk)});
  }
  const int64_t nitems = static_cast<int64_t>(items.size());

  // queries: scaled, [seq, kv head, M, D]; rotated (turbo keys, in the decode order) and q.mu
  const T scale = static_cast<T>(qscale);
  std::vector<T> qs(B * H * M * D), qr, qmu;
  bool any_rot = false, any_mu = false;
  for (const auto& k : K) {
    any_rot = any_rot || k.kind == TURBO;
    any_mu = any_mu || (k.kind == TURBO && k.mu);
  }
  if (any_rot) qr.assign(B * H * M * D, T(0));
  if (any_mu) qmu.assign(B * H * M, T(0));
  const T* qp = query.data_ptr<T>();
  const int64_t q0 = query.stride(0), q1 = query.stride(1), q2 = query.stride(2), q3 = query.stride(3);
  at::parallel_for(0, B * H, 1, [&](int64_t begin, int64_t end) {
    std::vector<T> mu(D);
    for (int64_t bh = begin; bh < end; ++bh) {
      const int64_t s = bh / H, h = bh % H;
      const Side<T>& k = K[seqs[s].side];
      if (k.mu) half_to(k.mu + seqs[s].row * k.mu_b + h * k.mu_h, D, mu.data());
      for (int64_t m = 0; m < M; ++m) {
        const T* src = qp + s * q0 + (h * G + m / L) * q1 + (m % L) * q2;
        T* dst = qs.data() + (bh * M + m) * D;
        for (int64_t j = 0; j < D; ++j) dst[j] = src[j * q3] * scale;
        if (k.kind != TURBO) continue;
        T* r = qr.data() + (bh * M + m) * D;
        for (int64_t i = 0; i < D; ++i) r[i] = dot(k.rot + (k.order.empty() ? i : k.order[i]) * D, dst, D);
        if (k.mu) qmu[bh * M + m] = dot(dst, mu.data(), D);
      }
    }
  });

  const T cap = static_cast<T>(softcap);
  const T thr = static_cast<T>(sparse_v);
  const T NEG = -std::numeric_limits<T>::infinity();
  // partials per item: max[M], sum[M], psum_rot[M], accD[M][Dv], accP[M][Dv]
  const int64_t pstride = 3 * M + 2 * M * Dv;
  std::vector<T> part(nitems * pstride);
  std::vector<int64_t> skipped(nitems, 0), visited(nitems, 0);
  const int64_t tld = std::max(D, Dv);

  at::parallel_for(0, nitems, 1, [&](int64_t begin, int64_t end) {
    std::vector<T> sbuf(M * blk_max), tbuf(TILE * tld);
    const T* rows[TILE];
    T tscale[TILE];
    bool trot[TILE];
    for (int64_t it = begin; it < end; ++it) {
      const Item& I = items[it];
      const Seq& S = seqs[I.s];
      const Side<T>& Ks = K[S.side];
      const Side<T>& Vs = V[S.side];
      const int64_t b = S.row, h = I.h, t0 = I.t0, n = I.t1 - I.t0, total = S.total, blk = n;
      T* P = part.data() + it * pstride;
      T *mx = P, *sm = P + M, *ps = P + 2 * M, *accD = P + 3 * M, *accP = accD + M * Dv;
      std::fill(P, P + pstride, T(0));
      for (int64_t m = 0; m < M; ++m) mx[m] = NEG;
      if (n <= 0) continue;
      const int64_t bh = I.s * H + h;
      const T* qb = qs.data() + bh * M * D;
      const T* qrb = qr.empty() ? nullptr : qr.data() + bh * M * D;
      const T* qmb = (qmu.empty() || !Ks.mu) ? nullptr : qmu.data() + bh * M;
      const bool dense_all = thr <= 0 && S.mask == nullptr && L == 1;
      // scores, a tile of rows at a time: decode (or point at) 16 rows, then every query of the kv head
      for (int64_t i0 = 0; i0 < n; i0 += TILE) {
        const int64_t nt = std::min(TILE, n - i0);
        if (qrb && turbo_tile(Ks, true, b, h, t0 + i0, nt, qrb, qmb, static_cast<const T*>(nullptr), blk, M,
                              sbuf.data() + i0, static_cast<T*>(nullptr), static_cast<T*>(nullptr)))
          continue;
        if (!fetch_tile_turbo(Ks, b, h, t0 + i0, nt, tbuf.data(), tld, rows, tscale, trot)) {
          for (int64_t j = 0; j < nt; ++j) {
            bool r;
            rows[j] = fetch_row(Ks, b, h, t0 + i0 + j, tbuf.data() + j * tld, tscale[j], r);
            trot[j] = r;
          }
        }
        tile_scores<T>(rows, tscale, trot, nt, qb, qrb, qmb, M, D, sbuf.data() + i0, blk);
      }
      if (cap > 0) {
        for (int64_t m = 0; m < M; ++m)
          for (int64_t i = 0; i < n; ++i) sbuf[m * blk + i] = cap * std::tanh(sbuf[m * blk + i] / cap);
      }
      if (S.mask || L > 1) {
        for (int64_t m = 0; m < M; ++m) {
          const int64_t l = m % L;
          T* sc = sbuf.data() + m * blk;
          if (S.mask) {
            const bool* row = S.mask + l * S.m_l;
            for (int64_t i = 0; i < n; ++i)
              if (!row[(t0 + i) * S.m_t]) sc[i] = NEG;
          } else {
            for (int64_t i = std::max<int64_t>(0, total - L + l + 1 - t0); i < n; ++i) sc[i] = NEG;
          }
        }
      }
      for (int64_t m = 0; m < M; ++m) {
        T* sc = sbuf.data() + m * blk;
        T mm = NEG;
#pragma omp simd reduction(max : mm)
        for (int64_t i = 0; i < n; ++i) mm = sc[i] > mm ? sc[i] : mm;
        mx[m] = mm;
        if (mm == NEG) {
          std::fill(sc, sc + n, T(0));
          sm[m] = 0;
        } else {
          exp_shift(sc, n, mm, sm[m]);
        }
      }
      // values, a tile at a time; rows no query weighs (masked, or below the Sparse-V threshold) are not read
      for (int64_t i0 = 0; i0 < n; i0 += TILE) {
        const int64_t nt = std::min(TILE, n - i0);
        if (dense_all && turbo_tile(Vs, false, b, h, t0 + i0, nt, static_cast<const T*>(nullptr),
                                    static_cast<const T*>(nullptr), sbuf.data() + i0, blk, M, static_cast<T*>(nullptr),
                                    accP, ps)) {
          visited[it] += nt;
          continue;
        }
        if (dense_all && fetch_tile_turbo(Vs, b, h, t0 + i0, nt, tbuf.data(), tld, rows, tscale, trot)) {
          visited[it] += nt;
          tile_values<T>(rows, tscale, trot, nt, sbuf.data() + i0, blk, M, Dv, accD, accP, ps);
          continue;
        }
        for (int64_t j = 0; j < nt; ++j) {
          const int64_t i = i0 + j;
          if (dense_all) {  // no mask, no Sparse-V: every row carries weight (a row whose weights underflow adds 0)
            bool r;
            rows[j] = fetch_row(Vs, b, h, t0 + i, tbuf.data() + j * tld, tscale[j], r);
            trot[j] = r;
            visited[it] += 1;
            continue;
          }
          bool any = false, keep = false;
          for (int64_t m = 0; m < M; ++m) {
            const T p = sbuf[m * blk + i];
            if (p > 0) {
              any = true;
              if (thr <= 0 || p >= thr * sm[m]) keep = true;
            }
          }
          rows[j] = nullptr;
          trot[j] = false;
          if (!any) continue;
          visited[it] += 1;
          if (!keep) {
            skipped[it] += 1;
            continue;
          }
          bool r;
          rows[j] = fetch_row(Vs, b, h, t0 + i, tbuf.data() + j * tld, tscale[j], r);
          trot[j] = r;
        }
        tile_values<T>(rows, tscale, trot, nt, sbuf.data() + i0, blk, M, Dv, accD, accP, ps);
      }
    }
  });

  // merge the blocks of every (sequence, kv head): log-sum-exp over block partials (+ the sink logit), then
  // the rotated-domain sum back to the row domain (+ p * mu for centred values)
  torch::Tensor out = torch::zeros({B, Hq, L, Dv}, query.options());
  T* op = out.data_ptr<T>();
  std::vector<int64_t> first(B * H + 1, 0);
  for (int64_t it = 0; it < nitems; ++it) first[items[it].s * H + items[it].h + 1] = it + 1;
  for (int64_t i = 1; i <= B * H; ++i) first[i] = std::max(first[i], first[i - 1]);
  at::parallel_for(0, B * H, 1, [&](int64_t begin, int64_t end) {
    std::vector<T> pp(Dv), mu(Dv);
    for (int64_t bh = begin; bh < end; ++bh) {
      const int64_t s = bh / H, h = bh % H;
      const Side<T>& v = V[seqs[s].side];
      const int64_t c0 = bh == 0 ? 0 : first[bh], c1 = first[bh + 1];
      if (v.mu) half_to(v.mu + seqs[s].row * v.mu_b + h * v.mu_h, Dv, mu.data());
      for (int64_t m = 0; m < M; ++m) {
        T big = NEG;
        for (int64_t c = c0; c < c1; ++c) big = std::max(big, part[c * pstride + m]);
        const T sink = sinkp ? sinkp[h * G + m / L] : NEG;
        big = std::max(big, sink);
        if (big == NEG) continue;  // nothing to attend: zeros, as SDPA gives for fully masked rows
        T denom = sinkp ? std::exp(sink - big) : T(0);
        T* d = op + (bh * M + m) * Dv;
        std::fill(pp.begin(), pp.end(), T(0));
        T pssum = 0;
        for (int64_t c = c0; c < c1; ++c) {
          const T* P = part.data() + c * pstride;
          if (P[m] == NEG) continue;
          const T w = std::exp(P[m] - big);
          denom += w * P[M + m];
          pssum += w * P[2 * M + m];
          axpy(w, P + 3 * M + m * Dv, d, Dv);
          axpy(w, P + 3 * M + M * Dv + m * Dv, pp.data(), Dv);
        }
        const T inv = denom > 0 ? T(1) / denom : T(0);
        for (int64_t j = 0; j < Dv; ++j) d[j] *= inv;
        if (v.kind == TURBO) {
          for (int64_t i = 0; i < Dv; ++i)
            if (pp[i] != 0) axpy(pp[i] * inv, v.rot + (v.order.empty() ? i : v.order[i]) * Dv, d, Dv);
          if (v.mu) axpy(pssum * inv, mu.data(), d, Dv);
        }
      }
    }
  });
  std::vector<int64_t> sk(B, 0), vi(B, 0);  // per sequence
  for (int64_t i = 0; i < nitems; ++i) {
    sk[items[i].s] += skipped[i];
    vi[items[i].s] += visited[i];
  }
  // every transient byte of the call: queries (scaled, rotated, q.mu), partials, per-thread scores + decoded
  // tile rows, per-thread query-centring and merge rows, per-sequence counts, byte tables and decode orders
  const int64_t used = std::min(threads, std::max<int64_t>(nitems, 1));
  const int64_t used_bh = std::min(threads, B * H);  // threads of the query pass and of the merge
  int64_t ws = static_cast<int64_t>(qs.size() + qr.size() + qmu.size() + part.size()) * sizeof(T);
  ws += static_cast<int64_t>(skipped.size() + visited.size() + sk.size() + vi.size()) * sizeof(int64_t);
  ws += nitems * static_cast<int64_t>(sizeof(Item)) + B * static_cast<int64_t>(sizeof(Seq)) +
        static_cast<int64_t>(first.size() * sizeof(int64_t));
  ws += used * (M * blk_max + TILE * tld) * static_cast<int64_t>(sizeof(T));  // sbuf + tbuf per thread
  ws += used_bh * D * static_cast<int64_t>(sizeof(T));                        // the query pass's mu row
  ws += used_bh * 2 * Dv * static_cast<int64_t>(sizeof(T));                   // the merge's pp and mu rows
  for (const auto* sides : {&K, &V})
    for (const auto& s : *sides)
      ws += static_cast<int64_t>(sizeof(Side<T>) + s.btab.size() * sizeof(T) + s.order.size() * sizeof(int32_t));
  return {out, sk, vi, ws};
}

std::tuple<torch::Tensor, std::vector<int64_t>, std::vector<int64_t>, int64_t> attend(
    const torch::Tensor& query, double scale, const std::vector<SideDesc>& k_sides,
    const std::vector<SideDesc>& v_sides, const std::vector<std::optional<torch::Tensor>>& masks, double softcap,
    const std::optional<torch::Tensor>& sinks, double sparse_v) {
  TORCH_CHECK(query.device().is_cpu(), "query must be a CPU tensor, got one on ", query.device());
  TORCH_CHECK(query.dim() == 4, "query must be 4-D [batch, q_heads, tokens, head_dim], got shape ", query.sizes());
  TORCH_CHECK(query.numel() > 0, "query is empty: shape ", query.sizes());
  TORCH_CHECK(!k_sides.empty(), "k_sides is empty: give one side per store");
  TORCH_CHECK(k_sides.size() == v_sides.size(), "k_sides has ", k_sides.size(), " sides, v_sides has ", v_sides.size());
  TORCH_CHECK(masks.empty() || masks.size() == k_sides.size(), "masks has ", masks.size(),
              " entries: give one per side (None for causal over the last query tokens) or none");
  if (query.scalar_type() == torch::kFloat)
    return attend_impl<float>(query, scale, k_sides, v_sides, masks, softcap, sinks, sparse_v);
  TORCH_CHECK(query.scalar_type() == torch::kDouble, "query must be float32 or float64, got ",
              c10::toString(query.scalar_type()));
  return attend_impl<double>(query, scale, k_sides, v_sides, masks, softcap, sinks, sparse_v);
}

}  // namespace

// TurboQuant quantize + pack of new rows (the append path): per row, norm, unit row rotated by R, codes by
// bucketize against the codebook's midpoints (index = number of bounds strictly below), least-squares norm
// correction onto the dequantized direction, LSB-first packing. Rows are centred by the caller.
template <typename T>
void encode_rows(const T* x, int64_t rows, int64_t D, const T* R, const T* levels, const T* bounds, int64_t nb,
                 int64_t bits, bool normfix, uint8_t* codes, int64_t nbytes, at::Half* norms) {
  at::parallel_for(0, rows, 16, [&](int64_t r0, int64_t r1) {
    std::vector<T> u(D), ur(D);
    std::vector<uint8_t> idx(D);
    for (int64_t r = r0; r < r1; ++r) {
      const T* xr = x + r * D;
      T ss = 0;
      for (int64_t j = 0; j < D; ++j) ss += xr[j] * xr[j];
      const T n = std::sqrt(ss);
      const T nc = std::max(n, std::numeric_limits<T>::min());
      for (int64_t j = 0; j < D; ++j) u[j] = xr[j] / nc;
      T dotc = 0, cc = 0;
      for (int64_t i = 0; i < D; ++i) {
        const T v = dot(R + i * D, u.data(), D);
        ur[i] = v;
        int64_t k = 0;
        while (k < nb && bounds[k] < v) ++k;
        idx[i] = static_cast<uint8_t>(k);
        dotc += v * levels[k];
        cc += levels[k] * levels[k];
      }
      T norm = normfix ? n * dotc / cc : n;
      norm = std::min<T>(std::max<T>(norm, T(0)), T(65504));
      norms[r] = at::Half(static_cast<float>(norm));
      uint8_t* out = codes + r * nbytes;
      std::memset(out, 0, nbytes);
      for (int64_t i = 0; i < D; ++i) {
        const int64_t bit = i * bits;
        out[bit >> 3] |= static_cast<uint8_t>(idx[i] << (bit & 7));
        if ((bit & 7) + bits > 8) out[(bit >> 3) + 1] |= static_cast<uint8_t>(idx[i] >> (8 - (bit & 7)));
      }
    }
  });
}

// One 1-D / 2-D constant of the encode call: CPU, dtype dt, contiguous, the given sizes.
void check_const(const torch::Tensor& t, const char* nm, at::ScalarType dt, std::initializer_list<int64_t> sizes) {
  TORCH_CHECK(t.device().is_cpu(), nm, " must be a CPU tensor, got one on ", t.device());
  TORCH_CHECK(t.scalar_type() == dt, nm, " must be ", c10::toString(dt), " (the rows' dtype), got ",
              c10::toString(t.scalar_type()));
  TORCH_CHECK(t.sizes().equals(sizes), nm, " must have shape ", c10::IntArrayRef(sizes), ", got ", t.sizes());
  TORCH_CHECK(t.is_contiguous(), nm, " must be contiguous, got strides ", t.strides());
}

std::vector<torch::Tensor> turbo_encode(torch::Tensor x, torch::Tensor rotation, torch::Tensor levels,
                                        torch::Tensor bounds, int64_t bits, bool normfix) {
  TORCH_CHECK(x.device().is_cpu(), "x must be a CPU tensor, got one on ", x.device());
  TORCH_CHECK(x.dim() == 4, "x must be 4-D [batch, kv_heads, tokens, head_dim], got shape ", x.sizes());
  TORCH_CHECK(x.scalar_type() == torch::kFloat || x.scalar_type() == torch::kDouble,
              "x must be float32 or float64, got ", c10::toString(x.scalar_type()));
  TORCH_CHECK(x.is_contiguous(), "x must be contiguous, got strides ", x.strides());
  TORCH_CHECK(bits >= 1 && bits <= 8, "bits must be in 1..8, got ", bits);
  const int64_t B = x.size(0), H = x.size(1), T = x.size(2), D = x.size(3);
  TORCH_CHECK(D >= 1, "x has head_dim 0");
  const at::ScalarType dt = x.scalar_type();
  const int64_t nlev = int64_t(1) << bits;
  check_const(rotation, "rotation", dt, {D, D});
  check_const(levels, "levels", dt, {nlev});
  check_const(bounds, "bounds", dt, {nlev - 1});
  const int64_t nbytes = (D * bits + 7) / 8;
  auto codes = torch::empty({B, H, T, nbytes}, x.options().dtype(torch::kUInt8));
  auto norms = torch::empty({B, H, T, 1}, x.options().dtype(torch::kHalf));
  const int64_t rows = B * H * T;
  if (dt == torch::kFloat) {
    encode_rows<float>(x.data_ptr<float>(), rows, D, rotation.data_ptr<float>(), levels.data_ptr<float>(),
                       bounds.data_ptr<float>(), bounds.numel(), bits, normfix, codes.data_ptr<uint8_t>(), nbytes,
                       norms.data_ptr<at::Half>());
  } else {
    encode_rows<double>(x.data_ptr<double>(), rows, D, rotation.data_ptr<double>(), levels.data_ptr<double>(),
                        bounds.data_ptr<double>(), bounds.numel(), bits, normfix, codes.data_ptr<uint8_t>(), nbytes,
                        norms.data_ptr<at::Half>());
  }
  return {codes, norms};
}


std::vector<int64_t> simd_order(int64_t bits, int64_t D) {
  TORCH_CHECK_VALUE(bits >= 1 && bits <= 4, "no SIMD order for ", bits, "-bit codes");
  TORCH_CHECK_VALUE(D >= 1 && D % SIMD_DIM_MULTIPLE == 0, "no SIMD order for head_dim ", D, " (needs a multiple of ",
                    SIMD_DIM_MULTIPLE, ")");
  std::vector<int64_t> out(D);
  for (int64_t i = 0; i < D; ++i) out[i] = simd_turbo(bits, D) ? 64 * (i / 64) + simd_pos(bits, i % 64) : i;
  return out;
}

std::vector<int64_t> simd_turbo_bits() {
  std::vector<int64_t> out;
  for (int64_t b = 1; b <= 8; ++b)
    if (simd_turbo(b, SIMD_DIM_MULTIPLE)) out.push_back(b);
  return out;
}

namespace py = pybind11;
using OptT = std::optional<torch::Tensor>;

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  py::class_<SideDesc>(m, "Side", "One side (K or V) of one store, as the kernel reads it (see attention.py).")
      .def(py::init([](std::string kind, int64_t bits, int64_t group, int64_t head_dim, int64_t n_before,
                       int64_t n_packed, OptT codes, OptT norms, OptT scales, OptT zeros, OptT levels, OptT rotation,
                       OptT mu, std::vector<torch::Tensor> dense) {
             SideDesc d;
             d.kind = std::move(kind);
             d.bits = bits;
             d.group = group;
             d.head_dim = head_dim;
             d.n_before = n_before;
             d.n_packed = n_packed;
             d.codes = std::move(codes);
             d.norms = std::move(norms);
             d.scales = std::move(scales);
             d.zeros = std::move(zeros);
             d.levels = std::move(levels);
             d.rotation = std::move(rotation);
             d.mu = std::move(mu);
             d.dense = std::move(dense);
             return d;
           }),
           py::kw_only(), py::arg("kind") = "dense", py::arg("bits") = 0, py::arg("group") = 1,
           py::arg("head_dim"), py::arg("n_before") = 0, py::arg("n_packed") = 0, py::arg("codes") = py::none(),
           py::arg("norms") = py::none(), py::arg("scales") = py::none(), py::arg("zeros") = py::none(),
           py::arg("levels") = py::none(), py::arg("rotation") = py::none(), py::arg("mu") = py::none(),
           py::arg("dense") = std::vector<torch::Tensor>{})
      .def_readwrite("kind", &SideDesc::kind)
      .def_readwrite("bits", &SideDesc::bits)
      .def_readwrite("group", &SideDesc::group)
      .def_readwrite("head_dim", &SideDesc::head_dim)
      .def_readwrite("n_before", &SideDesc::n_before)
      .def_readwrite("n_packed", &SideDesc::n_packed)
      .def_readwrite("codes", &SideDesc::codes)
      .def_readwrite("norms", &SideDesc::norms)
      .def_readwrite("scales", &SideDesc::scales)
      .def_readwrite("zeros", &SideDesc::zeros)
      .def_readwrite("levels", &SideDesc::levels)
      .def_readwrite("rotation", &SideDesc::rotation)
      .def_readwrite("mu", &SideDesc::mu)
      .def_readwrite("dense", &SideDesc::dense);
  m.def("attend", &attend, "fused decode attention of B sequences, each over its own packed + dense store (CPU)",
        py::arg("query"), py::arg("scale"), py::arg("k_sides"), py::arg("v_sides"), py::arg("masks"),
        py::arg("softcap"), py::arg("sinks"), py::arg("sparse_v"));
  m.def("turbo_encode", &turbo_encode, "TurboQuant quantize + pack of centred rows (CPU)", py::arg("x"),
        py::arg("rotation"), py::arg("levels"), py::arg("bounds"), py::arg("bits"), py::arg("normfix"));
  m.def("simd_turbo_bits", &simd_turbo_bits, "turbo widths decoded in SIMD order when head_dim % 64 == 0 (fp32)");
  m.def("simd_order", &simd_order, "the coordinate each position holds when a turbo row decodes in SIMD order");
  m.def("rules", []() {
    py::dict d;
    d["isa"] = isa_name();
    d["min_block"] = MIN_BLOCK;
    d["max_block"] = MAX_BLOCK;
    d["blocks_per_thread"] = BLOCKS_PER_THREAD;
    d["simd_dim_multiple"] = SIMD_DIM_MULTIPLE;
    d["simd_turbo_bits"] = simd_turbo_bits();
    d["max_head_dim"] = MAX_HEAD_DIM;
    d["max_dense_chunks"] = MAX_DENSE_CHUNKS;
    return d;
  }, "the kernel's rules: ISA, token blocks, SIMD widths and head-dim multiple, limits");
}
