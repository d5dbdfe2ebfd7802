"""pytest plugin: each test's worker, start and end (wall clock), appended to $TIMELINE_LOG (a probe)."""
import os
import time

import pytest


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    start = time.time()
    yield
    with open(os.environ.get("TIMELINE_LOG", "/tmp/timeline.txt"), "a") as f:
        f.write(f"{os.environ.get('PYTEST_XDIST_WORKER', 'main')} {start:.2f} {time.time():.2f} {item.nodeid}\n")
