"""The decode's one generation loop: every running request advances one step per iteration.

A step is one token (or, for a speculative request, one draft + verify round), so a long
request never holds up a short one by more than one step of each other request (continuous
batching, one request after another inside an iteration: batched matmuls would change the
toy model's bits). The loop is the only thread that runs the decode model and writes
generated KV, so when it drops a request (finished, cancelled or failed) no write into that
request's pages can follow: it frees them there, exactly once.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from .model import SpecDecoder
from .sampling import Sampling, sample, top_logprobs

log = logging.getLogger(__name__)


@dataclass(eq=False)
class Generation:
    """One request from its first token to its end."""

    room: int
    prompt: list[int]
    first: int
    max_tokens: int
    sampling: Sampling
    pages: list[int]
    emit: Callable[[dict[str, Any]], None]
    """Called from the loop thread with each event (token ids, then the end)."""
    on_end: Callable[[Generation], None]
    """Called from the loop thread once the request is dropped: free its pages here."""
    spec_k: int = 0
    out: list[int] = field(default_factory=list)
    logprobs: list[dict[str, Any]] = field(default_factory=list)
    cancel: threading.Event = field(default_factory=threading.Event)
    finish_reason: str | None = None
    error: str | None = None
    spec: SpecDecoder | None = None
    added_step: int = 0
    first_step: int | None = None
    end_step: int | None = None


class Scheduler:
    """The loop thread (see the module notes). ``add`` hands it a request whose prompt KV is
    in place; ``close`` stops it and ends every request still running."""

    def __init__(self, host: Any, min_step_s: float = 0.0) -> None:
        self.host = host
        self.min_step_s = min_step_s
        """A floor on each iteration (an emulated slower model; 0: none)."""
        self.steps = 0
        self.running: list[Generation] = []
        self._new: list[Generation] = []
        self._cond = threading.Condition()
        self._stop = False
        self._thread = threading.Thread(target=self._loop, name="pdxfer-decode-loop", daemon=True)
        self._thread.start()

    def add(self, g: Generation) -> None:
        with self._cond:
            g.added_step = self.steps
            self._new.append(g)
            self._cond.notify()

    def wake(self) -> None:
        """Look at cancellations now (a cancelled request may be the only one running)."""
        with self._cond:
            self._cond.notify()

    def close(self) -> None:
        with self._cond:
            self._stop = True
            self._cond.notify()
        self._thread.join(10)

    @property
    def active(self) -> int:
        with self._cond:
            return len(self.running) + len(self._new)

    # -- the loop ------------------------------------------------------------------------------
    def _loop(self) -> None:
        while True:
            with self._cond:
                while not self._stop and not self.running and not self._new:
                    self._cond.wait()
                if self._stop:
                    pending = self.running + self._new
                    self.running, self._new = [], []
                    break
                for g in self._new:
                    self._start(g)
                self._new = []
                batch = list(self.running)
            t0 = time.monotonic()
            for g in batch:
                if g.cancel.is_set():
                    self._end(g, "cancelled")
                    continue
                try:
                    self._step(g)
                except Exception as e:  # noqa: BLE001 - one request's failure ends only it
                    log.exception("generation of room %d failed", g.room)
                    g.error = f"{type(e).__name__}: {e}"
                    self._end(g, "error")
            self.steps += 1
            if self.min_step_s:
                time.sleep(max(0.0, t0 + self.min_step_s - time.monotonic()))
        for g in pending:
            g.error = "decode worker stopping"
            self._end(g, "error")

    def _start(self, g: Generation) -> None:
        """The first token came from the prefill: emit it (or stop at once on EOS)."""
        if g.sampling.stops(g.first):
            g.finish_reason = "stop"
            self._finish(g)
            return
        self.running.append(g)
        g.out.append(g.first)
        g.emit({"token_ids": [g.first]})
        if g.spec_k:
            h = self.host
            g.spec = SpecDecoder(
                h.model, h.draft, g.prompt, g.first, h.kv, h.draft_kv, g.pages, g.spec_k
            )
        if len(g.out) >= g.max_tokens:
            g.finish_reason = "length"
            self._end(g, "length")

    def _step(self, g: Generation) -> None:
        if g.first_step is None:
            g.first_step = self.steps
        h, s = self.host, g.sampling
        if g.spec is not None:
            new = g.spec.step()
        else:
            pos = len(g.prompt) + len(g.out) - 1  # the newest token's position
            logits = h.model.forward([g.out[-1]], pos, g.pages, h.kv)[-1]
            t = sample(logits, s, pos + 1)
            new = [t]
            if s.logprobs is not None:
                g.logprobs.append(top_logprobs(logits, s, t))
        room = g.max_tokens - len(g.out)
        new = new[:room]
        stop = next((i for i, t in enumerate(new) if s.stops(t)), None)
        if stop is not None:
            new = new[:stop]
        if new:
            g.out += new
            ev: dict[str, Any] = {"token_ids": new}
            if s.logprobs is not None and g.spec is None:
                ev["logprobs"] = g.logprobs[-len(new) :]
            g.emit(ev)
        if stop is not None:
            self._end(g, "stop")
        elif len(g.out) >= g.max_tokens:
            self._end(g, "length")

    def _end(self, g: Generation, reason: str) -> None:
        if g in self.running:
            self.running.remove(g)
        g.finish_reason = g.finish_reason or reason
        self._finish(g)

    def _finish(self, g: Generation) -> None:
        g.end_step = self.steps
        try:
            g.on_end(g)
        except Exception:  # noqa: BLE001 - the end callback must not stop the loop
            log.exception("end of room %d failed", g.room)
