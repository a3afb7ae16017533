"""`herald`: vectorised LAIA + on-demand synchronisation on the exact ownership protocol (executable plans).

Per step (batches[0] = current global batch, batches[1:] = up to L lookahead batches):
1. LAIA: score[s, r] = number of the sample's keys (in the scheduled tables) owned by r, from one owner lookup
   per (sample, key) and one bincount; `balanced_assign` gives every rank exactly B samples.
2. Reader sets of every key under that assignment (`schedule.reads`).
3. Ownership: a key read by one rank moves there (MIGRATE); a shared key stays with its owner when the owner reads
   it, otherwise it moves to the reader with the most samples reading it. Arrivals that exceed a rank's guest
   capacity evict guests not read in this step, those unused in the lookahead window first (Belady-like, least
   recently used among equals); evicted guests go home (EVICT_HOME) or, when the lookahead knows their next reader,
   straight there (FORWARD). If a rank cannot make room, the lowest-value arrivals are cancelled (the key is then
   read through the shared path). All moves apply at once; capacity holds after them.
4. Every other read key goes through `shared`.
"""

from __future__ import annotations

import numpy as np

from herald_torchrec.schedule.batch import GlobalBatch
from herald_torchrec.schedule.directory import OwnershipDirectory
from herald_torchrec.schedule.laia import balanced_assign
from herald_torchrec.schedule.plan import EVICT_HOME, FORWARD, MIGRATE, Plan, RowMoves
from herald_torchrec.schedule.policy import SchedulePolicy, order_from_assignment, shared_rows, split_gid
from herald_torchrec.schedule.reads import distinct, step_reads


