"""A small max-flow (Dinic) used to find the optimal fractional spread of send load over source replicas."""

from __future__ import annotations

from collections import deque


class FlowGraph:
    """A directed graph with capacities; ``max_flow`` runs Dinic's algorithm."""

    def __init__(self, nodes: int):
        self.n = nodes
        self.head: list[list[int]] = [[] for _ in range(nodes)]
        self.to: list[int] = []
        self.cap: list[float] = []

    def add_edge(self, u: int, v: int, cap: float) -> int:
        """Add u->v with ``cap`` (and its residual twin); returns the edge id."""
        self.head[u].append(len(self.to))
        self.to.append(v)
        self.cap.append(cap)
        self.head[v].append(len(self.to))
        self.to.append(u)
        self.cap.append(0.0)
        return len(self.to) - 2

    def flow_on(self, edge: int) -> float:
        """Flow pushed through ``edge`` (the residual capacity of its twin)."""
        return self.cap[edge ^ 1]

    def max_flow(self, s: int, t: int, eps: float = 1e-9) -> float:
        total = 0.0
        to, cap, head = self.to, self.cap, self.head
        while True:
            level = [-1] * self.n
            level[s] = 0
            q = deque([s])
            while q:
                u = q.popleft()
                for e in head[u]:
                    if cap[e] > eps and level[to[e]] < 0:
                        level[to[e]] = level[u] + 1
                        q.append(to[e])
            if level[t] < 0:
                return total
            it = [0] * self.n

            def push(u: int, f: float) -> float:
                if u == t:
                    return f
                edges = head[u]
                while it[u] < len(edges):
                    e = edges[it[u]]
                    v = to[e]
                    if cap[e] > eps and level[v] == level[u] + 1:
                        got = push(v, min(f, cap[e]))
                        if got > eps:
                            cap[e] -= got
                            cap[e ^ 1] += got
                            return got
                    it[u] += 1
                return 0.0

            while True:
                f = push(s, float("inf"))
                if f <= eps:
                    break
                total += f
