"""``bench.replicas``' CPU readings (the scale-out benchmark's "serving CPU ms / request"):
per-process seconds from ``/proc/<pid>/stat``, the machine's from ``/proc/stat``, and the window
arithmetic of ``CpuSampler``."""

import os
import subprocess
import sys
import time

from bench.replicas import CpuSampler, cpu_seconds, machine_busy_seconds


def test_cpu_seconds_counts_a_process_that_burns_cpu_and_is_zero_once_it_is_gone():
    child = subprocess.Popen([sys.executable, "-c", "import time\nt = time.process_time()\n"
                              "while time.process_time() - t < 0.3: pass\nprint('done', flush=True)\n"
                              "import sys; sys.stdin.read()"], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "done"
        assert cpu_seconds(child.pid) >= 0.3
    finally:
        child.stdin.close()
        child.wait(timeout=10)
    assert cpu_seconds(child.pid) == 0.0


def test_machine_busy_seconds_is_at_most_the_total():
    busy, total = machine_busy_seconds()
    assert 0 < busy <= total


def test_window_averages_the_last_seconds_sampled():
    sampler = CpuSampler([os.getpid()])
    # (monotonic s, machine busy s, pids' s): 4 cores busy and 1 core of pids in the last 2 s
    sampler.samples = [(0.0, 100.0, 10.0), (1.0, 101.0, 10.0), (2.0, 105.0, 11.0), (3.0, 109.0, 12.0)]
    assert sampler.window(2.0) == (4.0, 1.0)
    assert sampler.window(10.0) == (3.0, 0.67)  # longer than sampled: from the first sample


def test_a_sampler_sees_the_cpu_its_process_burns():
    with CpuSampler([os.getpid()], interval_s=0.05) as sampler:
        began = time.process_time()
        while time.process_time() - began < 0.3:
            pass
    assert len(sampler.samples) >= 2
    machine, own = sampler.window(60.0)
    assert own > 0 and machine >= own * 0.9  # the machine's busy cores include this process's
