"""Builds gtopk_ext._C, as PyTorch extensions do: the C++ CPU kernels always; the CUDA kernels (csrc/cuda/*.cu,
several minutes) when torch sees a GPU, or when asked (no GPU is needed to compile them). The package's metadata is
in pyproject.toml; its packages are found here (every package under gtopk_ext/, and triton_kernels/).

Environment (CMakeLists.txt reads the same):
  GTOPK_EXT_CUDA         auto (default: when torch sees a GPU and a CUDA toolkit is found) | 1 (require the CUDA
                         kernels: compiles them with no GPU, as CI does) | 0 (skip them)
  FORCE_CUDA             1: the same as GTOPK_EXT_CUDA=1 (the convention of PyTorch extensions)
  TORCH_CUDA_ARCH_LIST   GPU architectures to compile for (default here: "8.0;9.0+PTX")
  CUDA_HOME              the toolkit root (holding bin/nvcc and include/cuda_runtime.h); found if unset
  MAX_JOBS               compilers run at once (torch's)

The build prints, first, what it compiles and how to skip or force the CUDA kernels, then each source as it is
compiled, and a line at least every 20 s (pip shows a build's output with -v: `pip install -v ...`).
"""

import glob
import os
import threading
import time

from setuptools import find_packages, setup

TOOLKIT_CANDIDATES = ["/usr/local/cuda", "/opt/cuda", *sorted(glob.glob("/usr/local/cuda-*"), reverse=True)]


def is_toolkit_root(path: str) -> bool:
    return os.path.isfile(os.path.join(path, "bin", "nvcc")) and os.path.isfile(
        os.path.join(path, "include", "cuda_runtime.h")
    )


def locate_cuda_home() -> None:
    # torch guesses CUDA_HOME from the nvcc on PATH, which is wrong when that nvcc is a wrapper script;
    # it reads the variable at import, so it must be set before torch.utils.cpp_extension is imported.
    if os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH"):
        return
    for candidate in TOOLKIT_CANDIDATES:
        if is_toolkit_root(candidate):
            os.environ["CUDA_HOME"] = candidate
            return


locate_cuda_home()

import torch  # noqa: E402
from torch.utils.cpp_extension import CUDA_HOME, BuildExtension, CppExtension, CUDAExtension  # noqa: E402


def cuda_choice(environ) -> tuple[bool, str]:
    """Whether to build the CUDA kernels under the environment ``environ``, and why."""
    if "GTOPK_EXT_BUILD_CUDA" in environ:
        raise SystemExit("GTOPK_EXT_BUILD_CUDA is now GTOPK_EXT_CUDA (auto, 0 or 1), as in CMakeLists.txt")
    choice = environ.get("GTOPK_EXT_CUDA", "auto").lower()
    if choice not in ("auto", "0", "1"):
        raise SystemExit(f"GTOPK_EXT_CUDA must be auto, 0 or 1, got {choice!r}")
    force = environ.get("FORCE_CUDA", "0")
    if force not in ("0", "1"):
        raise SystemExit(f"FORCE_CUDA must be 0 or 1, got {force!r}")
    if force == "1" and choice == "0":
        raise SystemExit("FORCE_CUDA=1 asks for the CUDA kernels and GTOPK_EXT_CUDA=0 skips them: unset one")
    toolkit = torch.version.cuda is not None and CUDA_HOME is not None and is_toolkit_root(CUDA_HOME)
    if choice == "1" or force == "1":
        if not toolkit:
            raise SystemExit(
                "GTOPK_EXT_CUDA=1 (or FORCE_CUDA=1) but no CUDA toolkit was found (set CUDA_HOME to the folder "
                f"holding bin/nvcc and include/cuda_runtime.h; found {CUDA_HOME!r}) or torch is a CPU build "
                f"(torch.version.cuda={torch.version.cuda!r})"
            )
        return True, "asked for by " + ("FORCE_CUDA=1" if force == "1" else "GTOPK_EXT_CUDA=1")
    if choice == "0":
        return False, "GTOPK_EXT_CUDA=0"
    if not torch.cuda.is_available():
        return False, "torch sees no GPU"
    if not toolkit:
        return False, f"torch sees a GPU, but no CUDA toolkit was found (set CUDA_HOME; found {CUDA_HOME!r})"
    return True, "torch sees a GPU"


