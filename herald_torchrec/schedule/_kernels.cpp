// Compiled kernels of the Herald scheduler (control plane): the same arithmetic as the numpy code they replace,
// operation for operation, so plans are bit-identical (tests compare plan digests of both paths).
//
// Built on first use by herald_torchrec/schedule/native.py (a C ABI loaded with ctypes: no torch, no Python
// headers). Floating point must not be contracted (FMA) or reassociated: compile with -ffp-contract=off and
// without -ffast-math. Every array is C-contiguous; ids and counts are int64.
#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <numeric>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <vector>
#if defined(__SSE2__)
#include <emmintrin.h>
#endif

namespace {

// A loop that reads or writes an array over every row (full Criteo tables: 33.8 M rows, DRAM) at the keys it walks
// asks now for the line of the key kAhead places on, so that that many misses overlap where the loop's own work
// would let few: `ahead<1>` for a line the loop will write.
constexpr int64_t kAhead = 16;
template <int Write = 0, typename T>
inline void ahead(const T* a, const int64_t* keys, int64_t i, int64_t n) {
  if (i + kAhead < n) __builtin_prefetch(a + keys[i + kAhead], Write);
}

// A key's table, ROW_WISE home rank and directory host (HeraldHierPolicy.table_of / home_of / directory_host_of) for
// keys taken mostly in ascending order, as a host's sorted keys, moves and victims come: the table walked forward from
// the last key's (a binary search only where a key goes back: one per key mispredicted a branch at each of its ~5
// steps), the home stepped forward a block at a time within a table and divided for only where a key starts a table
// or goes back (a 64-bit division per key was most of a host's demand pass). An ascending pass meets each (table,
// home) once: at most T x R steps. Keys must be in the layout (`in_layout`); P and H only serve `dir`.
struct KeyWalk {
  const int64_t* offsets;  // [T + 1]
  const int64_t* block;    // [T]: ROW_WISE rows per home rank (positive)
  int64_t T, P, H;
  int64_t t = 0, home = 0, dir = 0, lo = 0, hi = 0;  // the rows [lo, hi) of (t, home) and their directory host
  KeyWalk(const int64_t* offsets_, const int64_t* block_, int64_t T_, int64_t P_ = 1, int64_t H_ = 1)
      : offsets(offsets_), block(block_), T(T_), P(P_), H(H_) {}
  bool in_layout(int64_t key) const { return key >= offsets[0] && key < offsets[T]; }
  // the walk at `key`'s table (home not looked at)
  int64_t table(int64_t key) {
    if (key < offsets[t]) t = std::upper_bound(offsets, offsets + T + 1, key) - offsets - 1, lo = hi = 0;
    while (key >= offsets[t + 1]) ++t, lo = hi = 0;
    return t;
  }
  // the walk at `key`'s table and home
  void to(int64_t key) {
    if (static_cast<uint64_t>(key - lo) < static_cast<uint64_t>(hi - lo)) return;  // lo <= key < hi
    table(key);
    if (hi > lo && key >= hi) {  // further in the same table
      do ++home, lo = hi, hi = std::min(lo + block[t], offsets[t + 1]);
      while (key >= hi);
    } else {
      home = (key - offsets[t]) / block[t];
      lo = offsets[t] + home * block[t];
      hi = std::min(lo + block[t], offsets[t + 1]);
    }
    if (H > 1) dir = (home / P + t) % H;  // (a walk for tables and homes only divides no further)
  }
};

// np.argsort(key, kind="stable") of float64 keys.
// (key, index) pairs sorted: the index breaks ties, which is what a stable sort does.
void stable_order(const std::vector<double>& key, std::vector<int64_t>& order) {
  std::vector<std::pair<double, int64_t>> kv(key.size());
  for (size_t i = 0; i < key.size(); ++i) kv[i] = {key[i], static_cast<int64_t>(i)};
  std::sort(kv.begin(), kv.end());
  order.resize(key.size());
  for (size_t i = 0; i < kv.size(); ++i) order[i] = kv[i].second;
}

// laia._key: rank, then regret descending, then score descending.
inline double accept_key(int64_t best, float regret, float bval, double scale) {
  const double c1 = 4.0 * scale * scale + 4.0 * scale;
  const double c2 = 2.0 * scale + 1.0;
  return static_cast<double>(best) * c1 - static_cast<double>(regret) * c2 - static_cast<double>(bval);
}

double abs_max_scale(const float* sc, int64_t n) {
  float m = 0.0f;
  for (int64_t i = 0; i < n; ++i) m = std::max(m, std::fabs(sc[i]));
  return static_cast<double>(m) + 1.0;
}

// laia._two_ranks (rot = identity).
void two_ranks(const float* sc, int64_t N, int64_t B, int64_t* out) {
  int64_t n1 = 0;
  for (int64_t n = 0; n < N; ++n) {
    out[n] = sc[2 * n + 1] > sc[2 * n] ? 1 : 0;
    n1 += out[n];
  }
  if (n1 == B) return;
  const double scale = abs_max_scale(sc, 2 * N);
  std::vector<double> key(N);
  for (int64_t n = 0; n < N; ++n) {
    const int64_t b = out[n];
    const float bval = sc[2 * n + b];
    const float regret = bval - sc[2 * n + 1 - b];
    key[n] = accept_key(b, regret, bval, scale);
  }
  std::vector<int64_t> order;
  stable_order(key, order);
  const int64_t c = n1 > B ? 1 : 0;  // the overfilled column keeps its B best bids
  std::vector<int64_t> col(N, 1 - c);
  int64_t taken = 0;
  for (int64_t i = 0; i < N && taken < B; ++i) {
    const int64_t s = order[i];
    if (out[s] == c) {
      col[s] = c;
      ++taken;
    }
  }
  std::copy(col.begin(), col.end(), out);
}

// laia._rounds (rot = identity): bidding rounds on float32 scores [N, R].
void rounds(const float* sc, int64_t N, int64_t R, int64_t B, int64_t* out) {
  const float neg = -std::numeric_limits<float>::infinity();
  std::vector<int64_t> room(R, B), todo(N);
  std::iota(todo.begin(), todo.end(), int64_t{0});
  std::fill(out, out + N, int64_t{-1});
  const double scale = N ? abs_max_scale(sc, N * R) : 1.0;
  std::vector<int64_t> best, cnt(R), keep;
  std::vector<float> bval, regret;
  std::vector<std::pair<double, int64_t>> bids;
  std::vector<float> closed(R);  // 0 for an open column, -inf for a full one (added: a finite score stays as it is)
  while (true) {
    const int64_t n = static_cast<int64_t>(todo.size());
    if (n == 0) break;
    int64_t nopen = 0, last_open = -1;
    for (int64_t r = 0; r < R; ++r) {
      closed[r] = room[r] > 0 ? 0.0f : neg;
      if (room[r] > 0) ++nopen, last_open = r;
    }
    if (nopen == 1) {
      for (int64_t s : todo) out[s] = last_open;
      break;
    }
    best.assign(n, 0);
    bval.assign(n, 0.0f);
    regret.assign(n, 0.0f);
    std::fill(cnt.begin(), cnt.end(), int64_t{0});
    for (int64_t i = 0; i < n; ++i) {
      // the best column (the first of equals) and the best of the others in one pass, without a branch: which
      // column wins is the data's coin toss
      const float* row = sc + todo[i] * R;
      int64_t b = 0;
      float bv = row[0] + closed[0], second = neg;
      for (int64_t r = 1; r < R; ++r) {
        const float v = row[r] + closed[r];
        const bool gt = v > bv;
        second = gt ? bv : std::max(second, v);
        b = gt ? r : b;
        bv = gt ? v : bv;
      }
      best[i] = b;
      bval[i] = bv;
      regret[i] = bv - second;
      ++cnt[b];
    }
    bool fits = true;
    for (int64_t r = 0; r < R; ++r) fits = fits && cnt[r] <= room[r];
    keep.assign(n, 1);
    if (fits) {
      for (int64_t i = 0; i < n; ++i) out[todo[i]] = best[i], --room[best[i]], keep[i] = 0;
    } else {
      // numpy sorts every bid by accept_key and takes each column's first room[b]: whether a bid is taken depends
      // only on its place among its own column's bids, so a column with room for all takes all, and an overfull
      // one takes its room[b] least (key, index) pairs (a selection, not a sort of every bid)
      for (int64_t i = 0; i < n; ++i)
        if (cnt[best[i]] <= room[best[i]]) out[todo[i]] = best[i], keep[i] = 0;
      for (int64_t r = 0; r < R; ++r) {
        if (cnt[r] <= room[r]) continue;
        bids.clear();
        for (int64_t i = 0; i < n; ++i)
          if (best[i] == r) bids.emplace_back(accept_key(r, regret[i], bval[i], scale), i);
        if (room[r] > 0) {
          std::nth_element(bids.begin(), bids.begin() + (room[r] - 1), bids.end());
          for (int64_t j = 0; j < room[r]; ++j) out[todo[bids[j].second]] = r, keep[bids[j].second] = 0;
        }
      }
      for (int64_t i = 0; i < n; ++i)
        if (!keep[i]) --room[best[i]];
    }
    int64_t m = 0;
    for (int64_t i = 0; i < n; ++i)
      if (keep[i]) todo[m++] = todo[i];
    todo.resize(m);
  }
}

void balanced(const float* sc, int64_t N, int64_t R, int64_t B, int64_t* out) {
  if (R == 2 && N) {
    two_ranks(sc, N, B, out);
  } else {
    rounds(sc, N, R, B, out);
  }
}

// One refine round's per-key scores need, per (key, rank) cell, the count of the key's elements assigned there;
// cells are key-major [K, R] here (a sample's keys then touch R adjacent cells), numpy's are rank-major: the
// counts and scores are the same numbers, and every float sum runs in numpy's order.
template <typename WT>
void refine_rounds(int64_t N, int64_t R, int64_t B, int64_t K, int64_t E, const int64_t* es, const int64_t* ec,
                   int64_t S, const int64_t* own, int64_t refine, WT two, WT ow_t, double owner_weight,
                   double stay_bonus, int64_t* a) {
  // a cell's elements only matter as 0, 1 or more: counted up to 2 in a byte (a quarter of the cache lines)
  std::vector<uint8_t> c(K * R);
  std::vector<double> corr(N), sc64;
  std::vector<float> sc(N * R);
  std::vector<WT> W(K * R);
  std::vector<int64_t> acc(R);
  std::vector<float> facc(R);
  for (int64_t round = 0; round < refine; ++round) {
    std::fill(c.begin(), c.end(), uint8_t{0});
    for (int64_t i = 0; i < E; ++i) {
      uint8_t& x = c[ec[i] * R + a[es[i]]];
      x += x < 2;
    }
    // a sample's keys it alone reads at its rank: -2 each, + owner_weight where the rank owns it. Added without a
    // branch (+0.0 for the others leaves a sum as it is): whether a key is read once is a coin toss per element
    const double term[3] = {0.0, 0.0 - 2.0, owner_weight - 2.0};  // read by others; alone; alone at its owner
    auto alone = [&](int64_t i, int64_t r) {
      const int64_t k = ec[i];
      return term[(c[k * R + r] == 1) * (1 + (own[k] == r))];
    };
    if (S > 0) {  // sample-major: each sample's sum in a register
      for (int64_t n = 0; n < N; ++n) {
        double x = 0.0;
        for (int64_t i = n * S; i < (n + 1) * S; ++i) x += alone(i, a[n]);
        corr[n] = x;
      }
    } else {
      std::fill(corr.begin(), corr.end(), 0.0);
      for (int64_t i = 0; i < E; ++i) corr[es[i]] += alone(i, a[es[i]]);
    }
    for (int64_t k = 0; k < K; ++k) {
      const uint8_t* ck = c.data() + k * R;
      WT* wk = W.data() + k * R;
      for (int64_t r = 0; r < R; ++r) wk[r] = ck[r] > 0 ? two : WT(0);  // (no branch per cell)
      const int64_t o = own[k];
      if (o >= 0 && o < R && ck[o] == 0) wk[o] = ow_t;
    }
    if (S > 0 && R == 8) {  // a host planner's 8 ranks: the same sums in the same order, in a fixed-width loop
      using Acc = std::conditional_t<std::is_same_v<WT, float>, float, int64_t>;  // (small integers: exact)
      for (int64_t n = 0; n < N; ++n) {
        const int64_t* keys = ec + n * S;
        Acc f[8];
        const WT* w = W.data() + keys[0] * 8;
        for (int r = 0; r < 8; ++r) f[r] = static_cast<Acc>(w[r]);
        for (int64_t q = 1; q < S; ++q) {
          w = W.data() + keys[q] * 8;
          for (int r = 0; r < 8; ++r) f[r] += static_cast<Acc>(w[r]);
        }
        for (int r = 0; r < 8; ++r) sc[n * 8 + r] = static_cast<float>(f[r]);
        float& x = sc[n * 8 + a[n]];
        x = static_cast<float>(static_cast<double>(x) + (corr[n] + stay_bonus));
      }
    } else if (S > 0) {  // single-hot, elements sample-major (S per sample): per rank, the sum over the sample's keys
      for (int64_t n = 0; n < N; ++n) {
        const int64_t* keys = ec + n * S;
        if constexpr (std::is_same_v<WT, float>) {  // float32 sums in key order, as numpy's axis-0 reduce
          const float* w = W.data() + keys[0] * R;
          for (int64_t r = 0; r < R; ++r) facc[r] = w[r];
          for (int64_t s = 1; s < S; ++s) {
            w = W.data() + keys[s] * R;
            for (int64_t r = 0; r < R; ++r) facc[r] += w[r];
          }
          for (int64_t r = 0; r < R; ++r) sc[n * R + r] = facc[r];
        } else {  // small integers: exact in any order
          std::fill(acc.begin(), acc.end(), int64_t{0});
          for (int64_t s = 0; s < S; ++s) {
            const WT* w = W.data() + keys[s] * R;
            for (int64_t r = 0; r < R; ++r) acc[r] += w[r];
          }
          for (int64_t r = 0; r < R; ++r) sc[n * R + r] = static_cast<float>(acc[r]);
        }
        float& x = sc[n * R + a[n]];
        x = static_cast<float>(static_cast<double>(x) + (corr[n] + stay_bonus));
      }
    } else {  // jagged: float64 sums in element order, then float32 for the assignment
      sc64.assign(N * R, 0.0);
      for (int64_t i = 0; i < E; ++i) {
        const WT* w = W.data() + ec[i] * R;
        double* o = sc64.data() + es[i] * R;
        for (int64_t r = 0; r < R; ++r) o[r] += static_cast<double>(w[r]);
      }
      for (int64_t n = 0; n < N; ++n) sc64[n * R + a[n]] += corr[n] + stay_bonus;
      for (int64_t j = 0; j < N * R; ++j) sc[j] = static_cast<float>(sc64[j]);
    }
    balanced(sc.data(), N, R, B, a);
  }
}

// The stream passes' elements per sample, in their order: sample n's are at[first[n]] .. at[first[n + 1] - 1] (a
// stable counting sort by es); with S > 0 (single-hot, S per sample, sample-major) they already are, and `at` stays
// empty (element j is at j).
void elements_by_sample(int64_t N, int64_t E, const int64_t* es, int64_t S, std::vector<int64_t>& first,
                        std::vector<int64_t>& at) {
  first.assign(N + 1, 0);
  if (S > 0) {
    for (int64_t n = 0; n <= N; ++n) first[n] = n * S;
    return;
  }
  at.resize(E);
  for (int64_t i = 0; i < E; ++i) ++first[es[i] + 1];
  for (int64_t n = 0; n < N; ++n) first[n + 1] += first[n];
  std::vector<int64_t> fill(first.begin(), first.end() - 1);
  for (int64_t i = 0; i < E; ++i) at[fill[es[i]]++] = i;
}

// The open rank of least load (the lowest among ties): where a stream pass puts a sample that scores nowhere open.
int64_t least_loaded(const int64_t* load, int64_t R, int64_t B) {
  int64_t best = -1;
  for (int64_t r = 0; r < R; ++r)
    if (load[r] < B && (best < 0 || load[r] < load[best])) best = r;
  return best;
}

// laia.stream_assign: samples in batch order, each to the open rank where most of its keys already are (owned
// there, or read there by a sample placed before it), every key weighing w0; a key's readers are tracked up to
// `cap` distinct ranks, beyond which it is everywhere and scores nowhere. Ties go to the lowest rank, a sample
// that scores at no open rank to the least loaded one (lowest first). Elements are taken per sample in their
// order (a stable counting sort by es), and each sample's scores summed in that order, as numpy's fallback does.
void stream_pass(int64_t N, int64_t R, int64_t B, int64_t K, int64_t E, const int64_t* es, const int64_t* ec,
                 const double* w0, const int64_t* own, int64_t cap, const int64_t* host, int64_t H, double intra,
                 int64_t* a) {
  std::vector<int64_t> first, at;
  elements_by_sample(N, E, es, 0, first, at);
  const int64_t W = (R + 63) / 64;  // a key's readers as a bit set over the ranks
  std::vector<uint64_t> readers(K * W, 0), seen(W);
  std::vector<int32_t> count(K, 0);  // distinct readers so far; cap + 1: everywhere, no longer tracked
  std::vector<int32_t> left(K, 0);   // the key's elements not placed yet: its readers matter while some are
  for (int64_t i = 0; i < E; ++i) ++left[ec[i]];
  std::vector<double> score(R, 0.0);
  std::vector<int64_t> load(R, 0);
  // host-aware (host != nullptr): the same over hosts (a key's reading hosts, never saturated), and a rank scores
  // intra x its own sum + (1 - intra) x its host's
  const int64_t WH = host ? (H + 63) / 64 : 0;
  std::vector<uint64_t> hreaders(K * WH, 0), hseen(WH);
  std::vector<double> hscore(host ? H : 0, 0.0);
  for (int64_t n = 0; n < N; ++n) {
    std::fill(seen.begin(), seen.end(), uint64_t{0});
    std::fill(hseen.begin(), hseen.end(), uint64_t{0});
    for (int64_t j = first[n]; j < first[n + 1]; ++j) {
      const int64_t i = at[j], k = ec[i], o = own[k];
      const double w = w0[i];
      if (o >= 0) {
        score[o] += w;
        seen[o >> 6] |= uint64_t{1} << (o & 63);
      }
      if (host) {
        const int64_t ho = o >= 0 ? host[o] : -1;
        if (ho >= 0) {
          hscore[ho] += w;
          hseen[ho >> 6] |= uint64_t{1} << (ho & 63);
        }
        const uint64_t* hk = hreaders.data() + k * WH;
        for (int64_t q = 0; q < WH; ++q) {
          uint64_t m = hk[q];
          if (ho >= 0 && (ho >> 6) == q) m &= ~(uint64_t{1} << (ho & 63));
          hseen[q] |= m;
          for (; m; m &= m - 1) hscore[q * 64 + __builtin_ctzll(m)] += w;
        }
      }
      if (count[k] == 0 || count[k] > cap) continue;
      const uint64_t* rk = readers.data() + k * W;
      for (int64_t q = 0; q < W; ++q) {
        uint64_t m = rk[q];
        if (o >= 0 && (o >> 6) == q) m &= ~(uint64_t{1} << (o & 63));  // the owner scored once
        seen[q] |= m;
        while (m) {
          score[q * 64 + __builtin_ctzll(m)] += w;
          m &= m - 1;
        }
      }
    }
    int64_t best = -1;
    double top = 0.0;
    if (host) {
      for (int64_t r = 0; r < R; ++r) {
        const double v = intra * score[r] + (1.0 - intra) * hscore[host[r]];
        if (load[r] < B && v > 0.0 && (best < 0 || v > top)) {
          best = r;
          top = v;
        }
      }
      for (int64_t q = 0; q < WH; ++q) {
        for (uint64_t m = hseen[q]; m; m &= m - 1) hscore[q * 64 + __builtin_ctzll(m)] = 0.0;
      }
    }
    for (int64_t q = 0; q < W; ++q) {
      for (uint64_t m = seen[q]; m; m &= m - 1) {
        const int64_t r = q * 64 + __builtin_ctzll(m);
        if (!host && load[r] < B && (best < 0 || score[r] > top)) {  // ranks ascend: ties keep the lower
          best = r;
          top = score[r];
        }
        score[r] = 0.0;
      }
    }
    if (best < 0) best = least_loaded(load.data(), R, B);
    a[n] = best;
    ++load[best];
    const uint64_t bit = uint64_t{1} << (best & 63);
    const int64_t hb = host ? host[best] : 0;
    for (int64_t j = first[n]; j < first[n + 1]; ++j) {
      const int64_t k = ec[at[j]];
      if (--left[k] == 0) continue;  // no later sample reads it
      if (host) hreaders[k * WH + (hb >> 6)] |= uint64_t{1} << (hb & 63);
      if (count[k] > cap) continue;  // everywhere
      uint64_t& word = readers[k * W + (best >> 6)];
      if (word & bit) continue;
      if (count[k] == cap) {
        count[k] = static_cast<int32_t>(cap + 1);
      } else {
        word |= bit;
        ++count[k];
      }
    }
  }
}

#if defined(__SSE2__)
// two ranks' lanes of a reader mask: all-ones where the rank reads the key (an AND keeps the weight, else +0.0)
const __m128d kLanePair[4] = {_mm_castsi128_pd(_mm_set_epi64x(0, 0)), _mm_castsi128_pd(_mm_set_epi64x(0, -1)),
                              _mm_castsi128_pd(_mm_set_epi64x(-1, 0)), _mm_castsi128_pd(_mm_set_epi64x(-1, -1))};
#endif

// stream_pass where no key can saturate (R <= cap, R <= 64, not host-aware: a host planner's 8 ranks, one
// planner's up to 16), the same sums in the same order: a key's readers and its owner as one bit mask (their
// union: each rank gets at most one w per element, as there), and each placed sample's rank added to its keys'
// masks without the reader count or the elements left (with no cap to reach, a key no later sample reads keeps
// a mask nobody looks at). Why: the general pass's branches per element cost 2.3x its time here.
void stream_pass_uncapped(int64_t N, int64_t R, int64_t B, int64_t K, int64_t E, const int64_t* es,
                          const int64_t* ec, const double* w0, int64_t S, const int64_t* own, int64_t* a) {
  std::vector<int64_t> first, at;
  elements_by_sample(N, E, es, S, first, at);
  std::vector<uint64_t> readers(K, 0);
  for (int64_t k = 0; k < K; ++k) readers[k] = own[k] >= 0 ? uint64_t{1} << own[k] : 0;  // the owner, always
  std::vector<double> score(std::max<int64_t>(R, 8), 0.0);
  std::vector<int64_t> load(R, 0);
  for (int64_t n = 0; n < N; ++n) {
    uint64_t seen = 0;
#if defined(__SSE2__)
    if (R <= 8) {  // a host's ranks: eight lanes, one add each per element (+0.0 where the key is not read leaves a
                   // sum as it is), where the loop over the reader bits below mispredicted its exit at every element
      __m128d f0 = _mm_setzero_pd(), f1 = f0, f2 = f0, f3 = f0;
      for (int64_t j = first[n]; j < first[n + 1]; ++j) {
        const int64_t i = S > 0 ? j : at[j];
        const __m128d w = _mm_set1_pd(w0[i]);
        const uint64_t m = readers[ec[i]];
        seen |= m;
        f0 = _mm_add_pd(f0, _mm_and_pd(w, kLanePair[m & 3]));
        f1 = _mm_add_pd(f1, _mm_and_pd(w, kLanePair[(m >> 2) & 3]));
        f2 = _mm_add_pd(f2, _mm_and_pd(w, kLanePair[(m >> 4) & 3]));
        f3 = _mm_add_pd(f3, _mm_and_pd(w, kLanePair[(m >> 6) & 3]));
      }
      _mm_storeu_pd(score.data(), f0), _mm_storeu_pd(score.data() + 2, f1);
      _mm_storeu_pd(score.data() + 4, f2), _mm_storeu_pd(score.data() + 6, f3);
    } else
#endif
    {
      for (int64_t j = first[n]; j < first[n + 1]; ++j) {
        const int64_t i = S > 0 ? j : at[j];
        const double w = w0[i];
        const uint64_t m = readers[ec[i]];
        seen |= m;
        for (uint64_t q = m; q; q &= q - 1) score[__builtin_ctzll(q)] += w;
      }
    }
    int64_t best = -1;
    double top = 0.0;
    for (uint64_t q = seen; q; q &= q - 1) {  // ranks ascend: ties keep the lower
      const int64_t r = __builtin_ctzll(q);
      if (load[r] < B && (best < 0 || score[r] > top)) best = r, top = score[r];
      score[r] = 0.0;
    }
    if (best < 0) best = least_loaded(load.data(), R, B);
    a[n] = best;
    ++load[best];
    const uint64_t bit = uint64_t{1} << best;
    for (int64_t j = first[n]; j < first[n + 1]; ++j) readers[ec[S > 0 ? j : at[j]]] |= bit;
  }
}

}  // namespace


