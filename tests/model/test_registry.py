"""The model registry: a checkpoint's architecture picks the class that runs it; an unknown one is refused at load,
naming the supported ones; every registered family builds and decodes as transformers does."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import make_tiny_hf_model

from pagedllm import LLM, SamplingParams
from pagedllm.model import model_runner, registry
from pagedllm.model.loader import load_model

STEPS = 8
PROMPT = [17, 4242, 901, 33000, 5, 12]


@pytest.fixture(scope="module")
def family_dirs(tmp_path_factory):
    """A tiny random checkpoint, made by transformers, of each registered architecture."""
    overrides = {"MistralForCausalLM": dict(sliding_window=None)}  # the decoder has no sliding window
    return {f.architecture: make_tiny_hf_model(str(tmp_path_factory.mktemp(f.model_type)), f.architecture,
                                               **overrides.get(f.architecture, {}))
            for f in registry.FAMILIES}


def test_the_table_holds_todays_families():
    assert registry.SUPPORTED_ARCHITECTURES == ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM")
    assert registry.GGUF_ARCHITECTURES == ("llama", "qwen2")
    assert [f.architecture for f in registry.FAMILIES if f.qkv_bias] == ["Qwen2ForCausalLM"]


@pytest.mark.parametrize("architectures,model_type,expected", [
    (["LlamaForCausalLM"], "llama", "LlamaForCausalLM"),
    (["GPT2LMHeadModel", "MistralForCausalLM"], "gpt2", "MistralForCausalLM"),  # the first supported entry
    ([], "qwen2", "Qwen2ForCausalLM"),  # a config naming only its model_type
])
def test_hf_config_names_its_family(architectures, model_type, expected):
    assert registry.hf_family(architectures, model_type, "x").architecture == expected


@pytest.mark.parametrize("lookup", [lambda: registry.hf_family(["GPT2LMHeadModel"], "gpt2", "ckpt"),
                                    lambda: registry.model_class("GPT2LMHeadModel"),
                                    lambda: registry.family_of("GPT2LMHeadModel")])
def test_unknown_architecture_is_refused_naming_the_supported_ones(lookup):
    with pytest.raises(ValueError, match="unsupported architecture .*GPT2") as e:
        lookup()
    assert all(name in str(e.value) for name in registry.SUPPORTED_ARCHITECTURES)


def test_unknown_gguf_architecture_is_refused_naming_the_supported_ones():
    with pytest.raises(ValueError, match=r"f\.gguf: unsupported GGUF architecture 'gpt2'; supported: llama, qwen2"):
        registry.gguf_family("gpt2", "f.gguf")
    assert registry.gguf_family("llama", "f.gguf").architecture == "LlamaForCausalLM"


def test_unknown_architecture_fails_before_weights_are_read(tmp_path, monkeypatch):
    """The folder's weights and tokenizer are never opened: the config alone decides."""
    from pagedllm.model.loader import hf

    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"}))
    monkeypatch.setattr(hf, "read_safetensors", lambda *a: pytest.fail("weights read"))
    with pytest.raises(ValueError, match="GPT2LMHeadModel.*supported: LlamaForCausalLM"):
        load_model(str(tmp_path))


@pytest.mark.parametrize("architecture", registry.SUPPORTED_ARCHITECTURES)
def test_each_registered_family_builds_and_decodes_as_transformers(family_dirs, architecture, monkeypatch):
    """The runner builds the class the registry names for the checkpoint, and it decodes greedily as transformers'
    own class for that architecture does."""
    import transformers

    asked = []
    monkeypatch.setattr(model_runner, "model_class", lambda arch: asked.append(arch) or registry.model_class(arch))
    folder = family_dirs[architecture]
    llm = LLM(folder, dtype="float32", num_blocks=64)
    assert asked == [architecture]
    assert isinstance(llm.engine.runner.model, registry.model_class(architecture))
    out = llm.generate([{"prompt_token_ids": PROMPT}], SamplingParams(temperature=0.0, max_tokens=STEPS,
                                                                       ignore_eos=True), use_tqdm=False)
    hf = getattr(transformers, architecture).from_pretrained(folder, dtype=torch.float32).eval()
    with torch.no_grad():
        ref = hf.generate(torch.tensor([PROMPT]), max_new_tokens=STEPS, min_new_tokens=STEPS, do_sample=False,
                          eos_token_id=None, pad_token_id=0)
    assert out[0].outputs[0].token_ids == ref[0, len(PROMPT):].tolist()
