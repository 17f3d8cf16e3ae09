"""The store's host killed at every request of a healing run (issue 60, item 4;
docs/healing.md, section 3 "The external store").

    .venv/bin/python bench/bench_store_kills.py [--ranks 3] [--fault update:1:8]
        [--steps 12] [--every 1] [--pairs 6] [--kill-at 70]

The C example trainer (build/bin/train_mlp) under `zsrun --restarts 1`, loses
the rank that ZS_FAULT_POINT names (--fault, "phase:rank:count") and heals it
in place; the store is served by zsstore, which zsrun starts again from its
journal when it dies. This runs the same job once uninterrupted (the
reference), once with the rank loss alone (counting the store's requests,
ZS_STORE_STATS), then once per kill point N (every --every-th request the
job makes), with zsstore SIGKILLing itself at its N-th request
(ZS_FAULT_STORE: applied, not answered). A point heals when the job exits 0
with no restart of the job, the store killed once and started again, and the
uninterrupted run's losses bit for bit. Then --pairs alternating pairs of the
job with and without the store killed at its --kill-at-th request (inside
the heal on 3 ranks), timed as whole runs: what a store's death costs.
Prints each failing point, the counts and the timings, and one JSON line
last. Needs `cmake --build build` (zsrun, zsstore, train_mlp).
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BIN = os.environ.get("ZS_TEST_BIN_DIR", os.path.join(ROOT, "build", "bin"))
HEARTBEAT = {"ZS_HEARTBEAT_MS": "100", "ZS_HEARTBEAT_TIMEOUT_MS": "600", "ZS_DEVICE": "cpu"}


def run(args, extra):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ZS_FAULT", "ZS_STORE_STATS"))}
    env.update(HEARTBEAT)
    env.update(extra)
    cmd = [os.path.join(BIN, "zsrun"), "-n", str(args.ranks), "--restarts", "1", "--no-prefix", "--",
           os.path.join(BIN, "train_mlp"), "--steps", str(args.steps)]
    t0 = time.perf_counter()
    p = subprocess.run(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=300)
    took = time.perf_counter() - t0
    losses = [line for line in p.stdout.splitlines() if line.startswith("step ")]
    return p.returncode, p.stdout, losses, took


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ranks", type=int, default=3)
    ap.add_argument("--fault", default="update:1:8", help="the rank loss, as ZS_FAULT_POINT")
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--every", type=int, default=1, help="kill at every k-th request")
    ap.add_argument("--pairs", type=int, default=6)
    ap.add_argument("--kill-at", type=int, default=70)
    args = ap.parse_args()
    for tool in ("zsrun", "zsstore", "train_mlp"):
        if not os.access(os.path.join(BIN, tool), os.X_OK):
            sys.exit(f"bench_store_kills: no {tool} in {BIN}: build first (cmake --build build)")

    rc, out, ref, _ = run(args, {})
    if rc != 0 or len(ref) != args.steps:
        sys.exit(f"bench_store_kills: the uninterrupted run failed (exit {rc}):\n{out}")
    rc, out, _, _ = run(args, {"ZS_FAULT_POINT": args.fault, "ZS_STORE_STATS": "1"})
    marker = "handled "
    at = out.find(marker)
    if rc != 0 or at < 0:
        sys.exit(f"bench_store_kills: the healing run without a store kill failed (exit {rc}):\n{out}")
    requests = int(out[at + len(marker):].split()[0])
    print(f"{args.ranks} ranks, rank loss {args.fault}: the store handles {requests} requests in the healed run")

    healed, failed = 0, []
    for n in range(1, requests + 1, args.every):
        rc, out, losses, _ = run(args, {"ZS_FAULT_POINT": args.fault, "ZS_FAULT_STORE": str(n)})
        why = []
        if rc != 0:
            why.append(f"exit {rc}")
        if "starting the job again" in out:
            why.append("the job restarted")
        if out.count("killed at its request") != 1 or "starting it again on port" not in out:
            why.append("the store was not killed and started again once")
        if losses != ref:
            why.append("losses differ from the uninterrupted run's")
        if why:
            failed.append(n)
            print(f"  store killed at request {n}: {', '.join(why)}")
        else:
            healed += 1
    points = len(range(1, requests + 1, args.every))
    print(f"healed in place, bitwise, no job restart: {healed} of {points} kill points")

    with_kill, without = [], []
    for _ in range(args.pairs):
        rc_a, _, la, ta = run(args, {"ZS_FAULT_POINT": args.fault, "ZS_FAULT_STORE": str(args.kill_at)})
        rc_b, _, lb, tb = run(args, {"ZS_FAULT_POINT": args.fault})
        if rc_a == 0 and la == ref:
            with_kill.append(ta)
        if rc_b == 0 and lb == ref:
            without.append(tb)
    med_a = statistics.median(with_kill) if with_kill else None
    med_b = statistics.median(without) if without else None
    if med_a and med_b:
        print(f"whole run, store killed at request {args.kill_at}: median {med_a:.3f} s against {med_b:.3f} s "
              f"without ({med_a / med_b:.2f}x, {args.pairs} alternating pairs)")
    print(json.dumps({"bench": "store_kills", "ranks": args.ranks, "fault": args.fault, "steps": args.steps,
                      "requests": requests, "kill_points": points, "healed": healed, "failed_at": failed,
                      "run_s_with_store_kill": med_a, "run_s_without": med_b,
                      "ratio": (med_a / med_b) if med_a and med_b else None}))


if __name__ == "__main__":
    main()
