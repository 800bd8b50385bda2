// tqbench native CPU decode attention straight from the packed KV store.
//
// One call (`attend`) attends the queries of B sequences over each sequence's own store: sequence s reads
// side K[s] and side V[s] (a `Side`: kind, bits, codes, norms/scales/zeros, codebook, rotation, centring mean,
// dense row chunks). A side may cover several batch rows (one padded store, as the model hands it) or one
// sequence (the ragged batch of serving: own length, own dense rows, own mask; no padding of codes to the
// longest, no dense history built). Rows are in store order: [dense before (sinks) | packed run | dense after
// (tail + this call's rows)], K and V each with their own packed range. Packed rows are decoded one row at a
// time into registers/L1 (never a decoded copy of the history): TurboQuant keys score in the rotated domain
// (n * <R q, c[idx]> + <q, mu>), TurboQuant values accumulate in the rotated domain and are rotated back once
// per query at the end (+ p * mu for centred values); affine int1-8 rows dequantize in place (per-token
// groups or KIVI per-channel blocks). One decoded row serves every query head of its KV head (GQA) and every
// query token of the call.
//
// A store may be another store's tier (`merge_into`, one entry per store): rows at a cheaper codec that the owner's
// queries attend in the same softmax, before the owner's rows (the demote tier of token eviction): its sequences
// read the owner's query rows, split into blocks like any other, and their partials merge with the owner's (each
// V side rotated back from its own domain). No mask: every tier row is visible to every query.
//
// Dense row chunks are in the query's dtype (read in place) or 16 bits (float16 / bfloat16, as an engine's f16
// cache holds them): a 16-bit row is converted exactly to the compute dtype as it is read (F16C / AVX-512
// conversions, scalar where the ISA has none) into the tile's scratch row; scores and sums stay in the query's
// dtype. A dense side over 16-bit chunks is the `dense-fp16-kernel` baseline's attention.
//
// Calibrated keys (`pcaq`: a transform per KV head, a width per coordinate, Lloyd-Max levels per coordinate)
// score like TurboQuant keys: the query is transformed once per step with its head's transform and each packed
// row is scored from its codes (<T_h q, level[idx]> + <q, mu>), with no norm. A store whose heads use different
// codecs (a per-head layer) is described by one side per group of heads, each naming its heads (`heads`,
// `kv_heads`): the groups of a store are ragged the way the sequences of a batch are, all in one call. A group's
// dense row chunk may hold every KV head of the store (the layer's rows as the cache holds them: read at the group's
// heads, no per-group copy or view). `heads_encode` quantizes + packs a per-head layer's new rows for all its groups
// in one call, each group reading its heads by index; `HeadsEncoder.encode_into` writes them straight into a store's
// packed buffers (the decode step's append path; a whole-layer turbo or pcaq codec is one group of every head), and
// `append_rows` does a layer's K and V step in one call (rows into each tail buffer, then packed); `LayerStep` also
// points the layer's kernel sides at the rows as of the call, so a plain layer's decode step is one call before attend.
//
// Work is split over (sequence, kv head, token block) with at::parallel_for (torch's own thread pool); every
// block keeps an online-softmax partial (max, sum, accumulators) that is merged at the end (split-K), so
// the workspace is the partials, not the scores. Sparse-V skips value rows whose softmax weight (an upper
// bound of it, from the block's partial softmax) is below a threshold for every query of the block.
//
// Every size, dtype and stride the caller passes is checked here (`build_side`, `read_stores`, `attend`): a bad argument is a
// Python exception that names it, never an out-of-bounds read. The SIMD rules (which widths decode in SIMD
// order, the head-dim multiple, the token block) live in this file only; `rules()` and `simd_order()` expose
// them to Python.
//
// Code layout (tqbench/kernels/packing.py): an LSB-first bit stream per row, value i at bits
// [i*bits, (i+1)*bits) (pcaq: at the sum of the widths before it).
//
// Files (one translation unit; the headers are internal): fa_rules.h (ISA, rules, side types), fa_decode.h
// (unpack and fetch rows), fa_tiles.h (tile scores / values), fa_turbo_tiles.h (packed turbo tiles),
// fa_pcaq_tiles.h (pcaq keys scored in 16 bits),
// fa_sides.h (the checked boundary), fa_stores.h (stores and their groups of heads), fa_attend.h (attend),
// fa_encode.h (turbo, pcaq and per-head-layer encode).

#include "fa_rules.h"
#include "fa_decode.h"
#include "fa_tiles.h"
#include "fa_turbo_tiles.h"
#include "fa_pcaq_tiles.h"
#include "fa_sides.h"
#include "fa_stores.h"
#include "fa_attend.h"
#include "fa_encode.h"

