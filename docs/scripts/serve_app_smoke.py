"""pagedllm.serve_app on a local Ray Serve: 2 engine replicas of the default model, 4 requests sharing a prefix (they
should all land on one replica, whose prefix cache then hits), a streamed chat, /health, each replica's counters.

    PYTHONPATH=. python docs/scripts/serve_app_smoke.py      # needs ray[serve]; about a minute to start here
"""

import os
import time

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
import httpx
import ray
from ray import serve

import pagedllm
from pagedllm.engine.replica_pool import package_runtime_env

t = time.time()
ray.init(num_cpus=2, include_dashboard=False, runtime_env=package_runtime_env())
serve.start(http_options={"host": "127.0.0.1", "port": 18766})
serve.run(pagedllm.serve_app(num_replicas=2, threads=1, num_blocks=128), route_prefix="/", name="pagedllm")
print("up in", time.time() - t, flush=True)
shared = (
    "You are a careful assistant for a library. Answer every question about the catalogue in one short sentence. " * 3
)
for q in ["Do you have maps?", "Who wrote it?", "Is there a book on owls?", "When do you open?"]:
    r = httpx.post(
        "http://127.0.0.1:18766/v1/completions",
        json={"prompt": shared + q, "max_tokens": 8, "temperature": 0},
        timeout=120,
    )
    print(r.status_code, r.json()["choices"][0]["text"] if r.status_code == 200 else r.text)
with httpx.stream(
    "POST",
    "http://127.0.0.1:18766/v1/chat/completions",
    json={"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 5, "stream": True},
    timeout=120,
) as r:
    print([line[:60] for line in r.iter_lines() if line][:3])
print(httpx.get("http://127.0.0.1:18766/health").status_code)
h = serve.get_deployment_handle("PagedLLMEngine", "pagedllm")
seen = {}
for _ in range(12):
    x = h.prefix_cache.remote().result()
    seen[x["pid"]] = x
print(seen)
st = serve.status()
print({n: {d: (v.status, v.replica_states) for d, v in a.deployments.items()} for n, a in st.applications.items()})
serve.shutdown()
ray.shutdown()
