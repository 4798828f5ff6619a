"""The collector under attack: ``nanwatch bench collector``'s load (``nanwatch.bench.load``) beside a hostile
client (``collector_attacks``), as the project measures it (docs/benchmarks.md, 'The collector under attack';
docs/security.md). Not shipped: it runs from a checkout, and tests/test_bench.py runs it.

``--rounds`` pairs of measured windows of ``--duration`` each against the same collector, alternating: the
ranks alone, then the ranks beside a hostile client on loopback (a process of its own); the windows of each
kind are pooled, and the ratio of their p99 ingest latencies reported (goal: within 2x). Alternating puts the
machine's drift on both sides alike. The kinds are ``collector_attacks``'s; ``all``: every kind at once;
``each``: every kind in turn and then all at once, each against a fresh collector, and a table of the ratios.
Every other flag is ``nanwatch bench collector``'s.

It reaches the load generator through its documented seam only (``against_collector(attacker=...)``,
``parser``, ``phase_lines``, ``quantiles``, ``new_phase``, ``describe_load``).

Example usage (from the repository root)::

    python tests/collector_attack_bench.py --ranks 256 --duration 10 --rounds 3 --attack slow-headers --attackers 1000
    python tests/collector_attack_bench.py --ranks 256 --sites 64 --duration 15 --rounds 3 --attack each
"""

from __future__ import annotations

import argparse
import os
import secrets
import statistics

from collector_attacks import ATTACKS, DEFAULT_ATTACKERS, HELD, Attacker, Target, plan_attack, prime_runs

from nanwatch.bench.load import against_collector, describe_load, new_phase, parser, phase_lines, quantiles

__all__ = ["main"]


class HostileClient:
    """The load generator's ``AttackerSeam``, filled by ``collector_attacks``: ``plan`` attackers per kind."""

    def __init__(self, args: argparse.Namespace, plan: dict[str, int]) -> None:
        self._args, self._plan, self._attacker = args, plan, None

    def _target(self, host: str, port: int) -> Target:
        return Target(host, port, self._args.token, self._args.run_id)

    async def prime(self, host: str, port: int) -> dict | None:
        return await prime_runs(self._target(host, port)) if "runs-listing" in self._plan else None

    def start(self, host: str, port: int, windows: list[tuple[float, float]]) -> None:
        self._attacker = Attacker(self._target(host, port), self._plan, windows)

    def result(self) -> tuple[list[dict], float]:
        return self._attacker.result()


def _attack_lines(counts: dict, duration: float) -> list[str]:
    """What one kind of attacker did: the statuses and times of its requests, or how the collector ended
    its held connections."""
    kind, n = counts["kind"], counts["n"]
    if kind not in HELD:
        t = quantiles(counts["times"])
        done = sum(counts["status"].values())
        timing = f", p50 {t[0] * 1e3:.0f} ms, max {t[2] * 1e3:.0f} ms" if t else ""
        cut = f"; {counts['open_at_end']} unanswered when its window ended" if counts["open_at_end"] else ""
        return [f"{kind} x{n}: {done} requests ({done / duration:.1f}/s){timing}; statuses {counts['status']}{cut}"]
    ended = sum(v for k, v in counts["ended"].items() if k != "connect failed")
    life = statistics.median(counts["lifetimes"]) if counts["lifetimes"] else None
    after = f", median after {life:.1f} s" if life is not None else ""
    return [f"{kind} x{n}: {counts['opened']} connections opened, {counts['open_at_end']} still open at the end; "
            f"ended by the server: {ended}{after} {counts['ended'] or ''}".rstrip()]


def _merged(phases: list[dict], name: str) -> dict:
    """The windows called ``name`` as one phase: samples pooled, CPU summed, RSS and descriptors from the
    last."""
    mine = [p for p in phases if p["name"] == name]
    out = new_phase(name, mine[0]["from"], mine[-1]["to"])
    for p in mine:
        for key in ("lat", "scrape", "lag"):
            out[key] += p[key]
        out["reports"] += p["reports"]
        for kind, lat in p["by_kind"].items():
            out["by_kind"].setdefault(kind, []).extend(lat)
        for key in ("status", "scrape_failed"):
            for k, v in p[key].items():
                out[key][k] = out[key].get(k, 0) + v
    out["rss"], out["fds"] = mine[-1]["rss"], mine[-1]["fds"]
    cpu = [p["cpu_s"] for p in mine]
    out["cpu_s"] = None if None in cpu else sum(cpu)
    return out


def _ratio(base: dict, hit: dict) -> tuple[float, float, float] | None:
    """(p99 unloaded, p99 under attack, their ratio) of the pooled phases; None without samples."""
    base, hit = quantiles(base["lat"]), quantiles(hit["lat"])
    if not base or not hit or base[1] <= 0:
        return None
    return base[1], hit[1], hit[1] / base[1]


def _failed(phase: dict) -> int:
    """The ranks' requests not answered 200 in the phase (refused, timed out, connection lost)."""
    return sum(n for k, n in phase["status"].items() if k != 200)


def _ratio_line(base: dict, hit: dict) -> str:
    r = _ratio(base, hit)
    failed = f"; ranks' requests not answered 200: {_failed(base)} unloaded, {_failed(hit)} under attack"
    if r is None:
        return "p99 under attack / p99 unloaded = n/a (no samples)" + failed
    return f"p99 under attack / p99 unloaded = {r[2]:.2f} (goal: within 2x)" + failed


