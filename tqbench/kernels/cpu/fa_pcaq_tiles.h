// fa_pcaq_tiles.h: calibrated (pcaq) keys scored in 16-bit integers straight from their codes (float32 queries,
// head_dim % 64 == 0, widths <= 7, AVX-512 VBMI + VNNI): the per-head bit map becomes an extraction plan, the
// per-coordinate levels int16 tables held in byte-permute windows. The stored bytes are read as they are.
//
// Per (head, 64-coordinate chunk) the plan holds, for byte lane i (coordinate 64c + i):
//   perm  : one VPERMB gathers into qword q the 8 row bytes holding coordinates 8q..8q+7 (from one 64-byte load at
//           the chunk's first byte);
//   shift : one VPMULTISHIFTQB cuts the 8 bits at each coordinate's offset within its qword (a code of <= 7 bits
//           starts <= 7 + 7 * 7 = 56 bits in, so its field never wraps);
//   mask, base : one VPTERNLOG makes (field & (2**w - 1)) | base, the code's index in its window of 128 entries;
// and the windows: each a 128-entry table of the low bytes and one of the high bytes of the head's int16 levels
// (levels rounded in steps of max|level| / PQ_LEVEL_STEPS per head; coordinates whose levels are equal share one
// table, as a calibrated codec's coordinates of one group and width do; tables packed largest first, so each sits
// aligned to its size). One VPERMI2B per window and byte half turns 64 indices into level bytes (a lane outside the
// window keeps its index: the windows chain), two byte unpacks make 2 x 32 int16 levels, and per query four
// VPDPWSSD multiply them with the query's two int16 parts (hi, and lo: the remainder PQ_LO_SPLIT times finer; a
// transformed query's coordinates span orders of magnitude, one int16 step is too coarse for its small ones) in
// the unpack's order (`pq_pos`) and sum pairs exactly in int32.
// score_j = step_m * (sum_hi + sum_lo / PQ_LO_SPLIT) + q.mu_m, step_m = query step * the head's level step:
// within `pcaq_int_score_bound` (attention.py) of the float score.

#pragma once

#include "fa_rules.h"
#include "fa_tiles.h"

