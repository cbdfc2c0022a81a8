"""Tokenizers for SFT data: a download-free byte-level tokenizer and a Hugging Face wrapper.

Both expose the same small interface (Megatron names kept where Megatron has one):
``encode``/``tokenize``, ``decode``/``detokenize``, ``vocab_size``, ``eod``, ``pad``, ``bos``,
plus the chat markers the SFT template needs: ``role_prefix(role)`` (ids that open a turn),
``turn_end`` (ids that close a turn; trained for assistant turns, so the model learns to stop)
and ``turn_sep`` (ids after a turn, never trained).

Select with :func:`build_tokenizer` (``--tokenizer-type`` / ``--tokenizer-model``).
"""
from __future__ import annotations

import abc
import os
from typing import Any, Iterable, Optional

ROLES = ("system", "user", "assistant")
TOKENIZER_TYPES = ("ByteLevelTokenizer", "HFTokenizer", "HuggingFaceTokenizer")
# Megatron-LM's name for the Hugging Face tokenizer; normalised to HFTokenizer.
TOKENIZER_ALIASES = {"HuggingFaceTokenizer": "HFTokenizer"}
DEFAULT_TOKENIZER_TYPE = "ByteLevelTokenizer"


class SFTTokenizer(abc.ABC):
    """Interface shared by every tokenizer the data stage accepts."""

    #: ``--tokenizer-type`` value that rebuilds this tokenizer.
    tokenizer_type: str = ""

    @property
    @abc.abstractmethod
    def vocab_size(self) -> int:
        """Number of token ids (every id is in ``[0, vocab_size)``)."""

    @property
    @abc.abstractmethod
    def eod(self) -> int:
        """End-of-document / end-of-turn id."""

    @property
    @abc.abstractmethod
    def pad(self) -> int:
        """Padding id (never trained)."""

    @property
    @abc.abstractmethod
    def bos(self) -> Optional[int]:
        """Begin-of-sequence id, or None when the vocabulary has none."""

    @abc.abstractmethod
    def encode(self, text: str) -> list[int]:
        """Token ids of ``text`` (no BOS/EOS added)."""

    @abc.abstractmethod
    def decode(self, ids: Iterable[int]) -> str:
        """Text of ``ids``; special tokens are rendered by name."""

    @abc.abstractmethod
    def role_prefix(self, role: str) -> list[int]:
        """Ids that open a turn of ``role`` (one of :data:`ROLES`)."""

    @property
    @abc.abstractmethod
    def turn_end(self) -> list[int]:
        """Ids that close a turn (trained after assistant content)."""

    @property
    def turn_sep(self) -> list[int]:
        """Ids placed after ``turn_end`` (formatting only, never trained)."""
        return []

    @abc.abstractmethod
    def describe(self) -> dict[str, Any]:
        """JSON-able identity stored next to a preprocessed dataset (type, model, ids)."""

    # Megatron's tokenizer names for the same operations.
    def tokenize(self, text: str) -> list[int]:
        return self.encode(text)

    def detokenize(self, ids: Iterable[int]) -> str:
        return self.decode(ids)

    def _check_role(self, role: str) -> None:
        if role not in ROLES:
            raise ValueError(f"unknown role {role!r}; expected one of {', '.join(ROLES)}")


class ByteLevelTokenizer(SFTTokenizer):
    """UTF-8 bytes (ids 0..255) plus six special tokens; needs no files.

    Ids: 256 ``<|pad|>``, 257 ``<|bos|>``, 258 ``<|eos|>``, 259 ``<|system|>``,
    260 ``<|user|>``, 261 ``<|assistant|>``.  Special-token *text* inside content is
    encoded as plain bytes (never as the special id), so data cannot forge turn markers.
    """

    tokenizer_type = "ByteLevelTokenizer"
    SPECIALS = ("<|pad|>", "<|bos|>", "<|eos|>", "<|system|>", "<|user|>", "<|assistant|>")
    PAD, BOS, EOS, SYSTEM, USER, ASSISTANT = range(256, 262)

    @property
    def vocab_size(self) -> int:
        return 256 + len(self.SPECIALS)

    @property
    def eod(self) -> int:
        return self.EOS

    @property
    def pad(self) -> int:
        return self.PAD

    @property
    def bos(self) -> Optional[int]:
        return self.BOS

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: Iterable[int]) -> str:
        out: list[str] = []
        buf = bytearray()
        for raw in ids:
            i = int(raw)
            if 0 <= i < 256:
                buf.append(i)
                continue
            if not 256 <= i < self.vocab_size:
                raise ValueError(f"token id {i} outside the byte-level vocabulary "
                                 f"[0, {self.vocab_size})")
            # Flush pending bytes first so a multi-byte character is not split by a marker.
            out.append(buf.decode("utf-8", errors="replace"))
            buf.clear()
            out.append(self.SPECIALS[i - 256])
        out.append(buf.decode("utf-8", errors="replace"))
        return "".join(out)

    def role_prefix(self, role: str) -> list[int]:
        self._check_role(role)
        return [self.SYSTEM + ROLES.index(role)]

    @property
    def turn_end(self) -> list[int]:
        return [self.EOS]

    def describe(self) -> dict[str, Any]:
        return {"type": self.tokenizer_type, "model": None, "vocab_size": self.vocab_size,
                "eod": self.eod, "pad": self.pad, "bos": self.bos}


