"""A tracer that records, at every call into a library's I/O boundary, the
chain of project frames on the stack: the "spine" of whatever ran while it
was recording (tests/test_request_spine.py measures one chat request with it).

How it works: a profile function (``sys.setprofile`` for this thread,
``threading.setprofile`` for every thread started later; Python 3.11 has no
way to reach threads already running, so ``install`` notes them) sees every
Python call and every call of a C function. While ``recording`` is on:

- a call of a boundary function (``BOUNDARIES``: redis-py's connects and
  sends, sync and async; ``http.client``'s connect, request, putrequest and
  send; httpx's transports; Django's cursor execute and connect) records the project frames on its
  stack, walked with ``f_back`` from the boundary outwards (inside an
  asyncio task that is the task's chain of awaiting coroutines). A boundary
  reached inside another (``request`` -> ``send``, ``send_command`` ->
  ``send_packed_command``) is not recorded again;
- a C-level send or connect on an internet socket outside every boundary is
  recorded as ``socket.<method>``: I/O the boundaries above missed (expected:
  none);
- a call of ``ScriptCall.run``/``run_async`` records its script's
  name; an EVALSHA going out on a Redis connection records its SHA (named
  by the ``ScriptCall`` that sent it, else by the ``LuaScript`` objects the
  modules hold);
- any call into a project file adds that file to ``executed``.

Project files are the ``.py`` files under ``root`` except ``.venv/`` and
``tests/``. A chain lists its project frames outermost first; a file that
comes back on the chain after another file was entered in between
(A -> B -> A, consecutive frames of one file counting once) is a re-entry."""

from __future__ import annotations

import gc
import http.client
import inspect
import re
import socket
import sys
import threading
from dataclasses import dataclass, field
from pathlib import Path
from types import CodeType, FrameType

import django.db.backends.base.base
import django.db.backends.utils
import httpx
import redis.asyncio.connection
import redis.connection

from budgets.redis.scripts import LuaScript, ScriptCall

_CO_COROUTINE_LIKE = 0x0080 | 0x0100 | 0x0200  # CO_COROUTINE, CO_ITERABLE_COROUTINE, CO_ASYNC_GENERATOR
_SOCKET_SENDS = frozenset({"send", "sendall", "sendto", "sendmsg", "connect", "connect_ex"})
_INTERNET = (socket.AF_INET, socket.AF_INET6)
_EVALSHA = re.compile(rb"EVALSHA\r\n\$40\r\n([0-9a-f]{40})", re.IGNORECASE)


def _functions_named(module, names: tuple[str, ...]) -> dict[CodeType, str]:
    """Every function called one of ``names`` defined in a class of ``module``."""
    found: dict[CodeType, str] = {}
    for cls in vars(module).values():
        if not isinstance(cls, type) or cls.__module__ != module.__name__:
            continue
        for name in names:
            function = vars(cls).get(name)
            code = getattr(inspect.unwrap(function), "__code__", None) if function is not None else None
            if code is not None:
                found[code] = f"{module.__name__}.{name}"
    return found


def _code(function) -> CodeType:
    # a decorated function's own code, not its wrapper's (Django's
    # async_unsafe wraps ``connect`` and many others in one shared ``inner``)
    return inspect.unwrap(function).__code__


def _boundaries() -> dict[CodeType, str]:
    """The library functions that do I/O, by code object: label."""
    found = {}
    # (not redis-py's nor http.client's ``connect``: called before every
    # command or request, they return at once on a live connection; a real
    # connect is seen on its socket, below)
    found.update(_functions_named(redis.connection, ("send_packed_command", "send_command")))
    found.update(_functions_named(redis.asyncio.connection, ("send_packed_command", "send_command")))
    for name in ("request", "putrequest", "send"):
        found[_code(getattr(http.client.HTTPConnection, name))] = f"http.client.{name}"
    found[_code(httpx.HTTPTransport.handle_request)] = "httpx.HTTPTransport.handle_request"
    found[_code(httpx.AsyncHTTPTransport.handle_async_request)] = "httpx.AsyncHTTPTransport.handle_async_request"
    for name in ("execute", "executemany", "callproc"):
        found[_code(getattr(django.db.backends.utils.CursorWrapper, name))] = f"django.CursorWrapper.{name}"
    found[_code(django.db.backends.base.base.BaseDatabaseWrapper.connect)] = "django.DatabaseWrapper.connect"
    return found


