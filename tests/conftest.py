import os

import torch

# The Triton kernels run on CPU tensors under the interpreter, which must be chosen before triton is imported.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# pytest-xdist's workers share the cores: each takes its share for torch's intra-op threads (two workers of two
# threads each on two cores spin in OpenMP's barriers: tests/test_ops.py took 22% more CPU). Tests that vary the
# threads set them themselves; the ranks of tests/distributed.py run one thread each.
_workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
if _workers > 1:
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // _workers))


def pytest_runtest_logreport(report):
    """With GTOPK_EXT_PRINT_FAILURES=1 (scripts/gpu_check.sh), a failure's traceback is printed when it happens: a
    later crash of the process (a segmentation fault in a kernel) would otherwise take pytest's summary with it."""
    if report.failed and os.environ.get("GTOPK_EXT_PRINT_FAILURES") == "1":
        print(f"\nFAILED {report.nodeid} ({report.when}):\n{report.longreprtext}\n", flush=True)