namespace {

std::vector<int64_t> simd_order(int64_t bits, int64_t D) {
  TORCH_CHECK_VALUE(bits >= 1 && bits <= 4, "no SIMD order for ", bits, "-bit codes");
  TORCH_CHECK_VALUE(D >= 1 && D % SIMD_DIM_MULTIPLE == 0, "no SIMD order for head_dim ", D, " (needs a multiple of ",
                    SIMD_DIM_MULTIPLE, ")");
  std::vector<int64_t> out(D);
  for (int64_t i = 0; i < D; ++i) out[i] = simd_turbo(bits, D) ? 64 * (i / 64) + simd_pos(bits, i % 64) : i;
  return out;
}

std::vector<int64_t> simd_turbo_bits() {
  std::vector<int64_t> out;
  for (int64_t b = 1; b <= 8; ++b)
    if (simd_turbo(b, SIMD_DIM_MULTIPLE)) out.push_back(b);
  return out;
}

}  // namespace

namespace py = pybind11;
using OptT = std::optional<torch::Tensor>;

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  py::class_<SideDesc>(m, "Side", "One side (K or V) of one store, as the kernel reads it (see attention.py).")
      .def(py::init([](std::string kind, int64_t bits, int64_t group, int64_t head_dim, int64_t n_before,
                       int64_t n_packed, OptT codes, OptT norms, OptT scales, OptT zeros, OptT levels, OptT rotation,
                       OptT mu, std::vector<torch::Tensor> dense, OptT widths, std::vector<int64_t> heads,
                       int64_t kv_heads) {
             SideDesc d;
             d.kind = std::move(kind);
             d.bits = bits;
             d.group = group;
             d.head_dim = head_dim;
             d.n_before = n_before;
             d.n_packed = n_packed;
             d.codes = std::move(codes);
             d.norms = std::move(norms);
             d.scales = std::move(scales);
             d.zeros = std::move(zeros);
             d.levels = std::move(levels);
             d.rotation = std::move(rotation);
             d.mu = std::move(mu);
             d.dense = std::move(dense);
             d.widths = std::move(widths);
             d.heads = std::move(heads);
             d.kv_heads = kv_heads;
             return d;
           }),
           py::kw_only(), py::arg("kind") = "dense", py::arg("bits") = 0, py::arg("group") = 1,
           py::arg("head_dim"), py::arg("n_before") = 0, py::arg("n_packed") = 0, py::arg("codes") = py::none(),
           py::arg("norms") = py::none(), py::arg("scales") = py::none(), py::arg("zeros") = py::none(),
           py::arg("levels") = py::none(), py::arg("rotation") = py::none(), py::arg("mu") = py::none(),
           py::arg("dense") = std::vector<torch::Tensor>{}, py::arg("widths") = py::none(),
           py::arg("heads") = std::vector<int64_t>{}, py::arg("kv_heads") = 0)
      .def_readwrite("kind", &SideDesc::kind)
      .def_readwrite("bits", &SideDesc::bits)
      .def_readwrite("group", &SideDesc::group)
      .def_readwrite("head_dim", &SideDesc::head_dim)
      .def_readwrite("n_before", &SideDesc::n_before)
      .def_readwrite("n_packed", &SideDesc::n_packed)
      .def_readwrite("codes", &SideDesc::codes)
      .def_readwrite("norms", &SideDesc::norms)
      .def_readwrite("scales", &SideDesc::scales)
      .def_readwrite("zeros", &SideDesc::zeros)
      .def_readwrite("levels", &SideDesc::levels)
      .def_readwrite("rotation", &SideDesc::rotation)
      .def_readwrite("mu", &SideDesc::mu)
      .def_readwrite("dense", &SideDesc::dense)
      .def_readwrite("widths", &SideDesc::widths)
      .def_readwrite("heads", &SideDesc::heads)
      .def_readwrite("kv_heads", &SideDesc::kv_heads)
      .def_readwrite("score_int8", &SideDesc::score_int8,
                     "keys only: score in 8 bits (int8 query x uint8 codebook, exact int32 sums; turbo 4/2-bit, "
                     "float32, head_dim % 64 == 0, AVX-512 VNNI); the error per score is bounded (attention.py)")
      .def_readwrite("score_int16", &SideDesc::score_int16,
                     "keys only: score in 16 bits (query and codebook rounded to +-4095 steps, exact int32 sums; "
                     "same conditions as score_int8); the error per score is bounded (attention.py)");
  m.def("attend", &attend, "fused decode attention of B sequences, each over its own packed + dense store (CPU)",
        py::arg("query"), py::arg("scale"), py::arg("k_sides"), py::arg("v_sides"), py::arg("masks"),
        py::arg("softcap"), py::arg("sinks"), py::arg("sparse_v"), py::arg("merge_into") = std::vector<int64_t>{});
  m.def("turbo_encode", &turbo_encode, "TurboQuant quantize + pack of centred rows (CPU)", py::arg("x"),
        py::arg("rotation"), py::arg("levels"), py::arg("bounds"), py::arg("bits"), py::arg("normfix"));
  m.def("pcaq_encode", &pcaq_encode, "calibrated (pcaq) quantize + pack of centred rows (CPU)", py::arg("x"),
        py::arg("transform"), py::arg("bounds"), py::arg("widths"));
  m.def("heads_encode", &heads_encode,
        "a per-head layer's new rows quantized + packed in one call, each group of heads by its own codec (CPU)",
        py::arg("x"), py::arg("kinds"), py::arg("heads"), py::arg("mus"), py::arg("tables"), py::arg("bits"),
        py::arg("normfix"));
  py::class_<HeadsEncoder>(m, "HeadsEncoder", "heads_encode with its per-group arguments held (encode(x) per step)")
      .def(py::init([](std::vector<std::string> kinds, std::vector<std::vector<int64_t>> heads,
                       std::vector<OptT> mus, std::vector<std::vector<torch::Tensor>> tables,
                       std::vector<int64_t> bits, std::vector<bool> normfix) {
             return HeadsEncoder{std::move(kinds), std::move(heads), std::move(mus), std::move(tables),
                                 std::move(bits), std::move(normfix)};
           }),
           py::arg("kinds"), py::arg("heads"), py::arg("mus"), py::arg("tables"), py::arg("bits"),
           py::arg("normfix"))
      .def("encode", &HeadsEncoder::encode, py::arg("x"))
      .def("encode_into", &HeadsEncoder::encode_into, py::arg("src"), py::arg("start"), py::arg("n"),
           py::arg("dsts"), py::arg("offsets"),
           "rows [start, start + n) of src quantized + packed into each field's buffer at its row offset");
  m.def("append_rows", &append_rows,
        "a decode step's rows of several stores copied into their tail buffers and packed, in one call (CPU)",
        py::arg("encoders"), py::arg("xs"), py::arg("tails"), py::arg("tail_at"), py::arg("starts"), py::arg("ns"),
        py::arg("dsts"), py::arg("offsets"));
  py::class_<LayerStep>(m, "LayerStep", "a plain layer's fused decode step: sides pointed at the rows, rows appended")
      .def(py::init([](std::vector<py::object> k_sides, std::vector<py::object> v_sides,
                       std::vector<torch::Tensor> k_bufs, std::vector<torch::Tensor> v_bufs, OptT k_head, OptT v_head,
                       torch::Tensor k_tail, torch::Tensor v_tail, py::object k_enc, py::object v_enc,
                       torch::Tensor like) {
             for (auto* e : {&k_enc, &v_enc}) (void)e->cast<const HeadsEncoder&>();  // (an encoder, or a TypeError)
             for (auto* ss : {&k_sides, &v_sides})
               for (auto& o : *ss) (void)o.cast<SideDesc&>();
             LayerStep st;
             st.sides = {std::move(k_sides), std::move(v_sides)};
             st.bufs = {std::move(k_bufs), std::move(v_bufs)};
             st.head = {std::move(k_head), std::move(v_head)};
             st.tail = {std::move(k_tail), std::move(v_tail)};
             st.enc = {std::move(k_enc), std::move(v_enc)};
             st.dt = like.scalar_type();
             return st;
           }),
           py::arg("k_sides"), py::arg("v_sides"), py::arg("k_bufs"), py::arg("v_bufs"), py::arg("k_head"),
           py::arg("v_head"), py::arg("k_tail"), py::arg("v_tail"), py::arg("k_encoder"), py::arg("v_encoder"),
           py::arg("compute_like"))
      .def("step", &LayerStep::step, py::arg("k"), py::arg("v"), py::arg("ints"));
  m.def("simd_turbo_bits", &simd_turbo_bits, "turbo widths decoded in SIMD order when head_dim % 64 == 0 (fp32)");
  m.def("simd_order", &simd_order, "the coordinate each position holds when a turbo row decodes in SIMD order");
  m.def("rules", []() {
    py::dict d;
    d["isa"] = isa_name();
    d["min_block"] = MIN_BLOCK;
    d["max_block"] = MAX_BLOCK;
    d["blocks_per_thread"] = BLOCKS_PER_THREAD;
    d["simd_dim_multiple"] = SIMD_DIM_MULTIPLE;
    d["simd_turbo_bits"] = simd_turbo_bits();
    d["score_int8_bits"] = TQ_VNNI ? (TQ_VBMI ? std::vector<int64_t>{4, 3, 2} : std::vector<int64_t>{4, 2})
                                   : std::vector<int64_t>{};
    d["score_int16_pcaq"] = static_cast<bool>(TQ_VBMI && TQ_VNNI);  // pcaq keys: float32, head_dim % 64, widths <= 7
    d["pcaq_level_steps"] = PQ_LEVEL_STEPS;  // pcaq 16-bit scoring: level steps each side of zero per head
    d["pcaq_lo_split"] = PQ_LO_SPLIT;        // and how much finer the query's lo part is than its hi part
    d["max_head_dim"] = MAX_HEAD_DIM;
    d["max_dense_chunks"] = MAX_DENSE_CHUNKS;
    return d;
  }, "the kernel's rules: ISA, token blocks, SIMD widths and head-dim multiple, limits");
}
