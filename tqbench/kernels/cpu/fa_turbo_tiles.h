// fa_turbo_tiles.h: packed TurboQuant tiles scored / accumulated straight from the codes
// (fp32, SIMD order, AVX-512; no decoded copy).

#pragma once

#include "fa_rules.h"
#include "fa_tiles.h"

namespace {

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
  // the tile after next: its codes and norms requested now, so the loads above and below find them in cache
  // (each tile's rows are one short stream per (sequence, head); the hardware prefetcher alone leaves the scoring
  // and accumulation loops waiting on memory)
  const int64_t pf0 = n + nt + TILE, pf1 = std::min(s.np, pf0 + TILE), rb = (s.D * s.bits + 7) / 8;
  for (int64_t j = pf0; j < pf1; ++j) {
    const char* r = reinterpret_cast<const char*>(base + (j - n) * s.c_r);
    for (int64_t o = 0; o < rb; o += 64) _mm_prefetch(r + o, _MM_HINT_T0);
  }
  if (pf0 < pf1) _mm_prefetch(reinterpret_cast<const char*>(a + (pf0 - n) * s.a_r), _MM_HINT_T0);
  const __m512 cb = _mm512_loadu_ps(s.lutpad);
  if (s.D == 64) return turbo_tile_dispatch<4>(scores, s.bits, rp, norm, nt, q, qmu, p, ld, M, s.D, cb, out, accP, ps);
  return turbo_tile_dispatch<8>(scores, s.bits, rp, norm, nt, q, qmu, p, ld, M, s.D, cb, out, accP, ps);
}
#endif

}  // namespace

// -- turbo keys scored in 8 bits (AVX-512 VNNI) ----------------------------------------------------------------
// 64 codes of a row become 64 uint8 codebook values in one byte shuffle (the codebook is one table for every
// coordinate, held in each 128-bit lane), and one VPDPBUSD multiplies them with the int8 query and sums each 4 in
// int32, exactly. score_j = norm_j * step_m * (sum_c q8_mc * cb8[code_jc] - 128 * sum_c q8_mc) + q.mu_m, where
// step_m = query step * codebook step. Positions follow the SIMD order of the float path (simd_pos).
namespace {

template <typename T>
inline bool turbo_tile8(const Side<T>&, int64_t, int64_t, int64_t, int64_t, const int8_t*, const float*,
                        const int32_t*, const T*, int64_t, T*, int64_t) {
  return false;
}

template <typename T>
inline bool turbo_tile16(const Side<T>&, int64_t, int64_t, int64_t, int64_t, const int16_t*, const float*, const T*,
                         int64_t, T*, int64_t) {
  return false;
}

#if TQ_VNNI
#if TQ_VBMI
// 3 bits: the 64 codes of group g as bytes in their natural order (the SIMD order of 3-bit rows with VBMI): bytes
// 3L..3L+2 of the group into 64-bit lane L, one multishift cuts the lane's 8 codes
TQ_INLINE __m512i turbo_codes3(const uint8_t* p, int64_t g) {
  const uint8_t* q = p + 24 * g;
  const __m512i raw = _mm512_castsi256_si512(_mm256_inserti128_si256(
      _mm256_castsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q))),
      _mm_loadl_epi64(reinterpret_cast<const __m128i*>(q + 16)), 1));
  const __m512i idx = _mm512_set_epi64(0x1717171717171615LL, 0x1414141414141312LL, 0x111111111111100FLL,
                                       0x0E0E0E0E0E0E0D0CLL, 0x0B0B0B0B0B0B0A09LL, 0x0808080808080706LL,
                                       0x0505050505050403LL, 0x0202020202020100LL);
  return _mm512_and_si512(_mm512_multishift_epi64_epi8(_mm512_set1_epi64(0x15120F0C09060300LL),
                                                        _mm512_permutexvar_epi8(idx, raw)),
                          _mm512_set1_epi8(7));
}
#endif

