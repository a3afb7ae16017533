"""Location-aware input allocation: capacity-constrained assignment of samples to ranks (exactly B each).

`balanced_assign(score, B, first)` maximises sum(score[s, rank(s)]) approximately, deterministically and
vectorised: in rounds, every unassigned sample bids for its best rank among those with room; each rank accepts the
bids with the largest *regret* (best minus second-best score: what the sample loses if sent elsewhere), then the
highest score, then the lowest sample index. Every round fills at least one rank or assigns every sample, so there
are at most R rounds. Ties between ranks go to the first rank in the rotation first, first+1, ... (by batch id), so
that no rank is favoured across steps. numpy only.
"""

from __future__ import annotations

import numpy as np


def balanced_assign(score: np.ndarray, batch_per_rank: int, first: int = 0) -> np.ndarray:
    """Rank of every sample (int64 [N]); score is [N, R] (int or float), N must equal R * batch_per_rank."""
    N, R = score.shape
    if N != R * batch_per_rank:
        raise ValueError(f"balanced_assign: {N} samples cannot fill {R} ranks x {batch_per_rank}")
    rot = (np.arange(R, dtype=np.int64) + first) % R
    sc = np.asarray(score, dtype=np.float64)[:, rot]  # column j is rank rot[j]: argmax ties pick the rotation order
    room = np.full(R, batch_per_rank, dtype=np.int64)
    out = np.full(N, -1, dtype=np.int64)
    todo = np.arange(N, dtype=np.int64)
    neg = -np.inf
    while todo.shape[0]:
        open_ = room > 0
        if open_.sum() == 1:
            out[todo] = rot[np.flatnonzero(open_)[0]]
            break
        sub = sc[todo]
        sub[:, ~open_] = neg
        best = np.argmax(sub, axis=1)
        bval = sub[np.arange(todo.shape[0]), best]
        sub[np.arange(todo.shape[0]), best] = neg
        regret = bval - sub.max(axis=1)
        # group bids by rank; inside a rank: regret desc, score desc, sample asc
        order = np.lexsort((todo, -bval, -regret, best))
        b_sorted = best[order]
        start = np.searchsorted(b_sorted, np.arange(R))
        within = np.arange(order.shape[0]) - start[b_sorted]
        take = within < room[b_sorted]
        acc = order[take]
        out[todo[acc]] = rot[best[acc]]
        room -= np.bincount(best[acc], minlength=R)
        keep = np.ones(todo.shape[0], dtype=bool)
        keep[acc] = False
        todo = todo[keep]
    return out