def sources(cuda: bool) -> list[str]:
    cuda_sources = sorted(glob.glob("csrc/cuda/*.cu")) if cuda else []
    return ["csrc/ops.cpp", *sorted(glob.glob("csrc/cpu/*.cpp")), *cuda_sources]


CUDA, WHY = cuda_choice(os.environ)
SOURCES = sources(CUDA)


def extensions():
    # torch's C++ ABI, whatever the compiler's default: every failing TORCH_CHECK hands torch a std::string, and
    # one of the other ABI crashes the process (torch.utils.cpp_extension passes no such flag, torch 2.11 to 2.14).
    abi = f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}"
    cxx_flags = ["-O3", "-fopenmp", "-ffp-contract=off", abi]  # no FMA contraction: same sums on every CPU
    if not CUDA:
        return [CppExtension("gtopk_ext._C", SOURCES, extra_compile_args={"cxx": cxx_flags},
                             extra_link_args=["-fopenmp"])]
    os.environ.setdefault("TORCH_CUDA_ARCH_LIST", "8.0;9.0+PTX")
    nvcc_flags = ["-O3", "--expt-relaxed-constexpr", abi, f"-I{os.path.join(CUDA_HOME, 'include', 'cccl')}"]
    return [CUDAExtension("gtopk_ext._C", SOURCES, extra_compile_args={"cxx": cxx_flags, "nvcc": nvcc_flags},
                          extra_link_args=["-fopenmp"])]


def plan(sources: list[str], why: str) -> str:
    """The build's first line: what it compiles, why, and how to change that."""
    cuda = sum(source.endswith(".cu") for source in sources)
    if cuda:
        return (f"gtopk_ext: compiling {len(sources) - cuda} C++ and {cuda} CUDA sources for "
                f"{os.environ.get('TORCH_CUDA_ARCH_LIST', '8.0;9.0+PTX')} ({why}); the CUDA kernels take several "
                "minutes, GTOPK_EXT_CUDA=0 skips them")
    return (f"gtopk_ext: compiling {len(sources)} C++ sources, the CPU kernels only ({why}); FORCE_CUDA=1 (or "
            "GTOPK_EXT_CUDA=1) compiles the CUDA kernels too, with no GPU (several minutes more)")


class Progress(threading.Thread):
    """Prints each source whose object file the compilers have written, and a line every ``quiet`` seconds when
    none was: one CUDA source takes minutes. (pip hides a build's output unless run with -v.)"""

    def __init__(self, build_temp: str, sources: list[str], quiet: float = 20.0):
        super().__init__(daemon=True)
        self.quiet, self.began, self.done = quiet, time.time(), threading.Event()
        self.objects = {os.path.join(build_temp, os.path.splitext(source)[0] + ".o"): source for source in sources}

    def run(self):
        reported, last = set(), self.began
        while not self.done.wait(1.0):
            now = time.time()
            for obj, source in self.objects.items():
                if obj not in reported and os.path.exists(obj) and os.path.getmtime(obj) >= self.began:
                    reported.add(obj)
                    last = now
                    print(f"gtopk_ext: compiled {source} ({len(reported)} of {len(self.objects)}, "
                          f"{now - self.began:.0f} s)", flush=True)
            if now - last >= self.quiet:
                last = now
                print(f"gtopk_ext: still compiling ({len(reported)} of {len(self.objects)} sources done, "
                      f"{now - self.began:.0f} s)", flush=True)


class BuildWithProgress(BuildExtension):
    def build_extensions(self):
        print(plan(SOURCES, WHY), flush=True)
        progress = Progress(self.build_temp, SOURCES)
        progress.start()
        try:
            super().build_extensions()
        finally:
            progress.done.set()
            progress.join()
        print(f"gtopk_ext: built in {time.time() - progress.began:.0f} s", flush=True)


setup(
    # Every package under gtopk_ext/, found (a package left off a hand-written list is missing from the wheel
    # only); triton_kernels/, a top-level folder, installs as gtopk_ext.triton_kernels.
    packages=[*find_packages(include=["gtopk_ext", "gtopk_ext.*"], exclude=["gtopk_ext.triton_kernels"]),
              "gtopk_ext.triton_kernels"],
    package_dir={"gtopk_ext.triton_kernels": "triton_kernels"},
    ext_modules=extensions(),
    cmdclass={"build_ext": BuildWithProgress},
)
