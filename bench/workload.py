"""The requests the scenarios send: one-sentence questions, ~4,000-token
documents to summarize, and their output lengths, all drawn from a seeded RNG
so every system in a scenario sees exactly the same request stream.

Output lengths are drawn here, client-side, and sent as the simulator's
per-request override (``"sim": {"output_tokens": n}``, passed through by both
gateways); the simulator still truncates at the max_tokens it receives. Drawn
by the simulator instead, the same request would get a different length on
each system, depending on arrival order."""

from __future__ import annotations

import math
import random
from dataclasses import dataclass
from functools import lru_cache

QUESTIONS = [
    "What is the capital of Australia?",
    "How many moons does Mars have?",
    "Can you explain what a token bucket is in one sentence?",
    "What does HTTP status 429 mean?",
    "Who wrote the novel Middlemarch?",
    "What is the boiling point of water at sea level in Fahrenheit?",
    "Why is the sky blue?",
    "What is Little's law?",
    "How do I reverse a list in Python?",
    "What time zone is Tokyo in?",
    "What is the difference between latency and throughput?",
    "Translate 'good morning' into French.",
]

_WORDS = ("the pool gateway budget token request tenant latency queue batch worker lane capacity provider "
          "minute window limit retry backoff jitter outage brownout report quarterly revenue customer policy "
          "contract clause summary section figure table analysis result method design system service").split()

LONG_PROMPT_TOKENS = 4_000


@lru_cache(maxsize=16)
def long_document(variant: int, tokens: int = LONG_PROMPT_TOKENS) -> str:
    """A document whose chat prompt (with the instruction) is ``tokens`` tokens
    in cl100k_base, give or take a few."""
    import llm_tokens

    rng = random.Random(1000 + variant)
    words = []
    # Each of these words is one token with its leading space; sentences add a few.
    while len(words) < tokens:
        sentence = [rng.choice(_WORDS) for _ in range(rng.randint(8, 20))]
        sentence[0] = sentence[0].capitalize()
        words.extend(sentence)
        words[-1] += "."
    text = " ".join(words)
    messages = long_messages(text)
    count = llm_tokens.count_chat_tokens(messages, "cl100k_base")
    while count > tokens and words:
        cut = max(1, (count - tokens) // 2)
        words = words[:-cut]
        text = " ".join(words)
        count = llm_tokens.count_chat_tokens(long_messages(text), "cl100k_base")
    return text


def long_messages(document: str) -> list[dict]:
    return [{"role": "system", "content": "You summarize documents for busy readers."},
            {"role": "user", "content": "Summarize the following document in a few paragraphs.\n\n" + document}]


def short_messages(question: str) -> list[dict]:
    return [{"role": "user", "content": question}]


def lognormal_tokens(rng: random.Random, median: float, sigma: float, cap: int) -> int:
    return max(1, min(cap, round(rng.lognormvariate(math.log(median), sigma))))


@dataclass(frozen=True)
class ChatCall:
    kind: str  # "short" | "long" | other scenario labels
    body: dict

    @property
    def max_tokens(self) -> int:
        return int(self.body.get("max_tokens") or 0)


def short_call(rng: random.Random, *, model: str = "sim-small", max_tokens: int = 64, median: float = 40,
               sigma: float = 0.8) -> ChatCall:
    body = {"model": model, "messages": short_messages(rng.choice(QUESTIONS)), "max_tokens": max_tokens,
            "sim": {"output_tokens": lognormal_tokens(rng, median, sigma, 4 * max_tokens)}}
    return ChatCall("short", body)


def long_call(rng: random.Random, *, model: str = "sim-small", max_tokens: int = 512, median: float = 300,
              sigma: float = 0.6, prompt_tokens: int = LONG_PROMPT_TOKENS) -> ChatCall:
    body = {"model": model, "messages": long_messages(long_document(rng.randrange(4), prompt_tokens)),
            "max_tokens": max_tokens,
            "sim": {"output_tokens": lognormal_tokens(rng, median, sigma, 4 * max_tokens)}}
    return ChatCall("long", body)


def mixed_stream(seed: int, client: int, count: int, long_fraction: float = 0.2) -> list[ChatCall]:
    """Client ``client``'s sequence of calls: the same on every system."""
    rng = random.Random(seed * 1_000_003 + client)
    return [long_call(rng) if rng.random() < long_fraction else short_call(rng) for _ in range(count)]
