"""Generated text whose token count is known exactly.

Each piece below is a single token in cl100k_base and o200k_base, and every
piece but the first starts with a space, so tiktoken's pre-tokenizer splits
the text back into exactly these pieces: ``n`` pieces tokenize to ``n``
tokens. Streaming sends one piece per chunk, as a real server sends one token.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator

import tiktoken

FIRST_PIECE = "Lorem"
CYCLE = (
    " ipsum",
    " dolor",
    " sit",
    " amet",
    " consectetur",
    " adipiscing",
    " elit",
    " sed",
    " do",
    " eiusmod",
    " tempor",
    " lorem",
)


def token_pieces(n: int) -> Iterator[str]:
    """The first ``n`` one-token pieces of the generated text."""
    if n <= 0:
        return iter(())
    return itertools.chain((FIRST_PIECE,), itertools.islice(itertools.cycle(CYCLE), n - 1))


def completion_text(n: int) -> str:
    return "".join(token_pieces(n))


def check_encoding(encoding: tiktoken.Encoding) -> None:
    """Fail at startup, not silently in usage numbers, if an encoding breaks the invariant."""
    sample = completion_text(3 * len(CYCLE) + 1)
    count = len(encoding.encode(sample, disallowed_special=()))
    if count != 3 * len(CYCLE) + 1 or any(len(encoding.encode(p)) != 1 for p in (FIRST_PIECE, *CYCLE)):
        raise ValueError(f"encoding {encoding.name} does not tokenize the simulator's text one token per piece")
