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
  const at::Half* z = nullptr;  // affine: zero, same shape as scale
  int64_t z_b = 0, z_h = 0, z_r = 0;
  const T* lut = nullptr;   // value of each code: turbo codebook, or 0..2^bits-1 for affine
  const T* btab = nullptr;  // [256][per_byte] decoded values of every byte (bits 1, 2, 4, 8)
  int64_t per_byte = 0;
  const T* dense = nullptr;  // dense rows [B, H, Nd, D]
  int64_t d_b = 0, d_h = 0, d_r = 0;
};

// codes of one row -> lut values (n codes starting at bit `bitoff` of p)
template <typename T>
inline void decode_codes(const Side<T>& s, const uint8_t* p, int64_t bitoff, int64_t n, T* out) {
  const int64_t bits = s.bits;
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

// Row `t` (store order) of one side for (b, h): a pointer to D values, `scale` (turbo norm, else 1) and
// whether it lives in the rotated domain (turbo packed rows).
template <typename T>
inline const T* fetch_row(const Side<T>& s, int64_t b, int64_t h, int64_t t, T* buf, T& scale, bool& rot) {
  scale = T(1);
  rot = false;
  if (t < s.nb || t >= s.nb + s.np) {
    const int64_t r = t < s.nb ? t : t - s.np;
    return s.dense + b * s.d_b + h * s.d_h + r * s.d_r;
  }
  const int64_t n = t - s.nb;
  const int64_t D = s.D;
  if (s.kind == TURBO) {
    decode_codes(s, s.codes + b * s.c_b + h * s.c_h + n * s.c_r, 0, D, buf);
    scale = static_cast<T>(static_cast<float>(s.a[b * s.a_b + h * s.a_h + n * s.a_r]));
    rot = true;
    return buf;
  }
  if (s.kind == AFFINE_TOKEN) {
    decode_codes(s, s.codes + b * s.c_b + h * s.c_h + n * s.c_r, 0, D, buf);
    const at::Half* sc = s.a + b * s.a_b + h * s.a_h + n * s.a_r;
    const at::Half* ze = s.z + b * s.z_b + h * s.z_h + n * s.z_r;
    const int64_t gs = s.group;
    for (int64_t g = 0; g < D / gs; ++g) {
      const T a = static_cast<T>(static_cast<float>(sc[g])), z = static_cast<T>(static_cast<float>(ze[g]));
      for (int64_t j = g * gs; j < (g + 1) * gs; ++j) buf[j] = buf[j] * a + z;
    }
    return buf;
  }
  // AFFINE_CHANNEL (KIVI): blocks of `group` tokens, token-major codes, scale/zero per (block, channel)
  const int64_t u = n / s.group, k = n % s.group;
  decode_codes(s, s.codes + b * s.c_b + h * s.c_h + u * s.c_r, k * D * s.bits, D, buf);
  const at::Half* sc = s.a + b * s.a_b + h * s.a_h + u * s.a_r;
  const at::Half* ze = s.z + b * s.z_b + h * s.z_h + u * s.z_r;
  for (int64_t j = 0; j < D; ++j)
    buf[j] = buf[j] * static_cast<T>(static_cast<float>(sc[j])) + static_cast<T>(static_cast<float>(ze[j]));
  return buf;
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
  TORCH_CHECK(a.scalar_type() == torch::kHalf && a.dim() == 4 && a.stride(3) == 1, "norm/scale must be fp16");
  s.a = a.data_ptr<at::Half>();
  s.a_b = a.stride(0);
  s.a_h = a.stride(1);
  s.a_r = a.stride(2);
  if (kind != TURBO) {
    TORCH_CHECK(z.scalar_type() == torch::kHalf && z.dim() == 4 && z.stride(3) == 1, "zero must be fp16");
    s.z = z.data_ptr<at::Half>();
    s.z_b = z.stride(0);
    s.z_h = z.stride(1);
    s.z_r = z.stride(2);
    if (kind == AFFINE_TOKEN) TORCH_CHECK(D % s.group == 0, "affine-token: head_dim must be a multiple of group");
  }
  TORCH_CHECK(lut.is_contiguous() && lut.numel() == (int64_t(1) << bits), "lut must hold 2**bits values");
  s.lut = lut.data_ptr<T>();
  if (btab.defined() && btab.numel() > 0) {
    TORCH_CHECK(btab.is_contiguous() && btab.numel() % 256 == 0, "byte table must be [256, per_byte]");
    s.btab = btab.data_ptr<T>();
    s.per_byte = btab.numel() / 256;
  }
  return s;
}

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
  const T NEG = -std::numeric_limits<T>::infinity();

  const int64_t nblk = std::max<int64_t>(1, std::min<int64_t>(blocks_per_head, (total + 31) / 32));
  const int64_t blk = (total + nblk - 1) / nblk;
  const int64_t items = B * H * nblk;
  // partials per item: max[M], sum[M], psum_rot[M], accD[M][Dv], accP[M][Dv]
  const int64_t pstride = 3 * M + 2 * M * Dv;
  std::vector<T> part(items * pstride);
  std::vector<int64_t> skipped(items, 0), visited(items, 0);

  at::parallel_for(0, items, 1, [&](int64_t begin, int64_t end) {
    std::vector<T> sbuf(M * blk), kbuf(D), vbuf(Dv), kscale(blk);
    std::vector<char> krot(blk);
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
      // scores
      for (int64_t i = 0; i < n; ++i) {
        const int64_t t = t0 + i;
        T scale;
        bool rot;
        const T* kr = fetch_row(K, b, h, t, kbuf.data(), scale, rot);
        for (int64_t m = 0; m < M; ++m) {
          T s = rot ? scale * dot(qrb + m * D, kr, D) + (qmb ? qmb[m] : T(0)) : dot(qb + m * D, kr, D);
          if (cap > 0) s = cap * std::tanh(s / cap);
          const int64_t l = m % seq;
          if (mp) {
            if (!mp[b * m_b + l * m_l + t * m_t]) s = NEG;
          } else if (seq > 1 && t > total - seq + l) {
            s = NEG;
          }
          sbuf[m * blk + i] = s;
        }
      }
      for (int64_t m = 0; m < M; ++m) {
        T* s = sbuf.data() + m * blk;
        T mm = NEG;
        for (int64_t i = 0; i < n; ++i) mm = std::max(mm, s[i]);
        mx[m] = mm;
        T acc = 0;
        if (mm == NEG) {
          for (int64_t i = 0; i < n; ++i) s[i] = 0;
        } else {
          for (int64_t i = 0; i < n; ++i) {
            s[i] = std::exp(s[i] - mm);
            acc += s[i];
          }
        }
        sm[m] = acc;
      }
      // values
      for (int64_t i = 0; i < n; ++i) {
        const int64_t t = t0 + i;
        bool any = false, keep = false;
        for (int64_t m = 0; m < M; ++m) {
          const T p = sbuf[m * blk + i];
          if (p > 0) any = true;
          if (p > 0 && (thr <= 0 || p >= thr * sm[m])) keep = true;
        }
        if (!any) continue;
        visited[it] += 1;
        if (!keep) {
          skipped[it] += 1;
          continue;
        }
        T scale;
        bool rot;
        const T* vr = fetch_row(V, b, h, t, vbuf.data(), scale, rot);
        for (int64_t m = 0; m < M; ++m) {
          const T p = sbuf[m * blk + i];
          if (p == 0) continue;
          if (rot) {
            axpy(p * scale, vr, accP + m * Dv, Dv);
            ps[m] += p;
          } else {
            axpy(p, vr, accD + m * Dv, Dv);
          }
        }
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

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("attend", &attend, "fused decode attention over packed + dense KV rows (CPU)");
}
