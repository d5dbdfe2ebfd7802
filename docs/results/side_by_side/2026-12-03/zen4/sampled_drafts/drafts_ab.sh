# Sampled requests (temperature 0.8, top_p 0.95) with n-gram drafts (4, the default) against without (0), alternated,
# on the checkout at /work/main: the edit requests one after another and all at once (EOS ends them), one free
# request of 256 tokens, and workload W's 200 requests at once (exact lengths).
cd /work/main/docs/results/side_by_side/2026-12-03/zen4/sampled_drafts
PY=/work/main/.venv/bin/python
W=/work/main/docs/results/side_by_side/2026-11-30/xeon_fp16/at_87a5b61/offline/workload.jsonl
run() { for round in $(seq $1); do for k in 4 0; do uptime; $PY sampled_drafts.py $2 $k 0.8 0.95 $3 $4 2>&1 | grep tokens/s; done; done; }
echo "## edit requests x3, one after another"; run 2 edit_requests_x3.jsonl 1 eos
echo "## one free request, 256 tokens"; run 3 single_request.jsonl 1 exact
echo "## edit requests x3, all at once"; run 2 edit_requests_x3.jsonl 0 eos
echo "## workload W, 200 at once"; run 2 $W 0 exact
uptime
