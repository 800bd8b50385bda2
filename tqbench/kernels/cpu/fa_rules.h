// fa_rules.h: the ISA switches, the kernel's rules (one place; Python asks `rules()`), the side types
// (`SideDesc`, what the caller describes; `Side`, the checked pointer form) and the fp16 row conversion.

#pragma once

#include <torch/extension.h>
#include <ATen/Parallel.h>

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define TQ_AVX512 1
#else
#define TQ_AVX512 0
#endif
#if !TQ_AVX512 && defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define TQ_AVX2 1
#else
#define TQ_AVX2 0
#endif
#if defined(__AVX512VBMI__) && TQ_AVX512
#define TQ_VBMI 1
#else
#define TQ_VBMI 0
#endif
#if defined(__AVX512VNNI__) && TQ_AVX512
#define TQ_VNNI 1
#else
#define TQ_VNNI 0
#endif
#if TQ_AVX512 || TQ_AVX2
#include <immintrin.h>
#endif

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <optional>
#include <string>
#include <vector>

#define TQ_INLINE inline __attribute__((always_inline))

namespace {

// -- the rules (one place; Python asks `rules()`) ----------------------------------------------------------
constexpr int64_t MIN_BLOCK = 32;          // the smallest token block of a work item
constexpr int64_t MAX_BLOCK = 2048;        // the largest (its scores stay in L2)
constexpr int64_t BLOCKS_PER_THREAD = 8;   // work items per thread the split aims for (keeps threads busy at batch 1)
constexpr int64_t SIMD_DIM_MULTIPLE = 64;  // turbo rows decode in SIMD order when head_dim % 64 == 0 (fp32)
constexpr int64_t MAX_DENSE_CHUNKS = 8;    // dense row chunks per side
constexpr int64_t MAX_HEAD_DIM = 512;      // the widest row (a row's scales and zeros fit one stack buffer)

const char* isa_name() {
#if TQ_AVX512 && TQ_VBMI
  return "avx512+vbmi";
#elif TQ_AVX512
  return "avx512";
#elif TQ_AVX2
  return "avx2";
#else
  return "generic";
#endif
}

enum RowType : int8_t { ROWS_T = 0, ROWS_F16 = 1, ROWS_BF16 = 2 };  // a dense chunk's element type

enum Kind : int64_t { DENSE = 0, TURBO = 1, AFFINE_TOKEN = 2, AFFINE_CHANNEL = 3, PCAQ = 4 };

// Kinds whose packed rows live in a transformed domain: keys score against the transformed query (R q), values
// accumulate there and are transformed back once per query. TurboQuant: one rotation for every head, a norm per
// row; pcaq (calibrated keys): one transform per head, per-coordinate widths and levels, no norm.
inline bool transformed(int64_t kind) { return kind == TURBO || kind == PCAQ; }

// turbo widths decoded in SIMD order (fp32, head_dim % 64 == 0)
inline bool simd_turbo(int64_t bits, int64_t D) {
#if TQ_AVX512 || TQ_AVX2
  return D % SIMD_DIM_MULTIPLE == 0 && bits >= 1 && bits <= 4;
#else
  (void)bits;
  (void)D;
  return false;
#endif
}

// Position p of a 64-code chunk holds coordinate simd_pos(bits, p) of the chunk (the unpack's natural output).
inline int64_t simd_pos(int64_t bits, int64_t p) {
#if TQ_AVX512
  if (bits == 4) return p < 32 ? 2 * p : 2 * (p - 32) + 1;
  if (bits == 2) return 4 * (p % 16) + p / 16;
#if TQ_VBMI
  if (bits == 3) return p;  // VBMI multishift unpacks 3-bit codes in their natural order
#else
  if (bits == 3) return 8 * (p % 8) + p / 8;
#endif
  return p;
#elif TQ_AVX2
  if (bits == 4) return p < 32 ? 2 * p : 2 * (p - 32) + 1;
  if (bits == 2) return 4 * (p % 16) + p / 16;
  if (bits == 3) return 8 * (p % 8) + p / 8;
  return p;
#else
  (void)bits;
  return p;
#endif
}

// What the caller describes, one per side per store (bound to Python as `Side`).
struct SideDesc {
  std::string kind = "dense";  // "dense", "turbo", "affine-token", "affine-channel", "pcaq"
  int64_t bits = 0, group = 1, head_dim = 0, n_before = 0, n_packed = 0;
  std::optional<torch::Tensor> codes, norms, scales, zeros, levels, rotation, mu;
  std::optional<torch::Tensor> widths;  // pcaq: bits of each coordinate, uint8 [H, D]
  std::vector<torch::Tensor> dense;  // full-precision row chunks [Bs, H, n_i, head_dim], in token order
  // one group of heads of a per-head store: the store's KV heads this side holds (its tensors' heads, in order)
  // and how many the store has; empty / 0: the side is the whole store
  std::vector<int64_t> heads;
  int64_t kv_heads = 0;
  // turbo keys scored in 8 bits (see `score_int8_ok`): the query rounded to int8 per query row, the codebook to
  // uint8 around 128, products summed exactly in int32 (AVX-512 VNNI), 64 codes looked up by one byte shuffle
  bool score_int8 = false;
  // the same in 16 bits (query and codebook rounded to +-Q16 steps, pairs summed exactly by VPDPWSSD): 32x finer
  bool score_int16 = false;
};

// 16-bit scoring's steps: query and codebook each rounded to integers within +-Q16 (sums of D <= 512 products
// stay below 2**31 in each int32 lane)
constexpr int32_t Q16 = 4095;
// 16-bit pcaq scoring: the levels in +-PQ_LEVEL_STEPS steps per head, the query as hi + lo / PQ_LO_SPLIT (two int16
// parts: hi in +-Q16 steps, lo the remainder in steps PQ_LO_SPLIT times finer): D / 16 products of at most
// Q16 * PQ_LEVEL_STEPS per int32 lane stay below 2**31 for D <= 512
constexpr int32_t PQ_LEVEL_STEPS = 16383;
constexpr int32_t PQ_LO_SPLIT = 4096;

// Whether a side's keys can be scored in 8 bits by this build: float32, turbo 4- or 2-bit codes (3-bit too where
// the build has VBMI), head_dim a multiple of 64, AVX-512 VNNI (both score_int8 and score_int16). The error this
// adds to each score is bounded (docs/cache-modes.md; the bound is `int_score_bound` in attention.py, tested).
inline bool score_int8_ok(int64_t kind, int64_t bits, int64_t D, bool is_float) {
  return TQ_VNNI && is_float && kind == TURBO && (bits == 4 || bits == 2 || (bits == 3 && TQ_VBMI)) && D % 64 == 0;
}

// pcaq keys scored in 16 bits: one 64-coordinate chunk of a head's row (fa_pcaq_tiles.h): the byte its 64-byte
// load starts at, per byte lane the permute / multishift / mask / window-base bytes, and its level windows
// (Side::pq_tab from window win0 on, nwin of them).
struct PqChunk {
  int32_t load = 0, win0 = 0, nwin = 0;
  alignas(64) uint8_t perm[64] = {0};
  alignas(64) uint8_t shift[64] = {0};
  alignas(64) uint8_t mask[64] = {0};
  alignas(64) uint8_t base[64] = {0};
};

// The checked, pointer form the kernel reads.
template <typename T>
struct Side {
  int64_t kind = DENSE, bits = 0, group = 1, D = 0;
  int64_t nb = 0, np = 0, nd = 0;  // dense rows before the packed run; packed tokens; dense rows in all
  const uint8_t* codes = nullptr;
  int64_t c_b = 0, c_h = 0, c_r = 0;  // codes [Bs, H, R, bytes] (R = tokens, or blocks for KIVI)
  const at::Half* a = nullptr;  // turbo: norm [Bs, H, N, 1]; affine: scale [Bs, H, R, G | D]
  int64_t a_b = 0, a_h = 0, a_r = 0;
  const at::Half* z = nullptr;  // affine: zero, same shape as scale
  int64_t z_b = 0, z_h = 0, z_r = 0;
  T lut[256];  // value of each code: turbo codebook, or 0..2^bits-1 for affine
  float lutpad[16] = {0};
  std::vector<T> btab;  // [256][per_byte] decoded values of every byte (bits 1, 2, 4, 8)
  int64_t per_byte = 0;
  const T* rot = nullptr;  // turbo rotation [D, D] / pcaq transform [H, D, D] (natural row order)
  int64_t rot_h = 0;       // the transform of head h is rot + h * rot_h (turbo: 0, one for all heads)
  const at::Half* mu = nullptr;  // turbo / pcaq centring [Bs|1, H, 1, D]
  int64_t mu_b = 0, mu_h = 0;
  std::vector<int32_t> order;  // SIMD decode order of the rotated coordinates (empty: natural)
  // pcaq, per (head, coordinate): the byte of the row holding its code, the code's shift within the 32-bit word
  // read there, its mask, and where its levels start in plev ([H][D][2**bits])
  std::vector<int32_t> pbyte, pshift, pmask, plev_at;
  std::vector<T> plev;
  int64_t row_bytes = 0;
  int nchunks = 0;
  // a dense chunk's rows: in T (the query's dtype, read in place) or 16 bits (ROWS_F16 / ROWS_BF16: each row
  // converted as it is read, exactly, into the tile's scratch row; the store is never widened)
  const void* dptr[MAX_DENSE_CHUNKS];
  int8_t dtype16[MAX_DENSE_CHUNKS] = {0};
  int64_t dend[MAX_DENSE_CHUNKS], db[MAX_DENSE_CHUNKS], dh[MAX_DENSE_CHUNKS], dr[MAX_DENSE_CHUNKS];
  // a group side's chunk that holds every KV head of its store (the layer's rows as the cache holds them): head
  // h of the side is head gheads[h] of that chunk (dglobal); its other chunks hold only the group's heads
  bool dglobal[MAX_DENSE_CHUNKS] = {false};
  std::vector<int64_t> gheads;
  // 8-bit scoring: the codebook as uint8 (round(level / cb8_scale) + 128) in each 128-bit lane
  bool s8 = false;
  alignas(64) uint8_t cb8[64] = {0};
  float cb8_scale = 0;
  // 16-bit scoring: the codebook as int16 (round(level / cb16_scale)), entries 0..15 of one 32-word table
  bool s16 = false;
  alignas(64) int16_t cb16[32] = {0};
  float cb16_scale = 0;
  // pcaq keys in 16 bits (s16 on a PCAQ side): per (head, chunk) the plan, every window's 128 low then 128 high
  // level bytes and its lanes, each head's level step, the query's order (pq_pos[i]: the coordinate position i
  // holds), the most bytes a row's chunk loads reach, and the codes' end (rows nearer it are read from a copy)
  std::vector<PqChunk> pq;
  std::vector<uint8_t> pq_tab;
  std::vector<uint64_t> pq_wmask;
  std::vector<float> pq_scale;
  std::vector<int32_t> pq_pos;
  int64_t pq_reach = 0;
  const uint8_t* codes_end = nullptr;
};

inline void half_to(const at::Half* src, int64_t n, float* out) {
  int64_t i = 0;
#if TQ_AVX512
  for (; i + 16 <= n; i += 16)
    _mm512_storeu_ps(out + i, _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + i))));
