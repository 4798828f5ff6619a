"""Collector settings: every knob in one typed, validated place, read from ``NANWATCH_*`` env variables.

Tests build ``Settings(...)`` directly and pass it to ``create_app``; the server and ``uvicorn --factory``
use the cached ``get_settings()``.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Collection
from functools import lru_cache
from pathlib import Path
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, SecretStr, StringConstraints, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from nanwatch.monitor.data.memory import default_limit_bytes
from nanwatch.policy import DEFAULT_LOGIT_TAU, Rule, default_rules
from nanwatch.tokens import check_token, read_token_file

__all__ = ["Rule", "RunGlob", "ScopedToken", "Settings", "TokenName", "database_url_of", "get_settings", "is_loopback"]

#: A token's audit name (the key of ``NANWATCH_TOKENS`` / ``NANWATCH_ADMIN_TOKENS``), written to the audit
#: log of every directive change it makes.
TokenName = Annotated[str, StringConstraints(pattern=r"^[A-Za-z0-9_.-]{1,64}$")]
#: A run-id namespace: a glob (``*``, ``?``) over run ids, e.g. ``team-a-*``.
RunGlob = Annotated[str, StringConstraints(pattern=r"^[A-Za-z0-9._:@+=*?-]{1,128}$")]


class ScopedToken(BaseModel):
    """A named ingest token that owns a run-id namespace: ``{"token": "...", "runs": "team-a-*"}``. It
    writes, reads and polls only the runs whose id matches ``runs``, and its namespace has its own caps."""

    model_config = ConfigDict(extra="forbid")
    token: SecretStr
    runs: RunGlob


def is_loopback(host: str) -> bool:
    """True when ``host`` only accepts connections from this machine."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


