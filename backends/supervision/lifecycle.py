"""When a managed worker is restarted, given up on, retried and unloaded: the supervisor's
decisions, apart from its effects.

Owns the restart policy and the counts it decides from (`RestartPolicy`):

- a worker that was ready and then died or stopped answering is restarted, after a capped
  exponential backoff (reset once it stays ready for `stable_s`); it is not a failed start;
- a start that never became ready is a failed start, retried with the same backoff;
  `max_restarts` failed starts in a row make the backend `failed`;
- a worker that exits with `EXIT_LOAD_FAILED` while starting (bad model, bad settings) makes
  it `failed` at once, with the worker's last stderr lines as the reason;
- `failed` is not final: one new start every `retry_failed_s`, or sooner when a request asks
  for it and the last attempt began at least `retry_min_s` ago;

and when a ready worker is unloaded (`Usage`): once no request is in flight, after `ttl_s`
without one, or at once when the model pool asks. Pure: no task, no waiting, no clock of its
own (the supervisor passes the loop time in); the supervisor acts on what these decide.
"""

from __future__ import annotations

from dataclasses import dataclass

from prefixd.backends.config import BackendConfig


@dataclass(frozen=True)
class Idle:
    """The verdict when the worker should be unloaded (idle, or asked to); `reason` labels the
    unload metric: ttl, or what the model pool said (budget, group)."""

    why: str
    reason: str


class RestartPolicy:
    def __init__(self, config: BackendConfig, backoff_s: tuple[float, float], stable_s: float,
                 retry_min_s: float) -> None:
        self._cfg = config
        self._backoff, self._stable_s, self._retry_min_s = backoff_s, stable_s, retry_min_s
        self.setbacks = 0          # crashes soon after ready and failed starts in a row (a task's)
        self.consecutive = 0       # failed starts in a row
        self.restarts = 0
        self.retry_at: float | None = None     # loop time of a failed backend's next attempt
        self.retry_wanted = False              # a request asked a failed backend to retry
        self.last_attempt = float("-inf")      # loop time the latest start began

    def backoff(self) -> float:
        """The wait before the next start, after `setbacks` (> 0) setbacks."""
        return min(self._backoff[0] * 2 ** (self.setbacks - 1), self._backoff[1])

    def ran(self, seconds: float) -> None:
        """A ready worker ended (crashed, or stopped answering) after `seconds`."""
        self.setbacks = 1 if seconds >= self._stable_s else self.setbacks + 1

    def start_failed(self, error: str, load_failed: bool, retrying: bool) -> str | None:
        """A start never became ready (`retrying`: it was a failed backend's retry): why the
        backend is failed now, or None when it is started again."""
        self.consecutive += 1
        self.setbacks += 1
        if load_failed:
            return f"{error} (cannot load its model or settings: not restarted like a crash)"
        if retrying:
            return error
        if self.consecutive > self._cfg.max_restarts:
            return f"{error} (gave up after {self.consecutive} attempts)"
        return None

    def too_soon(self, now: float) -> bool:
        """Whether a retry a request asks for now comes too soon after the latest start."""
        return now - self.last_attempt < self._retry_min_s

    def schedule_retry(self, now: float) -> float:
        """The loop time of a failed backend's next scheduled start, from `now`."""
        self.retry_at = now + self._cfg.retry_failed_s
        return self.retry_at


class Usage:
    """Requests in flight and the last use of a worker, and an unload asked for."""

    def __init__(self) -> None:
        self.active = 0
        self.last_used = 0.0
        self.unload: tuple[str, str] | None = None     # asked for (memory budget): why, reason

    def idle(self, now: float, ttl_s: float | None) -> tuple[Idle | None, float | None]:
        """(the verdict to unload now, or None; the loop time the worker goes idle, if it
        can). An unload asked for is taken once no request is in flight."""
        if self.unload is not None and not self.active:
            (why, reason), self.unload = self.unload, None
            return Idle(why, reason), None
        idle_at = self.last_used + ttl_s if ttl_s is not None and not self.active else None
        if idle_at is not None and now >= idle_at:
            return Idle(f"idle for {ttl_s:g}s", "ttl"), idle_at
        return None, idle_at
