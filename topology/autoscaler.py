"""Backlog autoscaling decisions, in the manner of KEDA's Kafka scaler (pure logic: no I/O).

lag = sum over the group's partitions of (end offset - committed offset)
desired = ceil(lag / target lag per replica), at least `min_replicas`, at most
          min(`max_replicas`, partitions, GPUs that can be had);
from zero only when lag > activation lag;
scale out to the LOWEST recommendation of the scale-out window, scale in to the HIGHEST of
the scale-in window (the HPA's stabilization), so a brief dip never shrinks the pool and a
brief spike only grows it once the window agrees.
A failed lag query is not a lag of zero: the size stays and the decision says why.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Policy:
    min_replicas: int = 0
    max_replicas: int = 1
    target_lag_per_replica: int = 1000
    activation_lag: int = 0
    scale_out_window_s: float = 0.0
    scale_in_window_s: float = 300.0


@dataclass(frozen=True)
class Decision:
    time: float
    current: int
    desired: int
    lag: int | None
    recommendation: int | None
    reason: str

    @property
    def changes(self) -> bool:
        return self.desired != self.current


@dataclass
class Autoscaler:
    policy: Policy
    _history: deque[tuple[float, int]] = field(default_factory=deque)
    _since: float | None = None  # first decision: a window needs that much history

    def recommend(self, lag: int, partitions: int, gpus: int) -> tuple[int, str]:
        p = self.policy
        cap = max(0, min(p.max_replicas, partitions, gpus))
        raw = math.ceil(lag / p.target_lag_per_replica) if lag > 0 else 0
        want = max(p.min_replicas, raw)
        why = f"lag {lag} / target {p.target_lag_per_replica} -> {raw}"
        if want > cap:
            limit = min(
                ("max_replicas", p.max_replicas),
                ("partitions", partitions),
                ("gpus", gpus),
                key=lambda kv: kv[1],
            )
            why += f", capped at {cap} by {limit[0]}"
            want = cap
        return want, why

    def decide(
        self,
        now: float,
        current: int,
        lag: int | None,
        partitions: int,
        gpus: int,
        *,
        error: str = "",
    ) -> Decision:
        """The size the pool should have now; `lag=None` when the query failed."""
        p = self.policy
        if lag is None:
            return Decision(
                now,
                current,
                current,
                None,
                None,
                f"keep {current}: lag unknown "
                f"({error or 'query failed'}); a failed query is not a lag of zero",
            )
        rec, why = self.recommend(lag, partitions, gpus)
        if current == 0 and lag <= p.activation_lag and p.min_replicas == 0:
            rec, why = 0, f"lag {lag} <= activation {p.activation_lag}: stay inactive"
        if self._since is None:
            self._since = now
        self._history.append((now, rec))
        horizon = max(p.scale_out_window_s, p.scale_in_window_s)
        while self._history and self._history[0][0] < now - horizon:
            self._history.popleft()
        out_window = [r for t, r in self._history if t >= now - p.scale_out_window_s]
        in_window = [r for t, r in self._history if t >= now - p.scale_in_window_s]
        desired = current
        reason = f"keep {current}: {why}"
        if rec > current:
            desired = max(current, min(out_window or [rec]))
            if desired > current:
                reason = f"scale out {current} -> {desired}: {why}"
            else:
                reason = f"keep {current}: {why}; waiting out the scale-out window"
        elif rec < current and now - self._since < p.scale_in_window_s:
            reason = f"keep {current}: {why}; not yet a full scale-in window of history"
        elif rec < current:
            desired = min(current, max(in_window or [rec]))
            if desired < current:
                reason = f"scale in {current} -> {desired}: {why}"
            else:
                reason = (
                    f"keep {current}: {why}; scale-in window "
                    f"{p.scale_in_window_s:.0f}s not yet calm"
                )
        # The floor and the cap hold even against the windows.
        cap = max(0, min(p.max_replicas, partitions, gpus))
        floor = min(p.min_replicas, cap)
        if desired > cap:
            desired, reason = cap, f"scale in {current} -> {cap}: above the cap ({why})"
        elif desired < floor:
            desired, reason = floor, f"scale out {current} -> {floor}: below min_replicas"
        return Decision(now, current, desired, lag, rec, reason)