# Names tried, in order, when a Hugging Face vocabulary is searched for a special token.
_EOD_NAMES = ("<|eos|>", "<|endoftext|>", "</s>", "<eos>", "<|im_end|>")
_PAD_NAMES = ("<|pad|>", "<pad>", "[PAD]")
_BOS_NAMES = ("<|bos|>", "<s>", "<bos>")
_SKRULL_ROLES = {r: f"<|{r}|>" for r in ROLES}
_CHATML = ("<|im_start|>", "<|im_end|>")


class HFTokenizer(SFTTokenizer):
    """Hugging Face tokenizer: a tokenizer directory or a bare ``tokenizer.json``.

    A directory (``tokenizer.json``, ``tokenizer_config.json``, optional
    ``chat_template.jinja``) is loaded with transformers' ``AutoTokenizer``; when it has a chat
    template, conversations are rendered by ``apply_chat_template`` and the loss mask covers
    the assistant replies (:mod:`megatron.skrull.chat_template`); ``chat_format`` is then
    ``"template"``.  Without a template (and for a bare ``tokenizer.json``) chat markers come
    from the vocabulary: Skrull role tokens (``<|system|>``, ``<|user|>``,
    ``<|assistant|>``, closed by the EOD token) or ChatML (``<|im_start|>role\\n ...
    <|im_end|>\\n``).  EOD is the tokenizer's ``eos_token`` when its config names one, else the
    first of ``<|eos|>``, ``<|endoftext|>``, ``</s>``, ``<eos>``, ``<|im_end|>`` present; PAD
    falls back to EOD and BOS to None.

    Args:
        path: A tokenizer directory or the path of a ``tokenizer.json`` file.

    Raises:
        FileNotFoundError: ``path`` does not exist.
        ValueError: Not a tokenizer, or no EOD token, or neither a chat template nor markers.
    """

    tokenizer_type = "HFTokenizer"

    def __init__(self, path: str) -> None:
        if not os.path.exists(path):
            raise FileNotFoundError(f"--tokenizer-model {path!r} does not exist; pass a Hugging "
                                    "Face tokenizer directory or tokenizer.json file")
        self.path = os.path.abspath(path)
        self.hf = _load_transformers_tokenizer(path)
        self._tok = self.hf.backend_tokenizer
        self.chat_template = self.hf.chat_template if os.path.isdir(path) else None
        eos = self.hf.eos_token_id if os.path.isdir(path) else None
        self._eod = eos if eos is not None else self._find(_EOD_NAMES)
        if self._eod is None:
            raise ValueError(f"tokenizer {path!r} has no end-of-document token; add one of "
                             f"{', '.join(_EOD_NAMES)} as a special token")
        pad = self.hf.pad_token_id if os.path.isdir(path) else None
        pad = self._find(_PAD_NAMES) if pad is None else pad
        self._pad = self._eod if pad is None else pad
        bos = self.hf.bos_token_id if os.path.isdir(path) else None
        self._bos = self._find(_BOS_NAMES) if bos is None else bos
        if self.chat_template:
            self.chat_format = "template"
            self._prefix, self._turn_end, self._turn_sep = {}, [], []
        else:
            self._init_chat_markers(path)

    def _find(self, names: Iterable[str]) -> Optional[int]:
        for name in names:
            tid = self._tok.token_to_id(name)
            if tid is not None:
                return int(tid)
        return None

    def _init_chat_markers(self, path: str) -> None:
        role_ids = {r: self._tok.token_to_id(t) for r, t in _SKRULL_ROLES.items()}
        if all(v is not None for v in role_ids.values()):
            self.chat_format = "skrull"
            self._prefix = {r: [int(v)] for r, v in role_ids.items()}
            self._turn_end, self._turn_sep = [self._eod], []
            return
        start, end = (self._tok.token_to_id(t) for t in _CHATML)
        if start is not None and end is not None:
            self.chat_format = "chatml"
            self._prefix = {r: [int(start)] + self.encode(f"{r}\n") for r in ROLES}
            self._turn_end, self._turn_sep = [int(end)], self.encode("\n")
            return
        raise ValueError(
            f"tokenizer {path!r} has neither a chat template nor chat markers: use a tokenizer "
            "directory whose tokenizer_config.json (or chat_template.jinja) has a chat template, "
            f"or add the special tokens {', '.join(_SKRULL_ROLES.values())} (or ChatML's "
            f"{' and '.join(_CHATML)})")

    @property
    def vocab_size(self) -> int:
        return int(self._tok.get_vocab_size(with_added_tokens=True))

    @property
    def eod(self) -> int:
        return self._eod

    @property
    def pad(self) -> int:
        return self._pad

    @property
    def bos(self) -> Optional[int]:
        return self._bos

    def encode(self, text: str) -> list[int]:
        return list(self._tok.encode(text, add_special_tokens=False).ids)

    def decode(self, ids: Iterable[int]) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=False)

    def role_prefix(self, role: str) -> list[int]:
        self._check_role(role)
        if self.chat_template:
            raise ValueError("this tokenizer renders conversations with its chat template; "
                             "use encode_chat(messages)")
        return list(self._prefix[role])

    def encode_chat(self, messages: list[dict[str, Any]], *, tools: Optional[list] = None,
                    loss_on: str = "assistant"):
        """``(tokens int64 [S], mask uint8 [S])`` of ``apply_chat_template(messages)``
        (:func:`megatron.skrull.chat_template.tokenize_chat`)."""
        from megatron.skrull.chat_template import tokenize_chat

        return tokenize_chat(self.hf, messages, tools=tools, loss_on=loss_on)

    @property
    def turn_end(self) -> list[int]:
        return list(self._turn_end)

    @property
    def turn_sep(self) -> list[int]:
        return list(self._turn_sep)

    def describe(self) -> dict[str, Any]:
        return {"type": self.tokenizer_type, "model": self.path, "vocab_size": self.vocab_size,
                "eod": self.eod, "pad": self.pad, "bos": self.bos,
                "chat_format": self.chat_format}


