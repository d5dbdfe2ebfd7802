"""pytest plugin: VmRSS / VmHWM after each test, appended to $RSS_LOG (a probe, not part of the suite)."""
import os
import time

_t0 = time.time()


def _status() -> tuple[int, int]:
    f = dict(line.split(":", 1) for line in open("/proc/self/status"))
    return int(f["VmRSS"].split()[0]) // 1024, int(f["VmHWM"].split()[0]) // 1024


def pytest_runtest_logfinish(nodeid, location):
    rss, hwm = _status()
    with open(os.environ.get("RSS_LOG", "/tmp/rss_log.txt"), "a") as f:
        f.write(f"{time.time() - _t0:8.1f} {rss:6d} {hwm:6d} {nodeid}\n")
