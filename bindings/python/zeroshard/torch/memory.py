"""Where a rank's memory goes: the engine's bytes by kind (now and the peak
of each training phase) beside the process's resident memory and the torch
side's share of it.

    report = zt.memory_report()
    print(zt.format_memory_report(report))
"""
import resource

import torch

from ..context import MEMORY_PHASES
from ._context import get_context


def _rss_now():
    with open("/proc/self/status", encoding="ascii") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def memory_report():
    """This rank's memory, in bytes:

    - "engine": what the engine holds now, by kind (shards, masters,
      optimizer_state, grads, gathered, hpz_secondary, reduce_buckets,
      comm_staging, scratch, io_staging, untagged, peer_copies: the
      replica of another rank's state this rank holds for healing,
      inboxes: the shared-memory transport's, one per group) and "total";
    - "peaks": per phase (construction, forward, backward, step,
      checkpoint) the most each kind held and "total", the most all held
      together then;
    - "pools_in_use" (what every kind but io_staging and inboxes adds up
      to) and
      "pool_idle" (freed blocks the engine's caching pools keep for reuse);
    - "phase": the phase now;
    - "copied": the bytes the engine copied by kind (grad_into_bucket,
      bucket_compaction, grad_onto_device, into_grad_shard, wire_widen,
      mics_replica, master_refresh, param_cast, grad_spill, group_of_one,
      gather_staging, comm_staging, other) and "total", as {"total": since
      the context was created, "last_step": between the last two optimizer
      step ends} (Context.copied_bytes);
    - "process_rss" and "process_peak_rss"; "torch_and_rest": the resident
      bytes that are not the engine's (activations, torch's and Python's
      heaps, libraries) on a CPU context;
    - on a CUDA context, "cuda": torch's caching allocator (allocated,
      reserved, peak allocated) beside the engine's device bytes.

    The engine's counts are process-wide (its pools are)."""
    ctx = get_context()
    stats = ctx.memory()
    engine = ctx.memory_by_kind()
    on_gpu = stats["device_bytes"] > 0 or ctx.device.startswith("cuda")
    report = {
        "engine": engine,
        "peaks": {phase: ctx.memory_by_kind(phase) for phase in MEMORY_PHASES},
        "pools_in_use": ctx.memory_pools_in_use(),
        # On a CPU context the device's pool is the host pool: counted once.
        "pool_idle": stats["host_cache_bytes"] + (stats["device_cache_bytes"] if on_gpu else 0),
        "phase": ctx.memory_phase,
        "copied": {"total": ctx.copied_bytes(), "last_step": ctx.copied_bytes(last_step=True)},
        "process_rss": _rss_now(),
        "process_peak_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
    }
    if on_gpu and torch.cuda.is_available():
        report["cuda"] = {"allocated": torch.cuda.memory_allocated(), "reserved": torch.cuda.memory_reserved(),
                          "peak_allocated": torch.cuda.max_memory_allocated()}
        report["torch_and_rest"] = None
    else:
        # Host memory: what is resident and not the engine's (its blocks in
        # use and those its pools keep idle).
        report["torch_and_rest"] = max(0, report["process_rss"] - engine["total"] - report["pool_idle"])
    return report


def format_memory_report(report=None):
    """memory_report() as a table, MiB."""
    report = memory_report() if report is None else report
    mib = 2.0 ** 20
    kinds = [k for k in report["engine"] if k != "total"]
    head = f"{'kind':16s} {'now':>9s} " + " ".join(f"{p[:10]:>10s}" for p in MEMORY_PHASES)
    lines = [f"zeroshard memory (MiB; peaks per phase; phase now: {report['phase']})", head]
    for k in kinds + ["total"]:
        lines.append(f"{k:16s} {report['engine'][k] / mib:9.1f} "
                     + " ".join(f"{report['peaks'][p][k] / mib:10.1f}" for p in MEMORY_PHASES))
    lines.append(f"pools in use {report['pools_in_use'] / mib:.1f}, idle in pools {report['pool_idle'] / mib:.1f}; "
                 f"process RSS {report['process_rss'] / mib:.1f} (peak {report['process_peak_rss'] / mib:.1f})"
                 + (f", torch and the rest {report['torch_and_rest'] / mib:.1f}"
                    if report.get("torch_and_rest") is not None else ""))
    if "copied" in report:
        last = report["copied"]["last_step"]
        kinds = ", ".join(f"{k} {v / mib:.1f}" for k, v in last.items() if k != "total" and v > 0)
        lines.append(f"copied in the last step {last['total'] / mib:.1f}" + (f" ({kinds})" if kinds else ""))
    if "cuda" in report:
        c = report["cuda"]
        lines.append(f"torch CUDA allocator: allocated {c['allocated'] / mib:.1f}, reserved {c['reserved'] / mib:.1f}, "
                     f"peak allocated {c['peak_allocated'] / mib:.1f}")
    return "\n".join(lines)
