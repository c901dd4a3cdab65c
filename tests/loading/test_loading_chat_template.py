"""Chat template rendering: HF-compatible environment, content parts, errors, no template, the sandbox."""

from __future__ import annotations

import datetime

import pytest
from tiny_llama_files import random_hf_weights, tiny_config, write_tiny_gguf, write_tiny_hf_dir

from flm_runtime.errors import InvalidRequestError, ModelFormatError, NoChatTemplateError
from flm_runtime.loading import load_model_files
from flm_runtime.loading.chat_template import check_chat_template, render_chat_template

MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
CHATML = ("{% for message in messages %}"
          "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
          "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")


@pytest.mark.parametrize("template", [None, ""])
def test_no_template_is_a_base_model_and_names_text_completion(template):
    with pytest.raises(NoChatTemplateError) as info:
        render_chat_template(template, MESSAGES)
    assert isinstance(info.value, InvalidRequestError) and info.value.param == "messages"
    assert "base model without a chat template" in str(info.value)
    assert "text completion" in str(info.value)


def test_trim_and_lstrip_blocks_like_transformers():
    template = ("{% for m in messages %}\n"
                "    {% if m.role == 'user' %}\n"
                "[{{ m.content }}]\n"
                "    {% endif %}\n"
                "{% endfor %}")
    assert render_chat_template(template, MESSAGES) == "[Hi]\n"


def test_variables_and_globals():
    template = ("{{ bos_token }}{{ messages | length }}{{ eos_token }}|{{ extra_flag }}|"
                "{{ strftime_now('%Y') }}|{{ {'k': 'é'} | tojson }}")
    out = render_chat_template(template, MESSAGES, bos_token="<s>", eos_token="</s>",
                               extra_flag=True)
    assert out == f'<s>2</s>|True|{datetime.datetime.now().year}|{{"k": "é"}}'


def test_content_parts_are_flattened():
    messages = [{"role": "user", "content": [{"type": "text", "text": "a"},
                                             {"type": "text", "text": "b"}]},
                {"role": "assistant", "content": None, "tool_calls": []}]
    out = render_chat_template(CHATML, messages, add_generation_prompt=False)
    assert out == "<|im_start|>user\na\nb<|im_end|>\n<|im_start|>assistant\n<|im_end|>\n"
    assert messages[0]["content"][0] == {"type": "text", "text": "a"}  # caller's list untouched


@pytest.mark.parametrize("messages", [
    [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}],
    [{"role": "user", "content": [{"type": "text"}]}],
    [{"role": "user", "content": 3}],
    [{"content": "no role"}],
    "not a list",
])
def test_bad_messages_raise_invalid_request(messages):
    with pytest.raises(InvalidRequestError) as e:
        render_chat_template(CHATML, messages)
    assert e.value.param == "messages"


def test_raise_exception_in_template_becomes_invalid_request():
    template = ("{% if messages[0].role != 'user' %}"
                "{{ raise_exception('Conversation must start with a user message') }}{% endif %}")
    with pytest.raises(InvalidRequestError, match="must start with a user message") as e:
        render_chat_template(template, MESSAGES)
    assert e.value.param == "messages"


def test_syntax_error_and_type_error_become_invalid_request():
    with pytest.raises(InvalidRequestError, match="chat template"):
        render_chat_template("{% for %}", MESSAGES)
    with pytest.raises(InvalidRequestError):
        render_chat_template("{{ messages[0].content + 1 }}", MESSAGES)


# Templates that name an attribute outside the sandbox outright: refused at load (the attribute
# named), and at render too.
NAMED_ESCAPES = {
    "{{ ''.__class__.__mro__[1].__subclasses__() }}": "__subclasses__",  # the outermost first
    "{{ messages.__class__ }}": "__class__",
    "{{ cycler.__init__.__globals__.os }}": "__globals__",
    "{{ self._TemplateReference__context }}": "_TemplateReference__context",
    "{{ dict.__subclasses__() }}": "__subclasses__",
    "{{ joiner['__init__'] }}": "__init__",
    "{{ namespace | attr('__init__') }}": "__init__",
    "{% for m in messages %}{{ m.content }}{% endfor %}\n{{ lipsum.__globals__['os'].popen('id').read() }}": "__globals__",
}


@pytest.mark.parametrize("template, attribute", NAMED_ESCAPES.items())
def test_a_template_naming_an_attribute_outside_the_sandbox_is_refused_at_load_and_at_render(template, attribute):
    with pytest.raises(ModelFormatError) as info:
        check_chat_template(template, "m.gguf")
    line = template.count("\n") + 1
    assert str(info.value) == f"m.gguf: the chat template reads attribute {attribute!r} (line {line}), which its sandbox refuses"
    with pytest.raises(ModelFormatError, match="^m.gguf: the chat template reached outside its sandbox: "):
        render_chat_template(template, MESSAGES, template_source="m.gguf")


# Templates that reach outside the sandbox only when they run: a computed name, str.format, a
# method that modifies its object. Jinja alone renders the first two as empty strings.
RUNTIME_ESCAPES = {
    "{{ messages | attr('_' ~ '_class__') }}": "access to attribute '__class__' of 'list' object is unsafe",
    "{% set name = '__cla' ~ 'ss__' %}{{ messages[name] }}": "access to attribute '__class__' of 'list' object is unsafe",
    "{{ '{0.__class__}'.format(messages) }}": "access to attribute '__class__' of 'list' object is unsafe",
    "{{ messages.append(1) }}": "access to attribute 'append' of 'list' object is unsafe",
}


@pytest.mark.parametrize("template, why", RUNTIME_ESCAPES.items())
def test_a_template_reaching_outside_the_sandbox_at_render_is_refused(template, why):
    check_chat_template(template, "m.gguf")  # nothing named outright
    with pytest.raises(ModelFormatError) as info:
        render_chat_template(template, MESSAGES, template_source="m.gguf")
    assert str(info.value) == f"m.gguf: the chat template reached outside its sandbox: {why}"


def test_single_underscore_keys_of_a_mapping_are_the_templates_to_read():
    template = "{{ messages[0]['_note'] }}|{% set ns = namespace(n=1) %}{{ ns.n }}"
    check_chat_template(template, "m.gguf")
    assert render_chat_template(template, [{"role": "user", "content": "", "_note": "kept"}]) == "kept|1"


def test_a_model_whose_template_names_an_escape_is_refused_at_load_from_either_format(tmp_path):
    config, template = tiny_config(), "{{ cycler.__init__.__globals__.os.popen('id').read() }}"
    weights = random_hf_weights(config)
    for path in (write_tiny_gguf(tmp_path / "t.gguf", config, weights, chat_template=template),
                 write_tiny_hf_dir(tmp_path / "hf", config, weights, chat_template=template)):
        with pytest.raises(ModelFormatError) as info:
            load_model_files(path)
        assert str(info.value) == (f"{path}: the chat template reads attribute '__globals__' (line 1), "
                                   "which its sandbox refuses")