def _load_transformers_tokenizer(path: str):
    """transformers fast tokenizer of a directory (AutoTokenizer) or a tokenizer.json."""
    import transformers  # deferred: only this tokenizer needs the package

    try:
        if os.path.isdir(path):
            if not os.path.isfile(os.path.join(path, "tokenizer.json")):
                raise ValueError("no tokenizer.json in it")
            if os.path.isfile(os.path.join(path, "tokenizer_config.json")):
                hf = transformers.AutoTokenizer.from_pretrained(path, local_files_only=True)
            else:
                hf = transformers.PreTrainedTokenizerFast(
                    tokenizer_file=os.path.join(path, "tokenizer.json"))
        else:
            hf = transformers.PreTrainedTokenizerFast(tokenizer_file=path)
    except Exception as exc:  # noqa: BLE001 - the libraries raise bare Exceptions
        raise ValueError(f"--tokenizer-model {path!r} is not a Hugging Face tokenizer.json "
                         f"file or tokenizer directory ({exc})") from exc
    if not getattr(hf, "is_fast", False):
        raise ValueError(f"--tokenizer-model {path!r} loads a slow tokenizer; convert it to "
                         "a fast tokenizer.json (tokenizer.save_pretrained after "
                         "AutoTokenizer.from_pretrained(..., use_fast=True))")
    return hf


def build_tokenizer(tokenizer_type: Optional[str] = DEFAULT_TOKENIZER_TYPE,
                    tokenizer_model: Optional[str] = None) -> SFTTokenizer:
    """Builds the tokenizer named by ``--tokenizer-type`` / ``--tokenizer-model``.

    Args:
        tokenizer_type: ``"ByteLevelTokenizer"`` (default; None means default) or
            ``"HFTokenizer"`` (alias ``"HuggingFaceTokenizer"``).
        tokenizer_model: A tokenizer directory or ``tokenizer.json``; required by
            ``HFTokenizer`` and
            rejected by ``ByteLevelTokenizer`` (which has no model file).

    Returns:
        The tokenizer.

    Raises:
        ValueError: Unknown type, or a model path missing / given where it means nothing.
        FileNotFoundError: The model file does not exist.
    """
    tokenizer_type = tokenizer_type or DEFAULT_TOKENIZER_TYPE
    tokenizer_type = TOKENIZER_ALIASES.get(tokenizer_type, tokenizer_type)
    if tokenizer_type == "ByteLevelTokenizer":
        if tokenizer_model:
            raise ValueError("--tokenizer-type ByteLevelTokenizer takes no --tokenizer-model; "
                             "drop it or use --tokenizer-type HFTokenizer")
        return ByteLevelTokenizer()
    if tokenizer_type == "HFTokenizer":
        if not tokenizer_model:
            raise ValueError("--tokenizer-type HFTokenizer needs --tokenizer-model PATH "
                             "(a Hugging Face tokenizer directory or tokenizer.json)")
        return HFTokenizer(tokenizer_model)
    raise ValueError(f"unknown --tokenizer-type {tokenizer_type!r}; expected one of "
                     f"{', '.join(TOKENIZER_TYPES)}")


def tokenizer_from_description(desc: dict[str, Any]) -> SFTTokenizer:
    """Rebuilds a tokenizer from :meth:`SFTTokenizer.describe` output (dataset metadata)."""
    return build_tokenizer(desc.get("type"), desc.get("model"))

