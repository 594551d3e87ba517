import os

import torch

# The Triton kernels run on CPU tensors under the interpreter, which must be chosen before triton is imported.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_runtest_logreport(report):
    """With GTOPK_EXT_PRINT_FAILURES=1 (scripts/gpu_check.sh), a failure's traceback is printed when it happens: a
    later crash of the process (a segmentation fault in a kernel) would otherwise take pytest's summary with it."""
    if report.failed and os.environ.get("GTOPK_EXT_PRINT_FAILURES") == "1":
        print(f"\nFAILED {report.nodeid} ({report.when}):\n{report.longreprtext}\n", flush=True)