BOUNDARIES = _boundaries()
SCRIPT_ENTRIES = {_code(getattr(ScriptCall, name)) for name in ("run", "run_async")}


@dataclass(frozen=True)
class BoundaryCall:
    """One call into a library's I/O: which boundary, on which thread, what
    it sent (a Redis command, an HTTP request line, SQL), and the project
    frames on the stack, outermost first, as ``path:function``."""

    boundary: str
    thread: str
    detail: str
    chain: tuple[str, ...]

    @property
    def files(self) -> tuple[str, ...]:
        """The chain's files, consecutive frames of one file counted once."""
        files: list[str] = []
        for frame in self.chain:
            path = frame.split(":", 1)[0]
            if not files or files[-1] != path:
                files.append(path)
        return tuple(files)

    @property
    def reentered(self) -> tuple[str, ...]:
        """Files entered again after another file came in between."""
        seen: set[str] = set()
        again: list[str] = []
        for path in self.files:
            if path in seen and path not in again:
                again.append(path)
            seen.add(path)
        return tuple(again)


@dataclass
class SpineTracer:
    root: Path
    recording: bool = False
    calls: list[BoundaryCall] = field(default_factory=list)
    calls_outside_project: int = 0  # boundary calls with no project frame on the stack (the test's own)
    executed: set[str] = field(default_factory=set)
    script_calls: list[str] = field(default_factory=list)  # ScriptCall names, in call order
    evalsha: list[str] = field(default_factory=list)  # SHAs sent, in order
    threads_untraced: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.root = Path(self.root).resolve()
        self._prefix = str(self.root) + "/"
        self._excluded = (str(self.root / ".venv") + "/", str(self.root / "tests") + "/")
        self._project: dict[str, str | None] = {}  # co_filename: path relative to root, or None
        self._resumed: dict[int, FrameType] = {}  # coroutine frames already entered (a resume is no new call)
        self._script_names: dict[str, str] = {}  # sha: LuaScript name

    # --- installing ---------------------------------------------------------

    def install(self) -> None:
        current = threading.current_thread()
        self.threads_untraced = sorted(t.name for t in threading.enumerate() if t is not current)
        threading.setprofile(self._profile)
        sys.setprofile(self._profile)

    def uninstall(self) -> None:
        """Stops tracing this thread and threads started from now on; threads
        started while installed keep the function, which then returns at once."""
        self.recording = False
        sys.setprofile(None)
        threading.setprofile(None)
        self._resumed.clear()

    def start(self) -> None:
        self._resumed.clear()
        self.recording = True

    def stop(self) -> None:
        self.recording = False
        self._resumed.clear()

    # --- the profile function -----------------------------------------------

    def _relative(self, filename: str) -> str | None:
        try:
            return self._project[filename]
        except KeyError:
            pass
        path = None
        if filename.startswith(self._prefix) and filename.endswith(".py") and not filename.startswith(self._excluded):
            path = filename[len(self._prefix):]
        self._project[filename] = path
        return path

    def _profile(self, frame: FrameType, event: str, arg) -> None:
        if not self.recording:
            return
        if event == "call":
            code = frame.f_code
            if code.co_flags & _CO_COROUTINE_LIKE:
                if id(frame) in self._resumed:
                    return  # a coroutine resumed: not a new call
                self._resumed[id(frame)] = frame
            path = self._relative(code.co_filename)
            if path is not None:
                self.executed.add(path)
            boundary = BOUNDARIES.get(code)
            if boundary is not None:
                self._boundary(frame, boundary, self._detail(boundary, frame.f_locals))
            elif code in SCRIPT_ENTRIES:
                script = frame.f_locals["self"].script
                self._script_names[script.sha] = script.name
                self.script_calls.append(script.name)
        elif event == "c_call":
            name = getattr(arg, "__name__", "")
            if name in _SOCKET_SENDS:
                sock = getattr(arg, "__self__", None)
                if isinstance(sock, socket.socket) and sock.family in _INTERNET:
                    self._boundary(frame, f"socket.{name}", "", caller_is_boundary_frame=False)

    def _boundary(self, frame: FrameType, boundary: str, detail: str, *,
                  caller_is_boundary_frame: bool = True) -> None:
        chain: list[str] = []
        outer = frame.f_back if caller_is_boundary_frame else frame
        while outer is not None:
            if outer.f_code in BOUNDARIES:
                return  # inside another boundary's call: recorded there
            path = self._relative(outer.f_code.co_filename)
            if path is not None:
                chain.append(f"{path}:{outer.f_code.co_qualname}")
            outer = outer.f_back
        if not chain:
            self.calls_outside_project += 1
            return
        chain.reverse()
        self.calls.append(BoundaryCall(boundary=boundary, thread=threading.current_thread().name, detail=detail,
                                       chain=tuple(chain)))

    def _detail(self, boundary: str, local: dict) -> str:
        if boundary.startswith("redis."):
            if "command" in local:  # send_packed_command(command)
                return self._redis_packed(local["command"])
            return " ".join(_text(a) for a in local.get("args", ())[:2])
        if boundary.startswith("http.client."):
            if "method" in local:
                return f"{local['method']} {local.get('url', '')}"
            return ""
        if boundary.startswith("httpx."):
            request = local.get("request")
            return f"{request.method} {request.url}" if request is not None else ""
        if boundary.startswith("django.CursorWrapper"):
            return " ".join(str(local.get("sql", "")).split())[:120]
        return ""

    def _redis_packed(self, command) -> str:
        if isinstance(command, (bytes, bytearray, memoryview)):
            data = bytes(command)
        else:
            data = b"".join(bytes(part) for part in command)
        shas = [sha.decode() for sha in _EVALSHA.findall(data)]
        self.evalsha.extend(shas)
        detail = "+".join(_resp_command_names(data))
        return " ".join([detail, *(self._script_name(sha) for sha in shas)])

    def _script_name(self, sha: str) -> str:
        name = self._script_names.get(sha)
        if name is None:  # a script built since the last look (a composed one is built at first use)
            self._script_names.update({script.sha: script.name for script in _lua_scripts_alive()})
            name = self._script_names.setdefault(sha, f"sha:{sha}")
        return name

    # --- reading the result -------------------------------------------------

    def spine_files(self) -> list[str]:
        return sorted({path for call in self.calls for path in call.files})

    def reentries(self) -> list[dict]:
        """Each distinct chain (by its files) that re-enters a file."""
        found: dict[tuple[str, ...], dict] = {}
        for call in self.calls:
            if call.reentered and call.files not in found:
                found[call.files] = {"reentered": list(call.reentered), "files": list(call.files),
                                     "boundary": call.boundary, "detail": call.detail, "thread": call.thread,
                                     "chain": list(call.chain)}
        return list(found.values())

    def lua_scripts(self) -> list[str]:
        """The scripts whose EVALSHA went out, by name, in order of first use
        (a composed call is one script named ``a+b+c``)."""
        return list(dict.fromkeys(self._script_name(sha) for sha in self.evalsha))


