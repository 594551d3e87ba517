"""Options of the pytest-benchmark suite (bench/test_kernels_benchmark.py): sizes and densities to run.

    pytest bench --benchmark-only --kernel-sizes 1048576 --kernel-densities 0.01 --benchmark-save=base
    pytest bench --benchmark-only --benchmark-compare               # against the last saved run
"""


def pytest_addoption(parser):
    group = parser.getgroup("gtopk_ext kernels")
    group.addoption("--kernel-sizes", default="1048576,16777216",
                    help="comma-separated element counts of the selection, merge and scatter benchmarks")
    group.addoption("--kernel-densities", default="0.001,0.01,0.05", help="comma-separated densities")
    group.addoption("--kernel-rounds", type=int, default=5, help="timed rounds per benchmark (after one warm-up)")


def pytest_generate_tests(metafunc):
    for name, option, kind in (("n", "--kernel-sizes", lambda text: int(float(text))),
                               ("density", "--kernel-densities", float)):
        if name in metafunc.fixturenames:
            metafunc.parametrize(name, [kind(x) for x in metafunc.config.getoption(option).split(",") if x])
