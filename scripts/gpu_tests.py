"""The GPU test suites in parallel groups, each under its own time limit, on one CUDA machine.

    python3 scripts/gpu_tests.py [--budget 300] [--workers 4] [--groups conv1d,norm] [--out DIR]

The GPU tests are compile-bound (each kernel variant compiles on first use), so a whole suite
does not fit a short time limit: each group runs as `pytest -v -m gpu -n WORKERS` with the time
limit `--budget` seconds, stopped by SIGINT at its limit (pytest then still reports what ran).
Every group writes DIR/<group>.txt (and DIR/<group>-failures.txt: each failure's traceback
as it happens, so a run killed before pytest's final report still says why); the summary
lists per group the tests passed, failed, errored and skipped, the failures by name, and how
many of the group's tests did not run, so a run cut by its limit reads as incomplete, never
as a pass. Groups past their limit are interrupted together and get GRACE_S seconds for
pytest's report, so a caller's own limit should leave budget + GRACE_S + about 20 s (the
summary collects each group's tests). Exit status 1 if any test failed.
The groups share the GPU, so run no timing beside them, and keep the workers of all groups
run at once far below 15: 15 at once on one H100 (2026-12-06) failed 32 tests, and the 13 of
them run again in three processes all passed
(benchmarks/results/2026-12-06-h100-gpu-tests-suites-contention-reruns.txt); beside 28
compile-only sweep processes (each holding its problem on the GPU) 26 of 77 tests that ran
failed with out-of-memory errors (2026-12-06): nothing of that size beside them either.
"""
import argparse
import os
import re
import signal
import subprocess
import sys
import time

#: group name -> pytest arguments (paths or node ids)
GROUPS = {
    "forward": ["tests/ssd/test_forward_gpu.py", "tests/ssd/test_varlen.py"],
    "backward": ["tests/ssd/test_backward_gpu.py", "tests/ssd/test_autograd.py"],
    "bad-input": ["tests/ssd/test_bad_input.py"],
    "long": ["tests/ssd/test_long_sequence_gpu.py"],
    "decode": ["tests/decode"],
    "conv1d": ["tests/conv1d"],
    "norm": ["tests/norm"],
    "layer": ["tests/layer"],
    "integrations": ["tests/integrations"],
    "distributed": ["tests/distributed"],
}


#: seconds a group's pytest gets after SIGINT to write its report (all groups at once)
GRACE_S = 30


def collect_count(args) -> int:
    """How many GPU tests the group holds (pytest --collect-only)."""
    res = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-m", "gpu",
                          *args], capture_output=True, text=True)
    m = re.search(r"(\d+)(?:/\d+)? tests? collected", res.stdout)
    return int(m.group(1)) if m else 0


def summarize(log: str):
    """(passed, failed, errors, failed names) from a `pytest -v` log."""
    passed = len(re.findall(r" PASSED ", log))
    failed = sorted(set(re.findall(r"FAILED (\S+)", log)))
    errors = sorted(set(re.findall(r"ERROR (\S+)", log)))
    return passed, len(failed), len(errors), failed + errors


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--budget", type=int, default=300, help="seconds per group")
    ap.add_argument("--workers", type=int, default=4, help="pytest-xdist workers per group")
    ap.add_argument("--groups", default=",".join(GROUPS), help="comma list of " +
                    ", ".join(GROUPS))
    ap.add_argument("--out", default=os.environ.get("OUT", "gpu-test-logs"))
    ap.add_argument("-k", default=None, help="pytest -k expression for every group")
    args = ap.parse_args(argv)
    names = [g for g in args.groups.split(",") if g]
    unknown = [g for g in names if g not in GROUPS]
    if unknown:
        ap.error(f"--groups: unknown {unknown}; choose from {list(GROUPS)}")
    os.makedirs(args.out, exist_ok=True)
    procs = {}
    for name in names:
        cmd = [sys.executable, "-m", "pytest", "-v", "-rfEs", "-m", "gpu", "-p", "no:cacheprovider",
               "-n", str(args.workers), "--dist", "loadgroup", *GROUPS[name]] + (["-k", args.k] if args.k else [])
        log = open(os.path.join(args.out, f"{name}.txt"), "w")
        # every failure's traceback as it happens (tests/conftest.py): kept if the run is cut
        env = {**os.environ, "MAMBA2_TEST_FAILLOG": os.path.join(args.out, f"{name}-failures.txt")}
        procs[name] = (subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env,
                                        start_new_session=True), log, time.time())
    interrupted = {}                                   # name -> when SIGINT went out
    while procs:
        for name, (proc, log, start) in list(procs.items()):
            if proc.poll() is not None:
                log.close()
                del procs[name]
                print(f"{name}: ended after {time.time() - start:.0f} s", flush=True)
            elif name not in interrupted and time.time() - start > args.budget:
                os.killpg(proc.pid, signal.SIGINT)      # pytest reports what ran
                interrupted[name] = time.time()
            elif name in interrupted and time.time() - interrupted[name] > GRACE_S:
                os.killpg(proc.pid, signal.SIGKILL)     # no report: its log holds what ran
                proc.wait()
                log.close()
                del procs[name]
                print(f"{name}: killed {GRACE_S} s after its interrupt", flush=True)
        time.sleep(1)
    any_failed = False
    print(f"{'group':<14} {'tests':>6} {'passed':>7} {'failed':>7} {'errors':>7} {'skipped':>8} "
          f"{'not run':>8}")
    for name in names:
        with open(os.path.join(args.out, f"{name}.txt")) as f:
            log = f.read()
        total = collect_count(GROUPS[name] + (["-k", args.k] if args.k else []))
        passed, failed, errors, which = summarize(log)
        any_failed |= bool(failed or errors)
        skipped = len(re.findall(r" SKIPPED ", log))
        print(f"{name:<14} {total:>6} {passed:>7} {failed:>7} {errors:>7} {skipped:>8} "
              f"{max(0, total - passed - failed - errors - skipped):>8}")
        for w in which:
            print(f"    {w}")
    return 1 if any_failed else 0


if __name__ == "__main__":
    sys.exit(main())
