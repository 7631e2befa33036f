#!/usr/bin/env python3
"""A TCP proxy that delays every byte by a fixed time in each direction, as a
store some way off would: each connection's bytes keep their order and arrive
DELAY_MS after they were sent (a round trip costs twice that). Used by
benches/compare-s3.sh when LATENCY_MS is set.

Usage: benches/latency-proxy.py LISTEN_PORT TARGET_PORT DELAY_MS
"""
import asyncio
import sys
import time

LISTEN, TARGET, DELAY = int(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3]) / 1000


async def pipe(reader, writer):
    queue = asyncio.Queue()

    async def receive():
        while True:
            data = await reader.read(1 << 16)
            await queue.put((time.monotonic() + DELAY, data))
            if not data:
                return

    async def send():
        while True:
            due, data = await queue.get()
            wait = due - time.monotonic()
            if wait > 0:
                await asyncio.sleep(wait)
            if not data:
                if writer.can_write_eof():
                    writer.write_eof()
                return
            writer.write(data)
            await writer.drain()

    await asyncio.gather(receive(), send())


async def handle(client_reader, client_writer):
    try:
        server_reader, server_writer = await asyncio.open_connection("127.0.0.1", TARGET)
    except OSError:
        client_writer.close()
        return
    try:
        await asyncio.gather(pipe(client_reader, server_writer), pipe(server_reader, client_writer))
    except (OSError, asyncio.IncompleteReadError):
        pass
    finally:
        client_writer.close()
        server_writer.close()


async def main():
    server = await asyncio.start_server(handle, "127.0.0.1", LISTEN)
    async with server:
        await server.serve_forever()


asyncio.run(main())
