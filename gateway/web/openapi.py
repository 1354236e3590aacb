"""The OpenAI-compatible API (/v1) in the OpenAPI schema. Its views are plain
async Django views, not DRF, so drf-spectacular cannot discover them; this
postprocessing hook (settings.SPECTACULAR_SETTINGS) adds their paths, the
bearer-key scheme, the error shape with its codes, and the headers the
gateway sets, to the same schema /api/docs/ shows (offline: no CDN)."""

from __future__ import annotations

from django.conf import settings

from gateway.core.jobs.lifecycle import JOB_LIST_DEFAULT, JOB_LIST_MAX
from gateway.models import Job

V1_TAG = "OpenAI-compatible API (/v1)"

# error.code values a /v1 caller may see, by HTTP status.
ERROR_CODES = {
    400: ["invalid_request", "unknown_parameter", "invalid_string", "context_length_exceeded",
          "sim_controls_disabled", "invalid_callback_url", "invalid_idempotency_key", "invalid_status",
          "invalid_limit", "invalid_cursor", "invalid_purpose", "missing_required_parameter", "empty_file",
          "invalid_endpoint", "invalid_completion_window", "invalid_metadata", "invalid_input_file", "invalid_upload"],
    401: ["missing_api_key", "invalid_api_key"],
    403: ["no_reservation"],
    404: ["job_not_found", "model_not_found", "file_not_found", "batch_not_found"],
    405: ["method_not_allowed"],
    409: ["idempotency_key_reused"],
    413: ["body_too_large", "request_too_large", "file_too_large"],
    429: ["workload_tpm", "workload_rpm", "pool_tpm", "pool_rpm", "pool_input_tpm", "pool_output_tpm",
          "pool_saturated", "workload_concurrency", "pool_backoff", "spend_budget", "overflow_spend_budget",
          "deadline_unreachable", "too_many_invalid_api_keys", "provider_tpm", "provider_rpm"],
    503: ["budget_unavailable", "database_unavailable", "queue_timeout", "pool_unavailable", "pool_circuit_open",
          "worker_lost"],
}

RATE_HEADERS = {
    "x-ratelimit-limit-tokens": "The workload's ceiling, tokens per minute.",
    "x-ratelimit-remaining-tokens": "Tokens the workload's ceiling bucket holds now.",
    "x-ratelimit-reset-tokens": "Until that bucket is full again (e.g. 1.5s).",
    "x-ratelimit-limit-requests": "The workload's requests per minute.",
    "x-ratelimit-remaining-requests": "Requests its bucket holds now.",
    "x-ratelimit-reset-requests": "Until that bucket is full again.",
}
REFUSAL_HEADERS = {
    "Retry-After": "Seconds until a retry can be admitted (computed from the buckets' refill).",
    "retry-after-ms": "The same in milliseconds.",
}
SUCCESS_HEADERS = {
    "x-request-id": "The ledger row's request id.",
    "x-sluice-lane": "The lane (Celery queue) the request ran on.",
    "x-sluice-borrowed": "true when admitted on capacity borrowed beyond the workload's reservation.",
    "x-sluice-max-tokens-applied": "max_tokens after the workload's default and cap.",
    "x-sluice-estimated-prompt-tokens": "The prompt tokens admission counted.",
    "x-sluice-queue-ms": "Time spent queued on the lane.",
    "x-sluice-attempts": "Calls made to the pool (retries included).",
}


def _headers(described: dict[str, str]) -> dict:
    return {name: {"description": text, "schema": {"type": "string"}} for name, text in described.items()}


def _error(status: int, what: str, *, refusal: bool = False) -> dict:
    headers = {**_headers(RATE_HEADERS), **_headers(REFUSAL_HEADERS)} if refusal else {}
    return {"description": f"{what}. error.code is one of: {', '.join(ERROR_CODES[status])}.",
            "headers": headers,
            "content": {"application/json": {"schema": {"$ref": "#/components/schemas/OpenAIError"}}}}