namespace {

// Position p of a chunk's 64 int16 query values holds coordinate pcaq_pos(p) of the chunk: VPUNPCKLBW gives words
// 0..31 (bytes 0..7 of each 128-bit lane), VPUNPCKHBW words 32..63 (bytes 8..15).
inline int64_t pcaq_pos(int64_t p) {
  const int64_t w = p % 32;
  return 16 * (w / 8) + (p < 32 ? 0 : 8) + w % 8;
}

// Whether this build can score a pcaq side in 16 bits; "" if so, else why not (the error names it).
inline std::string pcaq_int16_refusal(int64_t D, bool is_float, int64_t maxw) {
  if (!(TQ_VBMI && TQ_VNNI)) return "this build lacks AVX-512 VBMI + VNNI";
  if (!is_float) return "it needs float32 queries";
  if (D % 64) return "it needs head_dim a multiple of 64, got " + std::to_string(D);
  if (maxw > 7) return "it needs widths <= 7 bits, got " + std::to_string(maxw);
  return "";
}

// The extraction plan and level windows of every (head, chunk) of a pcaq side (`pcaq_int16_refusal` is "").
template <typename T>
void build_pcaq_plan(Side<T>& s, const uint8_t* widths, int64_t H) {
  const int64_t D = s.D, NC = D / 64, nlev = int64_t(1) << s.bits;
  s.pq.assign(H * NC, PqChunk{});
  s.pq_scale.assign(H, 1.0f);
  s.pq_pos.resize(D);
  for (int64_t i = 0; i < D; ++i) s.pq_pos[i] = static_cast<int32_t>(64 * (i / 64) + pcaq_pos(i % 64));
  s.pq_tab.clear();
  s.pq_wmask.clear();
  int64_t reach = 0;
  for (int64_t h = 0; h < H; ++h) {
    float amax = 0;
    for (int64_t j = 0; j < D; ++j)
      for (int64_t c = 0; c < (int64_t(1) << widths[h * D + j]); ++c)
        amax = std::max(amax, std::abs(static_cast<float>(s.plev[(h * D + j) * nlev + c])));
    const float step = amax > 0 ? amax / static_cast<float>(PQ_LEVEL_STEPS) : 1.0f;
    s.pq_scale[h] = step;
    std::vector<int64_t> off(D + 1, 0);  // each coordinate's first bit in the row's stream
    for (int64_t j = 0; j < D; ++j) off[j + 1] = off[j] + widths[h * D + j];
    for (int64_t c = 0; c < NC; ++c) {
      PqChunk& k = s.pq[h * NC + c];
      const int64_t j0 = h * D + 64 * c;
      k.load = static_cast<int32_t>(off[64 * c] >> 3);
      for (int64_t q = 0; q < 8; ++q) {
        const int64_t qb = off[64 * c + 8 * q] >> 3;
        for (int64_t i = 0; i < 8; ++i) {
          k.perm[8 * q + i] = static_cast<uint8_t>(qb - k.load + i);
          k.shift[8 * q + i] = static_cast<uint8_t>(off[64 * c + 8 * q + i] - 8 * qb);
          k.mask[8 * q + i] = static_cast<uint8_t>((1 << widths[j0 + 8 * q + i]) - 1);
        }
      }
      reach = std::max<int64_t>(reach, k.load + 64);
      // the chunk's distinct int16 tables, largest first, packed into windows of 128 entries
      std::vector<std::vector<int16_t>> tabs;
      std::vector<int> tab_of(64);
      for (int64_t i = 0; i < 64; ++i) {
        const int64_t w = widths[j0 + i];
        std::vector<int16_t> t(int64_t(1) << w);
        for (int64_t c2 = 0; c2 < (int64_t(1) << w); ++c2)
          t[c2] = static_cast<int16_t>(std::nearbyint(static_cast<float>(s.plev[(j0 + i) * nlev + c2]) / step));
        int found = -1;
        for (size_t u = 0; u < tabs.size() && found < 0; ++u)
          if (tabs[u] == t) found = static_cast<int>(u);
        if (found < 0) {
          found = static_cast<int>(tabs.size());
          tabs.push_back(std::move(t));
        }
        tab_of[i] = found;
      }
      std::vector<int> by_size(tabs.size());
      for (size_t u = 0; u < tabs.size(); ++u) by_size[u] = static_cast<int>(u);
      std::stable_sort(by_size.begin(), by_size.end(),
                       [&](int x, int y) { return tabs[x].size() > tabs[y].size(); });
      std::vector<int> win_of(tabs.size()), at_of(tabs.size()), fill;
      for (int u : by_size) {  // first fit: sizes are powers of 2 and come largest first, so each lands aligned
        const int sz = static_cast<int>(tabs[u].size());
        int w = 0;
        while (w < static_cast<int>(fill.size()) && fill[w] + sz > 128) ++w;
        if (w == static_cast<int>(fill.size())) fill.push_back(0);
        win_of[u] = w;
        at_of[u] = fill[w];
        fill[w] += sz;
      }
      k.win0 = static_cast<int32_t>(s.pq_wmask.size());
      k.nwin = static_cast<int32_t>(fill.size());
      const size_t t0 = s.pq_tab.size();
      s.pq_tab.resize(t0 + 256 * fill.size(), 0);
      s.pq_wmask.resize(s.pq_wmask.size() + fill.size(), 0);
      for (size_t u = 0; u < tabs.size(); ++u)
        for (size_t e = 0; e < tabs[u].size(); ++e) {
          const uint16_t v = static_cast<uint16_t>(tabs[u][e]);
          s.pq_tab[t0 + 256 * win_of[u] + at_of[u] + e] = static_cast<uint8_t>(v & 0xFF);
          s.pq_tab[t0 + 256 * win_of[u] + 128 + at_of[u] + e] = static_cast<uint8_t>(v >> 8);
        }
      for (int64_t i = 0; i < 64; ++i) {
        k.base[i] = static_cast<uint8_t>(at_of[tab_of[i]]);
        s.pq_wmask[k.win0 + win_of[tab_of[i]]] |= uint64_t(1) << i;
      }
    }
  }
  s.pq_reach = reach;
  s.s16 = true;
}

#if TQ_VBMI && TQ_VNNI
// The 64 int16 levels of one row's chunk `k` (two vectors in the unpack's order): NW windows (0: k.nwin of them).
template <int NW>
TQ_INLINE void pcaq_levels(const PqChunk& k, const uint8_t* t0, const uint64_t* wm, const uint8_t* row, __m512i perm,
                           __m512i shift, __m512i mask, __m512i base, __m512i& w0, __m512i& w1) {
  const __m512i raw = _mm512_loadu_si512(row + k.load);
  const __m512i f = _mm512_multishift_epi64_epi8(shift, _mm512_permutexvar_epi8(perm, raw));
  const __m512i idx = _mm512_ternarylogic_epi64(f, mask, base, 0xEA);  // (f & mask) | base
  __m512i lo, hi;
  if (NW == 1) {
    lo = _mm512_permutex2var_epi8(_mm512_loadu_si512(t0), idx, _mm512_loadu_si512(t0 + 64));
    hi = _mm512_permutex2var_epi8(_mm512_loadu_si512(t0 + 128), idx, _mm512_loadu_si512(t0 + 192));
  } else {
    lo = idx;
    hi = idx;
    const int32_t nw = NW ? NW : k.nwin;
    for (int32_t w = 0; w < nw; ++w) {
      const uint8_t* tw = t0 + 256 * w;
      const __mmask64 m = _cvtu64_mask64(wm[w]);
      lo = _mm512_mask2_permutex2var_epi8(_mm512_loadu_si512(tw), lo, m, _mm512_loadu_si512(tw + 64));
      hi = _mm512_mask2_permutex2var_epi8(_mm512_loadu_si512(tw + 128), hi, m, _mm512_loadu_si512(tw + 192));
    }
  }
  w0 = _mm512_unpacklo_epi8(lo, hi);
  w1 = _mm512_unpackhi_epi8(lo, hi);
}

// hi[2 m + r] / lo[2 m + r] += <levels of row r's chunk k, query m's hi / lo int16 chunk> for 2 rows (a missing
// row repeats row 0)
template <int MB, int NW>
TQ_INLINE void pcaq_chunk2(const PqChunk& k, const uint8_t* tab, const uint64_t* wm, const uint8_t* const* r2,
                           const int16_t* qh, const int16_t* ql, int64_t D, __m512i* hi, __m512i* lo) {
  const __m512i perm = _mm512_load_si512(k.perm), shift = _mm512_load_si512(k.shift);
  const __m512i mask = _mm512_load_si512(k.mask), base = _mm512_load_si512(k.base);
  const uint8_t* t0 = tab + 256 * static_cast<int64_t>(k.win0);
  const uint64_t* m0 = wm + k.win0;
  for (int r = 0; r < 2; ++r) {
    __m512i w0, w1;
    pcaq_levels<NW>(k, t0, m0, r2[r], perm, shift, mask, base, w0, w1);
    for (int m = 0; m < MB; ++m) {
      hi[2 * m + r] = _mm512_dpwssd_epi32(hi[2 * m + r], w0, _mm512_loadu_si512(qh + m * D));
      hi[2 * m + r] = _mm512_dpwssd_epi32(hi[2 * m + r], w1, _mm512_loadu_si512(qh + m * D + 32));
      lo[2 * m + r] = _mm512_dpwssd_epi32(lo[2 * m + r], w0, _mm512_loadu_si512(ql + m * D));
      lo[2 * m + r] = _mm512_dpwssd_epi32(lo[2 * m + r], w1, _mm512_loadu_si512(ql + m * D + 32));
    }
  }
}

template <int MB>
TQ_INLINE void pcaq_scores16_mb(const Side<float>& s, const PqChunk* ch, const uint8_t* const* rp, int64_t nt,
                                const int16_t* qh, const int16_t* ql, const float* step, const float* qmu,
                                float* out, int64_t ld) {
  const int64_t D = s.D, NC = D / 64;
  const uint8_t* tab = s.pq_tab.data();
  const uint64_t* wm = s.pq_wmask.data();
  const __m512 split = _mm512_set1_ps(1.0f / static_cast<float>(PQ_LO_SPLIT));
  for (int64_t j0 = 0; j0 < nt; j0 += 2) {
    __m512i hi[8], lo[8];
    for (int i = 0; i < 8; ++i) hi[i] = lo[i] = _mm512_setzero_si512();
    const int64_t nj = std::min<int64_t>(2, nt - j0);
    const uint8_t* r2[2] = {rp[j0], rp[j0 + (nj > 1 ? 1 : 0)]};
    for (int64_t c = 0; c < NC; ++c) {
      const PqChunk& k = ch[c];
      const int16_t *h = qh + 64 * c, *l = ql + 64 * c;
      switch (k.nwin) {
        case 1: pcaq_chunk2<MB, 1>(k, tab, wm, r2, h, l, D, hi, lo); break;
        case 2: pcaq_chunk2<MB, 2>(k, tab, wm, r2, h, l, D, hi, lo); break;
        case 3: pcaq_chunk2<MB, 3>(k, tab, wm, r2, h, l, D, hi, lo); break;
        case 4: pcaq_chunk2<MB, 4>(k, tab, wm, r2, h, l, D, hi, lo); break;
        default: pcaq_chunk2<MB, 0>(k, tab, wm, r2, h, l, D, hi, lo); break;
      }
    }
    __m512 f[16];  // f[2m + r] = hi + lo / PQ_LO_SPLIT (each part exact in int32, then in float)
    for (int i = 0; i < 8; ++i) f[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(lo[i]), split, _mm512_cvtepi32_ps(hi[i]));
    for (int i = 8; i < 16; ++i) f[i] = _mm512_setzero_ps();
    alignas(64) float r[16];
    _mm512_store_ps(r, reduce16(f));
    for (int m = 0; m < MB; ++m)
      for (int64_t jj = 0; jj < nj; ++jj) out[m * ld + j0 + jj] = step[m] * r[2 * m + jj] + (qmu ? qmu[m] : 0.f);
  }
}
#endif

// A tile of packed pcaq rows scored in 16 bits; false when the tile does not qualify (rows outside the packed run:
// the float path scores them).
template <typename T>
inline bool pcaq_tile16(const Side<T>&, int64_t, int64_t, int64_t, int64_t, const int16_t*, const int16_t*,
                        const float*, const T*, int64_t, T*, int64_t) {
  return false;
}

#if TQ_VBMI && TQ_VNNI
template <>
inline bool pcaq_tile16<float>(const Side<float>& s, int64_t b, int64_t h, int64_t t, int64_t nt, const int16_t* q16,
                               const int16_t* q16lo, const float* step, const float* qmu, int64_t M, float* out,
                               int64_t ld) {
  if (s.kind != PCAQ || !s.s16 || t < s.nb || t + nt > s.nb + s.np) return false;
  const int64_t n = t - s.nb;
  const uint8_t* base = s.codes + b * s.c_b + h * s.c_h + n * s.c_r;
  const uint8_t* rp[TILE];
  // a row whose 64-byte chunk loads would pass the codes' last byte is read from a zero-padded copy
  alignas(64) uint8_t pad[TILE][MAX_HEAD_DIM + 64];
  for (int64_t j = 0; j < nt; ++j) {
    rp[j] = base + j * s.c_r;
    if (rp[j] + s.pq_reach > s.codes_end) {
      std::memset(pad[j], 0, static_cast<size_t>(s.pq_reach));
      std::memcpy(pad[j], rp[j], static_cast<size_t>(s.row_bytes));
      rp[j] = pad[j];
    }
  }
  const int64_t pf0 = n + nt + TILE, pf1 = std::min(s.np, pf0 + TILE);
  for (int64_t j = pf0; j < pf1; ++j) {
    const char* r = reinterpret_cast<const char*>(base + (j - n) * s.c_r);
    for (int64_t o = 0; o < s.row_bytes; o += 64) _mm_prefetch(r + o, _MM_HINT_T0);
  }
  const PqChunk* ch = s.pq.data() + h * (s.D / 64);
  for (int64_t m0 = 0; m0 < M; m0 += 4) {
    const int16_t *q = q16 + m0 * s.D, *ql = q16lo + m0 * s.D;
    const float* st = step + m0;
    const float* mu = qmu ? qmu + m0 : nullptr;
    float* o = out + m0 * ld;
    switch (std::min<int64_t>(4, M - m0)) {
      case 4: pcaq_scores16_mb<4>(s, ch, rp, nt, q, ql, st, mu, o, ld); break;
      case 3: pcaq_scores16_mb<3>(s, ch, rp, nt, q, ql, st, mu, o, ld); break;
      case 2: pcaq_scores16_mb<2>(s, ch, rp, nt, q, ql, st, mu, o, ld); break;
      default: pcaq_scores16_mb<1>(s, ch, rp, nt, q, ql, st, mu, o, ld); break;
    }
  }
  return true;
}
#endif

}  // namespace
