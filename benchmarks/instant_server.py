"""An HTTP server that answers every ``POST /v1/completions`` at once with canned bytes: the load client's ceiling.

    python -m benchmarks.instant_server --port P --answer ANSWER.json --stream STREAM.sse

The bytes are a real server's answers, recorded once (`benchmarks/client_ceiling.py` records them from the embedded
server over the engine stand-in): a non-streamed answer, and a streamed one as its SSE events. A request whose body
asks ``"stream": true`` gets the events, one HTTP chunk each (one write and one yield to the loop per event, as a
server that streams per engine step sends them); any other gets the answer. ``GET /health`` answers ``{}``. Keep-alive
connections, no parsing beyond the request line and ``Content-Length``: the server costs next to nothing, so a pass
against it measures the client alone. Its own process, unlike `benchmarks/stub_policy.py` (which runs in the caller's
process, so shares its GIL, and builds every answer): the client under test must have its CPU to itself. Benchmarks
only.
"""

from __future__ import annotations

import argparse
import asyncio
import re
import sys
from pathlib import Path

_LENGTH = re.compile(rb"\r\ncontent-length:\s*(\d+)", re.IGNORECASE)
_STREAM = re.compile(rb'"stream"\s*:\s*true')


def _head(status: str, content_type: str, length: int | None) -> bytes:
    framing = f"content-length: {length}" if length is not None else "transfer-encoding: chunked"
    return (f"HTTP/1.1 {status}\r\ncontent-type: {content_type}\r\n{framing}\r\n\r\n").encode()


def events(sse: bytes) -> list[bytes]:
    """The SSE events of a recorded stream, each with its blank-line terminator."""
    return [part + b"\n\n" for part in sse.split(b"\n\n") if part.strip()]


async def serve(port: int, answer: bytes, stream: list[bytes]) -> None:
    plain = _head("200 OK", "application/json", len(answer)) + answer
    chunks = [b"%x\r\n%s\r\n" % (len(e), e) for e in stream]
    opening = _head("200 OK", "text/event-stream", None)

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = _LENGTH.search(head)
                body = await reader.readexactly(int(length.group(1))) if length else b""
                if head.startswith(b"GET"):
                    writer.write(_head("200 OK", "application/json", 2) + b"{}")
                elif _STREAM.search(body):
                    writer.write(opening)
                    for chunk in chunks:
                        writer.write(chunk)
                        await asyncio.sleep(0)
                    writer.write(b"0\r\n\r\n")
                else:
                    writer.write(plain)
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", port, backlog=2048)
    async with server:
        await server.serve_forever()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--answer", type=Path, required=True, help="a recorded non-streamed answer (JSON bytes)")
    ap.add_argument("--stream", type=Path, required=True, help="a recorded streamed answer (SSE bytes)")
    args = ap.parse_args(argv)
    try:
        import uvloop

        uvloop.install()
    except ImportError:
        pass
    asyncio.run(serve(args.port, args.answer.read_bytes(), events(args.stream.read_bytes())))
    return 0


if __name__ == "__main__":
    sys.exit(main())
