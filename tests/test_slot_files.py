"""llama.cpp's slot files (`serve --slot-save-path DIR`, `POST /slots/N?action=save|restore|erase`): a slot's KV
cache kept on disk between server runs, so an agent's long system prompt is computed once per model.

Two smollm2 servers, one after the other, share a save folder: the second starts with nothing cached, restores
what the first saved, and computes only the tokens after it, answering exactly what the first answered.
"""

from __future__ import annotations

import httpx
import pytest
from conftest import model_file
from test_server import start_server, stop_server

MODEL = "smollm2-135m-instruct"
# Some 300 tokens that stand for an agent's system prompt: long enough to span many KV blocks.
SYSTEM = ("You are a careful coding agent. Read the files you are given, plan the change, then make it. "
          "Explain each step in one short sentence, and never invent a file that you were not shown. ") * 8
QUESTION = "Question: what is 2 + 3?\nAnswer:"


def completion(client: httpx.Client, prompt: str, **extra) -> dict:
    r = client.post("/completion", json={"prompt": prompt, "n_predict": 8, "temperature": 0.0, "ignore_eos": True,
                                         "cache_prompt": True, **extra})
    assert r.status_code == 200, r.text
    return r.json()


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """The first server's run: a request in slot 1, then its slot saved; the server is stopped after."""
    model_file(MODEL)
    folder = tmp_path_factory.mktemp("slots")
    proc, url = start_server(MODEL, "--ctx", "1024", "--parallel", "2", "--slot-save-path", str(folder))
    try:
        with httpx.Client(base_url=url, timeout=300) as c:
            first = completion(c, SYSTEM + QUESTION, id_slot=1)
            save = c.post("/slots/1?action=save", json={"filename": "agent.slot"})
            slots = c.get("/slots").json()
    finally:
        err = stop_server(proc)
    assert "Traceback" not in err, err
    return folder, first, save, slots


def test_a_request_runs_in_the_slot_it_names_and_the_slot_keeps_its_tokens(saved):
    _, first, _, slots = saved
    assert first["id_slot"] == 1
    # What slot 1 holds: the prompt and the answer, less the last token (never evaluated): llama.cpp's count.
    assert [s["n_past"] for s in slots] == [0, first["tokens_cached"]]


def test_save_writes_the_slot_as_llama_cpp_answers_it(saved):
    folder, first, save, _ = saved
    assert save.status_code == 200, save.text
    body = save.json()
    assert list(body) == ["id_slot", "filename", "n_saved", "n_written", "timings"]
    assert body["id_slot"] == 1 and body["filename"] == "agent.slot"
    assert body["n_saved"] == first["tokens_cached"] > 250
    assert body["n_written"] == (folder / "agent.slot").stat().st_size > 0
    assert set(body["timings"]) == {"save_ms"}
    assert [p.name for p in folder.iterdir()] == ["agent.slot"]  # no temporary file left beside it


def test_a_restored_slot_in_a_new_server_computes_only_what_follows_and_answers_the_same(saved):
    folder, first, save, _ = saved
    proc, url = start_server(MODEL, "--ctx", "1024", "--parallel", "2", "--slot-save-path", str(folder))
    try:
        with httpx.Client(base_url=url, timeout=300) as c:
            r = c.post("/slots/0?action=restore", json={"filename": "agent.slot"})
            assert r.status_code == 200, r.text
            body = r.json()
            assert list(body) == ["id_slot", "filename", "n_restored", "n_read", "timings"]
            assert body["n_restored"] == save.json()["n_saved"] and body["n_read"] == save.json()["n_written"]
            assert c.get("/slots").json()[0]["n_past"] == body["n_restored"]
            again = completion(c, SYSTEM + QUESTION)
            # Nothing but the last prompt token computed (the forward must give its logits), and the answer is
            # bit for bit the first server's: the restored keys and values are the computed ones.
            assert again["timings"]["prompt_n"] == 1
            assert again["timings"]["cache_n"] == first["tokens_evaluated"] - 1
            assert again["content"] == first["content"] and again["tokens_predicted"] == 8
            # A request without id_slot goes to the slot whose conversation it continues.
            assert again["id_slot"] == 0
            erased = c.post("/slots/0?action=erase")
            assert erased.status_code == 200, erased.text
            assert erased.json() == {"id_slot": 0, "n_erased": again["tokens_cached"]}
            assert c.get("/slots").json()[0]["n_past"] == 0
    finally:
        err = stop_server(proc)
    assert "Traceback" not in err, err


def test_slot_files_refuse_paths_foreign_files_and_bad_slots(saved):
    folder, *_ = saved
    (folder / "notes.txt").write_text("not a slot file")
    proc, url = start_server(MODEL, "--ctx", "1024", "--parallel", "2", "--slot-save-path", str(folder))
    try:
        with httpx.Client(base_url=url, timeout=300) as c:
            for name in ["../escape.slot", "sub/dir.slot", "", ".", "..", " lead", "trail.", "x\x1b[31m",
                         "evil\u202etxt", "a" * 256, 7]:
                r = c.post("/slots/0?action=save", json={"filename": name})
                assert r.status_code == 400, (name, r.text)
            assert sorted(p.name for p in folder.iterdir()) == ["agent.slot", "notes.txt"]
            assert not (folder.parent / "escape.slot").exists()
            r = c.post("/slots/0?action=restore", json={"filename": "notes.txt"})
            assert r.status_code == 400 and "not a localllm session file" in r.json()["error"]["message"]
            r = c.post("/slots/0?action=restore", json={"filename": "missing.slot"})
            assert r.status_code == 400 and "missing.slot" in r.json()["error"]["message"]
            assert c.post("/slots/5?action=erase").status_code == 400
            assert c.post("/slots/x?action=erase").status_code == 400
            assert c.post("/slots/0?action=compact").status_code == 400
            r = c.post("/completion", json={"prompt": "Hi", "n_predict": 1, "id_slot": 2})
            assert r.status_code == 400 and "id_slot" in r.json()["error"]["message"]
    finally:
        err = stop_server(proc)
    assert "Traceback" not in err, err


def test_slot_actions_without_a_save_path_are_not_supported():
    model_file(MODEL)
    proc, url = start_server(MODEL, "--ctx", "512")
    try:
        r = httpx.post(url + "/slots/0?action=save", json={"filename": "a.slot"}, timeout=60)
        assert r.status_code == 501
        assert r.json()["error"]["type"] == "not_supported_error"
        assert "--slot-save-path" in r.json()["error"]["message"]
    finally:
        stop_server(proc)
