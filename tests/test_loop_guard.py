"""The loop guard (localllm/chat/loop_guard.py) and the loop count behind the chat defaults."""

from __future__ import annotations

from localllm.chat.loop_guard import RepeatGuard, looped, max_repeats


def feed_all(g, text, step=3):
    return any(g.feed(text[i:i + step]) for i in range(0, len(text), step))


def test_a_line_over_and_over_trips_on_its_fourth_time():
    g = RepeatGuard()
    assert not feed_all(g, "The sea.\nA day to dream\nA day to dream\nA day to dream\n")
    assert g.feed("A day to dream\n") and g.unit == "A day to dream"


def test_sentences_within_a_line_count_before_the_line_ends():
    g = RepeatGuard()
    assert feed_all(g, "I love the ocean. " * 4 + "and still no newline")


def test_refrains_list_markers_and_short_lines():
    # a refrain three times is a song, not a loop; numbering does not hide a repeat; short lines never count
    assert not feed_all(RepeatGuard(), "Sing with me now\nverse one here\n" * 3)
    assert feed_all(RepeatGuard(), "".join(f"{i}. Walk every single day\n" for i in range(1, 6)))
    assert not feed_all(RepeatGuard(), "Yes.\n" * 50 + "}\n" * 50)


def test_code_repeats_lines_by_nature():
    code = "```python\n" + "print('hello world')\n" * 5 + "```\n"
    assert not feed_all(RepeatGuard(), code)
    assert feed_all(RepeatGuard(), "```\n" + "print('hello world')\n" * 8)


def test_the_measurements_loop_definition():
    assert looped("A day to dream\n" * 3, "stop")
    assert not looped("A day to dream\n" * 2, "stop")
    assert looped("Waves crash on rocks.\n" * 2, "length")
    assert max_repeats("") == 0


def test_run_chat_stops_a_real_loop_with_a_notice():
    """gemma3-270m is a base model: asked in a chat template, greedy, without DRY, it writes the question back line
    after line; `run --chat` stops it at the 4th time and says so."""
    import subprocess
    import sys

    from conftest import model_file

    model_file("gemma3-270m")
    out = subprocess.run([sys.executable, "-m", "localllm", "run", "gemma3-270m", "--chat", "Write a haiku about the sea.",
                          "--temp", "0", "-n", "150", "--dry-multiplier", "0", "--json"],
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr
    import json

    answer = json.loads(out.stdout)
    assert "loop guard" in out.stderr and answer["timings"]["predicted_n"] < 150
    assert max_repeats(answer["text"]) == 4
