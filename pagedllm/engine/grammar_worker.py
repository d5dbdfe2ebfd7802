"""A trial compile of every new grammar in a child process, so that what llguidance cannot survive costs the child,
not the server: a stack overflow (SIGSEGV), a compile past the time limit (killed), an allocation past the memory
limit (RLIMIT_AS, llguidance aborts). The engine builds its own matcher only from a grammar the child compiled, with
the same llguidance and vocabulary, on a thread with at least the child's stack (the child compiles on a 2 MiB
stack, a quarter of a default thread's), so the in-process compile meets nothing the trial did not.

llguidance has no serialisable compiled form, so the trial is the proof, and costs a second compile (~1 ms for a
typical schema) plus a pipe round trip, once per distinct grammar: results are cached with the compiled grammar.
The child also measures what the compiled grammar holds (glibc's mallinfo2 with one malloc arena, before and after
the compile and the first mask): the engine's grammar cache is bounded by that figure, in bytes.

Run as `python -m pagedllm.engine.grammar_worker`: stdlib and llguidance only (no torch), one JSON line per
message on stdin and stdout; it exits when its stdin closes, so it never outlives the engine.
"""

from __future__ import annotations

import ctypes
import json
import logging
import os
import resource
import select
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass

from pagedllm.errors import InvalidRequestError

logger = logging.getLogger("pagedllm")

COMPILE_TIME_LIMIT_S = 10.0  # per grammar; a 10,000-entry choice list compiles in 0.2 s, 100,000 took 135 s
GRAMMAR_MEMORY_LIMIT = 128 << 20  # bytes one compiled grammar may hold ((X{1000}){1000} held 172 MB)
WORKER_STACK_BYTES = 2 << 20  # the child's compile thread: the engine's threads have 8 MiB
START_TIMEOUT_S = 60.0  # the child's start: Python, llguidance and the vocabulary's index (~0.3 s)
ERROR_CHARS = 2000


@dataclass
class TrialResult:
    """A grammar the child compiled: how long it took and what it holds."""

    seconds: float
    bytes: int


class GrammarWorker:
    """The engine's side: one child process, started on first use and again after it dies; one trial at a time
    (thread-safe), each bounded by the time and memory limits."""

    def __init__(self, tokenizer_json: str, vocab_size: int, eos_token_ids: list[int],
                 time_limit_s: float = COMPILE_TIME_LIMIT_S, memory_limit: int = GRAMMAR_MEMORY_LIMIT) -> None:
        self.setup = {"tokenizer": tokenizer_json, "vocab_size": vocab_size, "eos": eos_token_ids,
                      "stack_bytes": WORKER_STACK_BYTES, "memory_limit": memory_limit}
        self.time_limit_s = time_limit_s
        self.memory_limit = memory_limit
        self._lock = threading.Lock()
        self._proc: subprocess.Popen[bytes] | None = None

    def trial(self, grammar: str) -> TrialResult:
        """Compile `grammar` in the child; a grammar llguidance refuses, or that breaks a limit or the child, raises
        InvalidRequestError naming the reason."""
        with self._lock:
            proc = self._started()
            assert proc.stdin is not None
            try:
                proc.stdin.write(json.dumps({"grammar": grammar}).encode() + b"\n")
                proc.stdin.flush()
            except (BrokenPipeError, OSError):
                pass  # it died: the read below says why
            reply = self._read(proc, self.time_limit_s)
        if reply is None:
            raise InvalidRequestError(self._death_reason(proc))
        if reply["error"]:
            raise InvalidRequestError(reply["error"])
        if reply["bytes"] > self.memory_limit:
            raise InvalidRequestError(f"the compiled grammar holds {reply['bytes'] / 2**20:,.0f} MB, over the "
                                      f"limit of {self.memory_limit / 2**20:,.0f} MB")
        return TrialResult(reply["seconds"], reply["bytes"])

    def close(self) -> None:
        with self._lock:
            if self._proc is not None:
                self._stop(self._proc)
                self._proc = None

    def _started(self) -> subprocess.Popen[bytes]:
        if self._proc is not None and self._proc.poll() is None:
            return self._proc
        env = {**os.environ, "MALLOC_ARENA_MAX": "1"}  # every allocation in the arena mallinfo2 counts
        proc = subprocess.Popen([sys.executable, "-m", "pagedllm.engine.grammar_worker"], stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, env=env)
        assert proc.stdin is not None
        proc.stdin.write(json.dumps(self.setup).encode() + b"\n")
        proc.stdin.flush()
        if self._read(proc, START_TIMEOUT_S) is None:
            raise RuntimeError(f"the grammar worker did not start (exit code {proc.poll()})")
        self._proc = proc
        return proc

    def _read(self, proc: subprocess.Popen[bytes], timeout_s: float) -> dict | None:
        """The child's next reply, or None when it died or ran out of time (then it is killed: a new one starts
        on the next trial)."""
        assert proc.stdout is not None
        ready, _, _ = select.select([proc.stdout], [], [], timeout_s)
        line = proc.stdout.readline() if ready else b""
        if line:
            return json.loads(line)
        self._stop(proc)
        self._proc = None
        return None

    def _death_reason(self, proc: subprocess.Popen[bytes]) -> str:
        code = proc.returncode
        if code == -signal.SIGKILL:
            return f"the grammar did not compile within the limit of {self.time_limit_s:g} s"
        if code == -signal.SIGSEGV:
            return ("the grammar compiler crashed on this grammar (its rules or references nest too deeply); "
                    "make it shallower")
        return (f"the grammar compiler failed on this grammar (exit code {code}): it needs more than the limit of "
                f"{self.memory_limit / 2**20:,.0f} MB, or is otherwise beyond what it can compile")

    @staticmethod
    def _stop(proc: subprocess.Popen[bytes]) -> None:
        if proc.poll() is None:
            proc.kill()
        proc.wait()
        for pipe in (proc.stdin, proc.stdout):
            if pipe is not None:
                pipe.close()


