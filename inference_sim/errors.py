"""OpenAI-shaped error responses.

The official SDKs map the status code to an exception class (429 ->
RateLimitError, 5xx -> InternalServerError, ...) and read ``retry-after`` /
``retry-after-ms`` to back off, so the simulator's errors must look exactly
like a provider's: ``{"error": {"message", "type", "param", "code"}}``.
"""

from __future__ import annotations

from collections.abc import Mapping

from starlette.responses import JSONResponse

_SERVER_MESSAGES = {
    500: "The server had an error while processing your request. Sorry about that!",
    502: "Bad gateway.",
    503: "The engine is currently overloaded, please try again later.",
}


class OpenAIError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        type_: str,
        param: str | None = None,
        code: str | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type_
        self.param = param
        self.code = code
        self.headers = dict(headers or {})

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def to_response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def invalid_request(message: str, param: str | None = None, code: str | None = None) -> OpenAIError:
    return OpenAIError(400, message, "invalid_request_error", param=param, code=code)


def model_not_found(model: str) -> OpenAIError:
    return OpenAIError(
        404,
        f"The model `{model}` does not exist or you do not have access to it.",
        "invalid_request_error",
        param="model",
        code="model_not_found",
    )


def retry_headers(retry_after_s: int, retry_after_ms: int) -> dict[str, str]:
    return {"retry-after": str(retry_after_s), "retry-after-ms": str(retry_after_ms)}


def failure(status: int, headers: Mapping[str, str] | None = None, reason: str | None = None) -> OpenAIError:
    """An upstream-style failure with the given status (injected or outage)."""
    if status == 429:
        message = reason or "Rate limit reached. Please try again later."
        return OpenAIError(429, message, "requests", code="rate_limit_exceeded", headers=headers)
    message = _SERVER_MESSAGES.get(status, "Upstream failure.")
    if reason:
        message = f"{message} ({reason})"
    return OpenAIError(status, message, "server_error", headers=headers)
