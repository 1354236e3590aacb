"""A stored body of any /v1 endpoint validated again (an async job or a
batch line, released later): the endpoint names its validator."""

from __future__ import annotations

from typing import Any

from gateway.core.request.chat import validate_chat_request
from gateway.core.request.completions import validate_completion_request, validate_embedding_request
from gateway.core.request.endpoints import CHAT_COMPLETIONS, COMPLETIONS, EMBEDDINGS, ApiRequest

VALIDATORS = {
    CHAT_COMPLETIONS: validate_chat_request,
    COMPLETIONS: validate_completion_request,
    EMBEDDINGS: validate_embedding_request,
}


def request_validate(endpoint: str, body: dict[str, Any]) -> ApiRequest:
    """``body`` as ``endpoint``'s request (a 400 Rejected if it is not one);
    a record from before endpoints were stored is a chat completion."""
    return VALIDATORS[endpoint or CHAT_COMPLETIONS](body)
