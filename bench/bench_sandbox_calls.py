"""Calls per second of the code sandbox with sandboxes started ahead of the calls (``sandbox.warm``) next to each
call starting its own (``warm: 0``), side by side in one run, rounds interleaved so that both see the same load.

    python bench/bench_sandbox_calls.py [--calls 120] [--callers 1,4] [--warm 4] [--rounds 3]

Every call is the tool demo's (``print(438*583+673)``, examples/tiny_cpu_tools.yaml) through
:class:`~dapo_megatron.tools.sandbox.CodeSandbox` with the default isolation (bubblewrap, seccomp, a cgroup per
call); ``--callers`` threads call at once (the tool pool's ``pool_size``). A third column, ``warm: 0`` with
``cgroup: rlimits_only``, shows what the cgroup costs per call. Reported per setting: calls per second (the
median of the rounds) and the median latency a call sees, from its arrival to its answer. Needs bubblewrap and
root (or a delegated cgroup), as the sandbox does.
"""

from __future__ import annotations

import argparse
import statistics
import time
from concurrent.futures import ThreadPoolExecutor

from dapo_megatron.config.tools import RLIMITS_ONLY, SandboxConfig
from dapo_megatron.tools.sandbox import CodeSandbox

CODE = "print(438*583+673)\n"
SETTINGS = {  # name: SandboxConfig settings
    "warm 0, rlimits_only": {"warm": 0, "cgroup": RLIMITS_ONLY},
    "warm 0 (before)": {"warm": 0},
    "warm W (after)": {},
}


def measure(settings: dict, calls: int, callers: int) -> tuple[float, float]:
    """(calls per second, median latency in s) of ``calls`` calls made by ``callers`` threads."""
    sandbox = CodeSandbox(SandboxConfig(**settings))
    try:
        time.sleep(1.0)  # the sandboxes started ahead are up, as they are between a step's calls

        def call(_) -> float:
            start = time.perf_counter()
            result = sandbox.run(CODE)
            assert result.ok and result.text == "256027\n", result
            return time.perf_counter() - start

        with ThreadPoolExecutor(callers) as threads:
            start = time.perf_counter()
            latencies = list(threads.map(call, range(calls)))
            elapsed = time.perf_counter() - start
    finally:
        sandbox.close()
    return calls / elapsed, statistics.median(latencies)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=120)
    parser.add_argument("--callers", default="1,4")
    parser.add_argument("--warm", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    settings = {name: {**values, **({"warm": args.warm} if not values else {})} for name, values in SETTINGS.items()}
    callers_list = [int(c) for c in args.callers.split(",")]
    results = {(name, callers): [] for name in settings for callers in callers_list}
    for round_ in range(args.rounds):
        for callers in callers_list:
            for name, values in settings.items():
                results[name, callers].append(measure(values, args.calls, callers))
        print(f"round {round_ + 1}/{args.rounds} done", flush=True)
    print(f"\n{args.calls} calls of {CODE.strip()!r} per setting and round, median of {args.rounds} rounds; "
          f"W = {args.warm}\n")
    print("| callers | setting | calls/s | median latency | calls/s vs warm 0 |")
    print("|---|---|---|---|---|")
    for callers in callers_list:
        base = statistics.median(r[0] for r in results["warm 0 (before)", callers])
        for name in settings:
            rate = statistics.median(r[0] for r in results[name, callers])
            latency = statistics.median(r[1] for r in results[name, callers])
            print(f"| {callers} | {name.replace('W', str(args.warm))} | {rate:.1f} | {latency * 1e3:.0f} ms | "
                  f"{rate / base:.2f}x |")


if __name__ == "__main__":
    main()
