"""Builds csrc variants of int4_linear_q8 (each a folder with its int4_linear_q8.cpp and headers) as modules."""
import sys
from pathlib import Path
from torch.utils.cpp_extension import load


def build(folder: str):
    d = Path(folder)
    return load(name=f"q8var_{d.name}", sources=[str(Path(__file__).parent / "binding.cpp"), str(d / "int4_linear_q8.cpp")],
                extra_cflags=["-O3", "-march=native", "-fopenmp"], extra_ldflags=["-fopenmp"],
                extra_include_paths=[str(d)], verbose=False)


if __name__ == "__main__":
    for f in sys.argv[1:]:
        build(f)
        print("built", f)
