"""Resident memory of this process, for the Python benches (imported from
beside them: a bench run as a script has its own folder on sys.path)."""
import resource


def rss_now():
    """Resident bytes now (VmRSS)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def peak_rss():
    """Peak resident bytes so far (ru_maxrss)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