#elif TQ_AVX2
  for (; i + 8 <= n; i += 8)
    _mm256_storeu_ps(out + i, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i))));
#endif
  for (; i < n; ++i) out[i] = static_cast<float>(src[i]);
}
inline void half_to(const at::Half* src, int64_t n, double* out) {
  for (int64_t i = 0; i < n; ++i) out[i] = static_cast<double>(static_cast<float>(src[i]));
}

// bf16 -> fp32 is exact: the 16 bits are the float's top half (a shift, vectorized where the ISA has it)
inline void bf16_to(const at::BFloat16* src, int64_t n, float* out) {
  const uint16_t* s = reinterpret_cast<const uint16_t*>(src);
  int64_t i = 0;
#if TQ_AVX512
  for (; i + 16 <= n; i += 16)
    _mm512_storeu_ps(out + i, _mm512_castsi512_ps(_mm512_slli_epi32(
                                  _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(s + i))), 16)));
#elif TQ_AVX2
  for (; i + 8 <= n; i += 8)
    _mm256_storeu_ps(out + i, _mm256_castsi256_ps(_mm256_slli_epi32(
                                  _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(s + i))), 16)));
#endif
  for (; i < n; ++i) {
    const uint32_t w = static_cast<uint32_t>(s[i]) << 16;
    std::memcpy(out + i, &w, 4);
  }
}
inline void bf16_to(const at::BFloat16* src, int64_t n, double* out) {
  for (int64_t i = 0; i < n; ++i) out[i] = static_cast<double>(static_cast<float>(src[i]));
}

}  // namespace
