"""ChatTemplate renders real chat templates exactly as transformers' apply_chat_template(...,
tokenize=False, add_generation_prompt=True) does: Llama-3, ChatML/Qwen2 with tools through
`tojson` and a default system prompt, Mistral's role check through `raise_exception` (a 400 for
the server), and Llama-3.1's date through `strftime_now` (the clock fixed in both)."""

from __future__ import annotations

from datetime import datetime

import pytest
import transformers
from transformers.utils import chat_template_utils

from radixlora.errors import InvalidRequestError
from radixlora.server.http.common import invalid
from radixlora.text import chat as chat_module
from radixlora.text.chat import ChatTemplate
from scripts.checkpoints import TINY_CORPUS, build_tokenizer

LLAMA3 = (
    "{% set loop_messages = messages %}{% for message in loop_messages %}"
    "{% set content = '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'"
    " + message['content'] | trim + '<|eot_id|>' %}{% if loop.index0 == 0 %}"
    "{% set content = bos_token + content %}{% endif %}{{ content }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}"
    "{% endif %}"
)

QWEN2 = """{%- if tools %}
    {{- '<|im_start|>system\\n' }}
    {%- if messages[0]['role'] == 'system' %}
        {{- messages[0]['content'] }}
    {%- else %}
        {{- 'You are Qwen, a helpful assistant.' }}
    {%- endif %}
    {{- "\\n\\n# Tools\\n\\n<tools>" }}
    {%- for tool in tools %}
        {{- "\\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\\n</tools>\\n" }}
    {{- tools | tojson(indent=2, sort_keys=True) }}
    {{- "<|im_end|>\\n" }}
{%- else %}
    {%- if messages[0]['role'] == 'system' %}
        {{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}
    {%- else %}
        {{- '<|im_start|>system\\nYou are Qwen, a helpful assistant.<|im_end|>\\n' }}
    {%- endif %}
{%- endif %}
{%- for message in messages %}
    {%- if message.role == "system" and loop.first %}
        {%- continue %}
    {%- endif %}
    {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}
    {%- if loop.index > 8 %}{% break %}{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
{%- endif %}
"""

MISTRAL = (
    "{{ bos_token }}{% for message in messages %}"
    "{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}"
    "{% endif %}{% if message['role'] == 'user' %}{{ '[INST] ' + message['content'] + ' [/INST]' }}"
    "{% elif message['role'] == 'assistant' %}{{ message['content'] + eos_token}}"
    "{% else %}{{ raise_exception('Only user and assistant roles are supported!') }}"
    "{% endif %}{% endfor %}"
)

LLAMA31_DATE = """{{- bos_token }}
{%- if not date_string is defined %}
    {%- if strftime_now is defined %}
        {%- set date_string = strftime_now("%d %b %Y") %}
    {%- else %}
        {%- set date_string = "26 Jul 2024" %}
    {%- endif %}
{%- endif %}
{{- "<|start_header_id|>system<|end_header_id|>\\n\\n" }}
{{- "Cutting Knowledge Date: December 2023\\n" }}
{{- "Today Date: " + date_string + "\\n\\n<|eot_id|>" }}
{%- for message in messages %}
    {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' }}
    {{- message['content'] | trim + '<|eot_id|>' }}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}
{%- endif %}
"""

CHAT = [
    {"role": "system", "content": "Réponds en français <b>& brièvement</b>."},
    {"role": "user", "content": "  Wie ist das Wetter in Zürich? ☃ "},
    {"role": "assistant", "content": "Il fait <froid> & \"gris\"."},
    {"role": "user", "content": "Et demain ?"},
]
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Wetter für <Stadt> & 'Land' — heute",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string", "description": "z.B. Zürich"}},
                "required": ["city"],
            },
        },
    }
]


class FixedClock(datetime):
    @classmethod
    def now(cls, tz=None):
        return cls(2025, 3, 9, 12, 30)


@pytest.fixture(scope="module")
def hf_tokenizer():
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=build_tokenizer(TINY_CORPUS, 256),
        bos_token="<s>",
        eos_token="</s>",
        pad_token="<pad>",
    )


def hf_render(tok, template: str, messages: list[dict], **kwargs) -> str:
    return tok.apply_chat_template(
        messages, chat_template=template, tokenize=False, add_generation_prompt=True, **kwargs
    )


def ours(tok, template: str) -> ChatTemplate:
    return ChatTemplate(template, tok.bos_token, tok.eos_token, {"pad_token": tok.pad_token})


@pytest.mark.parametrize("template", [LLAMA3, QWEN2, MISTRAL], ids=["llama3", "qwen2", "mistral"])
def test_renders_as_transformers(hf_tokenizer, template):
    messages = CHAT[1:] if template == MISTRAL else CHAT
    want = hf_render(hf_tokenizer, template, messages)
    assert ours(hf_tokenizer, template).render(messages) == want
    if template == QWEN2:  # the default system prompt
        want = hf_render(hf_tokenizer, template, CHAT[1:])
        assert ours(hf_tokenizer, template).render(CHAT[1:]) == want
        assert "You are Qwen" in want


def test_tools_through_unescaped_tojson(hf_tokenizer):
    want = hf_render(hf_tokenizer, QWEN2, CHAT, tools=TOOLS)
    got = ours(hf_tokenizer, QWEN2).render(CHAT, tools=TOOLS)
    assert got == want
    assert "Wetter für <Stadt> & 'Land' — heute" in got  # not HTML-escaped, not ASCII-escaped
    assert '\n  {\n    "function": {' in got  # tojson(indent=2, sort_keys=True)


def test_strftime_now(hf_tokenizer, monkeypatch):
    monkeypatch.setattr(chat_module, "datetime", FixedClock)
    monkeypatch.setattr(chat_template_utils, "datetime", FixedClock)
    want = hf_render(hf_tokenizer, LLAMA31_DATE, CHAT[1:2])
    assert ours(hf_tokenizer, LLAMA31_DATE).render(CHAT[1:2]) == want
    assert "Today Date: 09 Mar 2025\n" in want


def test_checkpoint_directory_as_transformers_saves_it(hf_tokenizer, tmp_path):
    hf_tokenizer.chat_template = MISTRAL
    hf_tokenizer.save_pretrained(tmp_path)
    messages = CHAT[1:]
    want = hf_tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert ChatTemplate.from_dir(tmp_path).render(messages) == want
    assert want.startswith("<s>[INST]") and "</s>[INST]" in want


def test_raise_exception_is_a_bad_request(hf_tokenizer):
    bad_order = [CHAT[1], CHAT[1]]
    with pytest.raises(Exception, match="roles must alternate"):
        hf_render(hf_tokenizer, MISTRAL, bad_order)
    with pytest.raises(InvalidRequestError, match="roles must alternate") as info:
        ours(hf_tokenizer, MISTRAL).render(bad_order)
    assert info.value.param == "messages"
    assert invalid(info.value).status == 400


def test_sandbox_blocks_attribute_escapes():
    template = ChatTemplate("{{ messages.__class__.__mro__ }}")
    with pytest.raises(InvalidRequestError):
        template.render([{"role": "user", "content": "x"}])
