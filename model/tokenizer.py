"""The checkpoint's tokenizer: a byte-level BPE loaded from `tokenizer.json`.

Owns: loading (an official checkpoint's `tokenizer/tokenizer.json`, or the small
tokenizer bundled for the embedded default model), special-token ids read from the
file, and the two ways of turning text into ids:

- `encode_control` is for markers the chat encoder wrote itself (`<｜User｜>`,
  `</think>`, ...): added tokens in the text become their ids.
- `encode_content` is for everything a user, a file, a tool or the model wrote: no
  added token is ever matched, so a literal `<｜User｜>` or `<｜deepseek_image｜>` in a
  file becomes ordinary byte-level tokens, never a control id.

Does not own: the chat format (`model/chat.py` decides which text is control and
which is content) or completion parsing (`model/dsml.py`). No token id is hard-coded
here; the bundled tokenizer's ids are fixed by `scripts/train_tokenizer.py`.
"""

from __future__ import annotations

from functools import cached_property
from pathlib import Path

from tokenizers import Tokenizer as _HFTokenizer

BOS_TOKEN = "<｜begin▁of▁sentence｜>"
EOS_TOKEN = "<｜end▁of▁sentence｜>"
PAD_TOKEN = "<｜▁pad▁｜>"
IMAGE_TOKEN = "<｜deepseek_image｜>"

BUNDLED_PATH = Path(__file__).resolve().parent / "assets" / "tokenizer" / "tokenizer.json"


class TokenizerError(ValueError):
    """A tokenizer file is missing, unreadable or lacks a token the runtime needs."""


class UnknownTokenError(TokenizerError, KeyError):
    """A special/added token was asked for by name but the tokenizer has no such token."""

    def __str__(self) -> str:  # KeyError would repr() the message
        return str(self.args[0]) if self.args else ""


class Tokenizer:
    """Byte-level BPE with the V4.1 special tokens; see the module docstring."""

    def __init__(self, hf: _HFTokenizer, *, source: str) -> None:
        self.source = source
        self._control = hf
        # A second instance so the content path never shares a mutable flag with the
        # control path: `encode_special_tokens` turns off matching of *special* added
        # tokens only; non-special ones (the image placeholder) are split in _content_ids.
        self._content = _HFTokenizer.from_str(hf.to_str())
        self._content.encode_special_tokens = True
        self._added = {t.content: i for i, t in hf.get_added_tokens_decoder().items()}
        self._control_ids = frozenset(self._added.values())

    # -- loading ---------------------------------------------------------------------

    @classmethod
    def from_file(cls, path: str | Path) -> Tokenizer:
        path = Path(path)
        if not path.is_file():
            raise TokenizerError(f"tokenizer file not found: {path}")
        try:
            hf = _HFTokenizer.from_file(str(path))
        except Exception as exc:  # the library raises a bare Exception on bad JSON
            raise TokenizerError(f"cannot read tokenizer {path}: {exc}") from exc
        return cls(hf, source=str(path))

    @classmethod
    def from_checkpoint(cls, directory: str | Path) -> Tokenizer:
        """Load `DIR/tokenizer/tokenizer.json`, the layout of the official V4.1 checkpoint."""
        return cls.from_file(Path(directory) / "tokenizer" / "tokenizer.json")

    @classmethod
    def bundled(cls) -> Tokenizer:
        """The small tokenizer shipped with the package for the embedded default model."""
        return cls.from_file(BUNDLED_PATH)

    # -- special tokens --------------------------------------------------------------

    @classmethod
    def of(cls, model) -> Tokenizer:
        """The tokenizer a loaded model's ids mean (``model.loading.load`` records its file):
        a checkpoint's own, else the bundled one."""
        path = getattr(model, "tokenizer_json", None)
        return cls.from_file(path) if path else cls.bundled()

    def token_id(self, text: str) -> int:
        """The id of a special/added token such as `<｜User｜>`."""
        try:
            return self._added[text]
        except KeyError:
            raise UnknownTokenError(
                f"tokenizer {self.source} has no added token {text!r}"
            ) from None

    def has_token(self, text: str) -> bool:
        return text in self._added

    def is_control(self, token_id: int) -> bool:
        """True for every added token (special or not): ids content must never produce."""
        return token_id in self._control_ids

    @property
    def control_ids(self) -> frozenset[int]:
        return self._control_ids

    @cached_property
    def bos_id(self) -> int:
        return self.token_id(BOS_TOKEN)

    @cached_property
    def eos_id(self) -> int:
        return self.token_id(EOS_TOKEN)

    @cached_property
    def pad_id(self) -> int:
        return self.token_id(PAD_TOKEN)

    @cached_property
    def image_token_id(self) -> int:
        return self.token_id(IMAGE_TOKEN)

    @property
    def vocab_size(self) -> int:
        return self._control.get_vocab_size(with_added_tokens=True)

    # -- text <-> ids ----------------------------------------------------------------

    def encode_control(self, text: str) -> list[int]:
        """Markers written by the chat encoder: added tokens are matched."""
        return self._control.encode(text, add_special_tokens=False).ids

    def encode_content(self, text: str) -> list[int]:
        """User/file/tool/model text: never yields a control id, whatever it contains."""
        ids = self._content_ids(text)
        if any(i in self._control_ids for i in ids):
            # BPE merges never cross the pre-tokenizer's splits, so this is not expected;
            # if a vocabulary ever allows it, fall back to one character at a time.
            ids = [i for ch in text for i in self._content_ids(ch)]
        return ids

    def _content_ids(self, text: str) -> list[int]:
        cuts = self._added_token_cuts(text)
        if not cuts:
            return self._content.encode(text, add_special_tokens=False).ids
        pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]
        return [i for p in pieces if p for i in self._content.encode(p, add_special_tokens=False).ids]

    def _added_token_cuts(self, text: str) -> list[int]:
        """Cut points one character inside every occurrence of an added token, so no
        piece holds a whole added token and the library cannot match it."""
        cuts: set[int] = set()
        for token in self._added:
            start = text.find(token)
            while start != -1:
                cuts.add(start + 1)
                start = text.find(token, start + 1)
        return sorted(cuts)

    def decode(self, ids: list[int], skip_special: bool = False) -> str:
        return self._control.decode(list(ids), skip_special_tokens=skip_special)

    def id_to_token(self, token_id: int) -> str:
        """The raw vocabulary string (byte-level alphabet, e.g. `Ġthe`)."""
        token = self._control.id_to_token(token_id)
        if token is None:
            raise UnknownTokenError(f"token id {token_id} is outside the vocabulary")
        return token

    def token_text(self, token_id: int) -> str:
        """The decoded text of one id (partial UTF-8 sequences decode to U+FFFD)."""
        return self._control.decode([token_id], skip_special_tokens=False)

    def __repr__(self) -> str:
        return f"Tokenizer(source={self.source!r}, vocab_size={self.vocab_size})"
