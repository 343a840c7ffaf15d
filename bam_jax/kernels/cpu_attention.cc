// Fused causal attention forward for CPU, an XLA FFI custom call (bam_jax/kernels/cpu.py).
//
// A task is (batch row, kv head, up to kBlocksPerTask blocks of kBlockQ queries, for every
// query head sharing that kv head). It walks the kBlockK-key tiles its queries can see,
// nearest first; each tile's keys and values are copied once into contiguous buffers and
// serve all of the task's query blocks. For one query block the tile's logits are keys-major
// (each vector holds 16 queries), from a register-blocked product that broadcasts key
// elements; the prior (read from the per-head table over distances, reversed so that a
// key's values for consecutive queries are contiguous), the masks and the exponential are
// applied while they are in registers, and the probabilities are multiplied into the
// block's accumulator while the tile is still in cache. Nothing of size T x S is written.
//
// Logits are in log2 units (softmax via exp2) and float32, as in the Pallas kernels:
//   logit = (q . k) * content_i - table[h, s - i + table_q_len - 1] * prior_i
// with content_i = log2(e) / sqrt(D) (times SSMax's s_h log n_i) and prior_i = log2(e)
// (times the same SSMax factor when the prior is scaled with the content). The softmax's
// shift per row is raised only when a logit exceeds it by kSlack (see TileProbabilities);
// any shift gives the same softmax, and the log-sum-exp is shift + log2(sum).
//
// q, k and v are float32 or bfloat16 (widened to float32 as they are copied into a tile).
//
// Tasks are split over threads by an atomic counter; each task is computed by one thread
// in a fixed order, so results do not depend on the thread count. The threads are XLA's
// own (the FFI thread pool) where the runtime offers them, else threads started for the
// call; either way no more than the CPUs this process may use (affinity and cgroup quota,
// read at every call), and the calling thread works too, so a pool that never runs the
// scheduled helpers, or threads that cannot be started, only make the call slower.

#include <sched.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <condition_variable>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <fstream>
#include <limits>
#include <memory>
#include <mutex>
#include <new>
#include <optional>
#include <string>
#include <system_error>
#include <thread>
#include <vector>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr int kLanes = 16;
constexpr int kBlockQ = 64;
constexpr int kBlockK = 256;
constexpr float kLn2 = 0.6931471805599453f;
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

typedef float Vec __attribute__((vector_size(64)));
typedef float VecU __attribute__((vector_size(64), aligned(4)));
typedef int32_t IVec __attribute__((vector_size(64)));
typedef int32_t IVecU __attribute__((vector_size(64), aligned(4)));

inline Vec Load(const float* p) { return *reinterpret_cast<const VecU*>(p); }
inline void Store(float* p, Vec v) { *reinterpret_cast<VecU*>(p) = v; }
inline IVec LoadInt(const int32_t* p) { return *reinterpret_cast<const IVecU*>(p); }
// Element-wise initialisation, which compiles to one broadcast (`Vec{} + x` would add a zero).
inline Vec Splat(float x) { return Vec{x, x, x, x, x, x, x, x, x, x, x, x, x, x, x, x}; }
inline IVec SplatInt(int32_t x) { return IVec{x, x, x, x, x, x, x, x, x, x, x, x, x, x, x, x}; }