# ---- the child ---------------------------------------------------------------------------------------------
class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks",
                 "keepcost")]


def _heap_bytes(libc: ctypes.CDLL) -> int:
    """Bytes malloc has handed out and not had back (small blocks in the arena plus mmapped large ones)."""
    info = libc.mallinfo2()
    return int(info.uordblks + info.hblkhd)


def _vm_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")


def _compile(llg: object, tokenizer: object, grammar: str, libc: ctypes.CDLL) -> dict:
    """Build a matcher and its first mask; report the time, the bytes held, or llguidance's error."""
    before, start = _heap_bytes(libc), time.perf_counter()
    matcher = llg.LLMatcher(tokenizer, grammar, log_level=0)  # type: ignore[attr-defined]
    if not matcher.is_error():
        matcher.compute_bitmask()
    reply = {"error": matcher.get_error()[:ERROR_CHARS] if matcher.is_error() else "",
             "seconds": time.perf_counter() - start, "bytes": max(_heap_bytes(libc) - before, 0)}
    return reply


def _serve(llg: object, tokenizer: object, libc: ctypes.CDLL) -> None:
    """Answer trials until stdin closes; runs on the one thread with the small stack."""
    out = sys.stdout.buffer
    out.write(b'{"ready": true}\n')
    out.flush()
    for line in sys.stdin.buffer:
        out.write(json.dumps(_compile(llg, tokenizer, json.loads(line)["grammar"], libc)).encode() + b"\n")
        out.flush()


def main() -> None:
    import llguidance as llg

    libc = ctypes.CDLL("libc.so.6")
    libc.mallinfo2.restype = _MallInfo2
    setup = json.loads(sys.stdin.buffer.readline())
    tokenizer = llg.LLTokenizer(setup["tokenizer"], n_vocab=setup["vocab_size"], eos_token=setup["eos"])
    del setup["tokenizer"]
    threading.stack_size(setup["stack_bytes"])
    # Address space: what the child has now, its compile thread's stack, and 4x the grammar limit (what the grammar
    # holds is measured exactly; this bound only stops a runaway compile before it takes the machine's memory).
    budget = _vm_bytes() + 2 * setup["stack_bytes"] + 4 * setup["memory_limit"]
    resource.setrlimit(resource.RLIMIT_AS, (budget, resource.getrlimit(resource.RLIMIT_AS)[1]))
    server = threading.Thread(target=_serve, args=(llg, tokenizer, libc))
    server.start()
    server.join()


if __name__ == "__main__":
    main()