def _errors(*statuses: int) -> dict:
    what = {400: "Invalid input (costs nothing)", 401: "No or a bad API key", 403: "No budget on a pool",
            404: "Not found", 405: "Wrong method", 409: "Idempotency-Key reused with another body",
            413: "Body or request too large", 429: "Over budget: retry after Retry-After",
            503: "Redis, the pool or the queue is unavailable now"}
    return {str(s): _error(s, what[s], refusal=s in (429, 503)) for s in statuses}


CHAT_BODY = {
    "type": "object", "required": ["model", "messages"], "additionalProperties": True,
    "description": "OpenAI's chat-completions body (README, 'How a request flows': the allowed fields). Unknown "
                   "fields are refused (400 unknown_parameter), never forwarded.",
    "properties": {
        "model": {"type": "string", "example": "sim-small"},
        "messages": {"type": "array", "items": {"type": "object"},
                     "example": [{"role": "user", "content": "Hello, Sluice!"}]},
        "max_tokens": {"type": "integer", "description": "Clamped to the workload's cap; its default when absent."},
        "stream": {"type": "boolean"},
    },
}
COMPLETION_BODY = {
    "type": "object", "required": ["model", "prompt"], "additionalProperties": True,
    "description": "OpenAI's legacy completions body: weighed and billed as chat. Each prompt item is estimated "
                   "(and capped) on its own, with max_tokens each. Unknown fields are refused (400 unknown_parameter).",
    "properties": {
        "model": {"type": "string", "example": "sim-small"},
        "prompt": {"description": "A string, an array of strings, an array of token ids or an array of arrays of "
                                  "token ids.", "example": "Say hello to Sluice."},
        "max_tokens": {"type": "integer", "description": "Per prompt; clamped to the workload's cap."},
        "stream": {"type": "boolean"},
    },
}
EMBEDDING_BODY = {
    "type": "object", "required": ["model", "input"], "additionalProperties": True,
    "description": "OpenAI's embeddings body. Admitted on its exact input tokens (no output); each input must fit "
                   "the workload's prompt cap (400 context_length_exceeded names it). Unknown fields are refused.",
    "properties": {
        "model": {"type": "string", "example": "sim-embed"},
        "input": {"description": "A string, an array of strings, an array of token ids or an array of arrays of "
                                 "token ids (at most 2,048 items).", "example": ["first document", "second"]},
        "encoding_format": {"type": "string", "enum": ["float", "base64"]},
        "dimensions": {"type": "integer", "minimum": 1, "description": "Where the model can shorten its vectors."},
        "user": {"type": "string"},
    },
}
JOB_BODY = {"allOf": [CHAT_BODY, {"type": "object", "properties": {
    "callback_url": {"type": "string", "format": "uri",
                     "description": "POSTed the final job, signed (X-Sluice-Signature). Public https hosts only."},
    "deadline_seconds": {"type": "number", "description": "The job expires if not started by then."},
}}]}
JOB = {"type": "object", "properties": {
    "id": {"type": "string", "format": "uuid"}, "object": {"type": "string", "enum": ["job"]},
    "status": {"type": "string", "enum": list(Job.JOB_STATUSES)}, "workload": {"type": "string"},
    "created_at": {"type": "string", "format": "date-time"}, "deadline": {"type": "string", "format": "date-time"},
    "release_at": {"type": "string", "format": "date-time", "nullable": True,
                   "description": "A delayed job: when the pacer plans to release it."},
    "released_at": {"type": "string", "format": "date-time", "nullable": True},
    "finished_at": {"type": "string", "format": "date-time", "nullable": True},
    "reason": {"type": "string", "nullable": True}, "delays": {"type": "integer"},
    "delay_history": {"type": "array", "description": "Each wait: when, why (the refusal's reason, or paced) and "
                      "the release time planned.", "items": {"type": "object", "properties": {
                          "at": {"type": "string", "format": "date-time"}, "reason": {"type": "string"},
                          "release_at": {"type": "string", "format": "date-time"}}}},
    "status_url": {"type": "string"}, "result": {"type": "object", "nullable": True},
    "usage": {"type": "object", "nullable": True}, "cost": {"type": "string", "nullable": True},
}}