class Settings(BaseSettings):
    """The collector's configuration. Env: ``NANWATCH_<FIELD>`` (maps and lists as JSON)."""

    model_config = SettingsConfigDict(env_prefix="NANWATCH_", extra="ignore")

    host: str = "127.0.0.1"
    """Where ``nanwatch serve`` listens. Anything beyond loopback requires both token kinds."""
    port: Annotated[int, Field(ge=0, le=65535)] = 8000
    db_path: str = "nanwatch.db"
    """SQLite file (WAL) holding events, directives, ingest high-water marks and counter totals."""
    database_url: SecretStr | None = None
    """``postgresql://user:password@host/db``: keep that state in PostgreSQL instead of ``db_path``, shared by
    any number of collector replicas (docs/replicas.md; needs the ``postgres`` extra). Unset: SQLite."""
    database_url_file: Path | None = None
    """File holding ``database_url`` (a mounted secret: the URL carries the database password)."""
    database_refresh_s: Annotated[float, Field(gt=0, le=60)] = 1.0
    """With ``database_url``: at most this long before what another replica accepted shows here (a
    ``NOTIFY`` usually wakes the replica sooner)."""
    token: SecretStr | None = None
    """Ingest token (``NANWATCH_TOKEN``), audit name ``ingest``; trainers send it as a bearer token."""
    admin_token: SecretStr | None = None
    """Admin token (``NANWATCH_ADMIN_TOKEN``), audit name ``admin``; needed to change directives."""
    token_file: Path | None = None
    """File holding the ingest token (e.g. a mounted secret), audit name ``ingest-file``."""
    admin_token_file: Path | None = None
    metrics_token: SecretStr | None = None
    """Reader-only token (``NANWATCH_METRICS_TOKEN``), audit name ``metrics``: for Prometheus, which then
    cannot ingest or change directives. Reading (``/metrics``, ``/v1/runs``) takes any token kind."""
    metrics_token_file: Path | None = None
    tokens: dict[TokenName, SecretStr | ScopedToken] = {}
    """More ingest tokens by name. Scoped (each team its own namespace): ``{"team-a": {"token": "...",
    "runs": "team-a-*"}}``; a bare ``{"ci": "..."}`` owns every run, like ``NANWATCH_TOKEN``."""
    admin_tokens: dict[TokenName, SecretStr] = {}
    """More admin tokens by name; the name is written to the audit log of every directive change."""
    rank_ttl_s: Annotated[float, Field(gt=0)] = 300.0
    """A rank silent for this long loses its per-rank series (and a run with no live rank, its series)."""
    silent_keep_s: Annotated[float, Field(gt=0)] = 86_400.0
    """A rank silent past its TTL without a final report and without crashing (hung, or killed) keeps its
    last report time exported this long (``nanwatch_last_report_timestamp_seconds``), so the stale-rank
    alert keeps firing while it is hung; it goes at once if the rank reports again, and with the run."""
    weight_sync_wait_s: Annotated[float, Field(gt=0)] = 120.0
    """A rollout worker that posted nothing verified for a weight version this long after the trainer
    published it lags (``nanwatch_weight_sync_lag_versions``, a ``weight_sync_lag`` event,
    ``NanwatchWeightSyncLag``); two versions behind lags at once (docs/weight_sync.md)."""
    max_weight_mib_per_namespace: Annotated[int, Field(ge=1)] = 256
    """Weight-sync sets (trainer sets, and rollout sets waiting for theirs) the runs of one run-id namespace
    may hold together, in MiB of the collector's memory (estimated from their entries); a set beyond it gets
    429 (counted as ``cap="weight_bytes_per_namespace"``): one team's sets never fill the memory budget every
    team shares (#37: 67 rollout-only sets of ~1 MB got another team's new runs refused). An eighth of the
    default memory limit; raise both together for models of ~100k tensors with many rollout workers."""
    max_weight_versions_per_namespace: Annotated[int, Field(ge=1)] = 1_024
    """Weight versions the runs of one run-id namespace hold together while they wait to be compared; a set
    of a new version beyond it gets 429 (``cap="weight_versions_per_namespace"``)."""
    weight_sync_expire_s: Annotated[float, Field(gt=0)] = 21_600.0
    """A weight version is kept until every rollout worker the run knows compared with it (or moved past it),
    at most this long (and 32 versions a run, those every worker is done with dropped first); one dropped
    before a worker compared with it is a ``weight_sync_expired`` event naming the workers."""
    rank_late_s: Annotated[float, Field(gt=0)] = 90.0
    """Job mode: a rank known only through heartbeats has no per-rank series (a 65,536-rank job would
    otherwise export half a million); once it has been silent this long, its last report time is exported
    again (``nanwatch_last_report_timestamp_seconds``), so the stale-rank alert names it. Keep it above the
    trainers' heartbeat interval (60 s is what the benchmark assumes), with a margin for jitter, and below
    the alert's 120 s."""
    max_body_bytes: Annotated[int, Field(ge=1024)] = 8 * 1024 * 1024
    """Request bodies beyond this get 413 before they are buffered."""
    max_buffered_bytes: Annotated[int, Field(ge=1024)] = 128 * 1024 * 1024
    """Request bodies being received may hold this many bytes in all; a body that would go beyond gets 503
    with Retry-After (load shedding by bytes: slow senders holding a few bytes each shed nobody)."""
    max_buffered_bytes_per_token: Annotated[int, Field(ge=1024)] = 32 * 1024 * 1024
    """Of those, the bodies sent with one token (one audit name; every request of an open role is
    ``anonymous``) may hold this many bytes: a credential flooding partial bodies gets 503 itself and leaves
    the rest of the budget to the others. A body is read only after its token is checked, so a request
    without a valid token holds nothing."""
    retry_after_s: Annotated[int, Field(ge=1)] = 1
    max_series_per_run: Annotated[int, Field(ge=10)] = 50_000
    """New series of a run beyond this are dropped and counted."""
    max_runs: Annotated[int, Field(ge=1)] = 10_000
    """Runs the collector keeps per run-id namespace (each scoped token's glob, and one for the runs no scoped
    token owns); reports or directives for a new run beyond this get 429 (counted): one team's junk runs
    fill its own namespace only. An admin frees a place with ``DELETE /v1/runs/{run_id}``."""
    max_hosts_per_run: Annotated[int, Field(ge=1)] = 1_024
    """Hosts a run's not-reproducible incidents may name (each is a ``host`` series of
    ``nanwatch_not_reproducible_incidents_total``); an incident on a new host beyond this is not counted
    (``nanwatch_collector_caps_hit_total{cap="hosts_per_run"}``)."""
    max_hosts_per_namespace: Annotated[int, Field(ge=1)] = 8_192
    """Hosts the runs of one run-id namespace may name together, the same way
    (``cap="hosts_per_namespace"``): one team's made-up hosts fill its own namespace only."""
    max_incarnations_per_run: Annotated[int, Field(ge=1)] = 65_536
    """(rank, incarnation) pairs a run may have (each is an idempotency high-water mark); new ones beyond
    this get 429 (counted)."""
    max_incarnations_per_namespace: Annotated[int, Field(ge=1)] = 262_144
    """(rank, incarnation) pairs and held ranks the runs of one run-id namespace may have together (each is a
    high-water mark, or a rank's view in memory); new ones beyond this get 429 (counted as
    ``cap="incarnations_per_namespace"``): one team's made-up ranks fill its own namespace only (#37)."""
    max_events_per_run: Annotated[int, Field(ge=10)] = 10_000
    """Events a run's log keeps; further distinct events are not recorded (counted)."""
    max_events: Annotated[int, Field(ge=100)] = 1_000_000
    """Events the collector keeps over all runs (each is about 735 B of SQLite: about 700 MiB at this
    default); further events are not recorded (counted as ``cap="total_events"``), except directive changes,
    the audit trail."""
    max_events_per_namespace: Annotated[int, Field(ge=10)] = 250_000
    """Events the runs of one run-id namespace keep together (a quarter of ``max_events``); further events of
    that namespace are not recorded (counted as ``cap="events_per_namespace"``), except directive changes, so
    one team's events never use up another's share of the total (#37)."""
    memory_limit_mib: Annotated[int, Field(ge=1)] | None = None
    """Soft limit on the collector's resident memory, checked at most once a second (the OpenTelemetry
    Collector's memory_limiter): above it, a new run, (rank, incarnation) or held rank gets 429 (reason
    ``memory``), new series and events are not kept, all counted as ``cap="memory"``, while existing series
    keep being updated. Default: half the cgroup's memory limit (``/sys/fs/cgroup/memory.max``: a ``/metrics``
    render needs about as much again), else 2048 MiB."""
    run_retention_s: Annotated[float, Field(gt=0)] = 7 * 86400.0
    """A run with no report for this long is forgotten: gone from /metrics and /v1/runs, and its history
    deleted from SQLite. A trainer that comes back later starts a new history (directive versions from 1)."""
    metrics_public: bool = False
    """Serve ``/metrics`` without a token even when tokens are configured. By default it needs a reader
    token of any kind whenever tokens exist, since it names every run and layer; Prometheus sends
    one with ``authorization: {credentials_file: ...}`` in the scrape config."""
    metrics_min_interval_s: Annotated[float, Field(ge=0)] = 3.0
    """``/metrics`` is rendered at most once per this many seconds; a scrape gets the last render if nothing
    changed, else waits for the next one (so a scrape flood cannot take ingest's CPU). Keep it well below
    the scrape interval (15 s in deploy/): a scrape waits at most this long, and only after another."""
    max_header_bytes: Annotated[int, Field(ge=1024)] = 64 * 1024
    """Request line plus headers beyond this get 431 and the connection is closed."""
    header_timeout_s: Annotated[float, Field(gt=0)] = 10.0
    """A connection that has not sent a complete request head this long after it began is closed."""
    body_timeout_s: Annotated[float, Field(gt=0)] = 30.0
    """A request body not received in full this long after its headers gets 408 (the body is read before
    anything else, so a slow sender holds only the bytes it sent)."""
    keep_alive_s: Annotated[float, Field(gt=0)] = 5.0
    """A connection that begins no new request this long after its last answer is closed, whatever else
    the client sends (uvicorn's ``timeout_keep_alive``, enforced by ``nanwatch.monitor.web.protocol``)."""
    directive_margin_steps: Annotated[int, Field(ge=0)] = 0
    """Extra steps before a directive without ``apply_at_step`` applies. By default it applies at the
    earliest step every rank can: the next step for one rank, the next agreement step under
    torch.distributed (from the cadence the ranks report)."""
    max_wait_s: Annotated[float, Field(ge=0)] = 60.0
    """Longest long-poll the collector holds open; longer ``wait`` values are clamped."""
    logit_tau: float = DEFAULT_LOGIT_TAU
    """Attention-logit bound above which ``logit_over_tau`` fires (Kimi K2 clips at 100)."""
    rules: list[Rule] = Field(default_factory=default_rules)
    events_shown: Annotated[int, Field(ge=1, le=10_000)] = 200
    """How many recent events ``GET /v1/runs/{run_id}`` returns."""
    log_level: Literal["critical", "error", "warning", "info", "debug"] = "info"
    docs: bool = False
    """Serve the API documents (``/docs``, ``/redoc``, ``/openapi.json``). Off by default; when on they
    need a token of any kind whenever tokens are configured, like ``/v1/runs``."""
    tls_cert_file: Path | None = None
    """PEM certificate (chain) for HTTPS without a proxy (``nanwatch serve --tls-cert``); with
    ``tls_key_file``. Without both, the collector speaks plain HTTP (put a TLS proxy in front)."""
    tls_key_file: Path | None = None
    """PEM private key of ``tls_cert_file`` (``nanwatch serve --tls-key``)."""

    @model_validator(mode="after")
    def _check(self) -> Settings:
        names = [r.name for r in self.rules]
        if len(names) != len(set(names)):
            raise ValueError(f"rule names must be unique, got {names}")
        if (self.tls_cert_file is None) != (self.tls_key_file is None):
            raise ValueError("TLS needs both a certificate and its key (NANWATCH_TLS_CERT_FILE and "
                             "NANWATCH_TLS_KEY_FILE, or --tls-cert and --tls-key)")
        return self

    def memory_limit_bytes(self) -> int:
        """``memory_limit_mib`` in bytes, or its default (``nanwatch.monitor.data.memory.default_limit_bytes``)."""
        return self.memory_limit_mib << 20 if self.memory_limit_mib is not None else default_limit_bytes()

    def ingest_tokens(self) -> dict[str, str]:
        """Every accepted ingest token, by audit name."""
        named = {k: v.token if isinstance(v, ScopedToken) else v for k, v in self.tokens.items()}
        return _collect("ingest", self.token, self.token_file, named)

    def ingest_namespaces(self) -> dict[str, str]:
        """The run-id glob each scoped ingest token owns, by audit name (unscoped tokens own every run)."""
        return {k: v.runs for k, v in self.tokens.items() if isinstance(v, ScopedToken)}

    def admin_token_map(self) -> dict[str, str]:
        """Every accepted admin token, by audit name."""
        return _collect("admin", self.admin_token, self.admin_token_file, self.admin_tokens)

    def metrics_token_map(self) -> dict[str, str]:
        """Every accepted reader-only token, by audit name."""
        return _collect("metrics", self.metrics_token, self.metrics_token_file, {})

    def check_store(self, *, flags: Collection[str] | None = None) -> None:
        """Refuse two stores named at once: a SQLite file (``db_path``: ``--db``, ``NANWATCH_DB_PATH``) with a
        PostgreSQL URL (``database_url``: ``--database-url``, ``NANWATCH_DATABASE_URL``; or
        ``database_url_file``), from flags and the environment alike, and the URL in both its forms. The
        collector keeps its state in one, and taking either silently leaves the other's runs unread (a
        ``--db`` baked into an image, beside a URL the replicas' environment gives). ``flags``: the settings
        that came from the command line, named as flags in the message (None: named both ways). A flag still
        beats the environment for one setting (``--database-url`` over ``NANWATCH_DATABASE_URL``): that is
        one value replacing another, never two stores."""
        def name(field: str, flag: str, env: str) -> str:
            if flags is None:
                return f"{flag} / {env}" if flag else env
            return flag if field in flags and flag else env

        given = self.model_fields_set
        url = self.database_url.get_secret_value() if self.database_url is not None else ""
        urls = [label for field, present, label in (
            ("database_url", bool(url), name("database_url", "--database-url", "NANWATCH_DATABASE_URL")),
            ("database_url_file", self.database_url_file is not None,
             name("database_url_file", "", "NANWATCH_DATABASE_URL_FILE"))) if field in given and present]
        if "db_path" in given and urls:
            raise ValueError(
                f"both a SQLite file ({name('db_path', '--db', 'NANWATCH_DB_PATH')} {self.db_path!r}) and a "
                f"PostgreSQL database ({urls[0]}) are given: the collector keeps its state in one of them; "
                "drop the other (docs/operating.md#sqlite-or-postgresql)")
        if len(urls) == 2:
            raise ValueError(f"both {urls[0]} and {urls[1]} are given: name the PostgreSQL database once")

    def check_exposure(self) -> None:
        """Refuse an unauthenticated server that others can reach."""
        if is_loopback(self.host):
            return
        missing = [env for env, toks in (("NANWATCH_TOKEN", self.ingest_tokens()),
                                         ("NANWATCH_ADMIN_TOKEN", self.admin_token_map())) if not toks]
        if missing:
            raise ValueError(
                f"refusing to listen on {self.host!r} without authentication: set {' and '.join(missing)} "
                "(or the *_TOKEN_FILE / *_TOKENS settings), or listen on 127.0.0.1"
            )


def _collect(name: str, token: SecretStr | None, path: Path | None, named: dict[str, SecretStr]) -> dict[str, str]:
    """Every token of one kind by audit name, each checked (``nanwatch.tokens``)."""
    out = {k: check_token(k, v.get_secret_value()) for k, v in named.items()}
    if token is not None and token.get_secret_value():
        out[name] = check_token(name, token.get_secret_value())
    if path is not None:
        out[f"{name}-file"] = read_token_file(name, path)
    return out


def database_url_of(settings: Settings) -> str | None:
    """The PostgreSQL URL from ``database_url`` or ``database_url_file`` (None: the SQLite store)."""
    if settings.database_url is not None and settings.database_url.get_secret_value():
        return settings.database_url.get_secret_value()
    if settings.database_url_file is None:
        return None
    try:
        url = settings.database_url_file.read_text().strip()
    except OSError as e:
        raise ValueError(f"cannot read the database URL file {str(settings.database_url_file)!r}: {e}") from None
    if not url:
        raise ValueError(f"the database URL file {str(settings.database_url_file)!r} is empty")
    return url


@lru_cache
def get_settings() -> Settings:
    """The process-wide settings, read from the environment once."""
    return Settings()
