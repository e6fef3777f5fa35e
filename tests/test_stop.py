"""Stop strings over streamed text: never emit any part of a stop string."""

from __future__ import annotations

import random

import pytest

from localllm.chat.stop import StopMatcher


def stream(stops, pieces):
    """Feed pieces; return (all emitted text, stopped, emitted-per-feed list)."""
    m = StopMatcher(stops)
    out, per_feed, stopped = [], [], False
    for p in pieces:
        text, stopped = m.feed(p)
        out.append(text)
        per_feed.append(text)
        if stopped:
            break
    if not stopped:
        out.append(m.flush())
    return "".join(out), stopped, per_feed


def reference(stops, text):
    """What the full text should be cut to: before the earliest occurrence of any stop string."""
    hits = [text.find(s) for s in stops if s and s in text]
    return (text[:min(hits)], True) if hits else (text, False)


def test_no_stops_is_passthrough():
    m = StopMatcher([])
    assert m.feed("<|im_end|>") == ("<|im_end|>", False)
    assert m.feed("abc") == ("abc", False)
    assert m.flush() == ""
    assert StopMatcher(None).feed("x") == ("x", False)
    assert StopMatcher([""]).feed("x") == ("x", False)  # empty stop strings are ignored


def test_stop_split_across_many_small_feeds():
    m = StopMatcher(["<|im_end|>"])
    assert m.feed("Hello") == ("Hello", False)
    assert m.feed(" <") == (" ", False)  # "<" could start the stop string: held
    assert m.feed("|im") == ("", False)
    assert m.feed("_e") == ("", False)
    assert m.feed("nd") == ("", False)
    assert m.feed("|") == ("", False)
    assert m.feed(">trailing") == ("", True)
    assert m.stopped and m.matched == "<|im_end|>"
    assert m.feed("more") == ("", True)
    assert m.flush() == ""


def test_false_alarm_is_released():
    m = StopMatcher(["<|im_end|>"])
    assert m.feed("a <|im") == ("a ", False)
    assert m.feed("x") == ("<|imx", False)
    assert m.feed("<|") == ("", False)
    assert m.flush() == "<|"


def test_character_by_character():
    text = "The answer is 4.\n\nUser: what?"
    out, stopped, per_feed = stream(["\nUser:"], list(text))
    assert (out, stopped) == ("The answer is 4.\n", True)
    assert all("U" not in p for p in per_feed)


def test_overlapping_prefixes():
    # "abcabd": after "abcab" the held tail must restart at the second "ab"
    out, stopped, _ = stream(["abcabd"], ["xxabcab", "cabd", "yy"])
    assert (out, stopped) == ("xxabc", True)
    out, stopped, _ = stream(["aab"], list("aaaab"))
    assert (out, stopped) == ("aa", True)
    out, stopped, _ = stream(["aab"], list("aaaa"))
    assert (out, stopped) == ("aaaa", False)


def test_multiple_stops_earliest_wins():
    out, stopped, _ = stream(["END", "STOP"], ["text STO", "P and END"])
    assert (out, stopped) == ("text ", True)
    m = StopMatcher(["END", "STOP"])
    assert m.feed("a END b STOP") == ("a ", True)
    assert m.matched == "END"
    # one stop is a prefix of another: same start -> the text before it is the same either way
    m = StopMatcher(["</s>", "</s"])
    assert m.feed("ok</s>") == ("ok", True)
    # a shorter stop inside a longer candidate ends the text as soon as it is complete
    out, stopped, _ = stream(["<|im_end|>", "im"], ["<|", "im_"])
    assert (out, stopped) == ("<|", True)


def test_stop_at_very_start_and_exact_piece():
    assert StopMatcher(["###"]).feed("###") == ("", True)
    assert stream(["###"], ["#", "#", "#", "tail"])[:2] == ("", True)


def test_unicode():
    stops = ["。\n", "🛑"]
    out, stopped, _ = stream(stops, ["こんにちは", "。", "\n次"])
    assert (out, stopped) == ("こんにちは", True)
    out, stopped, _ = stream(stops, ["émoji ", "🛑", " after"])
    assert (out, stopped) == ("émoji ", True)
    out, stopped, _ = stream(stops, ["ça va。", "ok"])
    assert (out, stopped) == ("ça va。ok", False)


def test_held_text_never_exceeds_longest_stop():
    m = StopMatcher(["<|endoftext|>"])
    emitted = ""
    for ch in "<<<<<<<<<<<<<<<<<<<<<<<<<<<<":
        emitted += m.feed(ch)[0]
    assert len(m._held) <= len("<|endoftext|>") - 1
    assert emitted + m.flush() == "<" * 28


@pytest.mark.parametrize("seed", range(30))
def test_random_streams_match_reference(seed):
    rng = random.Random(seed)
    alphabet = "ab<|>"
    stops = ["".join(rng.choice(alphabet) for _ in range(rng.randint(1, 5))) for _ in range(rng.randint(1, 3))]
    text = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 60)))
    cuts = sorted(rng.sample(range(len(text) + 1), min(len(text) + 1, rng.randint(0, 12))))
    pieces = [text[i:j] for i, j in zip([0] + cuts, cuts + [len(text)])]
    out, stopped, per_feed = stream(stops, pieces)
    assert (out, stopped) == reference(stops, text), (stops, pieces)
    # nothing emitted before the stop is part of a stop string's occurrence in the text
    if stopped:
        assert "".join(per_feed) == out


def test_reset():
    m = StopMatcher(["X"])
    assert m.feed("aXb") == ("a", True)
    m.reset()
    assert m.feed("cd") == ("cd", False)
