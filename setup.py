"""The packaged C++ kernel, opt-in: URPE_BUILD_KERNEL=1 (what `make wheel` sets).

Without it this adds nothing: a pure-Python wheel, or the editable install of `make setup`,
whose kernel is compiled on first use. With it, the wheel's build step compiles the kernel with
portable flags (no -march=native) against the torch of the building environment, which must
therefore be the environment itself: `pip wheel --no-build-isolation` (an isolated build would
fetch another torch). The wheel is then tagged for this Python and platform, and urpe loads
its kernel where the same torch runs (`urpe.kernels.cpp.packaged`). The platform is
manylinux_2_<N>_<machine> where the compiled library allows it (it needs glibc 2.N at most, and
from other libraries only what torch's own need: `packaged.wheel_platform`), else this build's
linux_<machine>; the line that says the kernel was packaged says which and why.
"""

import os
import shutil
import sys
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py
from setuptools.dist import Distribution

try:
    from setuptools.command.bdist_wheel import bdist_wheel
except ImportError:  # setuptools < 70.1
    from wheel.bdist_wheel import bdist_wheel

OPT_IN = "URPE_BUILD_KERNEL"
WITH_KERNEL = os.environ.get(OPT_IN, "").strip() == "1"
PACKAGED: list[Path] = []  # the library this build compiled


class BuildWithKernel(build_py):
    def run(self):
        super().run()
        kernel = Path(self.build_lib) / "urpe" / "kernels" / "cpp"
        shutil.rmtree(kernel / "packaged", ignore_errors=True)  # none left from an earlier build
        if WITH_KERNEL and not self.editable_mode:
            # The copy in build_lib: its sources are the ones packaged beside the library.
            sys.path.insert(0, self.build_lib)
            try:
                from urpe.kernels.cpp.build import build_for_wheel

                library = build_for_wheel(kernel)
            finally:
                sys.path.remove(self.build_lib)
            PACKAGED.append(library)
            print(f"urpe: packaged the C++ kernel {library}", file=sys.stderr)


class TaggedWheel(bdist_wheel):
    """The platform tag the packaged library allows (`packaged.wheel_platform`)."""

    def get_tag(self):
        python, abi, default = super().get_tag()
        if not PACKAGED:
            return python, abi, default
        if not hasattr(self, "_urpe_platform"):  # asked more than once per build
            # urpe as build_py imported it from the build folder (still in sys.modules)
            from urpe.kernels.cpp.packaged import wheel_platform

            self._urpe_platform, why = wheel_platform(PACKAGED[-1], default)
            print(
                f"urpe: the wheel's platform tag is {self._urpe_platform} ({why})", file=sys.stderr
            )
        return python, abi, self._urpe_platform


class PlatformWheel(Distribution):
    """A wheel with a compiled library is a platform wheel (cp3XX-cp3XX-<platform>)."""

    def has_ext_modules(self):
        return WITH_KERNEL


setup(cmdclass={"build_py": BuildWithKernel, "bdist_wheel": TaggedWheel}, distclass=PlatformWheel)
