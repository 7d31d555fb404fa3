"""The HTTP connection: uvicorn's h11 protocol with a deadline for a request's headers.

uvicorn closes a keep-alive connection that stays idle between requests (``timeout_keep_alive``), but a client
that connects, or sends part of its headers, and then goes quiet would hold its connection forever. Here a
timer runs from the connection's start, and again after each answer, until a request's headers are complete
(h11's view of the client leaves ``IDLE``); when it fires first, the connection is closed.
"""
from __future__ import annotations

import asyncio


def header_timeout_protocol(timeout_s: float) -> type:
    """An ``asyncio.Protocol`` class for ``uvicorn.Config(http=...)``: h11 with a ``timeout_s`` header deadline."""
    import h11
    from uvicorn.protocols.http.h11_impl import H11Protocol

    class HeaderTimeoutProtocol(H11Protocol):
        header_timer: asyncio.TimerHandle | None = None

        def connection_made(self, transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self._arm()

        def handle_events(self) -> None:
            super().handle_events()
            if self.conn.their_state is not h11.IDLE:  # a request's headers are in
                self._disarm()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            if not self.transport.is_closing() and self.conn.their_state is h11.IDLE:
                self._arm()  # waiting for the next request's headers

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm()
            super().connection_lost(exc)

        def _arm(self) -> None:
            self._disarm()
            self.header_timer = self.loop.call_later(timeout_s, self._headers_late)

        def _disarm(self) -> None:
            if self.header_timer is not None:
                self.header_timer.cancel()
                self.header_timer = None

        def _headers_late(self) -> None:
            self.header_timer = None
            if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
                self.transport.close()

    HeaderTimeoutProtocol.timeout_s = timeout_s  # type: ignore[attr-defined]
    return HeaderTimeoutProtocol
