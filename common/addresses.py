"""Collector addresses: the URL check and the shard a run reports to. Standard library alone: the trainer's
config, its transport and the CLI share them, and none of them may need torch or the web stack for it."""

from __future__ import annotations

import hashlib
import urllib.parse
from collections.abc import Sequence

__all__ = ["check_collector_url", "collector_urls", "pick_collector"]


def check_collector_url(url: str) -> urllib.parse.SplitResult:
    """``url`` split, if it is an ``http(s)://host[:port][/prefix]`` collector URL; else a ValueError that
    says what is expected. The one check: ``MonitorConfig`` runs it at construction, the sender and the
    poller when they open a connection."""
    try:
        u = urllib.parse.urlsplit(url)
        ok = u.scheme in ("http", "https") and bool(u.hostname)
        u.port  # noqa: B018 - raises ValueError for a port that is not a number
    except (ValueError, TypeError, AttributeError):
        ok = False
    if not ok:
        raise ValueError(f"collector must be an http(s)://host[:port] URL, got {url!r}")
    return u


def collector_urls(value: str | Sequence[str]) -> list[str]:
    """The collector URLs ``value`` names: a list, or one string with commas between URLs; each checked."""
    parts = value.split(",") if isinstance(value, str) else list(value)
    urls = [u.strip() for u in parts if isinstance(u, str) and u.strip()]
    if not urls or len(urls) != len(parts):
        raise ValueError(f"collector must be one http(s)://host[:port] URL or several (a list, or separated by "
                         f"commas), got {value!r}")
    for u in urls:
        check_collector_url(u)
    return urls


def pick_collector(urls: Sequence[str], run_id: str) -> str:
    """The shard a run reports to: rendezvous (highest-random-weight) hashing of ``run_id`` over ``urls``.

    Stable (every rank of a run, and every restart, picks the same shard, whatever the list's order); adding
    an Nth shard moves only the ~1/N of runs that now score highest on it, and removing one moves only its
    own runs. Why the trainer picks, rather than a router or a collector cluster: no extra hop and nothing new
    to run or keep consistent; each collector holds whole runs (its rules and directives need a run's every
    report), and Prometheus (or the Thanos/Mimir already in place) scrapes every shard, so alerts and
    dashboards see all runs. URLs are compared without a trailing slash."""
    def weight(url: str) -> tuple[int, str]:
        key = url.rstrip("/")
        digest = hashlib.blake2b(f"{key}\x00{run_id}".encode(), digest_size=8).digest()
        return int.from_bytes(digest, "big"), key

    return max(urls, key=weight)
