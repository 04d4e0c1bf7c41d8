"""`python -m lucebox clients install --clients codex,claude,...|all`: install pinned clients project-locally.

npm packages go to one prefix (`.clients/npm`, `npm install --prefix`); each
Python client gets its own venv (`.clients/venvs/<name>`) so their
dependencies never meet each other's or Lucebox's. Idempotent: a client whose
pinned version is installed and whose command answers `--version` is skipped.

The npm clients ship their native binary in a platform package that npm
installs as an optional dependency (`@openai/codex-linux-x64`,
`@anthropic-ai/claude-code-linux-x64`, `opencode-linux-x64`); nothing is
downloaded from outside the registry. Claude Code and OpenCode copy that binary
over a placeholder in a postinstall script; when npm did not run the script
(`--ignore-scripts`, or an npm that holds scripts back), `repair_native` links
it in place instead.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import time
from pathlib import Path

from lucebox.clients import ClientError, ClientSpec, clients_dir, parse_names, spec


def log(msg: str) -> None:
    print(f"clients: {msg}", file=sys.stderr, flush=True)


def npm_prefix(root: Path) -> Path:
    return root / "npm"


def venv_dir(root: Path, name: str) -> Path:
    return root / "venvs" / name


def executable(name: str, root: Path | None = None) -> Path:
    """The installed command of a client (ClientError with the install command when missing)."""
    root = root or clients_dir()
    s = spec(name)
    path = (npm_prefix(root) / "node_modules" / ".bin" / s.command if s.kind == "npm"
            else venv_dir(root, name) / "bin" / s.command)
    if not path.exists():
        raise ClientError(f"{name} is not installed in {root} "
                          f"(run: python -m lucebox clients install --clients {name})")
    return path


def installed_version(s: ClientSpec, root: Path) -> str | None:
    """The version on disk, from the package metadata (no process started)."""
    if s.kind == "npm":
        meta = npm_prefix(root) / "node_modules" / s.package / "package.json"
        try:
            return json.loads(meta.read_text())["version"]
        except (OSError, ValueError, KeyError):
            return None
    site = sorted((venv_dir(root, s.name) / "lib").glob("python*/site-packages"))
    if not site:
        return None
    dist = s.package.replace("-", "_").lower()
    for info in site[0].glob("*.dist-info"):
        stem = info.name[: -len(".dist-info")]
        pkg, _, version = stem.rpartition("-")
        if pkg.lower().replace("-", "_") == dist:
            return version
    return None


def answers_version(name: str, root: Path) -> bool:
    try:
        exe = executable(name, root)
    except ClientError:
        return False
    try:
        proc = subprocess.run([str(exe), *spec(name).check], capture_output=True, timeout=120,
                              env={**os.environ, "NO_COLOR": "1"}, stdin=subprocess.DEVNULL)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return proc.returncode == 0


def is_installed(name: str, root: Path | None = None) -> bool:
    root = root or clients_dir()
    s = spec(name)
    return installed_version(s, root) == s.version and answers_version(name, root)


def platform_key() -> str:
    """`linux-x64`, `linux-arm64`, `darwin-arm64`: how the npm platform packages are named."""
    arch = {"x86_64": "x64", "amd64": "x64", "aarch64": "arm64", "arm64": "arm64"}.get(platform.machine().lower())
    osname = {"linux": "linux", "darwin": "darwin"}.get(sys.platform)
    if not arch or not osname:
        raise ClientError(f"no prebuilt client binaries for {sys.platform}/{platform.machine()}")
    return f"{osname}-{arch}"


# client -> (placeholder the launcher runs, the native binary in the platform package, relative to node_modules)
NATIVE = {
    "claude": ("@anthropic-ai/claude-code/bin/claude.exe", "@anthropic-ai/claude-code-{plat}/claude"),
    "opencode": ("opencode-ai/bin/opencode.exe", "opencode-{plat}/bin/opencode"),
}


def repair_native(name: str, root: Path) -> bool:
    """Put the platform package's binary where the launcher expects it; True if something was fixed."""
    if name not in NATIVE:
        return False
    modules = npm_prefix(root) / "node_modules"
    placeholder, native = NATIVE[name]
    src = modules / native.format(plat=platform_key())
    dst = modules / placeholder
    if not src.exists():
        raise ClientError(f"{name}: the platform package {src.relative_to(modules).parts[0]} is missing "
                          f"(was npm run with --omit=optional?)")
    dst.unlink(missing_ok=True)
    try:
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst)
    dst.chmod(0o755)
    return True