// ---- guest slots, eviction pool, capacity (directory.GuestSlots, eviction.EvictionPool, HeraldPolicy._make_room) ----
// The state stays in the policy's numpy arrays; these functions read and update them in place.
struct Slots {
  int64_t G;
  const int64_t* cap;
  const int64_t* base;
  const int64_t* alloc;  // slots reserved per group (GuestSlots.reserve grows them before the kernels add)
  int64_t* fill;
  int64_t* slot;
  int32_t* pos_of;
};

struct Pool {
  int64_t size;
  int64_t* tau;
  const int64_t* row;
  int64_t* keys;  // [big groups, size]
  int64_t* count;
  const int32_t* group_of_slot;
  int64_t* rebuilds;
};

struct Prio {  // HeraldPolicy._make_room.prio: lower is evicted first; -1 = stays (read this step, or already picked)
  const int16_t* nu;
  const int32_t* last;
  const uint8_t* picked;
  int64_t step, L1;
  int64_t operator()(int64_t key) const {
    const int64_t lu = last[key];
    if (lu == step || picked[key]) return -1;
    const int64_t n = nu[key];
    return (n > 0 ? L1 - n : 0) * (step + 2) + lu + 1;
  }
};

// HeraldHierPolicy.room_for_arrivals' priority: Prio's, where a host planner, which keeps no array over every row,
// finds a key's first use in its lookahead window by binary search in each batch's sorted keys, and this step's
// victims in a sorted list.
struct HostPrio {
  int64_t L;  // batches 1..L of the window
  const int64_t* const* window;
  const int64_t* window_len;
  const int32_t* last;
  const std::vector<int64_t>* chosen;  // sorted
  int64_t step, L1;
  int64_t next_use(int64_t key) const {  // the first batch that reads `key`, 0 for none
    for (int64_t j = 0; j < L; ++j)
      if (std::binary_search(window[j], window[j] + window_len[j], key)) return j + 1;
    return 0;
  }
  int64_t operator()(int64_t key) const {
    const int64_t lu = last[key];
    if (lu == step || std::binary_search(chosen->begin(), chosen->end(), key)) return -1;
    const int64_t n = next_use(key);
    return (n > 0 ? L1 - n : 0) * (step + 2) + lu + 1;
  }
};

// The `need` members of lowest (priority, slot) among (prio, pos) candidates with prio >= 0, appended to out.
void take_lowest(std::vector<std::pair<int64_t, int64_t>>& cand, int64_t need, std::vector<int64_t>& out) {
  if (static_cast<int64_t>(cand.size()) > need) {
    std::nth_element(cand.begin(), cand.begin() + need, cand.end());
    cand.resize(need);
  }
  for (auto& c : cand) out.push_back(c.second);
}

// GuestSlots.pick_victims for one group: a pass over its members. (PrioT: Prio, or HostPrio for a host planner.)
template <typename PrioT>
void full_selection(const Slots& sl, int64_t g, int64_t need, const PrioT& prio, std::vector<int64_t>& out) {
  std::vector<std::pair<int64_t, int64_t>> cand;
  for (int64_t p = sl.base[g]; p < sl.base[g] + sl.fill[g]; ++p) {
    const int64_t pr = prio(sl.slot[p]);
    if (pr >= 0) cand.push_back({pr, p});
  }
  take_lowest(cand, need, out);
}

// EvictionPool._rebuild for one group: the `size` lowest floors (all, if fewer).
void rebuild(const Slots& sl, Pool& pool, const int32_t* floor, int64_t g) {
  const int64_t lo = sl.base[g], n = sl.fill[g];
  int64_t* keys = pool.keys + pool.row[g] * pool.size;
  int64_t tau;
  if (n <= pool.size) {
    tau = std::numeric_limits<int64_t>::max();
  } else {
    std::vector<int32_t> fl(n);
    for (int64_t i = 0; i < n; ++i) fl[i] = floor[sl.slot[lo + i]];
    std::nth_element(fl.begin(), fl.begin() + pool.size, fl.end());
    tau = fl[pool.size];
  }
  int64_t c = 0;
  for (int64_t i = 0; i < n; ++i) {
    const int64_t key = sl.slot[lo + i];
    if (floor[key] < tau) keys[c++] = key;
  }
  pool.tau[g] = tau;
  pool.count[g] = c;
  ++*pool.rebuilds;
}

// EvictionPool._candidates for one group: live members (stale keys dropped for good, duplicates once).
void pool_candidates(const Slots& sl, Pool& pool, const int32_t* floor, int64_t g, std::vector<int64_t>& pos) {
  int64_t* keys = pool.keys + pool.row[g] * pool.size;
  const int64_t lo = sl.base[g], hi = sl.base[g] + sl.fill[g], tau = pool.tau[g];
  pos.clear();
  int64_t kept = 0;
  for (int64_t i = 0; i < pool.count[g]; ++i) {
    const int64_t key = keys[i];
    const int64_t p = sl.pos_of[key];
    if (p >= lo && p < hi && floor[key] < tau) keys[kept++] = key, pos.push_back(p);
  }
  // a row that left and came back is listed twice: keep its first listing
  std::vector<int64_t> sorted(pos);
  std::sort(sorted.begin(), sorted.end());
  if (std::adjacent_find(sorted.begin(), sorted.end()) != sorted.end()) {
    std::vector<int64_t> seen;
    int64_t m = 0;
    std::vector<int64_t> uniq;
    for (int64_t i = 0; i < kept; ++i) {
      const int64_t p = pos[i];
      if (std::find(seen.begin(), seen.end(), p) != seen.end()) continue;  // rare: few duplicates
      seen.push_back(p);
      keys[m++] = keys[i];
      uniq.push_back(p);
    }
    kept = m;
    pos.swap(uniq);
  }
  pool.count[g] = kept;
}

// EvictionPool.pick for one group: exactly the full selection's victims, from the pool where it can decide.
template <typename PrioT>
void pick_group(const Slots& sl, Pool& pool, const int32_t* floor, int64_t g, int64_t need, const PrioT& prio,
                std::vector<int64_t>& out) {
  if (need <= 0) return;
  if (sl.cap[g] <= pool.size) {
    full_selection(sl, g, need, prio, out);
    return;
  }
  std::vector<int64_t> pos;
  std::vector<std::pair<int64_t, int64_t>> cand;
  for (int attempt = 0; attempt < 2; ++attempt) {
    pool_candidates(sl, pool, floor, g, pos);
    cand.clear();
    for (int64_t p : pos) {
      const int64_t pr = prio(sl.slot[p]);
      if (pr >= 0 && pr < pool.tau[g]) cand.push_back({pr, p});
    }
    if (static_cast<int64_t>(cand.size()) >= need) {
      take_lowest(cand, need, out);
      return;
    }
    if (attempt == 0) rebuild(sl, pool, floor, g);
  }
  full_selection(sl, g, need, prio, out);
}

// eviction.cancel_arrivals: where a guest group is still left[g] > 0 slots short, cancel (want = own) that many of
// its arrivals `arr` (step-key indices entering groups arr_g), the least valuable first. Kept first: single-reader
// migrations, then keys used again in the lookahead (`used_again(key)`); among equals those leaving a guest slot
// (cancelling them would cascade); then by key.
template <typename UsedAgain>
void cancel_arrivals(const std::vector<int64_t>& arr, const std::vector<int64_t>& arr_g, const std::vector<int64_t>& left,
                     const int64_t* keys, const int64_t* own, const int64_t* home, const uint8_t* single,
                     const UsedAgain& used_again, int64_t* want) {
  struct C { int64_t g, val, from_home, key, i; };
  std::vector<C> cand;
  for (size_t j = 0; j < arr.size(); ++j) {
    const int64_t i = arr[j], g = arr_g[j];
    if (left[g] <= 0) continue;
    const int64_t val = (single[i] ? 2 : 0) + (used_again(keys[i]) ? 1 : 0);
    cand.push_back({g, -val, own[i] != home[i] ? 0 : 1, keys[i], i});
  }
  std::sort(cand.begin(), cand.end(), [](const C& x, const C& y) {
    if (x.g != y.g) return x.g < y.g;
    if (x.val != y.val) return x.val < y.val;
    if (x.from_home != y.from_home) return x.from_home < y.from_home;
    return x.key < y.key;
  });
  for (size_t j = 0; j < cand.size();) {
    size_t e = j;
    while (e < cand.size() && cand[e].g == cand[j].g) ++e;
    const int64_t keep = static_cast<int64_t>(e - j) - left[cand[j].g];
    for (size_t q = j; q < e; ++q)
      if (static_cast<int64_t>(q - j) >= keep) want[cand[q].i] = own[cand[q].i];
    j = e;
  }
}

// The capacity rounds of herald's _make_room and herald_hier's room_for_arrivals, the same victims and
// cancellations: over the guest groups [lo, lo + n_groups), victims (two rounds at most), else cancelled arrivals,
// until every group fits after the step's moves. Keys [K] sorted with their owner, home, wanted owner (cancelled
// ones written back), single-reader flag and table. `rules`: the priority (`prio`), whether a key's departure frees
// room in these groups (`departs(i)`), a victim's table (`table_of(v)`), a picked victim (`pick(v)`) and a round's
// picks done (`settle()`: the priority must not pick them again), and whether a key is used again in the lookahead
// (`used_again(key)`). Returns the last deficit per group (room = -deficit); throws where the rounds do not converge.
template <typename Rules>
std::vector<int64_t> room_rounds(int64_t K, const int64_t* keys, const int64_t* own, const int64_t* home,
                                 int64_t* want, const uint8_t* single, const int64_t* tk, int64_t T, int64_t lo,
                                 int64_t n_groups, Slots& sl, Pool& pool, const int32_t* owner, const int32_t* last,
                                 Rules& rules, const char* who) {
  std::vector<int64_t> vpos, arr, arr_g, freed(n_groups, 0), deficit(n_groups), left(n_groups);
  const int victim_rounds = 2;
  for (int64_t it = 0; it < K + 2; ++it) {
    std::fill(deficit.begin(), deficit.end(), int64_t{0});
    arr.clear();
    arr_g.clear();
    for (int64_t i = 0; i < K; ++i) {
      if (want[i] == own[i]) continue;
      if (want[i] != home[i]) arr.push_back(i), arr_g.push_back(want[i] * T + tk[i] - lo), ++deficit[arr_g.back()];
      if (own[i] != home[i] && rules.departs(i)) --deficit[own[i] * T + tk[i] - lo];
    }
    bool any = false;
    for (int64_t g = 0; g < n_groups; ++g) {
      deficit[g] += sl.fill[lo + g] - freed[g] - sl.cap[lo + g];
      any = any || deficit[g] > 0;
    }
    if (!any) return deficit;
    left = deficit;
    if (it < victim_rounds) {
      vpos.clear();
      for (int64_t g = 0; g < n_groups; ++g)
        if (deficit[g] > 0) pick_group(sl, pool, last, lo + g, deficit[g], rules.prio, vpos);
      if (!vpos.empty()) {
        for (int64_t p : vpos) {
          const int64_t v = sl.slot[p];
          rules.pick(v);
          const int64_t vg = static_cast<int64_t>(owner[v]) * T + rules.table_of(v) - lo;
          ++freed[vg];
          --left[vg];
        }
        rules.settle();
        bool fits = true;
        for (int64_t g = 0; g < n_groups; ++g) fits = fits && left[g] <= 0;
        if (fits) return left;
      }
    }
    cancel_arrivals(arr, arr_g, left, keys, own, home, single, [&](int64_t k) { return rules.used_again(k); }, want);
  }
  throw std::runtime_error(std::string(who) + ": capacity resolution did not converge");
}

// room_rounds' rules for herald_hier's host t: departures from its own ranks only count as room, victims kept in a
// sorted list (`HostPrio`), a key's next use found in the window's keys, a victim's table from the offsets.
struct HostRoomRules {
  HostPrio prio;
  const int64_t* own;
  const int64_t* offsets;
  int64_t P, T, t;
  std::vector<int64_t>* chosen;
  bool departs(int64_t i) const { return own[i] / P == t; }
  int64_t table_of(int64_t v) const { return std::upper_bound(offsets, offsets + T + 1, v) - offsets - 1; }
  void pick(int64_t v) { chosen->push_back(v); }
  void settle() { std::sort(chosen->begin(), chosen->end()); }
  bool used_again(int64_t key) const { return prio.next_use(key) > 0; }
};

void slots_remove(Slots& sl, const std::vector<int64_t>& keys, const std::vector<int64_t>& groups) {
  if (keys.empty()) return;
  std::vector<int64_t> d(sl.G, 0), holes;
  for (int64_t g : groups) ++d[g];
  std::vector<int64_t> pos(keys.size());
  for (size_t i = 0; i < keys.size(); ++i) {
    ahead<1>(sl.pos_of, keys.data(), i, keys.size());
    pos[i] = sl.pos_of[keys[i]];
    if (pos[i] < 0) throw std::runtime_error("GuestSlots.remove: key is not a member");
  }
  // the holes (removed rows below their group's new fill) in ascending order, the survivors above it moved into
  // them in ascending order; numpy sorts every hole, and as regions are disjoint a group's movers fill its own holes
  // (as many as it has), so each group's holes are sorted alone: a counting sort by group, then small sorts
  std::vector<int64_t> hs(sl.G + 1, 0);
  std::vector<uint8_t> is_hole(keys.size());
  for (size_t i = 0; i < keys.size(); ++i) {
    sl.slot[pos[i]] = -1;
    sl.pos_of[keys[i]] = -1;
    is_hole[i] = pos[i] < sl.base[groups[i]] + sl.fill[groups[i]] - d[groups[i]];
    hs[groups[i] + 1] += is_hole[i];
  }
  for (int64_t g = 0; g < sl.G; ++g) hs[g + 1] += hs[g];
  holes.resize(hs[sl.G]);
  std::vector<int64_t> at(hs.begin(), hs.end() - 1);
  for (size_t i = 0; i < keys.size(); ++i)
    if (is_hole[i]) holes[at[groups[i]]++] = pos[i];
  for (int64_t g = 0; g < sl.G; ++g) {
    if (!d[g]) continue;
    std::sort(holes.begin() + hs[g], holes.begin() + hs[g + 1]);
    const int64_t nf = sl.fill[g] - d[g];
    int64_t h = hs[g];
    for (int64_t p = sl.base[g] + nf; p < sl.base[g] + sl.fill[g]; ++p) {
      if (sl.slot[p] < 0) continue;
      if (h >= hs[g + 1]) throw std::runtime_error("GuestSlots.remove: hole/mover mismatch");
      const int64_t key = sl.slot[p];
      sl.slot[holes[h]] = key;
      sl.slot[p] = -1;
      sl.pos_of[key] = static_cast<int32_t>(holes[h]);
      ++h;
    }
    if (h != hs[g + 1]) throw std::runtime_error("GuestSlots.remove: hole/mover mismatch");
    sl.fill[g] = nf;
  }
}

// GuestSlots.add: append keys to their groups (stable by group); returns their slots in input order.
void slots_add(Slots& sl, const std::vector<int64_t>& keys, const std::vector<int64_t>& groups, int64_t* out) {
  std::vector<int64_t> a(sl.G, 0), next(sl.G);
  for (int64_t g : groups) ++a[g];
  for (int64_t g = 0; g < sl.G; ++g) {
    if (sl.fill[g] + a[g] > sl.cap[g]) throw std::runtime_error("GuestSlots.add: group over capacity");
    if (sl.fill[g] + a[g] > sl.alloc[g]) throw std::runtime_error("GuestSlots.add: region not reserved");
    next[g] = sl.base[g] + sl.fill[g];
  }
  for (size_t i = 0; i < keys.size(); ++i) {
    ahead<1>(sl.pos_of, keys.data(), i, keys.size());
    const int64_t p = next[groups[i]]++;
    sl.slot[p] = keys[i];
    sl.pos_of[keys[i]] = static_cast<int32_t>(p);
    out[i] = p;
  }
  for (int64_t g = 0; g < sl.G; ++g) sl.fill[g] += a[g];
}

// What growing a group's region changes besides its members' slots (GuestSlots: base, alloc, group_of_slot, top),
// the slot array's length and the smallest region (GuestSlots.MIN_REGION).
struct Regions {
  int64_t* base;
  int64_t* alloc;
  int32_t* group_of_slot;
  int64_t* top;
  int64_t n_slots, min_region;
};

// GuestSlots.reserve where the slot array's free end has room: every group whose region holds fewer than need[g]
// slots moves there (in group order, members in order) to a region of max(need, twice its size, min_region) slots
// (at most its capacity), its old region left as garbage: the same layout as numpy's. False, nothing changed, where
// the end lacks room (numpy then lays every region out again in a larger array).
bool grow_regions(const Slots& sl, const Regions& rg, const int64_t* need) {
  const auto size_of = [&](int64_t g) {
    return std::min(sl.cap[g], std::max(need[g], std::max(2 * rg.alloc[g], rg.min_region)));
  };
  int64_t total = 0;
  for (int64_t g = 0; g < sl.G; ++g)
    if (need[g] > rg.alloc[g]) total += size_of(g);
  if (*rg.top + total > rg.n_slots) return false;
  int64_t at = *rg.top;
  for (int64_t g = 0; g < sl.G; ++g) {
    if (need[g] <= rg.alloc[g]) continue;
    const int64_t size = size_of(g), b = rg.base[g];
    for (int64_t i = 0; i < sl.fill[g]; ++i) {
      const int64_t key = sl.slot[b + i];
      sl.slot[at + i] = key;
      sl.pos_of[key] = static_cast<int32_t>(at + i);
    }
    std::fill(sl.slot + b, sl.slot + b + rg.alloc[g], int64_t{-1});
    std::fill(rg.group_of_slot + b, rg.group_of_slot + b + rg.alloc[g], int32_t{-1});
    std::fill(rg.group_of_slot + at, rg.group_of_slot + at + size, static_cast<int32_t>(g));
    rg.base[g] = at;
    rg.alloc[g] = size;
    at += size;
  }
  *rg.top = at;
  return true;
}

// EvictionPool.arrived: rows just added at `pos` (floor set) join their group's pool if below its threshold.
void pool_arrived(const Slots& sl, Pool& pool, const int32_t* floor, const int64_t* pos, int64_t n) {
  std::vector<int64_t> a(sl.G, 0);
  std::vector<int64_t> low;
  for (int64_t i = 0; i < n; ++i) {
    if (i + kAhead < n) __builtin_prefetch(floor + sl.slot[pos[i + kAhead]]);
    const int64_t g = pool.group_of_slot[pos[i]];
    if (floor[sl.slot[pos[i]]] < pool.tau[g]) low.push_back(pos[i]), ++a[g];
  }
  if (low.empty()) return;
  std::vector<char> over(sl.G, 0);
  for (int64_t g = 0; g < sl.G; ++g)
    if (a[g] && pool.count[g] + a[g] > pool.size) over[g] = 1, pool.tau[g] = -1, pool.count[g] = 0;
  // each group's in arrival order, as numpy's stable argsort by group lists them (groups have their own rows)
  for (int64_t p : low) {
    const int64_t g = pool.group_of_slot[p];
    if (over[g]) continue;
    pool.keys[pool.row[g] * pool.size + pool.count[g]++] = sl.slot[p];
  }
}

