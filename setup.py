"""Builds gtopk_ext._C: the C++ CPU kernels always, the CUDA kernels when a CUDA toolkit and a CUDA build of
torch are present (no GPU is needed to compile them). The package's metadata is in pyproject.toml.

Environment (CMakeLists.txt reads the same):
  GTOPK_EXT_CUDA         auto (default) | 1 (require the CUDA kernels) | 0 (skip them: quick CPU-only builds)
  TORCH_CUDA_ARCH_LIST   GPU architectures to compile for (default here: "8.0;9.0+PTX")
  CUDA_HOME              the toolkit root (holding bin/nvcc and include/cuda_runtime.h); found if unset
"""

import glob
import os

from setuptools import setup

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


def build_cuda() -> bool:
    if "GTOPK_EXT_BUILD_CUDA" in os.environ:
        raise SystemExit("GTOPK_EXT_BUILD_CUDA is now GTOPK_EXT_CUDA (auto, 0 or 1), as in CMakeLists.txt")
    choice = os.environ.get("GTOPK_EXT_CUDA", "auto").lower()
    if choice not in ("auto", "0", "1"):
        raise SystemExit(f"GTOPK_EXT_CUDA must be auto, 0 or 1, got {choice!r}")
    available = torch.version.cuda is not None and CUDA_HOME is not None and is_toolkit_root(CUDA_HOME)
    if choice == "1" and not available:
        raise SystemExit(
            "GTOPK_EXT_CUDA=1 but no CUDA toolkit was found (set CUDA_HOME to the folder holding "
            f"bin/nvcc and include/cuda_runtime.h; found {CUDA_HOME!r}) or torch is a CPU build "
            f"(torch.version.cuda={torch.version.cuda!r})"
        )
    return available if choice == "auto" else choice == "1"


def extensions():
    sources = ["csrc/ops.cpp", *sorted(glob.glob("csrc/cpu/*.cpp"))]
    # torch's C++ ABI, whatever the compiler's default: every failing TORCH_CHECK hands torch a std::string, and
    # one of the other ABI crashes the process (torch.utils.cpp_extension passes no such flag, torch 2.11 to 2.14).
    abi = f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}"
    cxx_flags = ["-O3", "-fopenmp", "-ffp-contract=off", abi]  # no FMA contraction: same sums on every CPU
    if not build_cuda():
        print("gtopk_ext: building the CPU kernels only")
        return [CppExtension("gtopk_ext._C", sources, extra_compile_args={"cxx": cxx_flags},
                             extra_link_args=["-fopenmp"])]
    os.environ.setdefault("TORCH_CUDA_ARCH_LIST", "8.0;9.0+PTX")
    print(f"gtopk_ext: building the CPU and CUDA kernels for {os.environ['TORCH_CUDA_ARCH_LIST']}")
    nvcc_flags = ["-O3", "--expt-relaxed-constexpr", abi, f"-I{os.path.join(CUDA_HOME, 'include', 'cccl')}"]
    return [CUDAExtension("gtopk_ext._C", sources + sorted(glob.glob("csrc/cuda/*.cu")),
                          extra_compile_args={"cxx": cxx_flags, "nvcc": nvcc_flags},
                          extra_link_args=["-fopenmp"])]


setup(ext_modules=extensions(), cmdclass={"build_ext": BuildExtension})
