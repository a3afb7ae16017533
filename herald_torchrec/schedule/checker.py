"""Independent replay of any policy's plans against the true latest version of every row.

The checker shares no code with the policies' bookkeeping (it finds reader sets with np.unique, keeps its own owner
array and versions). Per step it verifies:

* the assignment: `sample_order` is an int64 permutation of the global batch, every rank gets exactly B samples,
  in increasing global order;
* plans that report their reads (`plan.reads`: counting-only plans, and the replica policies' plans): it lists every
true (key, reader) pair exactly once, and the
  version each reader used equals the true latest version (number of earlier steps that updated the row);
* replica plans (plans whose `reads.replica` is set: fae, p2res): the checker replays two copies of
  every row itself — the home copy and the replicas (identical on every rank) — from the plan's `ReplicaSync`
  (to_home / to_replicas before the step, all-reduce after it): a read of a replica (or of the home copy) older
  than the row's latest version is a stale read; a row read through replicas without an all-reduce of its
  gradient, or through replicas and home in the same step, is an error and leaves that copy stale; the reported
  versions must equal the replayed ones; `allreduce` = 2 (R-1) x all-reduced rows (ring all-reduce volume) and
  `shared_value` = `shared_grad` = home reads by non-home ranks;
* ownership plans: every move leaves the row's current owner (checker's replay), no row moves twice, EVICT_HOME goes
  home, MIGRATE goes to a reader of the row; after all moves every rank holds at most its guest capacity per table;
  every key read only by its owner may stay exclusive, every other read key is in `shared` with the true owner and
  exactly its reader set; the value the owner holds is the latest version (a lost gradient or a value served by a
  non-owner makes it stale from then on);
* counters: hit + migrate + shared_value (or hit + miss_pull + update_pull) = distinct (key, reader) pairs,
  shared_value = shared_grad = remote reads, move kinds match the move counters.

A *stale read* is one (key, reader) pair that computes with a value other than the latest. Structural violations
are collected in `errors` (and raised at once with `strict=True`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import numpy as np

from herald_torchrec.schedule.directory import guest_capacity, home_blocks
from herald_torchrec.schedule.global_batch import GlobalBatch, TableLayout
from herald_torchrec.schedule.plan import EVICT_HOME, FORWARD, MIGRATE, Plan, ReplicaSync


class CheckError(AssertionError):
    pass


@dataclass
class StepCheck:
    step: int
    stale_reads: int
    read_pairs: int
    errors: list[str] = field(default_factory=list)


class PlanChecker:
    def __init__(
        self,
        table_rows: Sequence[int] | TableLayout,
        num_ranks: int,
        batch_per_rank: int,
        cache_ratio: float = 0.1,
        strict: bool = False,
    ) -> None:
        self.layout = table_rows if isinstance(table_rows, TableLayout) else TableLayout(tuple(table_rows))
        self.R, self.B = int(num_ranks), int(batch_per_rank)
        self.strict = strict
        rows = np.array(self.layout.table_rows, dtype=np.int64)
        self.rows = rows
        self.cap = guest_capacity(self.layout.table_rows, cache_ratio)
        self.block = home_blocks(self.layout.table_rows, self.R)
        n = self.layout.total_rows
        self.tab_of = np.repeat(np.arange(rows.shape[0], dtype=np.int64), rows)
        self.home = (np.arange(n, dtype=np.int64) - self.layout.offsets[self.tab_of]) // self.block[self.tab_of]
        self.owner = self.home.copy()
        self.latest = np.zeros(n, dtype=np.int64)  # true number of updates (steps that read the row)
        self.held = np.zeros(n, dtype=np.int64)  # version of the owner's value (ownership plans)
        self.guests = np.zeros((self.R, rows.shape[0]), dtype=np.int64)
        # replica plans: version of the home copy and of the replicas (all ranks' replicas are identical)
        self.home_ver = np.zeros(n, dtype=np.int64)
        self.rep_ver = np.zeros(n, dtype=np.int64)
        self.steps = 0
        self.stale_reads = 0
        self.read_pairs = 0
        self.errors: list[str] = []
        self.mode: str | None = None

    # ------------------------------------------------------------------------------------------------------
    def _err(self, res: StepCheck, msg: str) -> None:
        msg = f"step {res.step}: {msg}"
        res.errors.append(msg)
        self.errors.append(msg)
        if self.strict:
            raise CheckError(msg)

    def _gid(self, table: np.ndarray, row: np.ndarray) -> np.ndarray:
        return self.layout.offsets[np.asarray(table, dtype=np.int64)] + np.asarray(row, dtype=np.int64)

    def check(self, plan: Plan, batch: GlobalBatch) -> StepCheck:
        res = StepCheck(step=self.steps, stale_reads=0, read_pairs=0)
        R, B = self.R, self.B
        # ---- assignment --------------------------------------------------------------------------------
        so = np.asarray(plan.sample_order)
        if plan.num_ranks != R or plan.batch_per_rank != B:
            self._err(res, f"plan is for {plan.num_ranks} x {plan.batch_per_rank}, checker for {R} x {B}")
        if so.dtype != np.int64 or so.shape != (R * B,):
            self._err(res, f"sample_order must be int64 [{R * B}], got {so.dtype} {so.shape}")
            return self._finish(res)
        if batch.num_samples != R * B:
            self._err(res, f"batch has {batch.num_samples} samples, expected {R * B}")
            return self._finish(res)
        if not np.array_equal(np.sort(so), np.arange(R * B)):
            self._err(res, "sample_order is not a permutation of the global batch")
            return self._finish(res)
        per_rank = so.reshape(R, B)
        if B > 1 and (np.diff(per_rank, axis=1) <= 0).any():
            self._err(res, "samples of a rank are not in increasing global order")
        rank_of = np.empty(R * B, dtype=np.int64)
        rank_of[so] = np.repeat(np.arange(R, dtype=np.int64), B)
        # ---- true reader sets (np.unique: independent of the policies' scatter tricks) -----------------------
        gids, ranks = [], []
        for t in range(self.layout.num_tables):
            cnt = np.diff(batch.offsets[t])
            smp = np.repeat(np.arange(R * B, dtype=np.int64), cnt)
            gids.append(batch.values[t] + self.layout.offsets[t])
            ranks.append(rank_of[smp])
        code = np.unique(np.concatenate(gids) * R + np.concatenate(ranks))
        pk, pr = code // R, code % R  # sorted by key, then rank
        keys, kstart, kcount = np.unique(pk, return_index=True, return_counts=True)
        res.read_pairs = int(code.shape[0])
        if plan.reads is None:  # ownership plans; plans that report their reads (replica policies) are replayed
            self._check_ownership(plan, res, pk, pr, keys, kstart, kcount)
        else:
            self._check_counting(plan, res, pk, pr)
        self.latest[keys] += 1
        self._check_counters(plan, res)
        return self._finish(res)

    def _finish(self, res: StepCheck) -> StepCheck:
        self.steps += 1
        self.stale_reads += res.stale_reads
        self.read_pairs += res.read_pairs
        return res

    # ------------------------------------------------------------------------------------------------------
    def _check_counting(self, plan: Plan, res: StepCheck, pk: np.ndarray, pr: np.ndarray) -> None:
        self._set_mode(res, "counting")
        rv = plan.reads
        if rv is None:
            self._err(res, "counting-only plan without `reads` (version of every read)")
            res.stale_reads += int(pk.shape[0])
            return
        g = self._gid(rv.table, rv.row)
        code = g * self.R + np.asarray(rv.rank, dtype=np.int64)
        order = np.argsort(code, kind="stable")
        code_s = code[order]
        true = pk * self.R + pr
        if code_s.shape != true.shape or not np.array_equal(code_s, true):
            self._err(
                res, f"reported reads ({code.shape[0]}) differ from the true (key, reader) pairs ({true.shape[0]})"
            )
            res.stale_reads += int(pk.shape[0])
            return
        ver = np.asarray(rv.version, dtype=np.int64)[order]
        if rv.replica is not None:
            self._replay_moves(plan, res, pk, pr, self.home_ver)  # Herald's replicas: its moves (fae / p2res: none)
            self._check_replicas(plan, res, pk, pr, np.asarray(rv.replica, dtype=bool)[order], ver)
            return
        res.stale_reads += int((ver != self.latest[pk]).sum())

    def _check_replicas(
        self, plan: Plan, res: StepCheck, pk: np.ndarray, pr: np.ndarray, rep: np.ndarray, reported: np.ndarray
    ) -> None:
        """Replay home copies and replicas (see the module docstring)."""
        rs = plan.replicas if plan.replicas is not None else ReplicaSync()
        declared = self._gid(rs.replicated_table, rs.replicated_row)
        self.rep_ver[declared] = self.home_ver[declared]  # a declared set is built from the owners' copies
        th = self._gid(rs.to_home_table, rs.to_home_row)
        self.home_ver[th] = self.rep_ver[th]
        tr = self._gid(rs.to_replicas_table, rs.to_replicas_row)
        self.rep_ver[tr] = self.home_ver[tr]
        ver = np.where(rep, self.rep_ver[pk], self.home_ver[pk])
        stale = ver != self.latest[pk]
        res.stale_reads += int(stale.sum())
        if (reported != ver).any():
            self._err(
                res,
                f"{int((reported != ver).sum())} reported versions differ from the replayed replica / home versions",
            )
        keys, kidx = np.unique(pk, return_inverse=True)
        n = np.bincount(kidx, minlength=keys.shape[0])
        n_rep = np.bincount(kidx, weights=rep, minlength=keys.shape[0]).astype(np.int64)
        fresh = np.bincount(kidx, weights=stale, minlength=keys.shape[0]) == 0
        mixed = (n_rep > 0) & (n_rep < n)
        if mixed.any():
            self._err(res, f"{int(mixed.sum())} rows are read through replicas and through home in one step")
        ar = self._gid(rs.allreduce_table, rs.allreduce_row)
        by_rep = n_rep == n
        in_ar = np.isin(keys, ar)
        lost = by_rep & ~in_ar
        if lost.any():
            self._err(res, f"{int(lost.sum())} rows read through replicas have no all-reduce of their gradients")
        remote_pair = pr != self.owner[pk]
        bad = self._check_owner_reads(plan, res, pk, pr, keys, kidx, ~by_rep & ~mixed, remote_pair)
        if plan.moves.row.shape[0]:
            moved = np.isin(keys, self._gid(plan.moves.table, plan.moves.row)) & by_rep
            if moved.any():
                self._err(res, f"{int(moved.sum())} rows read through replicas move in the same step")
        res.stale_reads += int(n[bad & fresh].sum())
        ok = fresh & ~mixed & ~bad
        rk, hk = by_rep & ~mixed, ~by_rep & ~mixed
        rep_new = np.where(ok[rk] & in_ar[rk], self.latest[keys[rk]] + 1, -1)
        self.rep_ver[keys[rk]] = rep_new
        # the owner applies the all-reduced gradient to its own copy too (distributed/step/replicas.py), so a row
        # leaves the set without a sync; the owner's copy is as fresh as the replicas
        self.home_ver[keys[rk]] = np.where(self.home_ver[keys[rk]] == self.latest[keys[rk]], rep_new, -1)
        self.home_ver[keys[hk]] = np.where(ok[hk], self.latest[keys[hk]] + 1, -1)
        self.home_ver[keys[mixed]] = self.rep_ver[keys[mixed]] = -1
        c = plan.counters
        want_ar = 2 * (self.R - 1) * int(ar.shape[0])
        if c.get("allreduce", 0) != want_ar:
            self._err(
                res, f"counter allreduce={c.get('allreduce', 0)}, expected 2 (R-1) x {ar.shape[0]} rows = {want_ar}"
            )
        remote = int((~rep & remote_pair).sum())
        if c.get("shared_value", 0) != remote or c.get("shared_grad", 0) != remote:
            self._err(
                res,
                f"shared_value/shared_grad {c.get('shared_value')}/{c.get('shared_grad')} != owner reads by "
                f"other ranks {remote}",
            )

    def _check_owner_reads(self, plan: Plan, res: StepCheck, pk, pr, keys, kidx, via_owner, remote_pair) -> np.ndarray:
        """Replica plans: the keys read through their owner by another rank are exactly `shared`, each with its
        true owner and reader set (a key read by its owner alone is exclusive); keys read through replicas are not
        in `shared`. Returns the keys (bool over `keys`) served wrongly."""
        R = self.R
        sh = plan.shared
        sg = self._gid(sh.table, sh.row)
        cnt = np.diff(np.asarray(sh.reader_offsets, dtype=np.int64))
        listed = np.repeat(sg, cnt) * R + np.asarray(sh.readers, dtype=np.int64)
        need = via_owner & (np.bincount(kidx, weights=remote_pair, minlength=keys.shape[0]) > 0)
        want = pk[need[kidx]] * R + pr[need[kidx]]
        wrong_owner = sg[np.asarray(sh.owner, dtype=np.int64) != self.owner[sg]]
        off = np.setxor1d(listed, want) // R
        bad = np.isin(keys, np.concatenate([off, wrong_owner]))
        if listed.shape[0] != np.unique(listed).shape[0]:
            self._err(res, "a shared key lists a reader twice")
        if bad.any() or (~np.isin(sg, keys)).any():
            self._err(
                res,
                f"{int(bad.sum())} keys are served wrongly by `shared` (missing, listed with other readers or "
                f"another owner, or read through replicas), {int((~np.isin(sg, keys)).sum())} shared keys not read",
            )
        return bad

    def _check_ownership(self, plan: Plan, res: StepCheck, pk, pr, keys, kstart, kcount) -> None:
        self._set_mode(res, "ownership")
        R = self.R
        self._replay_moves(plan, res, pk, pr, self.held)
        # ---- reads -----------------------------------------------------------------------------------------
        own = self.owner[keys]
        sh = plan.shared
        sg = self._gid(sh.table, sh.row)
        in_shared = np.isin(keys, sg)
        if sg.shape[0] and np.unique(sg).shape[0] != sg.shape[0]:
            self._err(res, "a key appears twice in shared")
        extra = ~np.isin(sg, keys)
        if extra.any():
            self._err(res, f"{int(extra.sum())} shared keys are not read in this step")
        # exclusive keys: reader set must be exactly {owner}
        first_reader = pr[kstart]
        excl_ok = (kcount == 1) & (first_reader == own)
        bad_excl = ~in_shared & ~excl_ok
        ok = np.ones(keys.shape[0], dtype=bool)
        if bad_excl.any():
            self._err(
                res,
                f"{int(bad_excl.sum())} keys not in shared are read by a rank that does not own them "
                "(exclusive keys must be owned by their single reader)",
            )
            ok &= ~bad_excl
        # shared keys: owner and reader set must match the truth
        if sg.shape[0]:
            pos = np.searchsorted(keys, sg)
            pos = np.clip(pos, 0, max(keys.shape[0] - 1, 0))
            valid = ~extra
            so_own = np.asarray(sh.owner, dtype=np.int64)
            wrong_owner = valid & (so_own != self.owner[sg])
            if wrong_owner.any():
                self._err(res, f"{int(wrong_owner.sum())} shared keys name an owner that does not hold the row")
            cnt = np.diff(np.asarray(sh.reader_offsets, dtype=np.int64))
            rd = np.asarray(sh.readers, dtype=np.int64)
            listed = np.unique(np.repeat(sg, cnt) * R + rd)
            if listed.shape[0] != rd.shape[0]:
                self._err(res, "a shared key lists a reader twice")
            true_sh = np.isin(pk, sg[valid])
            true_codes = pk[true_sh] * R + pr[true_sh]
            if not np.array_equal(
                np.unique(np.repeat(sg[valid], cnt[valid]) * R + rd[np.repeat(valid, cnt)]), true_codes
            ):
                # mark keys whose reader list differs
                miss = ~np.isin(true_codes, listed)
                bad_keys = np.unique(pk[true_sh][miss])
                xtra = np.unique(np.repeat(sg, cnt)[~np.isin(np.repeat(sg, cnt) * R + rd, true_codes)])
                self._err(
                    res,
                    f"shared reader lists differ from the true reader sets ({bad_keys.shape[0]} keys "
                    f"miss readers, {xtra.shape[0]} list extra readers)",
                )
                ok &= ~np.isin(keys, np.concatenate([bad_keys, xtra]))
            ok &= ~np.isin(keys, sg[wrong_owner])
        # values: the owner's copy must be the latest; a broken key loses gradients from now on
        fresh = self.held[keys] == self.latest[keys]
        res.stale_reads += int((kcount * (~fresh | ~ok)).sum())
        self.held[keys] = np.where(fresh & ok, self.latest[keys] + 1, -1)

    def _replay_moves(self, plan: Plan, res: StepCheck, pk, pr, copy_version: np.ndarray) -> None:
        """Apply the plan's row moves to the checker's owners and guest counts, checking each (module docstring); a
        move that does not start at the owner invalidates the copy it carries (`copy_version` := -1)."""
        R = self.R
        mv = plan.moves
        if len(mv):
            g = self._gid(mv.table, mv.row)
            src, dst, kind = (
                np.asarray(mv.src, dtype=np.int64),
                np.asarray(mv.dst, dtype=np.int64),
                np.asarray(mv.kind),
            )
            if np.unique(g).shape[0] != g.shape[0]:
                self._err(res, "a row moves more than once in one step")
            bad = src != self.owner[g]
            if bad.any():
                i = int(np.flatnonzero(bad)[0])
                self._err(
                    res,
                    f"{int(bad.sum())} moves do not start at the row's owner (e.g. table "
                    f"{int(mv.table[i])} row {int(mv.row[i])}: src {int(src[i])}, owner {int(self.owner[g[i]])})",
                )
                copy_version[g[bad]] = -1  # the destination receives a copy that is not the authoritative one
            if ((dst < 0) | (dst >= R)).any():
                self._err(res, "move destination out of range")
                dst = np.clip(dst, 0, R - 1)
            if (src == dst).any():
                self._err(res, "move with src == dst")
            eh = kind == EVICT_HOME
            if (dst[eh] != self.home[g[eh]]).any():
                self._err(res, "EVICT_HOME to a rank that is not the row's home")
            mi = kind == MIGRATE
            if mi.any():
                is_reader = np.isin(g[mi] * R + dst[mi], pk * R + pr)
                if not is_reader.all():
                    self._err(res, f"{int((~is_reader).sum())} MIGRATE moves go to a rank that does not read the row")
            if (~np.isin(kind, (MIGRATE, EVICT_HOME, FORWARD))).any():
                self._err(res, "unknown move kind")
            # simultaneous: every row leaves, then arrives
            t = self.tab_of[g]
            leave = self.owner[g] != self.home[g]
            np.add.at(self.guests, (self.owner[g][leave], t[leave]), -1)
            arrive = dst != self.home[g]
            np.add.at(self.guests, (dst[arrive], t[arrive]), 1)
            self.owner[g] = dst
            over = self.guests > self.cap[None, :]
            if over.any():
                r, tt = np.argwhere(over)[0]
                self._err(res, f"rank {r} holds {self.guests[r, tt]} guests of table {tt} > capacity {self.cap[tt]}")

    def _set_mode(self, res: StepCheck, mode: str) -> None:
        if self.mode is None:
            self.mode = mode
        elif self.mode != mode:
            self._err(res, f"plan switched from {self.mode} to {mode} plans")

    def _check_counters(self, plan: Plan, res: StepCheck) -> None:
        c = plan.counters
        if any(int(v) < 0 for v in c.values()):
            self._err(res, f"negative counter in {c}")
        if plan.read_pairs() != res.read_pairs:
            self._err(
                res, f"counters serve {plan.read_pairs()} reads, the step has {res.read_pairs} (key, reader) pairs"
            )
        if plan.executable and "shared_value" in c:  # ownership and replica plans (cache plans count pulls)
            remote = plan.shared.remote_reads()
            if c.get("shared_value", 0) != remote or c.get("shared_grad", 0) != remote:
                self._err(
                    res,
                    f"shared_value/shared_grad {c.get('shared_value')}/{c.get('shared_grad')} != remote reads {remote}",
                )
            kinds = np.asarray(plan.moves.kind)
            for k, name in ((MIGRATE, "migrate"), (EVICT_HOME, "evict_home"), (FORWARD, "forward")):
                if int((kinds == k).sum()) != c.get(name, 0):
                    self._err(res, f"counter {name}={c.get(name, 0)} but {int((kinds == k).sum())} such moves")

    def summary(self) -> dict:
        return {
            "steps": self.steps,
            "stale_reads": self.stale_reads,
            "read_pairs": self.read_pairs,
            "errors": len(self.errors),
        }
