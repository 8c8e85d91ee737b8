"""Cheapest replicas for a stage order, scored on replica classes.

The path construction (:mod:`scheduler.paths`) scores, for every microbatch it places, each
allowed stage order by the cheapest route through that order's stage replicas: a layered
shortest path on round-trip cost, where a route from data node ``d`` through replicas
``y1, ..., yk`` costs ``W[d, y1] + nw[y1] + W[y1, y2] + nw[y2] + ... + nw[yk] + W[yk, d]``
(``W``: hop time both ways; ``nw``: a replica's work plus the load already placed on it).

Replicas of a stage that no hop can tell apart (equal round-trip time to every node of the other
stages; with profile costs, the replicas in one location) form a *class*. A layered step
``min_x c[x] + W[x, y]`` then only needs each class's smallest ``c``, and the step's result is the
same for every replica ``y`` of one class but for its own ``nw[y]``. Rounding is monotone
(``a <= b`` implies ``fl(a + w) <= fl(b + w)``), so the minimum over a class is the class's
smallest ``nw`` added once: the whole programme runs on per-class vectors, and gives every order
the cost the replica-by-replica programme gives it, bit for bit. At 1,000 nodes that is 12
classes against 150 replicas a stage.

:meth:`StageOrders.costs` scores every allowed order at once (orders sharing a prefix share its
layers, each layer one array operation over all prefixes of its length);
:meth:`StageOrders.best_route` recovers the replicas of one order, choosing among equal costs
the replica the replica-by-replica programme chooses (the first in stage order at each step).
Pure numpy, no state between calls.
"""

from __future__ import annotations

import math
from typing import Sequence

import numpy as np

__all__ = ["StageOrders"]


