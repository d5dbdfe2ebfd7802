"""Where the suite's CPU goes, from `py-spy record --subprocesses --rate 20 --format raw` (suite_spy.raw.xz): the
seconds (samples / 20) of the frames whose function matches a pattern, each counted once per stack.
usage: python spy_summary.py suite_spy.raw.xz [PATTERN]"""
import collections
import lzma
import re
import sys

RATE = 20
DEFAULT = (r"^(LLMEngine\.(__init__|step) |load_model \(pagedllm|dequantize \(pagedllm"
           r"|Tokenizer\.(from_dir|max_token_chars)"
           r"|measure \(pagedllm/model/attention_dispatch|tune \(pagedllm/model/dispatch|<module> \(torch/__init__"
           r"|StateForActualGivenExecution\.execute_once |LlamaModel\._packed)")


def stacks(path: str):
    """(frames, samples) per record; a process's command line may hold a newline, continued on the next line."""
    pending = ""
    with lzma.open(path, "rt", errors="replace") as f:
        for line in f:
            pending += line.rstrip("\n")
            stack, _, count = pending.rpartition(" ")
            if count.isdigit():
                yield stack.split(";"), int(count)
                pending = ""


def main() -> None:
    pattern = re.compile(sys.argv[2] if len(sys.argv) > 2 else DEFAULT)
    seconds, total = collections.Counter(), 0
    for frames, count in stacks(sys.argv[1]):
        total += count
        for name in {re.sub(r":\d+\)", ")", f) for f in frames if pattern.search(f)}:
            seconds[name] += count
    print(f"{total / RATE:.1f} s of samples in all")
    for name, count in seconds.most_common(40):
        print(f"{count / RATE:8.1f}  {name}")


if __name__ == "__main__":
    main()
