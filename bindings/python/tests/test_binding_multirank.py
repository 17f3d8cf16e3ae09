"""The Python binding over 2 and 3 real processes on loopback.

Each rank runs this file as a script (``python3 test_binding_multirank.py
RANK WORLD PORT``) with an explicit rank, world size and TCP store port:
collectives (all-reduce, all-gather, broadcast, reduce-scatter, barrier, a
sub-group), a param round trip (registration from rank 0, fetch, update)
and optimizer steps with pushed gradients. It prints one JSON line; the
parent checks every exit code and compares the ranks' outputs.
"""
import hashlib
import json
import os
import socket
import subprocess
import sys

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
BINDING = os.path.dirname(HERE)


def bf16_bits(values):
    """float32 values (exact in bf16) -> their bf16 bit patterns as uint16."""
    return (np.asarray(values, np.float32).view(np.uint32) >> 16).astype(np.uint16)


def bf16_values(bits):
    return (bits.astype(np.uint32) << 16).view(np.float32)


def expect(cond, what):
    if not cond:
        raise AssertionError(what)


def worker(rank, world, port):
    import zeroshard as zs

    report = {"rank": rank}
    ctx = zs.Context(rank=rank, world_size=world, store_host="127.0.0.1", store_port=port,
                     timeout_ms=30000)
    expect((ctx.rank, ctx.world_size) == (rank, world), "rank/world")
    g = ctx.group("world")
    expect((g.rank, g.size, g.ranks()) == (rank, world, list(range(world))), "world group")
    total = world * (world + 1) / 2

    # all-reduce: sum in place, max out of place, bf16 (summed in fp32)
    a = np.full(5, rank + 1, np.float32)
    g.allreduce(a, a, 5, "fp32").wait()
    expect(np.all(a == total), "allreduce sum %s" % a)
    m = np.array([rank, -rank], np.float32)
    mo = np.zeros(2, np.float32)
    with g.allreduce(m, mo, 2, "float32", op="max") as w:
        w.wait()
    expect(list(mo) == [world - 1, 0], "allreduce max %s" % mo)
    b = bf16_bits([rank + 1, 0.5 * (rank + 1)])
    g.allreduce(b, b, 2, "bf16", op="avg").wait()
    expect(list(bf16_values(b)) == [total / world, 0.5 * total / world], "bf16 avg")

    # all-gather: member i's block at i * count
    send = np.arange(3, dtype=np.float32) + 10 * rank
    recv = np.zeros(3 * world, np.float32)
    work = g.allgather(send, recv, 3, "fp32")
    while not work.test():
        pass
    expect(np.array_equal(recv, np.concatenate([np.arange(3) + 10 * r for r in range(world)])),
           "allgather %s" % recv)

    # broadcast from the last rank, raw bytes and fp16
    buf = bytearray(b"root" if rank == world - 1 else b"????")
    g.broadcast(buf, 4, "uint8", world - 1).wait()
    expect(bytes(buf) == b"root", "broadcast bytes")
    h = np.full(3, 1.5 if rank == 0 else 0, np.float16)
    g.broadcast(h, 3, "fp16", 0).wait()
    expect(np.all(h == 1.5), "broadcast fp16")

    # reduce-scatter: rank r gets the sum of every rank's block r
    rs_send = np.concatenate([np.full(2, (r + 1) * (rank + 1), np.float32)
                              for r in range(world)])
    rs_recv = np.zeros(2, np.float32)
    g.reduce_scatter(rs_send, rs_recv, 2, "fp32", op="sum").wait()
    expect(np.all(rs_recv == (rank + 1) * total), "reduce_scatter %s" % rs_recv)
    g.barrier().wait()

    # a sub-group of the first and the last rank
    sub = ctx.new_group([0, world - 1])
    if rank in (0, world - 1):
        expect(sub.size == 2 and sub.rank == (0 if rank == 0 else 1), "sub rank")
        s = np.array([rank], np.float32)
        sub.allreduce(s, s, 1, "fp32").wait()
        expect(s[0] == world - 1, "sub allreduce")
    else:
        expect(sub.rank == -1, "non-member sub rank")
    sub.close()

    # params: rank 0 holds the data; every rank gets the full param back
    full = np.linspace(-2, 2, 10, dtype=np.float32)
    p = ctx.register("w", "fp32", (2, 5), init="from_rank", src_rank=0,
                     data=full if rank == 0 else None)
    shard = -(-10 // world)
    expect((p.shard_numel, p.padded_numel, p.shard_offset) == (shard, shard * world, rank * shard),
           "layout")
    expect(p.shard_valid == max(0, min(shard, 10 - rank * shard)), "shard_valid")
    q = ctx.register("h", "fp16", (7,), init="from_all", data=np.arange(7, dtype=np.float16))
    with ctx.fetch([p, q]) as gather:
        gather.wait()
    out = np.zeros((2, 5), np.float32)
    p.copy_to(out)
    expect(np.array_equal(out.ravel(), full), "param round trip")
    expect(np.array_equal(np.frombuffer(q.copy_to(), np.float16), np.arange(7)), "fp16 param")

    # GatheredParameters: the last rank changes q, update() re-partitions it
    if rank == world - 1:
        import ctypes
        arr = (ctypes.c_uint16 * 7).from_address(q.data_ptr())
        for i in range(7):
            arr[i] = int(np.float16(-i).view(np.uint16))
    ctx.update([q], modifier_rank=world - 1)
    ctx.release([p, q])
    ctx.fetch([q]).wait()
    expect(np.array_equal(np.frombuffer(q.copy_to(), np.float16), -np.arange(7)), "update")
    ctx.release(q)

    # SGD on p: every rank pushes (rank + 1); the step sees their mean
    opt = ctx.optimizer("sgd")
    opt.add_group([p], lr=0.5, weight_decay=0.0)
    p.push_grad(np.full(10, rank + 1, np.float32), "fp32")
    r = opt.step()
    mean = total / world
    expect(not r["skipped"] and r["step"] == 1, "step result %s" % r)
    expect(abs(r["grad_norm"] - mean * np.sqrt(10)) < 1e-4, "grad norm %s" % r)
    ctx.fetch([p]).wait()
    got = np.frombuffer(p.copy_to(), np.float32)
    expect(np.allclose(got, full - 0.5 * mean, rtol=1e-6), "sgd update %s" % got)
    ctx.release([p])

    # AdamW on a bf16 param: every rank must end with the same full values
    c = ctx.register("c", "bf16", (33,), init="normal", seed=11, b=0.5)
    adam = ctx.optimizer("adamw")
    adam.add_group([c], lr=1e-2)
    for step in range(3):
        grad = bf16_bits(np.linspace(-1, 1, 33) * (rank + 1) * (step + 1))
        c.push_grad(grad, "bf16")
        adam.step()
    ctx.fetch([c]).wait()
    report["adam_digest"] = hashlib.sha256(bytes(c.copy_to())).hexdigest()
    report["adam_steps"] = adam.steps
    ctx.release([c])
    ctx.check_async_error()
    report["num_params"] = ctx.memory()["num_params"]
    ctx.close()
    report["ok"] = True
    print(json.dumps(report), flush=True)


# ---------------------------------------------------------------------------
# the parent side (pytest)
# ---------------------------------------------------------------------------

def free_port():
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_world(world, script=__file__, extra=(), timeout=60):
    port = free_port()
    env = dict(os.environ)
    env["PYTHONPATH"] = BINDING + os.pathsep + env.get("PYTHONPATH", "")
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
                "MASTER_PORT"):
        env.pop(var, None)
    procs = [subprocess.Popen([sys.executable, script, str(r), str(world), str(port)] +
                              list(extra), env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True)
             for r in range(world)]
    results = []
    try:
        for r, proc in enumerate(procs):
            out, err = proc.communicate(timeout=timeout)
            results.append((proc.returncode, out, err))
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    return results


