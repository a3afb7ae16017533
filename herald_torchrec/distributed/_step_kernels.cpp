// Compiled kernels of the data plane's step preparation (plan_exec.py, lookup_layout.py): the same results as the
// numpy code, in one pass. Loaded by distributed/step_kernels.py (herald_torchrec/_native.py builds it). Integer
// work only. A kernel that meets something the numpy code would reject returns non-zero and does nothing visible:
// the caller then runs the numpy code, which raises with its own message.
#include <algorithm>
#include <cstdint>
#include <vector>

namespace {
constexpr int64_t NOT_SHARED = -1, NOT_READ_HERE = -2;  // plan_exec.SharedMarks
}

extern "C" {

int herald_step_version() { return 1; }

// plan_exec.classify: per table, the distinct keys read here (`reads`) and those among them that this rank owns
// after the moves and that did not move (`hits`). `seen` is uint8 scratch over all keys, all zero (left so).
// Moves: `moved` sorted global keys with their destinations. Returns 0, or 1 (a shared key this rank is not a
// reader of) / 2 (a key owned elsewhere after the moves and not shared): the caller's numpy code raises.
int herald_step_classify(int64_t n, const int64_t* gk, const int64_t* by_key, const int32_t* owner_all, int64_t M,
                         const int64_t* moved, const int64_t* moved_dst, int64_t T, const int64_t* key_base,
                         int64_t rank, uint8_t* seen, int64_t* hits, int64_t* reads) {
  std::vector<int64_t> u;
  u.reserve(static_cast<size_t>(n));
  int rc = 0;
  for (int64_t i = 0; i < n && rc == 0; ++i) {
    const int64_t g = gk[i];
    if (by_key[g] == NOT_READ_HERE) rc = 1;
    if (!seen[g]) seen[g] = 1, u.push_back(g);
  }
  std::fill(hits, hits + T, int64_t{0});
  std::fill(reads, reads + T, int64_t{0});
  for (int64_t g : u) {
    seen[g] = 0;
    if (rc) continue;
    const int64_t t = std::upper_bound(key_base, key_base + T + 1, g) - key_base - 1;
    int64_t own = owner_all[g];
    const int64_t* p = std::lower_bound(moved, moved + M, g);
    const bool mv = p != moved + M && *p == g;
    if (mv) own = moved_dst[p - moved];
    if (by_key[g] == NOT_SHARED && own != rank) {
      rc = 2;
      continue;
    }
    hits[t] += own == rank && !mv;
    ++reads[t];
  }
  return rc;
}

// lookup_layout.lookup_layout, rows (every table has the same dim): the TBE's indices (local slots of the exclusive
// ids) and offsets (F * B bags), and for the shared ids the value each one adds (`value_src`, its index among the
// pairs read here) and the pooled output row it adds to (`out_dst` = bag * F + feature). Writes the counts of
// exclusive and shared ids to `counts`. Returns 0, or 1 if an exclusive id has no local slot.
int herald_step_lookup_layout(int64_t n, const int64_t* gk, const int64_t* seg, const int64_t* by_key,
                              const int32_t* slot_of_all, int64_t B, int64_t F, int64_t* indices, int64_t* offsets,
                              int64_t* value_src, int64_t* out_dst, int64_t* counts) {
  int64_t ne = 0, ns = 0;
  std::fill(offsets, offsets + F * B + 1, int64_t{0});
  for (int64_t i = 0; i < n; ++i) {
    const int64_t g = gk[i], m = by_key[g];
    if (m == NOT_SHARED) {
      const int64_t s = slot_of_all[g];
      if (s < 0) return 1;
      indices[ne++] = s;
      ++offsets[seg[i] + 1];
    } else {
      value_src[ns] = m;
      out_dst[ns++] = (seg[i] % B) * F + seg[i] / B;
    }
  }
  for (int64_t j = 0; j < F * B; ++j) offsets[j + 1] += offsets[j];
  counts[0] = ne, counts[1] = ns;
  return 0;
}

}  // extern "C"
