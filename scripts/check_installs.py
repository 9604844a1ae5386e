"""Check that every install command the README documents resolves against the package registry, and that the two GPU
environments pin one torch and one NCCL.

    python scripts/check_installs.py [--constraint FILE ...]

Each ``pip install ...`` line in the code blocks of the README's "Installation" section is resolved as it stands
(same arguments, from the repository root) by ``uv pip install --dry-run`` for the GPU target: Linux x86_64 with
glibc 2.34, Python 3.11. Nothing is installed and no wheel is downloaded whole: uv reads a wheel's metadata with HTTP
range requests where the index serves no PEP 658 metadata (measured with this registry: ``uv pip compile`` of
sglang==0.5.23 fetched 88 MB in 3 s from an empty cache, where ``pip install --dry-run`` downloaded 1.7 GB in 33 s).
uv stands in for pip as the resolver: the same metadata and version rules, not pip's own code.
transformer-engine-torch is an sdist whose requirements come from constraints/uv-metadata.toml (its setup.py needs
a CUDA torch to run). ``--no-build-isolation`` is dropped: it changes how an sdist builds, not what resolves.

The CPU installs (scripts/setup_env.sh, scripts/install_sglang_cpu.sh) are not checked here: every CI run performs
them for real. ``--constraint`` adds a constraints file to every command (a deliberately conflicting pin shows that
the check fails). Exit status 0: all resolved; 1: a command failed to resolve or the GPU pins disagree.
"""

from __future__ import annotations

import argparse
import re
import shlex
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
SECTION = "## Installation"
GPU_TARGET = ["--python-platform", "x86_64-manylinux_2_34", "--python-version", "3.11"]
UV_CONFIG = ROOT / "constraints" / "uv-metadata.toml"
# The trainer's and the servers' environments must agree on these for the NCCL weight-update group.
GPU_LOCKS = (ROOT / "constraints" / "gpu-trainer.txt", ROOT / "constraints" / "gpu-sglang.txt")
SHARED_RUNTIME = ("torch", "nvidia-nccl-cu13")
# Options that change how pip builds or where it installs, not what resolves.
PIP_ONLY_OPTIONS = {"--no-build-isolation"}


@dataclass(frozen=True)
class InstallCommand:
    line: str  # as the README writes it
    arguments: list[str]  # what follows `pip install`


def documented_installs(readme: str) -> list[InstallCommand]:
    """The ``pip install`` lines inside code blocks of the README's Installation section."""
    start = readme.find(f"\n{SECTION}\n")
    if start < 0:
        raise SystemExit(f"check_installs: {README} has no '{SECTION}' section")
    section = readme[start + 1:]
    next_section = re.search(r"\n## ", section[len(SECTION):])
    if next_section:
        section = section[:len(SECTION) + next_section.start()]
    commands = []
    for block in re.findall(r"```[a-z]*\n(.*?)```", section, flags=re.DOTALL):
        for line in block.splitlines():
            code = line.split(" #", 1)[0].strip()
            words = shlex.split(code) if code else []
            if len(words) >= 2 and Path(words[0]).name == "pip" and words[1] == "install":
                commands.append(InstallCommand(line=code, arguments=words[2:]))
    return commands


def resolve(command: InstallCommand, extra_constraints: list[Path],
            scratch_python: Path) -> subprocess.CompletedProcess:
    arguments = [word for word in command.arguments if word not in PIP_ONLY_OPTIONS]
    for constraint in extra_constraints:
        arguments += ["--constraint", str(constraint)]
    uv = [sys.executable, "-m", "uv", "pip", "install", "--dry-run", "--quiet", "--python", str(scratch_python),
          "--config-file", str(UV_CONFIG), *GPU_TARGET]
    return subprocess.run(uv + arguments, cwd=ROOT, capture_output=True, text=True)


def pins(lock: Path) -> dict[str, str]:
    found = {}
    for line in lock.read_text().splitlines():
        name, separator, version = line.partition("==")
        if separator and not line.startswith("#"):
            found[name.strip().lower()] = version.strip()
    return found


def runtime_disagreements(locks: tuple[Path, Path] = GPU_LOCKS) -> list[str]:
    """Packages of SHARED_RUNTIME pinned differently (or not at all) by the two GPU lock files, each with both pins."""
    first, second = (pins(lock) for lock in locks)
    return [f"{name}: {locks[0].name} pins {first.get(name, 'nothing')}, {locks[1].name} pins "
            f"{second.get(name, 'nothing')}"
            for name in SHARED_RUNTIME if first.get(name) is None or first.get(name) != second.get(name)]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--constraint", action="append", type=Path, default=[],
                        help="an extra constraints file for every command (a control: a conflicting pin must fail)")
    args = parser.parse_args(argv)

    failures = runtime_disagreements()
    for failure in failures:
        print(f"check_installs: trainer and SGLang environments differ: {failure}")
    commands = documented_installs(README.read_text())
    if not commands:
        print(f"check_installs: no `pip install` line in the README's '{SECTION}' code blocks")
        return 1
    with tempfile.TemporaryDirectory(prefix="check_installs_") as scratch:
        # An empty environment to resolve into: a dry run reads what is installed, and the GPU target is not this one.
        subprocess.run([sys.executable, "-m", "uv", "venv", "--quiet", "--python", sys.executable, scratch],
                       check=True)
        scratch_python = Path(scratch) / "bin" / "python"
        with ThreadPoolExecutor(max_workers=len(commands)) as pool:  # each waits on the registry, not the CPU
            results = list(pool.map(lambda command: resolve(command, args.constraint, scratch_python), commands))
        for command, result in zip(commands, results):
            if result.returncode == 0:
                print(f"check_installs: resolves: {command.line}")
            else:
                failures.append(command.line)
                print(f"check_installs: DOES NOT RESOLVE: {command.line}\n{result.stderr.strip()}")
    if failures:
        print(f"check_installs: {len(failures)} problem(s)")
        return 1
    print(f"check_installs: {len(commands)} documented install commands resolve; the GPU environments share "
          f"{', '.join(SHARED_RUNTIME)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
