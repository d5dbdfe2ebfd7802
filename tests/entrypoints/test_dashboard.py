"""The KV cache dashboard: the page driven in headless Chromium against a real `pagedllm serve` (tiny model, a small
pool), its event stream, the engine's snapshots, and `bench throughput --trace` played back by `pagedllm replay`.

The browser tests need Debian's chromium (`apt-get install -y chromium`) and Playwright's Python package (in the
`test` extra); without them they are skipped, saying which is missing.
"""

from __future__ import annotations

import json
import os
import tempfile
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
from test_server import FakeEngine, launch, metric, metrics

from pagedllm.bench.server_process import ServerProcess as Server
from pagedllm.bench.server_process import free_port
from pagedllm.config import EngineConfig
from pagedllm.engine.llm_engine import LLMEngine
from pagedllm.entrypoints.cli import main
from pagedllm.entrypoints.kv_trace import TRACE_FORMAT, TraceRecorder, read_trace
from pagedllm.entrypoints.openai.dashboard import DashboardHub
from pagedllm.entrypoints.replay import build_replay_app
from pagedllm.sampling_params import SamplingParams

CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync"]
NUM_BLOCKS = 48
STORY = ("Once upon a time in a small village by the sea there lived an old fisherman who mended his nets every "
         "morning and told stories to the children in the evening")  # 2 full 16-token blocks and a partial one
PREFIX = ("You are a patient librarian. Answer every question in one short sentence and name a book the reader can "
          "borrow from the shelf by the window, which holds history, science and poetry. ")  # 3+ full blocks


# ---- browser -----------------------------------------------------------------------------------------------------
def sync_playwright_or_skip():
    if not os.path.exists(CHROMIUM):
        pytest.skip(f"Chromium is not installed at {CHROMIUM} (Debian: apt-get install -y chromium)")
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        pytest.skip("Playwright's Python package is not installed (pip install playwright; never `playwright "
                    "install`: the tests use Debian's chromium)")
    return sync_playwright


@pytest.fixture
def browser() -> Iterator:
    """A fresh headless Chromium (its own empty profile), as the machine notes say to start it."""
    sync_playwright = sync_playwright_or_skip()
    with sync_playwright() as p, tempfile.TemporaryDirectory() as profile:
        context = p.chromium.launch_persistent_context(profile, executable_path=CHROMIUM, args=CHROMIUM_ARGS,
                                                       headless=True, viewport={"width": 1400, "height": 1000})
        try:
            yield context
        finally:
            context.close()


def open_page(browser, url: str):
    page = browser.new_page()
    page.errors = []
    page.on("pageerror", lambda e: page.errors.append(str(e)))
    page.goto(url)
    page.wait_for_function("window.dashboardState && window.dashboardState.framesReceived > 0", timeout=30_000)
    return page


def state(page) -> dict:
    return page.evaluate("""() => { const s = window.dashboardState;
        return {counts: s.counts, peak: s.peak, counters: s.counters, selected: s.selected, mode: s.mode,
                connected: s.connected, kinds: [...new Set(s.events.map(e => e.kind))], requests: s.requests,
                clients: s.clients,
                grid: s.grid, numBlocks: s.numBlocks, states: Array.from(s.states), refs: Array.from(s.refs)}; }""")


