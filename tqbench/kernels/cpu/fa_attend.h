// fa_attend.h: `attend`: the batch's queries over every sequence's store (checks, the split into
// work items, the query pass, the block pass, the merge).

#pragma once

#include "fa_rules.h"
#include "fa_decode.h"
#include "fa_tiles.h"
#include "fa_turbo_tiles.h"
#include "fa_sides.h"

namespace {

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
