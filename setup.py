"""Only the wheel's tag lives here; everything else is in pyproject.toml.

The wheel carries x86-64 Linux binaries (CO-RE objects, the LD_PRELOAD
shim, the libcuda test double, Debian's libbpf/libelf) but no Python
extension, so it is tagged py3-none-linux_<arch>: one wheel for every
Python >= 3.10 on that platform, never py3-none-any.
"""

from __future__ import annotations

import os
import shutil

from setuptools import Distribution, setup

try:
    from setuptools.command.bdist_wheel import bdist_wheel
except ImportError:  # setuptools < 70.1
    from wheel.bdist_wheel import bdist_wheel  # type: ignore[no-redef]


class BinaryDistribution(Distribution):
    def has_ext_modules(self) -> bool:  # platlib and a platform tag
        return True


class PlatformWheel(bdist_wheel):  # type: ignore[misc, valid-type]
    def get_tag(self) -> tuple[str, str, str]:
        _, _, plat = super().get_tag()
        return "py3", "none", plat

    def run(self) -> None:
        # A stale build/lib.* (a file since deleted from pyctl/) would ship.
        lib = self.get_finalized_command("build").build_lib
        if os.path.basename(lib).startswith("lib"):
            shutil.rmtree(lib, ignore_errors=True)
        super().run()


setup(distclass=BinaryDistribution, cmdclass={"bdist_wheel": PlatformWheel})
