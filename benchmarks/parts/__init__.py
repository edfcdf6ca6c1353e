"""What the benchmark scripts share, and `overhead.py`'s sections: modules, not entry points.

Each script in benchmarks/ is one entry point, documented in docs/performance.md and smoke-tested
in tests/test_benchmarks.py; the pieces here are run through them (`overhead.py <section>`) or
imported by them (the hand-written loops and the framework under test, the rounds' statistics,
gpu_check's one-line readers).
"""