// Rows arriving as guests: added to their groups (GuestSlots.add), then to their pools (EvictionPool.arrived).
void arrive(Slots& sl, Pool& pool, const int32_t* floor, const std::vector<int64_t>& keys,
            const std::vector<int64_t>& groups) {
  std::vector<int64_t> pos(keys.size());
  slots_add(sl, keys, groups, pos.data());
  pool_arrived(sl, pool, floor, pos.data(), static_cast<int64_t>(pos.size()));
}

// The moving rows that are guests at `rank[i]` (not their home) among ranks [lo, hi): their keys and (rank, table)
// groups (OwnershipDirectory.release_guests / land_guests).
void guests_at(int64_t M, const int64_t* gid, const int64_t* rank, const int64_t* home, const int64_t* table,
               int64_t lo, int64_t hi, int64_t T, std::vector<int64_t>& keys, std::vector<int64_t>& groups) {
  keys.resize(M);
  groups.resize(M);
  int64_t n = 0;
  for (int64_t i = 0; i < M; ++i) {  // written always, kept where it is a guest there (no branch on the data)
    keys[n] = gid[i];
    groups[n] = rank[i] * T + table[i];
    n += (rank[i] != home[i]) & (static_cast<uint64_t>(rank[i] - lo) < static_cast<uint64_t>(hi - lo));
  }
  keys.resize(n);
  groups.resize(n);
}

// Entries 0..n-1 grouped by the hosts each goes to (`hosts_of(i, to)` calls to(t) for each of its hosts), each
// host's in entry order: `bounds` [H + 1], and put(i, q) for every (entry, place) (a counting sort, two passes).
template <typename HostsOf, typename Put>
void by_host(int64_t n, int64_t H, std::vector<int64_t>& bounds, const HostsOf& hosts_of, const Put& put) {
  bounds.assign(H + 1, 0);
  for (int64_t i = 0; i < n; ++i) hosts_of(i, [&](int64_t t) { ++bounds[t + 1]; });
  for (int64_t t = 0; t < H; ++t) bounds[t + 1] += bounds[t];
  std::vector<int64_t> at(bounds.begin(), bounds.end() - 1);
  for (int64_t i = 0; i < n; ++i) hosts_of(i, [&](int64_t t) { put(i, at[t]++); });
}

// A rank's host, rank / P, by a table over the P * H ranks (a division for any other value): the routing passes
// read each shared pair's host several times, and a 64-bit division costs ~40 cycles, 2/3 of their time.
struct HostOfRank {
  std::vector<int64_t> host;
  int64_t P;
  HostOfRank(int64_t P_, int64_t H) : host(P_ * H), P(P_) {
    for (int64_t r = 0; r < P * H; ++r) host[r] = r / P;
  }
  int64_t operator()(int64_t r) const { return static_cast<uint64_t>(r) < host.size() ? host[r] : r / P; }
};

extern "C" {

int herald_kernels_version() { return 22; }

// Errors of the functions below that return int: 0 = done, else a message in herald_last_error().
static std::string last_error;
const char* herald_last_error() { return last_error.c_str(); }

// schedule/herald/balance.balance_owners, the same moves in the same order (its docstring says why). Pairs: the
// step's readers per key in CSR (start, count; ranks sorted). skip, heavy_ranks: nullptr for none. Loads are
// integer-valued doubles, so every sum and comparison equals numpy's. Returns the rows handed on; want is updated.
int64_t herald_balance_owners(int64_t K, int64_t R, int64_t* want, const int64_t* own, const int64_t* count,
                              const int64_t* start, const int64_t* pr, const uint8_t* skip, double factor,
                              const uint8_t* heavy_ranks) {
  std::vector<double> load(R, 0.0);
  for (int64_t k = 0; k < K; ++k) {
    if (want[k] != own[k]) {
      load[own[k]] += 1.0;
      load[want[k]] += 1.0;
    }
    if (skip && skip[k]) continue;
    for (int64_t p = start[k]; p < start[k] + count[k]; ++p) {
      if (pr[p] == want[k]) continue;
      load[pr[p]] += 2.0;
      load[want[k]] += 2.0;
    }
  }
  double total = 0.0;
  for (int64_t r = 0; r < R; ++r) total += load[r];
  const double thr = factor * (total / static_cast<double>(R));
  int64_t moved = 0;
  auto least_loaded = [&](int64_t k, auto&& allowed) {  // the first reader with the least load, or -1
    int64_t best = -1;
    for (int64_t p = start[k]; p < start[k] + count[k]; ++p)
      if (allowed(pr[p]) && (best < 0 || load[pr[p]] < load[best])) best = pr[p];
    return best;
  };
  if (heavy_ranks) {  // rows no rank could take under thr go to heavy_ranks (balance._place_heavy)
    const double low = thr - *std::min_element(load.begin(), load.end());
    std::vector<int64_t> hk;
    for (int64_t k = 0; k < K; ++k)
      if (static_cast<double>(2 * count[k] - 3) > low && !heavy_ranks[want[k]] && !(skip && skip[k])) hk.push_back(k);
    std::stable_sort(hk.begin(), hk.end(), [&](int64_t a, int64_t b) { return count[a] > count[b]; });
    for (int64_t k : hk) {
      const int64_t dst = least_loaded(k, [&](int64_t r) { return heavy_ranks[r] && r != own[k]; });
      if (dst < 0) continue;
      const double gain = static_cast<double>(2 * count[k] - 3);
      load[dst] += gain;
      load[want[k]] -= want[k] != own[k] ? gain : gain - 2.0;
      want[k] = dst;
      ++moved;
    }
  }
  std::vector<uint8_t> over(R);
  std::vector<int64_t> heap;
  for (int64_t r = 0; r < R; ++r)
    if ((over[r] = load[r] > thr)) heap.push_back(r);
  if (heap.empty()) return moved;
  // candidates: shared keys whose owner reads them, owned by an overloaded rank; per owner, most readers first
  std::vector<int64_t> ck;
  for (int64_t k = 0; k < K; ++k) {
    if (count[k] < 2 || !over[want[k]] || (skip && skip[k])) continue;
    const int64_t* lo = pr + start[k];
    if (std::binary_search(lo, lo + count[k], want[k])) ck.push_back(k);
  }
  std::sort(ck.begin(), ck.end(), [&](int64_t a, int64_t b) {
    if (want[a] != want[b]) return want[a] < want[b];
    if (count[a] != count[b]) return count[a] > count[b];
    return a < b;
  });
  std::vector<int64_t> bound(R + 1, 0);
  for (int64_t k : ck) ++bound[want[k] + 1];
  for (int64_t r = 0; r < R; ++r) bound[r + 1] += bound[r];
  // the overloaded owners, busiest first (ties: lowest rank), in the order of their loads when the pass starts
  std::sort(heap.begin(), heap.end(), [&](int64_t a, int64_t b) { return load[a] != load[b] ? load[a] > load[b] : a < b; });
  for (int64_t r : heap) {
    for (int64_t i = bound[r]; i < bound[r + 1]; ++i) {
      if (load[r] <= thr) break;
      const int64_t k = ck[i];
      const double gain = static_cast<double>(2 * (count[k] - 1) - 1);
      const double drop = want[k] != own[k] ? gain : gain - 2.0;
      if (drop <= 0.0) continue;
      const int64_t dst = least_loaded(k, [&](int64_t x) { return x != r && x != own[k]; });
      if (dst < 0 || load[dst] + gain > thr) continue;
      load[dst] += gain;
      load[r] -= drop;
      want[k] = dst;
      ++moved;
    }
  }
  return moved;
}

// HeraldPolicy._plan, ownership: where every read key should live after the step. A key read by one rank only moves
// there; a shared key stays with its owner when the owner reads it, else moves to the reader with the most
// elements reading it (ties: lowest rank). Pairs (pk, pr) are the step's distinct (key, reader) pairs sorted by key
// then rank; elements are `cid` with their sample's rank (width > 0: sample-major, else `smp`). Writes want, single
// (one reader) and sole (the first reader).
void herald_decide(int64_t K, const int64_t* own, const int64_t* count, const int64_t* start, const int64_t* pr,
                   int64_t E, const int64_t* cid, int64_t width, const int64_t* smp, const int64_t* sample_rank,
                   int64_t R, int64_t dense_cells, int64_t* want, uint8_t* single, int64_t* sole) {
  std::vector<int64_t> far_idx(K, -1);
  int64_t F = 0;
  for (int64_t k = 0; k < K; ++k) {
    bool owner_reads = false;
    for (int64_t p = start[k]; p < start[k] + count[k]; ++p) owner_reads = owner_reads || pr[p] == own[k];
    single[k] = count[k] == 1;
    sole[k] = pr[start[k]];
    want[k] = own[k];
    if (single[k] && !owner_reads) want[k] = sole[k];
    if (!single[k] && !owner_reads) far_idx[k] = F++;
  }
  if (F == 0) return;
  if (F * R > dense_cells) {  // no [F, R] table: count per (key, reader) pair, found in the key's sorted readers
    std::vector<int64_t> cp(start[K - 1] + count[K - 1], 0);
    auto count_pair = [&](int64_t i, int64_t r) {
      const int64_t k = cid[i];
      if (far_idx[k] < 0) return;
      const int64_t* lo = pr + start[k];
      ++cp[std::lower_bound(lo, lo + count[k], r) - pr];
    };
    if (width > 0) {
      for (int64_t i = 0, n = 0; i < E; i += width, ++n)
        for (int64_t j = i; j < i + width; ++j) count_pair(j, sample_rank[n]);
    } else {
      for (int64_t i = 0; i < E; ++i) count_pair(i, sample_rank[smp[i]]);
    }
    for (int64_t k = 0; k < K; ++k) {
      if (far_idx[k] < 0) continue;
      const int64_t* c = cp.data() + start[k];
      want[k] = pr[start[k] + (std::max_element(c, c + count[k]) - c)];  // the first maximum: lowest rank
    }
    return;
  }
  std::vector<int64_t> cnt(F * R, 0);
  auto count_at = [&](int64_t i, int64_t r) {
    const int64_t f = far_idx[cid[i]];
    if (f >= 0) ++cnt[f * R + r];
  };
  if (width > 0) {
    for (int64_t i = 0, n = 0; i < E; i += width, ++n)
      for (int64_t j = i; j < i + width; ++j) count_at(j, sample_rank[n]);
  } else {
    for (int64_t i = 0; i < E; ++i) count_at(i, sample_rank[smp[i]]);
  }
  for (int64_t k = 0; k < K; ++k) {
    if (far_idx[k] < 0) continue;
    const int64_t* c = cnt.data() + far_idx[k] * R;
    want[k] = std::max_element(c, c + R) - c;  // the first maximum: lowest rank
  }
}

// HeraldPolicy._plan, assembly: the moves (migrations of read keys, then victims; sorted by row for the plan, in
// that order for the directory), the shared keys' reader CSR, and the hit / remote pair counts. Outputs sized by
// the caller: moves K + V, shared K (+1 offsets), readers = the step's pairs. Returns the number of moves; writes n_shared,
// n_readers, hit and remote to `counts` [4].
int64_t herald_assemble(int64_t K, const int64_t* keys, const int64_t* own, const int64_t* want, const uint8_t* single,
                        const int64_t* sole, const int64_t* count, const int64_t* start, const int64_t* pr,
                        int64_t V, const int64_t* victims, const int64_t* v_src,
                        const int64_t* v_dst, const int8_t* v_kind, int8_t migrate_kind, const int16_t* table_of,
                        const int64_t* offsets, int64_t* apply_gid, int64_t* apply_dst, int64_t* mv_table,
                        int64_t* mv_row, int64_t* mv_src, int64_t* mv_dst, int8_t* mv_kind, int64_t* sh_table,
                        int64_t* sh_row, int64_t* sh_owner, int64_t* sh_offsets, int64_t* sh_readers,
                        int64_t* counts) {
  // moves in the directory's order: migrations (keys ascending), then victims (ascending)
  int64_t M = 0;
  std::vector<int64_t> mig;
  for (int64_t k = 0; k < K; ++k)
    if (want[k] != own[k]) mig.push_back(k), apply_gid[M] = keys[k], apply_dst[M] = want[k], ++M;
  for (int64_t v = 0; v < V; ++v) apply_gid[M] = victims[v], apply_dst[M] = v_dst[v], ++M;
  // the plan's order: by row (both lists are sorted and disjoint: a merge)
  size_t a = 0;
  int64_t b = 0, m = 0;
  auto put = [&](int64_t gid, int64_t src, int64_t dst, int8_t kind) {
    const int64_t t = table_of[gid];
    mv_table[m] = t, mv_row[m] = gid - offsets[t], mv_src[m] = src, mv_dst[m] = dst, mv_kind[m] = kind, ++m;
  };
  while (a < mig.size() || b < V) {
    if (b >= V || (a < mig.size() && keys[mig[a]] < victims[b])) {
      const int64_t k = mig[a++];
      put(keys[k], own[k], want[k], migrate_kind);
    } else {
      put(victims[b], v_src[b], v_dst[b], v_kind[b]);
      ++b;
    }
  }
  // shared keys: every read key but those read only by their (unmoved or arriving) owner
  int64_t S = 0, nr = 0, hit = 0, remote = 0;
  sh_offsets[0] = 0;
  for (int64_t k = 0; k < K; ++k) {
    const bool moved = want[k] != own[k];
    for (int64_t p = start[k]; p < start[k] + count[k]; ++p) {
      if (want[k] == pr[p] && !moved) ++hit;
      if (want[k] != pr[p]) ++remote;
    }
    if (single[k] && sole[k] == want[k]) continue;  // exclusive
    const int64_t t = table_of[keys[k]];
    sh_table[S] = t, sh_row[S] = keys[k] - offsets[t], sh_owner[S] = want[k];
    for (int64_t p = start[k]; p < start[k] + count[k]; ++p) sh_readers[nr++] = pr[p];
    sh_offsets[++S] = nr;
  }
  counts[0] = S, counts[1] = nr, counts[2] = hit, counts[3] = remote;
  return M;
}

// HeraldPolicy._make_room: eviction victims so that every guest group fits after the step's moves; cancels (in
// `want`) the least valuable arrivals of groups that cannot make room. Step keys [K] (sorted global rows) with
// their current owner, home and wanted owner; `single` = read by one rank. Writes the victims (sorted global
// rows, at most `max_victims`) and their count, and the room left per group [G] (a lower bound).
int herald_make_room(int64_t K, const int64_t* keys, const int64_t* own, const int64_t* home, int64_t* want,
                     const uint8_t* single, int64_t R, int64_t T, const int16_t* table, const int32_t* owner,
                     const int16_t* nu, const int32_t* last, uint8_t* picked, int64_t step, int64_t L1,
                     const int64_t* cap, const int64_t* base, const int64_t* alloc, int64_t* fill, int64_t* slot,
                     int32_t* pos_of, int64_t pool_size, int64_t* tau, const int64_t* row, int64_t* pool_keys, int64_t* pool_count,
                     const int32_t* group_of_slot, int64_t* rebuilds, int64_t* victims, int64_t max_victims,
                     int64_t* n_victims, int64_t* room) {
  try {
    const int64_t G = R * T;
    Slots sl{G, cap, base, alloc, fill, slot, pos_of};
    Pool pool{pool_size, tau, row, pool_keys, pool_count, group_of_slot, rebuilds};
    std::vector<int64_t> tk(K), chosen;
    for (int64_t i = 0; i < K; ++i) tk[i] = table[keys[i]];
    // herald's rules: every guest leaving its owner frees room; victims marked in `picked` (over every row)
    struct Rules {
      Prio prio;
      const int16_t* table;
      uint8_t* picked;
      std::vector<int64_t>* chosen;
      bool departs(int64_t) const { return true; }
      int64_t table_of(int64_t v) const { return table[v]; }
      void pick(int64_t v) { picked[v] = 1, chosen->push_back(v); }
      void settle() const {}
      bool used_again(int64_t key) const { return prio.nu[key] > 0; }
    } rules{Prio{nu, last, picked, step, L1}, table, picked, &chosen};
    const std::vector<int64_t> deficit =
        room_rounds(K, keys, own, home, want, single, tk.data(), T, 0, G, sl, pool, owner, last, rules, "herald");
    for (int64_t v : chosen) picked[v] = 0;
    if (static_cast<int64_t>(chosen.size()) > max_victims) throw std::runtime_error("herald: too many victims");
    std::sort(chosen.begin(), chosen.end());
    std::copy(chosen.begin(), chosen.end(), victims);
    *n_victims = static_cast<int64_t>(chosen.size());
    for (int64_t g = 0; g < G; ++g) room[g] = -deficit[g];
    return 0;
  } catch (const std::exception& e) {
    last_error = e.what();
    return 1;
  }
}

// OwnershipDirectory.apply_moves + EvictionPool.arrived: every row leaves its owner, then arrives at dst.
int herald_apply_moves(int64_t M, const int64_t* gid, const int64_t* dst, int64_t T, const int16_t* table,
                       int32_t* owner, const int32_t* home, int64_t G, const int64_t* cap, const int64_t* base,
                       const int64_t* alloc, int64_t* fill, int64_t* slot, int32_t* pos_of, int64_t pool_size, int64_t* tau,
                       const int64_t* row, int64_t* pool_keys, int64_t* pool_count, const int32_t* group_of_slot,
                       const int32_t* floor) {
  try {
    Slots sl{G, cap, base, alloc, fill, slot, pos_of};
    Pool pool{pool_size, tau, row, pool_keys, pool_count, group_of_slot, nullptr};
    std::vector<int64_t> k, g;
    for (int64_t i = 0; i < M; ++i) {
      const int64_t src = owner[gid[i]];
      if (src != home[gid[i]]) k.push_back(gid[i]), g.push_back(src * T + table[gid[i]]);
    }
    slots_remove(sl, k, g);
    k.clear();
    g.clear();
    for (int64_t i = 0; i < M; ++i) {
      if (dst[i] != home[gid[i]]) k.push_back(gid[i]), g.push_back(dst[i] * T + table[gid[i]]);
      owner[gid[i]] = static_cast<int32_t>(dst[i]);
    }
    arrive(sl, pool, floor, k, g);
    return 0;
  } catch (const std::exception& e) {
    last_error = e.what();
    return 1;
  }
}

// OwnershipDirectory.release_guests: the moving rows leave their owners' guest groups, those of ranks [lo, hi) only.
int herald_release_guests(int64_t M, const int64_t* gid, const int64_t* src, const int64_t* home, const int64_t* table,
                          int64_t lo, int64_t hi, int64_t T, int64_t G, const int64_t* cap, const int64_t* base,
                          const int64_t* alloc, int64_t* fill, int64_t* slot, int32_t* pos_of) {
  try {
    Slots sl{G, cap, base, alloc, fill, slot, pos_of};
    std::vector<int64_t> k, g;
    guests_at(M, gid, src, home, table, lo, hi, T, k, g);
    slots_remove(sl, k, g);
    return 0;
  } catch (const std::exception& e) {
    last_error = e.what();
    return 1;
  }
}

// herald_land_guests / herald_move_guests: the moving rows that are guests of ranks [lo, hi) leave their groups
// (src != nullptr: a host that applies its moves alone; else they left already, herald_release_guests), every row
// gets its new owner, and the rows arriving as guests of those ranks join their groups and, below their group's
// threshold, its pool. A group's region too small grows into the slot array's free end (grow_regions, as
// GuestSlots.reserve does); where the end lacks room it changes nothing, writes every group's fill after the moves
// to `need` and returns 2: the caller reserves the regions (GuestSlots.reserve lays them out again) and calls again.
static int move_guests(int64_t M, const int64_t* gid, const int64_t* src, const int64_t* dst, const int64_t* home,
                       const int64_t* table, int64_t lo, int64_t hi, int64_t T, int32_t* owner, Slots sl,
                       const Regions& rg, Pool pool, const int32_t* floor, int64_t* need) {
  try {
    std::vector<int64_t> lk, lg, ak, ag;
    if (src) guests_at(M, gid, src, home, table, lo, hi, T, lk, lg);
    guests_at(M, gid, dst, home, table, lo, hi, T, ak, ag);
    std::copy(sl.fill, sl.fill + sl.G, need);
    for (int64_t x : lg) --need[x];
    for (int64_t x : ag) ++need[x];
    bool grow = false;
    for (int64_t x = 0; x < sl.G; ++x) {
      if (need[x] > sl.cap[x]) throw std::runtime_error("GuestSlots.add: group over capacity");
      grow = grow || need[x] > sl.alloc[x];
    }
    if (grow && !grow_regions(sl, rg, need)) return 2;
    slots_remove(sl, lk, lg);
    for (int64_t i = 0; i < M; ++i) {
      ahead<1>(owner, gid, i, M);
      owner[gid[i]] = static_cast<int32_t>(dst[i]);
    }
    arrive(sl, pool, floor, ak, ag);
    return 0;
  } catch (const std::exception& e) {
    last_error = e.what();
    return 1;
  }
}

// OwnershipDirectory.land_guests + EvictionPool.arrived (move_guests, the guests having left already).
int herald_land_guests(int64_t M, const int64_t* gid, const int64_t* dst, const int64_t* home, const int64_t* table,
                       int64_t lo, int64_t hi, int64_t T, int32_t* owner, int64_t G, const int64_t* cap, int64_t* base,
                       int64_t* alloc, int64_t* fill, int64_t* slot, int32_t* pos_of, int64_t* top, int64_t n_slots,
                       int64_t min_region, int64_t pool_size, int64_t* tau, const int64_t* row, int64_t* pool_keys,
                       int64_t* pool_count, int32_t* group_of_slot, const int32_t* floor, int64_t* need) {
  return move_guests(M, gid, nullptr, dst, home, table, lo, hi, T, owner, Slots{G, cap, base, alloc, fill, slot, pos_of},
                     Regions{base, alloc, group_of_slot, top, n_slots, min_region},
                     Pool{pool_size, tau, row, pool_keys, pool_count, group_of_slot, nullptr}, floor, need);
}

// herald_release_guests then herald_land_guests for the moves of one host that applies them alone (a planner in its
// own process: no other host's rows arrive in between): one call, the regions checked before anything changes
// (returns 2 with `need`, every group's fill after the moves, as herald_land_guests does).
int herald_move_guests(int64_t M, const int64_t* gid, const int64_t* src, const int64_t* dst, const int64_t* home,
                       const int64_t* table, int64_t lo, int64_t hi, int64_t T, int32_t* owner, int64_t G,
                       const int64_t* cap, int64_t* base, int64_t* alloc, int64_t* fill, int64_t* slot, int32_t* pos_of,
                       int64_t* top, int64_t n_slots, int64_t min_region, int64_t pool_size, int64_t* tau,
                       const int64_t* row, int64_t* pool_keys, int64_t* pool_count, int32_t* group_of_slot,
                       const int32_t* floor, int64_t* need) {
  return move_guests(M, gid, src, dst, home, table, lo, hi, T, owner, Slots{G, cap, base, alloc, fill, slot, pos_of},
                     Regions{base, alloc, group_of_slot, top, n_slots, min_region},
                     Pool{pool_size, tau, row, pool_keys, pool_count, group_of_slot, nullptr}, floor, need);
}

}  // extern "C"

