// fa_encode.h: TurboQuant and calibrated (pcaq) quantize + pack of new rows (the append path).

#pragma once

#include "fa_rules.h"
#include "fa_tiles.h"

#include <array>
#include <type_traits>

namespace {

// TurboQuant quantize + pack of new rows (the append path): per row, norm, unit row rotated by R, codes by
// bucketize against the codebook's midpoints (index = number of bounds strictly below), least-squares norm
// correction onto the dequantized direction, LSB-first packing. Rows are centred by the caller.
// One centred row: its norm, the unit row rotated by R, codes by bucketize against the codebook's midpoints (index =
// number of bounds strictly below), the least-squares norm correction onto the dequantized direction, LSB-first
// packing into `out` (nbytes) and the fp16 norm into `norm`. `u` is scratch of D values.
template <typename T>
inline void encode_row(const T* xr, int64_t D, const T* R, const T* levels, const T* bounds, int64_t nb,
                       int64_t bits, bool normfix, T* u, uint8_t* out, int64_t nbytes, at::Half* norm_out) {
  T ss = 0;
  for (int64_t j = 0; j < D; ++j) ss += xr[j] * xr[j];
  const T n = std::sqrt(ss);
  const T nc = std::max(n, std::numeric_limits<T>::min());
  for (int64_t j = 0; j < D; ++j) u[j] = xr[j] / nc;
  T dotc = 0, cc = 0;
  std::memset(out, 0, nbytes);
  for (int64_t i = 0; i < D; ++i) {
    const T v = dot(R + i * D, u, D);
    int64_t k = 0;
    while (k < nb && bounds[k] < v) ++k;
    dotc += v * levels[k];
    cc += levels[k] * levels[k];
    const int64_t bit = i * bits;
    const uint8_t c = static_cast<uint8_t>(k);
    out[bit >> 3] |= static_cast<uint8_t>(c << (bit & 7));
    if ((bit & 7) + bits > 8) out[(bit >> 3) + 1] |= static_cast<uint8_t>(c >> (8 - (bit & 7)));
  }
  T norm = normfix ? n * dotc / cc : n;
  norm = std::min<T>(std::max<T>(norm, T(0)), T(65504));
  *norm_out = at::Half(static_cast<float>(norm));
}

// TurboQuant quantize + pack of new rows (the append path): `encode_row` per row. Rows are centred by the caller.
template <typename T>
void encode_rows(const T* x, int64_t rows, int64_t D, const T* R, const T* levels, const T* bounds, int64_t nb,
                 int64_t bits, bool normfix, uint8_t* codes, int64_t nbytes, at::Half* norms) {
  at::parallel_for(0, rows, 16, [&](int64_t r0, int64_t r1) {
    std::vector<T> u(D);
    for (int64_t r = r0; r < r1; ++r)
      encode_row(x + r * D, D, R, levels, bounds, nb, bits, normfix, u.data(), codes + r * nbytes, nbytes,
                 norms + r);
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
// One centred row of head h: z = E_h x, code j = the number of bounds[h, j] strictly below z_j (bounds past
// 2**widths[h, j] - 1 are +inf), packed LSB-first at the sum of the widths before it. `E`, `bounds`, `w` are head h's.
template <typename T>
inline void pcaq_encode_row(const T* xr, int64_t D, const T* E, const T* bounds, int64_t nb, const uint8_t* w,
                            uint8_t* out, int64_t nbytes) {
  std::memset(out, 0, nbytes);
  int64_t bit = 0;
  for (int64_t j = 0; j < D; ++j) {
    const int64_t wj = w[j];
    if (wj == 0) continue;
    const T z = dot(E + j * D, xr, D);
    const T* bj = bounds + j * nb;
    int64_t k = 0;
    while (k < nb && bj[k] < z) ++k;
    const uint32_t c = static_cast<uint32_t>(std::min<int64_t>(k, (int64_t(1) << wj) - 1));
    out[bit >> 3] |= static_cast<uint8_t>(c << (bit & 7));
    if ((bit & 7) + wj > 8) out[(bit >> 3) + 1] |= static_cast<uint8_t>(c >> (8 - (bit & 7)));
    bit += wj;
  }
}

// pcaq quantize + pack of new rows (the append path of calibrated keys): `pcaq_encode_row` per row and head (the
// rows are centred by the caller).
template <typename T>
void pcaq_encode_rows(const T* x, int64_t B, int64_t H, int64_t N, int64_t D, const T* E, const T* bounds,
                      int64_t nb, const uint8_t* widths, uint8_t* codes, int64_t nbytes) {
  at::parallel_for(0, B * H * N, 16, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const int64_t h = (r / N) % H;
      pcaq_encode_row(x + r * D, D, E + h * D * D, bounds + h * D * nb, nb, widths + h * D, codes + r * nbytes,
                      nbytes);
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
  // The decode step's append path: rows [start, start + n) of a store's row buffer `src` ([B, H, capacity, D], unit
  // last stride; float32 / float64, or 16-bit rows computed in float32 as the codecs' torch path computes them)
  // centred, quantized and packed row by row (`encode_row` / `pcaq_encode_row`, the arithmetic of `encode`) straight
  // into the packed buffers `dsts` (one per field, in the groups' field order: turbo codes, norms; pcaq codes; each
  // [B, Hg, capacity, width] with unit last stride) at row offset `offsets[i]` of each: no tensor is allocated.
  // What encode_into reads of one group, checked once per (compute dtype, batch, heads, head_dim): the tables stand
  // while the encoder does (it holds them), so a decode step checks only its rows and buffers.
  struct GroupPlan {
    bool turbo;
    int64_t Hg, nbytes, nb, bits;
    bool normfix;
    const int64_t* heads;
    const at::Half* mu;
    const void* t0;
    const void* t1;
    const void* t2;
    const uint8_t* widths;
  };
  mutable std::vector<GroupPlan> plans;
  mutable std::array<int64_t, 4> planned{-1, -1, -1, -1};  // (compute dtype, B, H, D) the plans were checked for

  void prepare(at::ScalarType cd, int64_t B, int64_t H, int64_t D) const {
    const std::array<int64_t, 4> key{static_cast<int64_t>(cd), B, H, D};
    if (key == planned) return;
    planned = {-1, -1, -1, -1};
    plans.clear();
    for (size_t g = 0; g < kinds.size(); ++g) {
      const std::string gn = "group " + std::to_string(g);
      const auto& hs = heads[g];
      const int64_t Hg = static_cast<int64_t>(hs.size());
      TORCH_CHECK(Hg >= 1, gn, " names no heads");
      for (int64_t h : hs) TORCH_CHECK(h >= 0 && h < H, gn, " names kv head ", h, ", outside 0..", H - 1);
      const auto& mu = mus[g];
      if (mu.has_value())
        TORCH_CHECK(mu->device().is_cpu() && mu->scalar_type() == torch::kHalf && mu->is_contiguous() &&
                        mu->sizes().equals({B, Hg, 1, D}),
                    gn, ": its centring mean must be a contiguous CPU float16 [", B, ", ", Hg, ", 1, ", D,
                    "] tensor, got ", c10::toString(mu->scalar_type()), " ", mu->sizes());
      const auto& tb = tables[g];
      TORCH_CHECK(tb.size() == 3, gn, ": a group's tables are three tensors, got ", tb.size());
      const bool turbo = kinds[g] == "turbo";
      TORCH_CHECK(turbo || kinds[g] == "pcaq", gn, ": kind must be turbo or pcaq, got ", kinds[g]);
      GroupPlan p{turbo, Hg, 0, 0, bits[g], static_cast<bool>(normfix[g]), hs.data(),
                  mu.has_value() ? mu->data_ptr<at::Half>() : nullptr, tb[0].data_ptr(), tb[1].data_ptr(),
                  tb[2].data_ptr(), nullptr};
      if (turbo) {
        TORCH_CHECK(bits[g] >= 1 && bits[g] <= 8, gn, ": bits must be in 1..8, got ", bits[g]);
        const int64_t nlev = int64_t(1) << bits[g];
        check_const(tb[0], "rotation", cd, {D, D});
        check_const(tb[1], "levels", cd, {nlev});
        check_const(tb[2], "bounds", cd, {nlev - 1});
        p.nbytes = (D * bits[g] + 7) / 8;
        p.nb = nlev - 1;
      } else {
        check_const(tb[0], "transform", cd, {Hg, D, D});
        TORCH_CHECK(tb[1].dim() == 3 && tb[1].size(2) >= 1, gn, ": bounds must be [", Hg, ", ", D, ", levels - 1]");
        p.nb = tb[1].size(2);
        check_const(tb[1], "bounds", cd, {Hg, D, p.nb});
        TORCH_CHECK(tb[2].device().is_cpu() && tb[2].scalar_type() == torch::kUInt8 && tb[2].is_contiguous() &&
                        tb[2].sizes().equals({Hg, D}),
                    gn, ": widths must be a contiguous CPU uint8 [", Hg, ", ", D, "] tensor");
        const uint8_t* wp = tb[2].data_ptr<uint8_t>();
        int64_t total = -1;
        for (int64_t h = 0; h < Hg; ++h) {
          int64_t b = 0;
          for (int64_t j = 0; j < D; ++j) {
            TORCH_CHECK(wp[h * D + j] <= 8 && (int64_t(1) << wp[h * D + j]) - 1 <= p.nb, gn, ": widths[", h, ", ",
                        j, "] is above 8 bits or above what bounds cover");
            b += wp[h * D + j];
          }
          TORCH_CHECK(total < 0 || b == total, gn, ": widths: head ", h, " packs ", b, " bits per row, head 0 ",
                      total);
          total = b;
        }
        p.nbytes = (total + 7) / 8;
        p.widths = wp;
      }
      plans.push_back(p);
    }
    planned = key;
  }

  // The decode step's append path: rows [start, start + n) of a store's row buffer `src` ([B, H, capacity, D], unit
  // last stride; float32 / float64, or 16-bit rows computed in float32 as the codecs' torch path computes them)
  // centred, quantized and packed row by row (`encode_row` / `pcaq_encode_row`, the arithmetic of `encode`) straight
  // into the packed buffers `dsts` (one per field, in the groups' field order: turbo codes, norms; pcaq codes; each
  // [B, Hg, capacity, width] with unit last stride) at row offset `offsets[i]` of each: no tensor is allocated.
  void encode_into(const torch::Tensor& src, int64_t start, int64_t n, const std::vector<torch::Tensor>& dsts,
                   const std::vector<int64_t>& offsets) const {
    TORCH_CHECK(src.device().is_cpu(), "src must be a CPU tensor, got one on ", src.device());
    TORCH_CHECK(src.dim() == 4, "src must be 4-D [batch, kv_heads, capacity, head_dim], got shape ", src.sizes());
    const auto st = src.scalar_type();
    TORCH_CHECK(st == torch::kFloat || st == torch::kDouble || st == torch::kHalf || st == torch::kBFloat16,
                "src must be float32, float64, float16 or bfloat16, got ", c10::toString(st));
    TORCH_CHECK(src.stride(3) == 1, "src's rows must be contiguous (unit last stride), got strides ", src.strides());
    TORCH_CHECK(n >= 0 && start >= 0 && start + n <= src.size(2), "rows [", start, ", ", start + n,
                ") are outside src's ", src.size(2), " rows");
    const int64_t B = src.size(0), H = src.size(1), D = src.size(3);
    TORCH_CHECK(D >= 1 && D <= MAX_HEAD_DIM, "src has head_dim ", D, ", outside 1..", MAX_HEAD_DIM);
    const at::ScalarType cd = st == torch::kDouble ? torch::kDouble : torch::kFloat;
    prepare(cd, B, H, D);
    size_t fields = 0;
    for (const auto& p : plans) fields += p.turbo ? 2 : 1;
    TORCH_CHECK(dsts.size() == fields && offsets.size() == fields, "dsts and offsets must have one entry per packed "
                "field (", fields, "), got ", dsts.size(), " and ", offsets.size());
    const std::array<int64_t, 3> ss{src.stride(0), src.stride(1), src.stride(2)};
    size_t k = 0;
    for (size_t g = 0; g < plans.size(); ++g) {
      const GroupPlan& p = plans[g];
      const int64_t Hg = p.Hg;
      auto check_dst = [&](const torch::Tensor& d, int64_t at, at::ScalarType dt, int64_t width, size_t i) {
        TORCH_CHECK(d.device().is_cpu() && d.scalar_type() == dt && d.dim() == 4 && d.size(0) == B &&
                        d.size(1) == Hg && d.size(3) == width && d.stride(3) == 1,
                    "dsts[", i, "] (group ", g, ") must be a CPU ", c10::toString(dt), " [", B, ", ", Hg,
                    ", capacity, ", width, "] buffer with unit last stride, got ", c10::toString(d.scalar_type()), " ",
                    d.sizes());
        TORCH_CHECK(at >= 0 && at + n <= d.size(2), "offsets[", i, "] = ", at, ": rows [", at, ", ", at + n,
                    ") do not fit dsts[", i, "]'s ", d.size(2), " rows");
      };
      const auto& cdst = dsts[k];
      const int64_t coff = offsets[k];
      check_dst(cdst, coff, torch::kUInt8, p.nbytes, k);
      uint8_t* cp = cdst.data_ptr<uint8_t>();
      const std::array<int64_t, 3> cs{cdst.stride(0), cdst.stride(1), cdst.stride(2)};
      at::Half* np = nullptr;
      int64_t noff = 0;
      std::array<int64_t, 3> ns{0, 0, 0};
      if (p.turbo) {
        const auto& nd = dsts[k + 1];
        check_dst(nd, offsets[k + 1], torch::kHalf, 1, k + 1);
        np = nd.data_ptr<at::Half>();
        noff = offsets[k + 1];
        ns = {nd.stride(0), nd.stride(1), nd.stride(2)};
      }
      AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, st, "encode_into", [&] {
        using S = scalar_t;
        using T = std::conditional_t<std::is_same_v<S, double>, double, float>;
        const S* sp = src.data_ptr<S>();
        const T* t0 = static_cast<const T*>(p.t0);
        const T* t1 = static_cast<const T*>(p.t1);
        const T* t2 = static_cast<const T*>(p.t2);
        const auto body = [&](int64_t r0, int64_t r1) {
          std::array<T, MAX_HEAD_DIM> xr, u;
          for (int64_t r = r0; r < r1; ++r) {
            const int64_t b = r / (Hg * n), j = (r / n) % Hg, t = r % n;
            const S* row = sp + b * ss[0] + p.heads[j] * ss[1] + (start + t) * ss[2];
            const at::Half* m = p.mu == nullptr ? nullptr : p.mu + (b * Hg + j) * D;
            for (int64_t i = 0; i < D; ++i)
              xr[i] = m == nullptr ? static_cast<T>(row[i])
                                   : static_cast<T>(row[i]) - static_cast<T>(static_cast<float>(m[i]));
            uint8_t* out = cp + b * cs[0] + j * cs[1] + (coff + t) * cs[2];
            if (p.turbo)
              encode_row(xr.data(), D, t0, t1, t2, p.nb, p.bits, p.normfix, u.data(), out, p.nbytes,
                         np + b * ns[0] + j * ns[1] + (noff + t) * ns[2]);
            else
              pcaq_encode_row(xr.data(), D, t0 + j * D * D, t1 + j * D * p.nb, p.nb, p.widths + j * D, out,
                              p.nbytes);
          }
        };
        const int64_t rows = B * Hg * n;
        if (rows <= 16)  // (a decode step: inline, no pool round trip)
          body(0, rows);
        else
          at::parallel_for(0, rows, 16, body);
      });
      k += p.turbo ? 2 : 1;
    }
  }
};

// One decode step's append for several stores (a layer's K and V stores) in one call: for store i, the step's rows
// `xs[i]` ([B, H, t, D], any strides) are copied into its full-precision row buffer `tails[i]` ([B, H, capacity, D],
// unit last stride, the rows' dtype) at row `tail_at[i]`, then rows [starts[i], starts[i] + ns[i]) of that buffer are
// quantized + packed by `encoders[i]` into its packed buffers `dsts[i]` at `offsets[i]` (`encode_into`: the same
// arithmetic, the same bytes). Every copy is checked before any row is written; `KVStore.append_step` is the caller.
void append_rows(const std::vector<const HeadsEncoder*>& encoders, const std::vector<torch::Tensor>& xs,
                 const std::vector<torch::Tensor>& tails, const std::vector<int64_t>& tail_at,
                 const std::vector<int64_t>& starts, const std::vector<int64_t>& ns,
                 const std::vector<std::vector<torch::Tensor>>& dsts,
                 const std::vector<std::vector<int64_t>>& offsets) {
  const size_t m = xs.size();
  TORCH_CHECK(encoders.size() == m && tails.size() == m && tail_at.size() == m && starts.size() == m &&
                  ns.size() == m && dsts.size() == m && offsets.size() == m,
              "append_rows takes one encoder, rows, tail buffer, tail offset, start, count, dsts and offsets per store; "
              "got ", encoders.size(), ", ", m, ", ", tails.size(), ", ", tail_at.size(), ", ", starts.size(), ", ",
              ns.size(), ", ", dsts.size(), " and ", offsets.size());
  for (size_t i = 0; i < m; ++i) {
    const auto& x = xs[i];
    const auto& tb = tails[i];
    const std::string nm = "store " + std::to_string(i);
    TORCH_CHECK(encoders[i] != nullptr, nm, ": no encoder (None)");
    TORCH_CHECK(x.device().is_cpu() && tb.device().is_cpu(), nm, ": rows and tail buffer must be CPU tensors");
    TORCH_CHECK(x.dim() == 4 && tb.dim() == 4, nm, ": rows and tail buffer must be 4-D, got ", x.sizes(), " and ",
                tb.sizes());
    TORCH_CHECK(x.scalar_type() == tb.scalar_type(), nm, ": rows are ", c10::toString(x.scalar_type()),
                ", the tail buffer holds ", c10::toString(tb.scalar_type()));
    TORCH_CHECK(x.size(0) == tb.size(0) && x.size(1) == tb.size(1) && x.size(3) == tb.size(3), nm, ": rows ",
                x.sizes(), " do not match the tail buffer ", tb.sizes(), " (batch, kv heads, head_dim)");
    TORCH_CHECK(tb.stride(3) == 1, nm, ": the tail buffer's rows must be contiguous, got strides ", tb.strides());
    TORCH_CHECK(tail_at[i] >= 0 && tail_at[i] + x.size(2) <= tb.size(2), nm, ": rows [", tail_at[i], ", ",
                tail_at[i] + x.size(2), ") do not fit the tail buffer's ", tb.size(2), " rows");
  }
  for (size_t i = 0; i < m; ++i) {
    const auto& x = xs[i];
    const auto& tb = tails[i];
    const int64_t B = x.size(0), H = x.size(1), t = x.size(2), D = x.size(3);
    const size_t es = x.element_size();
    const char* sp = static_cast<const char*>(x.data_ptr());
    char* dp = static_cast<char*>(tb.data_ptr());
    for (int64_t b = 0; b < B; ++b)
      for (int64_t h = 0; h < H; ++h)
        for (int64_t r = 0; r < t; ++r) {
          char* out = dp + (b * tb.stride(0) + h * tb.stride(1) + (tail_at[i] + r) * tb.stride(2)) * es;
          const char* in = sp + (b * x.stride(0) + h * x.stride(1) + r * x.stride(2)) * es;
          if (x.stride(3) == 1) {
            std::memcpy(out, in, D * es);
          } else {
            for (int64_t j = 0; j < D; ++j) std::memcpy(out + j * es, in + j * x.stride(3) * es, es);
          }
        }
  }
  for (size_t i = 0; i < m; ++i)
    if (ns[i] > 0) encoders[i]->encode_into(tails[i], starts[i], ns[i], dsts[i], offsets[i]);
}

// One fused decode step of a plain layer (K store = 0, V store = 1), held across steps: each store's kernel sides
// (the Side objects its groups of heads are read through, in the encoder's group order), its sink / tail row buffers,
// its packed buffers (the encoder's field order) and its encoder. `step(k, v, ints)` does in one call what the Python
// glue did per layer and step: point every side at the store's rows as of the call (packed run, sinks, tail, then
// the call's own rows: views, no copy; chunks in the compute dtype), then append the call's rows (`append_rows`: into
// the tail buffer, the rows the policy packs now packed in place). `ints` per store: sink rows, sink start, tail
// start, tail rows (before the call), row offset of the call's rows in the tail buffer, rows to pack, packed rows
// (before the call), then per packed buffer its start and the offset the packed rows go to. Every index is checked.
// Returns (the bytes of converted chunks, per store (sinks view | None, tail view | None, [packed views])).
struct LayerStep {
  std::array<std::vector<py::object>, 2> sides;
  std::array<std::vector<torch::Tensor>, 2> bufs;
  std::array<std::optional<torch::Tensor>, 2> head;
  std::array<torch::Tensor, 2> tail;
  std::array<py::object, 2> enc;
  at::ScalarType dt = at::kFloat;

  py::tuple step(const torch::Tensor& k, const torch::Tensor& v, const std::vector<int64_t>& ints) {
    const std::array<const torch::Tensor*, 2> xs{&k, &v};
    size_t need = 0;
    for (int s = 0; s < 2; ++s) need += 7 + 2 * bufs[s].size();
    TORCH_CHECK(ints.size() == need, "step takes ", need, " integers (7 per store + 2 per packed buffer), got ",
                ints.size());
    // every index checked before anything is written
    size_t p = 0;
    for (int s = 0; s < 2; ++s) {
      const torch::Tensor& x = *xs[s];
      const torch::Tensor& tb = tail[s];
      const std::string nm = s == 0 ? "K store" : "V store";
      TORCH_CHECK(x.device().is_cpu() && x.dim() == 4 && x.scalar_type() == tb.scalar_type() &&
                      x.size(0) == tb.size(0) && x.size(1) == tb.size(1) && x.size(3) == tb.size(3),
                  nm, ": rows ", x.sizes(), " (", c10::toString(x.scalar_type()), ") do not match the tail buffer ",
                  tb.sizes(), " (", c10::toString(tb.scalar_type()), ")");
      const int64_t hn = ints[p], hs = ints[p + 1], ts = ints[p + 2], tn = ints[p + 3], at = ints[p + 4],
                    n = ints[p + 5], np0 = ints[p + 6];
      TORCH_CHECK(hn == 0 || (head[s].has_value() && hs >= 0 && hs + hn <= head[s]->size(2)), nm, ": sink rows [",
                  hs, ", ", hs + hn, ") outside its sink buffer");
      TORCH_CHECK(ts >= 0 && tn >= 0 && ts + tn <= at && at + x.size(2) <= tb.size(2) && n >= 0 &&
                      ts + n <= at + x.size(2),
                  nm, ": tail rows [", ts, ", ", ts + tn, "), the call's at ", at, ", ", n,
                  " to pack: outside its tail buffer's ", tb.size(2), " rows");
      TORCH_CHECK(np0 >= 0, nm, ": packed rows must be >= 0, got ", np0);
      for (size_t i = 0; i < bufs[s].size(); ++i) {
        const int64_t bs = ints[p + 7 + 2 * i], off = ints[p + 8 + 2 * i];
        TORCH_CHECK(bs >= 0 && bs + np0 <= bufs[s][i].size(2) && off >= bs + np0 && off + n <= bufs[s][i].size(2),
                    nm, ": packed buffer ", i, ": rows [", bs, ", ", bs + np0, ") and [", off, ", ", off + n,
                    ") outside its ", bufs[s][i].size(2), " rows");
      }
      p += 7 + 2 * bufs[s].size();
    }
    int64_t extra = 0;
    py::list out;
    p = 0;
    for (int s = 0; s < 2; ++s) {
      const torch::Tensor& x = *xs[s];
      const int64_t hn = ints[p], hs = ints[p + 1], ts = ints[p + 2], tn = ints[p + 3], at = ints[p + 4],
                    n = ints[p + 5], np0 = ints[p + 6];
      std::vector<torch::Tensor> views;
      std::vector<int64_t> offs;
      for (size_t i = 0; i < bufs[s].size(); ++i) {
        views.push_back(bufs[s][i].narrow(2, ints[p + 7 + 2 * i], np0));
        offs.push_back(ints[p + 8 + 2 * i]);
      }
      std::optional<torch::Tensor> hv, tv;
      std::vector<torch::Tensor> chunks;
      auto add = [&](const torch::Tensor& c) {
        if (c.scalar_type() == dt) {
          chunks.push_back(c);
        } else {
          chunks.push_back(c.to(dt));
          extra += chunks.back().numel() * chunks.back().element_size();
        }
      };
      if (hn) add(*(hv = head[s]->narrow(2, hs, hn)));
      if (tn) add(*(tv = tail[s].narrow(2, ts, tn)));
      add(x);
      size_t f = 0;
      for (auto& obj : sides[s]) {
        SideDesc& d = obj.cast<SideDesc&>();
        const size_t nf = d.kind == "turbo" ? 2 : 1;
        TORCH_CHECK(f + nf <= views.size(), "side of ", s == 0 ? "K" : "V", " store: more fields than packed buffers");
        d.n_before = hn;
        d.n_packed = np0;
        d.codes = views[f];
        if (nf == 2) d.norms = views[f + 1];
        d.dense = chunks;
        f += nf;
      }
      TORCH_CHECK(f == views.size(), s == 0 ? "K" : "V", " store: its sides read ", f, " of its ", views.size(),
                  " packed buffers");
      append_rows({&enc[s].cast<const HeadsEncoder&>()}, {x}, {tail[s]}, {at}, {ts}, {n}, {bufs[s]}, {offs});
      out.append(py::make_tuple(hv.has_value() ? py::cast(*hv) : py::none(), tv.has_value() ? py::cast(*tv) : py::none(),
                                py::cast(views)));
      p += 7 + 2 * bufs[s].size();
    }
    return py::make_tuple(extra, out);
  }
};

}  // namespace