def _lua_scripts_alive() -> list[LuaScript]:
    """The module-level scripts, and any other the collector can see (not
    those ``gc.freeze`` moved out of its reach: llm_platform/gc_tuning.py)."""
    found = [value for module in list(sys.modules.values()) for value in list(vars(module).values())
             if isinstance(value, LuaScript)]
    return found + [o for o in gc.get_objects() if isinstance(o, LuaScript)]


def _resp_command_names(data: bytes) -> list[str]:
    """The first word of each command in a packed RESP packet (a pipeline
    or a ``Commands`` round trip holds several)."""
    names, pos = [], 0
    try:
        while pos < len(data) and data[pos:pos + 1] == b"*":
            end = data.index(b"\r\n", pos)
            count, pos = int(data[pos + 1:end]), end + 2
            for i in range(count):
                end = data.index(b"\r\n", pos)
                length = int(data[pos + 1:end])
                if i == 0:
                    names.append(data[end + 2:end + 2 + length].decode(errors="replace").upper())
                pos = end + 2 + length + 2
    except ValueError:
        names.append("?")
    return names


def _text(value) -> str:
    if isinstance(value, (bytes, bytearray, memoryview)):
        return bytes(value).decode(errors="replace")
    return str(value)


def script_parts(names: list[str]) -> list[str]:
    """The single scripts inside ``names`` (a composed script is ``a+b+c``)."""
    return list(dict.fromkeys(part for name in names for part in name.split("+")))
