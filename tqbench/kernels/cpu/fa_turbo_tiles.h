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
  const __m512 cb = _mm512_loadu_ps(s.lutpad);
  if (s.D == 64) return turbo_tile_dispatch<4>(scores, s.bits, rp, norm, nt, q, qmu, p, ld, M, s.D, cb, out, accP, ps);
  return turbo_tile_dispatch<8>(scores, s.bits, rp, norm, nt, q, qmu, p, ld, M, s.D, cb, out, accP, ps);
}
#endif

}  // namespace
