// fa_sides.h: the boundary: every field of a caller's side checked, with its name, and turned
// into the pointer form the kernel reads (`build_side`).

#pragma once

#include "fa_rules.h"
#include "fa_pcaq_tiles.h"

namespace {

// -- the boundary: every argument checked, with its name ------------------------------------------------

int64_t kind_code(const std::string& k, const std::string& nm) {
  if (k == "dense") return DENSE;
  if (k == "turbo") return TURBO;
  if (k == "affine-token") return AFFINE_TOKEN;
  if (k == "affine-channel") return AFFINE_CHANNEL;
  if (k == "pcaq") return PCAQ;
  TORCH_CHECK(false, nm, ".kind must be one of dense, turbo, affine-token, affine-channel, pcaq; got '", k, "'");
  return DENSE;
}

// torch's Python name of a dtype (float32, float16, int8), as a Python caller writes it
std::string dtype_name(at::ScalarType t) {
  std::string n = c10::toString(t);
  if (t == torch::kFloat) return "float32";
  if (t == torch::kDouble) return "float64";
  if (t == torch::kHalf) return "float16";
  if (t == torch::kBFloat16) return "bfloat16";
  if (t == torch::kChar) return "int8";
  if (t == torch::kByte) return "uint8";
  for (auto& ch : n) ch = static_cast<char>(std::tolower(static_cast<unsigned char>(ch)));
  return n;
}

// A 4-D [Bs, H, rows, cols] CPU tensor of dtype dt with unit last stride (or a checked broadcast batch).
void check_rows(const torch::Tensor& t, const std::string& nm, at::ScalarType dt, int64_t Bs, int64_t H,
                int64_t rows, int64_t cols, const char* rows_what, bool batch_may_broadcast = false) {
  TORCH_CHECK(t.device().is_cpu(), nm, " must be a CPU tensor, got one on ", t.device());
  TORCH_CHECK(t.scalar_type() == dt, nm, " must be ", c10::toString(dt), ", got ", c10::toString(t.scalar_type()));
  TORCH_CHECK(t.dim() == 4, nm, " must be 4-D [batch, kv_heads, rows, ", cols, "], got shape ", t.sizes());
  TORCH_CHECK(t.size(0) == Bs || (batch_may_broadcast && t.size(0) == 1), nm, " has batch ", t.size(0),
              ", expected ", Bs, " (the side's batch)");
  TORCH_CHECK(t.size(1) == H, nm, " has ", t.size(1), " kv heads, expected ", H);
  TORCH_CHECK(t.size(2) == rows, nm, " has ", t.size(2), " rows, expected ", rows, " (", rows_what, ")");
  TORCH_CHECK(t.size(3) == cols, nm, " has ", t.size(3), " values per row, expected ", cols);
  TORCH_CHECK(cols <= 1 || t.stride(3) == 1, nm, " must have unit stride along its last dimension, got strides ",
              t.strides());
}

void check_absent(const std::optional<torch::Tensor>& t, const std::string& nm, const char* why) {
  TORCH_CHECK(!t.has_value(), nm, " must be None for ", why);
}

// The centring mean of a transformed side: fp16 [Bs|1, H, 1, D] (optional).
template <typename T>
void take_mu(Side<T>& s, const SideDesc& d, const std::string& nm, int64_t H, int64_t Bs) {
  if (!d.mu.has_value()) return;
  check_rows(*d.mu, nm + ".mu", torch::kHalf, Bs, H, 1, s.D, "one centring mean per head", true);
  s.mu = d.mu->data_ptr<at::Half>();
  s.mu_b = d.mu->size(0) == 1 ? 0 : d.mu->stride(0);
  s.mu_h = d.mu->stride(1);
}

// A pcaq (calibrated keys) side: codes [Bs, H, N, row bytes] (coordinate j of head h at stream bits
// [sum(widths[h, :j]), + widths[h, j]), LSB first), widths uint8 [H, D] (each <= bits, every head's row the same
// number of bytes), levels [H, D, 2**bits] (level c of coordinate j: its value for code c), transform
// [H, D, D] (row i of head h: the query's coordinate i is <transform[h, i], q>), centring mean as turbo's.
template <typename T>
Side<T> build_pcaq(Side<T>& s, const SideDesc& d, const std::string& nm, int64_t H, int64_t Bs) {
  const at::ScalarType dt = c10::CppTypeToScalarType<T>::value;
  const int64_t D = s.D, bits = s.bits, nlev = int64_t(1) << bits;
  TORCH_CHECK(nm.rfind("k_sides", 0) == 0, nm, ": pcaq is a key codec (values have no pcaq form)");
  for (const auto& f : {std::make_pair(&d.norms, ".norms"), std::make_pair(&d.scales, ".scales"),
                        std::make_pair(&d.zeros, ".zeros")})
    check_absent(*f.first, nm + f.second, "a pcaq side (rows have no norm or scale)");
  TORCH_CHECK(d.widths.has_value(), nm, ".widths (bits per coordinate, uint8 [kv_heads, head_dim]) is required for a pcaq side");
  const auto& w = *d.widths;
  TORCH_CHECK(w.device().is_cpu() && w.scalar_type() == torch::kUInt8 && w.dim() == 2 && w.size(0) == H &&
                  w.size(1) == D && w.is_contiguous(),
              nm, ".widths must be a contiguous CPU uint8 [", H, ", ", D, "] tensor, got ",
              c10::toString(w.scalar_type()), " ", w.sizes());
  const uint8_t* wp = w.data_ptr<uint8_t>();
  s.pbyte.resize(H * D);
  s.pshift.resize(H * D);
  s.pmask.resize(H * D);
  s.plev_at.resize(H * D);
  int64_t total = -1;
  for (int64_t h = 0; h < H; ++h) {
    int64_t off = 0;
    for (int64_t j = 0; j < D; ++j) {
      const int64_t wj = wp[h * D + j];
      TORCH_CHECK(wj <= bits, nm, ".widths[", h, ", ", j, "] is ", wj, ", above the side's bits ", bits);
      s.pbyte[h * D + j] = static_cast<int32_t>(off >> 3);
      s.pshift[h * D + j] = static_cast<int32_t>(off & 7);
      s.pmask[h * D + j] = static_cast<int32_t>((1 << wj) - 1);
      s.plev_at[h * D + j] = static_cast<int32_t>((h * D + j) * nlev);
      off += wj;
    }
    TORCH_CHECK(total < 0 || off == total, nm, ".widths: head ", h, " packs ", off, " bits per row, head 0 packs ",
                total);
    total = off;
  }
  s.row_bytes = (total + 7) / 8;
  for (int64_t i = 0; i < H * D; ++i) s.pbyte[i] = std::min<int32_t>(s.pbyte[i], std::max<int64_t>(s.row_bytes - 1, 0));
  const auto& codes = *d.codes;
  check_rows(codes, nm + ".codes", torch::kUInt8, Bs, H, s.np, s.row_bytes, "n_packed");
  s.codes = codes.data_ptr<uint8_t>();
  s.c_b = codes.stride(0);
  s.c_h = codes.stride(1);
  s.c_r = codes.stride(2);
  TORCH_CHECK(d.levels.has_value(), nm, ".levels (per-coordinate levels) is required for a pcaq side");
  const auto& lv = *d.levels;
  TORCH_CHECK(lv.device().is_cpu() && lv.scalar_type() == dt && lv.dim() == 3 && lv.size(0) == H &&
                  lv.size(1) == D && lv.size(2) == nlev && lv.is_contiguous(),
              nm, ".levels must be a contiguous CPU ", c10::toString(dt), " [", H, ", ", D, ", 2**bits = ", nlev,
              "] tensor, got ", c10::toString(lv.scalar_type()), " ", lv.sizes());
  s.plev.assign(lv.data_ptr<T>(), lv.data_ptr<T>() + H * D * nlev);
  TORCH_CHECK(d.rotation.has_value(), nm, ".rotation (one transform per head) is required for a pcaq side");
  const auto& r = *d.rotation;
  TORCH_CHECK(r.device().is_cpu() && r.scalar_type() == dt && r.dim() == 3 && r.size(0) == H && r.size(1) == D &&
                  r.size(2) == D && r.is_contiguous(),
              nm, ".rotation must be a contiguous CPU ", c10::toString(dt), " [", H, ", ", D, ", ", D,
              "] tensor (one transform per head), got ", c10::toString(r.scalar_type()), " ", r.sizes());
  s.rot = r.data_ptr<T>();
  s.rot_h = D * D;
  take_mu(s, d, nm, H, Bs);
  TORCH_CHECK(!d.score_int8, nm, ".score_int8: pcaq keys are scored in 16 bits (score_int16) or in float");
  if (d.score_int16) {
    int64_t maxw = 0;
    for (int64_t i = 0; i < H * D; ++i) maxw = std::max<int64_t>(maxw, wp[i]);
    const std::string why = pcaq_int16_refusal(D, std::is_same<T, float>::value, maxw);
    TORCH_CHECK(why.empty(), nm, ".score_int16 cannot score these pcaq keys: ", why, "; this call: ",
                c10::toString(dt), ", head_dim ", D, ", widths up to ", maxw,
                " (leave score_int16 off to score in float)");
    int64_t extent = 1;  // one past the codes' last byte
    for (int64_t i = 0; i < codes.dim(); ++i) extent += (codes.size(i) - 1) * codes.stride(i);
    s.codes_end = s.codes + extent;
    build_pcaq_plan(s, wp, H);
  }
  return s;
}

template <typename T>
Side<T> build_side(const SideDesc& d, const std::string& nm, int64_t H, int64_t Bs) {
  const at::ScalarType dt = c10::CppTypeToScalarType<T>::value;
  Side<T> s;
  s.kind = kind_code(d.kind, nm);
  s.bits = d.bits;
  s.group = d.group;
  s.D = d.head_dim;
  s.nb = d.n_before;
  s.np = d.n_packed;
  const int64_t D = s.D;
  TORCH_CHECK(D >= 1 && D <= MAX_HEAD_DIM, nm, ".head_dim must be in 1..", MAX_HEAD_DIM, ", got ", D);
  TORCH_CHECK(s.np >= 0, nm, ".n_packed must be >= 0, got ", s.np);
  TORCH_CHECK(s.kind != DENSE || s.np == 0, nm, ": a dense side has n_packed 0, got ", s.np);
  if (s.kind == DENSE) {  // a dense side reads only its row chunks: a packed field given to it is a caller's mistake
    const std::pair<const std::optional<torch::Tensor>*, const char*> packed_fields[] = {
        {&d.codes, ".codes"}, {&d.norms, ".norms"}, {&d.scales, ".scales"}, {&d.zeros, ".zeros"},
        {&d.levels, ".levels"}, {&d.rotation, ".rotation"}, {&d.mu, ".mu"}, {&d.widths, ".widths"}};
    for (const auto& f : packed_fields) check_absent(*f.first, nm + f.second, "a dense side (kind 'dense')");
  }
  TORCH_CHECK(static_cast<int64_t>(d.dense.size()) <= MAX_DENSE_CHUNKS, nm, ".dense takes at most ",
              MAX_DENSE_CHUNKS, " chunks, got ", d.dense.size());
  for (size_t i = 0; i < d.dense.size(); ++i) {
    const auto& t = d.dense[i];
    const std::string cn = nm + ".dense[" + std::to_string(i) + "]";
    // a group of heads may hand a chunk of all its store's kv heads (read at its heads' indices, no copy)
    const bool global = !d.heads.empty() && d.kv_heads != H && t.dim() == 4 && t.size(1) == d.kv_heads;
    const at::ScalarType st = t.scalar_type();  // the query's dtype, or 16-bit rows read as stored
    TORCH_CHECK(st == dt || st == torch::kHalf || st == torch::kBFloat16, cn, " must be ", dtype_name(dt),
                " (the query's dtype), float16 or bfloat16 (16-bit rows are read as stored), got ", dtype_name(st));
    check_rows(t, cn, st, Bs, global ? d.kv_heads : H, t.dim() == 4 ? t.size(2) : -1, D, "its own", false);
    if (t.size(2) == 0) continue;
    if (global && s.gheads.empty()) s.gheads = d.heads;
    s.dglobal[s.nchunks] = global;
    s.dtype16[s.nchunks] = st == dt ? ROWS_T : st == torch::kHalf ? ROWS_F16 : ROWS_BF16;
    s.dptr[s.nchunks] = t.data_ptr();
    s.db[s.nchunks] = t.stride(0);
    s.dh[s.nchunks] = t.stride(1);
    s.dr[s.nchunks] = t.stride(2);
    s.nd += t.size(2);
    s.dend[s.nchunks++] = s.nd;
  }
  for (int k = s.nchunks; k < MAX_DENSE_CHUNKS; ++k) s.dend[k] = std::numeric_limits<int64_t>::max();
  TORCH_CHECK(s.nb >= 0 && s.nb <= s.nd, nm, ".n_before must be in 0..", s.nd, " (the dense rows), got ", s.nb);
  if (s.kind == DENSE || s.np == 0) {
    s.kind = DENSE;
    s.np = 0;
    return s;
  }
  TORCH_CHECK(s.bits >= 1 && s.bits <= 8, nm, ".bits must be in 1..8, got ", s.bits);
  TORCH_CHECK(d.codes.has_value(), nm, ".codes is required for a packed side");
  const int64_t bits = s.bits;
  if (s.kind == PCAQ) return build_pcaq(s, d, nm, H, Bs);
  int64_t rows = s.np, row_bytes = (D * bits + 7) / 8;
  const char* rows_what = "n_packed";
  if (s.kind == AFFINE_CHANNEL) {
    TORCH_CHECK(s.group >= 1, nm, ".group (tokens per KIVI block) must be >= 1, got ", s.group);
    TORCH_CHECK(s.np % s.group == 0, nm, ".n_packed ", s.np, " is not a whole number of blocks of ", s.group, " tokens");
    rows = s.np / s.group;
    row_bytes = (s.group * D * bits + 7) / 8;
    rows_what = "n_packed / group blocks";
  }
  const auto& codes = *d.codes;
  check_rows(codes, nm + ".codes", torch::kUInt8, Bs, H, rows, row_bytes, rows_what);
  s.codes = codes.data_ptr<uint8_t>();
  s.c_b = codes.stride(0);
  s.c_h = codes.stride(1);
  s.c_r = codes.stride(2);
  const int64_t nlev = int64_t(1) << bits;
  if (s.kind == TURBO) {
    check_absent(d.widths, nm + ".widths", "a turbo side (one width for every coordinate: bits)");
    TORCH_CHECK(d.norms.has_value(), nm, ".norms is required for a turbo side");
    check_absent(d.scales, nm + ".scales", "a turbo side");
    check_absent(d.zeros, nm + ".zeros", "a turbo side");
    check_rows(*d.norms, nm + ".norms", torch::kHalf, Bs, H, s.np, 1, "n_packed");
    s.a = d.norms->data_ptr<at::Half>();
    s.a_b = d.norms->stride(0);
    s.a_h = d.norms->stride(1);
    s.a_r = d.norms->stride(2);
    TORCH_CHECK(d.levels.has_value(), nm, ".levels (the codebook) is required for a turbo side");
    const auto& lv = *d.levels;
    TORCH_CHECK(lv.device().is_cpu() && lv.scalar_type() == dt && lv.dim() == 1 && lv.size(0) == nlev &&
                    lv.is_contiguous(),
                nm, ".levels must be a contiguous CPU ", c10::toString(dt), " vector of 2**bits = ", nlev,
                " values, got ", c10::toString(lv.scalar_type()), " ", lv.sizes());
    for (int64_t i = 0; i < nlev; ++i) s.lut[i] = lv.data_ptr<T>()[i];
    TORCH_CHECK(d.rotation.has_value(), nm, ".rotation is required for a turbo side");
    const auto& r = *d.rotation;
    TORCH_CHECK(r.device().is_cpu() && r.scalar_type() == dt && r.dim() == 2 && r.size(0) == D && r.size(1) == D &&
                    r.is_contiguous(),
                nm, ".rotation must be a contiguous CPU ", c10::toString(dt), " [", D, ", ", D, "] matrix, got ",
                c10::toString(r.scalar_type()), " ", r.sizes(), r.is_contiguous() ? "" : " (not contiguous)");
    s.rot = r.data_ptr<T>();
    take_mu(s, d, nm, H, Bs);
    if (std::is_same<T, float>::value && simd_turbo(bits, D)) {
      for (int64_t i = 0; i < nlev; ++i) s.lutpad[i] = static_cast<float>(s.lut[i]);
      s.order.resize(D);
      for (int64_t i = 0; i < D; ++i) s.order[i] = static_cast<int32_t>(64 * (i / 64) + simd_pos(bits, i % 64));
    }
    if (d.score_int8) {
      TORCH_CHECK(nm.rfind("k_sides", 0) == 0, nm, ".score_int8: only keys are scored (values are summed in float)");
      TORCH_CHECK(score_int8_ok(s.kind, bits, D, std::is_same<T, float>::value), nm,
                  ".score_int8 needs float32 queries, 4- or 2-bit turbo codes (3-bit with AVX-512 VBMI) and head_dim a multiple of 64 on a CPU "
                  "with AVX-512 VNNI; this call: ", c10::toString(dt), ", ", bits, "-bit, head_dim ", D,
                  ", this build ", TQ_VNNI ? "has" : "lacks", " VNNI (leave score_int8 off to score in float)");
      float amax = 0;
      for (int64_t i = 0; i < nlev; ++i) amax = std::max(amax, std::abs(static_cast<float>(s.lut[i])));
      s.cb8_scale = amax > 0 ? amax / 127.0f : 1.0f;
      for (int64_t lane = 0; lane < 4; ++lane)
        for (int64_t i = 0; i < nlev; ++i)
          s.cb8[16 * lane + i] = static_cast<uint8_t>(
              128 + static_cast<int>(std::nearbyint(static_cast<float>(s.lut[i]) / s.cb8_scale)));
      s.s8 = true;
    }
    if (d.score_int16) {
      TORCH_CHECK(!d.score_int8, nm, ": score_int8 and score_int16 are exclusive (pick one)");
      TORCH_CHECK(nm.rfind("k_sides", 0) == 0, nm, ".score_int16: only keys are scored (values are summed in float)");
      TORCH_CHECK(score_int8_ok(s.kind, bits, D, std::is_same<T, float>::value), nm,
                  ".score_int16 needs float32 queries, 4- or 2-bit turbo codes (3-bit with AVX-512 VBMI) and head_dim a multiple of 64 on a CPU "
                  "with AVX-512 VNNI; this call: ", c10::toString(dt), ", ", bits, "-bit, head_dim ", D,
                  ", this build ", TQ_VNNI ? "has" : "lacks", " VNNI (leave score_int16 off to score in float)");
      float amax = 0;
      for (int64_t i = 0; i < nlev; ++i) amax = std::max(amax, std::abs(static_cast<float>(s.lut[i])));
      s.cb16_scale = amax > 0 ? amax / static_cast<float>(Q16) : 1.0f;
      for (int64_t i = 0; i < nlev; ++i)
        s.cb16[i] = static_cast<int16_t>(std::nearbyint(static_cast<float>(s.lut[i]) / s.cb16_scale));
      s.s16 = true;
    }
  } else {
    check_absent(d.widths, nm + ".widths", "an affine side");
    check_absent(d.norms, nm + ".norms", "an affine side");
    check_absent(d.levels, nm + ".levels", "an affine side (codes are their own values)");
    check_absent(d.rotation, nm + ".rotation", "an affine side");
    check_absent(d.mu, nm + ".mu", "an affine side");
    TORCH_CHECK(d.scales.has_value() && d.zeros.has_value(), nm, ".scales and ", nm, ".zeros are required for an affine side");
    int64_t cols = D;
    if (s.kind == AFFINE_TOKEN) {
      TORCH_CHECK(s.group >= 1 && D % s.group == 0, nm, ".group (channels per group) must divide head_dim ", D,
                  ", got ", s.group);
      cols = D / s.group;
    }
    check_rows(*d.scales, nm + ".scales", torch::kHalf, Bs, H, rows, cols, rows_what);
    check_rows(*d.zeros, nm + ".zeros", torch::kHalf, Bs, H, rows, cols, rows_what);
    s.a = d.scales->data_ptr<at::Half>();
    s.a_b = d.scales->stride(0);
    s.a_h = d.scales->stride(1);
    s.a_r = d.scales->stride(2);
    s.z = d.zeros->data_ptr<at::Half>();
    s.z_b = d.zeros->stride(0);
    s.z_h = d.zeros->stride(1);
    s.z_r = d.zeros->stride(2);
    for (int64_t i = 0; i < nlev; ++i) s.lut[i] = static_cast<T>(i);
  }
  if (8 % bits == 0) {
    s.per_byte = 8 / bits;
    s.btab.resize(256 * s.per_byte);
    for (int64_t v = 0; v < 256; ++v)
      for (int64_t i = 0; i < s.per_byte; ++i) s.btab[v * s.per_byte + i] = s.lut[(v >> (i * bits)) & (nlev - 1)];
  }
  return s;
}

int64_t side_batch(const SideDesc& d, const std::string& nm) {
  if (d.kind != "dense" && d.n_packed > 0 && d.codes.has_value() && d.codes->dim() == 4) return d.codes->size(0);
  for (const auto& t : d.dense)
    if (t.dim() == 4) return t.size(0);
  TORCH_CHECK(false, nm, " holds no rows: give its dense rows (dense=[...]) or its packed codes");
  return 0;
}

int64_t side_heads(const SideDesc& d) {
  if (d.kind != "dense" && d.n_packed > 0 && d.codes.has_value() && d.codes->dim() == 4) return d.codes->size(1);
  for (const auto& t : d.dense)
    if (t.dim() == 4) return t.size(1);
  return -1;
}

}  // namespace
