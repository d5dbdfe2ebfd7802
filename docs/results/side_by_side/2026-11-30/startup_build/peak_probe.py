"""The default model's engine start: seconds of LLM() and the process's peak and current RSS after it (VmHWM, VmRSS),
the kernel tables read from this machine's cache."""
import time

from pagedllm import LLM


def status(field: str) -> float:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field)) / 1e6


start = time.perf_counter()
LLM()
print(f"LLM() {time.perf_counter() - start:.2f} s, peak RSS {status('VmHWM'):.2f} GB, RSS {status('VmRSS'):.2f} GB")
