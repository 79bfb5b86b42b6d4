"""Package discovery (metadata: pyproject.toml). Every package under pagedlab/ is found; the Triton kernels of the
top-level kernels/ folder install as `pagedlab.kernels`: a top-level module named `kernels` would shadow the
Hugging Face package of that name, which transformers probes for. pyproject.toml cannot say both."""

from setuptools import find_namespace_packages, setup

setup(packages=[*find_namespace_packages(include=["pagedlab", "pagedlab.*"]), "pagedlab.kernels"],
      package_dir={"pagedlab.kernels": "kernels"})