namespace {

// HeraldHierPolicy.decide_keys: a directory host's keys from their (key, reader, elements) pairs sorted by key then
// rank: each key's pairs (start, count; `kid`: each pair's key index), its owner before the step (dem_owner[pd[i]]:
// that of pair i's demand position), its first reader (`sole`) and where it should live (`want`): with its owner
// where the owner reads it, else with the reader of the most elements (ties: the lowest rank). Returns the number of
// keys.
int64_t decide_pairs(int64_t n, const int64_t* g, const int64_t* r, const int64_t* c, const int32_t* dem_owner,
                     const int64_t* pd, int64_t* keys, int64_t* own, int64_t* want, uint8_t* single, int64_t* sole,
                     int64_t* count, int64_t* start, int64_t* kid) {
  int64_t K = 0;
  for (int64_t i = 0; i < n;) {
    const int64_t key = g[i], o = dem_owner[pd[i]];
    bool owner_reads = false;
    int64_t best = r[i], most = c[i], j = i;
    for (; j < n && g[j] == key; ++j) {  // branch-free: which reader reads the most is the data's
      kid[j] = K;
      owner_reads |= r[j] == o;
      const bool more = c[j] > most;
      most = more ? c[j] : most;
      best = more ? r[j] : best;
    }
    keys[K] = key;
    own[K] = o;
    start[K] = i;
    count[K] = j - i;
    single[K] = j - i == 1;
    sole[K] = r[i];
    want[K] = owner_reads ? o : best;
    ++K;
    i = j;
  }
  return K;
}

}  // namespace

extern "C" {

// np.sort of n non-negative int64 values into `out`: a least-significant-digit radix sort over the bits the largest
// value uses (at most 10 bits a pass; a pass whose digit is the same in every value is skipped), ~10x numpy's sort
// of 10^4-10^5 values on the build here. Returns -1 (out untouched) where a value is negative.
int herald_sort_nonneg(int64_t n, const int64_t* in, int64_t* out) {
  uint64_t any = 0;
  for (int64_t i = 0; i < n; ++i) {
    if (in[i] < 0) return -1;
    any |= static_cast<uint64_t>(in[i]);
  }
  const int bits = any ? 64 - __builtin_clzll(any) : 0;
  const int passes = (bits + 9) / 10, width = passes ? (bits + passes - 1) / passes : 0;
  const uint64_t mask = (uint64_t{1} << width) - 1;
  std::vector<int64_t> hist(static_cast<size_t>(passes) << width, 0);
  for (int64_t i = 0; i < n; ++i)
    for (int p = 0; p < passes; ++p) ++hist[(static_cast<size_t>(p) << width) + ((in[i] >> (p * width)) & mask)];
  std::vector<int> live;
  for (int p = 0; p < passes; ++p) {
    const int64_t* h = hist.data() + (static_cast<size_t>(p) << width);
    if (std::find(h, h + (int64_t{1} << width), n) == h + (int64_t{1} << width)) live.push_back(p);
  }
  std::vector<int64_t> tmp(live.size() > 1 ? n : 0);
  const int64_t* src = in;
  for (size_t k = 0; k < live.size(); ++k) {
    int64_t* dst = (live.size() - k) % 2 ? out : tmp.data();  // the last pass writes `out`
    const int p = live[k];
    int64_t* h = hist.data() + (static_cast<size_t>(p) << width);
    for (int64_t b = 0, at = 0; b < (int64_t{1} << width); ++b) {
      const int64_t c = h[b];
      h[b] = at;
      at += c;
    }
    for (int64_t i = 0; i < n; ++i) dst[h[(src[i] >> (p * width)) & mask]++] = src[i];
    src = dst;
  }
  if (live.empty()) std::copy(in, in + n, out);
  return 0;
}

// np.unique(gid, return_inverse=True, return_counts=True) of E non-negative ids: the distinct ids through an open-
// addressing hash table (ids in the order first seen), then a radix sort of those alone, (id, first-seen index)
// packed, to number them in id order. The outputs hold E values; returns the number of distinct ids K (keys[:K],
// cnt[:K]), or -1 where an id is negative or the packed pairs need more than 62 bits.
int64_t herald_distinct(int64_t E, const int64_t* gid, int64_t* keys, int64_t* cid, int64_t* cnt) {
  if (E == 0) return 0;
  int shift = 64;
  uint64_t cap = 1;
  while (cap < 2 * static_cast<uint64_t>(E)) cap <<= 1, --shift;
  std::vector<int64_t> slot_key(cap, -1), first(E);
  std::vector<int32_t> slot_id(cap);
  int64_t K = 0;
  const auto slot_of = [&](int64_t g) {
    return shift < 64 ? (static_cast<uint64_t>(g) * 0x9E3779B97F4A7C15ull) >> shift : 0;
  };
  for (int64_t i = 0; i < E; ++i) {
    const int64_t g = gid[i];
    if (g < 0) return -1;
    if (i + kAhead < E) __builtin_prefetch(&slot_key[slot_of(gid[i + kAhead])]);
    uint64_t h = slot_of(g);
    while (slot_key[h] >= 0 && slot_key[h] != g) h = (h + 1) & (cap - 1);
    if (slot_key[h] < 0) slot_key[h] = g, slot_id[h] = static_cast<int32_t>(K), first[K++] = g;
    cid[i] = slot_id[h];
  }
  const int b = std::max(64 - __builtin_clzll(static_cast<uint64_t>(K - 1) | 1), 1);
  uint64_t any = 0;
  for (int64_t k = 0; k < K; ++k) any |= static_cast<uint64_t>(first[k]);
  if ((any ? 64 - __builtin_clzll(any) : 0) + b > 62) return -1;
  for (int64_t k = 0; k < K; ++k) first[k] = (first[k] << b) | k;
  std::vector<int64_t> packed(K), rank(K);
  herald_sort_nonneg(K, first.data(), packed.data());
  for (int64_t k = 0; k < K; ++k) {
    keys[k] = packed[k] >> b;
    rank[packed[k] & ((int64_t{1} << b) - 1)] = k;
    cnt[k] = 0;
  }
  for (int64_t i = 0; i < E; ++i) ++cnt[cid[i] = rank[cid[i]]];
  return K;
}

// HostPlanner.assign_and_read's reads message: every (key, reader rank) pair of a host's batch with its element
// count, grouped by the key's directory host `dest[k]` (0..H-1), each group's pairs in (key, rank) order as
// reads.step_reads lists them. Elements: `cid` with their sample's rank (width > 0: sample-major, else `smp`), ranks
// 0..P-1 of the host. Writes each group's bounds [H + 1] and per pair: the key's `index[k]`, rank0 + its rank and its
// element count; `cells` (int32 [K x P]) is scratch. Returns the number of pairs.
int64_t herald_host_reads(int64_t E, const int64_t* cid, int64_t width, const int64_t* smp, const int64_t* sample_rank,
                          int64_t K, int64_t P, const int64_t* dest, int64_t H, const int64_t* index, int64_t rank0,
                          int32_t* cells, int64_t* bounds, int32_t* out_index, int64_t* out_rank, int32_t* out_count) {
  std::fill(cells, cells + K * P, 0);
  if (width > 0) {
    for (int64_t i = 0, n = 0; i < E; i += width, ++n) {
      const int64_t r = sample_rank[n];
      for (int64_t j = i; j < i + width; ++j) ++cells[cid[j] * P + r];
    }
  } else {
    for (int64_t i = 0; i < E; ++i) ++cells[cid[i] * P + sample_rank[smp[i]]];
  }
  std::fill(bounds, bounds + H + 1, 0);
#if defined(__SSE2__)
  if (P == 8) {  // a host's 8 ranks: each key's readers as a byte from two compares (a branch per cell mispredicted
                 // at the one or two ranks that read a key), then one step per reader
    static const auto ones = [] {
      std::array<uint8_t, 256> n{};
      for (int m = 1; m < 256; ++m) n[m] = static_cast<uint8_t>(n[m >> 1] + (m & 1));
      return n;
    }();
    std::vector<uint8_t> readers(K);
    const __m128i zero = _mm_setzero_si128();
    for (int64_t k = 0; k < K; ++k) {
      const __m128i* c = reinterpret_cast<const __m128i*>(cells + k * 8);
      const int none = _mm_movemask_ps(_mm_castsi128_ps(_mm_cmpeq_epi32(_mm_loadu_si128(c), zero))) |
                       _mm_movemask_ps(_mm_castsi128_ps(_mm_cmpeq_epi32(_mm_loadu_si128(c + 1), zero))) << 4;
      readers[k] = static_cast<uint8_t>(~none & 0xFF);
      bounds[dest[k] + 1] += ones[readers[k]];
    }
    for (int64_t t = 0; t < H; ++t) bounds[t + 1] += bounds[t];
    std::vector<int64_t> at(bounds, bounds + H);
    for (int64_t k = 0; k < K; ++k) {
      int64_t& q = at[dest[k]];
      for (unsigned m = readers[k]; m; m &= m - 1) {
        const int r = __builtin_ctz(m);
        out_index[q] = static_cast<int32_t>(index[k]);
        out_rank[q] = rank0 + r;
        out_count[q++] = cells[k * 8 + r];
      }
    }
    return bounds[H];
  }
#endif
  for (int64_t k = 0; k < K; ++k)
    for (int64_t r = 0; r < P; ++r) bounds[dest[k] + 1] += cells[k * P + r] > 0;
  for (int64_t t = 0; t < H; ++t) bounds[t + 1] += bounds[t];
  std::vector<int64_t> at(bounds, bounds + H);
  for (int64_t k = 0; k < K; ++k) {
    for (int64_t r = 0; r < P; ++r) {
      const int32_t c = cells[k * P + r];
      if (c == 0) continue;
      const int64_t q = at[dest[k]]++;
      out_index[q] = static_cast<int32_t>(index[k]);
      out_rank[q] = rank0 + r;
      out_count[q] = c;
    }
  }
  return bounds[H];
}

// The segments of `values` (segment i: `count[i]` values from `start[i]`) in the order `order`, back to back, as int64:
// a CSR's rows reordered (host_plans.part_rows: the shared rows' readers from the parts' order into key order).
void herald_gather_segments(int64_t n, const int64_t* order, const int64_t* start, const int64_t* count,
                            const int64_t* values, int64_t* out) {
  for (int64_t i = 0; i < n; ++i) {
    const int64_t* v = values + start[order[i]];
    out = std::copy(v, v + count[order[i]], out);
  }
}

// balanced_assign(score, B) with first = 0 on float32 scores [N, R].
void herald_balanced_assign(const float* sc, int64_t N, int64_t R, int64_t B, int64_t* out) {
  balanced(sc, N, R, B, out);
}

// HeraldPolicy.assign in rotated rank coordinates, on the dense path: the first LAIA pass (score = bincount of
// w0 by (sample, owner)), then `refine` rounds of balanced best response. `own` is every key's owner (rotated),
// es / ec every scheduled element's sample and key index (own[k] = -1: no rank of this problem owns k, a host
// planner's remote key: it scores nowhere); S > 0: single-hot, S elements per sample, sample-major.
// w_int16: the per-key scores are small integers (numpy int16), else float32. stream_cap > 0: the first pass is
// the stream (laia.stream_assign, readers tracked up to stream_cap ranks; host != null: host-aware, the host of
// every rank in H hosts, a row inside a host costing `intra`), and the refine rounds start from its balanced
// assignment. Writes the assignment to `a`.
void herald_assign(int64_t N, int64_t R, int64_t B, int64_t K, int64_t E, const int64_t* es, const int64_t* ec,
                   const double* w0, int64_t S, const int64_t* own, int64_t refine,
                   double owner_weight, double stay_bonus, int w_int16, int64_t stream_cap, const int64_t* host,
                   int64_t H, double intra, int64_t* a) {
  if (stream_cap > 0) {
    if (!host && R <= stream_cap && R <= 64) {
      stream_pass_uncapped(N, R, B, K, E, es, ec, w0, S, own, a);
    } else {
      stream_pass(N, R, B, K, E, es, ec, w0, own, stream_cap, host, H, intra, a);
    }
    if (refine == 0) return;
  } else {
    std::vector<double> score(N * R, 0.0);
    for (int64_t i = 0; i < E; ++i) {  // own < 0: a key no rank of this problem owns (a host planner's remote keys)
      const int64_t o = own[ec[i]];
      if (o >= 0) score[es[i] * R + o] += w0[i];
    }
    if (refine == 0) {
      std::vector<float> sc(score.begin(), score.end());
      balanced(sc.data(), N, R, B, a);
      return;
    }
    for (int64_t n = 0; n < N; ++n) {
      const double* row = score.data() + n * R;
      a[n] = std::max_element(row, row + R) - row;  // the first maximum, as np.argmax
    }
  }
  if (w_int16) {
    refine_rounds<int16_t>(N, R, B, K, E, es, ec, S, own, refine, int16_t(2),
                           static_cast<int16_t>(owner_weight), owner_weight, stay_bonus, a);
  } else {
    refine_rounds<float>(N, R, B, K, E, es, ec, S, own, refine, 2.0f, static_cast<float>(owner_weight),
                         owner_weight, stay_bonus, a);
  }
}

// herald_batch_keys' pass over the elements: each element's key index (the keys in earlier words plus the set bits
// below its own in its word) and the count per key. Built a second time with the POPCNT instruction, which x86-64
// CPUs since 2008 have but the baseline target lacks (its popcount is a library call: no faster than the byte-per-row
// map it replaced).
static inline __attribute__((always_inline)) void key_indices(const int64_t* gid, int64_t E, const uint64_t* bits,
                                                       const int64_t* before, int64_t* cid, int64_t* count) {
  for (int64_t i = 0; i < E; ++i) {
    const int64_t g = gid[i], w = g >> 6;
    const int64_t c = before[w] + __builtin_popcountll(bits[w] & ((uint64_t{1} << (g & 63)) - 1));
    cid[i] = c;
    ++count[c];
  }
}

#if defined(__x86_64__)
static __attribute__((target("popcnt"))) void key_indices_popcnt(const int64_t* gid, int64_t E, const uint64_t* bits,
                                                          const int64_t* before, int64_t* cid, int64_t* count) {
  key_indices(gid, E, bits, before, cid, count);
}
#endif

// reads.batch_keys, bitmap path: distinct sorted keys of `gid` (values in [0, n_rows)), the index of every
// element's key, and the count per key. A bit per row and, per 64-row word, the keys in earlier words: an element's
// key index is that count plus the set bits below its own in its word. 63 KB at 337 k rows, in L2, where a byte
// per row and an int32 position per row (1.7 MB) missed the cache on every element. Returns K; keys / count need
// room for min(E, n_rows) entries.
int64_t herald_batch_keys(const int64_t* gid, int64_t E, int64_t n_rows, int64_t* keys, int64_t* cid,
                          int64_t* count) {
  const int64_t W = (n_rows + 63) / 64;
  std::vector<uint64_t> bits(W, 0);
  for (int64_t i = 0; i < E; ++i) bits[gid[i] >> 6] |= uint64_t{1} << (gid[i] & 63);
  std::vector<int64_t> before(W);
  int64_t K = 0;
  for (int64_t w = 0; w < W; ++w) {
    before[w] = K;
    for (uint64_t b = bits[w]; b; b &= b - 1) keys[K++] = w * 64 + __builtin_ctzll(b);
  }
  std::fill(count, count + K, int64_t{0});
#if defined(__x86_64__)
  if (__builtin_cpu_supports("popcnt")) {
    key_indices_popcnt(gid, E, bits.data(), before.data(), cid, count);
    return K;
  }
#endif
  key_indices(gid, E, bits.data(), before.data(), cid, count);
  return K;
}

// planner.scheduled_elements, single-hot batches: the scheduled columns `idx` [S] of the [N, width] element keys
// `cid`, sample-major (ec, the sample of each in es), and each element's first-pass weight, its key's
// geo[min(count, nmax)]. One pass where numpy made a column gather, a repeat and two gathers.
void herald_scheduled_elements(int64_t N, int64_t width, const int64_t* cid, int64_t S, const int64_t* idx,
                               const int64_t* count, const double* geo, int64_t nmax, int64_t* es, int64_t* ec,
                               double* w0) {
  for (int64_t n = 0, i = 0; n < N; ++n) {
    const int64_t* row = cid + n * width;
    for (int64_t j = 0; j < S; ++j, ++i) {
      const int64_t k = row[idx[j]];
      es[i] = n;
      ec[i] = k;
      w0[i] = geo[std::min(count[k], nmax)];
    }
  }
}

// HostPlanner's demand (phase 1): a host batch's sorted keys by directory host (HeraldHierPolicy.directory_host_of:
// the home rank's host shifted by the key's table, mod H; KeyWalk), each host's in key order: every key's directory
// host, the keys' order, each key's index in its host's demand, and the keys per host [H]. Returns -1 (last_error)
// where a key is outside the layout.
int herald_demand(int64_t K, const int64_t* keys, int64_t T, const int64_t* offsets, const int64_t* block, int64_t P,
                  int64_t H, int64_t* dir_host, int64_t* order, int64_t* index, int64_t* per_host) {
  std::fill(per_host, per_host + H, int64_t{0});
  KeyWalk walk(offsets, block, T, P, H);
  if (K && !(walk.in_layout(keys[0]) && walk.in_layout(keys[K - 1])))  // (sorted: the ends hold the rest)
    return last_error = "demand: a key outside the layout", -1;
  for (int64_t k = 0; k < K; ++k) {
    walk.to(keys[k]);
    dir_host[k] = walk.dir;
    index[k] = per_host[dir_host[k]]++;
  }
  std::vector<int64_t> at(H, 0);
  for (int64_t h = 1; h < H; ++h) at[h] = at[h - 1] + per_host[h - 1];
  for (int64_t k = 0; k < K; ++k) order[at[dir_host[k]] + index[k]] = k;
  return 0;
}

// reads.step_reads, dense path: distinct (key, rank) pairs sorted by key then rank, for element keys `cid` and
// element ranks (`width` > 0: sample-major [N, width] elements, rank of the sample; else `smp` gives the sample).
// `mark` is uint8 scratch of K * R cells (any content). Writes count / start per key; returns the pair count.
int64_t herald_step_reads(const int64_t* cid, int64_t E, int64_t width, const int64_t* smp, const int64_t* sample_rank,
                          int64_t K, int64_t R, uint8_t* mark, int64_t* count, int64_t* start, int64_t* pair_key,
                          int64_t* pair_rank) {
  std::memset(mark, 0, static_cast<size_t>(K * R));
  if (width > 0) {
    for (int64_t i = 0, n = 0; i < E; i += width, ++n) {
      const int64_t r = sample_rank[n];
      for (int64_t j = i; j < i + width; ++j) mark[cid[j] * R + r] = 1;
    }
  } else {
    for (int64_t i = 0; i < E; ++i) mark[cid[i] * R + sample_rank[smp[i]]] = 1;
  }
  int64_t P = 0;
  for (int64_t k = 0; k < K; ++k) {
    start[k] = P;
    const uint8_t* m = mark + k * R;
    for (int64_t r = 0; r < R; ++r)
      if (m[r]) pair_key[P] = k, pair_rank[P] = r, ++P;
    count[k] = P - start[k];
  }
  return P;
}

// reads.step_reads, sparse path: the same pairs as herald_step_reads without its [K, R] table (K x R cells: 16 M at
// R=256 on a small model, 10^8 and more on full-size tables). Elements are taken rank by rank (a counting sort of
// their ranks) and every key's readers appended as they come, so each key's list comes out sorted by rank; `last`
// (per key, the rank that last read it) keeps a reader once. O(E + K + R) time and memory.
int64_t herald_step_reads_sparse(const int64_t* cid, int64_t E, int64_t width, const int64_t* smp,
                                 const int64_t* sample_rank, int64_t K, int64_t R, int64_t* count, int64_t* start,
                                 int64_t* pair_key, int64_t* pair_rank) {
  // items: samples (width > 0: a sample's `width` elements are contiguous) or elements, bucketed by rank
  const int64_t n = width > 0 ? E / width : E;
  std::vector<int64_t> first(R + 1, 0);
  std::vector<int32_t> order(n);
  for (int64_t i = 0; i < n; ++i) ++first[(width > 0 ? sample_rank[i] : sample_rank[smp[i]]) + 1];
  for (int64_t r = 0; r < R; ++r) first[r + 1] += first[r];
  {
    std::vector<int64_t> next(first.begin(), first.end() - 1);
    for (int64_t i = 0; i < n; ++i) order[next[width > 0 ? sample_rank[i] : sample_rank[smp[i]]]++] = static_cast<int32_t>(i);
  }
  // one pass, rank by rank: each key's first element at a rank makes a pair (pairs come out rank-major)
  std::vector<int32_t> last(K, -1), tk(E), tr(E);
  std::fill(count, count + K, int64_t{0});
  const int64_t w = width > 0 ? width : 1;
  int64_t P = 0;
  for (int64_t r = 0; r < R; ++r) {
    const int32_t r32 = static_cast<int32_t>(r);
    for (int64_t q = first[r]; q < first[r + 1]; ++q) {
      const int64_t* c = cid + static_cast<int64_t>(order[q]) * w;
      for (int64_t j = 0; j < w; ++j) {
        const int64_t k = c[j];
        if (last[k] != r32) last[k] = r32, tk[P] = static_cast<int32_t>(k), tr[P] = r32, ++P, ++count[k];
      }
    }
  }
  // then key by key (a stable counting sort by key keeps each key's readers in rank order)
  int64_t s = 0;
  for (int64_t k = 0; k < K; ++k) start[k] = s, s += count[k];
  std::vector<int64_t> at(start, start + K);
  for (int64_t p = 0; p < P; ++p) {
    const int64_t q = at[tk[p]]++;
    pair_key[q] = tk[p], pair_rank[q] = tr[p];
  }
  return P;
}

// ---- herald_hier's routing of a home host's part (host_planner.HostPlanner.routed) -------------------------------

}  // extern "C"

