"""`hearth chat --mcp`: the real model, a real MCP server (tests/engine/mcp_test_server.py), consent on stdin.

SmolLM2-135M never chooses to call a tool, so its first reply is scripted (the Qwen2.5-format call a
tool-using model writes); the prompt with the tools, the call, the consent question, the result going back
into the template and the model's answer after it are all the real thing. SmolLM2 speaks ChatML, so it is
given Qwen2.5's (ChatML, tool-aware) template.
"""

import json
import sys
from pathlib import Path

import pytest

import engine.commands as commands
from engine.chat_template import ChatTemplate
from engine.cli import main
from engine.generate import GenerationEvent

SERVER = str(Path(__file__).with_name("mcp_test_server.py"))
QWEN = (Path(__file__).parents[1] / "fixtures" / "chat_templates" / "qwen2.5.jinja").read_text()
CALL = '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>'


@pytest.fixture
def mcp_json(tmp_path):
    path = tmp_path / "mcp.json"
    path.write_text(json.dumps({"mcpServers": {"test": {"command": sys.executable, "args": [SERVER]}}}))
    return path


@pytest.fixture
def tool_model(monkeypatch):
    """The model with Qwen2.5's template; its first reply scripted to call add(2, 3); the prompts recorded."""
    real_load, real_generate = commands.load_model, commands.generate
    prompts = []

    def load(path):
        lm = real_load(path)
        lm.template = ChatTemplate(QWEN, eos_token=lm.tokenizer.eos_token)
        return lm

    def generate(model, tokenizer, ids, cache, params):
        prompts.append(tokenizer.decode(ids))
        if len(prompts) == 1:
            yield GenerationEvent(text=CALL, token=None, finish_reason="stop", prompt_tokens=len(ids))
            return
        yield from real_generate(model, tokenizer, ids, cache, params)

    monkeypatch.setattr(commands, "load_model", load)
    monkeypatch.setattr(commands, "generate", generate)
    return prompts


def chat(monkeypatch, capsys, smollm2_path, mcp_json, answers):
    lines = iter(answers)
    monkeypatch.setattr("builtins.input", lambda prompt="": next(lines))
    argv = ["chat", "-m", str(smollm2_path), "--temperature", "0", "-n", "12", "--mcp-config", str(mcp_json)]
    assert main(argv) == 0
    return capsys.readouterr()


def test_chat_runs_an_allowed_tool_and_the_model_answers(monkeypatch, capsys, smollm2_path, mcp_json,
                                                         tool_model):
    out = chat(monkeypatch, capsys, smollm2_path, mcp_json, ["What is 2+3?", "y", "/exit"])
    assert "tools: add, fail, sleep, big, pid, crash" in out.err
    assert '[tool call] add\n{\n  "a": 2,\n  "b": 3\n}' in out.err
    assert "[tool result] 5.0" in out.err
    assert '"name": "add"' in tool_model[0]  # the tools were in the first prompt
    assert "<tool_response>\n5.0\n</tool_response>" in tool_model[1]  # the result went back
    assert len(tool_model) == 2 and "prompt reused" in out.err


def test_chat_deny_sends_the_declined_note(monkeypatch, capsys, smollm2_path, mcp_json, tool_model):
    out = chat(monkeypatch, capsys, smollm2_path, mcp_json, ["What is 2+3?", "n", "/exit"])
    assert "[tool declined]" in out.err
    assert "The user declined to run this tool call." in tool_model[1]


def test_chat_mcp_with_a_template_without_tools(monkeypatch, capsys, smollm2_path, mcp_json):
    out = chat(monkeypatch, capsys, smollm2_path, mcp_json, ["Hi", "/exit"])
    assert "chat template takes no tools; chatting without them" in out.err


def test_chat_mcp_reports_a_broken_server(monkeypatch, capsys, smollm2_path, tmp_path):
    path = tmp_path / "mcp.json"
    bad = {"command": sys.executable, "args": [SERVER, "broken"]}
    path.write_text(json.dumps({"mcpServers": {"bad": bad}}))
    out = chat(monkeypatch, capsys, smollm2_path, path, ["/exit"])
    assert "Tool server 'bad': failed to start" in out.err and "missing API key" in out.err
