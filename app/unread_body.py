"""An answer sent before its request's body was read closes the connection.

Routes answer some errors before reading the body (401 without a valid key, 413 for a
declared oversize body, 415, 503 while loading or draining, 404 and 405 from the router).
HTTP/1.1 cannot reuse a connection whose request body is partly unread, so Hypercorn closes
it after such an answer; without `Connection: close` in the answer a keep-alive client
would send its next request onto that closing connection and see it fail.
"""

from __future__ import annotations

from starlette.types import ASGIApp, Message, Receive, Scope, Send


class CloseIfBodyUnread:
    """Pure ASGI middleware: adds `Connection: close` to a response that starts before the
    request body was received to its end."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not _has_body(scope["headers"]):
            await self.app(scope, receive, send)
            return
        body_done = False

        async def receive_tracked() -> Message:
            nonlocal body_done
            message = await receive()
            if message["type"] == "http.request" and not message.get("more_body", False):
                body_done = True
            return message

        async def send_closing(message: Message) -> None:
            if message["type"] == "http.response.start" and not body_done:
                headers = [*message.get("headers", []), (b"connection", b"close")]
                message = {**message, "headers": headers}
            await send(message)

        await self.app(scope, receive_tracked, send_closing)


def _has_body(headers: list[tuple[bytes, bytes]]) -> bool:
    for name, value in headers:
        lowered = name.lower()
        if lowered == b"transfer-encoding" or (
            lowered == b"content-length" and value.strip() not in (b"", b"0")
        ):
            return True
    return False
