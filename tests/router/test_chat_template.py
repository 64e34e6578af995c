"""Chat rendering with tools: a template that uses `tools` gets them (and the history's call
arguments as dicts); any other template, the default ChatML included, gets the Hermes
convention folded into plain turns. Exact rendered text through the real tokenizer."""

from __future__ import annotations

import pytest

from router.chat_template import DEFAULT_TEMPLATE, ChatRenderer, tools_prompt, uses_variable

TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather of a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}
CALL = {
    "id": "call_1",
    "type": "function",
    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
}
HISTORY = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": "", "tool_calls": [CALL]},
    {"role": "tool", "content": "sunny", "tool_call_id": "call_1"},
    {"role": "tool", "content": "21 C", "tool_call_id": "call_1"},
]

# A template in the style of tool-aware models' (it reads `tools`, writes arguments as JSON).
TOOL_TEMPLATE = (
    "{% if tools %}TOOLS:{% for t in tools %}{{ t.function.name }};{% endfor %}"
    "{{ '\\n' }}{% endif %}"
    "{% for m in messages %}[{{ m.role }}]{{ m.content }}"
    "{% for c in m.tool_calls or [] %}<call {{ c.function.name }} "
    "{{ c.function.arguments | tojson }}>{% endfor %}{{ '\\n' }}{% endfor %}[assistant]"
)


def rendered(renderer: ChatRenderer, messages, tools=None) -> str:
    return renderer.tokenizer.decode(renderer.render(messages, tools))


def test_default_template_folds_tools_into_hermes_turns(tokenizer):
    renderer = ChatRenderer(tokenizer)
    assert renderer.template == DEFAULT_TEMPLATE and not renderer.supports_tools
    expected = (
        f"<|im_start|>system\nBe brief.\n\n{tools_prompt([TOOL])}<|im_end|>\n"
        "<|im_start|>user\nWeather in Paris?<|im_end|>\n"
        '<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": '
        '{"city": "Paris"}}\n</tool_call><|im_end|>\n'
        "<|im_start|>user\n<tool_response>\nsunny\n</tool_response>\n"
        "<tool_response>\n21 C\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    assert rendered(renderer, HISTORY, [TOOL]) == expected
    assert '{"type": "function", "function": {"name": "get_weather"' in tools_prompt([TOOL])


def test_no_tools_no_system_turn_is_added(tokenizer):
    renderer = ChatRenderer(tokenizer)
    text = rendered(renderer, [{"role": "user", "content": "hi"}])
    assert text == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    with_tools = rendered(renderer, [{"role": "user", "content": "hi"}], [TOOL])
    assert with_tools.startswith(f"<|im_start|>system\n{tools_prompt([TOOL])}<|im_end|>\n")


def test_a_tool_aware_template_gets_tools_and_argument_dicts(tokenizer):
    renderer = ChatRenderer(tokenizer, TOOL_TEMPLATE)
    assert renderer.supports_tools
    assert rendered(renderer, HISTORY[1:4], [TOOL]) == (
        "TOOLS:get_weather;\n[user]Weather in Paris?\n"
        '[assistant]<call get_weather {"city": "Paris"}>\n[tool]sunny\n[assistant]'
    )


def test_the_servers_template_wins_over_the_tokenizers(tokenizer):
    own = type(tokenizer).from_pretrained(tokenizer.name_or_path)
    own.chat_template = "{% for m in messages %}{{ m.content }}{% endfor %}"
    assert rendered(ChatRenderer(own), [{"role": "user", "content": "hi"}]) == "hi"
    assert rendered(ChatRenderer(own, TOOL_TEMPLATE), [{"role": "user", "content": "hi"}]) == (
        "[user]hi\n[assistant]"
    )


def test_template_checks():
    assert uses_variable("{{ tools }}", "tools") and not uses_variable("{{ x }}", "tools")
    with pytest.raises(ValueError, match="not valid Jinja"):
        uses_variable("{% for %}", "tools")


def test_the_chat_template_option_is_a_file_read_at_start(tmp_path):
    import argparse

    from cluster.local import LocalOptions, add_serve_flags
    from cluster.templates import router_settings
    from router.chat_template import read_chat_template

    path = tmp_path / "tools.jinja"
    path.write_text(TOOL_TEMPLATE)
    parser = argparse.ArgumentParser()
    add_serve_flags(parser)
    manifest = LocalOptions.from_args(parser.parse_args(["--chat-template", str(path)])).manifest()
    assert router_settings(manifest).chat_template == str(path)
    assert read_chat_template(str(path)) == TOOL_TEMPLATE
    assert read_chat_template(None) is None
    with pytest.raises(ValueError, match="cannot be read"):
        read_chat_template(str(tmp_path / "missing.jinja"))
    (tmp_path / "bad.jinja").write_text("{% if %}")
    with pytest.raises(ValueError, match="not valid Jinja"):
        read_chat_template(str(tmp_path / "bad.jinja"))
