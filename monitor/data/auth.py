"""Who a bearer token is: its role, its audit name, and the runs it may touch (``Principal``).

Three roles: ``ingest`` (trainers: post reports, poll directives, read runs), ``admin`` (change
directives, delete runs, read everything) and ``reader`` (``NANWATCH_METRICS_TOKEN``: Prometheus; reads
``/metrics`` and runs). A named ingest token may own a run-id namespace (``runs``: a glob such as
``team-a-*``, configured with the token): it writes, reads and polls only the runs whose id matches, and
the caps it fills are its namespace's (``Principal.namespace``), so one team's junk locks out no other.
An ingest token without ``runs`` (``NANWATCH_TOKEN``, the single-team setup) owns every run.

Tokens are compared with ``secrets.compare_digest`` against every configured token (no early exit). A
role with no token configured is open (``anonymous``); that is only allowed on loopback
(``Settings.check_exposure``).

Web-free (the ingress guard checks a token before it reads a body; the routes' dependencies check it
again through ``nanwatch.monitor.web.deps``): no FastAPI here.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass
from fnmatch import fnmatchcase
from typing import Literal

from nanwatch.monitor.data.refusal import Refused

__all__ = ["ANY_NAMESPACE", "Principal", "Role", "TokenTable", "Unauthorized"]

Role = Literal["ingest", "admin", "reader"]
#: the namespace of runs that no scoped token owns (and of unscoped tokens' caps)
ANY_NAMESPACE = "*"


@dataclass(frozen=True, slots=True)
class Principal:
    """The caller: ``name`` is what the audit log records; ``runs`` the glob of run ids it owns (None:
    every run)."""

    name: str
    role: Role
    runs: str | None = None

    def owns(self, run_id: str) -> bool:
        """Whether this caller may write, read and poll ``run_id`` (admins and readers read every run)."""
        return self.runs is None or fnmatchcase(run_id, self.runs)

    @property
    def namespace(self) -> str:
        """The key its caps count under."""
        return self.runs if self.runs is not None else ANY_NAMESPACE


class Unauthorized(Refused):
    """No token, or not one of the role's: 401 (403 for a valid token of another role)."""

    status, reason = 401, "unauthorized"

    def __init__(self, detail: str, *, status: int = 401) -> None:
        super().__init__(detail, status=status, headers={"WWW-Authenticate": "Bearer"})


_ENV = {"admin": "NANWATCH_ADMIN_TOKEN", "ingest": "NANWATCH_TOKEN",
        "reader": "any nanwatch token; Prometheus: the reader-only NANWATCH_METRICS_TOKEN"}


class TokenTable:
    """Every configured token by role. ``ingest``: audit name -> (token, runs glob or None)."""

    def __init__(self, *, ingest: dict[str, tuple[str, str | None]], admin: dict[str, str],
                 reader: dict[str, str]) -> None:
        self._entries: list[tuple[bytes, Principal]] = (
            [(tok.encode(), Principal(name, "ingest", runs)) for name, (tok, runs) in ingest.items()]
            + [(tok.encode(), Principal(name, "admin")) for name, tok in admin.items()]
            + [(tok.encode(), Principal(name, "reader")) for name, tok in reader.items()])
        self._roles = {p.role for _, p in self._entries}
        #: scoped namespaces in configuration order: a run's namespace is the first that matches it
        self._namespaces = [p.runs for _, p in self._entries if p.runs is not None]

    def open(self, role: Role) -> bool:
        """Whether ``role`` needs no token (none of its kind is configured; readers: none at all)."""
        if role == "reader":
            return not self._roles
        return role not in self._roles

    def identify(self, presented: bytes) -> Principal | None:
        """The principal whose token this is, compared against every token (no early exit), else None."""
        found = None
        for token, principal in self._entries:
            if secrets.compare_digest(presented, token):
                found = principal
        return found

    def authorize(self, authorization: str | None, role: Role) -> Principal:
        """The caller for a request needing ``role``, from its ``Authorization`` header value; raises
        ``Unauthorized``. Readers are every role; an open role is ``anonymous`` (every run)."""
        if self.open(role):
            return Principal("anonymous", role)
        scheme, _, credentials = (authorization or "").partition(" ")
        if scheme.lower() != "bearer" or not credentials.strip():
            raise Unauthorized(f"missing bearer token: send 'Authorization: Bearer <token>' ({_ENV[role]})")
        principal = self.identify(credentials.strip().encode("latin-1", "replace"))
        if principal is None:
            raise Unauthorized("invalid bearer token")
        if role != "reader" and principal.role != role:
            raise Unauthorized(f"this token is not an {role} token", status=403)
        return principal

    def namespace_of(self, run_id: str) -> str:
        """The namespace ``run_id`` belongs to: the first scoped token's glob that matches it, else
        ``ANY_NAMESPACE``."""
        return next((glob for glob in self._namespaces if fnmatchcase(run_id, glob)), ANY_NAMESPACE)
