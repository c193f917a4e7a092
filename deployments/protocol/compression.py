"""HTTP content coding: compressed request bodies in, compressed responses out (gzip, deflate).

Sources: RFC 9110 section 8.4 (``Content-Encoding``: codings listed in the order they were
applied) and 12.5.3 (``Accept-Encoding`` with ``q`` weights); "deflate" is the zlib format of
RFC 1950, which is what ``tritonclient`` sends (``zlib.compress``) and expects back
(``zlib.decompress``) for ``request_compression_algorithm`` / ``response_compression_algorithm``
``"deflate"``, and what Triton's server speaks.

* Requests: ``decompress`` undoes ``Content-Encoding`` gzip, x-gzip, deflate (identity: as is)
  and bounds the decoded size; any other coding is 415 naming it.
* Responses: ``CompressionMiddleware`` is Starlette's ``GZipMiddleware`` that also answers
  deflate, choosing the coding the client weights higher in ``Accept-Encoding`` (gzip on a tie).
  Bodies under ``minimum_size`` bytes (500) go uncompressed, without ``Content-Encoding``.
"""

from __future__ import annotations

import zlib

from starlette.datastructures import Headers
from starlette.middleware.gzip import GZipMiddleware, GZipResponder, IdentityResponder
from starlette.types import ASGIApp, Receive, Scope, Send

from ..runtime.contract.errors import InvalidInput, PayloadTooLarge, UnsupportedMediaType

_WBITS_BY_CODING = {"gzip": 16 + zlib.MAX_WBITS, "x-gzip": 16 + zlib.MAX_WBITS, "deflate": zlib.MAX_WBITS}
"""zlib's ``wbits`` per content coding: 16 + 15 reads the gzip wrapper, 15 the zlib wrapper."""

REQUEST_CODINGS = ("deflate", "gzip", "identity")
RESPONSE_CODINGS = ("gzip", "deflate")  # server preference on a tie of q weights


def content_codings(header: str | None) -> list[str]:
    """The codings of a ``Content-Encoding`` header, in the order they were applied (identity
    left out); [] for no header.

    Raises:
        UnsupportedMediaType: a coding other than gzip, x-gzip, deflate or identity.
    """
    codings = [c.strip().lower() for c in (header or "").split(",") if c.strip()]
    for coding in codings:
        if coding != "identity" and coding not in _WBITS_BY_CODING:
            raise UnsupportedMediaType(
                f"Content-Encoding '{coding[:40]}' is not supported; supported: {list(REQUEST_CODINGS)}")
    return [c for c in codings if c != "identity"]


def _inflate(data: bytes, coding: str, limit_bytes: int) -> bytes:
    inflater = zlib.decompressobj(_WBITS_BY_CODING[coding])
    try:
        out = inflater.decompress(data, limit_bytes + 1)
    except zlib.error as e:
        raise InvalidInput(f"request body is not valid {coding} data (Content-Encoding: {coding}): {e}") from None
    if len(out) > limit_bytes:
        raise PayloadTooLarge(
            f"request body decompresses (Content-Encoding: {coding}) to more than the limit of "
            f"{limit_bytes} bytes")
    if not inflater.eof:
        raise InvalidInput(f"request body is truncated {coding} data (Content-Encoding: {coding})")
    if inflater.unused_data:
        raise InvalidInput(
            f"request body has {len(inflater.unused_data)} bytes after the end of its {coding} data "
            f"(Content-Encoding: {coding})")
    return out


def decompress(body: bytes, header: str | None, limit_bytes: int) -> bytes:
    """``body`` with its ``Content-Encoding`` undone (last applied, first undone).

    Args:
        body: the request body as received.
        header: the ``Content-Encoding`` header, or None.
        limit_bytes: the largest decoded body allowed (the server's body limit).

    Raises:
        UnsupportedMediaType: an unknown coding (415).
        InvalidInput: corrupt, truncated or trailing data (400).
        PayloadTooLarge: the decoded body is over ``limit_bytes`` (413); decoding stops there.
    """
    for coding in reversed(content_codings(header)):
        body = _inflate(body, coding, limit_bytes)
    return body


def preferred_coding(header: str | None) -> str | None:
    """The response coding for an ``Accept-Encoding`` header: gzip or deflate, whichever has the
    higher ``q`` weight (``*`` stands for both; ``q=0`` refuses), gzip on a tie; None for neither."""
    weights: dict[str, float] = {}
    for item in (header or "").split(","):
        coding, *params = [part.strip().lower() for part in item.split(";")]
        q = 1.0
        for param in params:
            key, _, value = param.partition("=")
            if key.strip() == "q":
                try:
                    q = float(value)
                except ValueError:
                    q = 0.0
        for name in RESPONSE_CODINGS if coding == "*" else (coding,):
            if name in RESPONSE_CODINGS and (coding != "*" or name not in weights):
                weights[name] = q
    accepted = [c for c in RESPONSE_CODINGS if weights.get(c, 0.0) > 0]
    return max(accepted, key=lambda c: weights[c]) if accepted else None


class DeflateResponder(GZipResponder):
    """Starlette's gzip responder writing the zlib format (``Content-Encoding: deflate``)."""

    content_encoding = "deflate"

    @property
    def compressor(self) -> "zlib._Compress":
        if self._compressor is None:
            self._compressor = zlib.compressobj(self.compresslevel, zlib.DEFLATED, zlib.MAX_WBITS)
        return self._compressor


class CompressionMiddleware(GZipMiddleware):
    """``GZipMiddleware`` answering infer responses with gzip or deflate as ``preferred_coding``
    picks (zlib level 6 by default: level 9, Starlette's default, costs more CPU for little gain
    on tensor data); other routes answer uncompressed, as Triton's do."""

    def __init__(self, app, minimum_size: int = 500, compresslevel: int = 6) -> None:
        super().__init__(app, minimum_size=minimum_size, compresslevel=compresslevel)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        # Only infer responses are compressed, as Triton does: tritonclient's asyncio client reads
        # every other answer raw (aiohttp with auto_decompress off), whatever Accept-Encoding
        # aiohttp added to the request.
        if scope["type"] != "http" or not scope["path"].endswith("/infer"):
            await self.app(scope, receive, send)
            return
        coding = preferred_coding(Headers(scope=scope).get("accept-encoding"))
        await self.responder(self.app, coding)(scope, receive, send)

    def responder(self, app: ASGIApp, coding: str | None) -> IdentityResponder:
        """Starlette's responder that answers an infer request through ``app`` in ``coding``
        (``preferred_coding`` of its ``Accept-Encoding``: gzip, deflate, or None for as it is)."""
        if coding is None:
            return IdentityResponder(app, self.minimum_size, exclude_content_types=self.exclude_content_types)
        kind = GZipResponder if coding == "gzip" else DeflateResponder
        return kind(app, self.minimum_size, compresslevel=self.compresslevel, thread_minimum_size=self.thread_minimum_size,
                    exclude_content_types=self.exclude_content_types)
