"""`make bench` (`python -m benchmarks`) and the single benchmarks (`python -m benchmarks.bench_ops`, ...).

On a machine without a GPU, torch.profiler's Kineto backend (the ATen op counts) printed "ERROR: gpuGetDeviceCount
failed with code 35" and two "USDT: profiler_start/stop" lines on every run, none of which says anything about the
CPU benchmarks; its log level is raised there unless KINETO_LOG_LEVEL is set.
"""

import os

import torch

KINETO_QUIET = "6"
"""Kineto's log level above its errors and USDT markers (lower levels print them)."""

if not torch.cuda.is_available():
    os.environ.setdefault("KINETO_LOG_LEVEL", KINETO_QUIET)
