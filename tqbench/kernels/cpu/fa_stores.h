// fa_stores.h: the call's stores read from the caller's sides (every size checked, with its name): which side
// holds each KV head of each store, every sequence's rows and mask, and the state the passes share (`Call`).
//
// A store may be another store's tier (`merge_into`): rows of a cheaper codec that the other store's queries
// attend in the same softmax, before its own rows (a demote tier: evicted rows kept at a cheaper codec). A tier's
// sequences read their owner's query rows, their block partials merge with the owner's (each V side rotated back
// in its own domain), and without a mask every tier row is visible to every query (its rows precede the call's).

#pragma once

#include "fa_rules.h"
#include "fa_sides.h"

namespace {

// One store (one padded batch of sequences, or one sequence of a ragged batch): a whole-store side, or one side
// per group of heads (a per-head layer: each group its own codec, the way each sequence has its own store).
struct Store {
  int64_t Bs = 0, total = 0;
  std::vector<int32_t> side_of, local;  // per KV head: the side (index into K / V) holding it, its head there
  int64_t into = -1;       // a tier: the store whose queries it serves (merge_into); -1: its own query rows
  int64_t tier = -1;       // the store that is this store's tier, or -1
  int64_t first_seq = 0;   // its first sequence in Call::seqs
  int64_t first_side = 0;  // its first side in K / V
};

struct Seq {
  int64_t store, row, total;
  const bool* mask;
  int64_t m_l, m_t;
  int64_t qrow;       // the query batch row it reads (and, for a tier, whose output it adds to)
  int64_t tier;       // an owner: the sequence of its tier, or -1
  bool causal;        // no mask: causal over the last L rows (an owner), or every row visible (a tier)
};

struct Item {
  int64_t s, h, t0, t1;
};

// What the passes of one call share.
template <typename T>
struct Call {
  int64_t B = 0, Hq = 0, L = 0, D = 0, H = 0, G = 0, M = 0, Dv = 0;
  int64_t NS = 0;  // sequences: the B query rows' own (first, as query row b), then the tiers'
  std::vector<Side<T>> K, V;
  std::vector<Store> stores;
  std::vector<Seq> seqs;
  std::vector<Item> items;
  int64_t blk_max = 1, threads = 1;
  std::vector<T> qs, qr, qmu;  // queries: scaled [seq, kv head, M, D]; transformed (same shape); q.mu [.., M]
  // 8-bit scoring (keys with s8): the transformed query as int8 [seq, kv head, M, D], its step times the
  // codebook's [.., M], and the sum of its int8 values [.., M] (removes the codebook's +128 offset)
  std::vector<int8_t> q8;
  std::vector<float> q8step;
  std::vector<int32_t> q8sum;
  // 16-bit scoring (keys with s16): the transformed query as int16 [seq, kv head, M, D]; its step times the codebook's
  std::vector<int16_t> q16;
  std::vector<float> q16step;
  const T* sinkp = nullptr;
  T cap = 0, thr = 0;

