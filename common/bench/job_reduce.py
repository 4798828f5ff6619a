"""What a job report's reduction costs the reporter thread per step, and how it grows with sites.

Run: ``torchrun --nproc_per_node 2 -m nanwatch.bench.job_reduce`` (gloo, CPU). Each rank routes the same
synthetic reports (``nanwatch.bench.load.synthetic_report``: per layer an attention site forward and backward,
an SDPA signature and a logit bound) through ``JobReporting.route``, as the reporter thread does; rank 0 prints
the median time per step of the whole route (header + SUM + MAX all-reduce + building the job report) and of its
pure part alone (layout and job report, no collective), and the same with tables that differ on every step
(the rare ``all_gather_object`` path).
"""

import statistics
import time

import torch
import torch.distributed as dist

from nanwatch.bench.load import synthetic_report
from nanwatch.hooks.report.job import JobReporting
from nanwatch.hooks.report.job_stats import contribution, reduce_job

ROUNDS = 200


def main() -> None:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(1)
    group = dist.new_group(backend="gloo")
    job = JobReporting(group, rank=rank, world_size=world, heartbeat_s=1e9)
    if rank == 0:
        print(f"{'sites':>6} {'sum+max floats':>15} {'route median us':>16} {'p90 us':>8} {'pure median us':>15} "
              f"{'differing tables us':>20}")
    for layers in (7, 31, 127, 511):
        reports = [synthetic_report(rank=rank, world_size=world, seq=i, layers=layers) for i in range(ROUNDS)]
        odd = [r.model_copy(update={"sites": [*r.sites, r.sites[0].model_copy(update={"site": f"moe.e{i}"})]})
               for i, r in enumerate(reports)] if rank else reports
        times, pure, mismatch = [], [], []
        for r in reports:
            t0 = time.perf_counter()
            job.route(r, None)
            times.append(time.perf_counter() - t0)
        for r in reports:
            t0 = time.perf_counter()
            c = contribution(r, None, rank=rank)
            sums, maxes = c.vectors(c.table, world=world)
            reduce_job(r, c.table, sums, maxes, world=world)
            pure.append(time.perf_counter() - t0)
        for r in odd[:50]:
            t0 = time.perf_counter()
            job.route(r, None)
            mismatch.append(time.perf_counter() - t0)
        assert job.active
        if rank == 0:
            q = statistics.quantiles(times[20:], n=10)
            print(f"{len(reports[0].sites):>6} {len(sums) + len(maxes):>15} {statistics.median(times[20:]) * 1e6:>16.0f} "
                  f"{q[-1] * 1e6:>8.0f} {statistics.median(pure) * 1e6:>15.0f} {statistics.median(mismatch) * 1e6:>20.0f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
