// fa_encode.h: TurboQuant and calibrated (pcaq) quantize + pack of new rows (the append path).

#pragma once

#include "fa_rules.h"
#include "fa_tiles.h"

namespace {

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

// One 1-D / 2-D constant of the encode call: CPU, dtype dt, contiguous, the given sizes.
void check_const(const torch::Tensor& t, const char* nm, at::ScalarType dt, std::initializer_list<int64_t> sizes) {
  TORCH_CHECK(t.device().is_cpu(), nm, " must be a CPU tensor, got one on ", t.device());
  TORCH_CHECK(t.scalar_type() == dt, nm, " must be ", c10::toString(dt), " (the rows' dtype), got ",
              c10::toString(t.scalar_type()));
  TORCH_CHECK(t.sizes().equals(sizes), nm, " must have shape ", c10::IntArrayRef(sizes), ", got ", t.sizes());
  TORCH_CHECK(t.is_contiguous(), nm, " must be contiguous, got strides ", t.strides());
}

std::vector<torch::Tensor> turbo_encode(torch::Tensor x, torch::Tensor rotation, torch::Tensor levels,
                                        torch::Tensor bounds, int64_t bits, bool normfix) {
  TORCH_CHECK(x.device().is_cpu(), "x must be a CPU tensor, got one on ", x.device());
  TORCH_CHECK(x.dim() == 4, "x must be 4-D [batch, kv_heads, tokens, head_dim], got shape ", x.sizes());
  TORCH_CHECK(x.scalar_type() == torch::kFloat || x.scalar_type() == torch::kDouble,
              "x must be float32 or float64, got ", c10::toString(x.scalar_type()));
  TORCH_CHECK(x.is_contiguous(), "x must be contiguous, got strides ", x.strides());
  TORCH_CHECK(bits >= 1 && bits <= 8, "bits must be in 1..8, got ", bits);
  const int64_t B = x.size(0), H = x.size(1), T = x.size(2), D = x.size(3);
  TORCH_CHECK(D >= 1, "x has head_dim 0");
  const at::ScalarType dt = x.scalar_type();
  const int64_t nlev = int64_t(1) << bits;
  check_const(rotation, "rotation", dt, {D, D});
  check_const(levels, "levels", dt, {nlev});
  check_const(bounds, "bounds", dt, {nlev - 1});
  const int64_t nbytes = (D * bits + 7) / 8;
  auto codes = torch::empty({B, H, T, nbytes}, x.options().dtype(torch::kUInt8));
  auto norms = torch::empty({B, H, T, 1}, x.options().dtype(torch::kHalf));
  const int64_t rows = B * H * T;
  if (dt == torch::kFloat) {
    encode_rows<float>(x.data_ptr<float>(), rows, D, rotation.data_ptr<float>(), levels.data_ptr<float>(),
                       bounds.data_ptr<float>(), bounds.numel(), bits, normfix, codes.data_ptr<uint8_t>(), nbytes,
                       norms.data_ptr<at::Half>());
  } else {
    encode_rows<double>(x.data_ptr<double>(), rows, D, rotation.data_ptr<double>(), levels.data_ptr<double>(),
                        bounds.data_ptr<double>(), bounds.numel(), bits, normfix, codes.data_ptr<uint8_t>(), nbytes,
                        norms.data_ptr<at::Half>());
  }
  return {codes, norms};
}

// pcaq quantize + pack of new rows (the append path of calibrated keys): per row and head, z = E_h x (the rows are
// centred by the caller), code j = the number of bounds[h, j] strictly below z_j (bounds past 2**widths[h, j] - 1
// are +inf), packed LSB-first at the sum of the widths before it.
template <typename T>
void pcaq_encode_rows(const T* x, int64_t B, int64_t H, int64_t N, int64_t D, const T* E, const T* bounds,
                      int64_t nb, const uint8_t* widths, uint8_t* codes, int64_t nbytes) {
  at::parallel_for(0, B * H * N, 16, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const int64_t h = (r / N) % H;
      const T* xr = x + r * D;
      const uint8_t* w = widths + h * D;
      uint8_t* out = codes + r * nbytes;
      std::memset(out, 0, nbytes);
      int64_t bit = 0;
      for (int64_t j = 0; j < D; ++j) {
        const int64_t wj = w[j];
        if (wj == 0) continue;
        const T z = dot(E + (h * D + j) * D, xr, D);
        const T* bj = bounds + (h * D + j) * nb;
        int64_t k = 0;
        while (k < nb && bj[k] < z) ++k;
        const uint32_t c = static_cast<uint32_t>(std::min<int64_t>(k, (int64_t(1) << wj) - 1));
        out[bit >> 3] |= static_cast<uint8_t>(c << (bit & 7));
        if ((bit & 7) + wj > 8) out[(bit >> 3) + 1] |= static_cast<uint8_t>(c >> (8 - (bit & 7)));
        bit += wj;
      }
    }
  });
}