namespace {

// A home host's shared readers grouped by host within each row: group g is pairs gs[g]..gs[g + 1], all on host
// gh[g]; row i's groups are rg[i]..rg[i + 1]. Built without a branch per group (the routing passes that walked the
// pairs mispredicted one at every group's end: half their time); `in_order`: every row's readers in host order.
struct ReaderGroups {
  std::vector<int64_t> gs, gh, rg;
  bool in_order = true;
  ReaderGroups(int64_t n, const int64_t* ro, const int64_t* rd, const HostOfRank& host)
      : gs(ro[n] + 1), gh(ro[n] + 1), rg(n + 1) {
    int64_t G = 0;
    bool back = false;
    for (int64_t i = 0; i < n; ++i) {
      rg[i] = G;
      int64_t prev = std::numeric_limits<int64_t>::min();  // a group starts at a row's first pair
      for (int64_t p = ro[i]; p < ro[i + 1]; ++p) {
        const int64_t u = host(rd[p]);
        gs[G] = p, gh[G] = u;  // slot G is the next group's: kept only where one starts here
        back |= u < prev;
        G += u != prev;
        prev = u;
      }
    }
    rg[n] = G, gs[G] = ro[n];
    in_order = !back;
  }
};

// host_planner._route_shared: each (row, reader) pair of a home host's n shared rows (readers in CSR `ro` / `rd`,
// ranks sorted, so a host's readers come together: `groups`) to the hosts that execute it: every pair to the hosts of
// the row's owners before and after the moves, and each other host its own pairs. Counts them into `dest_bounds`
// (pairs) and `run_bounds` (runs of one row's pairs) per host, marks the rows a host relay serves (`relayed`: a (row,
// host) group of two readers that do not receive the row in the moves, on a host not both owners'), then hands every
// run to `put(i, s, e, d, r)`: row i's pairs s..e go to some host, at pairs d.. and run r of the host-by-host order
// (within a host, rows in order). Returns the pairs routed, or -1 where a row's readers are not in host order
// (numpy's code then runs).
template <typename Put>
int64_t route_shared_rows(int64_t n, const int64_t* ro, const int64_t* rd, const int64_t* before, const int64_t* after,
                          const HostOfRank& host, const ReaderGroups& groups, int64_t H, int64_t* dest_bounds,
                          int64_t* run_bounds, uint8_t* relayed, Put&& put) {
  if (!groups.in_order) return -1;
  const int64_t *gs = groups.gs.data(), *gh = groups.gh.data(), *rg = groups.rg.data();
  std::vector<int64_t> dcount(H, 0), rcount(H, 0);
  for (int64_t i = 0; i < n; ++i) {
    const int64_t b = host(before[i]), a = host(after[i]), s = ro[i], e = ro[i + 1];
    const bool moved = before[i] != after[i];
    dcount[b] += e - s;
    rcount[b] += 1;
    if (a != b) {
      dcount[a] += e - s;
      rcount[a] += 1;
    }
    uint8_t relay = 0;
    for (int64_t g = rg[i]; g < rg[i + 1]; ++g) {
      const int64_t u = gh[g], len = gs[g + 1] - gs[g];
      int64_t live = len;  // its readers that do not receive the row in the moves (all on the new owner's host)
      if (moved && u == a)
        for (int64_t j = gs[g]; j < gs[g + 1]; ++j) live -= rd[j] == after[i];
      relay |= live >= 2 && (u != b || u != a);
      const bool other = u != b && u != a;
      dcount[u] += other ? len : 0;
      rcount[u] += other;
    }
    relayed[i] = relay;
  }
  dest_bounds[0] = run_bounds[0] = 0;
  for (int64_t t = 0; t < H; ++t) {
    dest_bounds[t + 1] = dest_bounds[t] + dcount[t];
    run_bounds[t + 1] = run_bounds[t] + rcount[t];
  }
  std::vector<int64_t> dpos(dest_bounds, dest_bounds + H), rpos(run_bounds, run_bounds + H);
  auto to = [&](int64_t t, int64_t i, int64_t s, int64_t e) {
    put(i, s, e, dpos[t], rpos[t]++);
    dpos[t] += e - s;
  };
  for (int64_t i = 0; i < n; ++i) {
    const int64_t b = host(before[i]), a = host(after[i]);
    to(b, i, ro[i], ro[i + 1]);
    if (a != b) to(a, i, ro[i], ro[i + 1]);
    for (int64_t g = rg[i]; g < rg[i + 1]; ++g)
      if (gh[g] != b && gh[g] != a) to(gh[g], i, gs[g], gs[g + 1]);
  }
  return dest_bounds[H];
}

// HostPlanner.routed's bits of a table in a host's step summary (host_messages.MOVED, SHARED, RELAYED)
constexpr uint8_t kMoved = 1, kShared = 2, kRelayed = 4;

// herald_route_part for ranks (and reader counts) of type Rk: the planners' wire carries them as int16 or int32.
template <typename Rk>
int64_t route_part(const int64_t* dims, void* const* arrays) {
  const int64_t h = dims[1], P = dims[2], H = dims[3], T = dims[4], K = dims[5], n_mig = dims[6], n = dims[7],
                n_pairs = dims[8], n_vic = dims[9];
  auto in = [&](int i) { return static_cast<const int64_t*>(arrays[i]); };
  auto in_rk = [&](int i) { return static_cast<const Rk*>(arrays[i]); };
  const int64_t *offsets = in(0), *block = in(1), *k_own = in(2), *mig_at = in(3), *mig_key = in(4), *sh_at = in(7),
                *sh_key = in(8), *readers = in(11), *victims = in(13), *counts = in(15);
  const Rk *mig_src = in_rk(5), *mig_dst = in_rk(6), *sh_owner = in_rk(9), *sh_count = in_rk(10),
           *sh_readers = in_rk(12), *victim_src = in_rk(14);
  auto out = [&](int i) { return static_cast<int64_t*>(arrays[i]); };
  auto out_rk = [&](int i) { return static_cast<Rk*>(arrays[i]); };
  int64_t *o_mig_key = out(16), *o_run_key = out(19), *o_victims = out(23), *summary = out(25), *starts = out(27),
          *stops = out(28), *lens = out(29);
  Rk *o_mig_src = out_rk(17), *o_mig_dst = out_rk(18), *o_run_owner = out_rk(20), *o_run_count = out_rk(21),
     *o_readers = out_rk(22), *o_victim_src = out_rk(24);
  uint8_t* flags = static_cast<uint8_t*>(arrays[26]);
  const HostOfRank host(P, H);
  // the shared rows (routed's _route_shared): readers in CSR from their counts, owners before (own) and after; each
  // run written as numpy gathers it (sh_key[run_row], sh_owner[run_row], run_count.astype(rk), sh_readers[pair])
  std::vector<int64_t> ro(n + 1, 0), before(n), after(n);
  for (int64_t i = 0; i < n; ++i) {
    ro[i + 1] = ro[i] + static_cast<int64_t>(sh_count[i]);
    before[i] = k_own[sh_at[i]];
    after[i] = static_cast<int64_t>(sh_owner[i]);
  }
  if (ro[n] != n_pairs) {
    last_error = "the shared rows' reader counts add up to " + std::to_string(ro[n]) + ", not the " +
                 std::to_string(n_pairs) + " readers";
    return -2;
  }
  std::vector<int64_t> pb(H + 1), rb(H + 1);
  std::vector<uint8_t> relayed(n);
  const ReaderGroups groups(n, ro.data(), readers, host);
  const int64_t pairs = route_shared_rows(
      n, ro.data(), readers, before.data(), after.data(), host, groups, H, pb.data(), rb.data(), relayed.data(),
      [&](int64_t i, int64_t s, int64_t e, int64_t d, int64_t r) {
        std::copy(sh_readers + s, sh_readers + e, o_readers + d);
        o_run_key[r] = sh_key[i], o_run_owner[r] = sh_owner[i], o_run_count[r] = static_cast<Rk>(e - s);
      });
  if (pairs < 0) return -1;
  // each shared row's migration (k_mig[shared]) and each migration's shared row (-1: a plain migration)
  std::vector<int64_t> k_mig(K, -1), mig_row(n_mig, -1);
  for (int64_t m = 0; m < n_mig; ++m) k_mig[mig_at[m]] = m;
  for (int64_t i = 0; i < n; ++i)
    if (k_mig[sh_at[i]] >= 0) mig_row[k_mig[sh_at[i]]] = i;
  // a plain migration to its source's and destination's hosts; a shared row's to every host its row's runs go to
  // (route_shared's: both owners' hosts and the hosts of its other readers); counted, then written in migration
  // order by host: numpy's sorted (host, migration) codes
  auto mig_hosts = [&](int64_t m, auto&& to) {
    const int64_t i = mig_row[m];
    if (i < 0) {
      const int64_t s = host(mig_src[m]), d = host(mig_dst[m]);
      to(s);
      if (d != s) to(d);
      return;
    }
    const int64_t b = host(before[i]), a = host(after[i]);
    to(b);
    if (a != b) to(a);
    for (int64_t g = groups.rg[i]; g < groups.rg[i + 1]; ++g)
      if (groups.gh[g] != b && groups.gh[g] != a) to(groups.gh[g]);
  };
  std::vector<int64_t> mb, vb;
  by_host(n_mig, H, mb, mig_hosts, [&](int64_t m, int64_t q) {
    o_mig_key[q] = mig_key[m], o_mig_src[q] = mig_src[m], o_mig_dst[q] = mig_dst[m];
  });
  // a victim to h, its home host and its directory host (directory_host_of), each once: numpy's sorted_distinct codes
  std::vector<int64_t> v_home(n_vic), v_dir(n_vic);
  std::vector<int64_t> v_table(n_vic);
  KeyWalk victim_walk(offsets, block, T, P, H);
  for (int64_t v = 0; v < n_vic; ++v) {
    if (!victim_walk.in_layout(victims[v])) {
      last_error = "victim " + std::to_string(victims[v]) + " is in no table of the layout";
      return -2;
    }
    victim_walk.to(victims[v]);
    v_table[v] = victim_walk.t, v_home[v] = victim_walk.home / P, v_dir[v] = victim_walk.dir;
  }
  auto victim_hosts = [&](int64_t v, auto&& to) {
    const int64_t a = v_home[v], d = v_dir[v];
    to(h);
    if (a != h) to(a);
    if (d != h && d != a) to(d);
  };
  by_host(n_vic, H, vb, victim_hosts, [&](int64_t v, int64_t q) {
    o_victims[q] = victims[v], o_victim_src[q] = victim_src[v];
  });
  // the summary: (hit, remote, migrations, victims) and each table's bits
  summary[0] = counts[0], summary[1] = counts[1], summary[2] = n_mig, summary[3] = n_vic;
  std::fill(flags, flags + T, uint8_t{0});
  KeyWalk mig_walk(offsets, block, T), shared_walk(offsets, block, T);  // (a key in no table flags none)
  for (int64_t m = 0; m < n_mig; ++m)
    if (mig_walk.in_layout(mig_key[m])) flags[mig_walk.table(mig_key[m])] |= kMoved;
  for (int64_t v = 0; v < n_vic; ++v) flags[v_table[v]] |= kMoved;
  for (int64_t i = 0; i < n; ++i)
    if (shared_walk.in_layout(sh_key[i]))
      flags[shared_walk.table(sh_key[i])] |= relayed[i] ? kShared | kRelayed : kShared;
  // host t's slice of each field: migrations (3), runs (3), pairs, victims (2), the summary and the bits whole
  constexpr int64_t W = 11;
  for (int64_t t = 0; t < H; ++t) {
    int64_t* lo = starts + t * W;
    int64_t* hi = stops + t * W;
    for (int64_t f = 0; f < 3; ++f) lo[f] = mb[t], hi[f] = mb[t + 1], lo[3 + f] = rb[t], hi[3 + f] = rb[t + 1];
    lo[6] = pb[t], hi[6] = pb[t + 1];
    lo[7] = lo[8] = vb[t], hi[7] = hi[8] = vb[t + 1];
    lo[9] = lo[10] = 0, hi[9] = 4, hi[10] = T;
  }
  lens[0] = mb[H], lens[1] = rb[H], lens[2] = pairs, lens[3] = vb[H];
  return 0;
}

}  // namespace

extern "C" {

// hierarchy.HostPlanner.routed, whole: a directory host h's part of the plan (HostPlanner.part) split by the host
// that needs each entry, every field of its Outbox and every host's slice bounds in one pass (routed's numpy code,
// entry for entry). `dims`: rank_bytes (2, 4 or 8: the ranks' type), h, P, H, T, K, n_mig, n, n_pairs, n_vic.
// `arrays`, addresses (0 for an empty one: never read), in: the layout's T + 1 offsets and the directory's block per
// table (a key's home), h's K keys' owners before the moves; the migrations' indices among the keys, key, source,
// destination; the shared rows' indices, key, owner, reader count, readers (int64, then as sent); the victims and
// their owners; the (hit, remote) counts; out: the Outbox's 11 fields (lengths in `lens`: migration entries, runs,
// pairs, victim entries), its [H, 11] starts and stops, lens. Arrays are int64 but ranks and counts (Rk), flags
// uint8. Returns 0; -1 where a shared row's readers are not in host order (the caller's numpy code then runs); -2 on
// malformed input (herald_last_error says how). Arrays travel as one table: 30 ctypes arguments cost ~20 us.
int64_t herald_route_part(const int64_t* dims, void* const* arrays) {
  switch (dims[0]) {
    case 2: return route_part<int16_t>(dims, arrays);
    case 4: return route_part<int32_t>(dims, arrays);
    case 8: return route_part<int64_t>(dims, arrays);
  }
  last_error = "ranks of " + std::to_string(dims[0]) + " bytes";
  return -2;
}

// ---- the plan's flat wire form (plan_wire.py): the same bytes as its numpy code --------------------------------

// plan_wire._assignment: each global sample's rank (n = R * B) from the sample order, where it determines it (every
// rank's slice increasing, a permutation). Returns 0, or 1: the plan travels in the general form.
int herald_wire_assignment(int64_t R, int64_t B, const int64_t* so, int64_t* rank) {
  const int64_t n = R * B;
  if (n == 0) return 1;
  std::fill(rank, rank + n, int64_t{-1});
  for (int64_t q = 0, i = 0; q < R; ++q)
    for (int64_t b = 0; b < B; ++b, ++i) {
      const int64_t v = so[i];
      if (v < 0 || v >= n || (b > 0 && v <= so[i - 1]) || rank[v] >= 0) return 1;
      rank[v] = q;
    }
  return 0;
}

// plan_wire._reader_mask: each of the n shared rows' readers as one bitmask, where the CSR says the same (readers
// sorted and distinct, ranks 0..62, every row read). Returns 0, or 1: the plan travels in the general form.
int herald_wire_reader_mask(int64_t n, const int64_t* ro, int64_t P, const int64_t* rd, int64_t* mask) {
  if (n == 0 || ro[0] != 0 || ro[n] != P) return 1;
  for (int64_t k = 0; k < n; ++k) {
    if (ro[k + 1] - ro[k] < 1) return 1;
    int64_t m = 0;
    for (int64_t j = ro[k]; j < ro[k + 1]; ++j) {
      if (rd[j] < 0 || rd[j] > 62 || (j > ro[k] && rd[j] <= rd[j - 1])) return 1;
      m += int64_t{1} << rd[j];
    }
    mask[k] = m;
  }
  return 0;
}

// plan_wire._narrow of k int64 arrays, written back to back into `out`: each in the narrowest of int8 / int16 /
// int32 / int64 that holds its values; `sizes[i]` gets its item size. Returns the bytes written.
int64_t herald_wire_pack(int64_t k, const int64_t* const* arrays, const int64_t* lens, uint8_t* out, int64_t* sizes) {
  int64_t pos = 0;
  for (int64_t i = 0; i < k; ++i) {
    const int64_t* a = arrays[i];
    const int64_t n = lens[i];
    int64_t lo = 0, hi = 0;
    if (n) lo = *std::min_element(a, a + n), hi = *std::max_element(a, a + n);
    const int64_t size = (lo >= INT8_MIN && hi <= INT8_MAX) ? 1 : (lo >= INT16_MIN && hi <= INT16_MAX) ? 2
                         : (lo >= INT32_MIN && hi <= INT32_MAX) ? 4 : 8;
    sizes[i] = size;
    uint8_t* o = out + pos;
    if (size == 1) for (int64_t j = 0; j < n; ++j) reinterpret_cast<int8_t*>(o)[j] = static_cast<int8_t>(a[j]);
    if (size == 2) for (int64_t j = 0; j < n; ++j) reinterpret_cast<int16_t*>(o)[j] = static_cast<int16_t>(a[j]);
    if (size == 4) for (int64_t j = 0; j < n; ++j) reinterpret_cast<int32_t*>(o)[j] = static_cast<int32_t>(a[j]);
    if (size == 8) std::memcpy(o, a, static_cast<size_t>(n) * 8);
    pos += n * size;
  }
  return pos;
}

// The inverse: k arrays of item sizes `sizes` (1, 2, 4, 8), back to back from `buf`, widened to int64.
void herald_wire_unpack(int64_t k, const uint8_t* buf, const int64_t* lens, const int64_t* sizes, int64_t* const* outs) {
  for (int64_t i = 0; i < k; ++i) {
    const int64_t n = lens[i], size = sizes[i];
    int64_t* o = outs[i];
    if (size == 1) for (int64_t j = 0; j < n; ++j) o[j] = reinterpret_cast<const int8_t*>(buf)[j];
    if (size == 2) for (int64_t j = 0; j < n; ++j) { int16_t v; std::memcpy(&v, buf + 2 * j, 2); o[j] = v; }
    if (size == 4) for (int64_t j = 0; j < n; ++j) { int32_t v; std::memcpy(&v, buf + 4 * j, 4); o[j] = v; }
    if (size == 8) std::memcpy(o, buf, static_cast<size_t>(n) * 8);
    buf += n * size;
  }
}

// plan_wire._readers_from_mask: the reader CSR of n bitmasks (each row's readers increasing), ranks below R.
// Returns the pairs, or -1 for a mask with a bit at R or above (the numpy code decodes it).
int64_t herald_wire_readers(int64_t n, int64_t R, const int64_t* mask, int64_t* offsets, int64_t* readers) {
  int64_t P = 0;
  offsets[0] = 0;
  for (int64_t k = 0; k < n; ++k) {
    if (R < 63 && (mask[k] >> R) != 0) return -1;
    for (int64_t r = 0; r < R && r < 63; ++r)
      if ((mask[k] >> r) & 1) readers[P++] = r;
    offsets[k + 1] = P;
  }
  return P;
}

// np.argsort(rank, kind="stable") of ranks in [0, R): a counting sort. Returns 0, or 1 for a rank out of range.
int herald_wire_sample_order(int64_t n, int64_t R, const int64_t* rank, int64_t* order) {
  std::vector<int64_t> start(R + 1, 0);
  for (int64_t i = 0; i < n; ++i) {
    if (rank[i] < 0 || rank[i] >= R) return 1;
    ++start[rank[i] + 1];
  }
  for (int64_t q = 0; q < R; ++q) start[q + 1] += start[q];
  for (int64_t i = 0; i < n; ++i) order[start[rank[i]]++] = i;
  return 0;
}

}  // extern "C"

