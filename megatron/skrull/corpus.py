"""Embedded default SFT corpus: seeded, learnable, long-tailed, no downloads.

Every record is ``{"messages": [{"role": ..., "content": ...}, ...]}``.  Each user turn is
``"<task>: w1 w2 ... wn"`` over a 48-word vocabulary and the assistant answer is a
deterministic function of it (copy, reverse the words, upper-case, say every word twice,
initials), so a tiny model learns the spelling and the rules within a short run and the
loss falls quickly.  Long samples are multi-turn conversations of the same tasks.

Lengths are *byte-level tokens* (:class:`~megatron.skrull.tokenizer.ByteLevelTokenizer`:
one BOS, then per message a role marker, the ASCII content, an EOS).  The target length of
a sample is drawn from a mixture scaled to CPU sizes, shaped like SFT mixes
(docs/design.md section 8: most samples short, a thin long tail):

- with probability ``1 - long_fraction``: log-normal with median ``median_tokens`` and
  shape ``sigma``, clipped to ``[min_tokens, long_min_tokens)``;
- with probability ``long_fraction``: log-uniform in ``[long_min_tokens, max_tokens]``;
- the sample with the largest target is set to ``max_tokens``, so the corpus always spans
  the full range (its real length is ``max_tokens`` minus at most a few tokens).

With the defaults about 80 % of samples are under 512 tokens.  Output is a pure function
of the config (NumPy ``PCG64`` seeded with ``seed``).
"""
from __future__ import annotations

import dataclasses
import math
from typing import Iterator

import numpy as np

WORDS = (
    "apple", "river", "stone", "cloud", "green", "tiger", "music", "paper",
    "light", "ocean", "bread", "chair", "dream", "frost", "grape", "house",
    "jelly", "knife", "lemon", "maple", "night", "olive", "pearl", "queen",
    "robin", "sugar", "table", "umbra", "vivid", "whale", "xenon", "yacht",
    "zebra", "amber", "blue", "cat", "dog", "egg", "fig", "gold",
    "hat", "ink", "jam", "kite", "lamp", "moon", "nest", "owl",
)
TASKS = ("copy", "reverse", "upper", "double", "initials")
SYSTEM_PROMPT = "You are a precise assistant. Apply the task before the colon to the words."

_WORD_LEN = np.array([len(w) for w in WORDS], dtype=np.int64)
_MIN_TURN = 24  # smallest token budget worth opening a new turn for
_FIRST_TURN = 47  # budget that fits one word of every task (min_tokens - BOS)


@dataclasses.dataclass(frozen=True, kw_only=True)
class CorpusConfig:
    """Shape of the synthetic corpus (all lengths in byte-level tokens).

    Attributes:
        num_samples: Records to generate (>= 1).
        seed: Seed of the generator; equal configs give identical corpora.
        max_tokens: Length of the longest sample (>= min_tokens).
        min_tokens: Shortest target length (>= 48, so one turn always fits).
        median_tokens: Median of the short-sample body.
        sigma: Log-normal shape of the short-sample body (> 0).
        long_fraction: Share of samples drawn from the long tail, in [0, 1].
        long_min_tokens: Where the long tail starts.
        system_fraction: Share of samples that start with a system message, in [0, 1].
        max_turn_tokens: Largest budget of one user+assistant turn (long samples are
            multi-turn).
    """

    num_samples: int
    seed: int = 1234
    max_tokens: int = 16384
    min_tokens: int = 48
    median_tokens: int = 192
    sigma: float = 0.8
    long_fraction: float = 0.08
    long_min_tokens: int = 1024
    system_fraction: float = 0.3
    max_turn_tokens: int = 1536

    def __post_init__(self) -> None:
        if self.num_samples < 1:
            raise ValueError(f"num_samples must be >= 1, got {self.num_samples}")
        if self.min_tokens < 48:
            raise ValueError(f"min_tokens must be >= 48, got {self.min_tokens}")
        if self.max_tokens < self.min_tokens:
            raise ValueError(f"max_tokens ({self.max_tokens}) must be >= min_tokens "
                             f"({self.min_tokens})")
        if not self.min_tokens <= self.median_tokens:
            raise ValueError(f"median_tokens ({self.median_tokens}) must be >= min_tokens")
        if self.sigma <= 0:
            raise ValueError(f"sigma must be > 0, got {self.sigma}")
        for name in ("long_fraction", "system_fraction"):
            value = getattr(self, name)
            if not 0.0 <= value <= 1.0:
                raise ValueError(f"{name} must be in [0, 1], got {value}")
        if self.long_min_tokens <= self.min_tokens:
            raise ValueError("long_min_tokens must be > min_tokens")
        if self.max_turn_tokens < 2 * _MIN_TURN:
            raise ValueError(f"max_turn_tokens must be >= {2 * _MIN_TURN}")


