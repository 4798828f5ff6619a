"""``nanwatch bench``: benchmarks, measured side by side in one run and reported as ratios.

* ``nanwatch bench [options]``: what the trainer-side hooks cost a training step
  (:mod:`nanwatch.bench.step`);
* ``nanwatch bench collector [options]``: a load generator against a real collector, many ranks
  reporting at once (:mod:`nanwatch.bench.load`; the collector runs as a child process,
  :mod:`nanwatch.bench.serve`);
* ``nanwatch bench collector --replicas 1,2,4 [options]``: the same load spread over collector replicas on one
  PostgreSQL, the database's share of the time and a projection to more cores
  (:mod:`nanwatch.bench.collector_replicas`; the database: :mod:`nanwatch.bench.pg_server`, its CPU and
  waits: :mod:`nanwatch.bench.pg_probe`);
* ``nanwatch bench durability [options]``: kill -9 of collector replicas while reports flow through all of
  them, then acknowledged, lost and double-counted reports (:mod:`nanwatch.bench.durability`);
* ``nanwatch bench fallback [options]``: steps and seconds from the first non-finite step to the
  fallback, for one rank and two gloo ranks, at defaults (:mod:`nanwatch.bench.fallback`);
* ``nanwatch bench guard [options]``: what the weight guard's cross-rank reduction costs a data-parallel
  step, with it on and off side by side (:mod:`nanwatch.bench.guard`);
* ``nanwatch bench optimizer [options]``: what guarding a non-fused optimizer (one host read per step) and
  checking its update (one ``_foreach_norm``) cost a step, side by side (:mod:`nanwatch.bench.optimizer`);
* ``nanwatch bench rollout [options]``: what ``Monitor.rlhf()`` costs a GRPO-shaped step, with and without
  the rollout comparison, side by side (:mod:`nanwatch.bench.rlhf_cost`);
* ``nanwatch bench fingerprint [options]``: the weight fingerprint of a model-sized set of tensors, as a
  ratio to one AdamW step on them (:mod:`nanwatch.bench.fingerprint_cost`);
* ``nanwatch bench spikes [options]``: the spike baseline's reporter-thread time per report, next to a step
  (:mod:`nanwatch.bench.spike_cost`);
* ``nanwatch bench replica [options]``: what the replica check costs a data-parallel step, per check and
  amortised at the default ``replica_check_every`` (:mod:`nanwatch.bench.replica`);
* ``nanwatch bench profile [options]``: where nanwatch's added time per step goes, one arm per component
  turned off, for bf16 and fp32 (:mod:`nanwatch.bench.profile`);
* ``nanwatch bench kernels [options]``: what nanwatch adds to a step on the device, as counts (kernels
  launched, bytes read, host syncs) by phase, at 1.7B- and 8B-shaped widths on the meta device, and what they
  cost on an H100 by a roofline model (:mod:`nanwatch.bench.kernels`).

They live beside the runtime packages, not in them: ``nanwatch.hooks`` and ``nanwatch.monitor`` never
import a benchmark.

**What the benches may reach.** The whole-step benches drive nanwatch through the public API
(``nanwatch.attach``, ``nanwatch.hooks.MonitorConfig``, ``nanwatch.fingerprint``: docs/api.md). A bench
that times one component alone, or that stands a device in for another, reaches an internal name, and
these are the internal seams, the only ones: a change to one of them changes its bench in the same commit.

* ``floor``: ``hooks.config.default_is_attention``, ``hooks.instrument.probes.first_tensor``,
  ``hooks.measure.structure.coarse_sites`` (the floor monitor reads the sites nanwatch reads);
* ``host_timers`` (``bench profile --timers``): the training thread's entry points into nanwatch, patched
  by name (its ``ENTRY_POINTS`` table, private methods included: ``_after_sdpa``, ``Probes._grad_hook``,
  ``OptimizerCheck._check``); ``profile``: ``hooks.report.reporter.Reporter`` (the reporter thread's
  time);
* ``fingerprint_cost``: ``hooks.rollout.weight_fingerprint.fingerprint_with_casts`` and
  ``DEFAULT_CHUNK_ELEMENTS`` (``Monitor.publish_weights``'s cast fingerprints, timed alone);
* ``guard``: ``hooks.measure.collective.FlagReduction``; ``replica``: ``hooks.measure.recorder.Recorder``,
  ``hooks.remedies.replica_check.ReplicaCheck``, ``hooks.failsafe.WarnOnce``; ``spike_cost``:
  ``hooks.measure.spikes.SpikeDetector``; ``job_reduce``: ``hooks.report.job.JobReporting``,
  ``hooks.report.job_stats.contribution`` and ``reduce_job`` (each component timed alone);
* ``kernels``: ``hooks.remedies.step_remedies.ACCELERATOR_CHECK_EVERY`` (the accelerator's cadence);
  ``kernel_seams``: ``hooks.instrument.patching.ORIGINAL_SDPA``, and torch's own privates
  (``torch.optim.optimizer._get_fused_kernels_supported_devices``, the flash kernel's meta op);
  ``dispatch_count``: ``torch.utils._python_dispatch.TorchDispatchMode`` and an op's ``_schema``;
* ``step``: an ``nn.Module``'s ``_forward_hooks`` dicts (``DebugUnderflowOverflow`` keeps no handle);
* ``durability``: the PostgreSQL store's ``counters`` table (family ``site``: the per-site non-finite totals
  it checks against what was acknowledged);
* ``load``: ``monitor.server.raise_fd_limit``. ``load`` is itself a seam: ``against_collector``'s
  ``attacker`` (``AttackerSeam``) and its renderers are what the project's hostile client
  (``tests/collector_attack_bench.py``, not shipped) runs through, and ``http1`` the raw HTTP/1.1 client
  it reuses (``tests/collector_attacks.py``).
"""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["main"]


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(argv or ())
    if argv[:1] == ["collector"]:
        from nanwatch.bench import collector_replicas, load

        if load.parser().parse_args(argv[1:]).replicas:
            return collector_replicas.main(load.parser().parse_args(argv[1:]))
        return load.main(argv[1:])
    if argv[:1] == ["durability"]:
        from nanwatch.bench import durability

        return durability.main(argv[1:])
    if argv[:1] == ["fallback"]:
        from nanwatch.bench import fallback

        return fallback.main(argv[1:])
    if argv[:1] == ["guard"]:
        from nanwatch.bench import guard

        return guard.main(argv[1:])
    if argv[:1] == ["rollout"]:
        from nanwatch.bench import rlhf_cost

        return rlhf_cost.main(argv[1:])
    if argv[:1] == ["optimizer"]:
        from nanwatch.bench import optimizer

        return optimizer.main(argv[1:])
    if argv[:1] == ["fingerprint"]:
        from nanwatch.bench import fingerprint_cost

        return fingerprint_cost.main(argv[1:])
    if argv[:1] == ["spikes"]:
        from nanwatch.bench import spike_cost

        return spike_cost.main(argv[1:])
    if argv[:1] == ["profile"]:
        from nanwatch.bench import profile

        return profile.main(argv[1:])
    if argv[:1] == ["kernels"]:
        from nanwatch.bench import kernels

        return kernels.main(argv[1:])
    if argv[:1] == ["replica"]:
        from nanwatch.bench import replica

        return replica.main(argv[1:])
    from nanwatch.bench import step

    return step.main(argv)
