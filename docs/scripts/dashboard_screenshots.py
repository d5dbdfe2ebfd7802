"""Screenshots of /dashboard for the docs: a shared-prefix run and a preemption storm, against a running server.

    pagedllm serve --num-blocks 192 &      # the default model; a small pool so that the storm preempts
    python docs/scripts/dashboard_screenshots.py --scenario shared-prefix --out docs/img/dashboard-shared-prefix.png
    python docs/scripts/dashboard_screenshots.py --scenario preemption --out docs/img/dashboard-preemption.png

Drives Debian's chromium (/usr/bin/chromium) through Playwright, sends the scenario's requests, and takes the
screenshot once the page shows what the scenario is about (shared blocks; preempted requests), with one request
selected so that its blocks are highlighted.
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile
import threading
import time

import httpx
from playwright.sync_api import sync_playwright

CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync"]
SYSTEM = ("You are the reference desk of a small public library. Answer in three short sentences, name one book the "
          "reader can borrow, and say on which shelf it stands: history is on shelf A, science on shelf B, novels on "
          "shelf C, poetry on shelf D and children's books on shelf E. Be kind, be precise, and never invent a title "
          "that the library does not hold. The library is open from nine to six, Monday to Saturday. ") * 2
QUESTIONS = ["Who was Ada Lovelace?", "Why is the sky blue?", "What is a black hole?", "How do bees make honey?",
             "Who painted the Mona Lisa?", "What causes the tides?", "How does a vaccine work?",
             "What is the tallest mountain?", "Why do leaves change colour?", "Who wrote Don Quixote?",
             "What is photosynthesis?", "How far away is the Moon?", "What is the speed of light?",
             "Who built the pyramids?", "How do volcanoes form?", "What is DNA?"]
STORIES = ["Write a long story about a lighthouse keeper who finds a message in a bottle.",
           "Describe, in great detail, a journey across the Sahara on a camel.",
           "Tell the history of the printing press as if you were there.",
           "Write a long letter from a sailor to his family in 1850.",
           "Explain how a steam engine works to a curious child, step by step.",
           "Write a detective story set in a snowed-in mountain hotel."]


async def shared_prefix(base: str, stop: threading.Event) -> None:
    """Chats with one long system prompt (a common prefix) and different questions, a few with n=3."""
    async with httpx.AsyncClient(base_url=base, timeout=600) as client:
        async def ask(i: int) -> None:
            await asyncio.sleep(0.4 * i)
            question = QUESTIONS[i % len(QUESTIONS)]
            messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]
            await client.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 120,
                                                            "n": 3 if i % 4 == 0 else 1, "temperature": 0.8,
                                                            "ignore_eos": True})

        await asyncio.gather(*(ask(i) for i in range(16)))


async def preemption(base: str, stop: threading.Event) -> None:
    """More long generations at once than the pool holds: the newest are preempted and recomputed."""
    async with httpx.AsyncClient(base_url=base, timeout=900) as client:
        async def write(i: int) -> None:
            await asyncio.sleep(0.05 * i)
            await client.post("/v1/completions", json={"prompt": STORIES[i % len(STORIES)], "max_tokens": 320,
                                                       "n": 2 if i % 5 == 0 else 1, "temperature": 0.9,
                                                       "ignore_eos": True})

        await asyncio.gather(*(write(i) for i in range(40)))


SCENARIOS = {
    "shared-prefix": (shared_prefix, "s.counts.shared >= 12 && s.counters.num_running >= 6 && s.counts.used > 30"),
    "preemption": (preemption, "s.counters.preemptions >= 6 && s.requests.some(r => r.status === 'preempted') && "
                               "s.counts.free < 8"),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base-url", default="http://127.0.0.1:8000")
    parser.add_argument("--scenario", choices=sorted(SCENARIOS), required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--timeout", type=float, default=600)
    args = parser.parse_args()
    load, condition = SCENARIOS[args.scenario]
    stop = threading.Event()
    runner = threading.Thread(target=lambda: asyncio.run(load(args.base_url, stop)), daemon=True)
    with sync_playwright() as p:
        browser = p.chromium.launch_persistent_context(tempfile.mkdtemp(), executable_path="/usr/bin/chromium",
                                                       args=CHROMIUM_ARGS, headless=True,
                                                       viewport={"width": 1440, "height": 1000})
        page = browser.new_page()
        page.goto(f"{args.base_url}/dashboard")
        page.wait_for_function("window.dashboardState && window.dashboardState.framesReceived > 0")
        runner.start()
        page.wait_for_function(f"(s => {condition})(window.dashboardState)", timeout=args.timeout * 1000,
                               polling=250)
        # highlight a request that shares blocks (n > 1), else the first running one
        page.evaluate("""() => { const s = window.dashboardState;
            const r = s.requests.find(r => r.status === 'running' && r.n > 1) || s.requests[0];
            if (r) document.querySelector(`tr.req[data-id="${r.request_id}"]`).click(); }""")
        time.sleep(0.3)
        page.screenshot(path=args.out, full_page=True)
        print(page.evaluate("JSON.stringify({counts: dashboardState.counts, counters: dashboardState.counters})"))
        browser.close()
    runner.join()


if __name__ == "__main__":
    main()
