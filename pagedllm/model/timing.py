"""Wall time per named part of a step, for `pagedllm bench latency`. Whoever runs a part names it: a `with
timer.part(name)` block, or a function taken through `timer.timed` once. Off (NO_TIMER), a part is a shared no-op
context and `timed` gives the function back, so the hot path carries nothing else."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterable
from typing import Any, TypeVar

F = TypeVar("F", bound=Callable[..., Any])


class PartTimer:
    """Exclusive times: a part inside another counts only for itself (the outer part gets what its inner parts
    leave), except inside an opaque part, which takes everything it runs along (e.g. the lm_head's matmul in
    "logits")."""

    def __init__(self, parts: Iterable[str]) -> None:
        self.seconds: dict[str, float] = dict.fromkeys(parts, 0.0)
        self.calls: dict[str, int] = dict.fromkeys(self.seconds, 0)
        self._nested: list[float] = []  # per open part: seconds spent in parts inside it
        self._opaque = 0  # > 0 inside an opaque part: parts there are not counted

    def part(self, name: str, opaque: bool = False) -> contextlib.AbstractContextManager[None]:
        return _Part(self, name, opaque)

    def timed(self, name: str, fn: F, opaque: bool = False) -> F:
        """`fn`, its calls counted as the part `name`."""

        def timed(*args: Any, **kwargs: Any) -> Any:
            with _Part(self, name, opaque):
                return fn(*args, **kwargs)

        return timed  # type: ignore[return-value]


class _Part:
    __slots__ = ("timer", "name", "opaque", "counted", "start")

    def __init__(self, timer: PartTimer, name: str, opaque: bool) -> None:
        self.timer, self.name, self.opaque = timer, name, opaque

    def __enter__(self) -> None:
        t = self.timer
        self.counted = not t._opaque
        t._opaque += self.opaque
        if self.counted:
            t._nested.append(0.0)
            self.start = time.perf_counter()

    def __exit__(self, *exc: object) -> None:
        t = self.timer
        t._opaque -= self.opaque
        if not self.counted:
            return
        elapsed = time.perf_counter() - self.start
        t.seconds[self.name] += elapsed - t._nested.pop()
        t.calls[self.name] += 1
        if t._nested:
            t._nested[-1] += elapsed


class _NoTimer(PartTimer):
    """Timing off: nothing is measured, nothing is wrapped."""

    _none = contextlib.nullcontext()

    def __init__(self) -> None:
        super().__init__(())

    def part(self, name: str, opaque: bool = False) -> contextlib.AbstractContextManager[None]:
        return self._none

    def timed(self, name: str, fn: F, opaque: bool = False) -> F:
        return fn


NO_TIMER: PartTimer = _NoTimer()
