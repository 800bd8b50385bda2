// fa_tiles.h: the softmax exp, dot / axpy, and scores / values of a tile of decoded rows
// (generic, and AVX-512 register tiles for head_dim 64 / 128).

#pragma once

#include "fa_rules.h"

namespace {

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

}  // namespace
