"""A request's own chat template (--trust-request-chat-template) renders in a child process of
render's with a time limit and a memory limit: a template that loops for minutes or builds a
gigabyte string is a 400 for its request, and the process is replaced, while render goes on
serving every other request.

Torch-free and process-local: the render stage starts the children (fresh interpreters, which
inherit none of render's threads), one per template rendering at once, at first use.
"""

from __future__ import annotations

import contextlib
import ctypes
import multiprocessing
import multiprocessing.connection
import os
import resource
import signal
import subprocess
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from stages.text.chat_template import ChatTemplateError, render_chat

DEFAULT_TIMEOUT_S = 5.0
# Address space, not resident memory: the child's interpreter with jinja2 maps about 30 MiB
DEFAULT_MEMORY_BYTES = 512 * 1024 * 1024
_PR_SET_PDEATHSIG = 1
_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _serve(connection: multiprocessing.connection.Connection, memory_bytes: int) -> None:
    """The child: render each template it is sent until its parent's end closes."""
    resource.setrlimit(resource.RLIMIT_AS, (memory_bytes, memory_bytes))
    while True:
        try:
            template, messages, kwargs = connection.recv()
        except EOFError:
            return
        try:
            answer: tuple[str, str] = ("text", render_chat(template, messages, **kwargs))
        except ChatTemplateError as error:
            answer = ("error", str(error))
        except MemoryError:
            answer = ("memory", "")
        except RecursionError:
            answer = ("error", "the chat template recursed too deeply")
        try:
            connection.send(answer)
        except MemoryError:  # the text rendered, but its copy to send did not fit
            connection.send(("memory", ""))


class _Child:
    """One child process and its end of a socket pair; replaced when it is killed or dies.

    A plain interpreter that imports this module from where render imported it (not whatever
    the environment's path finds first), not multiprocessing's spawn: that would import the
    server's main module (and so quart) into every child."""

    def __init__(self, memory_bytes: int) -> None:
        self.connection, child_end = multiprocessing.Pipe()
        start = f"import sys; sys.path.insert(0, {_ROOT!r}); import {__name__} as m; m.child_main()"
        self.process = subprocess.Popen(
            [sys.executable, "-c", start, str(child_end.fileno()), str(memory_bytes)],
            pass_fds=(child_end.fileno(),),
            stdin=subprocess.DEVNULL,
        )
        child_end.close()

    def close(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            self.process.kill()
        self.process.wait()
        self.connection.close()


class TemplateSandbox:
    """Renders request templates in child processes, `timeout_s` and `memory_bytes` each.

    Thread-safe: each calling thread takes an idle child (or starts one), so as many templates
    render at once as threads call."""

    def __init__(
        self, timeout_s: float = DEFAULT_TIMEOUT_S, memory_bytes: int = DEFAULT_MEMORY_BYTES
    ) -> None:
        self.timeout_s = timeout_s
        self.memory_bytes = memory_bytes
        self._idle: list[_Child] = []
        self._lock = threading.Lock()
        # The kernel's parent-death signal follows the thread that started a child, not its
        # process: children are started from this one thread, which lives as long as render.
        self._spawner = ThreadPoolExecutor(1, thread_name_prefix="chat-template-spawner")
        self.num_replaced = 0  # children killed for their template (time) or lost to it

    def render(self, template: str, messages: list[dict[str, Any]], **kwargs: Any) -> str:
        """As chat_template.render_chat; ChatTemplateError also for a template past a limit."""
        with self._lock:
            child = self._idle.pop() if self._idle else None
        if child is not None and child.process.poll() is not None:  # it died idle
            child.close()
            child = None
        if child is None:
            child = self._spawner.submit(_Child, self.memory_bytes).result()
        try:
            child.connection.send((template, messages, kwargs))
            finished = child.connection.poll(self.timeout_s)
            kind, text = child.connection.recv() if finished else ("time", "")
        except (EOFError, OSError):
            kind, text = "lost", ""
        if kind in ("time", "lost"):
            self.num_replaced += 1
            child.close()
        else:
            with self._lock:
                self._idle.append(child)
        if kind == "text":
            return text
        if kind == "error":
            raise ChatTemplateError(text)
        raise ChatTemplateError(self._past_limit(kind))

    def _past_limit(self, kind: str) -> str:
        if kind == "time":
            return (
                f"the request's chat template did not finish within {self.timeout_s:g} s "
                "(--chat-template-timeout)"
            )
        if kind == "memory":
            return (
                f"the request's chat template needed more than "
                f"{self.memory_bytes // (1024 * 1024)} MiB (--chat-template-memory)"
            )
        return "the request's chat template ended the process that rendered it"

    def close(self) -> None:
        with self._lock:
            children, self._idle = self._idle, []
        for child in children:
            child.close()
        self._spawner.shutdown()


def child_main() -> None:
    """A child's start (`_Child`): its socket's descriptor and memory limit are its arguments."""
    # Ended with render: the kernel sends SIGKILL when the parent dies, and a terminal's ^C is
    # for the server.
    ctypes.CDLL(None).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    os.nice(19)  # a template that loops until its timeout takes what the model leaves
    _serve(multiprocessing.connection.Connection(int(sys.argv[1])), int(sys.argv[2]))
