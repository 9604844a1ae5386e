"""dapo-megatron: DAPO reinforcement-learning post-training on megatron-core with SGLang rollouts."""

from setuptools import find_packages, setup

# Versions measured to work together (CPU build of torch here; `pip install torch==2.13.0` on a GPU machine
# takes the CUDA build of the same release). NVIDIA apex is optional: megatron-core uses it when you build it from
# source; PyPI's "apex" is an unrelated web package and must never be installed for this project.
CORE = [
    "torch==2.13.0",
    "megatron-core==0.16.1",
    "transformers==5.24.0",
    "tokenizers==0.23.3",
    "datasets==5.2.0",
    "pyarrow==26.0.1",
    "safetensors==0.8.0",
    "tensorboard==2.21.0",
    "pyyaml==6.0.4",
    "psutil==7.2.2",  # megatron dist_checkpointing needs it at load time
    "tqdm==4.70.1",
    "matplotlib==3.11.2",  # `dapo-megatron plot`
    "requests",
]

setup(
    name="dapo-megatron",
    version="0.1.0",
    description="DAPO (Decoupled Clip and Dynamic sAmpling Policy Optimization) on megatron-core + SGLang",
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    python_requires=">=3.11",
    packages=find_packages(include=["dapo_megatron", "dapo_megatron.*", "checkpoint_tools", "checkpoint_tools.*"]),
    package_data={"dapo_megatron": ["data/fixtures/*", "cpu/sglang/**/*"]},
    include_package_data=True,
    install_requires=CORE,
    extras_require={
        # GPU kernels (BF16/FP8 through Transformer Engine); needs CUDA and a matching torch.
        "gpu": ["transformer-engine[pytorch]==2.20.2"],
        # The production rollout engine. On CPU machines use scripts/install_sglang_cpu.sh instead.
        "sglang": ["sglang==0.5.23"],
        "math-verify": ["math-verify==0.9.0"],
        # trainer.loggers: wandb / mlflow. MLflow is its client, mlflow-skinny (the full package pins pyarrow<26),
        # with what its default local store (a SQLite file in the run directory) needs.
        "wandb": ["wandb==0.31.0"],
        "mlflow": ["mlflow-skinny==3.17.2", "sqlalchemy==2.1.9", "alembic==1.20.1"],
        "dev": ["pytest==9.2.0", "math-verify==0.9.0"],
    },
    entry_points={"console_scripts": ["dapo-megatron=dapo_megatron.cli:main"]},
)
