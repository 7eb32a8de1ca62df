"""Errors of the runtime. Each says which ring or actor failed and why, so a caller can report it."""

from __future__ import annotations


class RuntimeFault(Exception):
    """Base class of every error raised by pipeline/."""


class LayoutMismatch(RuntimeFault):
    """A segment was created for other records or another ring geometry than the attacher expects."""


class RingTimeout(RuntimeFault):
    """A wait on a ring ran past its deadline while the peer was alive."""


class RingClosed(RuntimeFault):
    """The peer closed its end and every message it published has been read."""


class PeerDied(RuntimeFault):
    """The process at the other end of a ring is gone."""


class ProtocolError(RuntimeFault):
    """The ring holds something the protocol does not allow (a bug, or memory written by a stranger)."""


class ActorFailed(RuntimeFault):
    """An actor died, failed its start-up, or stopped heartbeating."""

    def __init__(self, actor: str, reason: str) -> None:
        super().__init__(f"actor {actor!r} failed: {reason}")
        self.actor = actor
        self.reason = reason
