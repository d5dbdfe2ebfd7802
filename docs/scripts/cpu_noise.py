"""Keep a fraction of one core busy (a spin for `duty` of every 10 ms): the CPU a server's HTTP side and its
benchmark client take from the engine, reproduced offline. usage: python docs/scripts/cpu_noise.py 0.13"""

import sys
import time


def main(duty: float, period: float = 0.01) -> None:
    while True:
        start = time.perf_counter()
        while time.perf_counter() - start < duty * period:
            pass
        time.sleep(period * (1 - duty))


if __name__ == "__main__":
    main(float(sys.argv[1]))
