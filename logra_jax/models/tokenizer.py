"""Tokenizers behind one small interface: encode, decode, special ids and chat formatting.

Three sources build the same `Tokenizer` (a `tokenizers.Tokenizer` plus its special tokens and chat template):
  * a Hugging Face directory (tokenizer.json + tokenizer_config.json): `Tokenizer.from_directory`;
  * the byte-level BPE embedded in a GGUF file: `logra_jax.models.gguf.tokenizer_from_gguf`;
  * a character-level vocabulary for synthetic tasks: `char_tokenizer()`.

Chat formatting renders the tokenizer's Jinja chat template the way Hugging Face does (sandboxed, trim_blocks,
lstrip_blocks, loop controls), so SmolLM2/Qwen ChatML and any other template come out exactly as their authors
wrote them. `save` writes tokenizer.json + tokenizer_config.json, which `from_directory` (and transformers) read.
"""

from __future__ import annotations

import datetime
import json
import string
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
import jinja2.sandbox
import tokenizers

from logra_jax.models.jsonfile import read_json_object

Message = Mapping[str, str]

# Character-level vocabulary: special tokens first, then a fixed alphabet (ids never change between versions).
CHAR_SPECIALS = ("<pad>", "<bos>", "<eos>")
CHAR_ALPHABET = string.digits + string.ascii_lowercase + string.ascii_uppercase + " \n" + string.punctuation
# One "role: content" line per message; the generation prompt opens the assistant's line.
CHAR_CHAT_TEMPLATE = (
    "{% for message in messages %}{{ message['role'] }}: {{ message['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant: {% endif %}")


def _raise_exception(message: str) -> None:
    raise ValueError(f"chat template error: {message}")


def _compile_template(source: str) -> jinja2.Template:
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = lambda x, indent=None: json.dumps(x, ensure_ascii=False, indent=indent)
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.datetime.now().strftime(fmt)  # Llama 3.x templates
    try:
        return env.from_string(source)
    except jinja2.TemplateSyntaxError as err:
        raise ValueError(f"chat_template is not valid Jinja (line {err.lineno}): {err.message}") from err


