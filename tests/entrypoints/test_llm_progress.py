"""Progress on long offline work (issue 33): beam search shows a bar over its steps when asked (as vLLM's
`use_tqdm`), and nothing by default."""

from __future__ import annotations

import pytest

from pagedllm import LLM
from pagedllm.sampling_params import BeamSearchParams


@pytest.fixture(scope="module")
def llm(tiny_model_dir: str) -> LLM:
    return LLM(tiny_model_dir, dtype="float32", threads=1, num_blocks=64, attention_backend="reference")


def test_beam_search_shows_its_steps_when_asked(llm: LLM, capsys: pytest.CaptureFixture) -> None:
    params = BeamSearchParams(beam_width=2, max_tokens=3, ignore_eos=True)
    quiet = llm.beam_search([[1, 2, 3]], params)
    assert "Beam search" not in capsys.readouterr().err
    shown = llm.beam_search([[1, 2, 3]], params, use_tqdm=True)
    err = capsys.readouterr().err
    assert "Beam search" in err and "3/3" in err
    assert [b.tokens for b in shown[0].sequences] == [b.tokens for b in quiet[0].sequences]