template <int BITS>
TQ_INLINE __m512i turbo_codes64(const uint8_t* p, int64_t g) {
#if TQ_VBMI
  if (BITS == 3) return turbo_codes3(p, g);
#endif
  if (BITS == 4) {  // positions 0..31: low nibbles of the group's 32 bytes; 32..63: their high nibbles
    const __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 32 * g));
    const __m256i m = _mm256_set1_epi8(15);
    return _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_and_si256(x, m)),
                              _mm256_and_si256(_mm256_srli_epi16(x, 4), m), 1);
  }
  // 2 bits: position 16k + i holds bits 2k..2k+1 of byte i of the group's 16
  const __m512i x = _mm512_broadcast_i32x4(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 16 * g)));
  const __m512i sh = _mm512_set_epi64(6, 6, 4, 4, 2, 2, 0, 0);
  return _mm512_and_si512(_mm512_srlv_epi64(x, sh), _mm512_set1_epi8(3));
}

template <int BITS, int MB>
TQ_INLINE void turbo_scores8_mb(const uint8_t* const* rp, const float* norm, int64_t nt, const int8_t* q8,
                                const float* step, const int32_t* qsum, const float* qmu, int64_t D, __m512i tab,
                                float* s, int64_t ld) {
  const int64_t NG = D / 64;
  for (int64_t j0 = 0; j0 < nt; j0 += 4) {
    __m512i acc[16];
    for (int i = 0; i < 16; ++i) acc[i] = _mm512_setzero_si512();
    const int64_t nj = std::min<int64_t>(4, nt - j0);
    for (int64_t g = 0; g < NG; ++g) {
      __m512i qv[MB];
      for (int m = 0; m < MB; ++m) qv[m] = _mm512_loadu_si512(q8 + m * D + 64 * g);
      for (int jj = 0; jj < 4; ++jj) {
        if (jj >= nj) break;
        const __m512i x = _mm512_shuffle_epi8(tab, turbo_codes64<BITS>(rp[j0 + jj], g));
        for (int m = 0; m < MB; ++m) acc[4 * m + jj] = _mm512_dpbusd_epi32(acc[4 * m + jj], x, qv[m]);
      }
    }
    __m512 f[16];
    for (int i = 0; i < 16; ++i) f[i] = _mm512_cvtepi32_ps(acc[i]);  // |sum| < 2^24 for D <= 512: exact
    alignas(64) float r[16];
    _mm512_store_ps(r, reduce16(f));
    for (int m = 0; m < MB; ++m)
      for (int64_t jj = 0; jj < nj; ++jj)
        s[m * ld + j0 + jj] = norm[j0 + jj] * (step[m] * (r[4 * m + jj] - 128.0f * static_cast<float>(qsum[m]))) +
                              (qmu ? qmu[m] : 0.f);
  }
}

template <int BITS>
void turbo_scores8(const uint8_t* const* rp, const float* norm, int64_t nt, const int8_t* q8, const float* step,
                   const int32_t* qsum, const float* qmu, int64_t M, int64_t D, __m512i tab, float* s, int64_t ld) {
  for (int64_t m0 = 0; m0 < M; m0 += 4) {
    const int8_t* q = q8 + m0 * D;
    const float* st = step + m0;
    const int32_t* qs = qsum + m0;
    const float* mu = qmu ? qmu + m0 : nullptr;
    float* o = s + m0 * ld;
    switch (std::min<int64_t>(4, M - m0)) {
      case 4: turbo_scores8_mb<BITS, 4>(rp, norm, nt, q, st, qs, mu, D, tab, o, ld); break;
      case 3: turbo_scores8_mb<BITS, 3>(rp, norm, nt, q, st, qs, mu, D, tab, o, ld); break;
      case 2: turbo_scores8_mb<BITS, 2>(rp, norm, nt, q, st, qs, mu, D, tab, o, ld); break;
      default: turbo_scores8_mb<BITS, 1>(rp, norm, nt, q, st, qs, mu, D, tab, o, ld); break;
    }
  }
}