def _op(operation_id: str, summary: str, description: str, responses: dict, *, body: dict | None = None,
        parameters: list | None = None, headers: list[str] = ()) -> dict:
    operation = {"operationId": operation_id, "tags": [V1_TAG], "summary": summary, "description": description,
                 "security": [{"SluiceApiKey": []}], "responses": responses}
    params = list(parameters or [])
    params += [{"name": h, "in": "header", "required": False, "schema": {"type": "string"}} for h in headers]
    if params:
        operation["parameters"] = params
    if body is not None:
        operation["requestBody"] = {"required": True, "content": {"application/json": {"schema": body}}}
    return operation


def _ok(description: str, schema: dict, *, extra_headers: dict | None = None) -> dict:
    return {"description": description, "headers": _headers({**RATE_HEADERS, **(extra_headers or {})}),
            "content": {"application/json": {"schema": schema}}}


def v1_paths() -> dict:
    limits = (f"Bodies up to {settings.SLUICE_MAX_BODY_BYTES:,} bytes; prompts up to the workload's cap; "
              "max_tokens clamped to its cap. Unknown or revoked keys count against the caller's address.")
    query = [
        {"name": "status", "in": "query", "required": False, "schema": {"type": "string", "enum": list(Job.JOB_STATUSES)}},
        {"name": "after", "in": "query", "required": False, "schema": {"type": "string", "format": "uuid"},
         "description": "The last id of the previous page (keyset paging)."},
        {"name": "limit", "in": "query", "required": False,
         "schema": {"type": "integer", "minimum": 1, "maximum": JOB_LIST_MAX, "default": JOB_LIST_DEFAULT}},
    ]
    job_list = {"type": "object", "properties": {
        "object": {"type": "string", "enum": ["list"]}, "data": {"type": "array", "items": JOB},
        "first_id": {"type": "string", "nullable": True}, "last_id": {"type": "string", "nullable": True},
        "has_more": {"type": "boolean"}}}
    return {
        "/v1/chat/completions": {"post": _op(
            "v1_chat_completions_create", "Chat completion (OpenAI-compatible)",
            "Admitted against the workload's and the pool's budgets in one atomic step, queued on its lane, "
            "answered when the pool is done (or streamed with stream=true). " + limits,
            {"200": _ok("The completion, OpenAI's shape.", {"type": "object"}, extra_headers=SUCCESS_HEADERS),
             **_errors(400, 401, 403, 404, 405, 409, 413, 429, 503)},
            body=CHAT_BODY, headers=["Idempotency-Key", "X-Session-Id"])},
        "/v1/completions": {"post": _op(
            "v1_completions_create", "Legacy completion (OpenAI-compatible)",
            "The same door as chat: validation, estimate, one atomic admission, lane, ledger row (its endpoint "
            "recorded). Streams with stream=true. " + limits,
            {"200": _ok("The completion, OpenAI's text_completion shape.", {"type": "object"},
                        extra_headers=SUCCESS_HEADERS),
             **_errors(400, 401, 403, 404, 405, 409, 413, 429, 503)},
            body=COMPLETION_BODY, headers=["Idempotency-Key", "X-Session-Id"])},
        "/v1/embeddings": {"post": _op(
            "v1_embeddings_create", "Embeddings (OpenAI-compatible)",
            "The same door as chat, estimated on the exact input tokens (no output tokens) and billed per input "
            "token. " + limits,
            {"200": _ok("The embeddings, OpenAI's shape (float arrays, or base64 float32s).", {"type": "object"},
                        extra_headers=SUCCESS_HEADERS),
             **_errors(400, 401, 403, 404, 405, 409, 413, 429, 503)},
            body=EMBEDDING_BODY, headers=["Idempotency-Key", "X-Session-Id"])},
        "/v1/models": {"get": _op("v1_models_list", "Models of the workload's pool", "OpenAI's model list.",
                                  {"200": {"description": "The list.", "content": {"application/json": {
                                      "schema": {"type": "object"}}}}, **_errors(401, 403, 405, 503)})},
        "/v1/jobs": {
            "post": _op("v1_jobs_create", "Submit an async job",
                        "202 with the job and its status URL (Location). Over budget, the job is delayed until it "
                        "fits, not rejected, unless that would pass its deadline. " + limits,
                        {"202": _ok("The job.", JOB), "200": _ok("An idempotent replay: the same job.", JOB),
                         **_errors(400, 401, 403, 409, 413, 429, 503)},
                        body=JOB_BODY, headers=["Idempotency-Key", "X-Session-Id"]),
            "get": _op("v1_jobs_list", "List the workload's jobs",
                       "Newest first, keyset-paged: pass the last id as `after` while has_more is true.",
                       {"200": {"description": "One page.", "content": {"application/json": {"schema": job_list}}},
                        **_errors(400, 401, 405, 503)}, parameters=query),
        },
        "/v1/jobs/{job_id}": {"get": _op(
            "v1_jobs_retrieve", "A job", "Its status; once final, its result, tokens and cost (from the ledger) and callback attempts.",
            {"200": {"description": "The job.", "content": {"application/json": {"schema": JOB}}},
             **_errors(401, 404, 405, 503)},
            parameters=[{"name": "job_id", "in": "path", "required": True, "schema": {"type": "string", "format": "uuid"}}])},
    }


