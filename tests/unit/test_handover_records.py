"""The agent's records on a pool connection, as the relay reads them (services/handover.py)."""

from __future__ import annotations

import asyncio
import socket

import pytest

from fusion_oci.services.handover import RECORD_FORMAT, Record, read_records


def _record(kind: bytes, ident: int, err: int = 0) -> bytes:
    return RECORD_FORMAT.pack(kind, ident, 0, 0, err)


def test_each_read_is_handed_over_whole_and_a_split_record_waits_for_its_end() -> None:
    async def main() -> list[list[Record]]:
        ours, agent = socket.socketpair()
        ours.setblocking(False)
        seen: list[list[Record]] = []
        reading = asyncio.ensure_future(read_records(ours, seen.append))
        four = b"".join(_record(b"H", i) for i in range(4))
        agent.sendall(four + _record(b"O", 9)[:10])  # half a pool at once, and a piece
        await asyncio.sleep(0.05)
        agent.sendall(_record(b"O", 9)[10:] + _record(b"D", 9, err=111))
        await asyncio.sleep(0.05)
        agent.close()
        await asyncio.wait_for(reading, 5)
        ours.close()
        return seen

    seen = asyncio.run(main())
    assert [[(r[0], r[1]) for r in batch] for batch in seen] == [
        [(b"H", 0), (b"H", 1), (b"H", 2), (b"H", 3)],
        [(b"O", 9), (b"D", 9)],
    ]
    assert seen[1][1][4] == 111


def test_a_bug_in_the_handler_ends_the_connection_not_the_loop() -> None:
    async def main() -> None:
        ours, agent = socket.socketpair()
        ours.setblocking(False)

        def broken(records: list[Record]) -> None:
            raise KeyError("a bug")

        reading = asyncio.ensure_future(read_records(ours, broken))
        agent.sendall(_record(b"H", 1))
        try:
            with pytest.raises(KeyError):
                await asyncio.wait_for(reading, 5)
        finally:
            agent.close()
            ours.close()

    asyncio.run(main())
