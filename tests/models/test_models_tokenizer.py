"""Tokenizers: the character-level vocabulary for synthetic tasks and the Hugging Face file format (checked
against transformers reading the same files)."""

import json
import string

import numpy as np
import pytest
import tokenizers
import transformers

from logra_jax.models import Tokenizer, char_tokenizer, preset
from logra_jax.models.tokenizer import CHAR_ALPHABET

# transformers.AutoTokenizer imports torch: this module runs on the one worker that imports it
# (tests/models/conftest.py)
pytestmark = pytest.mark.xdist_group("torch")


def test_char_tokenizer_has_fixed_ids_within_the_tiny_vocabulary():
    tok = char_tokenizer()
    assert tok.vocab_size <= preset("tiny").vocab_size
    assert (tok.pad_id, tok.bos_id, tok.eos_id) == (0, 1, 2)
    required = string.digits + string.ascii_letters + " \n+-*/=()<>%^.,:;!?'\"[]{}_#@&|~`$\\"
    assert set(required) <= set(CHAR_ALPHABET)
    ids = [tok.encode(c) for c in CHAR_ALPHABET]
    assert ids == [[3 + i] for i in range(len(CHAR_ALPHABET))]  # one id per character, in alphabet order
    assert char_tokenizer().backend.get_vocab() == tok.backend.get_vocab()


def test_char_tokenizer_round_trips_and_rejects_unknown_characters():
    tok = char_tokenizer()
    rng = np.random.default_rng(0)
    text = "".join(rng.choice(list(CHAR_ALPHABET), 300))
    assert tok.decode(tok.encode(text)) == text
    assert tok.encode("1+2", add_bos=True) == [tok.bos_id, *tok.encode("1+2")]
    assert tok.decode(tok.encode("<bos>7<eos>"), skip_special=False) == "<bos>7<eos>"
    assert tok.decode(tok.encode("<bos>7<eos>")) == "7"
    with pytest.raises(ValueError, match="×"):
        tok.encode("3×4")


def test_char_tokenizer_chat_format():
    tok = char_tokenizer()
    chat = [{"role": "user", "content": "12+30=?"}]
    assert tok.format_chat(chat) == "user: 12+30=?\nassistant: "
    assert tok.decode(tok.encode_chat(chat)) == "user: 12+30=?\nassistant: "


def test_saved_tokenizer_reloads_and_transformers_agrees(tmp_path):
    tok = char_tokenizer()
    tok.save(tmp_path)
    again = Tokenizer.from_directory(tmp_path)
    text = "Q: (7*8)-6 = ?\nA: 50."
    assert again.encode(text) == tok.encode(text)
    assert (again.bos_id, again.eos_id, again.pad_id) == (tok.bos_id, tok.eos_id, tok.pad_id)
    assert again.chat_template == tok.chat_template

    reference = transformers.AutoTokenizer.from_pretrained(tmp_path)
    assert reference(text, add_special_tokens=False)["input_ids"] == tok.encode(text)
    chat = [{"role": "user", "content": "2+2"}, {"role": "assistant", "content": "4"}]
    assert reference.apply_chat_template(chat, tokenize=False, add_generation_prompt=False) == tok.format_chat(
        chat, add_generation_prompt=False)


def _write_hf_tokenizer(directory, config):
    backend = tokenizers.Tokenizer(tokenizers.models.WordLevel({"<s>": 0, "</s>": 1, "hi": 2, "[UNK]": 3},
                                                               unk_token="[UNK]"))
    backend.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    backend.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps(config))


def test_from_directory_reads_added_token_dicts_and_template_variants(tmp_path):
    _write_hf_tokenizer(tmp_path, {
        "bos_token": {"content": "<s>", "special": True}, "eos_token": {"content": "</s>", "special": True},
        "add_bos_token": True,
        "chat_template": [{"name": "tool_use", "template": "T"}, {"name": "default", "template": "{{ bos_token }}D"}]})
    tok = Tokenizer.from_directory(tmp_path)
    assert (tok.bos_id, tok.eos_id, tok.pad_id) == (0, 1, 1)
    assert tok.encode("hi") == [0, 2]  # add_bos_token from the config
    assert tok.format_chat([]) == "<s>D"

    (tmp_path / "chat_template.jinja").write_text("{% for m in messages %}{{ m['content'] }}{% endfor %}")
    _write_hf_tokenizer(tmp_path, {"eos_token": "</s>"})
    assert Tokenizer.from_directory(tmp_path).format_chat([{"role": "user", "content": "x"}]) == "x"