FILE = {"type": "object", "description": "OpenAI's file object.", "properties": {
    "id": {"type": "string"}, "object": {"type": "string", "enum": ["file"]}, "bytes": {"type": "integer"},
    "created_at": {"type": "integer"}, "filename": {"type": "string"},
    "purpose": {"type": "string", "enum": ["batch", "batch_output", "batch_error"]}, "status": {"type": "string"}}}
BATCH = {"type": "object", "description": "OpenAI's batch object; `sluice` adds the workload, the plan (whether "
         "its budget lets it finish within the window) and its lines by state.", "properties": {
    "id": {"type": "string"}, "object": {"type": "string", "enum": ["batch"]}, "endpoint": {"type": "string"},
    "status": {"type": "string", "enum": ["validating", "failed", "in_progress", "finalizing", "completed",
                                          "expired", "cancelling", "cancelled"]},
    "input_file_id": {"type": "string"}, "output_file_id": {"type": "string", "nullable": True},
    "error_file_id": {"type": "string", "nullable": True}, "errors": {"type": "object", "nullable": True},
    "request_counts": {"type": "object", "properties": {
        "total": {"type": "integer"}, "completed": {"type": "integer"}, "failed": {"type": "integer"}}},
    "usage": {"type": "object"}, "metadata": {"type": "object", "nullable": True}, "sluice": {"type": "object"}}}
BATCH_BODY = {"type": "object", "required": ["input_file_id", "endpoint", "completion_window"], "properties": {
    "input_file_id": {"type": "string"},
    "endpoint": {"type": "string", "enum": ["/v1/chat/completions", "/v1/embeddings", "/v1/completions"]},
    "completion_window": {"type": "string", "enum": ["24h"]},
    "metadata": {"type": "object", "additionalProperties": {"type": "string", "maxLength": 512}, "maxProperties": 16}}}


def _json(description: str, schema: dict) -> dict:
    return {"description": description, "content": {"application/json": {"schema": schema}}}


def _path_id(name: str) -> list[dict]:
    return [{"name": name, "in": "path", "required": True, "schema": {"type": "string"}}]


