"""Names of shared-memory objects: `pserve.<supervisor pid>.<nonce>.<what>`, and the sweep of stale ones.

Every segment, semaphore and wake-up FIFO of the runtime lives in /dev/shm under such a name. The names
exist only while processes attach; a supervisor that died before unlinking them leaves names whose pid is
dead, and the next supervisor removes them at start.
"""

from __future__ import annotations

import os
import re
import secrets

import structlog

SHM_DIR = "/dev/shm"
PREFIX = "pserve"
_NAME_RE = re.compile(r"^(?:sem\.)?" + PREFIX + r"\.(\d+)\.")

log = structlog.get_logger("pipeline.names")


def new_namespace(pid: int | None = None) -> str:
    """A fresh namespace for one supervisor: `pserve.<pid>.<nonce>`."""
    return f"{PREFIX}.{pid if pid is not None else os.getpid()}.{secrets.token_hex(4)}"


def pid_alive(pid: int) -> bool:
    """True when a process with this pid exists and is not a zombie."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except (FileNotFoundError, ProcessLookupError):
        return False
    # The state letter follows the parenthesised command name, which may itself contain ')'.
    state = stat[stat.rfind(b")") + 2 : stat.rfind(b")") + 3]
    return state not in (b"Z", b"X")


def process_start_ticks(pid: int) -> int:
    """The process's start time in clock ticks since boot (field 22 of /proc/pid/stat); 0 if gone.

    Paired with the pid it names one process for good: a reused pid has another start time.
    """
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except (FileNotFoundError, ProcessLookupError):
        return 0
    fields = stat[stat.rfind(b")") + 2 :].split()
    return int(fields[19])


def same_process_alive(pid: int, start_ticks: int) -> bool:
    """True when the process that had this pid and start time is still running."""
    return pid_alive(pid) and process_start_ticks(pid) == start_ticks


def names_in_shm(namespace: str | None = None) -> list[str]:
    """Entries of /dev/shm that belong to this runtime (to one namespace, if given)."""
    try:
        entries = os.listdir(SHM_DIR)
    except FileNotFoundError:
        return []
    own = [e for e in entries if _NAME_RE.match(e)]
    if namespace is None:
        return sorted(own)
    return sorted(e for e in own if e.removeprefix("sem.").startswith(namespace + "."))


def sweep_stale() -> list[str]:
    """Unlink every runtime name whose supervisor pid is dead; return what was removed."""
    removed = []
    for entry in names_in_shm():
        match = _NAME_RE.match(entry)
        if match is None or pid_alive(int(match.group(1))):
            continue
        try:
            os.unlink(os.path.join(SHM_DIR, entry))
            removed.append(entry)
        except FileNotFoundError:
            pass
    if removed:
        log.info("swept stale shared-memory names", count=len(removed), names=removed[:8])
    return removed