class HeraldPolicy(SchedulePolicy):
    name = "herald"

    def __init__(self, table_rows, num_ranks, batch_per_rank, cache_ratio=0.1, lookahead=4,
                 tables=None, shared_move=True, weight="none", lp_iters=0, own_bonus=0.5) -> None:
        super().__init__(table_rows, num_ranks, batch_per_rank, cache_ratio, lookahead)
        self.directory = OwnershipDirectory(self.layout, self.num_ranks, self.cache_ratio)
        T = self.layout.num_tables
        self.scored = np.ones(T, dtype=bool) if tables is None else np.isin(np.arange(T), tables)
        self.shared_move = shared_move
        self.weight = weight
        self.lp_iters = lp_iters
        self.own_bonus = own_bonus
        self.next_use = np.zeros(self.layout.total_rows, dtype=np.int64)
        self._picked = np.zeros(self.layout.total_rows, dtype=bool)

    # ------------------------------------------------------------------------------------------------------
    def _make_room(self, keys, own, home, want, single, nu) -> np.ndarray:
        """Pick eviction victims so that every guest group fits after the step's moves; cancels (in `want`) the
        lowest-value arrivals of groups that cannot make room. Returns the victims (global rows)."""
        d = self.directory
        R, T = self.num_ranks, self.layout.num_tables
        G = R * T
        tk = d.table[keys].astype(np.int64)
        last, step, L1 = d.last_use, self.step, self.lookahead + 1
        chosen = np.zeros(0, dtype=np.int64)
        freed = np.zeros(G, dtype=np.int64)
        picked = self._picked
        rounds = 4
        for it in range(rounds + 2):
            # cancelling an arrival also cancels a departure, which another group may have counted on: a few
            # rounds settle the chains; the last round no longer counts on departures, which always converges
            mv = np.flatnonzero(want != own)
            arr = mv[want[mv] != home[mv]]
            dep = mv[own[mv] != home[mv]]
            arr_g = want[arr] * T + tk[arr]
            credit = np.bincount(own[dep] * T + tk[dep], minlength=G) if it < rounds else 0
            deficit = d.slots.fill - credit + np.bincount(arr_g, minlength=G) - freed - d.slots.cap
            gneed = np.flatnonzero(deficit > 0)
            if gneed.shape[0] == 0:
                break

            def prio(pos: np.ndarray) -> np.ndarray:
                g = d.slots.slot[pos]
                lu = last[g]
                n = nu[g]
                p = np.where(n > 0, L1 - n, 0) * (step + 2) + lu + 1
                return np.where((lu == step) | picked[g], -1, p)  # read this step or already picked: stays

            vpos = d.slots.pick_victims(gneed, deficit[gneed], prio)
            v = d.slots.slot[vpos]
            picked[v] = True
            chosen = np.concatenate([chosen, v])
            vg = d.owner[v].astype(np.int64) * T + d.table[v].astype(np.int64)
            vcount = np.bincount(vg, minlength=G)
            freed += vcount
            left = deficit - vcount
            over = left[arr_g] > 0
            if over.any():
                cand, cg = arr[over], arr_g[over]
                # keep the most valuable arrivals: single-reader migrations, then keys used again soon
                val = np.where(single[cand], 2, 0) + (nu[keys[cand]] > 0)
                o = np.lexsort((keys[cand], -val, cg))
                cand, cg = cand[o], cg[o]
                n_in = np.bincount(cg, minlength=G)
                start = np.cumsum(n_in) - n_in
                within = np.arange(cand.shape[0]) - start[cg]
                drop = within >= n_in[cg] - left[cg]
                want[cand[drop]] = own[cand[drop]]
        else:  # pragma: no cover - cannot happen: each round cancels every arrival that does not fit
            raise RuntimeError("herald: capacity resolution did not converge")
        picked[chosen] = False
        return chosen

    def _batch_keys(self, b: GlobalBatch) -> np.ndarray:
        if "keys" not in b._cache:
            _, _, gid = b.flat()
            b._cache["keys"] = distinct(gid, self.scratch.get(self.layout.total_rows))[0]
        return b._cache["keys"]

    def _plan(self, batches: list[GlobalBatch]) -> Plan:
        b = batches[0]
        R, B, N = self.num_ranks, self.batch_per_rank, b.num_samples
        d = self.directory
        smp, tab, gid = b.flat()
        # ---- LAIA ------------------------------------------------------------------------------------------
        sel = self.scored[tab]
        own_pair = d.owner[gid[sel]].astype(np.int64)
        w = None
        if self.weight != "none":
            _, cid, cnt = distinct(gid[sel], self.scratch.get(self.layout.total_rows))
            c = cnt[cid].astype(np.float64)
            if self.weight == "geo":
                w = ((R - 1) / R) ** (c - 1)
            elif self.weight == "inv":
                w = 1.0 / c
            elif self.weight == "cap":
                w = (c <= B).astype(np.float64)
        score = np.bincount(smp[sel] * R + own_pair, weights=w, minlength=N * R).reshape(N, R)
        sample_rank = balanced_assign(score, B, self.step % R)
        if self.lp_iters:
            ukeys, cid, _ = distinct(gid[sel], self.scratch.get(self.layout.total_rows))
            K0 = ukeys.shape[0]
            ownk = d.owner[ukeys].astype(np.int64)
            bonus = np.zeros((K0, R)); bonus[np.arange(K0), ownk] = self.own_bonus
            ss = smp[sel]
            for _ in range(self.lp_iters):
                ckr = np.bincount(cid * R + sample_rank[ss], minlength=K0 * R).reshape(K0, R)
                vown = np.argmax(ckr + bonus, axis=1)
                score = np.bincount(ss * R + vown[cid], weights=w, minlength=N * R).reshape(N, R)
                sample_rank = balanced_assign(score, B, self.step % R)
        # ---- readers -----------------------------------------------------------------------------------------
        rd = step_reads(gid, sample_rank[smp], R, self.scratch)
        keys = rd.keys
        K = keys.shape[0]
        own = d.owner[keys].astype(np.int64)
        home = d.home[keys].astype(np.int64)
        pk, pr = rd.pair_key, rd.pair_rank
        owner_reads = np.zeros(K, dtype=bool)
        owner_reads[pk[own[pk] == pr]] = True
        single = rd.count == 1
        sole = np.empty(K, dtype=np.int64)
        sole[pk] = pr
        want = own.copy()
        m_single = single & ~owner_reads
        want[m_single] = sole[m_single]
        if self.shared_move:
            far = ~single & ~owner_reads
            if far.any():
                fp = np.flatnonzero(far[pk])
                o = np.lexsort((pr[fp], -rd.pair_samples[fp], pk[fp]))
                fp = fp[o]
                firstp = np.ones(fp.shape[0], dtype=bool)
                firstp[1:] = pk[fp][1:] != pk[fp][:-1]
                want[pk[fp[firstp]]] = pr[fp[firstp]]
        # ---- lookahead: next use (1..L) of every key in the window ------------------------------------------
        nu = self.next_use
        window = [self._batch_keys(x) for x in batches[1:]]
        for j in range(len(window), 0, -1):
            nu[window[j - 1]] = j
        # ---- capacity ----------------------------------------------------------------------------------------
        d.last_use[keys] = self.step  # also pins this step's keys: they are never eviction victims
        victims = self._make_room(keys, own, home, want, single, nu)
        # reset lookahead marks
        vnu = nu[victims] if victims.shape[0] else np.zeros(0, dtype=np.int64)
        for w in window:
            nu[w] = 0
        # ---- moves -------------------------------------------------------------------------------------------
        mig = np.flatnonzero(want != own)
        mv_gid = np.concatenate([keys[mig], victims])
        mv_src = np.concatenate([own[mig], d.owner[victims].astype(np.int64)])
        v_home = d.home[victims].astype(np.int64)
        mv_dst = np.concatenate([want[mig], v_home])
        mv_kind = np.concatenate([np.full(mig.shape[0], MIGRATE, dtype=np.int8),
                                  np.full(victims.shape[0], EVICT_HOME, dtype=np.int8)])
        del vnu
        new_own = want
        # ---- shared ------------------------------------------------------------------------------------------
        exclusive = single & (sole == new_own)
        moved_key = want != own
        pair_local = (new_own[pk] == pr) & ~moved_key[pk]
        ids, offs, readers = rd.readers_csr(~exclusive)
        shared = shared_rows(self.layout, d.table, keys[ids], new_own[ids], offs, readers)
        # ---- apply -------------------------------------------------------------------------------------------
        d.apply_moves(mv_gid, mv_dst)
        o = np.argsort(mv_gid, kind="stable")
        t, row = split_gid(self.layout, d.table, mv_gid[o])
        moves = RowMoves(table=t, row=row, src=mv_src[o], dst=mv_dst[o], kind=mv_kind[o])
        remote = shared.remote_reads()
        counters = {"hit": int(pair_local.sum()), "migrate": int(mig.shape[0]),
                    "evict_home": int((mv_kind == EVICT_HOME).sum()), "forward": int((mv_kind == FORWARD).sum()),
                    "shared_value": remote, "shared_grad": remote}
        return Plan(step=self.step, num_ranks=R, batch_per_rank=B, sample_order=order_from_assignment(sample_rank, R),
                    moves=moves, shared=shared, counters=counters)
