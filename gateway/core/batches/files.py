"""The Files API's store (``POST /v1/files``, ``purpose=batch``): an upload
streamed into Django's storage, its lines counted on the way, scoped to the
workload whose key wrote it. The body reaches Django spooled to disk past a
few megabytes (gateway/web/body_limit.py ``body_limit_streamed``) and the
upload handlers keep it there; nothing here reads a file whole."""

from __future__ import annotations

import tempfile
from collections.abc import Iterator
from dataclasses import dataclass

from django.conf import settings
from django.core.files.base import File
from django.core.files.uploadedfile import UploadedFile

from gateway.core.errors import bad_request
from gateway.core.request.context import CallerContext
from gateway.models import BatchFile

# Purposes a caller may upload; the output and error purposes are Sluice's own.
UPLOAD_PURPOSES = (BatchFile.Purpose.BATCH,)
READ_CHUNK = 64 * 1024


@dataclass(frozen=True)
class Counted:
    bytes: int
    lines: int


def lines_count(chunks: Iterator[bytes]) -> Counted:
    """Bytes and lines of a file read in chunks (a last line without its
    newline counts)."""
    size = lines = 0
    last = b"\n"
    for chunk in chunks:
        if chunk:
            size += len(chunk)
            lines += chunk.count(b"\n")
            last = chunk[-1:]
    if size and last != b"\n":
        lines += 1
    return Counted(bytes=size, lines=lines)


def file_store(*, ctx: CallerContext, upload: UploadedFile | None, purpose: str) -> BatchFile:
    """Store an upload for ``ctx``'s workload; a 400 for a missing file, a
    purpose other than ``batch``, or an empty file; a 413 past the limit."""
    if purpose not in UPLOAD_PURPOSES:
        raise bad_request("'purpose' must be 'batch' (the only purpose Sluice stores).", param="purpose",
                          code="invalid_purpose")
    if upload is None:
        raise bad_request("Send the file as multipart/form-data field 'file'.", param="file",
                          code="missing_required_parameter")
    if upload.size > settings.SLUICE_BATCH_FILE_MAX_BYTES:
        raise bad_request(f"The file exceeds {settings.SLUICE_BATCH_FILE_MAX_BYTES} bytes.", param="file",
                          code="file_too_large", status=413)
    counted = lines_count(upload.chunks(READ_CHUNK))
    if counted.lines == 0:
        raise bad_request("The file is empty.", param="file", code="empty_file")
    stored = BatchFile(tenant_id=ctx.tenant_id, workload_id=ctx.workload_id, purpose=purpose,
                       filename=(upload.name or "upload.jsonl")[:255], bytes=counted.bytes, lines=counted.lines)
    upload.seek(0)
    stored.content.save(f"{stored.id}.jsonl", upload, save=False)
    stored.save(force_insert=True)
    return stored


def file_write(*, tenant_id: int, workload_id: int, purpose: str, filename: str, lines: Iterator[bytes]) -> BatchFile:
    """A file Sluice writes (a batch's output or errors), line by line,
    spooled to a temporary file and then stored."""
    with tempfile.TemporaryFile() as spool:
        count = size = 0
        for line in lines:
            spool.write(line)
            count += 1
            size += len(line)
        spool.seek(0)
        stored = BatchFile(tenant_id=tenant_id, workload_id=workload_id, purpose=purpose, filename=filename,
                           bytes=size, lines=count)
        stored.content.save(f"{stored.id}.jsonl", File(spool), save=False)
        stored.save(force_insert=True)
    return stored


def file_of_workload(*, file_id: str, workload_id: int) -> BatchFile | None:
    """A file the caller's workload may see (None for another's: a 404, never a 403)."""
    return BatchFile.objects.filter(pk=file_id, workload_id=workload_id).first()


def file_delete(stored: BatchFile) -> None:
    stored.content.delete(save=False)
    stored.delete()


def file_view(stored: BatchFile) -> dict:
    """OpenAI's file object."""
    return {"id": stored.id, "object": "file", "bytes": stored.bytes, "created_at": int(stored.created_at.timestamp()),
            "filename": stored.filename, "purpose": stored.purpose, "status": "processed", "status_details": None,
            "expires_at": None}


def file_chunks(stored: BatchFile) -> Iterator[bytes]:
    """The file's content in chunks, for a streamed answer."""
    with stored.content.open("rb") as handle:
        while chunk := handle.read(READ_CHUNK):
            yield chunk