// 16 bits: 32 codes widened to 16-bit lanes become 32 int16 codebook values in one word permute; one VPDPWSSD per
// query multiplies them with the int16 query and sums each pair in int32, exactly.
template <int BITS>
TQ_INLINE void turbo_codes64w(const uint8_t* p, int64_t g, __m512i& lo, __m512i& hi) {
#if TQ_VBMI
  if (BITS == 3) {  // natural order: lo = positions 0..31, hi = 32..63, widened to words
    const __m512i x = turbo_codes3(p, g);
    lo = _mm512_cvtepu8_epi16(_mm512_castsi512_si256(x));
    hi = _mm512_cvtepu8_epi16(_mm512_extracti64x4_epi64(x, 1));
    return;
  }
#endif
  if (BITS == 4) {  // words 0..31: the group's 32 bytes; lo = their low nibbles (positions 0..31), hi = high
    const __m512i x = _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 32 * g)));
    lo = _mm512_and_si512(x, _mm512_set1_epi16(15));
    hi = _mm512_srli_epi16(x, 4);
    return;
  }
  // 2 bits: words 0..15 and 16..31 both the group's 16 bytes; position 16k + i holds bits 2k..2k+1 of byte i
  const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 16 * g));
  const __m512i x = _mm512_cvtepu8_epi16(_mm256_set_m128i(b, b));
  const __m512i s01 = _mm512_inserti64x4(_mm512_set1_epi16(0), _mm256_set1_epi16(2), 1);
  const __m512i s23 = _mm512_inserti64x4(_mm512_set1_epi16(4), _mm256_set1_epi16(6), 1);
  lo = _mm512_and_si512(_mm512_srlv_epi16(x, s01), _mm512_set1_epi16(3));
  hi = _mm512_and_si512(_mm512_srlv_epi16(x, s23), _mm512_set1_epi16(3));
}

template <int BITS, int MB>
TQ_INLINE void turbo_scores16_mb(const uint8_t* const* rp, const float* norm, int64_t nt, const int16_t* q16,
                                 const float* step, const float* qmu, int64_t D, __m512i tab, float* s, int64_t ld) {
  const int64_t NG = D / 64;
  for (int64_t j0 = 0; j0 < nt; j0 += 4) {
    __m512i acc[16];
    for (int i = 0; i < 16; ++i) acc[i] = _mm512_setzero_si512();
    const int64_t nj = std::min<int64_t>(4, nt - j0);
    for (int64_t g = 0; g < NG; ++g) {
      for (int jj = 0; jj < 4; ++jj) {
        if (jj >= nj) break;
        __m512i lo, hi;
        turbo_codes64w<BITS>(rp[j0 + jj], g, lo, hi);
        const __m512i vlo = _mm512_permutexvar_epi16(lo, tab), vhi = _mm512_permutexvar_epi16(hi, tab);
        for (int m = 0; m < MB; ++m) {
          const int16_t* q = q16 + m * D + 64 * g;
          acc[4 * m + jj] = _mm512_dpwssd_epi32(acc[4 * m + jj], vlo, _mm512_loadu_si512(q));
          acc[4 * m + jj] = _mm512_dpwssd_epi32(acc[4 * m + jj], vhi, _mm512_loadu_si512(q + 32));
        }
      }
    }
    __m512 f[16];
    for (int i = 0; i < 16; ++i) f[i] = _mm512_cvtepi32_ps(acc[i]);
    alignas(64) float r[16];
    _mm512_store_ps(r, reduce16(f));
    for (int m = 0; m < MB; ++m)
      for (int64_t jj = 0; jj < nj; ++jj)
        s[m * ld + j0 + jj] = norm[j0 + jj] * (step[m] * r[4 * m + jj]) + (qmu ? qmu[m] : 0.f);
  }
}

template <int BITS>
void turbo_scores16(const uint8_t* const* rp, const float* norm, int64_t nt, const int16_t* q16, const float* step,
                    const float* qmu, int64_t M, int64_t D, __m512i tab, float* s, int64_t ld) {
  for (int64_t m0 = 0; m0 < M; m0 += 4) {
    const int16_t* q = q16 + m0 * D;
    const float* st = step + m0;
    const float* mu = qmu ? qmu + m0 : nullptr;
    float* o = s + m0 * ld;
    switch (std::min<int64_t>(4, M - m0)) {
      case 4: turbo_scores16_mb<BITS, 4>(rp, norm, nt, q, st, mu, D, tab, o, ld); break;
      case 3: turbo_scores16_mb<BITS, 3>(rp, norm, nt, q, st, mu, D, tab, o, ld); break;
      case 2: turbo_scores16_mb<BITS, 2>(rp, norm, nt, q, st, mu, D, tab, o, ld); break;
      default: turbo_scores16_mb<BITS, 1>(rp, norm, nt, q, st, mu, D, tab, o, ld); break;
    }
  }
}