def batch_paths() -> dict:
    """The Files and Batch APIs (gateway/web/batches.py)."""
    listing = {"type": "object", "properties": {"object": {"type": "string"}, "data": {"type": "array"},
                                                 "has_more": {"type": "boolean"}}}
    upload = {"required": True, "content": {"multipart/form-data": {"schema": {
        "type": "object", "required": ["file", "purpose"], "properties": {
            "file": {"type": "string", "format": "binary",
                     "description": f"JSONL, up to {settings.SLUICE_BATCH_FILE_MAX_BYTES:,} bytes."},
            "purpose": {"type": "string", "enum": ["batch"]}}}}}}
    upload_op = _op("v1_files_create", "Upload a batch input file",
                    "Streamed to storage, scoped to the key's workload.",
                    {"200": _json("The file.", FILE), **_errors(400, 401, 405, 413, 503)})
    upload_op["requestBody"] = upload
    return {
        "/v1/files": {
            "post": upload_op,
            "get": _op("v1_files_list", "The workload's files", "Newest first.",
                       {"200": _json("The files.", listing), **_errors(401, 405, 503)}),
        },
        "/v1/files/{file_id}": {
            "get": _op("v1_files_retrieve", "A file", "Its file object.",
                       {"200": _json("The file.", FILE), **_errors(401, 404, 405, 503)},
                       parameters=_path_id("file_id")),
            "delete": _op("v1_files_delete", "Delete a file", "Its content and its record.",
                          {"200": _json("Deleted.", {"type": "object"}), **_errors(401, 404, 405, 503)},
                          parameters=_path_id("file_id")),
        },
        "/v1/files/{file_id}/content": {"get": _op(
            "v1_files_content", "A file's content", "The bytes, streamed (JSONL).",
            {"200": {"description": "The content.", "content": {"application/jsonl": {"schema": {"type": "string"}}}},
             **_errors(401, 404, 405, 503)}, parameters=_path_id("file_id"))},
        "/v1/batches": {
            "post": _op("v1_batches_create", "Create a batch",
                        "Its lines run as jobs on the batch lane, delayed (never rejected) by the workload's budget, "
                        "within the completion window.",
                        {"200": _json("The batch, validating.", BATCH), **_errors(400, 401, 404, 405, 413, 503)},
                        body=BATCH_BODY),
            "get": _op("v1_batches_list", "The workload's batches", "Newest first; `after` and `limit` page.",
                       {"200": _json("One page.", listing), **_errors(400, 401, 405, 503)},
                       parameters=[{"name": "after", "in": "query", "required": False, "schema": {"type": "string"}},
                                   {"name": "limit", "in": "query", "required": False,
                                    "schema": {"type": "integer", "minimum": 1, "maximum": 100}}]),
        },
        "/v1/batches/{batch_id}": {"get": _op(
            "v1_batches_retrieve", "A batch", "Its status, request counts, files and usage (from the ledger).",
            {"200": _json("The batch.", BATCH), **_errors(401, 404, 405, 503)}, parameters=_path_id("batch_id"))},
        "/v1/batches/{batch_id}/cancel": {"post": _op(
            "v1_batches_cancel", "Cancel a batch", "No new line starts; lines already running finish and are billed.",
            {"200": _json("The batch, cancelling.", BATCH), **_errors(401, 404, 405, 503)},
            parameters=_path_id("batch_id"))},
    }


def add_v1_paths(result: dict, generator, request, public) -> dict:
    """drf-spectacular postprocessing hook: the /v1 API beside /api."""
    result.setdefault("paths", {}).update({**v1_paths(), **batch_paths()})
    components = result.setdefault("components", {})
    components.setdefault("securitySchemes", {})["SluiceApiKey"] = {
        "type": "http", "scheme": "bearer", "description": "A workload's API key (sk-sluice-...), as with the openai SDK."}
    components.setdefault("schemas", {})["OpenAIError"] = {
        "type": "object", "required": ["error"], "properties": {"error": {"type": "object", "properties": {
            "message": {"type": "string"}, "type": {"type": "string"}, "param": {"type": "string", "nullable": True},
            "code": {"type": "string", "nullable": True,
                     "enum": sorted({c for codes in ERROR_CODES.values() for c in codes})}}}}}
    result.setdefault("tags", []).append({"name": V1_TAG, "description": "Call it with the openai SDK: "
                                          "OpenAI(base_url='<host>/v1', api_key='sk-sluice-...')."})
    return result
