"""The output streams of one admitted API request, as its HTTP handler reads them."""

from __future__ import annotations

from collections.abc import Callable

import structlog

from actors.frontend.output_stream import RequestStream, StreamDelta

Release = Callable[..., None]
"""`release(request_ids, abort=False)`: the admission actor's (its readers are done)."""

log = structlog.get_logger("tandem.admission")


class AdmittedGroup:
    """The streams of one admitted API request. Read them through `get`, which reports
    each stream's end to the admission actor once its reader has seen it; `close()`
    (always, e.g. in `finally`) aborts whatever is still running and releases the rest."""

    def __init__(self, release: Release, streams: list[RequestStream]) -> None:
        self._release_ids = release
        self.streams = streams
        self._done = [False] * len(streams)

    @property
    def request_ids(self) -> list[str]:
        return [s.request_id for s in self.streams]

    async def get(self, index: int) -> StreamDelta | None:
        """The next delta of sample `index` (everything since its last read); None at the end."""
        delta = await self.streams[index].get()
        if delta is None:
            self._release(index)
            return None
        if delta.finished:
            self._release(index)
        return delta

    def close(self) -> None:
        unfinished = tuple(
            self.streams[i].request_id for i in range(len(self.streams)) if not self._done[i]
        )
        for i in range(len(self.streams)):
            self._done[i] = True
        if unfinished:
            try:
                self._release_ids(unfinished, abort=True)
            except Exception:  # noqa: BLE001 - the actor is gone: the engine is stopping anyway
                log.debug("admission_closed_before_release", num_requests=len(unfinished))

    def _release(self, index: int) -> None:
        if not self._done[index]:
            self._done[index] = True
            self._release_ids((self.streams[index].request_id,))
