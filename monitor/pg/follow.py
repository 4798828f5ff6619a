"""How a replica learns what the others accepted: it re-reads the runs whose revision moved under it
(``PgStore.changed_runs``), woken by ``NOTIFY nanwatch_runs`` (every commit that touches a run sends one)
or, should a notification be lost with a dropped listening connection, after ``every_s`` at the latest.
That period is the documented bound (``NANWATCH_DATABASE_REFRESH_S``, docs/replicas.md)."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

import psycopg

from nanwatch.monitor.pg.database import NOTIFY_CHANNEL, PgStore, StoreError

__all__ = ["follow"]

log = logging.getLogger("nanwatch.monitor")


async def _listener(url: str) -> psycopg.AsyncConnection | None:
    try:
        conn = await psycopg.AsyncConnection.connect(url, autocommit=True, connect_timeout=5)
        await conn.execute(f"LISTEN {NOTIFY_CHANNEL}")
        return conn
    except psycopg.Error as e:
        log.warning("nanwatch collector: cannot LISTEN on the database (%s); polling every period instead", e)
        return None


async def follow(store: PgStore, refresh: Callable[[set[str]], object], *, every_s: float,
                 tick: Callable[[], object] | None = None) -> None:
    """Forever: wait for a notification or ``every_s``, then ``refresh`` the runs that changed elsewhere,
    and call ``tick`` (the run leases' update)."""
    conn = await _listener(store.url)
    ticked = -every_s
    try:
        while True:
            if conn is None or conn.closed:
                await asyncio.sleep(every_s)
                conn = await _listener(store.url)
            else:
                try:
                    async for _ in conn.notifies(timeout=every_s, stop_after=1):
                        pass
                except psycopg.Error as e:
                    log.warning("nanwatch collector: the LISTEN connection failed (%s); reconnecting", e)
                    await conn.close()
            try:
                changed = store.changed_runs()
                if changed:
                    refresh(changed)
            except StoreError as e:
                log.warning("nanwatch collector: cannot read what other replicas wrote (%s); retrying", e)
            except Exception:  # the follower must outlive any one failure: it is how this replica stays current
                log.exception("nanwatch collector: re-reading what other replicas wrote failed; retrying")
            if tick is not None and time.monotonic() - ticked >= every_s / 2:  # not on every notification
                ticked = time.monotonic()
                try:
                    tick()
                except Exception:
                    log.exception("nanwatch collector: updating the run leases failed; retrying")
    finally:
        if conn is not None:
            await conn.close()
