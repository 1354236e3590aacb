"""The Files and Batch APIs (/v1/files, /v1/batches), OpenAI's shapes: the
web side of gateway/core/batches. Every file and batch belongs to the
workload whose key made it; another workload's id is a 404."""

from __future__ import annotations

from collections.abc import AsyncIterator

from asgiref.sync import sync_to_async
from django.core.exceptions import RequestDataTooBig, TooManyFieldsSent, TooManyFilesSent
from django.http import HttpRequest, JsonResponse, StreamingHttpResponse
from django.http.multipartparser import MultiPartParserError
from django.views.decorators.csrf import csrf_exempt

from budgets.errors import Rejected
from gateway.core.batches.files import READ_CHUNK, file_delete, file_of_workload, file_store, file_view
from gateway.core.errors import bad_request
from gateway.core.batches.lifecycle import batch_cancel, batch_create, batch_list, batch_of_workload, batch_view
from gateway.core.db_threads import connection_checked
from gateway.models import BatchFile
from gateway.web.responses import openai_error, rejected_response
from gateway.web.views import caller_authenticate, get_only, json_body_read, unavailable_is_503


def off_loop(fn, **options):
    """Every database and storage step runs in a thread, off the event loop, its
    connection checked first (gateway/core/db_threads.py ``connection_checked``)."""
    return sync_to_async(connection_checked(fn), **options)


def _not_allowed(allowed: str) -> JsonResponse:
    return openai_error(status=405, message=f"Use {allowed.replace(', HEAD', '')}.",
                        error_type="invalid_request_error", code="method_not_allowed", headers={"Allow": allowed})


def _file_missing() -> JsonResponse:
    return openai_error(status=404, message="No such file.", error_type="invalid_request_error",
                        code="file_not_found")


def _batch_missing() -> JsonResponse:
    return openai_error(status=404, message="No such batch.", error_type="invalid_request_error",
                        code="batch_not_found")


async def _answer(request: HttpRequest, work) -> JsonResponse:
    """Authenticate, run ``work(ctx)`` off the loop, answer its dict (or
    (dict, status)); a Rejected is its OpenAI-shaped refusal."""
    auth = await caller_authenticate(request)
    if isinstance(auth, JsonResponse):
        return auth
    try:
        result = await off_loop(work, thread_sensitive=False)(auth)
    except Rejected as rejected:
        return rejected_response(rejected)
    if isinstance(result, JsonResponse):
        return result
    body, status = result if isinstance(result, tuple) else (result, 200)
    return JsonResponse(body, status=status)


@csrf_exempt
@unavailable_is_503
async def files(request: HttpRequest) -> JsonResponse:
    """POST /v1/files (multipart: ``file``, ``purpose=batch``); GET /v1/files."""
    if request.method == "POST":
        def store(ctx):
            try:
                upload, purpose = request.FILES.get("file"), request.POST.get("purpose", "")
            except (MultiPartParserError, RequestDataTooBig, TooManyFieldsSent, TooManyFilesSent) as exc:
                raise bad_request(f"The upload is not acceptable multipart/form-data: {exc}", param="file",
                                  code="invalid_upload") from None
            return file_view(file_store(ctx=ctx, upload=upload, purpose=purpose))
        return await _answer(request, store)
    if request.method in ("GET", "HEAD"):
        def listed(ctx):
            purpose = request.GET.get("purpose")
            rows = BatchFile.objects.filter(workload_id=ctx.workload_id)
            if purpose:
                rows = rows.filter(purpose=purpose)
            data = [file_view(f) for f in rows.order_by("-created_at")[:10_000]]
            return {"object": "list", "data": data, "has_more": False}
        return await _answer(request, listed)
    return _not_allowed("GET, HEAD, POST")


@csrf_exempt
@unavailable_is_503
async def file_detail(request: HttpRequest, file_id: str) -> JsonResponse:
    """GET or DELETE /v1/files/{id}."""
    if request.method not in ("GET", "HEAD", "DELETE"):
        return _not_allowed("GET, HEAD, DELETE")

    def work(ctx):
        stored = file_of_workload(file_id=file_id, workload_id=ctx.workload_id)
        if stored is None:
            return _file_missing()
        if request.method == "DELETE":
            file_delete(stored)
            return {"id": file_id, "object": "file", "deleted": True}
        return file_view(stored)
    return await _answer(request, work)


@unavailable_is_503
async def file_content(request: HttpRequest, file_id: str):
    """GET /v1/files/{id}/content: the stored bytes, streamed."""
    if (refused := get_only(request)) is not None:
        return refused
    auth = await caller_authenticate(request)
    if isinstance(auth, JsonResponse):
        return auth
    stored = await off_loop(file_of_workload, thread_sensitive=False)(file_id=file_id, workload_id=auth.workload_id)
    if stored is None:
        return _file_missing()
    return await file_streamed(stored)


async def file_streamed(stored: BatchFile) -> StreamingHttpResponse:
    """A stored file as an attachment, read a chunk at a time off the event
    loop (an async iterator: under ASGI a plain one would be read whole
    first). The web UI's download answers with it too."""
    handle = await off_loop(stored.content.open, thread_sensitive=False)("rb")

    async def chunks() -> AsyncIterator[bytes]:
        try:
            while chunk := await off_loop(handle.read, thread_sensitive=False)(READ_CHUNK):
                yield chunk
        finally:
            await off_loop(handle.close, thread_sensitive=False)()

    response = StreamingHttpResponse(chunks(), content_type="application/jsonl")
    response["Content-Length"] = str(stored.bytes)
    response["Content-Disposition"] = f'attachment; filename="{stored.id}.jsonl"'
    return response


@csrf_exempt
@unavailable_is_503
async def batches(request: HttpRequest) -> JsonResponse:
    """POST /v1/batches; GET /v1/batches (newest first, ``after``/``limit``)."""
    if request.method == "POST":
        def create(ctx):
            batch = batch_create(ctx=ctx, body=json_body_read(request))
            return batch_view(batch, counts={})
        return await _answer(request, create)
    if request.method in ("GET", "HEAD"):
        return await _answer(request, lambda ctx: batch_list(workload_id=ctx.workload_id,
                                                             after=request.GET.get("after"),
                                                             limit=request.GET.get("limit")))
    return _not_allowed("GET, HEAD, POST")


@unavailable_is_503
async def batch_detail(request: HttpRequest, batch_id: str) -> JsonResponse:
    if (refused := get_only(request)) is not None:
        return refused

    def work(ctx):
        batch = batch_of_workload(batch_id=batch_id, workload_id=ctx.workload_id)
        return batch_view(batch) if batch else _batch_missing()
    return await _answer(request, work)


@csrf_exempt
@unavailable_is_503
async def batch_cancel_view(request: HttpRequest, batch_id: str) -> JsonResponse:
    """POST /v1/batches/{id}/cancel."""
    if request.method != "POST":
        return _not_allowed("POST")

    def work(ctx):
        batch = batch_of_workload(batch_id=batch_id, workload_id=ctx.workload_id)
        return batch_view(batch_cancel(batch)) if batch else _batch_missing()
    return await _answer(request, work)
