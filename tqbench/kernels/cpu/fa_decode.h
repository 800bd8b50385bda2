// fa_decode.h: unpacking one row's codes (every width; TurboQuant rows in SIMD order, AVX-512 / AVX2)
// and fetching a row or a tile of rows of a side (`fetch_row`, `fetch_tile_turbo`).

#pragma once

#include "fa_rules.h"

namespace {

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

// -- pcaq rows: per-coordinate widths ----------------------------------------------------------------------
// Coordinate j of head h reads the 32-bit word at byte pbyte[j] of the row (copied into a zero-padded buffer, so
// no read passes the row), shifts it by pshift[j], masks pmask[j] and looks its level up at plev_at[j] + code.
template <typename T>
inline void decode_pcaq(const Side<T>& s, int64_t h, const uint8_t* p, T* out) {
  alignas(64) uint8_t row[MAX_HEAD_DIM + 8];  // a row holds at most 8 bits per coordinate
  std::memcpy(row, p, s.row_bytes);
  std::memset(row + s.row_bytes, 0, 4);
  const int64_t D = s.D, o = h * D;
  const int32_t *by = s.pbyte.data() + o, *sh = s.pshift.data() + o, *mk = s.pmask.data() + o,
                *la = s.plev_at.data() + o;
  const T* lev = s.plev.data();
  int64_t j = 0;
#if TQ_AVX512
  if constexpr (std::is_same<T, float>::value) {
    for (; j + 16 <= D; j += 16) {
      const __m512i w = _mm512_i32gather_epi32(_mm512_loadu_si512(by + j), row, 1);
      const __m512i c = _mm512_and_si512(_mm512_srlv_epi32(w, _mm512_loadu_si512(sh + j)), _mm512_loadu_si512(mk + j));
      _mm512_storeu_ps(out + j, _mm512_i32gather_ps(_mm512_add_epi32(c, _mm512_loadu_si512(la + j)), lev, 4));
    }
  }
#elif TQ_AVX2
  if constexpr (std::is_same<T, float>::value) {
    for (; j + 8 <= D; j += 8) {
      const __m256i w = _mm256_i32gather_epi32(reinterpret_cast<const int*>(row),
                                               _mm256_loadu_si256(reinterpret_cast<const __m256i*>(by + j)), 1);
      const __m256i c = _mm256_and_si256(_mm256_srlv_epi32(w, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(sh + j))),
                                         _mm256_loadu_si256(reinterpret_cast<const __m256i*>(mk + j)));
      _mm256_storeu_ps(out + j, _mm256_i32gather_ps(lev, _mm256_add_epi32(c, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(la + j))), 4));
    }
  }
#endif
  for (; j < D; ++j) {
    uint32_t w;
    std::memcpy(&w, row + by[j], 4);
    out[j] = lev[la[j] + ((w >> sh[j]) & static_cast<uint32_t>(mk[j]))];
  }
}

// Row `t` (store order) of one side for batch row b of the side, head h: a pointer to D values, `scale`
// (turbo norm, else 1) and whether it lives in the transformed domain (turbo and pcaq packed rows).
template <typename T>
TQ_INLINE const T* fetch_row(const Side<T>& s, int64_t b, int64_t h, int64_t t, T* buf, T& scale, bool& rot) {
  scale = T(1);
  rot = false;
  if (t < s.nb || t >= s.nb + s.np) {
    const int64_t r = t < s.nb ? t : t - s.np;
    int k = 0;
    while (r >= s.dend[k]) ++k;
    const int64_t r0 = k ? s.dend[k - 1] : 0;
    const int64_t off = b * s.db[k] + (s.dglobal[k] ? s.gheads[h] : h) * s.dh[k] + (r - r0) * s.dr[k];
    if (s.dtype16[k] == ROWS_T) return static_cast<const T*>(s.dptr[k]) + off;
    if (s.dtype16[k] == ROWS_F16) half_to(static_cast<const at::Half*>(s.dptr[k]) + off, s.D, buf);
    else bf16_to(static_cast<const at::BFloat16*>(s.dptr[k]) + off, s.D, buf);
    return buf;
  }
  const int64_t n = t - s.nb;
  const int64_t D = s.D;
  if (s.kind == PCAQ) {
    decode_pcaq(s, h, s.codes + b * s.c_b + h * s.c_h + n * s.c_r, buf);
    rot = true;
    return buf;
  }
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

}  // namespace