// bfloat16 is the upper half of a float32: widening is a 16-bit shift.
typedef uint16_t HalfVecU __attribute__((vector_size(32), aligned(2)));
inline Vec LoadBf16(const uint16_t* p) {
  return (Vec)(__builtin_convertvector(*reinterpret_cast<const HalfVecU*>(p), IVec) << 16);
}
inline float Bf16ToFloat(uint16_t x) {
  const uint32_t bits = static_cast<uint32_t>(x) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

// 2 ** f for |f| <= 1/2: its degree-6 Taylor polynomial (remainder below 1.2e-7).
inline Vec Exp2Fraction(Vec f) {
  Vec p = Splat(1.5403530393381606e-4f);
  p = p * f + 1.3333558146428443e-3f;
  p = p * f + 9.6181291076284772e-3f;
  p = p * f + 5.5504108664821580e-2f;
  p = p * f + 2.4022650695910071e-1f;
  p = p * f + 6.9314718055994531e-1f;
  return p * f + 1.0f;
}

// 2 ** x for x <= 127 (the softmax's x - shift is at most kSlack), about 1 ulp: x = n + f
// with n an integer, 2 ** f by its polynomial, n added to the exponent. 0 below -126 (-inf
// included; the denormals' share of a sum that holds a 1 is below float32 resolution);
// NaN stays NaN.
#if defined(__AVX512F__)
inline Vec Exp2(Vec x) {
  // max(lowest, x) keeps a NaN x; vscalefps applies 2 ** n, underflowing to 0.
  const __m512 clamped = _mm512_max_ps(Splat(-150.0f), x);
  const __m512 n = _mm512_roundscale_ps(clamped, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  return _mm512_scalef_ps(Exp2Fraction(clamped - n), n);
}
#else
inline Vec Exp2(Vec x) {
  const Vec lowest = Splat(-126.0f);
  const Vec clamped = x < lowest ? lowest : x;
  const Vec round_magic = Splat(12582912.0f);  // 1.5 * 2 ** 23: adding it rounds to an integer
  const Vec n = (clamped + round_magic) - round_magic;
  const Vec p = Exp2Fraction(clamped - n);
  const IVec bits = (IVec)p + (__builtin_convertvector(n, IVec) << 23);
  const Vec zeroed = x < lowest ? Splat(0.0f) : (Vec)bits;
  return x != x ? x : zeroed;
}
#endif

struct Problem {
  const void* q;             // [B, T, H, D]
  const void* k;             // [B, S, K, D]
  const void* v;             // [B, S, K, D]
  bool bf16;                 // q, k and v are bfloat16 (else float32)
  const float* table;        // [H, X]: the prior's magnitude over distances, reversed
  const float* head_params;  // [H, kHeadParams]: column 3 is SSMax's scale
  const float* log_n;        // [B, T]: SSMax's log n_i
  const int32_t* q_seg;      // [B, T]
  const int32_t* k_seg;      // [B, S]
  float* out;                // [B, T, H, D]
  float* lse;                // [B, H, T], natural log, +inf for rows that see no key
  int64_t batch, q_len, heads, head_dim, kv_slots, kv_heads, table_len, table_q_len;
  int64_t offset, kv_len, window;  // window < 0: none
  bool causal, prior, ssmax, prior_inside, segments;
  float content_scale;
  int64_t padded_dim;  // head_dim rounded up to whole vectors
};

// Element `index` of q, k or v, as float32.
inline float InputAt(const Problem& pr, const void* base, int64_t index) {
  if (pr.bf16) return Bf16ToFloat(static_cast<const uint16_t*>(base)[index]);
  return static_cast<const float*>(base)[index];
}

// Elements index .. index + 15 of q, k or v, as float32.
inline Vec InputVecAt(const Problem& pr, const void* base, int64_t index) {
  if (pr.bf16) return LoadBf16(static_cast<const uint16_t*>(base) + index);
  return Load(static_cast<const float*>(base) + index);
}

constexpr int kHeadParams = 8;
constexpr int kSsmaxColumn = 3;
constexpr int kRowVecs = kBlockQ / kLanes;
constexpr int kBlocksPerTask = 8;  // query blocks sharing each key tile a task loads

// A query block's rows as kRowVecs vectors.
struct Rows {
  Vec v[kRowVecs];
};

// One query block of one head: its queries (transposed), its row data and its
// online-softmax state.
struct QueryBlock {
  std::vector<float> q_t, acc;
  Rows row_max, row_sum, content_coef, prior_coef;
  IVec query_pos[kRowVecs], query_seg[kRowVecs];
  int64_t h, first_row, rows;
  int64_t lo, hi;  // the key slots its queries may see

  explicit QueryBlock(int64_t dim) : q_t(dim * kBlockQ), acc(kBlockQ * dim) {}
};

// Per-thread buffers, reused by every task the thread runs: the current key tile (keys
// and values copied contiguous, values zero-padded to whole vectors), the logits of one
// query block against it, keys-major (scores[j * kBlockQ + r]: every vector holds 16
// queries, so the products broadcast key elements), and the task's query blocks.
struct Scratch {
  std::vector<float> keys, values, scores;
  std::vector<int32_t> key_seg;
  std::vector<QueryBlock> blocks;

  // For tasks of at most `blocks_per_task` query blocks (fewer than kBlocksPerTask when
  // the queries are few).
  Scratch(int64_t dim, int64_t groups, int64_t blocks_per_task)
      : keys(kBlockK * dim), values(kBlockK * dim), scores(kBlockK * kBlockQ), key_seg(kBlockK) {
    blocks.reserve(blocks_per_task * groups);
    for (int64_t n = 0; n < blocks_per_task * groups; ++n) blocks.emplace_back(dim);
  }
};

// Whether every query of the block sees every key of the tile (no mask needed).
bool TileFullyVisible(const Problem& pr, const QueryBlock& qb, int64_t first) {
  if (pr.segments || pr.window >= 0 || first + kBlockK > pr.kv_len) return false;
  return !pr.causal || first + kBlockK - 1 <= pr.offset + qb.first_row;
}

// What turns a tile's scores into log2 logits: the prior's row of the (reversed) table and
// whether masks apply.
struct TileTerms {
  const float* prior;  // entry of key j and row vector c: prior[c * kLanes - j]
  int64_t first;
  bool full;
};

TileTerms TileTermsOf(const Problem& pr, const QueryBlock& qb, int64_t first) {
  // Key slot `first + j` and query row i meet at reversed-table entry
  // table_len - (first + j) + i - table_q_len, ascending in i.
  const float* prior = pr.prior ? pr.table + qb.h * pr.table_len +
                                      (pr.table_len - first + qb.first_row - pr.table_q_len)
                                : nullptr;
  return {prior, first, TileFullyVisible(pr, qb, first)};
}

// Log2 logits of key j of the tile for the 16 queries of row vector c.
inline Vec Logits(const Problem& pr, const TileTerms& tile, const QueryBlock& qb,
                  const int32_t* key_seg, int64_t j, int c, Vec scores) {
  scores *= qb.content_coef.v[c];
  if (tile.prior != nullptr) scores -= Load(tile.prior + c * kLanes - j) * qb.prior_coef.v[c];
  if (tile.full) return scores;
  const int32_t key_pos = static_cast<int32_t>(tile.first + j);
  const IVec behind = qb.query_pos[c] - key_pos;
  IVec visible = SplatInt(key_pos < pr.kv_len ? -1 : 0);
  if (pr.causal) visible &= behind >= 0;
  if (pr.window >= 0) {
    const int32_t window = static_cast<int32_t>(pr.window);
    visible &= behind <= window;
    if (!pr.causal) visible &= behind >= -window;
  }
  if (pr.segments) {
    visible &= qb.query_seg[c] == key_seg[j];
    if (key_seg[j] < 0) visible = SplatInt(0);
  }
  return visible ? scores : Splat(kNegInf);
}

// Whether any lane of a comparison holds.
inline bool AnyLane(IVec mask) {
#if defined(__AVX512F__)
  return _mm512_test_epi32_mask((__m512i)mask, (__m512i)mask) != 0;
#else
  int32_t any = 0;
  for (int l = 0; l < kLanes; ++l) any |= mask[l];
  return any != 0;
#endif
}

// 2 ** (from - to) for shifts that may be -inf (no key seen yet): 1 when `to` is -inf.
inline Vec ShiftRatio(Vec from, Vec to) {
  return to == Splat(kNegInf) ? Splat(1.0f) : Exp2(from - to);
}

// How far (log2 units) a logit may exceed its row's shift before the shift is raised:
// probabilities stay below 2 ** kSlack, so a row's sum cannot overflow.
constexpr float kSlack = 8.0f;

// The block's online-softmax step against the tile's first `count` keys: logits (prior and
// masks applied) from register tiles of 4 keys x 64 queries, exponentiated against the
// row's shift while still in registers and stored (s.scores) for TileValues; the row sums
// grow by them. The shift (qb.row_max) is raised only when a logit exceeds it by kSlack, so
// the tile is never read back for its max; keys run nearest first (the largest prior
// first), which makes raises rare. Returns the factor the accumulator's rows must be
// rescaled by.
Rows TileProbabilities(const Problem& pr, QueryBlock& qb, int64_t first, int64_t count,
                       Scratch& s) {
  constexpr int kKeys = 4;
  const TileTerms tile = TileTermsOf(pr, qb, first);
  const int64_t dim = pr.head_dim;
  const Rows start_shift = qb.row_max;
  Rows sum;
  for (int c = 0; c < kRowVecs; ++c) sum.v[c] = Splat(0.0f);
  for (int64_t j0 = (count - 1) / kKeys * kKeys; j0 >= 0; j0 -= kKeys) {
    const float* keys = s.keys.data() + j0 * dim;  // stale rows past `count` are not stored
    Vec acc[kKeys][kRowVecs] = {};
    for (int64_t d = 0; d < dim; ++d) {
      Vec query[kRowVecs];
#pragma GCC unroll 4
      for (int c = 0; c < kRowVecs; ++c) query[c] = Load(qb.q_t.data() + d * kBlockQ + c * kLanes);
#pragma GCC unroll 4
      for (int j = 0; j < kKeys; ++j) {
        const Vec k = Splat(keys[j * dim + d]);
#pragma GCC unroll 4
        for (int c = 0; c < kRowVecs; ++c) acc[j][c] += k * query[c];
      }
    }
    const int keys_here = static_cast<int>(std::min<int64_t>(kKeys, count - j0));
    for (int c = 0; c < kRowVecs; ++c) {
      Vec logits[kKeys];
      Vec group_max = Splat(kNegInf);
      for (int j = 0; j < keys_here; ++j) {
        logits[j] = Logits(pr, tile, qb, s.key_seg.data(), j0 + j, c, acc[j][c]);
        group_max = group_max > logits[j] ? group_max : logits[j];
      }
      Vec& shift = qb.row_max.v[c];
      const IVec raise = group_max > shift + kSlack;
      if (AnyLane(raise)) {
        const Vec new_shift = raise ? group_max : shift;
        const Vec factor = ShiftRatio(shift, new_shift);
        for (int64_t j = j0 + kKeys; j < count; ++j) {
          float* p = s.scores.data() + j * kBlockQ + c * kLanes;
          Store(p, Load(p) * factor);
        }
        sum.v[c] *= factor;
        shift = new_shift;
      }
      const Vec safe_shift = shift == Splat(kNegInf) ? Splat(0.0f) : shift;
      for (int j = 0; j < keys_here; ++j) {
        const Vec p = Exp2(logits[j] - safe_shift);
        Store(s.scores.data() + (j0 + j) * kBlockQ + c * kLanes, p);
        sum.v[c] += p;
      }
    }
  }
  Rows correction;
  for (int c = 0; c < kRowVecs; ++c) {
    correction.v[c] = ShiftRatio(start_shift.v[c], qb.row_max.v[c]);
    qb.row_sum.v[c] = qb.row_sum.v[c] * correction.v[c] + sum.v[c];
  }
  return correction;
}

// Rows per register tile of TileUpdate: at most 16 accumulators, and a divisor of kBlockQ.
constexpr int UpdateRows(int vecs) { return vecs <= 1 ? 16 : vecs <= 2 ? 8 : vecs <= 4 ? 4 : 2; }

// acc[64, kVecs * 16] = acc * correction (per row) + probs^T . values[count, kVecs * 16].
// The tile's products are summed on their own before joining acc, so rounding grows with
// the tile and the number of tiles rather than with the whole key count.
template <int kVecs>
void TileUpdate(const float* probs, const float* values, int64_t count, const float* correction,
                float* acc) {
  constexpr int kRows = UpdateRows(kVecs);
  constexpr int64_t dim = kVecs * kLanes;
  for (int r0 = 0; r0 < kBlockQ; r0 += kRows) {
    Vec sums[kRows][kVecs] = {};
    for (int64_t j = 0; j < count; ++j) {
      Vec value[kVecs];
#pragma GCC unroll 8
      for (int c = 0; c < kVecs; ++c) value[c] = Load(values + j * dim + c * kLanes);
#pragma GCC unroll 16
      for (int r = 0; r < kRows; ++r) {
        const Vec p = Splat(probs[j * kBlockQ + r0 + r]);
#pragma GCC unroll 8
        for (int c = 0; c < kVecs; ++c) sums[r][c] += p * value[c];
      }
    }
    for (int r = 0; r < kRows; ++r) {
      const Vec factor = Splat(correction[r0 + r]);
      for (int c = 0; c < kVecs; ++c) {
        float* row = acc + (r0 + r) * dim + c * kLanes;
        Store(row, Load(row) * factor + sums[r][c]);
      }
    }
  }
}

// Heads wider than 8 vectors: a plain loop (the compiler vectorises the inner one).
void TileUpdateWide(const float* probs, const float* values, int64_t count,
                    const float* correction, float* acc, int64_t dim) {
  for (int r = 0; r < kBlockQ; ++r) {
    for (int64_t d = 0; d < dim; ++d) acc[r * dim + d] *= correction[r];
    for (int64_t j = 0; j < count; ++j) {
      const float p = probs[j * kBlockQ + r];
      for (int64_t d = 0; d < dim; ++d) acc[r * dim + d] += p * values[j * dim + d];
    }
  }
}

// Rescales the block's accumulator by the softmax's correction and adds the tile's
// probabilities (in s.scores) times its values.
void TileValues(const Problem& pr, QueryBlock& qb, int64_t count, const Rows& correction,
                Scratch& s) {
  const float* probs = s.scores.data();
  const float* values = s.values.data();
  float factor[kBlockQ];
  for (int c = 0; c < kRowVecs; ++c) Store(factor + c * kLanes, correction.v[c]);
  float* acc = qb.acc.data();
  switch (pr.padded_dim / kLanes) {
    case 1: return TileUpdate<1>(probs, values, count, factor, acc);
    case 2: return TileUpdate<2>(probs, values, count, factor, acc);
    case 3: return TileUpdate<3>(probs, values, count, factor, acc);
    case 4: return TileUpdate<4>(probs, values, count, factor, acc);
    case 5: return TileUpdate<5>(probs, values, count, factor, acc);
    case 6: return TileUpdate<6>(probs, values, count, factor, acc);
    case 7: return TileUpdate<7>(probs, values, count, factor, acc);
    case 8: return TileUpdate<8>(probs, values, count, factor, acc);
    default: return TileUpdateWide(probs, values, count, factor, acc, pr.padded_dim);
  }
}

// First and one-past-last key slot the queries from first_row (rows of them) may see.
void KeyRange(const Problem& pr, int64_t first_row, int64_t rows, int64_t* lo, int64_t* hi) {
  const int64_t first_pos = pr.offset + first_row;
  const int64_t last_pos = first_pos + rows - 1;
  *lo = pr.window >= 0 ? std::max<int64_t>(0, first_pos - pr.window) : 0;
  int64_t stop = pr.kv_len;
  if (pr.causal) {
    stop = std::min(stop, last_pos + 1);
  } else if (pr.window >= 0) {
    stop = std::min(stop, last_pos + pr.window + 1);
  }
  *hi = std::min(stop, pr.kv_slots);
}

// Loads a query block of head h from first_row and resets its softmax state.
void StartBlock(const Problem& pr, int64_t b, int64_t h, int64_t first_row, QueryBlock& qb) {
  qb.h = h;
  qb.first_row = first_row;
  qb.rows = std::min<int64_t>(kBlockQ, pr.q_len - first_row);
  KeyRange(pr, first_row, qb.rows, &qb.lo, &qb.hi);
  std::fill(qb.q_t.begin(), qb.q_t.end(), 0.0f);
  std::fill(qb.acc.begin(), qb.acc.end(), 0.0f);
  const float ssmax_scale = pr.ssmax ? pr.head_params[h * kHeadParams + kSsmaxColumn] : 1.0f;
  float content_coef[kBlockQ], prior_coef[kBlockQ];
  int32_t query_pos[kBlockQ], query_seg[kBlockQ];
  for (int64_t r = 0; r < kBlockQ; ++r) {
    const int64_t i = first_row + std::min(r, qb.rows - 1);  // padding rows repeat the last
    const float factor = pr.ssmax ? ssmax_scale * pr.log_n[b * pr.q_len + i] : 1.0f;
    content_coef[r] = pr.content_scale * factor;
    prior_coef[r] = (pr.ssmax && pr.prior_inside ? factor : 1.0f) * 1.4426950408889634f;
    query_pos[r] = static_cast<int32_t>(pr.offset + first_row + r);
    query_seg[r] = pr.segments ? pr.q_seg[b * pr.q_len + i] : 0;
    if (r >= qb.rows) continue;
    const int64_t src = ((b * pr.q_len + i) * pr.heads + h) * pr.head_dim;
    for (int64_t d = 0; d < pr.head_dim; ++d) qb.q_t[d * kBlockQ + r] = InputAt(pr, pr.q, src + d);
  }
  for (int c = 0; c < kRowVecs; ++c) {
    qb.row_max.v[c] = Splat(kNegInf);
    qb.row_sum.v[c] = Splat(0.0f);
    qb.content_coef.v[c] = Load(content_coef + c * kLanes);
    qb.prior_coef.v[c] = Load(prior_coef + c * kLanes);
    qb.query_pos[c] = LoadInt(query_pos + c * kLanes);
    qb.query_seg[c] = LoadInt(query_seg + c * kLanes);
  }
}

// Copies the tile's keys, values and key segment ids. The values' padding columns stay
// zero from the buffer's construction; key rows past `count` keep stale finite values, whose
// scores TileLogits computes (in groups of 4) but never stores.
void LoadTile(const Problem& pr, int64_t b, int64_t kv_head, int64_t first, int64_t count,
              Scratch& s) {
  const int64_t dim = pr.head_dim;
  const int64_t padded = pr.padded_dim;
  const int64_t stride = pr.kv_heads * dim;
  const int64_t start = ((b * pr.kv_slots + first) * pr.kv_heads + kv_head) * dim;
  for (int64_t j = 0; j < count; ++j) {
    const int64_t row = start + j * stride;
    if (dim == padded) {
      for (int64_t d = 0; d < dim; d += kLanes) {
        Store(s.keys.data() + j * dim + d, InputVecAt(pr, pr.k, row + d));
        Store(s.values.data() + j * dim + d, InputVecAt(pr, pr.v, row + d));
      }
    } else {
      for (int64_t d = 0; d < dim; ++d) {
        s.keys[j * dim + d] = InputAt(pr, pr.k, row + d);
        s.values[j * padded + d] = InputAt(pr, pr.v, row + d);
      }
    }
    s.key_seg[j] = pr.segments ? pr.k_seg[b * pr.kv_slots + first + j] : 0;
  }
}

void WriteRows(const Problem& pr, int64_t b, const QueryBlock& qb) {
  const int64_t dim = pr.padded_dim;
  for (int64_t r = 0; r < qb.rows; ++r) {
    const int64_t i = qb.first_row + r;
    const float sum = qb.row_sum.v[r / kLanes][r % kLanes];
    const float max = qb.row_max.v[r / kLanes][r % kLanes];
    const bool seen = sum != 0.0f;  // a NaN sum (NaN inputs) is written out as NaN
    const float inverse = seen ? 1.0f / sum : 0.0f;
    float* dst = pr.out + ((b * pr.q_len + i) * pr.heads + qb.h) * pr.head_dim;
    for (int64_t d = 0; d < pr.head_dim; ++d) dst[d] = seen ? qb.acc[r * dim + d] * inverse : 0.0f;
    pr.lse[(b * pr.heads + qb.h) * pr.q_len + i] =
        seen ? (max + std::log2(sum)) * kLn2 : std::numeric_limits<float>::infinity();
  }
}

// A task: up to kBlocksPerTask query blocks from block `first_block`, for every query head
// of one (batch row, kv head). Each key tile is loaded once and serves all of them.
void RunTask(const Problem& pr, int64_t b, int64_t kv_head, int64_t first_block, Scratch& s) {
  const int64_t groups = pr.heads / pr.kv_heads;
  const int64_t q_blocks = (pr.q_len + kBlockQ - 1) / kBlockQ;
  const int64_t num_blocks = std::min<int64_t>(kBlocksPerTask, q_blocks - first_block);
  int64_t lo = pr.kv_slots, hi = 0;
  std::vector<QueryBlock*> active;
  for (int64_t n = 0; n < num_blocks; ++n) {
    for (int64_t g = 0; g < groups; ++g) {
      QueryBlock& qb = s.blocks[n * groups + g];
      StartBlock(pr, b, kv_head * groups + g, (first_block + n) * kBlockQ, qb);
      lo = std::min(lo, qb.lo);
      hi = std::max(hi, qb.hi);
      active.push_back(&qb);
    }
  }
  // Nearest tiles first (see TileProbabilities).
  for (int64_t first = (hi - 1) / kBlockK * kBlockK; hi > lo && first >= lo / kBlockK * kBlockK;
       first -= kBlockK) {
    LoadTile(pr, b, kv_head, first, std::min<int64_t>(kBlockK, hi - first), s);
    for (QueryBlock* qb : active) {
      if (first >= qb->hi || first + kBlockK <= qb->lo) continue;
      const int64_t count = std::min<int64_t>(kBlockK, qb->hi - first);
      const Rows correction = TileProbabilities(pr, *qb, first, count, s);
      TileValues(pr, *qb, count, correction, s);
    }
  }
  for (QueryBlock* qb : active) WriteRows(pr, b, *qb);
}

// CPUs the process's cgroups let it use (cgroup v2 cpu.max, v1 cpu.cfs_quota_us over
// cpu.cfs_period_us), rounded up; 0 when no quota applies. Every level from the process's
// cgroup up to the mount's root is read, and the smallest quota wins: inside a container the
// listed path may not exist under the mount, whose root then holds the container's limit.
int64_t QuotaCpus(int64_t quota, int64_t period) {
  return quota > 0 && period > 0 ? (quota + period - 1) / period : 0;
}

int64_t CgroupLevelCpus(const std::string& dir, bool v2) {
  int64_t quota = 0, period = 0;
  if (v2) {
    std::ifstream file(dir + "/cpu.max");
    std::string max;
    if (!(file >> max >> period) || max == "max") return 0;
    quota = std::atoll(max.c_str());
  } else {
    std::ifstream quota_file(dir + "/cpu.cfs_quota_us"), period_file(dir + "/cpu.cfs_period_us");
    if (!(quota_file >> quota) || !(period_file >> period)) return 0;
  }
  return QuotaCpus(quota, period);
}

int64_t CgroupCpus() {
  std::ifstream cgroups("/proc/self/cgroup");
  std::string line;
  int64_t limit = 0;
  while (std::getline(cgroups, line)) {  // hierarchy:controllers:path
    const size_t first = line.find(':');
    const size_t second = first == std::string::npos ? first : line.find(':', first + 1);
    if (second == std::string::npos) continue;
    const std::string controllers = line.substr(first + 1, second - first - 1);
    const bool v2 = controllers.empty();
    if (!v2 && ("," + controllers + ",").find(",cpu,") == std::string::npos) continue;
    const std::vector<std::string> mounts =
        v2 ? std::vector<std::string>{"/sys/fs/cgroup", "/sys/fs/cgroup/unified"}
           : std::vector<std::string>{"/sys/fs/cgroup/" + controllers, "/sys/fs/cgroup/cpu"};
    for (const std::string& mount : mounts) {
      for (std::string path = line.substr(second + 1);; path.resize(path.rfind('/'))) {
        const int64_t cpus = CgroupLevelCpus(mount + path, v2);
        if (cpus > 0) limit = limit > 0 ? std::min(limit, cpus) : cpus;
        if (path.find('/') == std::string::npos) break;
      }
    }
  }
  return limit;
}

// The CPUs this thread may run on (affinity), capped by the cgroup quota; read at every
// call, so a changed affinity or quota applies at once.
int64_t AllowedCpus() {
  int64_t cpus = std::thread::hardware_concurrency();
  cpu_set_t set;
  if (sched_getaffinity(0, sizeof set, &set) == 0) cpus = CPU_COUNT(&set);
  const int64_t quota = CgroupCpus();
  if (quota > 0) cpus = std::min(cpus, quota);
  return std::max<int64_t>(1, cpus);
}

// One call's tasks, shared by the threads that run them. Helpers hold it by shared_ptr: one
// that starts after the call has returned finds no task left and touches nothing else.
struct Work {
  Problem pr;
  int64_t num_tasks = 0, spans = 0, rows = 0, blocks_per_task = 0;
  std::atomic<int64_t> next{0}, finished{0};
  std::mutex mutex;
  std::condition_variable all_finished;
  std::exception_ptr error;  // the first failure of a task, under `mutex`
};

void RunTaskNumber(const Work& w, int64_t n, std::optional<Scratch>& scratch) {
  const Problem& pr = w.pr;
  if (!scratch) scratch.emplace(pr.padded_dim, pr.heads / pr.kv_heads, w.blocks_per_task);
  // Latest query blocks (the most keys) first, so the threads finish together.
  const int64_t span = w.spans - 1 - n / w.rows;
  RunTask(pr, (n % w.rows) / pr.kv_heads, n % pr.kv_heads, span * kBlocksPerTask, *scratch);
}

// Runs tasks until none is left; buffers are allocated once a task is claimed. Nothing is
// thrown: a failure is kept for the calling thread to report.
void Drain(Work& w) noexcept {
  std::optional<Scratch> scratch;
  for (int64_t n = w.next++; n < w.num_tasks; n = w.next++) {
    try {
      RunTaskNumber(w, n, scratch);
    } catch (...) {
      std::lock_guard<std::mutex> lock(w.mutex);
      if (!w.error) w.error = std::current_exception();
    }
    if (++w.finished == w.num_tasks) {
      std::lock_guard<std::mutex> lock(w.mutex);
      w.all_finished.notify_all();
    }
  }
}

// Up to `helpers` threads running Drain; fewer when the system refuses to start more
// (process or memory limits), the calling thread doing their share.
std::vector<std::thread> StartHelpers(const std::shared_ptr<Work>& work, int64_t helpers) {
  std::vector<std::thread> threads;
  threads.reserve(helpers);
  for (int64_t n = 0; n < helpers; ++n) {
    try {
      threads.emplace_back([work] { Drain(*work); });
    } catch (const std::system_error&) {
      break;
    }
  }
  return threads;
}

// XLA's pool may run the helpers late, one at a time or on the calling thread itself (the
// FFI API promises no parallelism), so the call never waits for a helper that has not
// claimed a task.
void ScheduleHelpers(ffi::ThreadPool& pool, const std::shared_ptr<Work>& work, int64_t helpers) {
  for (int64_t n = 0; n < helpers; ++n) {
    try {
      pool.Schedule([work] { Drain(*work); });
    } catch (const std::bad_alloc&) {
      break;
    }
  }
}

void RunAll(const Problem& pr, ffi::ThreadPool& pool) {
  auto work = std::make_shared<Work>();
  const int64_t q_blocks = (pr.q_len + kBlockQ - 1) / kBlockQ;
  work->pr = pr;
  work->blocks_per_task = std::min<int64_t>(kBlocksPerTask, q_blocks);
  work->spans = (q_blocks + kBlocksPerTask - 1) / kBlocksPerTask;
  work->rows = pr.batch * pr.kv_heads;
  work->num_tasks = work->rows * work->spans;
  const int64_t pool_threads = pool.num_threads();
  int64_t helpers = std::min(AllowedCpus(), work->num_tasks) - 1;
  std::vector<std::thread> threads;
  if (pool_threads > 0) {
    ScheduleHelpers(pool, work, std::min(helpers, pool_threads));
  } else if (helpers > 0) {
    threads = StartHelpers(work, helpers);
  }
  Drain(*work);
  {
    std::unique_lock<std::mutex> lock(work->mutex);
    work->all_finished.wait(lock, [&] { return work->finished == work->num_tasks; });
  }
  for (std::thread& thread : threads) thread.join();
  if (work->error) std::rethrow_exception(work->error);
}

bool SupportedInputs(const ffi::AnyBuffer& q, const ffi::AnyBuffer& k, const ffi::AnyBuffer& v) {
  const ffi::DataType type = q.element_type();
  return (type == ffi::DataType::F32 || type == ffi::DataType::BF16) &&
         k.element_type() == type && v.element_type() == type;
}

ffi::Error Forward(ffi::ThreadPool pool, ffi::AnyBuffer q, ffi::AnyBuffer k, ffi::AnyBuffer v,
                   ffi::Buffer<ffi::F32> table, ffi::Buffer<ffi::F32> head_params,
                   ffi::Buffer<ffi::F32> log_n, ffi::Buffer<ffi::S32> q_seg,
                   ffi::Buffer<ffi::S32> k_seg, ffi::Buffer<ffi::S32> offset,
                   ffi::ResultBuffer<ffi::F32> out, ffi::ResultBuffer<ffi::F32> lse,
                   int64_t causal, int64_t window, int64_t kv_len, int64_t has_prior,
                   int64_t ssmax, int64_t prior_inside, int64_t segments, int64_t table_q_len,
                   float content_scale) {
  const auto q_dims = q.dimensions();
  const auto k_dims = k.dimensions();
  if (q_dims.size() != 4 || k_dims.size() != 4 || v.dimensions().size() != 4) {
    return ffi::Error::InvalidArgument("cpu attention: q, k and v must be rank 4");
  }
  if (!SupportedInputs(q, k, v)) {
    return ffi::Error::InvalidArgument(
        "cpu attention: q, k and v must all be float32 or all bfloat16");
  }
  if (window > std::numeric_limits<int32_t>::max()) {
    return ffi::Error::InvalidArgument(
        "cpu attention: window must be below 2**31 (positions are int32); pass a smaller one");
  }
  Problem pr{};
  pr.q = q.untyped_data();
  pr.k = k.untyped_data();
  pr.v = v.untyped_data();
  pr.bf16 = q.element_type() == ffi::DataType::BF16;
  pr.table = table.typed_data();
  pr.head_params = head_params.typed_data();
  pr.log_n = log_n.typed_data();
  pr.q_seg = q_seg.typed_data();
  pr.k_seg = k_seg.typed_data();
  pr.out = out->typed_data();
  pr.lse = lse->typed_data();
  pr.batch = q_dims[0];
  pr.q_len = q_dims[1];
  pr.heads = q_dims[2];
  pr.head_dim = q_dims[3];
  pr.kv_slots = k_dims[1];
  pr.kv_heads = k_dims[2];
  pr.table_len = table.dimensions()[1];
  pr.table_q_len = table_q_len;
  pr.offset = offset.typed_data()[0];
  pr.kv_len = kv_len;
  pr.window = window;
  pr.causal = causal != 0;
  pr.prior = has_prior != 0;
  pr.ssmax = ssmax != 0;
  pr.prior_inside = prior_inside != 0;
  pr.segments = segments != 0;
  pr.content_scale = content_scale;
  pr.padded_dim = (pr.head_dim + kLanes - 1) / kLanes * kLanes;
  if (pr.kv_heads <= 0 || pr.heads % pr.kv_heads != 0) {
    return ffi::Error::InvalidArgument("cpu attention: query heads must be a multiple of kv heads");
  }
  if (pr.prior && pr.table_len < pr.kv_slots + table_q_len - 1) {
    return ffi::Error::InvalidArgument("cpu attention: the prior table is too short");
  }
  // Nothing may unwind into XLA: a failure (out of memory, say) becomes the call's error.
  try {
    RunAll(pr, pool);
  } catch (const std::exception& error) {
    return ffi::Error::Internal(std::string("cpu attention failed: ") + error.what());
  } catch (...) {
    return ffi::Error::Internal("cpu attention failed with an unknown exception");
  }
  return ffi::Error::Success();
}

}  // namespace

// Whether this build uses AVX-512: bam_jax/kernels/cpu.py asks before choosing the kernel
// over blockwise attention, which is faster than the portable vector code.
extern "C" __attribute__((visibility("default"))) int BamCpuAttentionHasAvx512() {
#if defined(__AVX512F__)
  return 1;
#else
  return 0;
#endif
}

// The threads a call would use at most now (before capping by its number of tasks).
extern "C" __attribute__((visibility("default"))) int64_t BamCpuAttentionThreads() {
  return AllowedCpus();
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(BamCpuAttentionForward, Forward,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<int64_t>("causal")
                                  .Attr<int64_t>("window")
                                  .Attr<int64_t>("kv_len")
                                  .Attr<int64_t>("has_prior")
                                  .Attr<int64_t>("ssmax")
                                  .Attr<int64_t>("prior_inside")
                                  .Attr<int64_t>("segments")
                                  .Attr<int64_t>("table_q_len")
                                  .Attr<float>("content_scale"));