def _report(stats: dict, args: argparse.Namespace, rss: float | None) -> str:
    phases = stats["phases"]
    lines = [f"machine: {os.cpu_count()} CPUs; load: {describe_load(args)}"]
    plan = ", ".join(f"{c['kind']} x{c['n']}" for c in stats["attacks"])
    lines.append(f"attack: {plan}; open file limit {stats.get('nofile')}"
                 + (f", collector's {stats['collector_nofile']}" if stats.get("collector_nofile") else ""))
    if stats.get("primed") is not None:
        lines.append(f"primed for runs-listing: {sum(stats['primed'].values())} requests of 256 runs, "
                     f"statuses {stats['primed']}")
    rounds = len(phases) // 2
    seconds = rounds * args.duration
    lines.append(f"{rounds} rounds of {args.duration:g} s unloaded, then {args.duration:g} s under attack "
                 f"and {args.settle:g} s unmeasured; each phase below pools its windows")
    merged = [_merged(phases, "unloaded"), _merged(phases, "under attack")]
    for i, phase in enumerate(merged, 1):
        title = phase["name"] + (f" ({plan})" if i > 1 else "")
        lines.append(f"phase {i}, {title}:")
        body = phase_lines(phase, seconds, args)
        if i > 1:
            for counts in stats["attacks"]:
                body += _attack_lines(counts, seconds)
            body.append(f"attacker process CPU: {100 * stats['attacker_cpu_s'] / seconds:.0f}% of one core "
                        "(on this machine, taken from the collector's CPUs)")
        if (lag := quantiles(phase["lag"])) is not None:
            body.append(f"bench event loop lag: p99 {lag[1] * 1e3:.1f} ms, max {lag[2] * 1e3:.1f} ms")
        if phase["rss"] is not None:
            body.append(f"collector at phase end: RSS {phase['rss']:.0f} MiB, {phase['fds']} open descriptors")
        if phase["cpu_s"] is not None:
            body.append(f"collector CPU: {100 * phase['cpu_s'] / seconds:.0f}% of one core")
        lines += ["  " + line for line in body]
    lines.append(_ratio_line(*merged))
    if rss is not None:
        lines.append(f"collector RSS: {rss:.0f} MiB")
    return "\n".join(lines)


def _one(args: argparse.Namespace, plan: dict[str, int], nofile: int) -> dict:
    """One attacked configuration against a fresh collector (or ``--url``); prints its report, returns its
    stats."""
    env = {}
    if not args.url and not args.token:  # attacks without a token must meet a collector that wants one
        args = argparse.Namespace(**{**vars(args), "token": secrets.token_urlsafe(16)})
        env["NANWATCH_TOKEN"] = args.token
    stats, rss = against_collector(args, attacker=HostileClient(args, plan), env=env)
    stats["nofile"] = nofile
    print(_report(stats, args, rss), flush=True)
    return stats


def _each(args: argparse.Namespace, plan: dict[str, int], nofile: int) -> None:
    """``--attack each``: every kind alone, then all at once, each against a fresh collector; then a table of
    the p99 ratios."""
    rows = []
    for kind in (*plan, "all"):
        one = argparse.Namespace(**{**vars(args), "attack": kind})
        print(f"--- attack {kind}", flush=True)
        stats = _one(one, plan if kind == "all" else {kind: plan[kind]}, nofile)
        base, hit = _merged(stats["phases"], "unloaded"), _merged(stats["phases"], "under attack")
        rows.append((kind, _ratio(base, hit), _failed(base), _failed(hit)))
    print(f"machine: {os.cpu_count()} CPUs; load: {describe_load(args)}; {args.rounds} rounds of {args.duration:g} s each side")
    print("| attack | ingest p99 unloaded → attacked | × | ranks' requests not 200 (unloaded, attacked) |\n"
          "|---|---|---|---|")
    for kind, r, base_failed, hit_failed in rows:
        n = "all at once" if kind == "all" else f"`{kind}` ×{plan[kind]}"
        p99 = f"{r[0] * 1e3:.1f} → {r[1] * 1e3:.1f} ms | {r[2]:.2f}" if r else "n/a | n/a"
        print(f"| {n} | {p99} | {base_failed}, {hit_failed} |")


def _parser() -> argparse.ArgumentParser:
    p = parser()
    p.prog, p.description = "collector_attack_bench", __doc__.split("\n\n")[0]
    p.add_argument("--attack", choices=(*ATTACKS, "all", "each"), required=True,
                   help="the hostile client beside the ranks in the attacked windows; all: "
                        "every kind at once; each: every kind in turn, then all, and a table of the ratios")
    p.add_argument("--rounds", type=int, default=3,
                   help="with --attack: unloaded/attacked window pairs, alternating (default: 3)")
    p.add_argument("--settle", type=float, default=5.0,
                   help="with --attack: unmeasured seconds after each attacked window, so that what the attack "
                        "left the collector doing is not counted as unloaded (default: 5)")
    p.add_argument("--attackers", type=int, default=None,
                   help="attackers of each kind (default: " +
                        ", ".join(f"{k} {n}" for k, n in DEFAULT_ATTACKERS.items()) + ")")
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    from nanwatch.monitor.server import raise_fd_limit

    nofile = raise_fd_limit()  # before the collector starts, so that it inherits the raised limit
    plan = plan_attack(args, nofile)
    if args.attack == "each":
        _each(args, plan, nofile)
    else:
        _one(args, plan, nofile)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
