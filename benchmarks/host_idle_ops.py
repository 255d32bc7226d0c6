"""Host time of single torch/CUDA calls on a thread that just woke from an idle pause.

The time to first token of a request at an idle engine runs through host code on two
threads that were asleep until it arrived. This measures, on the machine at hand, what a
few calls of the prompt step's input upload cost in a worker thread (as the engine's
device thread), back to back and ``--gap-ms`` after the thread last ran: a slice and
non-blocking copy from pinned memory to the device (as ``ModelRunner._replay_prompt``
does), the same copy between fixed views, from memory pinned with ``cudaHostRegister``,
a CUDA event record, a timing event's creation and record, two tensor slices, and
``torch.cuda.current_stream()``.

    python3 benchmarks/host_idle_ops.py [--gap-ms 200] [--repeats 25]
    python3 benchmarks/host_idle_ops.py --gaps-ms 0.1 1 5 20 200 --poll-us 50 200

``--gaps-ms`` times the calls after each of several pauses, and ``--poll-us`` also after
the same pauses spent as a poll (sleeps of that many microseconds until the pause is
over, as a thread that checks a queue would), to see how long a pause the host takes
before it slows a thread down, and whether short sleeps keep it warm.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import threading
import time

import numpy as np
import torch


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gap-ms", type=float, default=200.0)
    ap.add_argument("--repeats", type=int, default=25)
    ap.add_argument("--gaps-ms", type=float, nargs="+", default=None)
    ap.add_argument("--poll-us", type=float, nargs="*", default=[])
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("needs a CUDA GPU", file=sys.stderr)
        return 2
    size = 1400  # int64 words of an 80-token prompt graph's packed inputs, about
    dst = torch.zeros(4096, dtype=torch.int64, device="cuda")
    pinned = torch.empty(1 << 16, dtype=torch.int64, pin_memory=True)
    registered_np = np.zeros(1 << 16, dtype=np.int64)
    rc = torch.cuda.cudart().cudaHostRegister(registered_np.ctypes.data, registered_np.nbytes, 0)
    print("cudaHostRegister rc", rc)
    registered = torch.from_numpy(registered_np)
    event = torch.cuda.Event()
    dview, pview, rview = dst[:size], pinned[:size], registered[:size]
    calls = {
        "slice+copy pinned": lambda: dst[:size].copy_(pinned[:size], non_blocking=True),
        "view copy pinned": lambda: dview.copy_(pview, non_blocking=True),
        "view copy registered": lambda: dview.copy_(rview, non_blocking=True),
        "event.record": lambda: event.record(),
        "event(timing)+record": lambda: torch.cuda.Event(enable_timing=True).record(),
        "slice only x2": lambda: (dst[:size], pinned[:size]),
        "current_stream": lambda: torch.cuda.current_stream(),
    }

    def pause(gap_s: float, poll_s: float) -> None:
        if not poll_s:
            time.sleep(gap_s)
            return
        end = time.perf_counter() + gap_s
        while time.perf_counter() < end:
            time.sleep(poll_s)

    def measure(gap_s: float, poll_s: float = 0.0) -> dict[str, float]:
        times: dict[str, list[float]] = {k: [] for k in calls}
        for _ in range(args.repeats):
            for name, call in calls.items():
                if gap_s:
                    pause(gap_s, poll_s)
                t0 = time.perf_counter()
                call()
                times[name].append((time.perf_counter() - t0) * 1e6)
            torch.cuda.synchronize()
        return {k: statistics.median(v[3:]) for k, v in times.items()}

    if args.gaps_ms is None:
        for gap_s in (0.0, args.gap_ms / 1e3):
            result: dict[str, float] = {}
            worker = threading.Thread(target=lambda: result.update(measure(gap_s)))
            worker.start()
            worker.join()
            print(f"gap {gap_s * 1e3:.0f} ms (device-side thread):")
            for name, us in result.items():
                print(f"   {name:24s} {us:8.1f} us")
        return 0
    # One line per pause and way of pausing: the calls' medians, us.
    print(f"{'pause':>22s} " + " ".join(f"{name[:12]:>12s}" for name in calls))
    for gap_ms in [0.0] + args.gaps_ms:
        for poll_us in [0.0] + ([p for p in args.poll_us if p < gap_ms * 1e3] if gap_ms else []):
            result = {}
            worker = threading.Thread(target=lambda: result.update(measure(gap_ms / 1e3, poll_us / 1e6)))
            worker.start()
            worker.join()
            how = f"{gap_ms:g} ms" + (f", poll {poll_us:g} us" if poll_us else "")
            print(f"{how:>22s} " + " ".join(f"{result[name]:12.1f}" for name in calls), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