def check_world(world):
    results = run_world(world)
    reports = []
    for r, (rc, out, err) in enumerate(results):
        assert rc == 0, "rank %d exited %d:\n%s\n%s" % (r, rc, out, err)
        report = json.loads(out.strip().splitlines()[-1])
        assert report["rank"] == r and report["ok"] is True
        reports.append(report)
    assert len({rep["adam_digest"] for rep in reports}) == 1, "ranks disagree after AdamW"
    assert all(rep["adam_steps"] == 3 and rep["num_params"] == 3 for rep in reports)


def test_two_ranks():
    check_world(2)


def test_three_ranks():
    check_world(3)


def test_dead_peer_raises_comm_or_timeout(tmp_path):
    # Rank 1 leaves after bring-up; rank 0's all-reduce must fail in bounded
    # time with the engine's error, raised as a ZeroShardError subclass.
    script = tmp_path / "dead_peer.py"
    script.write_text(
        "import sys, os, json, numpy as np\n"
        "import zeroshard as zs\n"
        "rank, world, port = map(int, sys.argv[1:4])\n"
        "ctx = zs.Context(rank=rank, world_size=world, store_host='127.0.0.1',\n"
        "                 store_port=port, timeout_ms=2000)\n"
        "ctx.group().barrier().wait()\n"
        "if rank == 1:\n"
        "    os._exit(0)\n"
        "a = np.ones(4, np.float32)\n"
        "try:\n"
        "    ctx.group().allreduce(a, a, 4, 'fp32').wait()\n"
        "    print(json.dumps({'raised': None}))\n"
        "except zs.ZeroShardError as e:\n"
        "    print(json.dumps({'raised': type(e).__name__, 'status': e.status_name,\n"
        "                      'message': str(e)}))\n"
        "    try:\n"
        "        ctx.check_async_error()\n"
        "    except zs.ZeroShardError:\n"
        "        pass\n")
    results = run_world(2, script=str(script), timeout=60)
    rc, out, err = results[0]
    assert rc == 0, err
    report = json.loads(out.strip().splitlines()[-1])
    assert report["raised"] in ("CommError", "ZsTimeoutError"), report
    assert report["status"] in ("ZS_ERR_COMM", "ZS_ERR_TIMEOUT") and report["message"]