class StageOrders:
    """Scoring of the stage orders ``seqs`` (tuples of non-zero stages, all of one length) over
    ``stages`` (node ids per stage, stage 0 the data nodes) with round-trip hop times ``W`` (a
    symmetric node x node array)."""

    def __init__(self, stages: Sequence[Sequence[int]], W: np.ndarray, seqs: Sequence[tuple[int, ...]]):
        self.W = W
        self.S = S = len(stages)
        self.R = [np.asarray(s, dtype=int) for s in stages]
        self.seqs = list(seqs)
        self.depth = len(self.seqs[0]) if self.seqs else 0
        #: per non-zero stage: each replica's class (classes numbered 0.. in np.unique's order),
        #: the replicas sorted by class (stable) and where each class starts in that order
        self.inv: dict[int, np.ndarray] = {}
        self.order: dict[int, np.ndarray] = {}
        self.start: dict[int, np.ndarray] = {}
        reps: dict[int, np.ndarray] = {}  # the first replica of each class
        for a in range(1, S):
            others = np.asarray([v for t, nodes in enumerate(stages) if t != a for v in nodes], dtype=int)
            _, inverse = np.unique(W[np.ix_(self.R[a], others)], axis=0, return_inverse=True)
            inverse = np.asarray(inverse).reshape(-1)
            order = np.argsort(inverse, kind="stable")
            self.inv[a] = inverse
            self.order[a] = order
            self.start[a] = np.flatnonzero(np.r_[True, np.diff(inverse[order]) != 0])
            reps[a] = self.R[a][order[self.start[a]]]
        self.K = K = max((len(r) for r in reps.values()), default=1)
        #: padded per-stage class arrays (S x K; stage 0 and the pads are infinite)
        self._reps = np.zeros((S, K), dtype=int)
        self._pad = np.ones((S, K), dtype=bool)
        for a, r in reps.items():
            self._reps[a, : len(r)] = r
            self._pad[a, : len(r)] = False
        #: class-to-class hop times ``Wc[a, b, k, k']`` (infinite where a or b is 0, a == b, or a pad)
        self.Wc = np.full((S, S, K, K), np.inf)
        for a in reps:
            for b in reps:
                if a != b:
                    self.Wc[a, b, : len(reps[a]), : len(reps[b])] = W[np.ix_(reps[a], reps[b])]
        # every stage's replicas, class by class, for one reduceat giving all class minima of nw
        flat, starts, pos, off = [], [], [], 0
        for a in range(1, S):
            flat.append(self.R[a][self.order[a]])
            starts.append(self.start[a] + off)
            pos.append(a * K + np.arange(len(reps[a])))
            off += len(self.R[a])
        self._flat = np.concatenate(flat) if flat else np.zeros(0, dtype=int)
        self._starts = np.concatenate(starts) if starts else np.zeros(0, dtype=int)
        self._pos = np.concatenate(pos) if pos else np.zeros(0, dtype=int)
        # the orders' prefix tree: per depth, each distinct prefix's parent (one shorter) and stages
        self._levels: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []  # (parent index, last-but-one, last)
        index: list[dict[tuple[int, ...], int]] = []
        for depth in range(1, self.depth + 1):
            ids: dict[tuple[int, ...], int] = {}
            for q in self.seqs:
                ids.setdefault(q[:depth], len(ids))
            prefixes = list(ids)
            parent = [index[-1][p[:-1]] if depth > 1 else 0 for p in prefixes]
            prev = [p[-2] if depth > 1 else 0 for p in prefixes]
            self._levels.append((np.asarray(parent, dtype=int), np.asarray(prev, dtype=int),
                                 np.asarray([p[-1] for p in prefixes], dtype=int)))
            index.append(ids)
        self._seq_row = np.asarray([index[-1][q] for q in self.seqs], dtype=int) if self.depth else None
        self._last = np.asarray([q[-1] for q in self.seqs], dtype=int) if self.depth else None
        self._ends: dict[int, tuple[np.ndarray, np.ndarray]] = {}

    def _end_hops(self, d: int) -> tuple[np.ndarray, np.ndarray]:
        """``W[d, class]`` and ``W[class, d]`` per stage and class (S x K, pads infinite)."""
        got = self._ends.get(d)
        if got is None:
            out = np.where(self._pad, np.inf, self.W[d, self._reps])
            back = np.where(self._pad, np.inf, self.W[self._reps, d])
            got = self._ends[d] = (out, back)
        return got

    def class_min(self, nw: np.ndarray) -> np.ndarray:
        """The smallest ``nw`` of each class, S x K (pads and stage 0 infinite)."""
        out = np.full(self.S * self.K, np.inf)
        if len(self._flat):
            out[self._pos] = np.minimum.reduceat(nw[self._flat], self._starts)
        return out.reshape(self.S, self.K)

    def costs(self, d: int, nw: np.ndarray) -> list[float]:
        """For every order of ``seqs`` (in its order), the cost of its cheapest route from data
        node ``d`` and back, replica costs ``nw`` (infinite: the replica is unusable)."""
        if not self.depth:
            return [0.0] * len(self.seqs)
        out_hop, back_hop = self._end_hops(d)
        m = self.class_min(nw)
        P = None
        for parent, prev, last in self._levels:
            if P is None:
                P = out_hop[last] + m[last]
            else:
                P = (P[parent][:, :, None] + self.Wc[prev, last]).min(axis=1) + m[last]
        return (P[self._seq_row] + back_hop[self._last]).min(axis=1).tolist()

    def best_route(self, d: int, seq: tuple[int, ...], nw: np.ndarray) -> tuple[float, tuple[int, ...]]:
        """Cost and replicas of the cheapest route through ``seq`` from data node ``d``: among
        equal costs, at each step back from the end the first replica in stage order."""
        if not seq:
            return 0.0, (d,)
        R, W = self.R, self.W
        c = W[d, R[seq[0]]] + nw[R[seq[0]]]
        layers = [c]
        for a, b in zip(seq, seq[1:]):
            P = np.minimum.reduceat(c[self.order[a]], self.start[a])  # per class of a
            ka, kb = len(self.start[a]), len(self.start[b])
            G = (P[:, None] + self.Wc[a, b, :ka, :kb]).min(axis=0)  # per class of b
            c = G[self.inv[b]] + nw[R[b]]
            layers.append(c)
        final = c + W[R[seq[-1]], d]
        i = int(final.argmin())
        best = float(final[i])
        if not math.isfinite(best):
            return math.inf, ()
        idx = [i]
        for k in range(len(seq) - 2, -1, -1):
            y = R[seq[k + 1]][idx[-1]]
            idx.append(int((layers[k] + W[R[seq[k]], y]).argmin()))
        idx.reverse()
        return best, (d,) + tuple(int(R[s][k]) for s, k in zip(seq, idx))