namespace {

// ---- herald_hier planner messages (schedule/message_wire.py; its docstring has the format) ----------------------
// Modes: 0 raw bytes, 1 bits (value - base), 2 delta bits (delta - least delta), 3 zigzag varint, 4 zigzag varint of
// deltas. Integer kinds (element codes): 1 int8, 2 uint8, 3 int16, 4 uint16, 5 int32, 6 uint32, 7 int64.
static inline uint64_t msg_zz(int64_t v) { return (static_cast<uint64_t>(v) << 1) ^ static_cast<uint64_t>(v >> 63); }
static inline int64_t msg_unzz(uint64_t u) { return static_cast<int64_t>((u >> 1) ^ (~(u & 1) + 1)); }
static inline int64_t msg_bitlen(uint64_t u) { return u ? 64 - __builtin_clzll(u) : 0; }
// a varint's bytes: ceil(bits / 7), at least 1, by a table over the bit length (a division per value was the
// size pass's most costly step)
constexpr std::array<uint8_t, 65> kVarintBytes = [] {
  std::array<uint8_t, 65> t{};
  for (int b = 0; b <= 64; ++b) t[b] = static_cast<uint8_t>(b ? (b + 6) / 7 : 1);
  return t;
}();
static inline int64_t msg_vlen(uint64_t u) { return kVarintBytes[64 - __builtin_clzll(u | 1)]; }
static inline uint8_t* msg_put_varint(uint8_t* o, uint64_t u) {
  while (u >= 128) { *o++ = static_cast<uint8_t>(u | 128); u >>= 7; }
  *o++ = static_cast<uint8_t>(u);
  return o;
}
// Element j of an array of T at b, as int64 (any alignment).
template <typename T>
static inline int64_t msg_at(const uint8_t* b, int64_t j) {
  T x;
  std::memcpy(&x, b + sizeof(T) * j, sizeof(T));
  return static_cast<int64_t>(x);
}
static inline int64_t msg_sub(int64_t a, int64_t b) {  // a - b as uint64 wraps
  return static_cast<int64_t>(static_cast<uint64_t>(a) - static_cast<uint64_t>(b));
}
template <typename W, typename U>
static uint8_t* msg_put_words(uint8_t* o, int64_t n, const U& u) {
  for (int64_t j = 0; j < n; ++j) {
    const W x = static_cast<W>(u(j));
    std::memcpy(o + sizeof(W) * j, &x, sizeof(W));
  }
  return o + static_cast<int64_t>(sizeof(W)) * n;
}
// a byte at a time through an accumulator of type Acc, which holds the up to 7 bits left over plus one value
template <typename Acc, typename U>
static uint8_t* msg_put_bytes(uint8_t* o, int64_t n, int64_t b, const U& u) {
  Acc acc = 0;
  int64_t have = 0;
  for (int64_t j = 0; j < n; ++j) {
    acc |= static_cast<Acc>(u(j)) << have;
    have += b;
    while (have >= 8) { *o++ = static_cast<uint8_t>(acc); acc >>= 8; have -= 8; }
  }
  if (have > 0) *o++ = static_cast<uint8_t>(acc);
  return o;
}
// n values u(j) of b bits each (u(j) < 2^b), least significant first, into ceil(n b / 8) bytes: whole bytes by
// little-endian stores; up to 32 bits through a 64-bit accumulator flushed 4 bytes at a time; wider ones a byte at
// a time (a 128-bit accumulator above 56 bits). The bytes are the same whichever way they are flushed.
template <typename U>
static uint8_t* msg_put_bits(uint8_t* o, int64_t n, int64_t b, const U& u) {
  if (b == 8) return msg_put_words<uint8_t>(o, n, u);
  if (b == 16) return msg_put_words<uint16_t>(o, n, u);
  if (b == 32) return msg_put_words<uint32_t>(o, n, u);
  if (b <= 32) {
    uint64_t acc = 0;
    int64_t have = 0;
    for (int64_t j = 0; j < n; ++j) {
      acc |= u(j) << have;
      have += b;
      if (have >= 32) {
        const uint32_t w = static_cast<uint32_t>(acc);
        std::memcpy(o, &w, 4);
        o += 4, acc >>= 32, have -= 32;
      }
    }
    for (; have > 0; have -= 8) *o++ = static_cast<uint8_t>(acc), acc >>= 8;
    return o;
  }
  return b <= 56 ? msg_put_bytes<uint64_t>(o, n, b, u) : msg_put_bytes<unsigned __int128>(o, n, b, u);
}

// What msg_encode_ints needs to know of n >= 1 values x[0 .. n) before it picks a mode: their least and greatest
// value, the least and greatest delta x[j] - x[j - 1] (0, 0 for one value; deltas wrap as uint64), and how many
// values and deltas (the first value counting as a delta from 0) take more than one varint byte (zigzag >= 128).
struct MsgStats {
  int64_t lo, hi, dlo, dhi, wide_v, wide_d;
};
template <typename T>
static MsgStats msg_stats(const uint8_t* in, int64_t n) {
  const auto x = [in](int64_t j) { return msg_at<T>(in, j); };
  const auto wide = [](int64_t v) { return static_cast<int64_t>(static_cast<uint64_t>(v) + 64 >= 128); };
  MsgStats st{x(0), x(0), n >= 2 ? msg_sub(x(1), x(0)) : 0, 0, wide(x(0)), wide(x(0))};
  st.dhi = st.dlo;
  for (int64_t j = 1, prev = st.lo; j < n; ++j) {
    const int64_t v = x(j), d = msg_sub(v, prev);
    st.lo = std::min(st.lo, v), st.hi = std::max(st.hi, v), st.dlo = std::min(st.dlo, d), st.dhi = std::max(st.dhi, d);
    st.wide_v += wide(v), st.wide_d += wide(d);
    prev = v;
  }
  return st;
}
// Values of 16 bits or fewer: the same in int32 lanes (their deltas fit), which the compiler vectorises (int64
// minima and maxima it cannot, on the baseline x86-64 this is built for); the rank arrays are most of what a
// planner sends. In chunks of 2^30 so that the int32 counts stay exact.
template <typename T>
#if defined(__GNUC__) && !defined(__clang__)
__attribute__((optimize("tree-vectorize", "vect-cost-model=dynamic")))
#endif
static MsgStats msg_stats_small(const T* x, int64_t n) {
  static_assert(sizeof(T) <= 2, "values of 16 bits or fewer");
  int32_t lo = x[0], hi = lo, dlo = n >= 2 ? x[1] - x[0] : 0, dhi = dlo;
  int64_t wide_v = 0, wide_d = 0;
  for (int64_t c = 0; c < n; c += int64_t{1} << 30) {
    const int64_t e = std::min(n, c + (int64_t{1} << 30));
    int32_t wv = 0, wd = 0;
    for (int64_t j = std::max<int64_t>(c, 1); j < e; ++j) {
      const int32_t v = x[j], d = v - x[j - 1];
      lo = std::min(lo, v), hi = std::max(hi, v), dlo = std::min(dlo, d), dhi = std::max(dhi, d);
      wv += static_cast<uint32_t>(v + 64) >= 128u, wd += static_cast<uint32_t>(d + 64) >= 128u;
    }
    wide_v += wv, wide_d += wd;
  }
  const int64_t w0 = static_cast<uint32_t>(x[0] + 64) >= 128u;  // the first value, counted in both
  return {lo, hi, dlo, dhi, wide_v + w0, wide_d + w0};
}

// n >= 1 integers of type T at `in` in the mode of fewest bytes (ties: the lower mode), raw taking `raw` bytes: the
// mode written into header byte *h (its dtype code already there), the payload from o. Returns the payload's end,
// or nullptr where it would pass lim. The values are read where they are (no widened copy): one pass for min, max,
// the least and greatest delta and how many values and deltas need a second varint byte, one more for the varint
// sizes where a varint mode could still win, one to write.
template <typename T>
static uint8_t* msg_encode_ints(const uint8_t* in, int64_t n, int64_t raw, uint8_t* h, uint8_t* o, uint8_t* lim) {
  const auto x = [in](int64_t j) { return msg_at<T>(in, j); };
  MsgStats st;
  if constexpr (sizeof(T) <= 2) {
    if (reinterpret_cast<uintptr_t>(in) % alignof(T) == 0) {
      st = msg_stats_small(reinterpret_cast<const T*>(in), n);
    } else {
      st = msg_stats<T>(in, n);
    }
  } else {
    st = msg_stats<T>(in, n);
  }
  const int64_t lo = st.lo, hi = st.hi, dlo = st.dlo, dhi = st.dhi, wide_v = st.wide_v, wide_d = st.wide_d;
  const int64_t b = msg_bitlen(static_cast<uint64_t>(hi) - static_cast<uint64_t>(lo));
  const int64_t bits = msg_vlen(msg_zz(lo)) + 1 + (n * b + 7) / 8;
  const int64_t db = msg_bitlen(static_cast<uint64_t>(dhi) - static_cast<uint64_t>(dlo));
  const int64_t dbits = n >= 2 ? msg_vlen(msg_zz(x(0))) + msg_vlen(msg_zz(dlo)) + 1 + ((n - 1) * db + 7) / 8
                               : std::numeric_limits<int64_t>::max();
  // a varint takes a byte, two where its zigzag is 128 or more: where raw, bits or delta bits take no more than that
  // bound, neither varint mode can take fewer (ties go to the lower mode), so their sizes are not needed
  int64_t vl = std::numeric_limits<int64_t>::max(), dvl = vl;
  if (std::min(std::min(raw, bits), dbits) > n + std::min(wide_v, wide_d)) {
    vl = 0, dvl = 0;
    for (int64_t j = 0, prev = 0; j < n; ++j) {
      const int64_t v = x(j);
      vl += msg_vlen(msg_zz(v)), dvl += msg_vlen(msg_zz(msg_sub(v, prev)));
      prev = v;
    }
  }
  const int64_t size[5] = {raw, bits, dbits, vl, dvl};
  int mode = 0;
  for (int q = 1; q < 5; ++q)
    if (size[q] < size[mode]) mode = q;
  if (o + size[mode] > lim) return nullptr;
  *h = static_cast<uint8_t>(*h | mode);
  if (mode == 0) {
    std::memcpy(o, in, static_cast<size_t>(raw));
    return o + raw;
  }
  if (mode == 1) {
    o = msg_put_varint(o, msg_zz(lo));
    *o++ = static_cast<uint8_t>(b);
    return msg_put_bits(o, n, b, [&](int64_t j) { return static_cast<uint64_t>(msg_sub(x(j), lo)); });
  }
  if (mode == 2) {
    o = msg_put_varint(o, msg_zz(x(0)));
    o = msg_put_varint(o, msg_zz(dlo));
    *o++ = static_cast<uint8_t>(db);
    return msg_put_bits(o, n - 1, db, [&](int64_t j) {
      return static_cast<uint64_t>(msg_sub(msg_sub(x(j + 1), x(j)), dlo));
    });
  }
  for (int64_t j = 0, prev = 0; j < n; ++j) {
    const int64_t v = x(j);
    o = msg_put_varint(o, msg_zz(mode == 4 ? msg_sub(v, prev) : v));
    prev = v;
  }
  return o;
}

// One array as herald_msg_encode writes it at o: its header (one byte, dtype code << 3 | mode; its element count as
// a varint), then its payload in the mode of fewest bytes (ties: the lower mode); element code `kind` 0: raw bytes.
// Returns where it ends, or nullptr (past lim).
uint8_t* msg_encode_array(const void* a, int64_t n, int64_t kind, int64_t itemsize, int64_t code, uint8_t* o,
                          uint8_t* const lim) {
  if (o + 11 > lim) return nullptr;
  uint8_t* h = o++;
  o = msg_put_varint(o, static_cast<uint64_t>(n));
  *h = static_cast<uint8_t>(code << 3);
  const int64_t raw = n * itemsize;
  if (kind == 0 || n == 0) {
    if (o + raw > lim) return nullptr;
    if (raw) std::memcpy(o, a, static_cast<size_t>(raw));
    return o + raw;
  }
  const uint8_t* in = static_cast<const uint8_t*>(a);
  switch (kind) {
    case 1: return msg_encode_ints<int8_t>(in, n, raw, h, o, lim);
    case 2: return msg_encode_ints<uint8_t>(in, n, raw, h, o, lim);
    case 3: return msg_encode_ints<int16_t>(in, n, raw, h, o, lim);
    case 4: return msg_encode_ints<uint16_t>(in, n, raw, h, o, lim);
    case 5: return msg_encode_ints<int32_t>(in, n, raw, h, o, lim);
    case 6: return msg_encode_ints<uint32_t>(in, n, raw, h, o, lim);
    default: return msg_encode_ints<int64_t>(in, n, raw, h, o, lim);
  }
}

}  // namespace

extern "C" {

// Encodes nmsg messages back to back into `out` (capacity `cap`): message m is arrays first[m] .. first[m + 1]
// (pointers `arrays`, lengths `lens`, element codes `kinds` (0: raw bytes), item sizes, dtype codes), each as
// msg_encode_array writes it after the message's first byte (its number of arrays). `ends[m]`: the byte where message
// m ends. Returns the bytes written, or -1 (capacity).
int64_t herald_msg_encode(int64_t nmsg, const int64_t* first, const void* const* arrays, const int64_t* lens,
                          const int64_t* kinds, const int64_t* itemsizes, const int64_t* codes, uint8_t* out,
                          int64_t cap, int64_t* ends) {
  uint8_t* o = out;
  uint8_t* const lim = out + cap;
  for (int64_t m = 0; m < nmsg; ++m) {
    const int64_t a0 = first[m], na = first[m + 1] - a0;
    if (na > 255 || o + 1 > lim) return -1;
    *o++ = static_cast<uint8_t>(na);
    for (int64_t i = a0; i < a0 + na && o; ++i)
      o = msg_encode_array(arrays[i], lens[i], kinds[i], itemsizes[i], codes[i], o, lim);
    if (!o) return -1;
    ends[m] = o - out;
  }
  return o - out;
}

// herald_msg_encode for nmsg messages of the same nf fields (message_wire.encode_slices): message m is, for every
// field i (at fields[i], field_len[i] elements), its elements starts[m * nf + i] .. stops[m * nf + i]. Why: a
// planner's phase sends up to H - 1 such messages; addressed here, the caller's work is per field, not per array.
// Returns the bytes written, -1 (capacity) or -2 (a slice outside its field; nothing written that counts).
int64_t herald_msg_encode_slices(int64_t nmsg, int64_t nf, const uint64_t* fields, const int64_t* field_len,
                                 const int64_t* kinds, const int64_t* itemsizes, const int64_t* codes,
                                 const int64_t* starts, const int64_t* stops, uint8_t* out, int64_t cap,
                                 int64_t* ends) {
  if (nf > 255) return -1;
  for (int64_t k = 0; k < nmsg * nf; ++k)
    if (starts[k] < 0 || stops[k] < starts[k] || stops[k] > field_len[k % nf]) return -2;
  uint8_t* o = out;
  uint8_t* const lim = out + cap;
  for (int64_t m = 0; m < nmsg; ++m) {
    if (o + 1 > lim) return -1;
    *o++ = static_cast<uint8_t>(nf);
    for (int64_t i = 0; i < nf && o; ++i) {
      const int64_t s = starts[m * nf + i];
      const void* a = reinterpret_cast<const void*>(fields[i] + static_cast<uint64_t>(s * itemsizes[i]));
      o = msg_encode_array(a, stops[m * nf + i] - s, kinds[i], itemsizes[i], codes[i], o, lim);
    }
    if (!o) return -1;
    ends[m] = o - out;
  }
  return o - out;
}

// A varint the scan has checked: no bounds to test.
static inline uint64_t msg_varint_checked(const uint8_t*& p) {
  uint64_t u = *p & 127;
  for (int s = 7; *p++ & 128; s += 7) u |= static_cast<uint64_t>(*p & 127) << s;
  return u;
}

static bool msg_get_varint(const uint8_t*& p, const uint8_t* end, uint64_t& u) {
  u = 0;
  for (int s = 0; s < 70; s += 7) {
    if (p >= end) return false;
    const uint8_t c = *p++;
    u |= static_cast<uint64_t>(c & 127) << s;
    if (!(c & 128)) return true;
  }
  return false;
}

}  // extern "C"

namespace {

// One array's header and payload extent at p (its message's bytes end at `end`), checked: its dtype code, mode,
// element count and payload start; p moves past its payload. nullptr, or why the message is malformed.
const char* msg_scan_array(const uint8_t*& p, const uint8_t* end, const int64_t* itemsize, int64_t& code,
                           int64_t& mode, int64_t& n, const uint8_t*& payload) {
  if (p >= end) return "header past its end";
  code = *p >> 3, mode = *p & 7;
  const int64_t size = itemsize[code];
  ++p;
  uint64_t n64, x;
  if (!msg_get_varint(p, end, n64) || n64 >= (uint64_t{1} << 32)) return "bad element count";
  if (!size) return "unknown dtype";
  n = static_cast<int64_t>(n64);
  payload = p;
  if (mode == 0) {
    if (n * size > end - p) return "payload past its end";
    p += n * size;
  } else if (mode == 1 || mode == 2) {
    if (n < mode) return "too few elements for its mode";
    for (int64_t q = 0; q < mode; ++q)
      if (!msg_get_varint(p, end, x)) return "bad varint";
    if (p >= end || *p > 64) return "bad bit width";
    const int64_t b = *p++, nbytes = ((n - (mode == 2)) * b + 7) / 8;
    if (nbytes > end - p) return "payload past its end";
    p += nbytes;
  } else if (mode == 3 || mode == 4) {
    for (int64_t j = 0; j < n; ++j)
      if (!msg_get_varint(p, end, x)) return "bad varint";
  } else {
    return "unknown mode";
  }
  return nullptr;
}

int64_t msg_malformed(int64_t m, const char* why) {
  last_error = "message " + std::to_string(m) + ": " + why;
  return -1;
}

}  // namespace

extern "C" {

// Pass 1 of decoding: the arrays of nmsg messages (message m: bytes bounds[m] .. bounds[m + 1] of buf). Per array:
// its message, dtype code, mode, element count, payload start and end. itemsize[c] (32 codes): the item size of
// dtype code c (0: not one). Returns the arrays found, or -1 (malformed: herald_last_error says how; or more than
// cap arrays).
int64_t herald_msg_scan(int64_t nmsg, const uint8_t* buf, const int64_t* bounds, const int64_t* itemsize, int64_t cap,
                        int64_t* arr_msg, int64_t* arr_code, int64_t* arr_mode, int64_t* arr_count,
                        int64_t* arr_start, int64_t* arr_end) {
  int64_t k = 0;
  for (int64_t m = 0; m < nmsg; ++m) {
    const uint8_t* p = buf + bounds[m];
    const uint8_t* const end = buf + bounds[m + 1];
    if (p >= end) return msg_malformed(m, "empty");
    const int64_t na = *p++;
    if (k + na > cap) return msg_malformed(m, "too many arrays");
    for (int64_t i = 0; i < na; ++i, ++k) {
      const uint8_t* payload;
      const char* bad = msg_scan_array(p, end, itemsize, arr_code[k], arr_mode[k], arr_count[k], payload);
      if (bad) return msg_malformed(m, bad);
      arr_msg[k] = m, arr_start[k] = payload - buf, arr_end[k] = p - buf;
    }
    if (p != end) return msg_malformed(m, "bytes after its last array");
  }
  return k;
}

}  // extern "C"

namespace {

// One array of mode 1-4 (the scan checked its bounds) into o[0 .. n) as T: numpy's int64 values cast (wrapping) to
// the array's dtype, written as they are decoded. A packed value whose 8 bytes from its first lie in the payload takes
// one unaligned load (every one but the last few, for values up to 56 bits); the others are read byte by byte.
template <typename T>
static void msg_decode_ints(const uint8_t* p, const uint8_t* end, int64_t mode, int64_t n, uint8_t* o) {
  const auto put = [o](int64_t j, uint64_t v) {
    const T x = static_cast<T>(static_cast<int64_t>(v));
    std::memcpy(o + sizeof(T) * j, &x, sizeof(T));
  };
  if (mode == 3 || mode == 4) {
    uint64_t prev = 0;
    for (int64_t j = 0; j < n; ++j) {
      const uint64_t val = static_cast<uint64_t>(msg_unzz(msg_varint_checked(p)));
      prev = mode == 4 ? prev + val : val;
      put(j, prev);
    }
    return;
  }
  uint64_t base, dlo = 0;
  msg_get_varint(p, end, base);
  if (mode == 2) msg_get_varint(p, end, dlo);
  const int64_t b = *p++, nb = n - (mode == 2);
  const uint64_t first = static_cast<uint64_t>(msg_unzz(base)), d0 = static_cast<uint64_t>(msg_unzz(dlo));
  const uint64_t mask = b == 64 ? ~uint64_t{0} : (uint64_t{1} << b) - 1;
  const uint8_t* const p0 = p;  // the packed values
  int64_t fast = b > 0 && b <= 56 ? nb : 0;
  while (fast > 0 && p0 + ((fast - 1) * b >> 3) + 8 > end) --fast;
  const auto value = [&](int64_t j) {
    const int64_t bit = j * b, byte = bit >> 3, off = bit & 7;
    if (j < fast) {
      uint64_t w;
      std::memcpy(&w, p0 + byte, 8);
      return (w >> off) & mask;
    }
    unsigned __int128 w = 0;
    for (int64_t q = 0; q < (off + b + 7) / 8; ++q) w |= static_cast<unsigned __int128>(p0[byte + q]) << (8 * q);
    return static_cast<uint64_t>(w >> off) & mask;
  };
  if (mode == 1) {
    for (int64_t j = 0; j < nb; ++j) put(j, first + value(j));
    return;
  }
  uint64_t acc = first;
  put(0, acc);
  for (int64_t j = 0; j < nb; ++j) {
    acc += d0 + value(j);
    put(j + 1, acc);
  }
}

// One array the scan found (payload p .. end) into o, in its own dtype: a raw one copied, the others decoded (as
// numpy's int64 values cast to the dtype: integer dtype codes 1-8 only). False for an encoded array of another dtype.
bool msg_unpack_array(int64_t code, int64_t mode, int64_t n, const uint8_t* p, const uint8_t* end,
                      const int64_t* itemsize, uint8_t* o) {
  if (mode == 0) {
    if (n) std::memcpy(o, p, static_cast<size_t>(n * itemsize[code]));
    return true;
  }
  switch (code) {
    case 1: msg_decode_ints<int8_t>(p, end, mode, n, o); return true;
    case 2: msg_decode_ints<uint8_t>(p, end, mode, n, o); return true;
    case 3: msg_decode_ints<int16_t>(p, end, mode, n, o); return true;
    case 4: msg_decode_ints<uint16_t>(p, end, mode, n, o); return true;
    case 5: msg_decode_ints<int32_t>(p, end, mode, n, o); return true;
    case 6: msg_decode_ints<uint32_t>(p, end, mode, n, o); return true;
    case 7:
    case 8: msg_decode_ints<int64_t>(p, end, mode, n, o); return true;  // uint64: the same bits
    default: return false;
  }
}

}  // namespace

