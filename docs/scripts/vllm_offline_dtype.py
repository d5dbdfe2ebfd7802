"""The peers' vLLM offline script (../shared/peers/vllm_offline.py) with the dtype VLLM_DTYPE names instead of its
bfloat16, as side_by_side_serve.sh does for vLLM's server: on CPUs without AVX512-BF16 or AMX a user would try
float32, since bf16 matmuls are emulated there.
usage: VLLM_DTYPE=float32 VLLM_OFFLINE=docs/scripts/vllm_offline_dtype.py docs/scripts/side_by_side.sh ...
  (PEER_SCRIPT names the peer's script; default ../shared/peers/vllm_offline.py beside the repo)"""

import os
import runpy
import sys
from pathlib import Path


def main() -> None:
    import vllm

    dtype, build = os.environ.get("VLLM_DTYPE", "bfloat16"), vllm.LLM

    def llm(*args: object, **kwargs: object) -> object:
        return build(*args, **{**kwargs, "dtype": dtype})

    vllm.LLM = llm  # the peer's script imports LLM from vllm inside its main()
    repo = Path(__file__).resolve().parents[2]
    peer = os.environ.get("PEER_SCRIPT", str(repo.parent / "shared" / "peers" / "vllm_offline.py"))
    sys.argv = [peer, *sys.argv[1:]]
    runpy.run_path(peer, run_name="__main__")


if __name__ == "__main__":
    main()
