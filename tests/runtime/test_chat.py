"""Chat prompts: a model's Jinja template rendered the transformers way, the fallback, clear errors."""
import pytest

from uacompile.runtime import chat
from uacompile.runtime.loader import load

from server_helpers import stories_path

CHATML = ("{% for message in messages %}{{'<|im_start|>' + message['role'] + '\\n' + message['content'] + "
          "'<|im_end|>' + '\\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")
LLAMA2 = ("{{ bos_token }}{% for message in messages %}{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
          "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
          "{% if message['role'] == 'user' %}{{ '[INST] ' + message['content'] | trim + ' [/INST]' }}"
          "{% else %}{{ ' ' + message['content'] | trim + eos_token }}{% endif %}{% endfor %}")


@pytest.fixture(scope="module")
def tok():
    return load(stories_path()).tokenizer


def with_template(tok, template):
    tok.chat_template, old = template, tok.chat_template
    return old


def test_model_template_is_rendered_like_transformers(tok):
    old = with_template(tok, CHATML)
    try:
        text = chat.render(tok, [{"role": "system", "content": "Be brief."},
                                 {"role": "user", "content": [{"type": "text", "text": "Hi"}]}])
    finally:
        tok.chat_template = old
    assert text == "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"


def test_raise_exception_in_a_template_is_a_value_error(tok):
    old = with_template(tok, LLAMA2)
    try:
        ok = chat.render(tok, [{"role": "user", "content": " Hi "}])
        with pytest.raises(ValueError, match="roles must alternate"):
            chat.render(tok, [{"role": "assistant", "content": "x"}])
    finally:
        tok.chat_template = old
    assert ok == "<s>[INST] Hi [/INST]"
    assert chat.encode(tok, ok)[0] == tok.bos_token_id and chat.encode(tok, ok).count(tok.bos_token_id) == 1


def test_fallback_template(tok):
    assert tok.chat_template is None  # stories260K ships none
    text = chat.render(tok, [{"role": "system", "content": "Stories."}, {"role": "user", "content": "Tell one."}])
    assert text == "<s>Stories.\n\nUser: Tell one.\nAssistant:"
    ids = chat.encode(tok, text)
    assert ids[0] == tok.bos_token_id and tok.decode(ids[1:]) == "Stories.\n\nUser: Tell one.\nAssistant:"


@pytest.mark.parametrize("messages,needle", [([], "non-empty"), ([{"role": "pirate", "content": "x"}], "role"),
                                             ([{"role": "user", "content": 5}], "content must be"),
                                             ([{"role": "user", "content": [{"type": "image_url"}]}], "text")])
def test_bad_messages(tok, messages, needle):
    with pytest.raises(ValueError, match=needle):
        chat.render(tok, messages)
