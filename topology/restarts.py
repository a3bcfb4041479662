"""When the controller may start a failed replica again: at once the first time, then after
a pause that doubles with each failure in a row, up to a cap; the count resets once the
replica has served for a while. A replica that fails on every start (a batch it cannot
read, say) then costs one start per cap instead of a crash loop, and `dgstream status`
shows it failing meanwhile.

Plain Python on the controller's clock (tested with a fake one).
"""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["RestartBackoff"]


@dataclass
class RestartBackoff:
    initial_s: float
    max_s: float
    reset_after_s: float
    _failures: dict[int, int] = field(default_factory=dict)  # replica index -> in a row
    _ready_since: dict[int, float] = field(default_factory=dict)

    def delay(self, failures: int) -> float:
        """The pause before the restart that follows the `failures`-th failure in a row."""
        if failures <= 1:
            return 0.0
        return float(min(self.max_s, self.initial_s * 2 ** (failures - 2)))

    def failed(self, index: int, now: float) -> float:
        """Replica `index` is gone: count it; returns when it may start again."""
        n = self._failures.get(index, 0) + 1
        self._failures[index] = n
        self._ready_since.pop(index, None)
        return now + self.delay(n)

    def failures(self, index: int) -> int:
        return self._failures.get(index, 0)

    def ready(self, index: int, now: float) -> None:
        """Replica `index` reported serving; after `reset_after_s` of it in a row its
        failures are forgotten."""
        since = self._ready_since.setdefault(index, now)
        if now - since >= self.reset_after_s:
            self._failures.pop(index, None)

    def not_ready(self, index: int) -> None:
        self._ready_since.pop(index, None)

    def forget(self, index: int) -> None:
        """The replica was removed on purpose (scale-in)."""
        self._failures.pop(index, None)
        self._ready_since.pop(index, None)
