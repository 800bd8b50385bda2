// fa_attend.h: `attend`: the batch's queries over every sequence's store, in passes over one `Call`: the split
// into work items, the query pass, the block pass (scores, softmax, values per item), the merge.

#pragma once

#include "fa_rules.h"
#include "fa_decode.h"
#include "fa_tiles.h"
#include "fa_turbo_tiles.h"
#include "fa_pcaq_tiles.h"
#include "fa_sides.h"
#include "fa_stores.h"

namespace {

using AttendResult = std::tuple<torch::Tensor, std::vector<int64_t>, std::vector<int64_t>, int64_t>;

// The split: token blocks of MIN_BLOCK..MAX_BLOCK rows, about BLOCKS_PER_THREAD items per thread.
template <typename T>
void split_work(Call<T>& c) {
  c.threads = std::max<int64_t>(1, at::get_num_threads());
  int64_t work = 0;
  for (const auto& s : c.seqs) work += s.total * c.H;  // (a tier's sequences are split with the rest)
  const int64_t per = BLOCKS_PER_THREAD * c.threads;
  const int64_t blk_len = std::min(MAX_BLOCK, std::max(MIN_BLOCK, (work + per - 1) / per));
  for (int64_t s = 0; s < c.NS; ++s) {
    const int64_t tot = c.seqs[s].total, nblk = (tot + blk_len - 1) / blk_len, blk = (tot + nblk - 1) / nblk;
    c.blk_max = std::max(c.blk_max, blk);
    for (int64_t h = 0; h < c.H; ++h)
      for (int64_t b = 0; b < nblk; ++b) c.items.push_back({s, h, b * blk, std::min(tot, (b + 1) * blk)});
  }
}

// Queries: scaled, [seq, kv head, M, D] (a tier's sequence: its owner's query row); transformed for turbo / pcaq
// keys (in the decode order, with the head's own transform for pcaq) and q.mu for centred keys.
template <typename T>
void prepare_queries(Call<T>& c, const torch::Tensor& query, double qscale) {
  const int64_t B = c.NS, H = c.H, M = c.M, D = c.D, L = c.L, G = c.G;
  const T scale = static_cast<T>(qscale);
  c.qs.assign(B * H * M * D, T(0));
  bool any_rot = false, any_mu = false;
  for (const auto& k : c.K) {
    any_rot = any_rot || transformed(k.kind);
    any_mu = any_mu || (transformed(k.kind) && k.mu);
  }
  if (any_rot) c.qr.assign(B * H * M * D, T(0));
  bool any_s8 = false, any_s16 = false;
  for (const auto& k : c.K) {
    any_s8 = any_s8 || k.s8;
    any_s16 = any_s16 || k.s16;
  }
  bool any_pq16 = false;  // pcaq keys in 16 bits: their query's lo parts after every hi part (q16[NQ + ...])
  for (const auto& k : c.K) any_pq16 = any_pq16 || (k.s16 && k.kind == PCAQ);
  if (any_s16) {
    c.q16.assign((any_pq16 ? 2 : 1) * B * H * M * D, 0);
    c.q16step.assign(B * H * M, 0.f);
  }
  if (any_s8) {
    c.q8.assign(B * H * M * D, 0);
    c.q8step.assign(B * H * M, 0.f);
    c.q8sum.assign(B * H * M, 0);
  }
  if (any_mu) c.qmu.assign(B * H * M, T(0));
  const T* qp = query.data_ptr<T>();
  const int64_t q0 = query.stride(0), q1 = query.stride(1), q2 = query.stride(2), q3 = query.stride(3);
  at::parallel_for(0, B * H, 1, [&](int64_t begin, int64_t end) {
    std::vector<T> mu(D);
    for (int64_t bh = begin; bh < end; ++bh) {
      const int64_t s = bh / H, h = bh % H, lh = c.local(s, h);
      const Side<T>& k = c.kside(s, h);
      if (k.mu) half_to(k.mu + c.seqs[s].row * k.mu_b + lh * k.mu_h, D, mu.data());
      const T* rot = k.rot + lh * k.rot_h;
      for (int64_t m = 0; m < M; ++m) {
        const T* src = qp + c.seqs[s].qrow * q0 + (h * G + m / L) * q1 + (m % L) * q2;
        T* dst = c.qs.data() + (bh * M + m) * D;
        for (int64_t j = 0; j < D; ++j) dst[j] = src[j * q3] * scale;
        if (!transformed(k.kind)) continue;
        T* r = c.qr.data() + (bh * M + m) * D;
        for (int64_t i = 0; i < D; ++i) r[i] = dot(rot + (k.order.empty() ? i : k.order[i]) * D, dst, D);
        if (k.mu) c.qmu[bh * M + m] = dot(dst, mu.data(), D);
        if (k.s8) {  // int8 query: round(r / step), step = max |r| / 127 (round half to even, as the SIMD convert)
          float amax = 0;
          for (int64_t i = 0; i < D; ++i) amax = std::max(amax, std::abs(static_cast<float>(r[i])));
          const float step = amax > 0 ? amax / 127.0f : 1.0f;
          int8_t* o = c.q8.data() + (bh * M + m) * D;
          int32_t sum = 0;
          for (int64_t i = 0; i < D; ++i) {
            o[i] = static_cast<int8_t>(std::nearbyint(static_cast<float>(r[i]) / step));
            sum += o[i];
          }
          c.q8step[bh * M + m] = step * k.cb8_scale;
          c.q8sum[bh * M + m] = sum;
        }
        if (k.s16) {  // int16 query: round(r / step), step = max |r| / Q16 (pcaq: in the order its tiles read)
          float amax = 0;
          for (int64_t i = 0; i < D; ++i) amax = std::max(amax, std::abs(static_cast<float>(r[i])));
          const float step = amax > 0 ? amax / static_cast<float>(Q16) : 1.0f;
          int16_t* o = c.q16.data() + (bh * M + m) * D;
          const bool pq = k.kind == PCAQ;
          for (int64_t i = 0; i < D; ++i)
            o[i] = static_cast<int16_t>(std::nearbyint(static_cast<float>(r[pq ? k.pq_pos[i] : i]) / step));
          if (pq) {  // lo: the remainder in steps PQ_LO_SPLIT times finer (|lo| <= PQ_LO_SPLIT / 2 + rounding)
            int16_t* ol = o + B * H * M * D;
            const float fine = step / static_cast<float>(PQ_LO_SPLIT);
            for (int64_t i = 0; i < D; ++i) {
              const float rem = static_cast<float>(r[k.pq_pos[i]]) - static_cast<float>(o[i]) * step;
              const int32_t v = static_cast<int32_t>(std::nearbyint(rem / fine));
              ol[i] = static_cast<int16_t>(std::max(-Q16, std::min(Q16, v)));
            }
          }
          c.q16step[bh * M + m] = step * (pq ? k.pq_scale[lh] : k.cb16_scale);
        }
      }
    }
  });
}

// One thread's buffers: a block's scores, and a tile of decoded rows with their scales and domains.
template <typename T>
struct Scratch {
  std::vector<T> sbuf, tbuf;
  const T* rows[TILE];
  T tscale[TILE];
  bool trot[TILE];
  int64_t tld;
  Scratch(int64_t M, int64_t blk_max, int64_t tld_) : sbuf(M * blk_max), tbuf(TILE * tld_), tld(tld_) {}
};

// Scores of one item's rows, a tile at a time: decode (or point at) 16 rows, then every query of the KV head;
// then the soft-cap and the mask (or causal over the last L rows).
template <typename T>
void item_scores(const Call<T>& c, const Item& I, Scratch<T>& w, int64_t n) {
  const Seq& S = c.seqs[I.s];
  const Side<T>& Ks = c.kside(I.s, I.h);
  const int64_t b = S.row, h = c.local(I.s, I.h), t0 = I.t0, M = c.M, blk = n, bh = I.s * c.H + I.h;
  const T* qb = c.qs.data() + bh * M * c.D;
  const T* qrb = c.qr.empty() ? nullptr : c.qr.data() + bh * M * c.D;
  const T* qmb = (c.qmu.empty() || !Ks.mu) ? nullptr : c.qmu.data() + bh * M;
  for (int64_t i0 = 0; i0 < n; i0 += TILE) {
    const int64_t nt = std::min(TILE, n - i0);
    if (Ks.s16 && Ks.kind == PCAQ &&
        pcaq_tile16(Ks, b, h, t0 + i0, nt, c.q16.data() + bh * M * c.D, c.q16.data() + (c.NS * c.H + bh) * M * c.D,
                    c.q16step.data() + bh * M, qmb, M, w.sbuf.data() + i0, blk))
      continue;
    if (Ks.s16 && Ks.kind == TURBO &&
        turbo_tile16(Ks, b, h, t0 + i0, nt, c.q16.data() + bh * M * c.D, c.q16step.data() + bh * M, qmb, M,
                     w.sbuf.data() + i0, blk))
      continue;
    if (Ks.s8 && turbo_tile8(Ks, b, h, t0 + i0, nt, c.q8.data() + bh * M * c.D, c.q8step.data() + bh * M,
                             c.q8sum.data() + bh * M, qmb, M, w.sbuf.data() + i0, blk))
      continue;
    if (qrb && turbo_tile(Ks, true, b, h, t0 + i0, nt, qrb, qmb, static_cast<const T*>(nullptr), blk, M,
                          w.sbuf.data() + i0, static_cast<T*>(nullptr), static_cast<T*>(nullptr)))
      continue;
    if (!fetch_tile_turbo(Ks, b, h, t0 + i0, nt, w.tbuf.data(), w.tld, w.rows, w.tscale, w.trot)) {
      for (int64_t j = 0; j < nt; ++j) {
        bool r;
        w.rows[j] = fetch_row(Ks, b, h, t0 + i0 + j, w.tbuf.data() + j * w.tld, w.tscale[j], r);
        w.trot[j] = r;
      }
    }
    tile_scores<T>(w.rows, w.tscale, w.trot, nt, qb, qrb, qmb, M, c.D, w.sbuf.data() + i0, blk);
  }
  const T NEG = -std::numeric_limits<T>::infinity();
  if (c.cap > 0) {
    for (int64_t m = 0; m < M; ++m)
      for (int64_t i = 0; i < n; ++i) w.sbuf[m * blk + i] = c.cap * std::tanh(w.sbuf[m * blk + i] / c.cap);
  }
  if (S.mask || (c.L > 1 && S.causal)) {
    for (int64_t m = 0; m < M; ++m) {
      const int64_t l = m % c.L;
      T* sc = w.sbuf.data() + m * blk;
      if (S.mask) {
        const bool* row = S.mask + l * S.m_l;
        for (int64_t i = 0; i < n; ++i)
          if (!row[(t0 + i) * S.m_t]) sc[i] = NEG;
      } else {
        for (int64_t i = std::max<int64_t>(0, S.total - c.L + l + 1 - t0); i < n; ++i) sc[i] = NEG;
      }
    }
  }
}

// The block's softmax partial per query: max, sum of exp(s - max); the scores become the exp weights.
template <typename T>
void item_softmax(const Call<T>& c, Scratch<T>& w, int64_t n, T* mx, T* sm) {
  const T NEG = -std::numeric_limits<T>::infinity();
  for (int64_t m = 0; m < c.M; ++m) {
    T* sc = w.sbuf.data() + m * n;
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
}

// Values, a tile at a time; rows no query weighs (masked, or below the Sparse-V threshold) are not read.
template <typename T>
void item_values(const Call<T>& c, const Item& I, Scratch<T>& w, int64_t n, const T* sm, T* accD, T* accP, T* ps,
                 int64_t& visited, int64_t& skipped) {
  const Seq& S = c.seqs[I.s];
  const Side<T>& Vs = c.vside(I.s, I.h);
  const int64_t b = S.row, h = c.local(I.s, I.h), t0 = I.t0, M = c.M, blk = n, Dv = c.Dv;
  const bool dense_all = c.thr <= 0 && S.mask == nullptr && (c.L == 1 || !S.causal);
  for (int64_t i0 = 0; i0 < n; i0 += TILE) {
    const int64_t nt = std::min(TILE, n - i0);
    if (dense_all && turbo_tile(Vs, false, b, h, t0 + i0, nt, static_cast<const T*>(nullptr),
                                static_cast<const T*>(nullptr), w.sbuf.data() + i0, blk, M, static_cast<T*>(nullptr),
                                accP, ps)) {
      visited += nt;
      continue;
    }
    if (dense_all && fetch_tile_turbo(Vs, b, h, t0 + i0, nt, w.tbuf.data(), w.tld, w.rows, w.tscale, w.trot)) {
      visited += nt;
      tile_values<T>(w.rows, w.tscale, w.trot, nt, w.sbuf.data() + i0, blk, M, Dv, accD, accP, ps);
      continue;
    }
    for (int64_t j = 0; j < nt; ++j) {
      const int64_t i = i0 + j;
      if (dense_all) {  // no mask, no Sparse-V: every row carries weight (a row whose weights underflow adds 0)
        bool r;
        w.rows[j] = fetch_row(Vs, b, h, t0 + i, w.tbuf.data() + j * w.tld, w.tscale[j], r);
        w.trot[j] = r;
        visited += 1;
        continue;
      }
      bool any = false, keep = false;
      for (int64_t m = 0; m < M; ++m) {
        const T p = w.sbuf[m * blk + i];
        if (p > 0) {
          any = true;
          if (c.thr <= 0 || p >= c.thr * sm[m]) keep = true;
        }
      }
      w.rows[j] = nullptr;
      w.trot[j] = false;
      if (!any) continue;
      visited += 1;
      if (!keep) {
        skipped += 1;
        continue;
      }
      bool r;
      w.rows[j] = fetch_row(Vs, b, h, t0 + i, w.tbuf.data() + j * w.tld, w.tscale[j], r);
      w.trot[j] = r;
    }
    tile_values<T>(w.rows, w.tscale, w.trot, nt, w.sbuf.data() + i0, blk, M, Dv, accD, accP, ps);
  }
}

// Merge the blocks of every (query row, KV head), its tier's too: log-sum-exp over block partials (+ the sink
// logit), then each V side's transformed-domain sum back to the row domain (+ p * mu for centred values).
template <typename T>
torch::Tensor merge_blocks(const Call<T>& c, const torch::Tensor& query, const std::vector<T>& part,
                           int64_t pstride, std::vector<int64_t>& first) {
  const int64_t B = c.B, H = c.H, M = c.M, Dv = c.Dv, L = c.L, G = c.G;
  const int64_t nitems = static_cast<int64_t>(c.items.size());
  const T NEG = -std::numeric_limits<T>::infinity();
  torch::Tensor out = torch::zeros({B, c.Hq, L, Dv}, query.options());
  T* op = out.data_ptr<T>();
  first.assign(c.NS * H + 1, 0);
  for (int64_t it = 0; it < nitems; ++it) first[c.items[it].s * H + c.items[it].h + 1] = it + 1;
  for (int64_t i = 1; i <= c.NS * H; ++i) first[i] = std::max(first[i], first[i - 1]);
  at::parallel_for(0, B * H, 1, [&](int64_t begin, int64_t end) {
    std::vector<T> pp(2 * Dv), mu(2 * Dv);
    for (int64_t bh = begin; bh < end; ++bh) {
      const int64_t s = bh / H, h = bh % H, s2 = c.seqs[s].tier;
      const int64_t nseg = s2 < 0 ? 1 : 2, segs[2] = {s, s2};
      for (int64_t g = 0; g < nseg; ++g) {
        const Side<T>& v = c.vside(segs[g], h);
        if (v.mu) half_to(v.mu + c.seqs[segs[g]].row * v.mu_b + c.local(segs[g], h) * v.mu_h, Dv, mu.data() + g * Dv);
      }
      for (int64_t m = 0; m < M; ++m) {
        T big = NEG;
        for (int64_t g = 0; g < nseg; ++g) {
          const int64_t k0 = first[segs[g] * H + h], k1 = first[segs[g] * H + h + 1];
          for (int64_t k = k0; k < k1; ++k) big = std::max(big, part[k * pstride + m]);
        }
        const T sink = c.sinkp ? c.sinkp[h * G + m / L] : NEG;
        big = std::max(big, sink);
        if (big == NEG) continue;  // nothing to attend: zeros, as SDPA gives for fully masked rows
        T denom = c.sinkp ? std::exp(sink - big) : T(0);
        T* d = op + (bh * M + m) * Dv;
        std::fill(pp.begin(), pp.end(), T(0));
        T pssum[2] = {0, 0};
        for (int64_t g = 0; g < nseg; ++g) {
          const int64_t k0 = first[segs[g] * H + h], k1 = first[segs[g] * H + h + 1];
          for (int64_t k = k0; k < k1; ++k) {
            const T* P = part.data() + k * pstride;
            if (P[m] == NEG) continue;
            const T w = std::exp(P[m] - big);
            denom += w * P[M + m];
            pssum[g] += w * P[2 * M + m];
            axpy(w, P + 3 * M + m * Dv, d, Dv);
            axpy(w, P + 3 * M + M * Dv + m * Dv, pp.data() + g * Dv, Dv);
          }
        }
        const T inv = denom > 0 ? T(1) / denom : T(0);
        for (int64_t j = 0; j < Dv; ++j) d[j] *= inv;
        for (int64_t g = 0; g < nseg; ++g) {  // each V side back from its own domain
          const int64_t sg = segs[g], lh = c.local(sg, h);
          const Side<T>& v = c.vside(sg, h);
          if (!transformed(v.kind)) continue;
          const T* rot = v.rot + lh * v.rot_h;
          const T* pg = pp.data() + g * Dv;
          for (int64_t i = 0; i < Dv; ++i)
            if (pg[i] != 0) axpy(pg[i] * inv, rot + (v.order.empty() ? i : v.order[i]) * Dv, d, Dv);
          if (v.mu) axpy(pssum[g] * inv, mu.data() + g * Dv, d, Dv);
        }
      }
    }
  });
  return out;
}

// Every transient byte of the call: queries (scaled, transformed, q.mu), partials, per-thread scores + decoded
// tile rows, per-thread query-centring and merge rows, per-sequence counts, stores, tables and decode orders.
template <typename T>
int64_t workspace_bytes(const Call<T>& c, int64_t part_size, int64_t counts, int64_t first_size) {
  const int64_t nitems = static_cast<int64_t>(c.items.size());
  const int64_t used = std::min(c.threads, std::max<int64_t>(nitems, 1));
  const int64_t used_bh = std::min(c.threads, c.NS * c.H);  // threads of the query pass and of the merge
  const int64_t tld = std::max(c.D, c.Dv);
  int64_t ws = static_cast<int64_t>(c.qs.size() + c.qr.size() + c.qmu.size() + part_size) * sizeof(T);
  ws += static_cast<int64_t>(c.q16.size() * sizeof(int16_t) + c.q8.size() +  // integer-scored keys' queries
                             (c.q16step.size() + c.q8step.size() + c.q8sum.size()) * 4);
  ws += (counts + first_size) * static_cast<int64_t>(sizeof(int64_t));
  ws += nitems * static_cast<int64_t>(sizeof(Item)) + c.NS * static_cast<int64_t>(sizeof(Seq));
  for (const auto& st : c.stores)
    ws += static_cast<int64_t>(sizeof(Store) + (st.side_of.size() + st.local.size()) * sizeof(int32_t));
  ws += used * (c.M * c.blk_max + TILE * tld) * static_cast<int64_t>(sizeof(T));  // sbuf + tbuf per thread
  ws += used_bh * c.D * static_cast<int64_t>(sizeof(T));                          // the query pass's mu row
  ws += used_bh * 4 * c.Dv * static_cast<int64_t>(sizeof(T));                     // the merge's pp and mu rows (2 each)
  for (const auto* sides : {&c.K, &c.V})
    for (const auto& s : *sides)
      ws += static_cast<int64_t>(sizeof(Side<T>) + (s.btab.size() + s.plev.size()) * sizeof(T) +
                                 (s.order.size() + s.pbyte.size() + s.pshift.size() + s.pmask.size() +
                                  s.plev_at.size() + s.pq_pos.size() + s.pq_scale.size()) * sizeof(int32_t) +
                                 s.pq.size() * sizeof(PqChunk) + s.pq_tab.size() + s.pq_wmask.size() * sizeof(uint64_t));
  return ws;
}

template <typename T>
AttendResult attend_impl(const torch::Tensor& query, double qscale, const std::vector<SideDesc>& kd,
                         const std::vector<SideDesc>& vd, const std::vector<std::optional<torch::Tensor>>& masks,
                         double softcap, const std::optional<torch::Tensor>& sinks, double sparse_v,
                         const std::vector<int64_t>& merge_into) {
  const at::ScalarType dt = c10::CppTypeToScalarType<T>::value;
  Call<T> c;
  read_stores(c, query, kd, vd, masks, merge_into);
  if (sinks.has_value()) {
    const auto& s = *sinks;
    TORCH_CHECK(s.device().is_cpu() && s.scalar_type() == dt && s.dim() == 1 && s.size(0) == c.Hq && s.is_contiguous(),
                "sinks must be a contiguous CPU ", c10::toString(dt), " vector of ", c.Hq,
                " logits (one per query head), got ", c10::toString(s.scalar_type()), " ", s.sizes());
    c.sinkp = s.data_ptr<T>();
  }
  TORCH_CHECK(softcap >= 0 && std::isfinite(softcap), "softcap must be a finite number >= 0 (0 = off), got ", softcap);
  TORCH_CHECK(sparse_v >= 0 && sparse_v < 1, "sparse_v must be a softmax-weight threshold in [0, 1), got ", sparse_v);
  TORCH_CHECK(std::isfinite(qscale), "scale must be finite, got ", qscale);
  c.cap = static_cast<T>(softcap);
  c.thr = static_cast<T>(sparse_v);
  split_work(c);
  prepare_queries(c, query, qscale);

  // partials per item: max[M], sum[M], psum_rot[M], accD[M][Dv], accP[M][Dv]
  const int64_t M = c.M, Dv = c.Dv, nitems = static_cast<int64_t>(c.items.size());
  const int64_t pstride = 3 * M + 2 * M * Dv;
  std::vector<T> part(nitems * pstride);
  std::vector<int64_t> skipped(nitems, 0), visited(nitems, 0);
  const T NEG = -std::numeric_limits<T>::infinity();
  at::parallel_for(0, nitems, 1, [&](int64_t begin, int64_t end) {
    Scratch<T> w(M, c.blk_max, std::max(c.D, Dv));
    for (int64_t it = begin; it < end; ++it) {
      const Item& I = c.items[it];
      const int64_t n = I.t1 - I.t0;
      T* P = part.data() + it * pstride;
      T *mx = P, *sm = P + M, *ps = P + 2 * M, *accD = P + 3 * M, *accP = accD + M * Dv;
      std::fill(P, P + pstride, T(0));
      for (int64_t m = 0; m < M; ++m) mx[m] = NEG;
      if (n <= 0) continue;
      item_scores(c, I, w, n);
      item_softmax(c, w, n, mx, sm);
      item_values(c, I, w, n, sm, accD, accP, ps, visited[it], skipped[it]);
    }
  });
  std::vector<int64_t> first;
  torch::Tensor out = merge_blocks(c, query, part, pstride, first);
  std::vector<int64_t> sk(c.B, 0), vi(c.B, 0);  // per query row (a tier's rows count with its owner's)
  for (int64_t i = 0; i < nitems; ++i) {
    sk[c.seqs[c.items[i].s].qrow] += skipped[i];
    vi[c.seqs[c.items[i].s].qrow] += visited[i];
  }
  const int64_t counts = static_cast<int64_t>(skipped.size() + visited.size() + sk.size() + vi.size());
  return {out, sk, vi, workspace_bytes(c, static_cast<int64_t>(part.size()), counts,
                                       static_cast<int64_t>(first.size()))};
}

AttendResult attend(const torch::Tensor& query, double scale, const std::vector<SideDesc>& k_sides,
                    const std::vector<SideDesc>& v_sides, const std::vector<std::optional<torch::Tensor>>& masks,
                    double softcap, const std::optional<torch::Tensor>& sinks, double sparse_v,
                    const std::vector<int64_t>& merge_into) {
  TORCH_CHECK(query.device().is_cpu(), "query must be a CPU tensor, got one on ", query.device());
  TORCH_CHECK(query.dim() == 4, "query must be 4-D [batch, q_heads, tokens, head_dim], got shape ", query.sizes());
  TORCH_CHECK(query.numel() > 0, "query is empty: shape ", query.sizes());
  TORCH_CHECK(!k_sides.empty(), "k_sides is empty: give one side per store");
  TORCH_CHECK(k_sides.size() == v_sides.size(), "k_sides has ", k_sides.size(), " sides, v_sides has ", v_sides.size());
  if (query.scalar_type() == torch::kFloat)
    return attend_impl<float>(query, scale, k_sides, v_sides, masks, softcap, sinks, sparse_v, merge_into);
  TORCH_CHECK(query.scalar_type() == torch::kDouble, "query must be float32 or float64, got ",
              c10::toString(query.scalar_type()));
  return attend_impl<double>(query, scale, k_sides, v_sides, masks, softcap, sinks, sparse_v, merge_into);
}

}  // namespace
