"""Backlog autoscaling decisions, in the manner of KEDA's Kafka scaler (pure logic: no I/O).

lag = sum over the group's partitions of (end offset - committed offset)
desired = ceil(lag / target lag per replica), at least `min_replicas`, at most
          min(`max_replicas`, partitions, GPUs that can be had);
from zero only when lag > activation lag;
scale out to the LOWEST recommendation of the scale-out window, scale in to the HIGHEST of
the scale-in window (the HPA's stabilization), so a brief dip never shrinks the pool and a
brief spike only grows it once the window agrees.
A failed lag query is not a lag of zero: the size stays and the decision says why, and
scale-in then waits for a whole window of measurements again.

Lag alone cannot hold a steady load: a pool that keeps up has almost no lag, so the lag
asks for the minimum, the pool shrinks after the window, the lag builds up again and the
pool grows: it flaps with a period of about one scale-in window. So scale-in also keeps
the replicas the work needs now: `busy` (the pool's engine-seconds per second, i.e. how
many replicas' worth of engine time the current load uses) over `busy_target` (the
utilization one replica may run at). It only holds replicas; scale-out stays lag-driven,
so noise in `busy` never grows the pool.
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
    # A replica counts as needed while the load keeps its engine busy more than this
    # share of the time. 0.8: the HPA's usual utilization targets are 0.5-0.8; the high
    # end, because the lag term grows the pool again whenever it falls short, and 20% of
    # headroom absorbs the noise of a measurement over a few engine calls.
    busy_target: float = 0.8


@dataclass(frozen=True)
class Decision:
    time: float
    current: int
    desired: int
    lag: int | None
    recommendation: int | None
    reason: str
    # Replicas the engines' load needs (ceil(busy / busy_target)); None when not measured.
    needed: int | None = None

    @property
    def changes(self) -> bool:
        return self.desired != self.current


@dataclass
class Autoscaler:
    policy: Policy
    _history: deque[tuple[float, int, int]] = field(default_factory=deque)  # (t, rec, hold)
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
        busy: float | None = None,
    ) -> Decision:
        """The size the pool should have now; `lag=None` when the query failed.

        `busy`: replicas' worth of engine time the load uses now (engine-seconds per
        second over the pool); it holds replicas against scale-in (see the module doc)."""
        p = self.policy
        if lag is None:
            return self._unknown(now, current, error)
        rec, why = self.recommend(lag, partitions, gpus)
        if current == 0 and lag <= p.activation_lag and p.min_replicas == 0:
            rec, why = 0, f"lag {lag} <= activation {p.activation_lag}: stay inactive"
        cap = max(0, min(p.max_replicas, partitions, gpus))
        hold, needed, why = self._hold(rec, busy, cap, why)
        out_window, in_window = self._remember(now, rec, hold)
        desired, reason = self._windowed(now, current, rec, hold, out_window, in_window, why)
        # The floor and the cap hold even against the windows.
        floor = min(p.min_replicas, cap)
        if desired > cap:
            desired, reason = cap, f"scale in {current} -> {cap}: above the cap ({why})"
        elif desired < floor:
            desired, reason = floor, f"scale out {current} -> {floor}: below min_replicas"
        return Decision(now, current, desired, lag, rec, reason, needed)

    def _unknown(self, now: float, current: int, error: str) -> Decision:
        # Nothing is known about the time without a measurement: after it, scale-in
        # waits for a whole window of measurements again.
        self._since = None
        self._history.clear()
        return Decision(
            now,
            current,
            current,
            None,
            None,
            f"keep {current}: lag unknown "
            f"({error or 'query failed'}); a failed query is not a lag of zero",
        )

    def _hold(
        self, rec: int, busy: float | None, cap: int, why: str
    ) -> tuple[int, int | None, str]:
        """What scale-in may go down to: the lag's recommendation, or the replicas the
        engines' load needs, whichever is higher; and that need (None without `busy`)."""
        p = self.policy
        if busy is None:
            return rec, None, why
        needed = min(cap, math.ceil(busy / p.busy_target - 1e-9)) if busy > 0 else 0
        if needed <= rec:
            return rec, needed, why
        why += (
            f"; engines busy {busy:.2f} replicas' worth / target {p.busy_target:g} -> hold {needed}"
        )
        return needed, needed, why

    def _remember(self, now: float, rec: int, hold: int) -> tuple[list[int], list[int]]:
        """Record this measurement; the recommendations within the scale-out window and the
        holds within the scale-in window."""
        p = self.policy
        if self._since is None:
            self._since = now
        self._history.append((now, rec, hold))
        horizon = max(p.scale_out_window_s, p.scale_in_window_s)
        while self._history and self._history[0][0] < now - horizon:
            self._history.popleft()
        out_window = [r for t, r, _ in self._history if t >= now - p.scale_out_window_s]
        in_window = [h for t, _, h in self._history if t >= now - p.scale_in_window_s]
        return out_window, in_window

    def _windowed(
        self,
        now: float,
        current: int,
        rec: int,
        hold: int,
        out_window: list[int],
        in_window: list[int],
        why: str,
    ) -> tuple[int, str]:
        """Scale out to the lowest recommendation of the scale-out window, in to the highest
        hold of a full scale-in window; else keep."""
        p = self.policy
        since = now if self._since is None else self._since
        if rec > current:
            desired = max(current, min(out_window or [rec]))
            if desired > current:
                return desired, f"scale out {current} -> {desired}: {why}"
            return current, f"keep {current}: {why}; waiting out the scale-out window"
        if hold >= current:
            return current, f"keep {current}: {why}"
        if now - since < p.scale_in_window_s:
            return current, f"keep {current}: {why}; not yet a full scale-in window of history"
        desired = min(current, max(in_window or [hold]))
        if desired < current:
            return desired, f"scale in {current} -> {desired}: {why}"
        return current, (
            f"keep {current}: {why}; scale-in window {p.scale_in_window_s:.0f}s not yet calm"
        )
