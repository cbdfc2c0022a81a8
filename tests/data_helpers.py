"""Shared fixtures of the data-stage tests: tiny Hugging Face tokenizers built in code."""
from __future__ import annotations

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

SKRULL_SPECIALS = ["<|pad|>", "<|bos|>", "<|eos|>", "<|system|>", "<|user|>", "<|assistant|>"]
CHATML_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CORPUS = [
    "copy: apple river stone", "reverse: cloud green tiger", "the quick brown fox jumps",
    "over the lazy dog", "user assistant system", "hello world, how are you?",
]


def make_hf_tokenizer(path: str, specials: list[str], vocab_size: int = 300) -> str:
    """Trains a byte-level BPE on a few sentences, saves it to ``path``, returns ``path``.

    Byte-level pre-tokenization and decoding make ``decode(encode(text)) == text`` for any
    text, like GPT-2/Qwen tokenizers.
    """
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=specials,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(CORPUS, trainer=trainer)
    tok.save(path)
    return path