torch::Tensor pcaq_encode(torch::Tensor x, torch::Tensor transform, torch::Tensor bounds, torch::Tensor widths) {
  TORCH_CHECK(x.device().is_cpu(), "x must be a CPU tensor, got one on ", x.device());
  TORCH_CHECK(x.dim() == 4, "x must be 4-D [batch, kv_heads, tokens, head_dim], got shape ", x.sizes());
  TORCH_CHECK(x.scalar_type() == torch::kFloat || x.scalar_type() == torch::kDouble,
              "x must be float32 or float64, got ", c10::toString(x.scalar_type()));
  TORCH_CHECK(x.is_contiguous(), "x must be contiguous, got strides ", x.strides());
  const int64_t B = x.size(0), H = x.size(1), N = x.size(2), D = x.size(3);
  TORCH_CHECK(D >= 1 && D <= MAX_HEAD_DIM, "x has head_dim ", D, ", outside 1..", MAX_HEAD_DIM);
  const at::ScalarType dt = x.scalar_type();
  check_const(transform, "transform", dt, {H, D, D});
  TORCH_CHECK(bounds.dim() == 3 && bounds.size(2) >= 1, "bounds must be [", H, ", ", D,
              ", levels - 1] (per head and coordinate), got shape ", bounds.sizes());
  const int64_t nb = bounds.size(2);
  check_const(bounds, "bounds", dt, {H, D, nb});
  TORCH_CHECK(widths.device().is_cpu() && widths.scalar_type() == torch::kUInt8 && widths.is_contiguous() &&
                  widths.sizes().equals({H, D}),
              "widths must be a contiguous CPU uint8 [", H, ", ", D, "] tensor, got ",
              c10::toString(widths.scalar_type()), " ", widths.sizes());
  const uint8_t* wp = widths.data_ptr<uint8_t>();
  int64_t total = -1;
  for (int64_t h = 0; h < H; ++h) {
    int64_t bits = 0;
    for (int64_t j = 0; j < D; ++j) {
      TORCH_CHECK(wp[h * D + j] <= 8 && (int64_t(1) << wp[h * D + j]) - 1 <= nb, "widths[", h, ", ", j, "] is ",
                  int(wp[h * D + j]), ": above 8 bits or above what bounds' ", nb, " values cover");
      bits += wp[h * D + j];
    }
    TORCH_CHECK(total < 0 || bits == total, "widths: head ", h, " packs ", bits, " bits per row, head 0 packs ", total);
    total = bits;
  }
  const int64_t nbytes = (total + 7) / 8;
  auto codes = torch::empty({B, H, N, nbytes}, x.options().dtype(torch::kUInt8));
  if (dt == torch::kFloat)
    pcaq_encode_rows<float>(x.data_ptr<float>(), B, H, N, D, transform.data_ptr<float>(), bounds.data_ptr<float>(),
                            nb, wp, codes.data_ptr<uint8_t>(), nbytes);
  else
    pcaq_encode_rows<double>(x.data_ptr<double>(), B, H, N, D, transform.data_ptr<double>(),
                             bounds.data_ptr<double>(), nb, wp, codes.data_ptr<uint8_t>(), nbytes);
  return codes;
}

}  // namespace

