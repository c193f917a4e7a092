"""protocol.compression: request bodies with Content-Encoding, responses as Accept-Encoding asks."""

from __future__ import annotations

import asyncio
import gzip
import json
import zlib

import httpx
import pytest
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.responses import Response
from starlette.routing import Route

from deployments.protocol.compression import CompressionMiddleware, decompress, preferred_coding
from deployments.protocol.errors import error_status
from deployments.runtime.contract.errors import InvalidInput, PayloadTooLarge, UnsupportedMediaType

BODY = json.dumps({"inputs": [{"name": "INPUT0", "data": list(range(400))}]}).encode()


@pytest.mark.parametrize("header, encode", [
    ("gzip", gzip.compress),                         # tritonclient: request_compression_algorithm="gzip"
    ("deflate", zlib.compress),                      # tritonclient: "deflate" is the zlib format
    ("x-gzip", gzip.compress),
    (" GZip ", gzip.compress),
    ("identity", lambda b: b),
    ("deflate, gzip", lambda b: gzip.compress(zlib.compress(b))),  # applied in the order listed
])
def test_request_body_is_decoded(header, encode):
    assert decompress(encode(BODY), header, 1 << 20) == BODY


def test_no_header_leaves_the_body_alone():
    assert decompress(BODY, None, 1 << 20) == BODY


@pytest.mark.parametrize("header", ["br", "zstd", "gzip, compress"])
def test_unknown_coding_is_415_naming_it_and_the_supported_ones(header):
    with pytest.raises(UnsupportedMediaType) as info:
        decompress(BODY, header, 1 << 20)
    status, message = error_status(info.value)
    assert status == 415
    assert message == (f"Content-Encoding '{header.split(', ')[-1]}' is not supported; "
                       "supported: ['deflate', 'gzip', 'identity']")


@pytest.mark.parametrize("body, header, words", [
    (BODY, "gzip", "not valid gzip data"),
    (gzip.compress(BODY)[:-12], "gzip", "truncated gzip data"),
    (zlib.compress(BODY) + b"junk", "deflate", "4 bytes after the end of its deflate data"),
])
def test_corrupt_truncated_or_trailing_data_is_400(body, header, words):
    with pytest.raises(InvalidInput, match=words) as info:
        decompress(body, header, 1 << 20)
    assert error_status(info.value)[0] == 400


def test_a_body_decompressing_past_the_limit_is_413_without_inflating_it_all():
    bomb = gzip.compress(b"\0" * (64 << 20))  # 64 MiB of zeros in about 64 KB
    with pytest.raises(PayloadTooLarge, match="to more than the limit of 1048576 bytes") as info:
        decompress(bomb, "gzip", 1 << 20)
    assert error_status(info.value)[0] == 413


@pytest.mark.parametrize("header, coding", [
    ("gzip", "gzip"), ("deflate", "deflate"), ("gzip, deflate", "gzip"), ("deflate;q=1, gzip;q=0.5", "deflate"),
    ("gzip;q=0, deflate", "deflate"), ("*", "gzip"), ("*;q=0.2, deflate", "deflate"), ("br", None),
    ("identity", None), ("", None), (None, None), ("gzip;q=bad", None),
])
def test_response_coding_follows_accept_encoding_weights(header, coding):
    assert preferred_coding(header) == coding


@pytest.fixture(scope="module")
def app() -> Starlette:
    async def big(request):
        return Response(BODY, media_type="application/json")

    async def small(request):
        return Response(b'{"live":true}', media_type="application/json")

    return Starlette(routes=[Route("/big/infer", big), Route("/small/infer", small)],
                     middleware=[Middleware(CompressionMiddleware)])


def raw_get(app: Starlette, path: str, accept: str) -> tuple[dict, bytes]:
    """Headers and the body exactly as the app sent them (no client-side decoding)."""
    async def get() -> tuple[dict, bytes]:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as client:
            async with client.stream("GET", path, headers={"Accept-Encoding": accept}) as r:
                return dict(r.headers), b"".join([chunk async for chunk in r.aiter_raw()])

    return asyncio.run(get())


@pytest.mark.parametrize("accept, coding, decode", [
    ("deflate", "deflate", zlib.decompress), ("gzip", "gzip", gzip.decompress),
    ("gzip;q=0.1, deflate", "deflate", zlib.decompress),
])
def test_responses_are_compressed_as_asked(app, accept, coding, decode):
    headers, body = raw_get(app, "/big/infer", accept)
    assert headers["content-encoding"] == coding and headers["vary"] == "Accept-Encoding"
    assert int(headers["content-length"]) == len(body) < len(BODY)
    assert decode(body) == BODY


@pytest.mark.parametrize("path, accept", [("/big/infer", "br"), ("/big/infer", "identity"), ("/small/infer", "deflate")])
def test_responses_stay_plain_when_no_coding_fits_or_the_body_is_small(app, path, accept):
    headers, body = raw_get(app, path, accept)
    assert "content-encoding" not in headers
    assert body in (BODY, b'{"live":true}')


def test_an_uncompressed_infer_answer_of_500_bytes_or_more_says_vary_accept_encoding(app):
    big, _ = raw_get(app, "/big/infer", "identity")
    small, _ = raw_get(app, "/small/infer", "identity")
    assert big["vary"] == "Accept-Encoding" and "vary" not in small
