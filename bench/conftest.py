"""Options of the pytest-benchmark suite (bench/test_kernels_benchmark.py): sizes and densities to run.

    pytest bench --benchmark-only                                  # the default sizes
    pytest bench --benchmark-only --kernel-sizes 1048576 --kernel-densities 0.01 --benchmark-save=base
    pytest bench --benchmark-only --benchmark-compare               # against the last saved run
"""


def pytest_addoption(parser):
    group = parser.getgroup("gtopk_ext kernels")
    group.addoption("--kernel-sizes", default="1048576,16777216",
                    help="comma-separated element counts of the selection, merge and scatter benchmarks")
    group.addoption("--kernel-densities", default="0.001,0.01,0.05", help="comma-separated densities")
    group.addoption("--kernel-rounds", type=int, default=5, help="timed rounds per benchmark (after one warm-up)")


def _floats(text: str) -> list[float]:
    return [float(x) for x in text.split(",") if x]


def pytest_generate_tests(metafunc):
    config = metafunc.config
    if "n" in metafunc.fixturenames:
        metafunc.parametrize("n", [int(x) for x in _floats(config.getoption("--kernel-sizes"))])
    if "density" in metafunc.fixturenames:
        metafunc.parametrize("density", _floats(config.getoption("--kernel-densities")))
