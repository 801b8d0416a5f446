"""A loopback TCP proxy that delays every response chunk: a slow server for fault and balance tests.

`python -m loadtests.delay_proxy LISTEN_PORT TARGET_PORT DELAY_SECONDS` forwards 127.0.0.1:LISTEN
to 127.0.0.1:TARGET, sleeping DELAY before passing on each chunk the target sends back.
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


async def serve(listen_port: int, target_port: int, delay_s: float) -> None:
    async def handle(client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter) -> None:
        try:
            up_r, up_w = await asyncio.open_connection("127.0.0.1", target_port)
        except OSError:
            client_w.close()
            return
        await asyncio.gather(_pipe(client_r, up_w, 0.0), _pipe(up_r, client_w, delay_s))

    server = await asyncio.start_server(handle, "127.0.0.1", listen_port)
    async with server:
        await server.serve_forever()


def main() -> None:
    listen, target, delay = int(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3])
    asyncio.run(serve(listen, target, delay))


if __name__ == "__main__":
    main()