template <>
inline bool turbo_tile8<float>(const Side<float>& s, int64_t b, int64_t h, int64_t t, int64_t nt, const int8_t* q8,
                               const float* step, const int32_t* qsum, const float* qmu, int64_t M, float* out,
                               int64_t ld) {
  if (t < s.nb || t + nt > s.nb + s.np) return false;  // rows outside the packed run: the float path
  const int64_t n = t - s.nb;
  const uint8_t* rp[TILE];
  alignas(64) float norm[TILE];
  const uint8_t* base = s.codes + b * s.c_b + h * s.c_h + n * s.c_r;
  const at::Half* a = s.a + b * s.a_b + h * s.a_h + n * s.a_r;
  for (int64_t j = 0; j < nt; ++j) {
    rp[j] = base + j * s.c_r;
    norm[j] = static_cast<float>(a[j * s.a_r]);
  }
  const int64_t pf0 = n + nt + TILE, pf1 = std::min(s.np, pf0 + TILE), rb = (s.D * s.bits + 7) / 8;
  for (int64_t j = pf0; j < pf1; ++j) {
    const char* r = reinterpret_cast<const char*>(base + (j - n) * s.c_r);
    for (int64_t o = 0; o < rb; o += 64) _mm_prefetch(r + o, _MM_HINT_T0);
  }
  const __m512i tab = _mm512_load_si512(s.cb8);
  if (s.bits == 4) turbo_scores8<4>(rp, norm, nt, q8, step, qsum, qmu, M, s.D, tab, out, ld);
#if TQ_VBMI
  else if (s.bits == 3) turbo_scores8<3>(rp, norm, nt, q8, step, qsum, qmu, M, s.D, tab, out, ld);
#endif
  else turbo_scores8<2>(rp, norm, nt, q8, step, qsum, qmu, M, s.D, tab, out, ld);
  return true;
}

template <>
inline bool turbo_tile16<float>(const Side<float>& s, int64_t b, int64_t h, int64_t t, int64_t nt, const int16_t* q16,
                                const float* step, const float* qmu, int64_t M, float* out, int64_t ld) {
  if (t < s.nb || t + nt > s.nb + s.np) return false;  // rows outside the packed run: the float path
  const int64_t n = t - s.nb;
  const uint8_t* rp[TILE];
  alignas(64) float norm[TILE];
  const uint8_t* base = s.codes + b * s.c_b + h * s.c_h + n * s.c_r;
  const at::Half* a = s.a + b * s.a_b + h * s.a_h + n * s.a_r;
  for (int64_t j = 0; j < nt; ++j) {
    rp[j] = base + j * s.c_r;
    norm[j] = static_cast<float>(a[j * s.a_r]);
  }
  const int64_t pf0 = n + nt + TILE, pf1 = std::min(s.np, pf0 + TILE), rb = (s.D * s.bits + 7) / 8;
  for (int64_t j = pf0; j < pf1; ++j) {
    const char* r = reinterpret_cast<const char*>(base + (j - n) * s.c_r);
    for (int64_t o = 0; o < rb; o += 64) _mm_prefetch(r + o, _MM_HINT_T0);
  }
  const __m512i tab = _mm512_load_si512(s.cb16);
  if (s.bits == 4) turbo_scores16<4>(rp, norm, nt, q16, step, qmu, M, s.D, tab, out, ld);
#if TQ_VBMI
  else if (s.bits == 3) turbo_scores16<3>(rp, norm, nt, q16, step, qmu, M, s.D, tab, out, ld);
#endif
  else turbo_scores16<2>(rp, norm, nt, q16, step, qmu, M, s.D, tab, out, ld);
  return true;
}
#endif

}  // namespace
