"""Stop strings are cut exactly and never leak partially, whatever the delta boundaries."""

from __future__ import annotations

import pytest

from magnitude.runner.detokenize import IncrementalDetokenizer
from magnitude.server.output_processor import OutputState, StopMatcher
from magnitude.server.simulated_runner import ByteTokenizer


@pytest.mark.parametrize(
    ("deltas", "stops", "emitted", "stopped"),
    [
        (["Hello", " wor", "ld"], ["world"], "Hello ", True),
        (["ab", "c##", "d"], ["##"], "abc", True),
        (["a#", "b"], ["##"], "a#b", False),
        (["x", "E", "N", "D", "y"], ["END"], "x", True),
        (["one two"], ["two", "one"], "", True),
        (["no stop here"], [], "no stop here", False),
        (["te", "st"], ["testing"], "test", False),  # held back, then flushed at the end
        (["é", "à"], ["à"], "é", True),
    ],
)
def test_stop_matcher(deltas: list[str], stops: list[str], emitted: str, stopped: bool) -> None:
    m = StopMatcher(stops)
    out = ""
    for d in deltas:
        part = m.feed(d)
        out += part
        for s in stops:  # never a stop string, nor text after one, on the wire
            assert s not in out
    out += m.flush()
    assert out == emitted
    assert m.stopped == stopped


def test_output_state_cuts_multibyte_text_exactly() -> None:
    tok = ByteTokenizer()
    state = OutputState(tok, IncrementalDetokenizer(tok), ["ß!"], want_logprobs=True)
    text = ""
    stopped = False
    for b in "grüße ßa ß! tail".encode():
        piece, lps, stopped = state.push([b], None)
        text += piece
        if stopped:
            break
    text += state.finish()
    assert stopped and text == "grüße ßa "
    assert "\ufffd" not in text