def run_logged(cmd: list[str], what: str, log_file: Path, env: dict[str, str] | None = None) -> None:
    """Run an installer, its output to a log file; ClientError with the log's tail on failure."""
    log_file.parent.mkdir(parents=True, exist_ok=True)
    with open(log_file, "ab") as out:
        out.write(("\n$ " + " ".join(cmd) + "\n").encode())
        out.flush()
        proc = subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                              env={**os.environ, **(env or {})})
    if proc.returncode != 0:
        tail = log_file.read_text(errors="replace").splitlines()[-15:]
        raise ClientError(f"{what} failed (exit {proc.returncode}); last lines of {log_file}:\n" + "\n".join(tail))


def install_npm(s: ClientSpec, root: Path) -> None:
    if not shutil.which("npm"):
        raise ClientError("npm is not on PATH (Node.js 20+ with npm is needed for codex, claude, opencode)")
    prefix = npm_prefix(root)
    prefix.mkdir(parents=True, exist_ok=True)
    pkgs = [f"{s.package}@{s.version}", *s.extra]
    run_logged(["npm", "install", "--prefix", str(prefix), "--no-audit", "--no-fund", "--loglevel=warn",
                "--include=optional", *pkgs], f"npm install {' '.join(pkgs)}", root / "logs" / f"{s.name}.log",
               env={"npm_config_update_notifier": "false"})
    if not answers_version(s.name, root) and repair_native(s.name, root):
        log(f"{s.name}: postinstall did not place the native binary; linked it from the platform package")


def install_pypi(s: ClientSpec, root: Path) -> None:
    venv = venv_dir(root, s.name)
    py = venv / "bin" / "python"
    if not py.exists():
        run_logged([sys.executable, "-m", "venv", str(venv)], f"python -m venv {venv}", root / "logs" / f"{s.name}.log")
    pip = [str(py), "-m", "pip", "install", "--disable-pip-version-check", "--no-input", "-q"]
    if s.pre:
        run_logged(pip + list(s.pre), f"pip install {' '.join(s.pre)}", root / "logs" / f"{s.name}.log")
    pkgs = [f"{s.package}=={s.version}", *s.extra]
    run_logged(pip + pkgs, f"pip install {' '.join(pkgs)}", root / "logs" / f"{s.name}.log")


def du(path: Path) -> int:
    total = 0
    seen: set[tuple[int, int]] = set()
    for dirpath, _dirs, files in os.walk(path):
        for f in files:
            try:
                st = os.lstat(os.path.join(dirpath, f))
            except OSError:
                continue
            if (st.st_dev, st.st_ino) not in seen:  # hard links (the native binaries) count once
                seen.add((st.st_dev, st.st_ino))
                total += st.st_size
    return total


def install(names: list[str], root: Path | None = None, force: bool = False) -> dict[str, dict]:
    """Install each client unless it is already there; returns {name: {status, seconds, version}}."""
    root = root or clients_dir()
    root.mkdir(parents=True, exist_ok=True)
    ignore = root / ".gitignore"
    if not ignore.exists():
        ignore.write_text("# installed agent clients (python -m lucebox clients install): never committed\n*\n")
    report: dict[str, dict] = {}
    for i, name in enumerate(names, 1):
        s = spec(name)
        head = f"[{i}/{len(names)}] {name} ({s.kind} {s.package}=={s.version})"
        if not force and is_installed(name, root):
            log(f"{head}: already installed")
            report[name] = {"status": "present", "seconds": 0.0, "version": s.version}
            continue
        log(f"{head}: installing{' — ' + s.note if s.note else ''} ...")
        t0 = time.monotonic()
        (install_npm if s.kind == "npm" else install_pypi)(s, root)
        secs = time.monotonic() - t0
        if not answers_version(name, root):
            raise ClientError(f"{name}: installed, but `{executable(name, root)} {' '.join(s.check)}` fails "
                              f"(see {root / 'logs' / (name + '.log')})")
        log(f"{head}: done in {secs:.0f}s")
        report[name] = {"status": "installed", "seconds": round(secs, 1), "version": s.version}
    return report


def main(args: argparse.Namespace) -> int:
    root = Path(args.dir).resolve() if getattr(args, "dir", None) else clients_dir()
    names = parse_names(args.clients)
    report = install(names, root, force=getattr(args, "force", False))
    for name in names:
        where = npm_prefix(root) if spec(name).kind == "npm" else venv_dir(root, name)
        print(f"{name:10} {report[name]['status']:9} {report[name]['seconds']:7.1f}s  {where}")
    if any(spec(n).kind == "npm" for n in names):
        print(f"{'(npm)':10} {'':9} {du(npm_prefix(root)) / 2**20:7.0f} MiB in {npm_prefix(root)}")
    for name in names:
        if spec(name).kind == "pypi":
            print(f"{'(' + name + ')':10} {'':9} {du(venv_dir(root, name)) / 2**20:7.0f} MiB in {venv_dir(root, name)}")
    return 0
