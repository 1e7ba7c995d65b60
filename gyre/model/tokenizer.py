"""A byte-level BPE tokenizer trained offline on the task suite's own text; saved in HF format."""

from __future__ import annotations

import functools
import json
from collections.abc import Iterable
from pathlib import Path

from tokenizers import Tokenizer as _HFTokenizer
from tokenizers import decoders, models, pre_tokenizers, trainers

from gyre.model.chat_template import CHAT_TEMPLATE_JINJA, IM_END, PAD, SPECIAL_TOKENS


class Tokenizer:
    """Thin wrapper over a `tokenizers` BPE model with the chat special tokens."""

    def __init__(self, hf: _HFTokenizer) -> None:
        self._hf = hf
        missing = [t for t in SPECIAL_TOKENS if hf.token_to_id(t) is None]
        if missing:
            raise ValueError(f"tokenizer lacks special tokens {missing}; rebuild it")
        self.special_ids = {t: hf.token_to_id(t) for t in SPECIAL_TOKENS}
        self.pad_id = self.special_ids[PAD]
        self.eos_id = self.special_ids[IM_END]

    @property
    def vocab_size(self) -> int:
        return self._hf.get_vocab_size()

    @functools.cached_property
    def max_token_chars(self) -> int:
        """Characters of the longest token (byte-level tokens: bytes, never fewer than their text's
        characters), so that a text of n characters has at least n / max_token_chars tokens."""
        return max(len(t) for t in self._hf.get_vocab(with_added_tokens=True))

    def encode(self, text: str) -> list[int]:
        return self._hf.encode(text, add_special_tokens=False).ids

    def encode_unlocked(self, text: str) -> list[int]:
        """The same ids as `encode`, computed with the GIL released (the batch entry points of `tokenizers`
        release it, `encode` does not): megabytes tokenized in a worker thread leave other threads running."""
        batch = getattr(self._hf, "encode_batch_fast", self._hf.encode_batch)  # no offsets: ~3x faster
        return batch([text], add_special_tokens=False)[0].ids

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = False) -> str:
        return self._hf.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_id(self, token: str) -> int:
        tid = self._hf.token_to_id(token)
        if tid is None:
            raise KeyError(f"unknown token {token!r}")
        return tid

    @classmethod
    def train(cls, corpus: Iterable[str], vocab_size: int) -> Tokenizer:
        hf = _HFTokenizer(models.BPE())
        hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        hf.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(
            vocab_size=vocab_size,
            special_tokens=list(SPECIAL_TOKENS),
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
            show_progress=False,
        )
        hf.train_from_iterator(corpus, trainer=trainer)
        return cls(hf)

    def save(self, directory: str | Path) -> None:
        d = Path(directory)
        d.mkdir(parents=True, exist_ok=True)
        self._hf.save(str(d / "tokenizer.json"))
        config = {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "eos_token": IM_END,
            "pad_token": PAD,
            "bos_token": None,
            "model_max_length": 1 << 20,
            "chat_template": CHAT_TEMPLATE_JINJA,
            "additional_special_tokens": [t for t in SPECIAL_TOKENS if t not in (PAD, IM_END)],
        }
        (d / "tokenizer_config.json").write_text(json.dumps(config, indent=2))

    @classmethod
    def load(cls, directory: str | Path) -> Tokenizer:
        path = Path(directory) / "tokenizer.json"
        if not path.exists():
            raise FileNotFoundError(f"no tokenizer at {path}; build one with Tokenizer.train(...).save()")
        return cls(_HFTokenizer.from_file(str(path)))
