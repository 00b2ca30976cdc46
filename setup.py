"""megatron-envpipe: energy-saving pipeline-parallel training for Megatron-core."""

from pathlib import Path

from setuptools import find_packages, setup

ROOT = Path(__file__).parent

setup(
    name="megatron-envpipe",
    version="0.1.0",
    description="EnvPipe schedules and per-unit GPU clock plans for Megatron-core pipeline parallelism",
    long_description=(ROOT / "README.md").read_text() if (ROOT / "README.md").exists() else "",
    long_description_content_type="text/markdown",
    license="Apache-2.0",
    python_requires=">=3.11",
    # configs/ and data/ live at the repo root and ship inside the package.
    packages=find_packages(include=["megatron_envpipe", "megatron_envpipe.*"])
    + ["megatron_envpipe.configs", "megatron_envpipe.data"],
    package_dir={
        "megatron_envpipe": "megatron_envpipe",
        "megatron_envpipe.configs": "configs",
        "megatron_envpipe.data": "data",
    },
    package_data={
        "megatron_envpipe.configs": ["*.toml"],
        "megatron_envpipe.data": ["profiles/*.md", "profiles/*/*.csv", "corpus/*.txt", "corpus/*.md"],
    },
    # The planning core is pure Python: no runtime dependency at all.
    install_requires=[],
    extras_require={
        "plot": ["matplotlib>=3.7"],
        # torch is pinned by the caller (CPU build in CI); any >=2.6 works.
        "megatron": ["torch>=2.6", "megatron-core>=0.16", "sentencepiece>=0.2"],
        # `-m megatron_envpipe.megatron.pretrain_gpt --megatron-lm DIR`: what a Megatron-LM checkout imports beyond
        # megatron-core (its own `mlm` extra: tokenizers, wandb; triton, which CPU builds of torch lack).
        "megatron-lm": ["torch>=2.6", "megatron-core[mlm]>=0.16", "sentencepiece>=0.2", "triton; sys_platform == 'linux'"],
        "gpu": ["nvidia-ml-py>=12"],
        # --type optimal: the time-cost LP (HiGHS; scipy's linprog is the fallback).
        "optimal": ["numpy", "highspy>=1.7"],
        "test": ["pytest>=7", "matplotlib>=3.7", "numpy", "highspy>=1.7", "scipy", "ruff>=0.6", "nvidia-ml-py>=12"],
        # bench/planner_vs_lowtime.py: Perseus's planner (pulls networkx, scikit-learn, scipy).
        "bench": ["lowtime==0.3.0"],
    },
    entry_points={"console_scripts": ["envpipe=megatron_envpipe.apps.cli:main"]},
    classifiers=[
        "Programming Language :: Python :: 3",
        "License :: OSI Approved :: Apache Software License",
        "Topic :: Scientific/Engineering :: Artificial Intelligence",
    ],
)
