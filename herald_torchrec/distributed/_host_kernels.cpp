// Compiled kernels of the data plane's step preparation (step/prepare.py, lookup_layout.py): the same results as the
// numpy code, in one pass. Loaded by distributed/host_kernels.py (herald_torchrec/_native.py builds it). Integer
// work only. A kernel that meets something the numpy code would reject returns non-zero and does nothing visible:
// the caller then runs the numpy code, which raises with its own message.
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

namespace {
constexpr int64_t NOT_SHARED = -1, NOT_READ_HERE = -2;  // plan_exec.SharedMarks
}

extern "C" {

int herald_step_version() { return 16; }

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

// ---- the store's directory (row_store.RowStore): every call checks first and changes nothing if it declines ----

// RowStore.release_many: this rank gives up (table, row) pairs; freed guest slots go back on their table's stack in
// reverse item order (so the next arrivals take them in item order). Writes the released slots. Returns 0, or 1 if
// this rank does not own one of them.
// (The same parameters as herald_step_allocate; `home_lo` is not needed here.) Also 1 for a table or row out of range.
int herald_step_release(int64_t n, const int64_t* tables, const int64_t* keys, const int64_t* rows,
                        const int64_t* key_base, const int64_t* slot_base, const int64_t* /*home_lo*/,
                        const int64_t* home_len, const int64_t* free_base, int64_t T, int32_t* slot_of_all,
                        int64_t* key_of_all, int64_t* free_all, int64_t* free_top, int64_t* slots) {
  for (int64_t i = 0; i < n; ++i) {
    if (tables[i] < 0 || tables[i] >= T || keys[i] < 0 || keys[i] >= rows[tables[i]]) return 1;
    slots[i] = slot_of_all[key_base[tables[i]] + keys[i]];
    if (slots[i] < 0) return 1;
  }
  std::vector<int64_t> n_out(T, 0), k(T, 0);
  for (int64_t i = 0; i < n; ++i)
    if (slots[i] >= home_len[tables[i]]) ++n_out[tables[i]];
  for (int64_t i = 0; i < n; ++i) {
    const int64_t t = tables[i], s = slots[i];
    slot_of_all[key_base[t] + keys[i]] = -1;
    key_of_all[slot_base[t] + s] = -1;
    if (s >= home_len[t]) free_all[free_base[t] + free_top[t] + n_out[t] - 1 - k[t]++] = s;
  }
  for (int64_t t = 0; t < T; ++t) free_top[t] += n_out[t];
  return 0;
}

// RowStore.set_owner_many: the global ownership map and the per-(table, rank) guest counts [T, R]. Returns 0, or 1
// (nothing changed) for a table, row or rank out of range.
int herald_step_set_owner(int64_t n, const int64_t* tables, const int64_t* keys, const int64_t* ranks,
                          const int64_t* rows, const int64_t* key_base, const int64_t* home_block, int64_t T,
                          int64_t R, int32_t* owner_all, int64_t* guest_count) {
  for (int64_t i = 0; i < n; ++i)
    if (tables[i] < 0 || tables[i] >= T || keys[i] < 0 || keys[i] >= rows[tables[i]] || ranks[i] < 0 || ranks[i] >= R)
      return 1;
  for (int64_t i = 0; i < n; ++i) {
    const int64_t t = tables[i], g = key_base[t] + keys[i], home = keys[i] / home_block[t], old = owner_all[g];
    if (old != home) --guest_count[t * R + old];
    if (ranks[i] != home) ++guest_count[t * R + ranks[i]];
    owner_all[g] = static_cast<int32_t>(ranks[i]);
  }
  return 0;
}

// RowStore.allocate_many: arriving (table, row) pairs get their home slot, or a free guest slot (in item order).
// Writes the slots. Returns 0, or 1 (a row out of range, one already owned here, or too few free guest slots).
int herald_step_allocate(int64_t n, const int64_t* tables, const int64_t* keys, const int64_t* rows,
                         const int64_t* key_base, const int64_t* slot_base, const int64_t* home_lo,
                         const int64_t* home_len, const int64_t* free_base, int64_t T, int32_t* slot_of_all,
                         int64_t* key_of_all, const int64_t* free_all, int64_t* free_top, int64_t* slots) {
  std::vector<int64_t> n_guest(T, 0), k(T, 0);
  for (int64_t i = 0; i < n; ++i) {
    const int64_t t = tables[i], r = keys[i];
    if (t < 0 || t >= T || r < 0 || r >= rows[t] || slot_of_all[key_base[t] + r] >= 0) return 1;
    if (!(r >= home_lo[t] && r < home_lo[t] + home_len[t])) ++n_guest[t];
  }
  for (int64_t t = 0; t < T; ++t)
    if (n_guest[t] > free_top[t]) return 1;
  for (int64_t i = 0; i < n; ++i) {
    const int64_t t = tables[i], r = keys[i];
    const bool home = r >= home_lo[t] && r < home_lo[t] + home_len[t];
    slots[i] = home ? r - home_lo[t] : free_all[free_base[t] + free_top[t] - 1 - k[t]++];
    slot_of_all[key_base[t] + r] = static_cast<int32_t>(slots[i]);
    key_of_all[slot_base[t] + slots[i]] = r;
  }
  for (int64_t t = 0; t < T; ++t) free_top[t] -= n_guest[t];
  return 0;
}

// lookup_layout.with_owner_bags: the batch's F x B bags plus n one-row bags per feature, one per shared row this rank
// owns (key i of table t: bag B + k_i of t's first feature, k_i its rank among t's keys). Writes the new offsets
// (F * (B + n) + 1; room for F * (B + nk) + 1), indices (ne + nk) and each key's bag row (B + k_i) * F + feature;
// returns n.
int64_t herald_step_owner_bags(int64_t B, int64_t F, const int64_t* offsets, const int64_t* indices, int64_t nk,
                               const int64_t* tables, const int64_t* slots, const int64_t* first_feature, int64_t T,
                               int64_t* offsets_new, int64_t* indices_new, int64_t* bag_rows) {
  std::vector<int64_t> k_of(T, 0), k(nk), feat(nk), start(F + 1, 0);
  int64_t n = 0;
  for (int64_t i = 0; i < nk; ++i) {
    k[i] = k_of[tables[i]]++;
    feat[i] = first_feature[tables[i]];
    n = std::max(n, k[i] + 1);
    ++start[feat[i] + 1];
    bag_rows[i] = (B + k[i]) * F + feat[i];
  }
  for (int64_t f = 0; f < F; ++f) start[f + 1] += start[f];
  std::vector<int64_t> by_feat(nk), fill(start.begin(), start.end() - 1);
  for (int64_t i = 0; i < nk; ++i) by_feat[fill[feat[i]]++] = i;  // keys by feature, in key order (= k order)
  int64_t pos = 0, bag = 0;
  offsets_new[0] = 0;
  for (int64_t f = 0; f < F; ++f) {
    for (int64_t b = 0; b < B; ++b, ++bag) {
      for (int64_t j = offsets[f * B + b]; j < offsets[f * B + b + 1]; ++j) indices_new[pos++] = indices[j];
      offsets_new[bag + 1] = pos;
    }
    const int64_t m = start[f + 1] - start[f];  // this feature's extra rows: bags 0..m-1 of its n
    for (int64_t j = 0; j < n; ++j, ++bag) {
      if (j < m) indices_new[pos++] = slots[by_feat[start[f] + j]];
      offsets_new[bag + 1] = pos;
    }
  }
  return n;
}

// plan_exec.prepare_moves: the plan's M moves checked against the ownership map and the guest capacities, then this
// rank's part of the moves all-to-all: the moves it sends (by destination, stable) and receives (by source, stable),
// the splits in elements (`width` per move) and the moved keys sorted with their destinations. Returns 0, or 1 for
// a plan the numpy code rejects (table, rank, kind or row out of range, src == dst, a row not owned by src, an
// evict_home that does not go home, a guest group over capacity, a row moving twice): nothing is written then that
// the caller uses.
int herald_step_prepare_moves(int64_t M, const int64_t* table, const int64_t* row, const int64_t* src,
                              const int64_t* dst, const int64_t* kind, const int64_t* width, int64_t T, int64_t R,
                              int64_t rank, const int64_t* rows, const int64_t* key_base, const int32_t* owner_all,
                              const int64_t* home_block, const int64_t* guest_count, const int64_t* capacity,
                              const uint8_t* known_kind, int64_t n_kinds, int64_t evict_home, int64_t* send_idx,
                              int64_t* recv_idx, int64_t* splits /* send [R], then recv [R] */, int64_t* gkey_sorted,
                              int64_t* dst_sorted, int64_t* counts /* n_send, n_recv */) {
  std::vector<int64_t> gc(guest_count, guest_count + T * R);
  std::vector<std::pair<int64_t, int64_t>> gk(M);
  for (int64_t i = 0; i < M; ++i) {
    const int64_t t = table[i];
    if (t < 0 || t >= T || src[i] < 0 || src[i] >= R || dst[i] < 0 || dst[i] >= R || src[i] == dst[i]) return 1;
    if (kind[i] < 0 || kind[i] >= n_kinds || !known_kind[kind[i]] || row[i] < 0 || row[i] >= rows[t]) return 1;
    const int64_t g = key_base[t] + row[i], home = row[i] / home_block[t];
    if (owner_all[g] != src[i]) return 1;
    if (kind[i] == evict_home && (dst[i] != home || src[i] == home)) return 1;
    if (src[i] != home) --gc[t * R + src[i]];
    if (dst[i] != home) ++gc[t * R + dst[i]];
    gk[i] = {g, i};
  }
  for (int64_t t = 0; t < T; ++t)
    for (int64_t q = 0; q < R; ++q)
      if (gc[t * R + q] > capacity[t]) return 1;
  std::sort(gk.begin(), gk.end());
  for (int64_t i = 1; i < M; ++i)
    if (gk[i].first == gk[i - 1].first) return 1;
  for (int64_t i = 0; i < M; ++i) gkey_sorted[i] = gk[i].first, dst_sorted[i] = dst[gk[i].second];
  // routes: counting sorts by peer keep the plan's order within a peer (numpy's stable argsort)
  std::fill(splits, splits + 2 * R, int64_t{0});
  std::vector<int64_t> ns(R + 1, 0), nr(R + 1, 0);
  for (int64_t i = 0; i < M; ++i) {
    if (src[i] == rank) ++ns[dst[i] + 1], splits[dst[i]] += width[i];
    if (dst[i] == rank) ++nr[src[i] + 1], splits[R + src[i]] += width[i];
  }
  for (int64_t q = 0; q < R; ++q) ns[q + 1] += ns[q], nr[q + 1] += nr[q];
  counts[0] = ns[R], counts[1] = nr[R];
  for (int64_t i = 0; i < M; ++i) {
    if (src[i] == rank) send_idx[ns[dst[i]]++] = i;
    if (dst[i] == rank) recv_idx[nr[src[i]]++] = i;
  }
  return 0;
}

// plan_exec.prepare_shared: the plan's n shared rows (P (row, reader) pairs, readers in CSR `ro`) checked against the
// ownership map as it is after the moves (`moved`: the step's moved keys, sorted, with their destinations), then
// this rank's part of the values' all-to-all (owner before the moves -> reader; a reader that becomes the owner in
// the moves "fills" from its store instead) and of the gradients' return (reader -> owner after the moves). Each
// route is a counting sort by peer, stable in pair order (numpy's routes()). `out` holds, P entries each unless
// said: gkey [n], send_table, send_row, send_gkey, send_off, recv_table, recv_row, recv_gkey, recv_off, value_table,
// value_gkey, grad_idx, then send_splits, recv_splits, value_splits, grad_splits [R each], then the counts n_send,
// n_recv, n_value, n_grad, n_values_out, n_grads_out, n_fill. Returns 0, or 1 for a plan the numpy code rejects or
// handles itself (rows not strictly increasing by key): nothing is written then that the caller uses.
int herald_step_prepare_shared(int64_t n, const int64_t* table, const int64_t* row, const int64_t* owner,
                               const int64_t* ro, int64_t P, const int64_t* readers, int64_t T, int64_t R,
                               int64_t rank, const int64_t* rows, const int64_t* key_base, const int32_t* owner_all,
                               const int64_t* dims, int64_t M, const int64_t* moved, const int64_t* moved_dst,
                               int64_t* out) {
  if (ro[0] != 0 || ro[n] != P) return 1;
  int64_t* gkey = out;
  int64_t *send_table = gkey + n, *send_row = send_table + P, *send_gkey = send_row + P, *send_off = send_gkey + P;
  int64_t *recv_table = send_off + P, *recv_row = recv_table + P, *recv_gkey = recv_row + P, *recv_off = recv_gkey + P;
  int64_t *value_table = recv_off + P, *value_gkey = value_table + P, *grad_idx = value_gkey + P;
  int64_t *send_splits = grad_idx + P, *recv_splits = send_splits + R, *value_splits = recv_splits + R;
  int64_t *grad_splits = value_splits + R, *counts = grad_splits + R;
  std::vector<int64_t> pre(n);  // owner before the moves
  for (int64_t k = 0; k < n; ++k) {
    const int64_t t = table[k];
    if (t < 0 || t >= T || owner[k] < 0 || owner[k] >= R || row[k] < 0 || row[k] >= rows[t]) return 1;
    if (ro[k + 1] - ro[k] < 1) return 1;
    const int64_t g = key_base[t] + row[k];
    if (k && g <= gkey[k - 1]) return 1;
    gkey[k] = g;
    pre[k] = owner_all[g];
    int64_t after = pre[k];
    const int64_t* p = std::lower_bound(moved, moved + M, g);
    if (p != moved + M && *p == g) after = moved_dst[p - moved];
    if (after != owner[k]) return 1;
    for (int64_t j = ro[k]; j < ro[k + 1]; ++j)
      if (readers[j] < 0 || readers[j] >= R || (j > ro[k] && readers[j] <= readers[j - 1])) return 1;
  }
  // counting sorts by peer: values sent (pre == rank, by reader) and received (reader == rank, by pre) over the
  // pairs that are not fills; gradients sent (reader == rank, by owner) and received (owner == rank, by reader)
  std::vector<int64_t> vs(R + 1, 0), vr(R + 1, 0), gs(R + 1, 0), gr(R + 1, 0);
  std::fill(send_splits, send_splits + 4 * R, int64_t{0});
  int64_t n_fill = 0;
  for (int64_t k = 0; k < n; ++k) {
    const int64_t w = dims[table[k]], own = owner[k];
    for (int64_t j = ro[k]; j < ro[k + 1]; ++j) {
      const int64_t q = readers[j];
      const bool fill = q == own && pre[k] != own;
      if (!fill && pre[k] == rank) ++vs[q + 1], value_splits[q] += w;
      if (!fill && q == rank) ++vr[pre[k] + 1], recv_splits[pre[k]] += w;
      if (fill && q == rank) ++n_fill;
      if (q == rank) ++gs[own + 1], grad_splits[own] += w;
      if (own == rank) ++gr[q + 1], send_splits[q] += w;
    }
  }
  for (int64_t q = 0; q < R; ++q) vs[q + 1] += vs[q], vr[q + 1] += vr[q], gs[q + 1] += gs[q], gr[q + 1] += gr[q];
  const int64_t n_value = vs[R], n_recv = vr[R] + n_fill, n_grad = gs[R], n_send = gr[R];
  std::vector<int64_t> position(P, -1);
  int64_t fill_at = vr[R], n_values_out = 0, n_grads_out = 0;
  std::vector<int64_t> grad_pair(n_grad);
  for (int64_t k = 0; k < n; ++k) {
    const int64_t t = table[k], own = owner[k];
    for (int64_t j = ro[k]; j < ro[k + 1]; ++j) {
      const int64_t q = readers[j];
      const bool fill = q == own && pre[k] != own;
      if (!fill && pre[k] == rank) {
        const int64_t i = vs[q]++;
        value_table[i] = t, value_gkey[i] = gkey[k];
      }
      if (q == rank) {
        const int64_t i = fill ? fill_at++ : vr[pre[k]]++;
        recv_table[i] = t, recv_row[i] = row[k], recv_gkey[i] = gkey[k], recv_off[i] = dims[t];
        position[j] = i;
        grad_pair[gs[own]++] = j;
        n_grads_out += own != rank;
      }
      if (own == rank) {
        const int64_t i = gr[q]++;
        send_table[i] = t, send_row[i] = row[k], send_gkey[i] = gkey[k], send_off[i] = dims[t];
        n_values_out += q != rank;
      }
    }
  }
  for (int64_t i = 0; i < n_grad; ++i) grad_idx[i] = position[grad_pair[i]];
  int64_t acc = 0;  // widths -> exclusive offsets
  for (int64_t i = 0; i < n_send; ++i) std::swap(acc, send_off[i]), acc += send_off[i];
  acc = 0;
  for (int64_t i = 0; i < n_recv; ++i) std::swap(acc, recv_off[i]), acc += recv_off[i];
  counts[0] = n_send, counts[1] = n_recv, counts[2] = n_value, counts[3] = n_grad;
  counts[4] = n_values_out, counts[5] = n_grads_out, counts[6] = n_fill;
  return 0;
}

// plan_exec.local_input, for a KJT whose keys are the module's features in its order: every id range-checked
// against its feature's table, then its global key and its bag (`seg` = feature * B + sample). Returns 0, or 1 if
// the lengths do not add up to the values or an id is out of range (the numpy code raises, naming it).
int herald_step_local_input(int64_t n, const int64_t* values, int64_t F, int64_t B, const int64_t* lengths,
                            const int64_t* ftab, const int64_t* rows, const int64_t* key_base, int64_t* gkeys,
                            int64_t* seg) {
  int64_t i = 0;
  for (int64_t f = 0; f < F; ++f) {
    const int64_t lim = rows[ftab[f]], base = key_base[ftab[f]];
    for (int64_t b = f * B; b < (f + 1) * B; ++b) {
      const int64_t len = lengths[b];
      if (len < 0 || len > n - i) return 1;
      for (int64_t e = i + len; i < e; ++i) {
        if (values[i] < 0 || values[i] >= lim) return 1;
        gkeys[i] = values[i] + base, seg[i] = b;
      }
    }
  }
  return i == n ? 0 : 1;
}

// out[out_idx[i]] += in[in_idx[i]] (rows of `width` floats; in_idx null: row i), i = 0..n-1 in order: torch's
// index_add_ / index_select backward on the CPU add in the same order, so the sums are bit for bit theirs, without
// a gathered copy and without index_add_'s per-row dispatch. Indices are the caller's, already in range.
void herald_step_gather_add(int64_t n, const int64_t* out_idx, const int64_t* in_idx, int64_t width, const float* in,
                            float* out) {
  for (int64_t i = 0; i < n; ++i) {
    const float* a = in + (in_idx ? in_idx[i] : i) * width;
    float* o = out + out_idx[i] * width;
    for (int64_t c = 0; c < width; ++c) o[c] += a[c];
  }
}

// lookup_layout.grad_sum_layout, rows: the distinct keys of the n returned gradients, sorted (`keys`), each
// gradient's key index (`inv`), and each key's table and local slot. Returns the number of distinct keys.
int64_t herald_step_grad_sum(int64_t n, const int64_t* gkey, int64_t T, const int64_t* key_base,
                             const int32_t* slot_of_all, int64_t* keys, int64_t* inv, int64_t* tab, int64_t* slots) {
  std::vector<int64_t> order(n);
  for (int64_t i = 0; i < n; ++i) order[i] = i;
  std::sort(order.begin(), order.end(), [gkey](int64_t a, int64_t b) { return gkey[a] < gkey[b]; });
  int64_t k = 0;
  for (int64_t j = 0; j < n; ++j) {
    const int64_t g = gkey[order[j]];
    if (k == 0 || keys[k - 1] != g) {
      keys[k] = g;
      tab[k] = std::upper_bound(key_base, key_base + T + 1, g) - key_base - 1;
      slots[k++] = slot_of_all[g];
    }
    inv[order[j]] = k - 1;
  }
  return k;
}

// ---- the input stage's samples, every bag of one length u (input_layout.py) ------------------------------------
namespace {
// ids of sample s for keys `keys` (positions in the slice's K keys), sample-major, narrowed to `it` bytes
uint8_t* put_ids(uint8_t* o, const int64_t* values, int64_t n, int64_t u, const int64_t* keys, int64_t nk,
                 int64_t s, int64_t it) {
  for (int64_t j = 0; j < nk; ++j) {
    const int64_t* v = values + (keys[j] * n + s) * u;
    for (int64_t e = 0; e < u; ++e, o += it) {
      if (it == 4) {
        const int32_t x = static_cast<int32_t>(v[e]);
        std::memcpy(o, &x, 4);
      } else {
        std::memcpy(o, v + e, 8);
      }
    }
  }
  return o;
}
}  // namespace

// input_layout.sample_blocks for a slice of n samples whose bags all have length u (its values are [K, n, u]):
// block d holds samples order[cut[d] : cut[d + 1]]: their dense + label bytes (`fixed` [n, fb]), then, where
// with_ids[d], their managed ids (the wire's `it` bytes, sample-major), then their carried ids (int64, sample-major).
// The blocks are written back to back into `out`; `sizes` [R] and `id_bytes` [R] get each block's bytes and its
// managed ids' bytes.
void herald_step_sample_blocks(int64_t n, int64_t fb, const uint8_t* fixed, const int64_t* values, int64_t u,
                               int64_t J, const int64_t* managed, int64_t C, const int64_t* carried, int64_t it,
                               const int64_t* order, int64_t R, const int64_t* cut, const uint8_t* with_ids,
                               uint8_t* out, int64_t* sizes, int64_t* id_bytes) {
  uint8_t* o = out;
  for (int64_t d = 0; d < R; ++d) {
    uint8_t* start = o;
    for (int64_t i = cut[d]; i < cut[d + 1]; ++i, o += fb) std::memcpy(o, fixed + order[i] * fb, fb);
    uint8_t* ids = o;
    if (with_ids[d])
      for (int64_t i = cut[d]; i < cut[d + 1]; ++i) o = put_ids(o, values, n, u, managed, J, order[i], it);
    id_bytes[d] = o - ids;
    for (int64_t i = cut[d]; i < cut[d + 1]; ++i) o = put_ids(o, values, n, u, carried, C, order[i], 8);
    sizes[d] = o - start;
  }
}

// input_layout._received_uniform: from each source's block (`blocks[q]`, n_from[q] samples: [n, fb] bytes, then
// [n, J, u] managed ids of `it` bytes, then [n, C, u] carried int64 ids), the received samples' dense + label bytes
// [n_all, fb] and KJT values [K, n_all, u] (int64), in source order.
void herald_step_received_uniform(int64_t R, const uint8_t* const* blocks, const int64_t* n_from, int64_t fb,
                                  int64_t u, int64_t J, const int64_t* managed, int64_t C, const int64_t* carried,
                                  int64_t it, uint8_t* fixed, int64_t* values) {
  int64_t n_all = 0;
  for (int64_t q = 0; q < R; ++q) n_all += n_from[q];
  for (int64_t q = 0, at = 0; q < R; ++q) {
    const int64_t n = n_from[q];
    const uint8_t* b = blocks[q];
    std::memcpy(fixed + at * fb, b, n * fb);
    b += n * fb;
    for (int64_t i = 0; i < n; ++i)
      for (int64_t j = 0; j < J; ++j) {
        int64_t* v = values + (managed[j] * n_all + at + i) * u;
        for (int64_t e = 0; e < u; ++e, b += it) {
          if (it == 4) {
            int32_t x;
            std::memcpy(&x, b, 4);
            v[e] = x;
          } else {
            std::memcpy(v + e, b, 8);
          }
        }
      }
    for (int64_t i = 0; i < n; ++i)
      for (int64_t c = 0; c < C; ++c, b += 8 * u) std::memcpy(values + (carried[c] * n_all + at + i) * u, b, 8 * u);
    at += n;
  }
}

// plan_part._relay_groups: the tables with a relayed (row, host) group, and the pairs read on a wanted host. Row r's
// pairs are offsets[r]..offsets[r+1] (reader readers[p]); a reader is live unless it receives the row in the moves
// (it is the owner after them, `after[r]`, and the owner before them, `before[r]`, is another rank). A (row, host)
// goes through its relay iff it has two live readers and the host is not both owners' (host_relay.pair_routes'
// rule). Sets table_relayed[table[r]] for such rows (the caller zeroes it) and on[p] = wanted_host[host[readers[p]]].
// `count` is int32 scratch over the H hosts, all zero (left so).
void herald_step_relay_groups(int64_t n, const int64_t* offsets, const int64_t* readers, const int64_t* before,
                              const int64_t* after, const int64_t* table, const int64_t* host,
                              const uint8_t* wanted_host, int32_t* count, uint8_t* table_relayed, uint8_t* on) {
  std::vector<int64_t> touched;
  for (int64_t r = 0; r < n; ++r) {
    if (table_relayed[table[r]]) {  // the table's flag is set: only the wanted hosts' pairs are left to find
      for (int64_t p = offsets[r]; p < offsets[r + 1]; ++p) on[p] = wanted_host[host[readers[p]]];
      continue;
    }
    const int64_t b = before[r], a = after[r], hb = host[b], ha = host[a];
    bool relayed = false;
    touched.clear();
    for (int64_t p = offsets[r]; p < offsets[r + 1]; ++p) {
      const int64_t q = readers[p], h = host[q];
      on[p] = wanted_host[h];
      if (q == a && b != a) continue;  // it receives the row itself
      if (count[h]++ == 0) touched.push_back(h);
      else if (count[h] == 2 && (h != hb || h != ha)) relayed = true;
    }
    for (int64_t h : touched) count[h] = 0;
    if (relayed) table_relayed[table[r]] = 1;
  }
}

// host_relay.pair_routes with relays: every pair's relay pair (the lowest-ranked reader of its row and host that does
// not receive the row itself, `fill`; the pair itself where its group has none) and its two routes (`stages`: the
// values of FROM_OWNER, FROM_RELAY, TO_RELAY, TO_OWNER). The pairs of a row must be together, rows in increasing
// order (`pair_row` non-decreasing): returns 1 otherwise, having written nothing the caller uses (its numpy code
// runs). `best` is int64 scratch over the H hosts, all -1 (left so).
int herald_step_pair_routes(int64_t P, const int64_t* pair_row, const int64_t* readers, const int64_t* before,
                            const int64_t* after, const uint8_t* fill, const int64_t* host, const int64_t* stages,
                            int64_t* best, int64_t* value_src, int64_t* value_stage, int64_t* grad_dst,
                            int64_t* grad_stage, int64_t* relay_pair) {
  std::vector<int64_t> touched;
  for (int64_t s = 0, e = 0; s < P; s = e) {
    e = s + 1;
    while (e < P && pair_row[e] == pair_row[s]) ++e;
    if (e < P && pair_row[e] < pair_row[s]) {
      for (int64_t h : touched) best[h] = -1;
      return 1;
    }
    for (int64_t h : touched) best[h] = -1;
    touched.clear();
    for (int64_t p = s; p < e; ++p) {
      if (fill[p]) continue;  // it receives the row itself: it cannot relay its value
      const int64_t h = host[readers[p]], b = best[h];
      if (b < 0) best[h] = p, touched.push_back(h);
      else if (readers[p] < readers[b]) best[h] = p;
    }
    for (int64_t p = s; p < e; ++p) {
      const int64_t h = host[readers[p]], rp = best[h] >= 0 ? best[h] : p;
      const bool relay = rp == p, direct_value = relay || fill[p] || h == host[before[p]];
      const bool direct_grad = relay || h == host[after[p]];
      relay_pair[p] = rp;
      value_src[p] = direct_value ? before[p] : readers[rp];
      value_stage[p] = stages[direct_value ? 0 : 1];
      grad_dst[p] = direct_grad ? after[p] : readers[rp];
      grad_stage[p] = stages[direct_grad ? 3 : 2];
    }
  }
  for (int64_t h : touched) best[h] = -1;
  return 0;
}

// plan_part._needed_pairs: every (part, pair) a part needs, by part, then pair. Row r's pairs are
// offsets[r]..offsets[r+1]; part[q] is rank q's part (-1: none cut here). A part needs every pair of the rows whose
// owner before or after the moves is its rank, its rank's own pairs, and for each pair read on a wanted host (`on`,
// increasing, with its relay pair `relay_of_on`): the relay's rank needs the pair, the reader's rank the relay pair
// (both in the pair's row). Writes up to `cap` entries to out_part / out_pair; returns how many there are (more
// than cap: call again with room for them).
int64_t herald_step_part_pairs(int64_t n, const int64_t* offsets, const int64_t* readers, const int64_t* before,
                               const int64_t* after, const int64_t* part, int64_t K, int64_t Q, const int64_t* on,
                               const int64_t* relay_of_on, int64_t cap, int64_t* out_part, int64_t* out_pair) {
  constexpr int SHIFT = 40;  // (part, pair) packed: part << 40 | pair
  std::vector<std::vector<int64_t>> per(static_cast<size_t>(K));
  std::vector<int64_t> codes;
  int64_t c = 0;  // cursor in `on`
  for (int64_t r = 0; r < n; ++r) {
    const int64_t s = offsets[r], e = offsets[r + 1], kb = part[before[r]], ka = part[after[r]];
    codes.clear();
    for (int64_t p = s; p < e; ++p) {
      if (kb >= 0) codes.push_back(kb << SHIFT | p);
      if (ka >= 0 && ka != kb) codes.push_back(ka << SHIFT | p);
      const int64_t kr = part[readers[p]];
      if (kr >= 0) codes.push_back(kr << SHIFT | p);
      if (c < Q && on[c] == p) {
        const int64_t rp = relay_of_on[c++], kq = part[readers[rp]];
        if (kq >= 0) codes.push_back(kq << SHIFT | p);  // the relay: every pair it relays
        if (kr >= 0) codes.push_back(kr << SHIFT | rp);  // the reader: its relay's pair
      }
    }
    if (codes.empty()) continue;
    std::sort(codes.begin(), codes.end());
    int64_t last = -1;
    for (int64_t x : codes)
      if (x != last) per[x >> SHIFT].push_back(x & ((int64_t{1} << SHIFT) - 1)), last = x;
  }
  int64_t total = 0;
  for (int64_t k = 0; k < K; ++k) {
    for (int64_t p : per[k]) {
      if (total < cap) out_part[total] = k, out_pair[total] = p;
      ++total;
    }
  }
  return total;
}

// RowStore.read_packed / write_packed on host storage (row_access.py, the row-layout path): item i is table t[i]'s
// local slot s[i]; its packed floats are the row of every storage kind k in turn (`widths[k]` floats at row
// base_k[t] + s of kind k's [rows, width] float32 storage `kinds[k]`). `write` = 0: storage -> packed, 1: packed ->
// storage. Indices are the caller's, already checked.
void herald_step_rows(int64_t n, const int64_t* tables, const int64_t* slots, int64_t K, float* const* kinds,
                      const int64_t* widths, const int64_t* const* bases, float* packed, int write) {
  int64_t item = 0;
  for (int64_t k = 0; k < K; ++k) item += widths[k];
  for (int64_t i = 0; i < n; ++i) {
    float* p = packed + i * item;
    for (int64_t k = 0; k < K; ++k) {
      const int64_t w = widths[k];
      float* row = kinds[k] + (bases[k][tables[i]] + slots[i]) * w;
      if (write) std::memcpy(row, p, w * sizeof(float));
      else std::memcpy(p, row, w * sizeof(float));
      p += w;
    }
  }
}

}  // extern "C"
