"""What a new user meets first on the command line (issue 33): `--help` that is quick and shows defaults, a mistyped
flag or command that gets the closest one suggested, an error that names the flag to change, and Ctrl-C that stops
quietly."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from pagedllm.entrypoints.cli import main

REPO = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "PYTHONPATH": str(REPO)}
HEAVY = ("torch", "fastapi", "uvicorn.main", "pagedllm.engine.llm_engine", "pagedllm.bench.commands")


@pytest.mark.parametrize("argv,allowed", [(["--help"], ()), (["generate", "--help"], ()),
                                          (["replay", "--help"], ()), (["serve", "--help"], ("uvicorn.main",))])
def test_help_imports_no_heavy_module(argv, allowed):
    """`pagedllm --help` took 5-8 s: every command's modules (torch, fastapi, the engine) were imported first."""
    code = ("import sys\nfrom pagedllm.entrypoints.cli import main\ntry:\n    main(sys.argv[1:])\nexcept SystemExit:\n"
            f"    pass\nprint(' '.join(m for m in {HEAVY!r} if m in sys.modules), file=sys.stderr)")
    run = subprocess.run([sys.executable, "-c", code, *argv], env=ENV, capture_output=True, text=True, timeout=120)
    assert "usage: pagedllm" in run.stdout
    loaded = set(run.stderr.split()) - set(allowed)
    assert not loaded, f"{argv} imported {loaded}"


def test_help_shows_defaults_and_only_accepted_choices(capsys):
    with pytest.raises(SystemExit):
        main(["generate", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "tokens to generate at most (default: 256)" in text
    assert "--min-p MIN_P (default: 0.0)" in text  # a zero default is a default too
    assert "--kv-cache-dtype {auto,bfloat16,float32,int8}" in text  # fp8 is always refused: not offered
    assert "--quantization {auto,none,int4,w8a8}" in text
    assert "(default: False)" not in text and "(default: None)" not in text


@pytest.mark.parametrize("argv,hint", [
    (["generate", "--max-tokenz", "5", "hi"], "did you mean --max-tokens?"),
    (["serve", "--prot", "8001"], "did you mean --port?"),
    (["genrate", "hi"], "did you mean generate?"),
    (["bench", "throughputt"], "did you mean throughput?"),
])
def test_a_mistyped_flag_or_command_gets_the_closest_one(capsys, argv, hint):
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert hint in err
    assert err.startswith(f"usage: pagedllm {argv[0]}" if argv[0] in ("generate", "serve", "bench") else "usage:")


def test_a_prompt_longer_than_the_cache_names_the_flags(tiny_model_dir, capsys):
    code = main(["generate", "--model", tiny_model_dir, "--num-blocks", "1", "--threads", "1", "--dtype", "float32",
                 "--raw", "count with me: " + " ".join(str(i) for i in range(40))])
    err = capsys.readouterr().err
    assert code == 2 and "max_model_len is 16" in err and "--num-blocks" in err and "Traceback" not in err


def default_sigint() -> None:
    """In the child: a Ctrl-C that ends it, even when pytest runs as a shell's background job (`&`), which ignores
    SIGINT and would hand that on (the command then keeps an ignored SIGINT ignored, as it should)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def test_ctrl_c_in_generate_exits_quietly_with_130(tiny_model_dir):
    proc = subprocess.Popen([sys.executable, "-m", "pagedllm.entrypoints.cli", "generate", "--model", tiny_model_dir,
                             "--threads", "1", "--dtype", "float32", "--ignore-eos", "--max-tokens", "100000",
                             "--max-model-len", "2000", "--num-speculative-tokens", "0", "--raw", "hello"],
                            env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=default_sigint)
    try:
        assert proc.stdout is not None
        proc.stdout.read(20)  # generating: interrupted at once, ~2000 steps before its end (speculation off)
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == -signal.SIGINT, err  # ended by SIGINT: a shell's $? is 130
    assert "Traceback" not in err and "KeyboardInterrupt" not in err
