from __future__ import annotations

import datetime

import pytest

from app.chat_template import (
    CHATML_TEMPLATE,
    JOIN_SLICE,
    ChatTemplateError,
    RenderedTooLong,
    RenderLimit,
    normalize_messages,
    render_chat_template,
)

MESSAGES = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Héllo — 日本 😀"},
    {"role": "assistant", "content": "Hi!"},
]

# Templates exercising what real model templates use: whitespace control, loop controls,
# namespaces, tojson with keyword arguments, raise_exception, strftime_now, generation tags.
TEMPLATES = {
    "chatml": CHATML_TEMPLATE,
    "blocks": (
        "{% for m in messages %}\n"
        "    {% if m.role == 'system' %}\n"
        "[SYS] {{ m.content }}\n"
        "    {% else %}\n"
        "[{{ m.role | upper }}] {{ m.content }}\n"
        "    {% endif %}\n"
        "{% endfor %}\n"
        "{% if add_generation_prompt %}[ASSISTANT]{% endif %}"
    ),
    "namespace_loopcontrols": (
        "{% set ns = namespace(count=0) %}"
        "{% for m in messages %}{% if m.role == 'assistant' %}{% continue %}{% endif %}"
        "{% set ns.count = ns.count + 1 %}{{ m.content }}|"
        "{% if ns.count >= 5 %}{% break %}{% endif %}"
        "{% endfor %}{{ ns.count }}"
    ),
    "tojson": (
        "{{ messages | tojson }}\n{{ tools | tojson(indent=2) }}\n"
        "{{ {'b': 1, 'a': 'é'} | tojson(sort_keys=True) }}"
    ),
    "generation_tag": (
        "{% for m in messages %}{% if m.role == 'assistant' %}{% generation %}"
        "<a>{{ m.content }}</a>{% endgeneration %}{% else %}<{{ m.role }}>{{ m.content }}"
        "{% endif %}{% endfor %}"
    ),
    "kwargs": (
        "{{ bos_token }}"
        "{% if enable_thinking is defined and not enable_thinking %}/no_think{% endif %}"
    ),
}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Météo"}}]


@pytest.mark.parametrize("name", sorted(TEMPLATES))
def test_renders_like_transformers(name):
    from transformers.utils.chat_template_utils import render_jinja_template

    kwargs = {"bos_token": "<s>", "enable_thinking": False, "tools": TOOLS}
    ours = render_chat_template(TEMPLATES[name], MESSAGES, add_generation_prompt=True, **kwargs)
    rendered, _generation_indices = render_jinja_template(
        conversations=[MESSAGES],
        chat_template=TEMPLATES[name],
        add_generation_prompt=True,
        **kwargs,
    )
    assert ours == rendered[0]


@pytest.mark.parametrize("num_messages", [JOIN_SLICE - 1, JOIN_SLICE, 2 * JOIN_SLICE + 3])
def test_a_long_conversation_renders_whole(num_messages):
    """The rendered pieces are joined a slice at a time: none lost or reordered."""
    from transformers.utils.chat_template_utils import render_jinja_template

    messages = [
        {"role": "user" if i % 2 else "assistant", "content": f"m{i}"} for i in range(num_messages)
    ]
    ours = render_chat_template(CHATML_TEMPLATE, messages, add_generation_prompt=True)
    rendered, _generation_indices = render_jinja_template(
        conversations=[messages], chat_template=CHATML_TEMPLATE, add_generation_prompt=True
    )
    assert ours == rendered[0]
    assert ours.count("<|im_start|>") == num_messages + 1


def test_rendering_stops_once_the_text_passes_its_limit():
    """A conversation far beyond the limit is never rendered whole; one within it renders
    as without a limit, and dropped characters do not count towards it."""
    messages = [{"role": "user", "content": "x\x04"} for _ in range(20 * JOIN_SLICE)]
    full = render_chat_template(CHATML_TEMPLATE, messages)
    with pytest.raises(RenderedTooLong) as raised:
        render_chat_template(CHATML_TEMPLATE, messages, limit=RenderLimit(len(full) // 10))
    assert len(full) // 10 < raised.value.num_chars <= len(full) // 5
    assert render_chat_template(CHATML_TEMPLATE, messages, limit=RenderLimit(len(full))) == full
    num_dropped = full.count("\x04")
    assert (
        render_chat_template(
            CHATML_TEMPLATE, messages, limit=RenderLimit(len(full) - num_dropped, dropped="\x04")
        )
        == full
    )
    with pytest.raises(RenderedTooLong):
        render_chat_template(
            CHATML_TEMPLATE, messages, limit=RenderLimit(len(full) - num_dropped - 1)
        )


def test_tojson_keeps_non_ascii():
    out = render_chat_template(
        "{{ messages[0].content | tojson }}", [{"role": "u", "content": "é😀"}]
    )
    assert out == '"é😀"'


def test_whitespace_control():
    out = render_chat_template(TEMPLATES["blocks"], MESSAGES[:2], add_generation_prompt=False)
    assert out == "[SYS] Be brief.\n[USER] Héllo — 日本 😀\n"


def test_raise_exception_becomes_chat_template_error():
    template = (
        "{% if messages[0].role != 'user' %}"
        "{{ raise_exception('Conversation must start with user') }}{% endif %}"
    )
    with pytest.raises(ChatTemplateError, match="Conversation must start with user"):
        render_chat_template(template, MESSAGES)


def test_syntax_error_becomes_chat_template_error():
    with pytest.raises(ChatTemplateError, match="invalid chat template"):
        render_chat_template("{% for m in messages %}{{ m.content }}", MESSAGES)


def test_runtime_errors_become_chat_template_error():
    with pytest.raises(ChatTemplateError):
        render_chat_template("{{ messages[0].content + 1 }}", MESSAGES)
    with pytest.raises(ChatTemplateError):
        render_chat_template("{{ undefined_thing.attr }}", MESSAGES)


def test_sandbox_blocks_python_internals():
    with pytest.raises(ChatTemplateError):
        render_chat_template("{{ ''.__class__.__mro__[1].__subclasses__() }}", MESSAGES)
    with pytest.raises(ChatTemplateError):
        render_chat_template("{% set ns = namespace(_x=1) %}{{ ns._x }}", MESSAGES)
    with pytest.raises(ChatTemplateError):  # immutable: templates cannot mutate the messages
        render_chat_template("{{ messages.append(1) }}", MESSAGES)


def test_strftime_now():
    out = render_chat_template("{{ strftime_now('%Y') }}", MESSAGES)
    assert out in {str(datetime.datetime.now().year), str(datetime.datetime.now().year - 1)}


def test_list_of_text_parts_is_joined():
    messages = [
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}
    ]
    assert normalize_messages(messages)[0]["content"] == "a\nb"
    assert messages[0]["content"][0]["text"] == "a"  # the caller's message is not modified
    out = render_chat_template(CHATML_TEMPLATE, messages, add_generation_prompt=False)
    assert out == "<|im_start|>user\na\nb<|im_end|>\n"


def test_non_text_parts_are_rejected():
    messages = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]
    with pytest.raises(ChatTemplateError, match="image_url"):
        render_chat_template(CHATML_TEMPLATE, messages)


def test_messages_must_be_objects():
    with pytest.raises(ChatTemplateError, match="message 0"):
        render_chat_template(CHATML_TEMPLATE, ["hello"])  # type: ignore[list-item]


def test_chat_template_error_is_a_value_error():
    assert issubclass(ChatTemplateError, ValueError)
