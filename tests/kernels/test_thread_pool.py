"""cpu_ext.release_thread_pool: once the thread that loaded the model hands back its OpenMP
workers, the engine's thread keeps its own workers spinning between parallel regions instead of
putting them to sleep after each one (libgomp does that while its pools' threads outnumber the
CPUs). Checked in a child process held to two CPUs, by the workers' voluntary context switches."""

import os
import subprocess
import sys
import textwrap

import pytest

CHILD = textwrap.dedent("""
    import os, threading
    os.sched_setaffinity(0, {0, 1})  # before libgomp starts: it counts the CPUs it may use
    import torch
    from hetero_run.kernels import cpu_ext

    x = torch.randn(1 << 20)

    def switches():
        total = 0
        for task in os.listdir("/proc/self/task"):
            with open(f"/proc/self/task/{task}/status") as f:
                total += sum(int(line.split()[1]) for line in f if line.startswith("voluntary_ctxt_switches"))
        return total

    def engine(out):  # parallel regions with a little Python between them, as in a forward
        x.mul(2.0)
        before = switches()
        for _ in range(300):
            x.mul(2.0)
        out.append((switches() - before) / 300)

    x.mul(2.0)  # the main thread's own pool (the model's load)
    per_region = []
    for release in (False, True):
        if release:
            print("released", cpu_ext.release_thread_pool())
        worker = threading.Thread(target=engine, args=(per_region,))
        worker.start()
        worker.join()
    print("switches", *per_region)
""")


@pytest.mark.skipif(not sys.platform.startswith("linux") or len(os.sched_getaffinity(0)) < 2,
                    reason="needs Linux and two CPUs")
def test_released_pool_keeps_the_other_threads_workers_awake():
    env = dict(os.environ, OMP_NUM_THREADS="2")
    done = subprocess.run([sys.executable, "-c", CHILD], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    lines = dict(line.split(" ", 1) for line in done.stdout.splitlines())
    assert lines["released"] == "True"
    before, after = map(float, lines["switches"].split())
    assert before > 0.5, f"two pools on two CPUs: {before} switches a region (expected a sleep and a wake)"
    assert after < 0.1, f"one pool: {after} switches a region"
