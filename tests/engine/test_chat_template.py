"""Chat templates: SmolLM2's real template, HF-compatible helpers, and the sandbox."""

from __future__ import annotations

import datetime

import pytest

from engine.chat_template import ChatTemplate, TemplateError
from models.errors import HearthError
from tests.engine.test_tokenizer import read_metadata

# SmolLM2's default system prompt, as its template writes it when the conversation has none.
SMOL_SYSTEM = (
    "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
)


@pytest.fixture
def smollm2_template(smollm2_path) -> ChatTemplate:
    template = ChatTemplate.from_gguf_metadata(read_metadata(str(smollm2_path)))
    assert template is not None
    return template


def test_smollm2_default_system_prompt(smollm2_template):
    text = smollm2_template.render([{"role": "user", "content": "Hi!"}])
    assert text == SMOL_SYSTEM + "<|im_start|>user\nHi!<|im_end|>\n<|im_start|>assistant\n"


def test_smollm2_multi_turn_with_system(smollm2_template):
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": "4"},
        {"role": "user", "content": "Thanks"},
    ]
    expected = (
        "<|im_start|>system\nBe brief.<|im_end|>\n"
        "<|im_start|>user\n2+2?<|im_end|>\n"
        "<|im_start|>assistant\n4<|im_end|>\n"
        "<|im_start|>user\nThanks<|im_end|>\n"
    )
    assert smollm2_template.render(messages, add_generation_prompt=False) == expected
    assert smollm2_template.render(messages) == expected + "<|im_start|>assistant\n"


def test_smollm2_special_tokens(smollm2_template):
    assert smollm2_template.bos_token == "<|im_start|>"
    assert smollm2_template.eos_token == "<|im_end|>"


def test_from_gguf_metadata_without_template():
    assert ChatTemplate.from_gguf_metadata({"tokenizer.ggml.model": "gpt2"}) is None


def test_trim_and_lstrip_blocks():
    source = (
        "{% for m in messages %}\n    {% if m.role == 'user' %}\nU:{{ m.content }}\n"
        "    {% endif %}\n{% endfor %}"
    )
    text = ChatTemplate(source).render([{"role": "user", "content": "a"}, {"role": "bot", "content": "b"}])
    assert text == "U:a\n"


def test_bos_eos_and_extra_variables():
    template = ChatTemplate(
        "{{ bos_token }}{{ messages[0].content }}{{ eos_token }}|{{ tools | length }}", "<s>", "</s>"
    )
    assert template.render([{"role": "user", "content": "x"}], tools=[1, 2]) == "<s>x</s>|2"


def test_tojson_is_hf_compatible():
    template = ChatTemplate("{{ messages[0] | tojson }}|{{ tools | tojson(indent=2) }}")
    text = template.render([{"role": "user", "content": "café <b>&'"}], tools={"a": 1})
    assert text == '{"role": "user", "content": "café <b>&\'"}|{\n  "a": 1\n}'


def test_strftime_now():
    text = ChatTemplate("{{ strftime_now('%Y') }}").render([])
    assert text == str(datetime.datetime.now().year)


def test_generation_block_renders_its_body():
    template = ChatTemplate(
        "{% for m in messages %}{% generation %}[{{ m.content }}]{% endgeneration %}{% endfor %}"
    )
    assert template.render([{"role": "assistant", "content": "ok"}]) == "[ok]"


def test_loop_controls():
    template = ChatTemplate(
        "{% for m in messages %}{% if m.role == 'system' %}{% continue %}{% endif %}"
        "{{ m.content }}{% endfor %}"
    )
    assert template.render([{"role": "system", "content": "s"}, {"role": "user", "content": "u"}]) == "u"


def test_raise_exception_becomes_template_error():
    template = ChatTemplate(
        "{% if messages[0].role != 'user' %}"
        "{{ raise_exception('Conversations must start with user') }}{% endif %}"
    )
    with pytest.raises(TemplateError, match="Conversations must start with user") as info:
        template.render([{"role": "assistant", "content": "x"}])
    assert isinstance(info.value, HearthError)
    assert template.render([{"role": "user", "content": "x"}]) == ""


def test_syntax_error_at_construction():
    with pytest.raises(TemplateError, match="syntax error on line 1"):
        ChatTemplate("{% for m in messages %}{{ m.content }")
    with pytest.raises(TemplateError, match="empty"):
        ChatTemplate("   ")


@pytest.mark.parametrize(
    "source",
    [
        "{{ ''.__class__.__mro__[1].__subclasses__() }}",
        "{{ cycler.__init__.__globals__.os.popen('echo pwned').read() }}",
        "{{ messages.__class__ }}",
        "{{ messages.append({'role': 'user', 'content': 'injected'}) }}",
        "{% set d = {} %}{{ d.update({'a': 1}) }}",
    ],
)
def test_sandbox_escapes_fail(source):
    template = ChatTemplate(source)
    with pytest.raises(TemplateError, match="sandbox forbids"):
        template.render([{"role": "user", "content": "x"}])


def test_undefined_misuse_fails():
    with pytest.raises(TemplateError, match="undefined"):
        ChatTemplate("{{ nothing.here }}").render([])
    with pytest.raises(TemplateError, match="failed to render"):
        ChatTemplate("{{ messages[0].content + 1 }}").render([{"role": "user", "content": "x"}])
    # Plain undefined names render empty, as in transformers (templates test `tools is defined`).
    assert ChatTemplate("[{{ tools }}]").render([]) == "[]"


def test_bad_messages():
    template = ChatTemplate("{{ messages | length }}")
    with pytest.raises(TemplateError, match="message 1"):
        template.render([{"role": "user", "content": "x"}, "not a dict"])
