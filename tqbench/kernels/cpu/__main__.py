"""``python -m tqbench.kernels.cpu``: build (or load) the native CPU kernel now and print whether it runs."""

import sys
import time


def main() -> int:
    from tqbench.kernels.cpu import native_status

    t0 = time.perf_counter()
    ok, why = native_status()
    print(f"tqbench native CPU kernel: {'ready' if ok else 'unavailable'} ({why}) in {time.perf_counter() - t0:.1f} s")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
