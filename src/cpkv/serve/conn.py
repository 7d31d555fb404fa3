"""The HTTP connection: uvicorn's h11 protocol with deadlines for the parts uvicorn leaves unbounded.

uvicorn closes a keep-alive connection that stays idle between requests (``timeout_keep_alive``), but a client
that connects, or sends part of its headers, and then goes quiet would hold its connection forever; so would
one still sending a body the server has already answered (a 413: uvicorn reads and drops the rest, so that the
client, still writing, gets to read the answer instead of a reset). Here one timer per connection runs

    headers   from the connection's start, and from each answer, until a request's headers are complete
              (h11's view of the client leaves IDLE): ``header_timeout_s``
    drain     from an answer sent before its request's body ended, until that body ends: ``body_timeout_s``

and closes the connection when it fires first. Reading a body the app asked for is the app's deadline
(``cpkv.serve.app.read_body``).
"""
from __future__ import annotations


def deadline_protocol(header_timeout_s: float, body_timeout_s: float) -> type:
    """An ``asyncio.Protocol`` class for ``uvicorn.Config(http=...)``: h11 with the deadlines above."""
    import h11
    from uvicorn.protocols.http.h11_impl import H11Protocol

    limits = {"headers": header_timeout_s, "drain": body_timeout_s}

    class DeadlineProtocol(H11Protocol):
        deadline = None  # (kind, asyncio.TimerHandle) while one runs

        def connection_made(self, transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self._watch()

        def handle_events(self) -> None:
            super().handle_events()
            self._watch()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            self._watch()

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm()
            super().connection_lost(exc)

        def _kind(self) -> str | None:
            """The deadline the connection's state calls for (None: a request is being read or answered)."""
            if self.transport.is_closing():
                return None
            theirs = self.conn.their_state
            if theirs is h11.IDLE:
                return "headers"
            if theirs is h11.SEND_BODY and self.conn.our_state is h11.DONE:
                return "drain"
            return None

        def _watch(self) -> None:
            """Start the deadline the state calls for; one already running for that state keeps its start (more
            bytes of the same headers do not push it back)."""
            kind = self._kind()
            if self.deadline is not None and self.deadline[0] == kind:
                return
            self._disarm()
            if kind is not None:
                self.deadline = (kind, self.loop.call_later(limits[kind], self._late, kind))

        def _disarm(self) -> None:
            if self.deadline is not None:
                self.deadline[1].cancel()
                self.deadline = None

        def _late(self, kind: str) -> None:
            self.deadline = None
            if self._kind() == kind:
                self.transport.close()

    return DeadlineProtocol