namespace {

// A per-head layer's new rows in one call: x [B, H, T, D] holds every KV head of the layer (float32/float64); group
// g reads its heads `heads[g]` by their index in x, subtracts its centring mean `mus[g]` (fp16 [B, Hg, 1, D], or
// none) and quantizes + packs them with its own codec: kind "turbo" (tables: rotation [D, D], levels [2**bits],
// bounds [2**bits - 1]; `bits[g]`, `normfix[g]`) or "pcaq" (tables: transform [Hg, D, D], bounds [Hg, D, nb],
// widths uint8 [Hg, D]). Returns per group its fields: turbo {codes, norms}, pcaq {codes} (as turbo_encode /
// pcaq_encode return them for that group's rows).
std::vector<std::vector<torch::Tensor>> heads_encode(torch::Tensor x, std::vector<std::string> kinds,
                                                     std::vector<std::vector<int64_t>> heads,
                                                     std::vector<std::optional<torch::Tensor>> mus,
                                                     std::vector<std::vector<torch::Tensor>> tables,
                                                     std::vector<int64_t> bits, std::vector<bool> normfix) {
  TORCH_CHECK(x.device().is_cpu(), "x must be a CPU tensor, got one on ", x.device());
  TORCH_CHECK(x.dim() == 4, "x must be 4-D [batch, kv_heads, tokens, head_dim], got shape ", x.sizes());
  TORCH_CHECK(x.scalar_type() == torch::kFloat || x.scalar_type() == torch::kDouble,
              "x must be float32 or float64, got ", c10::toString(x.scalar_type()));
  TORCH_CHECK(x.is_contiguous(), "x must be contiguous, got strides ", x.strides());
  const size_t G = kinds.size();
  TORCH_CHECK(heads.size() == G && mus.size() == G && tables.size() == G && bits.size() == G && normfix.size() == G,
              "kinds, heads, mus, tables, bits and normfix must have one entry per group of heads (", G, " kinds)");
  const int64_t B = x.size(0), H = x.size(1), T = x.size(2), D = x.size(3);
  std::vector<bool> seen(H, false);
  std::vector<std::vector<torch::Tensor>> out;
  out.reserve(G);
  for (size_t g = 0; g < G; ++g) {
    const std::string gn = "group " + std::to_string(g);
    const auto& hs = heads[g];
    const int64_t Hg = static_cast<int64_t>(hs.size());
    TORCH_CHECK(Hg >= 1, gn, " names no heads");
    for (int64_t h : hs) {
      TORCH_CHECK(h >= 0 && h < H, gn, " names kv head ", h, ", outside 0..", H - 1);
      TORCH_CHECK(!seen[h], gn, " names kv head ", h, ", which an earlier group already holds");
      seen[h] = true;
    }
    // the group's rows, centred, in x's dtype (what the sub-codec's own encode computes before quantizing)
    auto xg = torch::empty({B, Hg, T, D}, x.options());
    const auto& mu = mus[g];
    if (mu.has_value()) {
      TORCH_CHECK(mu->device().is_cpu() && mu->scalar_type() == torch::kHalf && mu->is_contiguous() &&
                      mu->sizes().equals({B, Hg, 1, D}),
                  gn, ": mus must be a contiguous CPU float16 [", B, ", ", Hg, ", 1, ", D, "] tensor, got ",
                  c10::toString(mu->scalar_type()), " ", mu->sizes());
    }
    AT_DISPATCH_FLOATING_TYPES(x.scalar_type(), "heads_encode", [&] {
      const scalar_t* src = x.data_ptr<scalar_t>();
      scalar_t* dst = xg.data_ptr<scalar_t>();
      const at::Half* mp = mu.has_value() ? mu->data_ptr<at::Half>() : nullptr;
      for (int64_t b = 0; b < B; ++b)
        for (int64_t j = 0; j < Hg; ++j) {
          const scalar_t* s = src + ((b * H + hs[j]) * T) * D;
          scalar_t* d = dst + ((b * Hg + j) * T) * D;
          if (mp == nullptr) {
            std::memcpy(d, s, sizeof(scalar_t) * T * D);
            continue;
          }
          const at::Half* m = mp + (b * Hg + j) * D;
          for (int64_t t = 0; t < T; ++t)
            for (int64_t i = 0; i < D; ++i) d[t * D + i] = s[t * D + i] - static_cast<scalar_t>(static_cast<float>(m[i]));
        }
    });
    const auto& tb = tables[g];
    if (kinds[g] == "turbo") {
      TORCH_CHECK(tb.size() == 3, gn, ": a turbo group's tables are (rotation, levels, bounds), got ", tb.size());
      out.push_back(turbo_encode(xg, tb[0], tb[1], tb[2], bits[g], normfix[g]));
    } else if (kinds[g] == "pcaq") {
      TORCH_CHECK(tb.size() == 3, gn, ": a pcaq group's tables are (transform, bounds, widths), got ", tb.size());
      out.push_back({pcaq_encode(xg, tb[0], tb[1], tb[2])});
    } else {
      TORCH_CHECK(false, gn, ": kind must be turbo or pcaq, got ", kinds[g]);
    }
  }
  return out;
}

// heads_encode's per-group arguments held once (a store's codec and state stand for many steps): encode(x) then
// converts only x, not the tables, on every call.
struct HeadsEncoder {
  std::vector<std::string> kinds;
  std::vector<std::vector<int64_t>> heads;
  std::vector<std::optional<torch::Tensor>> mus;
  std::vector<std::vector<torch::Tensor>> tables;
  std::vector<int64_t> bits;
  std::vector<bool> normfix;
  std::vector<std::vector<torch::Tensor>> encode(torch::Tensor x) const {
    return heads_encode(std::move(x), kinds, heads, mus, tables, bits, normfix);
  }
};

}  // namespace