extern "C" {

// Pass 2: every array found by herald_msg_scan into arena[offset[i] ..) (msg_unpack_array). One pass and one
// allocation for a phase's messages, where a copy per array cost ~1 us of Python each. Returns 0, or -1 for an
// encoded array of a dtype that is not an integer (bool, floats: never written by the encoder; numpy decodes those).
int64_t herald_msg_unpack(int64_t k, const uint8_t* buf, const int64_t* code, const int64_t* mode,
                          const int64_t* count, const int64_t* start, const int64_t* stop, const int64_t* itemsize,
                          const int64_t* offset, uint8_t* arena) {
  for (int64_t i = 0; i < k; ++i)
    if (!msg_unpack_array(code[i], mode[i], count[i], buf + start[i], buf + stop[i], itemsize, arena + offset[i]))
      return -1;
  return 0;
}

// message_wire.decode_fields in two calls: nmsg messages of sizes[m] > 0 bytes back to back in buf (nbytes in all),
// each of nf arrays with the same dtype at each place, decoded field by field. Without an arena: the layout, checked
// as herald_msg_scan checks it: codes[i] the dtype code of field i, at[m * nf + i] its elements before message m's
// (at[nmsg * nf + i]: its total), first[i] the byte where it begins in the arena (each field 8-byte aligned, as a
// fresh array); returns the arena's size, -1 (malformed: herald_last_error) or -2 (the layouts differ, or an
// encoded array is not of an integer dtype: the caller decodes message by message). With the arena of that size,
// after a layout call on the same arguments: every array decoded into it; returns 0.
int64_t herald_msg_decode_fields(int64_t nmsg, const uint8_t* buf, int64_t nbytes, const int64_t* sizes,
                                 const int64_t* itemsize, int64_t nf, int64_t* codes, int64_t* at, int64_t* first,
                                 uint8_t* arena) {
  const uint8_t* p = buf;
  int64_t code, mode, n;
  const uint8_t* payload;
  if (!arena) {
    int64_t total = 0;
    for (int64_t m = 0; m < nmsg; ++m) {
      if (sizes[m] <= 0 || sizes[m] > nbytes - total) return msg_malformed(m, "sizes past the buffer");
      total += sizes[m];
    }
    if (total != nbytes) return msg_malformed(nmsg, "bytes after the last message");
    bool same = true;
    std::fill(at, at + nf, 0);
    for (int64_t m = 0; m < nmsg; ++m) {
      const uint8_t* const end = p + sizes[m];
      const int64_t na = *p++;
      same = same && na == nf;
      for (int64_t i = 0; i < na; ++i) {
        const char* bad = msg_scan_array(p, end, itemsize, code, mode, n, payload);
        if (bad) return msg_malformed(m, bad);
        if (!same || i >= nf) continue;
        if (m == 0) codes[i] = code;
        same = code == codes[i] && (mode == 0 || (code >= 1 && code <= 8));
        at[(m + 1) * nf + i] = at[m * nf + i] + n;
      }
      if (p != end) return msg_malformed(m, "bytes after its last array");
    }
    if (!same) return -2;
    int64_t size = 0;
    for (int64_t i = 0; i < nf; ++i) {
      first[i] = size;
      size += (at[nmsg * nf + i] * itemsize[codes[i]] + 7) & ~int64_t{7};
    }
    return size;
  }
  for (int64_t m = 0; m < nmsg; ++m) {
    const uint8_t* const end = p + sizes[m];
    ++p;
    for (int64_t i = 0; i < nf; ++i) {
      msg_scan_array(p, end, itemsize, code, mode, n, payload);
      msg_unpack_array(code, mode, n, payload, p, itemsize, arena + first[i] + at[m * nf + i] * itemsize[code]);
    }
  }
  return 0;
}

}  // extern "C"


// ---- a directory host's decision (phases 5-6) and its part of the plan (phase 8): host_planner.HostPlanner ----
namespace {

// Outbox.by_host's order of entries whose hosts (0..H-1) are `host`: grouped by host, each host's in entry order.
// Writes the hosts' bounds [H + 1] and the entries in that order; false where a host is out of range.
bool group_by_host(const std::vector<int64_t>& host, int64_t H, int64_t* bounds, std::vector<int64_t>& order) {
  std::fill(bounds, bounds + H + 1, 0);
  for (int64_t t : host) {
    if (t < 0 || t >= H) return false;
    ++bounds[t + 1];
  }
  for (int64_t t = 0; t < H; ++t) bounds[t + 1] += bounds[t];
  std::vector<int64_t> at(bounds, bounds + H);
  order.resize(host.size());
  for (size_t i = 0; i < host.size(); ++i) order[at[host[i]]++] = static_cast<int64_t>(i);
  return true;
}

// HostPlanner.decide's pairs sorted by (key, rank), as stable_order(key * R + rank) orders them: each pair's key is
// demanded[idx + first[s]] for the pairs of sender s (n_of[s] of them, after those of the senders before). Writes
// the keys g, ranks pr and elements c in that order. (code, index) pairs sorted: the index breaks ties, as a stable
// sort does.
template <typename RK>
void pairs_by_code(int64_t S, const int64_t* first, const int64_t* n_of, const int32_t* idx, const RK* r_in,
                   const int32_t* c_in, const int64_t* demanded, int64_t D, int64_t R, int64_t n, int64_t* g,
                   int64_t* pr, int64_t* c, int64_t* pd) {
  std::vector<std::pair<int64_t, int64_t>> code(n);
  for (int64_t s = 0, i = 0; s < S; ++s) {
    for (const int64_t e = i + n_of[s]; i < e; ++i) {
      const int64_t d = idx[i] + first[s];
      if (d < 0 || d >= D) throw std::runtime_error("host_decide: a pair's index is outside the demand");
      if (r_in[i] < 0 || r_in[i] >= R) throw std::runtime_error("host_decide: a reader outside the ranks");
      code[i] = {demanded[d] * R + r_in[i], i};
    }
  }
  std::sort(code.begin(), code.end());
  for (int64_t i = 0; i < n; ++i) {
    const int64_t p = code[i].second;
    int64_t s = 0;
    for (int64_t end = n_of[0]; p >= end;) end += n_of[++s];  // p's sender
    pd[i] = idx[p] + first[s];
    g[i] = demanded[pd[i]];
    pr[i] = r_in[p];
    c[i] = c_in[p];
  }
}

// pairs_by_code where the messages are as HostPlanner._reads sends them (each sender's pairs in its demand's order,
// its ranks above the earlier senders'): the demand (about half as many keys as pairs) is sorted by key instead, and
// each demanded key's pairs follow it. False (nothing written that counts) where the pairs would not come out in
// ascending (key, rank) order (a (key, rank) repeated included) or a key is negative: pairs_by_code then.
template <typename RK>
bool pairs_by_demand(int64_t n, int64_t S, const int64_t* first, const int64_t* n_of, const int32_t* idx,
                     const RK* r_in, const int32_t* c_in, const int64_t* demanded, int64_t D, int64_t R, int64_t* g,
                     int64_t* pr, int64_t* c, int64_t* pd) {
  static thread_local std::vector<int64_t> pstart, code, pos, code2, pos2;
  pstart.assign(D + 1, 0);  // the pairs of demand position d: pstart[d]:pstart[d + 1]
  for (int64_t s = 0, i = 0, last = 0; s < S; ++s) {
    for (const int64_t e = i + n_of[s]; i < e; ++i) {
      const int64_t d = idx[i] + first[s];
      if (d < 0 || d >= D) throw std::runtime_error("host_decide: a pair's index is outside the demand");
      if (r_in[i] < 0 || r_in[i] >= R) throw std::runtime_error("host_decide: a reader outside the ranks");
      if (d < last) return false;  // not in demand order
      last = d;
      ++pstart[d + 1];
    }
  }
  for (int64_t d = 0; d < D; ++d) pstart[d + 1] += pstart[d];
  // the demand positions by key, ties in position order (an LSD radix sort is stable): ~20 us for 6,000 keys, where
  // merging the senders' sorted runs cost ~50 (its every step waits on the last, or on a branch the data decides)
  code.resize(D), pos.resize(D), code2.resize(D), pos2.resize(D);
  int64_t lo = 0, hi = 0;
  for (int64_t d = 0; d < D; ++d) lo = std::min(lo, demanded[d]), hi = std::max(hi, demanded[d]);
  if (lo < 0) return false;
  const int bits = hi ? 64 - __builtin_clzll(static_cast<uint64_t>(hi)) : 0;
  const int passes = (bits + 10) / 11, width = passes ? (bits + passes - 1) / passes : 0;
  const int64_t mask = (int64_t{1} << width) - 1;
  std::copy(demanded, demanded + D, code.begin());
  std::iota(pos.begin(), pos.end(), int64_t{0});
  std::vector<int64_t> at(size_t{1} << width);
  for (int p = 0; p < passes; ++p) {
    std::fill(at.begin(), at.end(), 0);
    for (int64_t d = 0; d < D; ++d) ++at[(code[d] >> (p * width)) & mask];
    for (int64_t x = 0, sum = 0; x <= mask; ++x) std::swap(at[x], sum), sum += at[x];
    for (int64_t d = 0; d < D; ++d) {
      const int64_t q = at[(code[d] >> (p * width)) & mask]++;
      code2[q] = code[d], pos2[q] = pos[d];
    }
    code.swap(code2);
    pos.swap(pos2);
  }
  // each demand position's first place in the output (code2: scratch), then every pair to its place: branch-free, as
  // the keys' reader counts vary; then the check that (key, rank) ascends
  for (int64_t q = 0, o = 0; q < D; ++q) {
    const int64_t d = pos[q];
    code2[d] = o;
    o += pstart[d + 1] - pstart[d];
  }
  for (int64_t s = 0, i = 0; s < S; ++s) {
    for (const int64_t e = i + n_of[s]; i < e; ++i) {
      const int64_t d = idx[i] + first[s], o = code2[d] + i - pstart[d];
      g[o] = demanded[d], pr[o] = r_in[i], c[o] = c_in[i], pd[o] = d;
    }
  }
  bool ascending = true;
  for (int64_t o = 1; o < n; ++o) ascending &= g[o] * R + pr[o] > g[o - 1] * R + pr[o - 1];
  return ascending;
}

// herald_host_decide, for ranks of type RK on the wire.
template <typename RK>
void host_decide(int64_t S, const int64_t* first, const int64_t* n_of, const int32_t* idx, const RK* r_in,
                 const int32_t* c_in, const int64_t* demanded, int64_t D, const int32_t* dem_owner, int64_t R,
                 int64_t P, int64_t H, int64_t h, int is_static, int balance, double factor, const int64_t* offsets,
                 const int64_t* block, int64_t T, int64_t* keys, int64_t* own, int64_t* want, uint8_t* single,
                 int64_t* sole, int64_t* kid, int64_t* pr, int64_t* a_key, RK* a_own, RK* a_want, int8_t* a_single,
                 int64_t* p_key, int64_t* a_count, int64_t* p_count, int64_t* dests, int64_t* starts, int64_t* stops,
                 int64_t* sizes) {
  int64_t n = 0;
  for (int64_t s = 0; s < S; ++s) n += n_of[s];
  // scratch kept between calls (a fresh 0.2 MB each step cost its page faults, ~20% of the pass)
  static thread_local std::vector<int64_t> g, c, count, start, pd;
  g.resize(n), c.resize(n), count.resize(n), start.resize(n), pd.resize(n);
  if (!pairs_by_demand(n, S, first, n_of, idx, r_in, c_in, demanded, D, R, g.data(), pr, c.data(), pd.data()))
    pairs_by_code(S, first, n_of, idx, r_in, c_in, demanded, D, R, n, g.data(), pr, c.data(), pd.data());
  // phase 5: decide_pairs on the sorted pairs, then owner balancing (HeraldHierPolicy.decide_keys). A key's owner
  // from the owners' phase (`dem_owner`, aligned with the demand: no move lands in between), not the array over
  // every row: on full tables its second random read per key
  const int64_t K = decide_pairs(n, g.data(), pr, c.data(), dem_owner, pd.data(), keys, own, want, single, sole,
                                 count.data(), start.data(), kid);
  int64_t balanced = 0;
  if (balance) {
    std::vector<uint8_t> heavy(R);
    for (int64_t r = 0; r < R; ++r) heavy[r] = r % H == h;
    balanced = herald_balance_owners(K, R, want, own, count.data(), start.data(), pr, nullptr, factor, heavy.data());
  }
  if (is_static) std::copy(own, own + K, want);  // every row stays with its owner
  // phase 6: the moves (want != own) to the destination's host; the pins (guests, own != home, that no rank of the
  // owner's host reads) to the owner's host. No division per key (3 of them cost ~40% of the pass): a rank's host
  // from a table, the keys' homes from a KeyWalk along them
  static thread_local std::vector<int64_t> host_of;
  host_of.resize(R);
  for (int64_t r = 0; r < R; ++r) host_of[r] = r / P;
  // branch-free where the data decides (a mispredicted branch per key cost more than the divisions)
  std::vector<int64_t> mv(K), mv_host(K), pin(K), pin_host(K);
  int64_t n_mv = 0, n_pin = 0;
  KeyWalk walk(offsets, block, T);
  for (int64_t k = 0; k < K; ++k) {
    const int64_t key = keys[k], o = own[k], w = want[k];
    if (o < 0 || o >= R || w < 0 || w >= R) throw std::runtime_error("host_decide: a rank outside the hosts");
    if (!walk.in_layout(key)) throw std::runtime_error("host_decide: a key outside the tables");
    walk.to(key);
    const int64_t home = walk.home;
    const int64_t oh = host_of[o], lo = oh * P;  // the owner's host and its first rank
    bool host_reads = false;  // pr // P == own // P for a pair of the key
    for (int64_t p = start[k]; p < start[k] + count[k]; ++p)
      host_reads |= static_cast<uint64_t>(pr[p] - lo) < static_cast<uint64_t>(P);
    pin[n_pin] = k, pin_host[n_pin] = oh;
    n_pin += !host_reads & (o != home);
    mv[n_mv] = k, mv_host[n_mv] = host_of[w];
    n_mv += w != o;
  }
  mv.resize(n_mv), mv_host.resize(n_mv), pin.resize(n_pin), pin_host.resize(n_pin);
  std::vector<int64_t> ab(H + 1), pb(H + 1), order;
  if (!group_by_host(mv_host, H, ab.data(), order)) throw std::runtime_error("host_decide: a rank outside the hosts");
  for (size_t q = 0; q < order.size(); ++q) {
    const int64_t k = mv[order[q]];
    a_key[q] = keys[k];
    a_own[q] = static_cast<RK>(own[k]);
    a_want[q] = static_cast<RK>(want[k]);
    a_single[q] = static_cast<int8_t>(single[k]);
  }
  if (!group_by_host(pin_host, H, pb.data(), order)) throw std::runtime_error("host_decide: a rank outside the hosts");
  for (size_t q = 0; q < order.size(); ++q) p_key[q] = keys[pin[order[q]]];
  // Outbox.joined of the two: every host either sends to, its slices of the 4 arrival fields and of the pins (0:0
  // for the part that sends it nothing)
  int64_t nd = 0;
  for (int64_t t = 0; t < H; ++t) {
    a_count[t] = ab[t + 1] - ab[t];
    p_count[t] = pb[t + 1] - pb[t];
    if (!a_count[t] && !p_count[t]) continue;
    dests[nd] = t;
    for (int64_t f = 0; f < 5; ++f) {
      const int64_t* b = f < 4 ? ab.data() : pb.data();
      const bool sent = (f < 4 ? a_count[t] : p_count[t]) > 0;
      starts[nd * 5 + f] = sent ? b[t] : 0;
      stops[nd * 5 + f] = sent ? b[t + 1] : 0;
    }
    ++nd;
  }
  sizes[0] = K, sizes[1] = static_cast<int64_t>(mv.size()), sizes[2] = static_cast<int64_t>(pin.size());
  sizes[3] = nd, sizes[4] = balanced;
}

// herald_host_part, for ranks of type RK on the wire; its outputs at their places in out64 / outrk.
template <typename RK>
void host_part(int64_t K, int64_t n, const int64_t* keys, const int64_t* own, int64_t* want, const uint8_t* single,
               const int64_t* sole, const int64_t* pk, const int64_t* pr, int64_t n_cancel, const int64_t* cancelled,
               int64_t n_vic, const int64_t* victims, const int32_t* owner, int64_t n_local, const int64_t* local_rank,
               int64_t rank0, int64_t* out64, RK* outrk) {
  int64_t *mig = out64, *mig_key = mig + K, *shared = mig_key + K, *sh_key = shared + K, *row = sh_key + K;
  int64_t *readers = row + n, *sizes = readers + n;
  RK *mig_src = outrk, *mig_dst = mig_src + K, *sh_owner = mig_dst + K, *sh_count = sh_owner + K;
  RK *readers_rk = sh_count + K, *victim_src = readers_rk + n, *local_out = victim_src + n_vic;
  for (int64_t j = 0; j < n_cancel; ++j) {  // want[searchsorted(keys, cancelled)] = own[...]
    const int64_t at = std::lower_bound(keys, keys + K, cancelled[j]) - keys;
    if (at == K) throw std::runtime_error("host_part: a cancelled key after every key");
    want[at] = own[at];
  }
  // one pass along the pairs, a run of them per key: pk = 0..K-1 as the decision gives it (a key's pairs in one run,
  // every key read), so each run's length is bincount(pk) and the keys' and the pairs' outputs come in order
  int64_t n_mig = 0, n_sh = 0, hit = 0, remote = 0, n_pairs = 0, k = 0;
  for (int64_t p = 0, q; p < n; p = q, ++k) {
    if (pk[p] != k || k >= K) throw std::runtime_error("host_part: the pairs' keys are not the decision's");
    for (q = p + 1; q < n && pk[q] == k;) ++q;
    const int64_t w = want[k], o = own[k];
    if (w != o) {
      mig[n_mig] = k, mig_key[n_mig] = keys[k];
      mig_src[n_mig] = static_cast<RK>(o), mig_dst[n_mig] = static_cast<RK>(w);
      ++n_mig;
    }
    for (int64_t i = p; i < q; ++i) hit += w == pr[i] && w == o, remote += w != pr[i];  // hits: the row stays
    if (single[k] && sole[k] == w) continue;  // exclusive; else a shared row with its pairs
    shared[n_sh] = k, sh_key[n_sh] = keys[k];
    sh_owner[n_sh] = static_cast<RK>(w), sh_count[n_sh] = static_cast<RK>(q - p);
    for (int64_t i = p; i < q; ++i, ++n_pairs) {
      row[n_pairs] = n_sh, readers[n_pairs] = pr[i], readers_rk[n_pairs] = static_cast<RK>(pr[i]);
    }
    ++n_sh;
  }
  if (k != K) throw std::runtime_error("host_part: the pairs' keys are not the decision's");
  for (int64_t v = 0; v < n_vic; ++v) victim_src[v] = static_cast<RK>(owner[victims[v]]);
  for (int64_t i = 0; i < n_local; ++i) local_out[i] = static_cast<RK>(local_rank[i] + rank0);
  sizes[0] = n_mig, sizes[1] = n_sh, sizes[2] = n_pairs, sizes[3] = hit, sizes[4] = remote;
}

// herald_host_decide's outputs at their places in out64 / out8 / outrk.
template <typename RK>
void host_decide_at(int64_t n, int64_t S, const int64_t* first, const int64_t* n_of, const int32_t* idx,
                    const void* r_in, const int32_t* c_in, const int64_t* demanded, int64_t D,
                    const int32_t* dem_owner, int64_t R, int64_t P, int64_t H, int64_t h, int is_static, int balance,
                    double factor, const int64_t* offsets, const int64_t* block, int64_t T, int64_t* out64,
                    uint8_t* out8, void* outrk) {
  int64_t total = 0;
  for (int64_t s = 0; s < S; ++s) total += n_of[s];
  if (total != n) throw std::runtime_error("host_decide: the senders' counts do not add up to the pairs");
  int64_t* o = out64;
  int64_t *keys = o, *own = o + n, *want = o + 2 * n, *sole = o + 3 * n, *kid = o + 4 * n, *pr = o + 5 * n;
  int64_t *a_key = o + 6 * n, *p_key = o + 7 * n, *a_count = o + 8 * n, *p_count = a_count + H, *dests = p_count + H;
  int64_t *starts = dests + H, *stops = starts + 5 * H, *sizes = stops + 5 * H;
  RK* rk = static_cast<RK*>(outrk);
  host_decide<RK>(S, first, n_of, idx, static_cast<const RK*>(r_in), c_in, demanded, D, dem_owner, R, P, H, h,
                  is_static, balance, factor, offsets, block, T, keys, own, want, out8, sole, kid, pr, a_key, rk,
                  rk + n, reinterpret_cast<int8_t*>(out8 + n), p_key, a_count, p_count, dests, starts, stops, sizes);
}

}  // namespace