# ---- a server ----------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def server(tiny_model_dir: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """A small pool (48 blocks of 16 tokens) so that the workload below shares, caches and may preempt; 20
    snapshots a second so that a short run on the tiny model still shows many frames."""
    log = tmp_path_factory.mktemp("dashboard-server") / "server.log"
    with launch(tiny_model_dir, log, "--num-blocks", str(NUM_BLOCKS), "--max-model-len", "512",
                "--dashboard-rate", "20") as s:
        yield s
    assert "Traceback" not in Path(s.log_path).read_text(errors="replace"), s.log_tail()


def complete(server: Server, prompt: str, max_tokens: int, n: int = 1, **fields: object) -> int:
    """One completion with exactly max_tokens tokens per sample; its completion tokens."""
    r = httpx.post(f"{server.url}/v1/completions", json={"prompt": prompt, "max_tokens": max_tokens, "n": n,
                                                         "temperature": 1.0, "seed": 1, "ignore_eos": True,
                                                         **fields}, timeout=300)
    assert r.status_code == 200, r.text
    return r.json()["usage"]["completion_tokens"]


def sharing_workload(server: Server) -> int:
    """Parallel sampling (4 samples over one prompt's blocks, client "storyteller", priority -1) beside anonymous
    shared-prefix requests (the first fills the prefix cache, the others find it). Returns the tokens generated."""
    generated = complete(server, PREFIX + "Question 0: what is a comet?", 1)
    with ThreadPoolExecutor(8) as pool:
        jobs = [pool.submit(complete, server, STORY, 120, 4, user="storyteller", priority=-1)]
        time.sleep(0.3)
        jobs += [pool.submit(complete, server, PREFIX + f"Question {i}: who was person number {i}?", 60)
                 for i in range(1, 7)]
        return generated + sum(job.result() for job in jobs)


def idle_page_state(page, generated: int) -> dict:
    page.wait_for_function(f"""(s => s.counters.num_running === 0 && s.counters.num_waiting === 0 &&
                                     s.counters.generated_tokens >= {generated})(window.dashboardState)""",
                           timeout=60_000)
    return state(page)


# ---- the page, live ----------------------------------------------------------------------------------------------
def test_the_page_shows_sharing_and_caching_and_agrees_with_metrics(server: Server, browser) -> None:
    page = open_page(browser, f"{server.url}/dashboard")
    first = state(page)
    assert first["mode"] == "live" and first["numBlocks"] == NUM_BLOCKS and first["connected"]
    before = first["counters"]["generated_tokens"]

    result: dict[str, int] = {}
    load = threading.Thread(target=lambda: result.update(generated=sharing_workload(server)))
    load.start()
    # while it runs: the 4 samples share the prompt's full blocks; clicking their request highlights its blocks
    page.wait_for_function("window.dashboardState.peak.shared > 0", timeout=60_000)
    selected = page.evaluate("""() => { const r = window.dashboardState.requests.find(r => r.n === 4);
        if (!r) return null;
        document.querySelector(`tr.req[data-id="${r.request_id}"]`).click();
        return r.request_id; }""")
    if selected is not None:
        assert state(page)["selected"] == selected
        assert page.locator("tr.req.selected").count() == 1
        assert page.locator("tr.req.selected td.who").inner_text() == "storyteller · -1"
    load.join()

    s = idle_page_state(page, before + result["generated"])
    m = metrics(server)
    c = s["counters"]
    # the same figures as /metrics
    assert c["generated_tokens"] == metric(m, "generation_tokens_total") == before + result["generated"]
    assert c["prefix_cache_hits"] == metric(m, "prefix_cache_hits_total") > 0
    assert c["prefix_cache_queries"] == metric(m, "prefix_cache_queries_total")
    assert c["preemptions"] == metric(m, "num_preemptions_total")
    assert c["num_running"] == metric(m, "num_requests_running") == 0
    assert c["num_waiting"] == metric(m, "num_requests_waiting") == 0
    assert c["blocks_in_use"] / NUM_BLOCKS == metric(m, "kv_cache_usage_perc") == 0.0
    # the grid: shared blocks were seen during the run, cached prefixes stay after it, and the cells add up
    assert s["peak"]["shared"] > 0 and s["peak"]["used"] > 0
    assert s["counts"]["cached"] == c["blocks_cached_free"] > 0
    assert s["counts"]["used"] + s["counts"]["shared"] + s["counts"]["reserved"] == c["blocks_in_use"]
    assert sum(s["counts"].values()) == NUM_BLOCKS
    assert c["forks"] >= 3 and {"fork", "prefix_hit"} <= set(s["kinds"])
    # the clients table: the storyteller's one request of 4 x 120 tokens, the anonymous client's 7
    clients = {row["client"]: row for row in s["clients"]}
    assert set(clients) == {"storyteller", ""} and clients["storyteller"]["output_tokens"] == 480
    assert clients["storyteller"]["requests"] == 1 and clients[""]["requests"] == 7
    assert page.locator("#clients tr").count() == 2 and "(anonymous)" in page.locator("#clients").inner_text()

    # hovering a cached block names it
    block = s["states"].index(3)
    g = s["grid"]
    box = page.locator("#pool").bounding_box()
    page.mouse.move(box["x"] + (block % g["cols"]) * g["cell"] + g["cell"] / 2,
                    box["y"] + (block // g["cols"]) * g["cell"] + g["cell"] / 2)
    tooltip = page.locator("#tooltip")
    tooltip.wait_for(state="visible")
    assert f"block {block}" in tooltip.inner_text() and "cached" in tooltip.inner_text()
    assert page.errors == []


def test_event_stream_diffs_rebuild_the_snapshot(server: Server) -> None:
    """A full frame first, then diffs: applied in order they give what /dashboard/snapshot gives."""
    mirror: dict[int, tuple[int, int]] = {}
    frames: list[dict] = []
    done = threading.Event()

    def read() -> None:
        with httpx.stream("GET", f"{server.url}/dashboard/events", timeout=60) as r:
            assert r.headers["content-type"].startswith("text/event-stream")
            for line in r.iter_lines():
                if not line.startswith("data: "):
                    continue
                frame = json.loads(line[6:])
                frames.append(frame)
                if frame["full"]:
                    mirror.clear()
                b = frame["blocks"]
                for i in range(0, len(b), 3):
                    mirror[b[i]] = (b[i + 1], b[i + 2])
                if done.is_set() and frame["counters"]["num_running"] == 0 and frame["counters"]["num_waiting"] == 0:
                    return

    reader = threading.Thread(target=read)
    reader.start()
    time.sleep(0.5)
    complete(server, STORY, 30, n=2)
    done.set()
    complete(server, "one more request, so that a frame comes after `done`", 2)
    reader.join(60)
    assert not reader.is_alive()
    assert frames[0]["full"] and frames[0]["history"] and not any(f["full"] for f in frames[1:])
    snapshot = httpx.get(f"{server.url}/dashboard/snapshot").json()
    b = snapshot["blocks"]
    assert {k: v for k, v in mirror.items() if v[0]} == {b[i]: (b[i + 1], b[i + 2]) for i in range(0, len(b), 3)}


def test_an_open_page_does_not_keep_the_server_from_stopping(tiny_model_dir: str, tmp_path: Path) -> None:
    """uvicorn waits for open connections when it stops; the event streams end first, or SIGTERM would hang."""
    with launch(tiny_model_dir, tmp_path / "server.log", "--num-blocks", "16") as s:
        opened = threading.Event()

        def listen() -> None:
            with httpx.stream("GET", f"{s.url}/dashboard/events", timeout=60) as r:
                for _ in r.iter_lines():
                    opened.set()

        reader = threading.Thread(target=listen, daemon=True)
        reader.start()
        assert opened.wait(30)
        s.proc.terminate()
        s.proc.wait(20)  # uvicorn ends by re-raising SIGTERM once it has shut down
        assert "Application shutdown complete" in s.log_tail()
        reader.join(10)
        assert not reader.is_alive()


def test_no_dashboard_and_a_dashboard_that_cannot_start() -> None:
    """--no-dashboard: no routes. An engine without snapshots: the server serves, the dashboard says why not."""
    from fastapi.testclient import TestClient

    from pagedllm.config import ServerConfig
    from pagedllm.entrypoints.serve import build_app

    with TestClient(build_app(FakeEngine(), ["fake"], ServerConfig(no_dashboard=True))) as http:
        assert http.get("/dashboard").status_code == 404
        assert http.get("/dashboard/events").status_code == 404
    with TestClient(build_app(FakeEngine(), ["fake"])) as http:
        assert http.get("/health").status_code == 200
        assert http.get("/dashboard").status_code == 200
        assert http.get("/dashboard/snapshot").json()["error"] == "no snapshot yet"


# ---- the engine's snapshots, traces, replay ----------------------------------------------------------------------
@pytest.fixture(scope="module")
def engine(tiny_model_dir: str) -> LLMEngine:
    return LLMEngine(EngineConfig(model=tiny_model_dir, dtype="float32", num_blocks=32, block_size=4,
                                  max_num_batched_tokens=64, max_num_seqs=8, threads=1))


def test_snapshots_name_prompts_unless_hidden(engine: LLMEngine) -> None:
    engine.add_request("words", "The quick brown fox jumps over the lazy dog again and again",
                       SamplingParams(max_tokens=3, n=2))
    engine.step()
    (request,) = engine.kv_snapshot().requests
    assert request.prompt == "The quick brown fox jumps over the lazy …" and request.n == 2
    assert DashboardHub("m", hide_prompts=True).take(engine).requests[0].prompt == ""
    while engine.has_unfinished_requests():
        engine.step()


def test_a_trace_replays_to_the_engines_state(engine: LLMEngine, tmp_path: Path) -> None:
    path = str(tmp_path / "trace.jsonl")
    trace = TraceRecorder(engine, path, every=2, keyframe_every=4, kv_policy="paged")
    engine.add_step_observer(trace)
    for i in range(6):
        engine.add_request(f"t{i}", list(range(1, 14)) + [100 + i], SamplingParams(max_tokens=20, n=1 + i % 2,
                                                                                   ignore_eos=True))
    while engine.has_unfinished_requests():
        engine.step()
    trace.close()
    engine.remove_step_observer(trace)
    header, lines = read_trace(path)
    assert header["format"] == TRACE_FORMAT and header["every"] == 2 and header["kv_policy"] == "paged"
    frames = [json.loads(line) for line in lines]
    assert len(frames) == trace.frames > 4 and [f["full"] for f in frames[:5]] == [True, False, False, False, True]
    mirror: dict[int, tuple[int, int]] = {}
    for f in frames:
        if f["full"]:
            mirror.clear()
        b = f["blocks"]
        for i in range(0, len(b), 3):
            mirror[b[i]] = (b[i + 1], b[i + 2])
    b = engine.kv_snapshot().blocks
    assert {k: v for k, v in mirror.items() if v[0]} == {b[i]: (b[i + 1], b[i + 2]) for i in range(0, len(b), 3)}
    assert any(e["kind"] == "prefix_hit" for f in frames for e in f["events"])
    with pytest.raises(ValueError, match="not a pagedllm KV trace"):
        read_trace(__file__)


@pytest.mark.usefixtures("fake_machine")  # its machine-limit estimate: no measuring in a test
def test_bench_throughput_trace_then_replay_in_the_browser(tiny_model_dir: str, tmp_path: Path, browser) -> None:
    path = str(tmp_path / "bench.jsonl")
    assert main(["bench", "throughput", "--model", tiny_model_dir, "--dtype", "float32", "--num-blocks", "40",
                 "--threads", "1", "--dataset", "parallel-sampling", "--num-prompts", "8", "--output-len", "24",
                 "--trace", path, "--trace-every", "2"]) == 0
    header, frames = read_trace(path)
    assert header["dataset"] == "parallel-sampling" and len(frames) > 3

    import uvicorn

    port = free_port()
    replay = uvicorn.Server(uvicorn.Config(build_replay_app(path), host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=replay.run, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 30
        while not replay.started:
            assert time.monotonic() < deadline, "the replay server did not start"
            time.sleep(0.05)
        info = httpx.get(f"http://127.0.0.1:{port}/dashboard/info").json()
        assert info == {"mode": "replay", "model": header["model"], "path": path, "frames": len(frames)}
        assert httpx.get(f"http://127.0.0.1:{port}/dashboard/events").status_code == 404
        page = open_page(browser, f"http://127.0.0.1:{port}/dashboard")
        assert page.is_visible("#slider")
        last = json.loads(frames[-1])
        middle = len(frames) // 2
        page.fill("#slider", str(middle))
        page.dispatch_event("#slider", "input")
        s = page.evaluate("({index: dashboardState.replay.index, step: dashboardState.step, "
                          "peak: dashboardState.peak})")
        assert s["index"] == middle and s["step"] == json.loads(frames[middle])["step"]
        page.click("#play")
        page.wait_for_function(f"window.dashboardState.step === {last['step']}", timeout=30_000)
        assert state(page)["counters"] == last["counters"]
        assert s["peak"]["shared"] > 0  # parallel samples share their prompt's blocks
        assert page.errors == []
    finally:
        replay.should_exit = True
        thread.join(10)
