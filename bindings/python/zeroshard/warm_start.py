"""The interpreter every rank forks from under `zsrun --warm-start -- python
SCRIPT ARGS` (docs/launching.md): zsrun starts

    python -m zeroshard.warm_start SCRIPT ARGS

once per attempt, with the ranks' environment less their own variables and
ZS_WARM_START_FD naming its end of a socket pair. It imports the modules
SCRIPT's import statements name (zeroshard.spare: none of SCRIPT runs),
then serves zsrun's requests one at a time: a request is a rank's whole
environment (NAME=value strings, NUL-separated) with its stdin, stdout and
stderr passed as descriptors; the answer is "pid N" or "error WHY".

Each rank is forked twice so that zsrun, a child subreaper, becomes its
parent (and reaps it, and sees its exit status) as it is of a rank it
executes: the first child forks the rank, sets its process group, writes
its pid here and exits. The rank waits to be zsrun's, dies with it
(PR_SET_PDEATHSIG, as zsrun sets for the ranks it executes), takes its
descriptors and environment and runs SCRIPT as `python SCRIPT ARGS` would.
What the imports cost (seconds of CPU for torch and transformers, per
process) is paid once for all the ranks, their replacements included.
"""
import ctypes
import os
import signal
import socket
import sys
import threading
import time

from zeroshard.spare import imported_modules, preload, run_as_rank

_PR_SET_PDEATHSIG = 1
_MAX_REQUEST = 1 << 20  # bytes of environment; zsrun's socket buffer bounds it well below
_REPARENT_WAIT_S = 10.0


def read_request(sock):
    """(environment dict, [stdin, stdout, stderr]) of zsrun's next request;
    None at EOF (the job is over)."""
    data, fds, _, _ = socket.recv_fds(sock, _MAX_REQUEST, 3)
    if not data and not fds:
        return None
    if len(fds) != 3:
        for fd in fds:
            os.close(fd)
        raise ValueError(f"zeroshard.warm_start: zsrun sent {len(fds)} descriptors, expected 3")
    env = {}
    for item in data.split(b"\0"):
        if not item:
            continue
        name, sep, value = item.partition(b"=")
        if not sep:
            raise ValueError(f"zeroshard.warm_start: zsrun sent {item[:80]!r}, expected NAME=value")
        env[os.fsdecode(name)] = os.fsdecode(value)
    return env, fds


def become_rank(launcher, env, fds):
    """In the forked rank: zsrun's child, with its descriptors and its
    environment, as if zsrun had executed it."""
    deadline = time.monotonic() + _REPARENT_WAIT_S
    while os.getppid() != launcher:  # the first child's exit hands us to zsrun
        if time.monotonic() > deadline:
            os.write(fds[2], b"zeroshard.warm_start: the rank was not handed to zsrun (not a child subreaper?)\n")
            os._exit(1)
        time.sleep(0.0005)
    ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != launcher:  # zsrun died before the line above
        os._exit(1)
    for target, fd in enumerate(fds):
        os.dup2(fd, target)
        os.close(fd)
    os.environ.clear()
    os.environ.update(env)
    if "numpy" in sys.modules:
        # Seeded from the system's entropy at import, as each process of its
        # own would be; `random` reseeds itself at fork.
        sys.modules["numpy"].random.seed()


def serve(sock, launcher):
    """Forks a rank per request. Returns its environment and descriptors in
    the rank; None in this process once zsrun has closed the socket."""
    while True:
        request = read_request(sock)
        if request is None:
            return None
        env, fds = request
        others = [t.name for t in threading.enumerate() if t is not threading.main_thread()]
        if others:
            for fd in fds:
                os.close(fd)
            sock.send(f"error the script's imports started Python threads ({', '.join(others)}), which a "
                      "forked rank would not have".encode())
            continue
        sys.stdout.flush()
        sys.stderr.flush()
        r, w = os.pipe()
        first = os.fork()
        if first == 0:
            os.close(r)
            rank = os.fork()
            if rank == 0:
                os.close(w)
                sock.close()
                return env, fds
            try:
                os.setpgid(rank, rank)  # before zsrun can signal it: its group exists
                os.write(w, str(rank).encode())
            except BaseException:  # noqa: BLE001 (unreported, it must not run: zsrun executes the rank instead)
                os.kill(rank, signal.SIGKILL)
                os._exit(1)
            os._exit(0)
        os.close(w)
        for fd in fds:
            os.close(fd)
        pid = os.read(r, 32)
        os.close(r)
        os.waitpid(first, 0)
        sock.send(b"pid " + pid if pid else b"error the fork of the rank failed")


def main(argv):
    if not argv or "ZS_WARM_START_FD" not in os.environ:
        sys.exit("usage: python -m zeroshard.warm_start SCRIPT [ARGS...] (started by zsrun --warm-start)")
    launcher = os.getppid()
    sock = socket.socket(fileno=int(os.environ.pop("ZS_WARM_START_FD")))
    sys.path[0] = os.path.dirname(os.path.abspath(argv[0]))  # as `python SCRIPT` sets it
    preload(imported_modules(argv[0]))
    served = serve(sock, launcher)
    if served is None:
        return  # the job ended
    become_rank(launcher, *served)
    run_as_rank(argv)


if __name__ == "__main__":
    main(sys.argv[1:])
