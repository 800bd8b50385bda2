// tqbench native CPU decode attention straight from the packed KV store.
//
// One call attends queries [B, Hkv, M, D] (M = GQA group x query length, already scaled) over a layer's
// tokens in store order: [dense before (sinks) | packed run | dense after (tail + this call's rows)], K and
// V each with their own packed range. Packed rows are decoded one row at a time into registers/L1
// (never a decoded copy of the history): TurboQuant keys score in the rotated domain
// (n * <R q, c[idx]> + <q, mu>), TurboQuant values accumulate in the rotated domain (the caller rotates
// back once); affine int1-8 rows dequantize in place (per-token groups or KIVI per-channel blocks).
//
// Work is split over (batch, kv head, token block) with at::parallel_for (torch's own thread pool); every
// block keeps an online-softmax partial (max, sum, accumulators) that is merged at the end (split-K), so
// the workspace is the partials, not the scores. Sparse-V skips value rows whose softmax weight (an upper
// bound of it, from the block's partial softmax) is below a threshold for every query of the block.
//
// Code layout (tqbench/kernels/packing.py): an LSB-first bit stream per row, value i at bits
// [i*bits, (i+1)*bits).

#include <torch/extension.h>
#include <ATen/Parallel.h>

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#include <immintrin.h>
#define TQ_SIMD 1
#else
#define TQ_SIMD 0
#endif

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

namespace {

enum Kind : int64_t { DENSE = 0, TURBO = 1, AFFINE_TOKEN = 2, AFFINE_CHANNEL = 3 };

template <typename T>
struct Side {
  int64_t kind = DENSE, bits = 0, group = 1, D = 0;
  int64_t nb = 0, np = 0;  // dense rows before the packed run; packed tokens
  const uint8_t* codes = nullptr;
  int64_t c_b = 0, c_h = 0, c_r = 0;  // codes [B, H, R, bytes] (R = tokens, or blocks for KIVI)
  const at::Half* a = nullptr;  // turbo: norm [B, H, N, 1]; affine: scale [B, H, R, G | D]
  int64_t a_b = 0, a_h = 0, a_r = 0;
  const T* af = nullptr;  // affine: scale [B, H, R, G | D] in the compute dtype (converted once per call)
  const T* z = nullptr;   // affine: zero, same shape as scale
  int64_t z_b = 0, z_h = 0, z_r = 0;
  const T* lut = nullptr;   // value of each code: turbo codebook, or 0..2^bits-1 for affine
  float lutpad[16] = {0};
  const T* btab = nullptr;  // [256][per_byte] decoded values of every byte (bits 1, 2, 4, 8)
  int64_t per_byte = 0;
  const T* dense = nullptr;  // dense rows [B, H, Nd, D]
  int64_t d_b = 0, d_h = 0, d_r = 0;
};

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
  if (s.btab != nullptr && (bitoff & 7) == 0 && n % s.per_byte == 0) {
    p += bitoff >> 3;
    const int64_t nbytes = n / s.per_byte;
    const int64_t pb = s.per_byte;
    if (pb == 2) {
      for (int64_t i = 0; i < nbytes; ++i) {
        const T* e = s.btab + 2 * p[i];
        out[2 * i] = e[0];
        out[2 * i + 1] = e[1];
      }
    } else if (pb == 1) {
      for (int64_t i = 0; i < nbytes; ++i) out[i] = s.lut[p[i]];
    } else {
      for (int64_t i = 0; i < nbytes; ++i) std::memcpy(out + pb * i, s.btab + pb * p[i], pb * sizeof(T));
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

#if TQ_SIMD
// TurboQuant 2/3/4-bit rows with D % 64 == 0 decode in "SIMD order": 64 codes at a time, position order
// as the unpack produces it (simd_order() gives the permutation; the caller permutes the rotation's rows
// once, so queries and rotated-domain sums are already in this order and nothing is shuffled per row).
inline bool simd_turbo(int64_t bits, int64_t D) { return D % 64 == 0 && bits >= 1 && bits <= 4; }

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
      alignas(32) int32_t w[8];
      for (int g = 0; g < 8; ++g) w[g] = int32_t(q[3 * g]) | int32_t(q[3 * g + 1]) << 8 | int32_t(q[3 * g + 2]) << 16;
      const __m256i wv = _mm256_load_si256(reinterpret_cast<const __m256i*>(w));
      const __m256 cb8 = _mm256_loadu_ps(lut);
      const __m256i m = _mm256_set1_epi32(7);
      for (int k = 0; k < 8; ++k)
        _mm256_storeu_ps(out + 8 * k, _mm256_permutevar8x32_ps(cb8, _mm256_and_si256(_mm256_srli_epi32(wv, 3 * k), m)));
    }
  }
}
#endif

