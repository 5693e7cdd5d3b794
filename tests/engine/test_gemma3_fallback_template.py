"""Chat with models that ship no chat template (Gemma 3 base): fallback templates and the CLI path."""

from __future__ import annotations

import io
import json

import pytest

from engine import templates
from engine.chat_template import TemplateError
from engine.cli import main
from engine.loader import load_model
from engine.templates import fallback_template, fallback_template_name
from tests.engine.tiny_gemma3 import TinyGemmaSpec, write_tiny_gemma3
from tests.engine.tiny_models import TinySpec, write_tiny_gguf

CONVERSATION = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": " Hi there \n"},
    {"role": "assistant", "content": "Hello."},
    {"role": "user", "content": "Name a colour."},
]


def test_family_choice():
    assert fallback_template_name("gemma3") == "gemma"
    assert fallback_template_name("gemma2") == "gemma"
    assert fallback_template_name("llama") == "chatml"
    assert fallback_template_name("something-new") == "chatml"


def test_gemma_turns():
    text = fallback_template("gemma3", bos_token="<bos>").render(CONVERSATION)
    assert text == (
        "<bos><start_of_turn>user\nBe brief.\n\nHi there<end_of_turn>\n"
        "<start_of_turn>model\nHello.<end_of_turn>\n"
        "<start_of_turn>user\nName a colour.<end_of_turn>\n"
        "<start_of_turn>model\n"
    )
    no_prompt = fallback_template("gemma3").render(CONVERSATION[1:2], add_generation_prompt=False)
    assert no_prompt == "<start_of_turn>user\nHi there<end_of_turn>\n"


def test_gemma4_turns():
    assert fallback_template_name("gemma4") == "gemma4"
    text = fallback_template("gemma4", bos_token="<bos>").render(CONVERSATION)
    assert text == (
        "<bos><|turn>system\nBe brief.<turn|>\n<|turn>user\nHi there<turn|>\n"
        "<|turn>model\nHello.<turn|>\n<|turn>user\nName a colour.<turn|>\n<|turn>model\n"
    )


def test_chatml_turns():
    text = fallback_template("llama").render(CONVERSATION[:2])
    assert text == "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\n Hi there \n<|im_end|>\n" + (
        "<|im_start|>assistant\n"
    )


def test_missing_template_file_is_a_typed_error(monkeypatch, tmp_path):
    monkeypatch.setattr(templates, "TEMPLATE_DIR", tmp_path)
    with pytest.raises(TemplateError, match="reinstall"):
        fallback_template("gemma3")


@pytest.fixture
def tiny_gemma(tmp_path):
    path = tmp_path / "tiny-gemma3.gguf"
    write_tiny_gemma3(path, TinyGemmaSpec(layers=2))
    return path


def test_run_chat_uses_gemma_fallback(capsys, tiny_gemma):
    argv = ["run", "-m", str(tiny_gemma), "--chat", "--json", "-n", "3", "--temperature", "0", "Hi"]
    assert main(argv) == 0
    captured = capsys.readouterr()
    out = json.loads(captured.out.strip().splitlines()[-1])
    assert "no chat template" in captured.err and "gemma" in captured.err
    tok = load_model(tiny_gemma).tokenizer
    expected = tok.encode("<bos><start_of_turn>user\nHi<end_of_turn>\n<start_of_turn>model\n")
    assert out["prompt_ids"] == expected
    # BOS and the turn markers are single control tokens, not spelled out in bytes
    assert expected[0] == tok.bos_id and expected.count(tok.encode("<start_of_turn>")[0]) == 2


def test_run_without_chat_is_plain_completion(capsys, tiny_gemma):
    assert main(["run", "-m", str(tiny_gemma), "--json", "-n", "2", "--temperature", "0", "Hi"]) == 0
    captured = capsys.readouterr()
    out = json.loads(captured.out.strip().splitlines()[-1])
    tok = load_model(tiny_gemma).tokenizer
    assert out["prompt_ids"] == [tok.bos_id, *tok.encode("Hi")]
    assert "chat template" not in captured.err


def test_chat_uses_fallback_once(capsys, monkeypatch, tiny_gemma):
    monkeypatch.setattr("sys.stdin", io.StringIO("Hi\nAgain\n/exit\n"))
    assert main(["chat", "-m", str(tiny_gemma), "-n", "2", "--temperature", "0"]) == 0
    err = capsys.readouterr().err
    assert err.count("no chat template") == 1
    assert err.index("no chat template") < err.index("ready")
    assert err.count("tokens;") == 2  # both turns answered


def test_run_chat_llama_without_template_uses_chatml(capsys, tmp_path):
    path = tmp_path / "tiny-llama.gguf"
    write_tiny_gguf(path, TinySpec())
    argv = ["run", "-m", str(path), "--chat", "--json", "-n", "2", "--temperature", "0", "Hi"]
    assert main(argv) == 0
    captured = capsys.readouterr()
    out = json.loads(captured.out.strip().splitlines()[-1])
    assert "chatml" in captured.err
    tok = load_model(path).tokenizer
    # the tiny llama vocabulary does not ask for BOS, so the template writes none
    assert out["prompt_ids"] == tok.encode("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")
