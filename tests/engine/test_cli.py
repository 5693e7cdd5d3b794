"""The `hearth` command line, in process (kernels stay compiled) and once as a real subprocess."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from engine.cli import main

GOLDENS = Path(__file__).resolve().parents[1] / "goldens"


def _json_out(capsys, argv) -> dict:
    assert main(argv) == 0
    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])


def test_run_chat_greedy_json(capsys, smollm2_path):
    golden = json.loads((GOLDENS / "smollm2_greedy.json").read_text())
    out = _json_out(
        capsys,
        [
            "run",
            "-m",
            str(smollm2_path),
            "--chat",
            "--temperature",
            "0",
            "-n",
            "32",
            "--json",
            "What is the capital of France?",
        ],
    )
    assert out["prompt_ids"] == golden["prompt_ids"]
    assert out["ids"] == golden["new_ids"][: golden["eos_index"]]
    assert out["text"] == golden["text_skip_special"]
    assert out["finish_reason"] == "stop"


def test_run_streams_text_and_respects_max_tokens(capsys, smollm2_path):
    assert main(["run", "-m", str(smollm2_path), "-n", "5", "--seed", "3", "Once upon a time"]) == 0
    captured = capsys.readouterr()
    assert captured.out.strip()
    assert "5 tokens, length" in captured.err


def test_seeded_sampling_is_reproducible(capsys, smollm2_path):
    argv = [
        "run",
        "-m",
        str(smollm2_path),
        "-n",
        "12",
        "--temperature",
        "1.0",
        "--seed",
        "42",
        "--json",
        "Hello",
    ]
    first = _json_out(capsys, argv)
    second = _json_out(capsys, argv)
    assert first["ids"] == second["ids"] and len(first["ids"]) == 12


def test_tokenize_a_hugging_face_folder(capsys):
    from engine.loader import load_model

    folder = Path(__file__).resolve().parents[1] / "fixtures" / "tiny" / "qwen3"
    text = "the cat <|im_start|>"
    want = load_model(folder).tokenizer.encode(text, add_special=False)
    assert _json_out(capsys, ["tokenize", "-m", str(folder), "--json", text]) == {"ids": want}


def test_tokenize_json(capsys, smollm2_path):
    golden = json.loads((GOLDENS / "smollm2_tokens.json").read_text())
    text, ids = golden["texts"][0], golden["ids"][0]
    assert _json_out(capsys, ["tokenize", "-m", str(smollm2_path), "--json", text]) == {"ids": ids}


def test_bench_json(capsys, smollm2_path):
    out = _json_out(
        capsys, ["bench", "-m", str(smollm2_path), "-p", "32", "-g", "4", "--ctx", "64", "--json"]
    )
    for key in ("load_s", "prefill_tps", "decode_tps", "ttft_s", "peak_rss_mb"):
        assert out[key] > 0, key


def test_chat_multi_turn_reuses_cache(monkeypatch, capsys, smollm2_path):
    lines = iter(["What is the capital of France?", "/reset", "Say hi", "/exit"])
    monkeypatch.setattr("builtins.input", lambda prompt="": next(lines))
    assert main(["chat", "-m", str(smollm2_path), "--temperature", "0", "-n", "16"]) == 0
    captured = capsys.readouterr()
    assert "Paris" in captured.out
    # the second chat shares the system prompt with the first: its prefix comes from the cache
    reused = [line for line in captured.err.splitlines() if "prompt reused" in line]
    assert len(reused) == 2
    assert not reused[1].split("tokens; ")[1].startswith("0/")


@pytest.mark.parametrize(
    "argv, message",
    [
        (["run", "-m", "/nonexistent/model.gguf", "hi"], "neither a model file nor a starter"),
        (["run", "-m", "{model}", "--top-p", "0", "hi"], "invalid sampling option"),
        (["run", "-m", "{model}", "--ctx", "8", "hi"], "at least 16"),
        (["run", "-m", "{model}", "--ctx", "16", "word " * 40], "context holds 16"),
        (["run", "-m", "{notgguf}", "hi"], "not a GGUF file|magic"),
    ],
)
def test_errors_are_clear(capsys, smollm2_path, tmp_path, argv, message):
    import re

    notgguf = tmp_path / "x.gguf"
    notgguf.write_bytes(b"PK\x03\x04 this is a zip, not a model" * 4)
    argv = [a.format(model=smollm2_path, notgguf=notgguf) for a in argv]
    assert main(argv) == 1
    err = capsys.readouterr().err
    assert err.startswith("hearth: ") and re.search(message, err), err
    assert "Traceback" not in err


def test_console_entry_point_runs(smollm2_path):
    result = subprocess.run(
        [sys.executable, "-m", "engine.cli", "tokenize", "-m", str(smollm2_path), "--json", "Hello world"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["ids"]


def test_chat_reuses_a_reply_that_re_tokenizes_differently(monkeypatch, capsys, smollm2_path):
    from engine.bench_chat import SCRIPT, SYSTEM

    # greedy, SmolLM2's third reply here holds " compost" "er", which its text encodes as " comp" "oster"
    lines = iter([*SCRIPT[:4], "/exit"])
    monkeypatch.setattr("builtins.input", lambda prompt="": next(lines))
    argv = ["chat", "-m", str(smollm2_path), "--temperature", "0", "-n", "128", "--system", SYSTEM]
    assert main(argv) == 0
    turns = [line for line in capsys.readouterr().err.splitlines() if "prompt reused" in line]
    assert len(turns) == 4
    for before, turn in zip(turns, turns[1:]):
        # every turn reuses all the previous one left in the cache: prompt and reply
        left = int(before.split("context ")[1].split("/")[0])
        assert int(turn.split("tokens; ")[1].split("/")[0]) == left


def test_bench_lookup_with_notes(capsys, smollm2_path):
    argv = ["bench", "-m", str(smollm2_path), "--lookup", "-g", "8", "--json"]
    base = _json_out(capsys, argv)
    longer = _json_out(capsys, [*argv, "--notes", "300"])
    assert base["mode"] == "lookup" and base["identical_greedy"] and longer["identical_greedy"]
    assert longer["notes_tokens"] == 300
    for short, long in zip(base["prompt_tokens"], longer["prompt_tokens"]):
        assert 300 <= long - short <= 450
    for key in ("baseline_decode_tps", "decode_tps", "speedup", "acceptance_rate", "tokens_per_pass"):
        assert longer[key] > 0, key


def test_bench_times_a_prompt_with_an_image(capsys):
    """`hearth bench --image FILE`: reading the image, the prompt's prefill and TTFT, with the image's rows
    counted (4 on the tiny Gemma 3 vision fixture); a text model answers with the typed error."""
    tiny = Path(__file__).resolve().parents[1] / "fixtures" / "tiny"
    image = str(tiny / "gemma3-vision" / "image0.png")
    argv = ["bench", "-m", str(tiny / "gemma3-vision"), "-p", "8", "-g", "4", "--image", image, "--json"]
    out = _json_out(capsys, argv)
    assert out["image_rows"] == 4 and out["image_prompt_tokens"] > 4
    assert out["image_ttft_s"] >= out["image_s"] > 0 and out["image_prefill_s"] > 0
    assert main(["bench", "-m", str(tiny / "gemma3"), "-p", "8", "-g", "4", "--image", image]) != 0
    assert "does not read images" in capsys.readouterr().err


@pytest.fixture
def prompts(monkeypatch) -> list[list[dict]]:
    """The messages every reply of `hearth chat` was asked for (recorded as the prompt is made)."""
    import engine.commands as commands

    seen: list[list[dict]] = []
    real = commands._chat_prompt

    def chat_prompt(lm, messages, template_vars=None):
        seen.append([dict(m) for m in messages])
        return real(lm, messages, template_vars)

    monkeypatch.setattr(commands, "_chat_prompt", chat_prompt)
    return seen


def test_chat_with_a_document(monkeypatch, capsys, smollm2_path, tmp_path, prompts):
    notes = tmp_path / "notes.txt"
    notes.write_text("Meeting notes. The wifi password is swordfish.\n")
    more = tmp_path / "more.md"
    more.write_text("# More\n\nThe printer is on the second floor.\n")
    lines = iter(["What is the wifi password?", f"/doc {more}", "/doc", "Where is the printer?", "/exit"])
    monkeypatch.setattr("builtins.input", lambda prompt="": next(lines))
    argv = ["chat", "-m", str(smollm2_path), "--temperature", "0", "-n", "8", "--doc", str(notes)]
    assert main(argv) == 0
    err = capsys.readouterr().err
    assert "(document notes.txt: 47 characters)" in err and "[sources: notes.txt (whole document)]" in err
    assert "give a file: /doc PATH" in err
    assert "[sources: notes.txt (whole document); more.md (whole document)]" in err
    asked = [p for p in prompts if p and p[-1]["role"] == "user" and "<documents>" in p[-1]["content"]]
    first = asked[0][-1]["content"]
    assert first.startswith('<documents>\n<document name="notes.txt" part="whole document">\n')
    assert first.endswith("swordfish.\n</document>\n</documents>\n\nWhat is the wifi password?")
    last = prompts[-1]
    assert "swordfish" in last[0]["content"] and "second floor" in last[-1]["content"]


def test_chat_ranks_a_long_document_with_an_embedding_model(monkeypatch, capsys, smollm2_path, tmp_path):
    """--embed-model (else the library's first embedding model) ranks the chunks with keywords and meaning;
    a broken one falls back to keywords and says why."""
    from models.library import Library
    from tests.engine.test_documents import _essay

    bert = Path(__file__).resolve().parents[1] / "fixtures" / "tiny" / "bert-embed"
    essay = tmp_path / "essay.txt"
    essay.write_text(_essay())
    broken = tmp_path / "broken.gguf"
    broken.write_bytes(b"GGUF" + b"\0" * 64)
    base = ["chat", "-m", str(smollm2_path), "-n", "2", "--ctx", "512", "--doc", str(essay)]
    Library().import_path(bert)
    for flag, ranked in (([], "keywords and bert-embed"), (["--embed-model", str(broken)], "keywords")):
        lines = iter(["What is the vault launch code?", "/exit"])
        monkeypatch.setattr("builtins.input", lambda prompt="", it=lines: next(it))
        assert main(base + flag) == 0
        err = capsys.readouterr().err
        (sources,) = [line for line in err.splitlines() if line.startswith("[sources: essay.txt (chunk")]
        assert sources.endswith(f" · ranked by {ranked}]"), (flag, sources)
        assert ("broken.gguf could not be loaded" in err) == bool(flag), err


def test_chat_doc_errors_are_clear(capsys, smollm2_path, tmp_path):
    scan = tmp_path / "data.bin"
    scan.write_bytes(b"\x00\x01\x02" * 100)
    assert main(["chat", "-m", str(smollm2_path), "--doc", str(scan)]) == 1
    err = capsys.readouterr().err
    assert err.startswith("hearth: data.bin is not a document Hearth can read") and "Traceback" not in err


def test_chat_image_command(monkeypatch, capsys, tmp_path, prompts):
    """`/image FILE` in `hearth chat` queues the file for the next message (the tiny Gemma 3 with a vision
    tower); a missing path or file says so and the chat goes on; a text model refuses the command."""
    tiny = Path(__file__).resolve().parents[1] / "fixtures" / "tiny"
    picture = tiny / "gemma3-vision" / "image0.png"
    missing = tmp_path / "gone.png"
    lines = iter(["/image", f"/image {missing}", f"/image {picture}", "What is this?", "And now?", "/exit"])
    monkeypatch.setattr("builtins.input", lambda prompt="": next(lines))
    argv = ["chat", "-m", str(tiny / "gemma3-vision"), "--temperature", "0", "-n", "3", "--ctx", "256"]
    assert main(argv) == 0
    err = capsys.readouterr().err
    assert "/image FILE adds an image to your next message" in err
    assert "give a file: /image PATH" in err
    assert f"{missing}: cannot read the image" in err
    assert "(1 image(s) go with your next message)" in err
    asked = [p[-1] for p in prompts if p[-1]["role"] == "user"]
    assert asked[0]["content"] == [
        {"type": "image", "image": picture.read_bytes()},
        {"type": "text", "text": "What is this?"},
    ]
    assert asked[-1]["content"] == "And now?", "the image went with one message only"

    lines = iter([f"/image {picture}", "/exit"])
    monkeypatch.setattr("builtins.input", lambda prompt="": next(lines))
    assert main(["chat", "-m", str(tiny / "gemma3"), "-n", "2"]) == 0
    err = capsys.readouterr().err
    assert "does not read images" in err and "/image FILE" not in err


def test_chat_and_run_with_a_preset(monkeypatch, capsys, smollm2_path, prompts):
    """`-m PRESET` (a preset made by `hearth serve`'s /api/create) runs its base model with its system
    prompt, opening messages and parameters; options given on the command line win."""
    from models.library import Library, Preset

    Library().save_preset(Preset(
        "terse", str(smollm2_path), system="Answer in one word.",
        messages=[{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello."}],
        parameters={"temperature": 0.0, "num_predict": 3, "stop": ["zzz"]},
    ))
    lines = iter(["What colour is the sky?", "/exit"])
    monkeypatch.setattr("builtins.input", lambda prompt="": next(lines))
    assert main(["chat", "-m", "Terse:latest"]) == 0
    assert prompts[-1] == [
        {"role": "system", "content": "Answer in one word."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello."},
        {"role": "user", "content": "What colour is the sky?"},
    ]
    capsys.readouterr()
    argv = ["run", "-m", "terse", "--chat", "--json", "What colour is the sky?"]
    assert main(argv) == 0
    first = json.loads(capsys.readouterr().out)
    assert len(first["ids"]) == 3 and first["finish_reason"] == "length", "num_predict"
    assert main(argv) == 0
    assert json.loads(capsys.readouterr().out)["text"] == first["text"], "temperature 0: greedy"
    assert main([*argv[:-1], "-n", "5", "--system", "Be brief.", argv[-1]]) == 0
    assert len(json.loads(capsys.readouterr().out)["ids"]) == 5, "a given option wins"
    assert prompts[-1][0] == {"role": "system", "content": "Be brief."}