def test_peer_copy_replicas_equal_their_sources(tmp_path):
    # zeroshard.healing.peer_copy on 3 ranks: after 3 AdamW steps each
    # rank's replica hashes as its source's own state, and the memory
    # report has the copies under "peer_copies".
    script = tmp_path / "peer_copy.py"
    script.write_text(
        "import sys, json, numpy as np\n"
        "import zeroshard as zs\n"
        "rank, world, port = map(int, sys.argv[1:4])\n"
        "ctx = zs.Context(rank=rank, world_size=world, store_host='127.0.0.1', store_port=port,\n"
        "                 timeout_ms=30000, config={'zeroshard': {'healing': {'peer_copy': True}}})\n"
        "p = ctx.register('w', 'fp32', (1001,), init='normal', seed=3)\n"
        "opt = ctx.optimizer('adamw')\n"
        "opt.add_group([p], lr=1e-2)\n"
        "for step in range(3):\n"
        "    p.push_grad(np.linspace(-1, 1, 1001, dtype=np.float32) * (rank + 1 + step), 'fp32')\n"
        "    opt.step()\n"
        "print(json.dumps({'own': opt.heal_state_digest(), 'replica': opt.heal_state_digest(replica=True),\n"
        "                  'peer_copies': ctx.memory_by_kind()['peer_copies']}))\n"
        "ctx.close()\n")
    results = run_world(3, script=str(script), timeout=60)
    reports = []
    for r, (rc, out, err) in enumerate(results):
        assert rc == 0, "rank %d exited %d:\n%s\n%s" % (r, rc, out, err)
        reports.append(json.loads(out.strip().splitlines()[-1]))
    for h, rep in enumerate(reports):
        own_hash, source, step = rep["own"]
        assert source == h and step == 3, rep
        replica_hash, of, replica_step = rep["replica"]
        assert of == (h - 1) % 3 and replica_step == 3, rep
        assert replica_hash == reports[of]["own"][0], (h, reports)
        assert rep["peer_copies"] > 0, rep
    assert len({rep["own"][0] for rep in reports}) == 3, "the ranks' shards should differ"


if __name__ == "__main__":
    worker(int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]))