def target_lengths(config: CorpusConfig, rng: np.random.Generator) -> np.ndarray:
    """Draws the target length of every sample: int64 ``[num_samples]``."""
    n = config.num_samples
    body_cap = min(config.long_min_tokens - 1, config.max_tokens)
    body = np.exp(rng.normal(math.log(config.median_tokens), config.sigma, size=n))
    body = np.clip(body, config.min_tokens, body_cap)
    lo = min(config.long_min_tokens, config.max_tokens)
    tail = np.exp(rng.uniform(math.log(lo), math.log(config.max_tokens), size=n))
    is_long = rng.random(n) < config.long_fraction
    targets = np.where(is_long, tail, body).astype(np.int64)
    targets[int(np.argmax(targets))] = config.max_tokens
    return targets


def _task_costs(task: str, tag_len: int, word_len: np.ndarray) -> np.ndarray:
    """Tokens of a turn with the first n words, for n = 1..len(word_len): int64 [n].

    A turn is ``<|user|> "task: " words <|eos|> <|assistant|> answer <|eos|>``.
    """
    n = np.arange(1, len(word_len) + 1, dtype=np.int64)
    text = np.cumsum(word_len) + n - 1  # words joined by single spaces
    answer = {"copy": text, "reverse": text, "upper": text,
              "double": 2 * text + 1, "initials": n}[task]
    return 2 + tag_len + text + 2 + answer


def _answer(task: str, words: list[str]) -> str:
    if task == "copy":
        return " ".join(words)
    if task == "reverse":
        return " ".join(reversed(words))
    if task == "upper":
        return " ".join(words).upper()
    if task == "double":
        return " ".join(w for w in words for _ in range(2))
    return "".join(w[0] for w in words)


def _make_turn(budget: int, rng: np.random.Generator) -> tuple[list[dict], int]:
    """One user/assistant turn of at most ``budget`` tokens; ([], 0) when none fits."""
    task = TASKS[int(rng.integers(len(TASKS)))]
    tag = f"{task}: "
    # Every word costs >= 2 tokens of prompt, so budget // 2 words is always enough.
    idx = rng.integers(len(WORDS), size=max(budget // 2, 1))
    costs = _task_costs(task, len(tag), _WORD_LEN[idx])
    n = int(np.searchsorted(costs, budget, side="right"))
    if n == 0:
        return [], 0
    words = [WORDS[i] for i in idx[:n]]
    turn = [{"role": "user", "content": tag + " ".join(words)},
            {"role": "assistant", "content": _answer(task, words)}]
    return turn, int(costs[n - 1])


def make_record(target: int, config: CorpusConfig, rng: np.random.Generator) -> dict:
    """One conversation of at most ``target`` byte-level tokens (close to it)."""
    messages: list[dict] = []
    used = 1  # BOS
    # A system message only where a first turn still fits after it (every sample trains).
    with_system = rng.random() < config.system_fraction
    if with_system and target - 1 - (2 + len(SYSTEM_PROMPT)) >= _FIRST_TURN:
        messages.append({"role": "system", "content": SYSTEM_PROMPT})
        used += 2 + len(SYSTEM_PROMPT)
    while target - used >= _MIN_TURN:
        remaining = target - used
        if remaining <= config.max_turn_tokens:
            budget = remaining
        else:
            # Leave at least one full-size turn's worth so the last turn is not a sliver.
            budget = int(rng.integers(config.max_turn_tokens // 2, config.max_turn_tokens + 1))
        turn, cost = _make_turn(budget, rng)
        if not turn:
            break
        messages.extend(turn)
        used += cost
    return {"messages": messages}


def generate_records(config: CorpusConfig) -> Iterator[dict]:
    """Yields ``config.num_samples`` chat records, deterministic in ``config``."""
    rng = np.random.Generator(np.random.PCG64(config.seed))
    targets = target_lengths(config, rng)
    for target in targets:
        yield make_record(int(target), config, rng)


def byte_level_length(record: dict) -> int:
    """Byte-level token count of a chat record (BOS + marker/content/EOS per message)."""
    return 1 + sum(2 + len(m["content"].encode("utf-8")) for m in record["messages"])
