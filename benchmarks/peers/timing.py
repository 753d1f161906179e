"""The timing protocol of ``bench compiled-step``, shared by the PyTorch worker and the GPflow/GPJax scripts (which
import it from their own folder; it needs only numpy): time the first step (the compilation, for compiled steps),
take ``warmup`` more, then step for ``seconds``. Each step is measured in wall-clock time and in CPU time of the
whole process (every thread: TensorFlow and XLA run steps on their own threads); on a machine shared with other jobs
the CPU time is the fairer measure, since wall-clock time also counts the time the process waits for a core."""

import time

import numpy as np


def time_steps(config: str, step, seconds: float, warmup: int, finish=lambda result: None) -> dict:
    """Runs ``step(i)`` for i = 0, 1, ... (``finish`` waits for a step's result where execution is asynchronous) and
    returns the JSON summary: the first step's seconds and the median, 10th and 90th percentile step times (ms)."""
    start_wall, start_cpu = time.perf_counter(), time.process_time()
    finish(step(0))
    first_wall, first_cpu = time.perf_counter() - start_wall, time.process_time() - start_cpu
    for i in range(1, warmup + 1):
        finish(step(i))
    wall, cpu, i = [], [], warmup + 1
    deadline = time.perf_counter() + seconds
    while time.perf_counter() < deadline:
        start_wall, start_cpu = time.perf_counter(), time.process_time()
        finish(step(i))
        wall.append(time.perf_counter() - start_wall)
        cpu.append(time.process_time() - start_cpu)
        i += 1
    wall_ms, cpu_ms = np.array(wall) * 1e3, np.array(cpu) * 1e3
    return {
        "config": config,
        "first_step_s": first_wall,
        "first_step_cpu_s": first_cpu,
        "step_ms": float(np.median(cpu_ms)),
        "step_ms_p10": float(np.percentile(cpu_ms, 10)),
        "step_ms_p90": float(np.percentile(cpu_ms, 90)),
        "step_wall_ms": float(np.median(wall_ms)),
        "steps": len(cpu),
    }