extern "C" {

// HostPlanner.decide, as a directory host: phase 5, herald's decision for its keys on the union of their reads, and
// phase 6's messages. The reads: n_of[s] (index in sender s's demand, which begins at first[s] in `demanded`,
// reader rank, elements) triples from each of S senders, concatenated (n in all); they are sorted by (key, rank) as
// stable_order(key * R + rank) does, decided as decide_pairs (each key's owner: dem_owner [D], the owner of every
// demanded key, aligned with `demanded`), balanced as herald_balance_owners (balance != 0:
// heavy rows to ranks = h mod H) and, at the STATIC level, every want set to its owner. Writes the keys' arrays
// (HeraldHierPolicy.decide_keys's: keys, own, want, single, sole, each pair's key index and rank), the arrivals (key,
// owner, destination, single) and pins (key) by destination host as Outbox.by_host orders them, each host's count of
// either, and the Outbox.joined slices [nd x 5] of the nd hosts sent to. In three buffers, as native.host_decide
// slices them: out64 (int64 [8 n + 13 H + 5]): keys, own, want, sole, the pairs' key index and rank, the arrivals'
// and the pins' keys (n each), the arrivals and pins to each host and the hosts sent to (H each), the slices' starts
// and stops ([H x 5] each), sizes (keys, arrivals, pins, hosts sent to, rows balanced); out8 (uint8 [2 n]): single,
// the arrivals' single (int8); outrk (ranks, rank_bytes 2 or 4 as r_in [2 n]): the arrivals' owner and destination.
// Returns 0, or 1 with herald_last_error.
int herald_host_decide(int64_t rank_bytes, int64_t n, int64_t S, const int64_t* first, const int64_t* n_of, const int32_t* idx,
                       const void* r_in, const int32_t* c_in, const int64_t* demanded, int64_t D,
                       const int32_t* dem_owner, int64_t R, int64_t P, int64_t H, int64_t h, int64_t is_static,
                       int64_t balance, double factor, const int64_t* offsets, const int64_t* block, int64_t T,
                       int64_t* out64, uint8_t* out8, void* outrk) {
  try {
    if (rank_bytes != 2 && rank_bytes != 4) throw std::runtime_error("host_decide: ranks must be 2 or 4 bytes");
    (rank_bytes == 2 ? host_decide_at<int16_t> : host_decide_at<int32_t>)(
        n, S, first, n_of, idx, r_in, c_in, demanded, D, dem_owner, R, P, H, h, static_cast<int>(is_static),
        static_cast<int>(balance), factor, offsets, block, T, out64, out8, outrk);
    return 0;
  } catch (const std::exception& e) {
    last_error = e.what();
    return 1;
  }
}

// HostPlanner.part, as a directory host: the cancelled arrivals undone (want = own at searchsorted(keys,
// cancelled)), then the migrations (want != own: index, key, source, destination), the shared rows (not exclusive:
// single with sole == want; index, key, owner, reader count), every shared pair's row among them and its reader
// (int64 and RK), the (hit, remote) pair counts, the victims' owners and h's samples' ranks (local + rank0), as
// numpy's `part` computes them; the pairs are the decision's (pk, pr: sorted by key then rank). In two buffers, as
// native.host_part slices them: out64 (int64 [4 K + 2 n + 5]): the migrations' indices and keys, the shared rows'
// indices and keys (K each), the shared pairs' rows and readers (n each), sizes (migrations, shared rows, shared
// pairs, hit, remote); outrk (ranks, rank_bytes 2 or 4 [4 K + n + V + L]): the migrations' sources and destinations,
// the shared rows' owners and reader counts (K each), the shared pairs' readers (n), the victims' owners (V), the
// samples' ranks (L). Returns 0, or 1 with herald_last_error.
int herald_host_part(int64_t rank_bytes, int64_t K, int64_t n, const int64_t* keys, const int64_t* own, int64_t* want,
                     const uint8_t* single, const int64_t* sole, const int64_t* pk, const int64_t* pr,
                     int64_t n_cancel, const int64_t* cancelled, int64_t n_vic, const int64_t* victims,
                     const int32_t* owner, int64_t n_local, const int64_t* local_rank, int64_t rank0, int64_t* out64,
                     void* outrk) {
  try {
    if (rank_bytes == 2) {
      host_part<int16_t>(K, n, keys, own, want, single, sole, pk, pr, n_cancel, cancelled, n_vic, victims, owner,
                         n_local, local_rank, rank0, out64, static_cast<int16_t*>(outrk));
    } else if (rank_bytes == 4) {
      host_part<int32_t>(K, n, keys, own, want, single, sole, pk, pr, n_cancel, cancelled, n_vic, victims, owner,
                         n_local, local_rank, rank0, out64, static_cast<int32_t*>(outrk));
    } else {
      throw std::runtime_error("host_part: ranks must be 2 or 4 bytes");
    }
    return 0;
  } catch (const std::exception& e) {
    last_error = e.what();
    return 1;
  }
}

}  // extern "C"

namespace {

// ---- a herald_hier host's plan from the parts routed to it (host_plans.host_plan / part_rows) -----------------

// The end of the keys k[lo, hi) (ascending) that come before v: below it, or (Upper) not above it. Exponential
// steps from lo, then a binary search: O(log) of the stretch, as timsort's galloping.
template <bool Upper>
int64_t gallop(const int64_t* k, int64_t lo, int64_t hi, int64_t v) {
  auto before = [v](int64_t x) { return Upper ? x <= v : x < v; };
  if (lo >= hi || !before(k[lo])) return lo;
  int64_t prev = lo, step = 1, cur = lo + 1;
  while (cur < hi && before(k[cur])) prev = cur, step <<= 1, cur = prev + step;
  cur = std::min(cur, hi);
  return (Upper ? std::upper_bound(k + prev + 1, k + cur, v) : std::lower_bound(k + prev + 1, k + cur, v)) - k;
}

// np.argsort(key, kind="stable") of n int64 keys into `order`: the key's ascending runs merged bottom-up, adjacent
// runs at a time, the left run's keys first among equals (hence stable, for any keys), each stretch that comes from
// one run copied whole (`gallop`). The concatenation of a few hosts' sorted parts is a few runs of long stretches
// (a directory host's keys are blocks of rows), where numpy's timsort does the same.
void merge_runs_order(int64_t n, const int64_t* key, int64_t* order) {
  std::vector<int64_t> bounds{0}, next;
  for (int64_t i = 1; i < n; ++i)
    if (key[i] < key[i - 1]) bounds.push_back(i);
  bounds.push_back(n);
  std::iota(order, order + n, int64_t{0});
  if (bounds.size() <= 2) return;
  std::unique_ptr<int64_t[]> kb(new int64_t[n]), oa(new int64_t[n]), ob(new int64_t[n]), ka(new int64_t[n]);
  std::copy(key, key + n, ka.get());
  std::copy(order, order + n, oa.get());
  while (bounds.size() > 2) {
    next.assign(1, 0);
    const int64_t *k = ka.get(), *o = oa.get();
    int64_t *k2 = kb.get(), *o2 = ob.get();
    size_t r = 0;
    for (; r + 2 < bounds.size(); r += 2) {
      int64_t i = bounds[r], j = bounds[r + 1], p = i;
      const int64_t b = bounds[r + 1], c = bounds[r + 2];
      while (i < b && j < c) {
        const bool right = k[j] < k[i];
        const int64_t s = right ? j : i, e = right ? gallop<false>(k, j, c, k[i]) : gallop<true>(k, i, b, k[j]);
        std::copy(k + s, k + e, k2 + p);
        std::copy(o + s, o + e, o2 + p);
        p += e - s;
        (right ? j : i) = e;
      }
      std::copy(k + i, k + b, k2 + p), std::copy(o + i, o + b, o2 + p), p += b - i;
      std::copy(k + j, k + c, k2 + p), std::copy(o + j, o + c, o2 + p);
      next.push_back(c);
    }
    if (r + 1 < bounds.size()) {  // an odd run out: as it is
      std::copy(k + bounds[r], k + bounds[r + 1], k2 + bounds[r]);
      std::copy(o + bounds[r], o + bounds[r + 1], o2 + bounds[r]);
      next.push_back(bounds[r + 1]);
    }
    ka.swap(kb);
    oa.swap(ob);
    bounds.swap(next);
  }
  std::copy(oa.get(), oa.get() + n, order);
}

inline int64_t floor_div(int64_t a, int64_t b) { return a / b - ((a % b != 0) && ((a < 0) != (b < 0))); }

struct HostPlanIn {
  int64_t n_mig, n_sh, n_rd, n_vic, T, h, P, n_own, K, n_smp, n_sum, n_flags;
  const int64_t *mig_key, *sh_key, *victims, *offsets, *block, *own_idx, *keys, *want, *k_own, *members, *summary;
  const void *mig_src, *mig_dst, *sh_owner, *sh_count, *sh_readers, *victim_src, *ranks;
  const uint8_t* flags;
  int8_t migrate_kind, evict_kind;
  uint8_t moved_bit, shared_bit, relayed_bit;
};

struct HostPlanOut {
  int64_t *m_table, *m_row, *m_src, *m_dst, *r_gid, *r_dst, *r_src, *r_home, *r_table;
  int8_t* m_kind;
  int64_t *s_table, *s_row, *s_owner, *s_offsets, *s_readers, *order, *slice_ranks, *tables, *counts;
};

template <typename RK>
int host_plan(const HostPlanIn& in, const HostPlanOut& out) {
  const int64_t T = in.T, P = in.P, h = in.h;
  const RK *mig_src = static_cast<const RK*>(in.mig_src), *mig_dst = static_cast<const RK*>(in.mig_dst);
  const RK *sh_owner = static_cast<const RK*>(in.sh_owner), *sh_count = static_cast<const RK*>(in.sh_count);
  const RK *sh_readers = static_cast<const RK*>(in.sh_readers), *victim_src = static_cast<const RK*>(in.victim_src);
  const RK* ranks = static_cast<const RK*>(in.ranks);
  for (int64_t t = 0; t < T; ++t)
    if (in.block[t] <= 0) return last_error = "host_plan: a table's home block is not positive", 1;
  // the moves: migrations, then victims (sent home from their owner), in one stable order by key; a key's table and
  // home rank by a walk along them (sorted_tables, home_of)
  const int64_t n = in.n_mig + in.n_vic;
  std::vector<int64_t> key(n), o(n);
  std::copy(in.mig_key, in.mig_key + in.n_mig, key.begin());
  std::copy(in.victims, in.victims + in.n_vic, key.begin() + in.n_mig);
  merge_runs_order(n, key.data(), o.data());
  int64_t kept = 0;
  KeyWalk walk(in.offsets, in.block, T);
  for (int64_t i = 0; i < n; ++i) {
    const int64_t j = o[i], g = key[j];
    if (!walk.in_layout(g)) return last_error = "host_plan: a move's key is outside the layout", 1;
    walk.to(g);
    const int64_t t = walk.t, home = walk.home, row = g - in.offsets[t];
    const bool victim = j >= in.n_mig;
    const int64_t src = victim ? victim_src[j - in.n_mig] : mig_src[j], dst = victim ? home : mig_dst[j];
    out.r_gid[i] = g, out.r_dst[i] = dst, out.r_src[i] = src, out.r_home[i] = home, out.r_table[i] = t;
    // the plan's moves: every one (h < 0), else a host's (less the victims that came for their directory entry)
    if (h < 0 || !victim || floor_div(src, P) == h || floor_div(dst, P) == h) {
      out.m_table[kept] = t, out.m_row[kept] = row, out.m_src[kept] = src, out.m_dst[kept] = dst;
      out.m_kind[kept++] = victim ? in.evict_kind : in.migrate_kind;
    }
  }
  // the replica's moves: then the host's own migrations no part brought (~in_sorted: a forward scan where they come
  // in key order, a binary search where not), with their table and home rank (table_of, home_of)
  KeyWalk own_walk(in.offsets, in.block, T);
  int64_t m = n;
  for (int64_t q = 0, p = 0, last = 0; q < in.n_own; ++q) {
    const int64_t k = in.own_idx[q];
    if (k < 0 || k >= in.K) return last_error = "host_plan: a migration's index is outside the host's keys", 1;
    const int64_t g = in.keys[k];
    if (!own_walk.in_layout(g)) return last_error = "host_plan: a migration's key is outside the layout", 1;
    p = q == 0 || g < last ? std::lower_bound(out.r_gid, out.r_gid + n, g) - out.r_gid
                           : gallop<false>(out.r_gid, p, n, g);
    last = g;
    if (p < n && out.r_gid[p] == g) continue;
    own_walk.to(g);
    out.r_gid[m] = g, out.r_dst[m] = in.want[k], out.r_src[m] = in.k_own[k];
    out.r_home[m] = own_walk.home, out.r_table[m++] = own_walk.t;
  }
  // shared rows: in one stable order by key, each with its readers (the parts' CSR gathered into key order)
  std::vector<int64_t> so(in.n_sh), start(in.n_sh);
  int64_t total = 0;
  for (int64_t i = 0; i < in.n_sh; ++i) {
    if (sh_count[i] < 0) return last_error = "host_plan: a negative reader count", 1;
    start[i] = total;
    total += sh_count[i];
  }
  if (total > in.n_rd) return last_error = "host_plan: the reader counts exceed the readers", 1;
  merge_runs_order(in.n_sh, in.sh_key, so.data());
  out.s_offsets[0] = 0;
  KeyWalk shared_walk(in.offsets, in.block, T);
  for (int64_t i = 0, r = 0; i < in.n_sh; ++i) {
    const int64_t j = so[i], g = in.sh_key[j];
    if (!shared_walk.in_layout(g)) return last_error = "host_plan: a shared row's key is outside the layout", 1;
    const int64_t t = shared_walk.table(g);
    out.s_table[i] = t, out.s_row[i] = g - in.offsets[t], out.s_owner[i] = sh_owner[j];
    for (int64_t q = start[j]; q < start[j] + sh_count[j]; ++q) out.s_readers[r++] = sh_readers[q];
    out.s_offsets[i + 1] = r;
  }
  // the host's samples: rank-major by their local rank, stable (order_from_assignment), and every slice sample's
  // rank in sample order (ranks[argsort(members, kind="stable")])
  std::vector<int64_t> at(P + 1, 0), mo(in.n_smp);
  for (int64_t i = 0; i < in.n_smp; ++i) {
    const int64_t local = ranks[i] - h * P;
    if (local < 0 || local >= P) return last_error = "host_plan: a sample's rank is not the host's", 1;
    ++at[local + 1];
  }
  for (int64_t q = 0; q < P; ++q) at[q + 1] += at[q];
  for (int64_t i = 0; i < in.n_smp; ++i) out.order[at[ranks[i] - h * P]++] = in.members[i];
  merge_runs_order(in.n_smp, in.members, mo.data());
  for (int64_t i = 0; i < in.n_smp; ++i) out.slice_ranks[i] = ranks[mo[i]];
  // the step summary: the hosts' counts summed, their table bits or-ed, the tables with each bit
  if (in.n_sum % 4 || in.n_flags % T) return last_error = "host_plan: a summary of the wrong length", 1;
  int64_t* c = out.counts;
  std::fill(c, c + 10, int64_t{0});
  c[0] = kept, c[1] = m, c[2] = total;
  for (int64_t i = 0; i < in.n_sum; ++i) c[6 + i % 4] += in.summary[i];
  std::vector<uint8_t> bits(T, 0);
  for (int64_t i = 0; i < in.n_flags; ++i) bits[i % T] |= in.flags[i];
  const uint8_t bit[3] = {in.moved_bit, in.shared_bit, in.relayed_bit};
  for (int b = 0; b < 3; ++b)
    for (int64_t t = 0; t < T; ++t)
      if (bits[t] & bit[b]) out.tables[b * T + c[3 + b]++] = t;
  return 0;
}

}  // namespace

extern "C" {

// host_plans.host_plan's arrays from the parts routed to host h (each field concatenated over the source
// hosts; rank fields of rank_size 2 or 4 bytes), in one pass each: the plan's moves in key order (every move where
// h < 0: part_rows of the whole plan), the replica's moves (HostMoves: every move, then h's own migrations no part
// brought), the shared rows in key order with their readers, h's sample order and slice ranks, and the step
// summary. counts: [plan moves, replica moves, readers, moved / shared / relayed tables (at tables[0 / T / 2T]),
// hit, remote, migrations, victims]. The same values as the numpy code (host_plans.py), which runs where this
// returns 1 (inputs it does not take: a key outside the layout, a sample of another host, ...).
int herald_host_plan(int64_t rank_size, int64_t n_mig, const int64_t* mig_key, const void* mig_src,
                     const void* mig_dst, int64_t n_sh, const int64_t* sh_key, const void* sh_owner,
                     const void* sh_count, int64_t n_rd, const void* sh_readers, int64_t n_vic, const int64_t* victims,
                     const void* victim_src, int64_t T, const int64_t* offsets, const int64_t* block, int64_t h,
                     int64_t P, int64_t n_own, const int64_t* own_idx, int64_t K, const int64_t* keys,
                     const int64_t* want, const int64_t* k_own, int64_t n_smp, const int64_t* members,
                     const void* ranks, int64_t n_sum, const int64_t* summary, int64_t n_flags, const uint8_t* flags,
                     int8_t migrate_kind, int8_t evict_kind, int64_t table_bits, int64_t* m_table, int64_t* m_row,
                     int64_t* m_src, int64_t* m_dst, int8_t* m_kind, int64_t* r_gid, int64_t* r_dst, int64_t* r_src,
                     int64_t* r_home, int64_t* r_table, int64_t* s_table, int64_t* s_row, int64_t* s_owner,
                     int64_t* s_offsets, int64_t* s_readers, int64_t* order, int64_t* slice_ranks, int64_t* tables,
                     int64_t* counts) {
  const HostPlanIn in{n_mig, n_sh, n_rd, n_vic, T, h, P, n_own, K, n_smp, n_sum, n_flags,
                      mig_key, sh_key, victims, offsets, block, own_idx, keys, want, k_own, members, summary,
                      mig_src, mig_dst, sh_owner, sh_count, sh_readers, victim_src, ranks, flags,
                      migrate_kind, evict_kind, static_cast<uint8_t>(table_bits & 0xff),
                      static_cast<uint8_t>((table_bits >> 8) & 0xff), static_cast<uint8_t>((table_bits >> 16) & 0xff)};
  const HostPlanOut out{m_table, m_row, m_src, m_dst, r_gid, r_dst, r_src, r_home, r_table, m_kind,
                        s_table, s_row, s_owner, s_offsets, s_readers, order, slice_ranks, tables, counts};
  if (T < 1 || P < 1) return last_error = "host_plan: no table or no rank", 1;
  if (rank_size == 2) return host_plan<int16_t>(in, out);
  if (rank_size == 4) return host_plan<int32_t>(in, out);
  return last_error = "host_plan: ranks must be int16 or int32", 1;
}

}  // extern "C"

extern "C" {

// HostPlanner.make_room (phase 7) on host t: the moves into its ranks as received, each sender's in key order
// (keys_in, own_in, want_in, single_in [K]; merge_runs_order sorts them), their tables and homes (KeyWalk), the
// capacity rounds (host_room_rounds), then the cancelled keys grouped by directory host, each host's in key order, as
// the cancels message sends them. `window` [L]: the sorted keys of the lookahead batches 1..L. Writes the victims
// (sorted, at most max_victims) and their count, the cancelled keys and the count per host [H].
int herald_host_room(int64_t K, const int64_t* keys_in, const int64_t* own_in, const int64_t* want_in,
                     const uint8_t* single_in, int64_t t, int64_t P, int64_t H, int64_t T, const int64_t* offsets,
                     const int64_t* block, int64_t L, const int64_t* const* window, const int64_t* window_len,
                     const int32_t* owner, const int32_t* last, int64_t step, int64_t L1, int64_t G,
                     const int64_t* cap, const int64_t* base, const int64_t* alloc, int64_t* fill, int64_t* slot,
                     int32_t* pos_of, int64_t pool_size, int64_t* tau, const int64_t* row, int64_t* pool_keys,
                     int64_t* pool_count, const int32_t* group_of_slot, int64_t* rebuilds, int64_t* victims,
                     int64_t max_victims, int64_t* n_victims, int64_t* cancelled, int64_t* per_host) {
  try {
    Slots sl{G, cap, base, alloc, fill, slot, pos_of};
    Pool pool{pool_size, tau, row, pool_keys, pool_count, group_of_slot, rebuilds};
    std::vector<int64_t> o(K), keys(K), own(K), want(K), home(K), tk(K), dir(K), chosen;
    std::vector<uint8_t> single(K);
    merge_runs_order(K, keys_in, o.data());
    KeyWalk walk(offsets, block, T, P, H);
    for (int64_t i = 0; i < K; ++i) {
      const int64_t j = o[i];
      keys[i] = keys_in[j], own[i] = own_in[j], want[i] = want_in[j], single[i] = single_in[j];
      if (keys[i] < 0 || keys[i] >= offsets[T] || (i && keys[i] <= keys[i - 1]))
        throw std::runtime_error("host_room: keys outside the layout or repeated");
      walk.to(keys[i]);
      home[i] = walk.home, tk[i] = walk.t, dir[i] = walk.dir;
    }
    HostRoomRules rules{HostPrio{L, window, window_len, last, &chosen, step, L1}, own.data(), offsets, P, T, t,
                        &chosen};
    room_rounds(K, keys.data(), own.data(), home.data(), want.data(), single.data(), tk.data(), T, t * P * T, P * T,
                sl, pool, owner, last, rules, "herald_hier");
    if (static_cast<int64_t>(chosen.size()) > max_victims) throw std::runtime_error("herald_hier: too many victims");
    std::copy(chosen.begin(), chosen.end(), victims);
    *n_victims = static_cast<int64_t>(chosen.size());
    // the cancelled arrivals (want back to the owner) by directory host, each host's in key order
    std::fill(per_host, per_host + H, int64_t{0});
    for (int64_t i = 0; i < K; ++i) per_host[dir[i]] += want[i] != want_in[o[i]];
    std::vector<int64_t> at(H, 0);
    for (int64_t h = 1; h < H; ++h) at[h] = at[h - 1] + per_host[h - 1];
    for (int64_t i = 0; i < K; ++i)
      if (want[i] != want_in[o[i]]) cancelled[at[dir[i]]++] = keys[i];
    return 0;
  } catch (const std::exception& e) {
    last_error = e.what();
    return 1;
  }
}

}  // extern "C"