  const Store& store(int64_t s) const { return stores[seqs[s].store]; }
  const Side<T>& kside(int64_t s, int64_t h) const { return K[store(s).side_of[h]]; }
  const Side<T>& vside(int64_t s, int64_t h) const { return V[store(s).side_of[h]]; }
  int64_t local(int64_t s, int64_t h) const { return store(s).local[h]; }  // the head within its side
};

// The sides of one store starting at side i: one whole-store side, or the groups of heads that partition its
// KV heads (consecutive sides, each naming its heads and the store's kv_heads). Returns the next side's index.
template <typename T>
size_t read_store(Call<T>& c, const std::vector<SideDesc>& kd, const std::vector<SideDesc>& vd, size_t i) {
  const int64_t H = c.H;
  Store st;
  st.first_side = static_cast<int64_t>(i);
  st.side_of.assign(H, -1);
  st.local.assign(H, -1);
  const size_t first = i;
  int64_t covered = 0;
  while (covered < H) {
    const std::string kn = "k_sides[" + std::to_string(i) + "]", vn = "v_sides[" + std::to_string(i) + "]";
    TORCH_CHECK(i < kd.size(), "k_sides[", first, "..", i - 1, "] hold ", covered, " of their store's ", H,
                " kv heads: the sides end before the store's groups of heads do");
    const SideDesc& k = kd[i];
    const SideDesc& v = vd[i];
    TORCH_CHECK(k.heads == v.heads && k.kv_heads == v.kv_heads, vn, " holds other heads than ", kn,
                " (K and V of a store are grouped alike)");
    const bool whole = k.heads.empty();
    TORCH_CHECK(!whole || i == first, kn, " names no heads, but it follows a group of heads of the store that ",
                "k_sides[", first, "] starts (a group names its heads and kv_heads)");
    TORCH_CHECK(whole || k.kv_heads == H, kn, ".kv_heads is ", k.kv_heads, ", the call's stores have ", H,
                " kv heads");
    const int64_t nh = whole ? H : static_cast<int64_t>(k.heads.size());
    for (int64_t j = 0; j < nh; ++j) {
      const int64_t h = whole ? j : k.heads[j];
      TORCH_CHECK(h >= 0 && h < H, kn, ".heads names kv head ", h, ", outside 0..", H - 1);
      TORCH_CHECK(st.side_of[h] < 0, kn, ".heads names kv head ", h, ", which k_sides[", st.side_of[h],
                  "] of the same store already holds");
      st.side_of[h] = static_cast<int32_t>(i);
      st.local[h] = static_cast<int32_t>(j);
    }
    covered += nh;
    const int64_t Bs = side_batch(k, kn);
    TORCH_CHECK(side_batch(v, vn) == Bs, vn, " has batch ", side_batch(v, vn), ", ", kn, " has ", Bs);
    TORCH_CHECK(i == first || Bs == st.Bs, kn, " has batch ", Bs, ", the store's first group k_sides[", first,
                "] has ", st.Bs);
    TORCH_CHECK(k.head_dim == c.D, kn, ".head_dim is ", k.head_dim, ", the query's head_dim is ", c.D);
    TORCH_CHECK(v.head_dim == c.Dv, vn, ".head_dim is ", v.head_dim, ", v_sides[0].head_dim is ", c.Dv);
    c.K.push_back(build_side<T>(k, kn, nh, Bs));
    c.V.push_back(build_side<T>(v, vn, nh, Bs));
    const int64_t total = c.K.back().nd + c.K.back().np;
    TORCH_CHECK(c.V.back().nd + c.V.back().np == total, vn, " holds ", c.V.back().nd + c.V.back().np, " rows (",
                c.V.back().nd, " dense + ", c.V.back().np, " packed), ", kn, " holds ", total);
    TORCH_CHECK(i == first || total == st.total, kn, " holds ", total, " rows, the store's first group k_sides[",
                first, "] holds ", st.total);
    st.Bs = Bs;
    st.total = total;
    ++i;
  }
  c.stores.push_back(std::move(st));
  return i;
}

// Every store of the call, its sequences and their masks (one per store: bool [Bs | 1, L, rows], or None), and which
// stores are another's tier (merge_into: one entry per store, -1 or the owner's index; or none).
template <typename T>
void read_stores(Call<T>& c, const torch::Tensor& query, const std::vector<SideDesc>& kd,
                 const std::vector<SideDesc>& vd, const std::vector<std::optional<torch::Tensor>>& masks,
                 const std::vector<int64_t>& merge_into) {
  c.B = query.size(0);
  c.Hq = query.size(1);
  c.L = query.size(2);
  c.D = query.size(3);
  c.H = kd[0].heads.empty() ? side_heads(kd[0]) : kd[0].kv_heads;
  TORCH_CHECK(c.H >= 1, "k_sides[0] holds no rows");
  TORCH_CHECK(c.Hq % c.H == 0, "query has ", c.Hq, " heads, not a multiple of the ", c.H,
              " kv heads of k_sides[0]");
  c.G = c.Hq / c.H;
  c.M = c.G * c.L;
  c.Dv = vd[0].head_dim;
  for (size_t i = 0; i < kd.size();) i = read_store(c, kd, vd, i);
  const int64_t nst = static_cast<int64_t>(c.stores.size());
  TORCH_CHECK(masks.empty() || static_cast<int64_t>(masks.size()) == nst, "masks has ", masks.size(),
              " entries: give one per store (", nst, " here; None for causal over the last query tokens)", " or none");
  TORCH_CHECK(merge_into.empty() || static_cast<int64_t>(merge_into.size()) == nst, "merge_into has ",
              merge_into.size(), " entries: give one per store (", nst, " here; -1 for a store with its own query rows)",
              " or none");
  for (int64_t si = 0; si < nst && !merge_into.empty(); ++si) {
    const int64_t into = merge_into[si];
    if (into < 0) continue;
    const std::string nm = "merge_into[" + std::to_string(si) + "]";
    TORCH_CHECK(into < nst && into != si, nm, " is ", into, ": name another store (0..", nst - 1, ") or -1");
    TORCH_CHECK(merge_into[into] < 0, nm, " names store ", into, ", itself a tier of store ", merge_into[into],
                " (a tier serves a store with its own query rows)");
    TORCH_CHECK(c.stores[into].tier < 0, nm, " names store ", into, ", which store ", c.stores[into].tier,
                " is already a tier of (one tier per store)");
    TORCH_CHECK(c.stores[si].Bs == c.stores[into].Bs, nm, ": store ", si, " has batch ", c.stores[si].Bs, ", store ",
                into, " has ", c.stores[into].Bs, " (a tier has its owner's sequences)");
    c.stores[si].into = into;
    c.stores[into].tier = si;
  }
  int64_t nseq = 0;
  for (int pass = 0; pass < 2; ++pass) {  // the query rows' own stores first (sequence b reads query row b), then tiers
    for (int64_t si = 0; si < nst; ++si) {
      Store& st = c.stores[si];
      if ((st.into < 0) != (pass == 0)) continue;
      TORCH_CHECK(pass == 1 || st.total >= c.L, "k_sides[", st.first_side, "] holds ", st.total,
                  " rows, fewer than the query's ", c.L, " tokens");
      const bool* mp = nullptr;
      int64_t m_b = 0, m_l = 0, m_t = 0;
      if (!masks.empty() && masks[si].has_value()) {
        const auto& m = *masks[si];
        const std::string mn = "masks[" + std::to_string(si) + "]";
        TORCH_CHECK(m.device().is_cpu() && m.scalar_type() == torch::kBool, mn, " must be a bool CPU tensor, got ",
                    c10::toString(m.scalar_type()));
        TORCH_CHECK(m.dim() == 3 && (m.size(0) == st.Bs || m.size(0) == 1) && m.size(1) == c.L &&
                        m.size(2) == st.total,
                    mn, " must be [", st.Bs, ", ", c.L, ", ", st.total, "] (batch, query tokens, the store's rows), got ",
                    m.sizes());
        mp = m.data_ptr<bool>();
        m_b = m.size(0) == 1 ? 0 : m.stride(0);
        m_l = m.stride(1);
        m_t = m.stride(2);
      }
      st.first_seq = static_cast<int64_t>(c.seqs.size());
      for (int64_t r = 0; r < st.Bs; ++r) {
        const int64_t own = pass == 0 ? nseq + r : c.stores[st.into].first_seq + r;
        if (pass == 1) c.seqs[own].tier = static_cast<int64_t>(c.seqs.size());
        c.seqs.push_back({si, r, st.total, mp ? mp + r * m_b : nullptr, m_l, m_t, own, -1, pass == 0});
      }
      if (pass == 0) nseq += st.Bs;
    }
  }
  c.NS = static_cast<int64_t>(c.seqs.size());
  TORCH_CHECK(nseq == c.B, "query has batch ", c.B, ", the sides hold ", nseq, " sequences",
              c.NS > nseq ? " (besides their tiers)" : "");
}

}  // namespace