template <typename T>
inline bool decode_turbo_fast(const Side<T>&, const uint8_t*, T*) { return false; }

#if TQ_SIMD
template <>
inline bool decode_turbo_fast<float>(const Side<float>& s, const uint8_t* p, float* out) {
  if (!simd_turbo(s.bits, s.D)) return false;
  decode_turbo_simd(p, s.bits, s.D, s.lutpad, out);
  return true;
}
#endif

// Row `t` (store order) of one side for (b, h): a pointer to D values, `scale` (turbo norm, else 1) and
// whether it lives in the rotated domain (turbo packed rows).
#define TQ_INLINE inline __attribute__((always_inline))

template <typename T>
TQ_INLINE const T* fetch_row(const Side<T>& s, int64_t b, int64_t h, int64_t t, T* buf, T& scale, bool& rot) {
  scale = T(1);
  rot = false;
  if (t < s.nb || t >= s.nb + s.np) {
    const int64_t r = t < s.nb ? t : t - s.np;
    return s.dense + b * s.d_b + h * s.d_h + r * s.d_r;
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
  if (s.kind == AFFINE_TOKEN) {
    decode_codes(s, s.codes + b * s.c_b + h * s.c_h + n * s.c_r, 0, D, buf);
    const T* sc = s.af + b * s.a_b + h * s.a_h + n * s.a_r;
    const T* ze = s.z + b * s.z_b + h * s.z_h + n * s.z_r;
    const int64_t gs = s.group;
    for (int64_t g = 0; g < D / gs; ++g) {
      const T a = sc[g], z = ze[g];
      T* bg = buf + g * gs;
#pragma omp simd
      for (int64_t j = 0; j < gs; ++j) bg[j] = bg[j] * a + z;
    }
    return buf;
  }
  // AFFINE_CHANNEL (KIVI): blocks of `group` tokens, token-major codes, scale/zero per (block, channel)
  const int64_t u = n / s.group, k = n % s.group;
  decode_codes(s, s.codes + b * s.c_b + h * s.c_h + u * s.c_r, k * D * s.bits, D, buf);
  const T* sc = s.af + b * s.a_b + h * s.a_h + u * s.a_r;
  const T* ze = s.z + b * s.z_b + h * s.z_h + u * s.z_r;
#pragma omp simd
  for (int64_t j = 0; j < D; ++j) buf[j] = buf[j] * sc[j] + ze[j];
  return buf;
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

template <typename T>
Side<T> make_side(int64_t kind, int64_t bits, int64_t group, int64_t nb, int64_t np, int64_t D,
                  const torch::Tensor& codes, const torch::Tensor& a, const torch::Tensor& z,
                  const torch::Tensor& lut, const torch::Tensor& btab, const torch::Tensor& dense) {
  Side<T> s;
  s.kind = kind;
  s.bits = bits;
  s.group = std::max<int64_t>(group, 1);
  s.nb = nb;
  s.np = np;
  s.D = D;
  TORCH_CHECK(dense.dim() == 4 && dense.stride(3) == 1, "dense rows must be [B, H, N, D] with unit last stride");
  s.dense = dense.data_ptr<T>();
  s.d_b = dense.size(0) == 1 ? 0 : dense.stride(0);
  s.d_h = dense.stride(1);
  s.d_r = dense.stride(2);
  if (kind == DENSE || np == 0) {
    s.kind = DENSE;
    s.np = 0;
    return s;
  }
  TORCH_CHECK(bits >= 1 && bits <= 8, "bits must be in 1..8");
  TORCH_CHECK(codes.scalar_type() == torch::kUInt8 && codes.dim() == 4 && codes.stride(3) == 1,
              "codes must be uint8 [B, H, R, bytes] with unit last stride");
  s.codes = codes.data_ptr<uint8_t>();
  s.c_b = codes.stride(0);
  s.c_h = codes.stride(1);
  s.c_r = codes.stride(2);
  TORCH_CHECK(a.dim() == 4 && a.stride(3) == 1, "norm/scale must be [B, H, R, n] with unit last stride");
  if (kind == TURBO) {
    TORCH_CHECK(a.scalar_type() == torch::kHalf, "turbo norms must be fp16");
    s.a = a.data_ptr<at::Half>();
  } else {
    TORCH_CHECK(a.scalar_type() == c10::CppTypeToScalarType<T>::value, "affine scale must be in the compute dtype");
    s.af = a.data_ptr<T>();
  }
  s.a_b = a.stride(0);
  s.a_h = a.stride(1);
  s.a_r = a.stride(2);
  if (kind != TURBO) {
    TORCH_CHECK(z.scalar_type() == c10::CppTypeToScalarType<T>::value && z.dim() == 4 && z.stride(3) == 1,
                "affine zero must be in the compute dtype");
    s.z = z.data_ptr<T>();
    s.z_b = z.stride(0);
    s.z_h = z.stride(1);
    s.z_r = z.stride(2);
    if (kind == AFFINE_TOKEN) TORCH_CHECK(D % s.group == 0, "affine-token: head_dim must be a multiple of group");
  }
  TORCH_CHECK(lut.is_contiguous() && lut.numel() == (int64_t(1) << bits), "lut must hold 2**bits values");
  s.lut = lut.data_ptr<T>();
  if (kind == TURBO && bits <= 4) {
    for (int64_t i = 0; i < (int64_t(1) << bits); ++i) s.lutpad[i] = static_cast<float>(s.lut[i]);
  }
  if (btab.defined() && btab.numel() > 0) {
    TORCH_CHECK(btab.is_contiguous() && btab.numel() % 256 == 0, "byte table must be [256, per_byte]");
    s.btab = btab.data_ptr<T>();
    s.per_byte = btab.numel() / 256;
  }
  return s;
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

#if TQ_SIMD
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
inline void tile_scores_nv(const float* const* rows, const float* qv_ptr, float* out16, int64_t nt) {
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
  _mm512_storeu_ps(out16, reduce16(acc));
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
    alignas(64) float r[16];
    const bool rr = rot[0];
    for (int64_t m = 0; m < M; ++m) {
      const float* qq = rr ? qr + m * D : q + m * D;
      if (D == 64) tile_scores_nv<4>(rows, qq, r, nt); else tile_scores_nv<8>(rows, qq, r, nt);
      const float mu = rr && qmu ? qmu[m] : 0.f;
      float* out = s + m * ld;
      if (rr) {
        for (int64_t j = 0; j < nt; ++j) out[j] = scale[j] * r[j] + mu;
      } else {
        for (int64_t j = 0; j < nt; ++j) out[j] = r[j];
      }
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

template <typename T>
std::vector<torch::Tensor> attend_impl(
    const torch::Tensor& q, const torch::Tensor& qr, const torch::Tensor& qmu, int64_t seq, int64_t total,
    const Side<T>& K, const Side<T>& V, int64_t Dv, const torch::Tensor& mask, double softcap,
    const torch::Tensor& sinks, double sparse_v, int64_t blocks_per_head) {
  const int64_t B = q.size(0), H = q.size(1), M = q.size(2), D = q.size(3);
  const int64_t G = M / seq;  // query heads per kv head
  const T* qp = q.data_ptr<T>();
  const T* qrp = qr.defined() && qr.numel() ? qr.data_ptr<T>() : nullptr;
  const T* qmup = qmu.defined() && qmu.numel() ? qmu.data_ptr<T>() : nullptr;
  const bool* mp = mask.defined() && mask.numel() ? mask.data_ptr<bool>() : nullptr;
  int64_t m_b = 0, m_l = 0, m_t = 0;
  if (mp) {
    m_b = mask.size(0) == 1 ? 0 : mask.stride(0);
    m_l = mask.stride(1);
    m_t = mask.stride(2);
  }
  const T* sinkp = sinks.defined() && sinks.numel() ? sinks.data_ptr<T>() : nullptr;
  const T cap = static_cast<T>(softcap);
  const T thr = static_cast<T>(sparse_v);
  const bool dense_all = thr <= 0 && mp == nullptr && seq == 1;
  const T NEG = -std::numeric_limits<T>::infinity();

  const int64_t nblk = std::max<int64_t>(1, std::min<int64_t>(blocks_per_head, (total + 31) / 32));
  const int64_t blk = (total + nblk - 1) / nblk;
  const int64_t items = B * H * nblk;
  // partials per item: max[M], sum[M], psum_rot[M], accD[M][Dv], accP[M][Dv]
  const int64_t pstride = 3 * M + 2 * M * Dv;
  std::vector<T> part(items * pstride);
  std::vector<int64_t> skipped(items, 0), visited(items, 0);

  at::parallel_for(0, items, 1, [&](int64_t begin, int64_t end) {
    const int64_t tld = std::max(D, Dv);
    std::vector<T> sbuf(M * blk), tbuf(TILE * tld);
    const T* rows[TILE];
    T tscale[TILE];
    bool trot[TILE];
    for (int64_t it = begin; it < end; ++it) {
      const int64_t bh = it / nblk, c = it % nblk, b = bh / H, h = bh % H;
      const int64_t t0 = c * blk, t1 = std::min(total, t0 + blk), n = std::max<int64_t>(t1 - t0, 0);
      T* P = part.data() + it * pstride;
      T *mx = P, *sm = P + M, *ps = P + 2 * M, *accD = P + 3 * M, *accP = accD + M * Dv;
      std::fill(P, P + pstride, T(0));
      for (int64_t m = 0; m < M; ++m) mx[m] = NEG;
      if (n == 0) continue;
      const T* qb = qp + (b * H + h) * M * D;
      const T* qrb = qrp ? qrp + (b * H + h) * M * D : nullptr;
      const T* qmb = qmup ? qmup + (b * H + h) * M : nullptr;
      // scores, a tile of rows at a time: decode (or point at) 16 rows, then every query of the kv head
      for (int64_t i0 = 0; i0 < n; i0 += TILE) {
        const int64_t nt = std::min(TILE, n - i0);
        for (int64_t j = 0; j < nt; ++j) {
          bool r;
          rows[j] = fetch_row(K, b, h, t0 + i0 + j, tbuf.data() + j * tld, tscale[j], r);
          trot[j] = r;
        }
        tile_scores<T>(rows, tscale, trot, nt, qb, qrb, qmb, M, D, sbuf.data() + i0, blk);
      }
      if (cap > 0) {
        for (int64_t m = 0; m < M; ++m)
          for (int64_t i = 0; i < n; ++i) sbuf[m * blk + i] = cap * std::tanh(sbuf[m * blk + i] / cap);
      }
      if (mp || seq > 1) {
        for (int64_t m = 0; m < M; ++m) {
          const int64_t l = m % seq;
          T* s = sbuf.data() + m * blk;
          if (mp) {
            const bool* row = mp + b * m_b + l * m_l;
            for (int64_t i = 0; i < n; ++i)
              if (!row[(t0 + i) * m_t]) s[i] = NEG;
          } else {
            for (int64_t i = std::max<int64_t>(0, total - seq + l + 1 - t0); i < n; ++i) s[i] = NEG;
          }
        }
      }
      for (int64_t m = 0; m < M; ++m) {
        T* s = sbuf.data() + m * blk;
        T mm = NEG;
#pragma omp simd reduction(max : mm)
        for (int64_t i = 0; i < n; ++i) mm = s[i] > mm ? s[i] : mm;
        mx[m] = mm;
        if (mm == NEG) {
          std::fill(s, s + n, T(0));
          sm[m] = 0;
        } else {
          exp_shift(s, n, mm, sm[m]);
        }
      }
      // values, a tile at a time; rows no query weighs (masked, or below the Sparse-V threshold) are not read
      for (int64_t i0 = 0; i0 < n; i0 += TILE) {
        const int64_t nt = std::min(TILE, n - i0);
        for (int64_t j = 0; j < nt; ++j) {
          const int64_t i = i0 + j;
          if (dense_all) {  // no mask, no Sparse-V: every row carries weight (a row whose weights underflow adds 0)
            bool r;
            rows[j] = fetch_row(V, b, h, t0 + i, tbuf.data() + j * tld, tscale[j], r);
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
          rows[j] = fetch_row(V, b, h, t0 + i, tbuf.data() + j * tld, tscale[j], r);
          trot[j] = r;
        }
        tile_values<T>(rows, tscale, trot, nt, sbuf.data() + i0, blk, M, Dv, accD, accP, ps);
      }
    }
  });

  // merge the blocks of every (b, h): log-sum-exp over block partials (+ the sink logit)
  auto opts = q.options();
  torch::Tensor outD = torch::zeros({B, H, M, Dv}, opts), outP = torch::zeros({B, H, M, Dv}, opts);
  torch::Tensor psum = torch::zeros({B, H, M}, opts);
  T* oD = outD.data_ptr<T>();
  T* oP = outP.data_ptr<T>();
  T* oS = psum.data_ptr<T>();
  for (int64_t bh = 0; bh < B * H; ++bh) {
    const int64_t h = bh % H;
    for (int64_t m = 0; m < M; ++m) {
      T big = NEG;
      for (int64_t c = 0; c < nblk; ++c) big = std::max(big, part[(bh * nblk + c) * pstride + m]);
      const T sink = sinkp ? sinkp[h * G + m / seq] : NEG;
      big = std::max(big, sink);
      if (big == NEG) continue;  // nothing to attend: zeros, as SDPA gives for fully masked rows
      T denom = sinkp ? std::exp(sink - big) : T(0);
      T* d = oD + (bh * M + m) * Dv;
      T* pp = oP + (bh * M + m) * Dv;
      T pssum = 0;
      for (int64_t c = 0; c < nblk; ++c) {
        const T* P = part.data() + (bh * nblk + c) * pstride;
        if (P[m] == NEG) continue;
        const T w = std::exp(P[m] - big);
        denom += w * P[M + m];
        pssum += w * P[2 * M + m];
        axpy(w, P + 3 * M + m * Dv, d, Dv);
        axpy(w, P + 3 * M + M * Dv + m * Dv, pp, Dv);
      }
      const T inv = denom > 0 ? T(1) / denom : T(0);
      for (int64_t j = 0; j < Dv; ++j) {
        d[j] *= inv;
        pp[j] *= inv;
      }
      oS[bh * M + m] = pssum * inv;
    }
  }
  int64_t sk = 0, vi = 0;
  for (int64_t i = 0; i < items; ++i) {
    sk += skipped[i];
    vi += visited[i];
  }
  torch::Tensor counts = torch::tensor({sk, vi}, torch::kInt64);
  return {outD, outP, psum, counts};
}

std::vector<torch::Tensor> attend(
    torch::Tensor q, torch::Tensor qr, torch::Tensor qmu, int64_t seq, int64_t total,
    int64_t k_kind, int64_t k_bits, int64_t k_group, int64_t k_nb, int64_t k_np,
    torch::Tensor k_codes, torch::Tensor k_a, torch::Tensor k_z, torch::Tensor k_lut, torch::Tensor k_btab,
    torch::Tensor k_dense,
    int64_t v_kind, int64_t v_bits, int64_t v_group, int64_t v_nb, int64_t v_np,
    torch::Tensor v_codes, torch::Tensor v_a, torch::Tensor v_z, torch::Tensor v_lut, torch::Tensor v_btab,
    torch::Tensor v_dense,
    torch::Tensor mask, double softcap, torch::Tensor sinks, double sparse_v, int64_t blocks_per_head) {
  TORCH_CHECK(q.dim() == 4 && q.is_contiguous(), "q must be contiguous [B, Hkv, M, D]");
  TORCH_CHECK(q.device().is_cpu(), "the native kernel runs on CPU tensors");
  TORCH_CHECK(seq >= 1 && q.size(2) % seq == 0, "M must be a multiple of the query length");
  if (mask.defined() && mask.numel()) {
    TORCH_CHECK(mask.scalar_type() == torch::kBool && mask.dim() == 3 && mask.size(1) == seq &&
                    mask.size(2) == total, "mask must be bool [B, L, total]");
  }
  const int64_t D = q.size(3), Dv = v_dense.size(3);
  TORCH_CHECK(k_dense.size(2) + k_np == total, "K rows do not add up to the total");
  TORCH_CHECK(k_kind != TURBO || k_np == 0 || (qr.defined() && qr.sizes() == q.sizes()),
              "turbo keys need the rotated queries");
  TORCH_CHECK(v_dense.size(2) + v_np == total, "V rows do not add up to the total");
  if (q.scalar_type() == torch::kFloat) {
    auto K = make_side<float>(k_kind, k_bits, k_group, k_nb, k_np, D, k_codes, k_a, k_z, k_lut, k_btab, k_dense);
    auto V = make_side<float>(v_kind, v_bits, v_group, v_nb, v_np, Dv, v_codes, v_a, v_z, v_lut, v_btab, v_dense);
    return attend_impl<float>(q, qr, qmu, seq, total, K, V, Dv, mask, softcap, sinks, sparse_v, blocks_per_head);
  }
  TORCH_CHECK(q.scalar_type() == torch::kDouble, "q must be float32 or float64");
  auto K = make_side<double>(k_kind, k_bits, k_group, k_nb, k_np, D, k_codes, k_a, k_z, k_lut, k_btab, k_dense);
  auto V = make_side<double>(v_kind, v_bits, v_group, v_nb, v_np, Dv, v_codes, v_a, v_z, v_lut, v_btab, v_dense);
  return attend_impl<double>(q, qr, qmu, seq, total, K, V, Dv, mask, softcap, sinks, sparse_v, blocks_per_head);
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

std::vector<torch::Tensor> turbo_encode(torch::Tensor x, torch::Tensor rotation, torch::Tensor levels,
                                        torch::Tensor bounds, int64_t bits, bool normfix) {
  TORCH_CHECK(x.dim() == 4 && x.is_contiguous() && x.device().is_cpu(), "x must be contiguous CPU [B, H, T, D]");
  TORCH_CHECK(bits >= 1 && bits <= 8, "bits must be in 1..8");
  const int64_t B = x.size(0), H = x.size(1), T = x.size(2), D = x.size(3);
  TORCH_CHECK(rotation.is_contiguous() && rotation.size(0) == D && rotation.size(1) == D, "rotation must be [D, D]");
  TORCH_CHECK(levels.numel() == (int64_t(1) << bits) && bounds.numel() == levels.numel() - 1, "codebook size");
  const int64_t nbytes = (D * bits + 7) / 8;
  auto codes = torch::empty({B, H, T, nbytes}, x.options().dtype(torch::kUInt8));
  auto norms = torch::empty({B, H, T, 1}, x.options().dtype(torch::kHalf));
  const int64_t rows = B * H * T;
  if (x.scalar_type() == torch::kFloat) {
    encode_rows<float>(x.data_ptr<float>(), rows, D, rotation.data_ptr<float>(), levels.data_ptr<float>(),
                       bounds.data_ptr<float>(), bounds.numel(), bits, normfix, codes.data_ptr<uint8_t>(), nbytes,
                       norms.data_ptr<at::Half>());
  } else {
    TORCH_CHECK(x.scalar_type() == torch::kDouble, "x must be float32 or float64");
    encode_rows<double>(x.data_ptr<double>(), rows, D, rotation.data_ptr<double>(), levels.data_ptr<double>(),
                        bounds.data_ptr<double>(), bounds.numel(), bits, normfix, codes.data_ptr<uint8_t>(), nbytes,
                        norms.data_ptr<at::Half>());
  }
  return {codes, norms};
}

std::vector<int64_t> simd_turbo_bits() {
#if TQ_SIMD
  return {1, 2, 3, 4};
#else
  return {};
#endif
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("attend", &attend, "fused decode attention over packed + dense KV rows (CPU)");
  m.def("turbo_encode", &turbo_encode, "TurboQuant quantize + pack of centred rows (CPU)");
  m.def("simd_turbo_bits", &simd_turbo_bits, "turbo widths decoded in SIMD order when head_dim % 64 == 0");
}
