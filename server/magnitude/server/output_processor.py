"""Per-request output processing: token ids -> text deltas, stop strings, logprobs.

Runs in the engine-loop thread right after `update_from_output`, so a stop-string match calls
`scheduler.finish_request` before the next step is scheduled. Text that could still turn into a
stop string is held back until it cannot, so a client never sees part of a stop string.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from magnitude.engine.output import SampledToken


@dataclass(slots=True)
class TokenLogprob:
    token: str
    logprob: float
    bytes: list[int]
    top: list[tuple[str, float, list[int]]] = field(default_factory=list)


class StopMatcher:
    """Finds the earliest stop string in the generated text; holds back a possible stop prefix."""

    def __init__(self, stops: list[str]) -> None:
        self.stops = [s for s in stops if s]
        self.text = ""  # everything generated so far
        self.emitted = 0  # characters of `text` already handed out
        self.stopped = False

    def feed(self, delta: str) -> str:
        """Add decoded text; return what may be emitted now (stop string and beyond cut off)."""
        if self.stopped:
            return ""
        search_from = max(0, len(self.text) - max((len(s) for s in self.stops), default=0))
        self.text += delta
        cut = self._earliest_stop(search_from)
        if cut is not None:
            self.stopped = True
            out, self.emitted = self.text[self.emitted : cut], cut
            return out
        safe = len(self.text) - self._held_back()
        out = self.text[self.emitted : max(self.emitted, safe)]
        self.emitted = max(self.emitted, safe)
        return out

    def flush(self) -> str:
        """At the end of generation nothing can become a stop string any more."""
        if self.stopped:
            return ""
        out, self.emitted = self.text[self.emitted :], len(self.text)
        return out

    def _earliest_stop(self, start: int) -> int | None:
        hits = [i for s in self.stops if (i := self.text.find(s, start)) >= 0]
        return min(hits) if hits else None

    def _held_back(self) -> int:
        """Length of the longest suffix of `text` that is a proper prefix of some stop string."""
        best = 0
        for s in self.stops:
            for k in range(min(len(s) - 1, len(self.text)), best, -1):
                if self.text.endswith(s[:k]):
                    best = k
                    break
        return best


class OutputState:
    """Detokenizer + stop matcher + logprob formatting for one request."""

    def __init__(self, tokenizer: Any, detokenizer: Any, stops: list[str], want_logprobs: bool) -> None:
        self.tokenizer = tokenizer
        self.detok = detokenizer
        self.stop = StopMatcher(stops)
        self.want_logprobs = want_logprobs
        self.num_tokens = 0

    def push(self, token_ids: list[int], sampled: list[SampledToken] | None) -> tuple[str, list[TokenLogprob], bool]:
        """Returns (text to emit, logprobs of these tokens, whether a stop string matched)."""
        text = ""
        logprobs: list[TokenLogprob] = []
        for i, tid in enumerate(token_ids):
            if self.stop.stopped:
                break
            self.num_tokens += 1
            text += self.stop.feed(self.detok.push(tid))
            if self.want_logprobs:
                st = sampled[i] if sampled is not None and i < len(sampled) and sampled[i].token_id == tid else None
                logprobs.append(self._logprob(tid, st))
        return text, logprobs, self.stop.stopped

    def finish(self) -> str:
        tail = ""
        flush = getattr(self.detok, "flush", None)
        if flush is not None and not self.stop.stopped:
            tail = self.stop.feed(flush() or "")
        return tail + self.stop.flush()

    def _token_text(self, tid: int) -> tuple[str, list[int]]:
        text = self.tokenizer.decode([tid])
        return text, list(text.encode("utf-8", errors="replace"))

    def _logprob(self, tid: int, st: SampledToken | None) -> TokenLogprob:
        text, raw = self._token_text(tid)
        lp = st.logprob if st is not None and st.logprob is not None else 0.0
        top = []
        for alt_id, alt_lp in (st.top_logprobs or []) if st is not None else []:
            alt_text, alt_raw = self._token_text(alt_id)
            top.append((alt_text, alt_lp, alt_raw))
        return TokenLogprob(token=text, logprob=lp, bytes=raw, top=top)