def test_tokenizer_errors_name_the_problem(tmp_path):
    backend = char_tokenizer().backend
    with pytest.raises(ValueError, match="eos token '<end>'"):
        Tokenizer(backend, eos="<end>")
    with pytest.raises(ValueError, match="not valid Jinja"):
        Tokenizer(backend, eos="<eos>", chat_template="{% for %}")
    with pytest.raises(ValueError, match="no chat_template"):
        Tokenizer(backend, eos="<eos>").format_chat([])
    strict = Tokenizer(backend, eos="<eos>", chat_template="{{ raise_exception('roles must alternate') }}")
    with pytest.raises(ValueError, match="roles must alternate"):
        strict.format_chat([])
    with pytest.raises(FileNotFoundError, match=r"tokenizer\.json"):
        Tokenizer.from_directory(tmp_path)
    _write_hf_tokenizer(tmp_path, {"bos_token": "<s>"})
    with pytest.raises(ValueError, match=r"tokenizer_config\.json: no eos_token"):
        Tokenizer.from_directory(tmp_path)


# Templates written in the shape of the two families' (not copies): Qwen3's ChatML with its thinking switch
# (namespace, reversed message scan, string methods, an extra `enable_thinking` variable) and Gemma 3's turns
# (bos, "model" for the assistant, the system prompt folded into the first user turn, raise_exception, trim).
QWEN3_STYLE = """{%- set ns = namespace(last_user=messages|length - 1) %}
{%- for m in messages[::-1] %}{%- if m.role == 'user' and ns.last_user == messages|length - 1 %}
{%- set ns.last_user = messages|length - 1 - loop.index0 %}{%- endif %}{%- endfor %}
{%- for m in messages %}
{%- set content = m.content %}
{%- if m.role == 'assistant' and '</think>' in content %}
{%- set content = content.split('</think>')[-1].lstrip('\\n') %}{%- endif %}
{{- '<|im_start|>' + m.role + '\\n' + content + '<|im_end|>\\n' }}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}
{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}
{%- endif %}"""
GEMMA3_STYLE = """{{ bos_token }}
{%- if messages[0]['role'] == 'system' %}{%- set prefix = messages[0]['content'] + '\\n\\n' %}
{%- set rest = messages[1:] %}{%- else %}{%- set prefix = '' %}{%- set rest = messages %}{%- endif %}
{%- for m in rest %}
{%- if (m['role'] == 'user') != (loop.index0 % 2 == 0) %}
{{- raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{%- endif %}
{%- set role = 'model' if m['role'] == 'assistant' else m['role'] %}
{{- '<start_of_turn>' + role + '\\n' + (prefix if loop.first else '') + m['content'] | trim + '<end_of_turn>\\n' }}
{%- endfor %}
{%- if add_generation_prompt %}{{ '<start_of_turn>model\\n' }}{%- endif %}"""


@pytest.mark.parametrize("template", [QWEN3_STYLE, GEMMA3_STYLE], ids=["qwen3-style", "gemma3-style"])
def test_family_style_chat_templates_render_as_transformers(template, tmp_path):
    base = char_tokenizer()
    tok = Tokenizer(base.backend, eos=base.eos, bos=base.bos, pad=base.pad, chat_template=template)
    tok.save(tmp_path)
    reference = transformers.AutoTokenizer.from_pretrained(tmp_path)
    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2? "},
            {"role": "assistant", "content": "<think>\nadd\n</think>\n\n4"}, {"role": "user", "content": "3+3?"}]
    for variables in ({}, {"enable_thinking": False}):
        ours = Tokenizer.from_directory(tmp_path).format_chat(chat, **variables)
        assert ours == reference.apply_chat_template(chat, tokenize=False, add_generation_prompt=True, **variables)
    if template is GEMMA3_STYLE:
        with pytest.raises(ValueError, match="roles must alternate"):
            tok.format_chat(chat[:2] + chat[3:])
    else:
        assert tok.format_chat(chat, enable_thinking=False).endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
        assert "add" not in tok.format_chat(chat)
