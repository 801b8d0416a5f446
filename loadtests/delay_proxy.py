"""A loopback TCP proxy that delays responses: a slow server for fault and balance tests.

`python -m loadtests.delay_proxy LISTEN_PORT TARGET_PORT DELAY_SECONDS [--only-infer]` forwards
127.0.0.1:LISTEN to 127.0.0.1:TARGET. By default it sleeps DELAY before passing on each chunk the
target sends back (any protocol). With `--only-infer` it reads HTTP/1.1 exchanges one at a time and
delays only the answers to `POST .../infer`: health probes and metadata pass at once, so a server
can be slow (or, with a long delay, hung) for inference while its health checks stay green.
"""

from __future__ import annotations

import asyncio
import sys


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, delay_s: float) -> None:
    try:
        while data := await reader.read(65536):
            if delay_s:
                await asyncio.sleep(delay_s)
            writer.write(data)
            await writer.drain()
    except (ConnectionError, asyncio.CancelledError):
        pass
    finally:
        writer.close()


async def _read_message(reader: asyncio.StreamReader) -> bytes:
    """One HTTP/1.1 message with a Content-Length body (what Triton and the gateway send)."""
    head = await reader.readuntil(b"\r\n\r\n")
    length = 0
    for line in head.split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            length = int(value.strip())
    return head + (await reader.readexactly(length) if length else b"")


async def _exchanges(
    client_r: asyncio.StreamReader,
    client_w: asyncio.StreamWriter,
    up_r: asyncio.StreamReader,
    up_w: asyncio.StreamWriter,
    delay_s: float,
) -> None:
    try:
        while True:
            request = await _read_message(client_r)
            up_w.write(request)
            await up_w.drain()
            response = await _read_message(up_r)
            request_line = request.split(b"\r\n", 1)[0]
            if request_line.startswith(b"POST ") and b"/infer" in request_line:
                await asyncio.sleep(delay_s)
            client_w.write(response)
            await client_w.drain()
    except (asyncio.IncompleteReadError, ConnectionError, asyncio.CancelledError):
        pass
    finally:
        client_w.close()
        up_w.close()


async def serve(listen_port: int, target_port: int, delay_s: float, only_infer: bool = False) -> None:
    async def handle(client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter) -> None:
        try:
            up_r, up_w = await asyncio.open_connection("127.0.0.1", target_port)
        except OSError:
            client_w.close()
            return
        if only_infer:
            await _exchanges(client_r, client_w, up_r, up_w, delay_s)
        else:
            await asyncio.gather(_pipe(client_r, up_w, 0.0), _pipe(up_r, client_w, delay_s))

    server = await asyncio.start_server(handle, "127.0.0.1", listen_port)
    async with server:
        await server.serve_forever()


def main() -> None:
    args = [a for a in sys.argv[1:] if a != "--only-infer"]
    listen, target, delay = int(args[0]), int(args[1]), float(args[2])
    asyncio.run(serve(listen, target, delay, only_infer="--only-infer" in sys.argv[1:]))


if __name__ == "__main__":
    main()
