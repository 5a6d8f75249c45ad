"""`GET /ui`, the status page in a browser, and `GET /status/events`, the live feed it reads.

The page is three files in iop/edge/static/, shipped inside the package (and so inside iop.pyz):
no framework, no build step, nothing fetched from elsewhere. They hold no data: everything shown
comes from `/status/events`, which asks for a client key exactly as `/status` does. So the files
themselves are served without a key; a browser cannot send a bearer header when it navigates to a
URL, and the page asks for the key instead, keeping it in the tab's sessionStorage.

The feed builds the status document once per period and sends the same bytes to every open page:
with 20 pages open that costs the edge a small fraction of what 20 pages polling `/status` once a
second cost (bench/ui_live.py, docs/performance.md).
"""

from __future__ import annotations

import asyncio
import importlib.resources
from collections.abc import AsyncIterator

from starlette.requests import Request
from starlette.responses import RedirectResponse, Response, StreamingResponse
from starlette.routing import Route

from iop.contracts.status import encode_status
from iop.edge.keys import EdgeKeys
from iop.edge.status import StatusSources, status_of
from iop.errors import NotFound, Unavailable

PERIOD_S = 1.0
"""How often the feed sends a fresh status document (the node heartbeat's own period)."""

SECURITY_HEADERS = {
    # Only the page's own files run, style and load; no inline script or style at all, so a value
    # that slipped into the markup could not run even if the page's textContent-only rendering failed.
    "Content-Security-Policy": (
        "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self'; connect-src 'self'; "
        "base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
    ),
    "X-Content-Type-Options": "nosniff",
    "X-Frame-Options": "DENY",
    "Referrer-Policy": "no-referrer",
    # An upgraded edge serves new files at once: the browser revalidates instead of guessing.
    "Cache-Control": "no-cache",
}

_FILES = {
    "app.js": "text/javascript; charset=utf-8",
    "app.css": "text/css; charset=utf-8",
    "favicon.svg": "image/svg+xml",
}


def _static(name: str) -> bytes:
    return importlib.resources.files("iop.edge").joinpath("static", name).read_bytes()


class StatusFeed:
    """One status document per period, built and encoded once, handed to every open page.

    A page that reads slowly skips to the newest document rather than queueing old ones.
    """

    def __init__(self, src: StatusSources, period_s: float = PERIOD_S) -> None:
        self.sources = src
        self.period_s = period_s
        self.closing = False
        self._pages: set[asyncio.Queue[bytes]] = set()
        self._task: asyncio.Task[None] | None = None

    @property
    def pages(self) -> int:
        return len(self._pages)

    def frame(self) -> bytes:
        return b"event: status\ndata: " + encode_status(status_of(self.sources)) + b"\n\n"

    def subscribe(self) -> asyncio.Queue[bytes]:
        page: asyncio.Queue[bytes] = asyncio.Queue(maxsize=1)
        page.put_nowait(self.frame())  # the page has data at once, not a period later
        self._pages.add(page)
        if self._task is None or self._task.done():
            self._task = asyncio.create_task(self._run())
        return page

    def unsubscribe(self, page: asyncio.Queue[bytes]) -> None:
        self._pages.discard(page)

    def close(self) -> None:
        """End every open stream now: an edge shutting down must not wait for pages to go away."""
        self.closing = True
        for page in self._pages:
            self._put(page, b"")
        if self._task is not None:
            self._task.cancel()

    @staticmethod
    def _put(page: asyncio.Queue[bytes], frame: bytes) -> None:
        if page.full():
            page.get_nowait()
        page.put_nowait(frame)

    async def _run(self) -> None:
        while self._pages and not self.closing:
            await asyncio.sleep(self.period_s)  # the feed's own clock: a page wants a document a second
            if not self._pages:
                break
            frame = self.frame()
            for page in self._pages:
                self._put(page, frame)


def ui_routes(keys: EdgeKeys, feed: StatusFeed, *, ledger_on: bool) -> list[Route]:
    """`/ui`, its files under `/ui/`, and `/status/events`.

    `ledger_on`: the edge serves `/usage` and `/usage/tail` (the page shows them).
    """
    page_template = _static("index.html")
    files = {name: (_static(name), media) for name, media in _FILES.items()}

    async def page(request: Request) -> Response:
        # Whether a key is needed, and whether the ledger's endpoints answer, is told in the page, so it
        # requests nothing that must fail: a refused request is a console error and a flash of nothing.
        body = page_template.replace(b"{{keys}}", b"required" if keys.clients else b"none")
        body = body.replace(b"{{ledger}}", b"on" if ledger_on else b"off")
        return Response(body, media_type="text/html; charset=utf-8", headers=SECURITY_HEADERS)

    async def slash(request: Request) -> Response:
        # The page's links are relative to `/ui` (so a path prefix added by a proxy keeps working).
        return RedirectResponse("../ui", status_code=308)

    async def asset(request: Request) -> Response:
        name = request.path_params["name"]
        found = files.get(name)
        if found is None:
            raise NotFound(f"GET /ui/{name}: the status page has no such file", code="not_found")
        return Response(found[0], media_type=found[1], headers=SECURITY_HEADERS)

    async def events(request: Request) -> Response:
        keys.client(request.scope)
        if feed.closing:
            raise Unavailable("the edge is shutting down", code="shutting_down")
        queue = feed.subscribe()

        async def stream() -> AsyncIterator[bytes]:
            try:
                while frame := await queue.get():
                    yield frame
            finally:
                feed.unsubscribe(queue)

        headers = {"Cache-Control": "no-store", "X-Content-Type-Options": "nosniff", "X-Accel-Buffering": "no"}
        return StreamingResponse(stream(), media_type="text/event-stream", headers=headers)

    return [
        Route("/ui", page, methods=["GET"]),
        Route("/ui/", slash, methods=["GET"]),
        Route("/ui/{name}", asset, methods=["GET"]),
        Route("/status/events", events, methods=["GET"]),
    ]
