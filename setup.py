"""setuptools reads setup.cfg; this adds one step to the build: the CPU kernels, compiled in every variant for this
architecture (wsgi_infer/engine/kernels/variants.py), so that no start compiles and any x86-64 CPU loads its best."""

import importlib.util
import sys
from pathlib import Path

from setuptools import Distribution, setup
from setuptools.command.build_py import build_py

VARIANTS = Path(__file__).parent / "wsgi_infer" / "engine" / "kernels" / "variants.py"


def _variants():
    """variants.py, loaded on its own: the package is not installed yet (it imports only the standard library)."""
    spec = importlib.util.spec_from_file_location("wsgi_infer_kernel_variants", VARIANTS)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


class BuildPyWithKernels(build_py):
    def run(self) -> None:
        super().run()
        variants = _variants()
        # An editable install serves the source tree; a wheel, what build_lib holds.
        out = variants.INSTALLED if self.editable_mode else Path(self.build_lib, *variants.INSTALLED.parts[-4:])
        print(f"building the CPU kernels' variants into {out}", file=sys.stderr)
        for message in variants.build_variants(out):
            print(f"warning: {message}", file=sys.stderr)


class NativeLibraries(Distribution):
    def has_ext_modules(self) -> bool:  # a wheel of this machine's platform, not "any"
        return True


setup(cmdclass={"build_py": BuildPyWithKernels}, distclass=NativeLibraries)