class Tokenizer:
    """Text ↔ token ids with special ids and chat formatting, over a `tokenizers.Tokenizer`.

    Args:
      backend: the `tokenizers.Tokenizer` doing the work; its post-processor is not used (see `add_bos`).
      eos: end-of-sequence token text; generation stops on it.
      bos: beginning-of-sequence token text, or None.
      pad: padding token text; None pads with eos.
      chat_template: Jinja chat template (Hugging Face conventions), or None.
      add_bos: whether `encode` prepends bos by default.

    Raises:
      ValueError: a special token is not in the vocabulary, or the chat template does not compile.

    Example:
      >>> tok = char_tokenizer()
      >>> tok.decode(tok.encode("12+7=19"))
      '12+7=19'
    """

    def __init__(self, backend: tokenizers.Tokenizer, *, eos: str, bos: str | None = None, pad: str | None = None,
                 chat_template: str | None = None, add_bos: bool = False):
        self.backend = backend
        self.eos, self.bos, self.pad = eos, bos, pad
        for field, token in (("eos", eos), ("bos", bos), ("pad", pad)):
            if token is not None and backend.token_to_id(token) is None:
                raise ValueError(f"Tokenizer: {field} token {token!r} is not in the vocabulary")
        self.chat_template = chat_template
        self._template = None if chat_template is None else _compile_template(chat_template)
        self.add_bos = bool(add_bos)

    @property
    def vocab_size(self) -> int:
        """Number of ids the tokenizer can produce (a model's vocabulary must be at least this large)."""
        return self.backend.get_vocab_size(with_added_tokens=True)

    @property
    def eos_id(self) -> int:
        return self.backend.token_to_id(self.eos)

    @property
    def bos_id(self) -> int | None:
        return None if self.bos is None else self.backend.token_to_id(self.bos)

    @property
    def pad_id(self) -> int:
        return self.eos_id if self.pad is None else self.backend.token_to_id(self.pad)

    def encode(self, text: str, *, add_bos: bool | None = None) -> list[int]:
        """Token ids of `text`; special-token strings in the text (e.g. "<|im_start|>") become their ids.

        add_bos: prepend bos (None: the tokenizer's default `self.add_bos`).

        Raises:
          ValueError: `text` holds characters the vocabulary cannot express (named in the message).
        """
        try:
            ids = self.backend.encode(text, add_special_tokens=False).ids
        except Exception as err:  # tokenizers raises a bare Exception for out-of-vocabulary input
            bad = sorted({c for c in text if not self._encodable(c)})
            raise ValueError(f"Tokenizer.encode: characters {bad} are not in the vocabulary ({err})") from err
        if (self.add_bos if add_bos is None else add_bos) and self.bos is not None:
            ids = [self.bos_id, *ids]
        return ids

    def _encodable(self, char: str) -> bool:
        try:
            self.backend.encode(char, add_special_tokens=False)
        except Exception:
            return False
        return True

    def decode(self, ids: Sequence[int], *, skip_special: bool = True) -> str:
        """Text of `ids`; special tokens are dropped unless skip_special=False."""
        return self.backend.decode([int(i) for i in ids], skip_special_tokens=skip_special)

    def format_chat(self, messages: Sequence[Message], *, add_generation_prompt: bool = True,
                    **variables: Any) -> str:
        """The chat template rendered for `messages` ([{"role": ..., "content": ...}, ...]).

        `variables` are passed to the template as Hugging Face's `apply_chat_template` passes its extra keyword
        arguments (e.g. Qwen3's enable_thinking=False).

        Raises:
          ValueError: the tokenizer has no chat template, or the template rejects the messages.
        """
        if self._template is None:
            raise ValueError("Tokenizer.format_chat: this tokenizer has no chat_template")
        return self._template.render(**variables, messages=list(messages),
                                     add_generation_prompt=add_generation_prompt, bos_token=self.bos or "",
                                     eos_token=self.eos)

    def encode_chat(self, messages: Sequence[Message], *, add_generation_prompt: bool = True,
                    **variables: Any) -> list[int]:
        """Token ids of `format_chat(messages, ...)` (the template itself decides about bos)."""
        text = self.format_chat(messages, add_generation_prompt=add_generation_prompt, **variables)
        return self.encode(text, add_bos=False)

    def save(self, directory: str | Path) -> None:
        """Write tokenizer.json and tokenizer_config.json (Hugging Face format) into an existing `directory`."""
        directory = Path(directory)
        self.backend.save(str(directory / "tokenizer.json"))
        config: dict[str, Any] = {
            "tokenizer_class": "PreTrainedTokenizerFast", "eos_token": self.eos, "bos_token": self.bos,
            "pad_token": self.pad if self.pad is not None else self.eos, "add_bos_token": self.add_bos,
            "clean_up_tokenization_spaces": False}
        if self.chat_template is not None:
            config["chat_template"] = self.chat_template
        (directory / "tokenizer_config.json").write_text(json.dumps(config, indent=2, ensure_ascii=False))

    @classmethod
    def from_directory(cls, directory: str | Path) -> Tokenizer:
        """The tokenizer of a Hugging Face model directory (tokenizer.json + tokenizer_config.json).

        The chat template comes from tokenizer_config.json or chat_template.jinja; token fields may be strings
        or AddedToken dicts. Raises FileNotFoundError when tokenizer.json is missing and ValueError, naming the
        file, when tokenizer.json is unreadable, tokenizer_config.json is not a JSON object or names no eos token.
        """
        directory = Path(directory)
        path = directory / "tokenizer.json"
        if not path.is_file():
            raise FileNotFoundError(f"no tokenizer.json in {directory}")
        try:
            backend = tokenizers.Tokenizer.from_file(str(path))
        except Exception as err:  # the Rust library raises a bare Exception ("expected value at line 1 ...")
            raise ValueError(f"{path}: not a readable tokenizer.json ({err})") from err
        config_path = directory / "tokenizer_config.json"
        config = read_json_object(config_path) if config_path.is_file() else {}

        def token(name: str) -> str | None:
            value = config.get(name)
            return value.get("content") if isinstance(value, dict) else value

        template = config.get("chat_template")
        if isinstance(template, list):  # named templates: [{"name": "default", "template": ...}, ...]
            template = next((t["template"] for t in template if t.get("name") == "default"), None)
        jinja_path = directory / "chat_template.jinja"
        if template is None and jinja_path.is_file():
            template = jinja_path.read_text()
        eos = token("eos_token")
        if eos is None:
            raise ValueError(f"{config_path}: no eos_token")
        return cls(backend, eos=eos, bos=token("bos_token"), pad=token("pad_token"), chat_template=template,
                   add_bos=bool(config.get("add_bos_token", False)))


def char_tokenizer() -> Tokenizer:
    """Character-level tokenizer for synthetic tasks: ids 0..2 = <pad>, <bos>, <eos>, then `CHAR_ALPHABET`
    (digits, lowercase, uppercase, space, newline, ASCII punctuation) in that order: 99 ids, within the tiny
    preset's vocabulary of 128. Characters outside the alphabet raise ValueError on encode.

    Example:
      >>> tok = char_tokenizer()
      >>> tok.encode("1+2", add_bos=True)
      [1, 4, 77, 5]
    """
    vocab = {t: i for i, t in enumerate((*CHAR_SPECIALS, *CHAR_ALPHABET))}
    backend = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab))
    backend.pre_tokenizer = tokenizers.pre_tokenizers.Split(tokenizers.Regex(r"[\s\S]"), behavior="isolated")
    backend.decoder = tokenizers.decoders.Fuse()
    backend.add_special_tokens([tokenizers.AddedToken(t, special=True, normalized=False) for t in CHAR_SPECIALS])
    return Tokenizer(backend, eos="<eos>", bos="<bos>", pad="<pad>", chat_template=CHAR_CHAT_TEMPLATE)
