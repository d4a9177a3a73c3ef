"""Check that the PyPI half of the image's pins resolves together, without building anything.

The pins come from one place, ``docker/Dockerfile``: the defaults of its build arguments, the
requirements its ``pip install`` steps name (with those defaults substituted), the ``-r`` files they
install (``docker/requirements-*.txt``), the dependencies of this package (``pip install
/opt/verl-ds4`` installs ``pyproject.toml``'s), and the constraints file the build writes. Git-sourced
packages (Megatron-LM, Megatron-Bridge and the kernels built from a commit) are left out: they are
installed with ``--no-deps`` and their run-time needs are ``requirements-runtime.txt``.

pip's resolver then runs in dry-run mode for the image's platform: CPython 3.12 on x86_64 Linux
(Ubuntu 24.04, glibc 2.39, so ``manylinux_2_17`` ... ``manylinux_2_39``), wheels only. It fetches
package metadata, not wheels: from the index where it serves a wheel's metadata on its own
(PEP 658), otherwise by HTTP range requests into the wheel (pip's ``fast-deps``). Packages the image
builds from an sdist (flash-attn, TransformerEngine's PyTorch extension) cannot take part in a
wheels-only resolve; they are checked to exist on PyPI at the pinned version instead. Pure-Python
dependencies that PyPI has as an sdist only, at the versions the pins need (antlr4-python3-runtime
4.9.*, which hydra-core 1.3.x and omegaconf 2.3.x require), are built into a wheel from their PyPI
sdist first, as pip does in the image, and handed to the resolve through ``--find-links``; the
resolve still takes every other package from PyPI.

The check is independent of the machine's pip configuration: no config file is read
(``PIP_CONFIG_FILE`` is the null device, which makes pip skip global, user and site files), pip runs
``--isolated`` (no ``PIP_*`` variables: no local find-links, no constraints file, no extra index),
and the index is ``https://pypi.org/simple``. Only a CA bundle named by ``PIP_CERT`` is kept.

pip evaluates environment markers (``python_version >= "3.12"``) against the interpreter that runs it,
whatever ``--python-version`` says; when that interpreter is not 3.12, pip is started through a
launcher that makes the marker environment the target's.

    python docker/check_pins_resolve.py            # exit 0: resolvable; 1: not (the conflict is printed)
    python docker/check_pins_resolve.py --print    # the requirement list only
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DOCKERFILE = REPO / "docker" / "Dockerfile"
INDEX_URL = "https://pypi.org/simple"
# Where PyPI serves files from; every package of a resolve must come from here.
PYPI_FILE_HOSTS = ("https://files.pythonhosted.org/", "https://pypi.org/")

TARGET_PYTHON = "3.12"
# The marker environment of the image's interpreter (Ubuntu 24.04's python3.12 is 3.12.3).
TARGET_MARKERS = {
    "python_version": "3.12",
    "python_full_version": "3.12.3",
    "implementation_name": "cpython",
    "implementation_version": "3.12.3",
    "platform_python_implementation": "CPython",
    "platform_machine": "x86_64",
    "platform_system": "Linux",
    "sys_platform": "linux",
    "os_name": "posix",
}
# glibc 2.39 (Ubuntu 24.04) runs every manylinux wheel up to manylinux_2_39; pip does not expand a
# manylinux_2_X platform to the older ones by itself, so all are named.
PLATFORMS = [f"manylinux_2_{minor}_x86_64" for minor in range(39, 16, -1)] + [
    "manylinux2014_x86_64", "manylinux2010_x86_64", "manylinux1_x86_64"]

# Built from an sdist in the image (no wheel on PyPI for this stack): checked to exist instead.
SDIST_ONLY = {
    "flash-attn": "PyPI has the sdist only; the image compiles it against the pinned torch",
}
# Extras whose packages are sdist-only: (distribution, extra) -> the sdist-only distribution at the
# same version. transformer-engine[pytorch] pulls transformer-engine-torch, which the image builds.
SDIST_ONLY_EXTRAS = {
    ("transformer-engine", "pytorch"): "transformer-engine-torch",
}
# Pure-Python dependencies (not pins of the image) whose needed versions PyPI has as an sdist only.
# pip builds them in the image (a pure-Python wheel); for the resolve they are built here from the
# same PyPI sdist, so that the resolver sees their real metadata. requirement -> why it is needed.
SDIST_ONLY_DEPS = {
    # Every hydra-core 1.3 release (verl, TransferQueue, Megatron-Bridge need hydra-core) and
    # omegaconf 2.3.x require antlr4-python3-runtime==4.9.*; PyPI has wheels only from 4.11.0 on.
    # Without it pip reports a misleading "Cannot install hydra-core==1.3.1 and hydra-core==1.3.2".
    "antlr4-python3-runtime==4.9.*": "hydra-core 1.3.x and omegaconf 2.3.x require ==4.9.*, PyPI has no 4.9 wheel",
}

# pip started with the target's marker environment (see the module docstring).
_LAUNCHER = """\
import json, sys
from pip._vendor.packaging import markers
_target = json.loads(sys.argv.pop(1))
_default = markers.default_environment
markers.default_environment = lambda: {**_default(), **_target}
from pip._internal.cli.main import main
sys.exit(main())
"""


def _canon(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


@dataclass
class PinSet:
    requirements: list[str] = field(default_factory=list)   # for the wheels-only resolve
    constraints: list[str] = field(default_factory=list)    # the image's PIP_CONSTRAINT lines
    sdist_only: list[tuple[str, str]] = field(default_factory=list)  # (name, version)
    git: list[str] = field(default_factory=list)            # names installed from a git commit
    sources: dict[str, str] = field(default_factory=dict)   # requirement -> where it came from


def dockerfile_args(dockerfile: Path = DOCKERFILE) -> dict[str, str]:
    """The defaults of the build arguments declared before FROM (pins and build settings)."""
    args = {}
    for line in dockerfile.read_text().splitlines():
        if line.startswith("FROM "):
            break
        m = re.match(r"ARG\s+([A-Z0-9_]+)=(.*)$", line.strip())
        if m:
            args[m.group(1)] = m.group(2).strip().strip('"')
    return args


def _run_instructions(dockerfile: Path) -> list[str]:
    """Each RUN instruction as one line (continuations joined, comments dropped)."""
    runs, current = [], None
    for raw in dockerfile.read_text().splitlines():
        line = raw.strip()
        if current is None:
            if not line.startswith("RUN "):
                continue
            current, line = "", line[4:]
        elif line.startswith("#"):
            continue
        if line.endswith("\\"):
            current += line[:-1] + " "
        else:
            runs.append(current + line)
            current = None
    return runs


def _copy_map(dockerfile: Path) -> dict[str, Path]:
    """Image path -> repository path for the COPY instructions (file or directory destinations)."""
    mapping = {}
    for line in dockerfile.read_text().splitlines():
        if not line.startswith("COPY "):
            continue
        words = [w for w in line.split()[1:] if not w.startswith("--")]
        *sources, dest = words
        for src in sources:
            target = dest.rstrip("/") + "/" + Path(src).name if dest.endswith("/") else dest
            mapping[target] = REPO / src if src != "." else REPO
    return mapping


def _substitute(text: str, args: dict[str, str]) -> str:
    # Build arguments only; other variables (ENV, shell) stay as written.
    return re.sub(r"\$\{([A-Z0-9_]+)\}", lambda m: args.get(m.group(1), m.group(0)), text)


def _requirement_lines(path: Path) -> list[str]:
    lines = []
    for raw in path.read_text().splitlines():
        line = raw.split(" #")[0].strip()
        if line and not line.startswith("#"):
            lines.append(line)
    return lines


def image_pins(dockerfile: Path = DOCKERFILE) -> PinSet:
    """The PyPI requirements the image installs, from the Dockerfile (see the module docstring)."""
    from packaging.requirements import Requirement

    try:
        import tomllib
    except ImportError:  # Python 3.10
        import tomli as tomllib

    args = dockerfile_args(dockerfile)
    args.setdefault("PIP_CONSTRAINT", "/opt/verl-ds4-constraints.txt")
    copies = _copy_map(dockerfile)
    pins = PinSet()
    raw_reqs: list[tuple[str, str]] = []  # (requirement, source)

    for run in _run_instructions(dockerfile):
        for command in re.split(r"&&|;", run):
            words = shlex.split(_substitute(command, args))
            if "printf" in words and ">" in words and words[words.index(">") + 1] == args["PIP_CONSTRAINT"]:
                pins.constraints = words[words.index("printf") + 2: words.index(">")]
                continue
            starts = [i for i in range(len(words) - 1) if words[i] == "pip" and words[i + 1] == "install"]
            if not starts:
                continue
            it = iter(words[starts[0] + 2:])
            for word in it:
                if word in ("-r", "--requirement"):
                    req_file = next(it)
                    local = copies.get(req_file)
                    if local is None:
                        raise ValueError(f"pip install -r {req_file}: not a file the Dockerfile copies in")
                    raw_reqs += [(r, f"docker/{local.name}") for r in _requirement_lines(local)]
                elif word.startswith("-"):
                    continue
                elif word.startswith("/"):
                    # A local project (COPY . /opt/verl-ds4): its own dependencies are installed too.
                    local = copies.get(word.rstrip("/"))
                    if local is None or not (local / "pyproject.toml").exists():
                        raise ValueError(f"pip install {word}: not a project the Dockerfile copies in")
                    project = tomllib.loads((local / "pyproject.toml").read_text())["project"]
                    raw_reqs += [(r, "pyproject.toml") for r in project["dependencies"]]
                else:
                    raw_reqs.append((word, "docker/Dockerfile"))

    parsed = [(Requirement(r), r, src) for r, src in raw_reqs]
    pins.git = sorted({_canon(req.name) for req, _, _ in parsed if req.url})
    for req, text, src in parsed:
        name = _canon(req.name)
        if req.url or name in pins.git:
            continue  # git-sourced: installed --no-deps from a commit
        if req.marker is not None and not req.marker.evaluate(TARGET_MARKERS):
            continue
        version = next((s.version for s in req.specifier if s.operator == "=="), None)
        if name in SDIST_ONLY:
            pins.sdist_only.append((name, version))
            continue
        for extra in sorted(req.extras):
            if (name, extra) in SDIST_ONLY_EXTRAS:
                pins.sdist_only.append((SDIST_ONLY_EXTRAS[(name, extra)], version))
                req.extras.discard(extra)
        req.marker = None
        pins.requirements.append(str(req))
        pins.sources[str(req)] = src
    # The constraints of git-sourced or sdist-only packages cannot apply to a wheels-only resolve.
    skip = set(pins.git) | {n for n, _ in pins.sdist_only}
    pins.constraints = [c for c in pins.constraints if _canon(Requirement(c).name) not in skip]
    return pins


@dataclass
class Resolution:
    ok: bool
    message: str
    installs: dict[str, str] = field(default_factory=dict)  # name -> version
    seconds: float = 0.0
    stderr: str = ""


def _pip_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PIP_")}
    env["PIP_CONFIG_FILE"] = os.devnull  # pip then reads no config file at all (global, user, site)
    env["PIP_CONSTRAINT"] = ""
    return env


def _conflict_summary(stderr: str) -> str:
    keep = []
    for line in stderr.splitlines():
        s = line.strip()
        if not s:
            continue
        if (s.startswith(("ERROR:", "The conflict is caused by", "The user requested", "To fix this"))
                or " depends on " in s or "Could not find a version" in s or "No matching distribution" in s):
            keep.append(s)
    return "\n".join(keep[:40]) or stderr.strip()[-3000:]


def _has_fast_deps() -> bool:
    out = subprocess.run([sys.executable, "-m", "pip", "install", "--help"], capture_output=True, text=True,
                         env=_pip_env())
    return "fast-deps" in out.stdout


def build_sdist_wheels(requirements: list[str], dest: Path, timeout: float = 300) -> tuple[bool, list[str]]:
    """Build pure-Python wheels for `requirements` from their PyPI sdists into `dest` (no deps).

    The same machine-independent pip settings as the resolve (no config, --isolated, PyPI only, no
    cache). Returns (ok, one message per requirement or the error)."""
    dest.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "pip", "wheel", "--isolated", "--no-deps", "--no-cache-dir",
           "--disable-pip-version-check", "--no-input", "--no-binary", ":all:",
           "--index-url", INDEX_URL, "--timeout", "60", "--wheel-dir", str(dest)]
    if os.environ.get("PIP_CERT"):
        cmd += ["--cert", os.environ["PIP_CERT"]]
    try:
        out = subprocess.run(cmd + list(requirements), capture_output=True, text=True, env=_pip_env(),
                             timeout=timeout)
    except subprocess.TimeoutExpired:
        return False, [f"building {' '.join(requirements)} from PyPI sdists did not finish in {timeout:.0f} s"]
    if out.returncode != 0:
        return False, [f"building {' '.join(requirements)} from PyPI sdists failed (exit {out.returncode}):\n"
                       + (out.stderr.strip()[-2000:] or out.stdout.strip()[-2000:])]
    built = sorted(w.name for w in dest.glob("*.whl"))
    bad = [w for w in built if not w.endswith("-py3-none-any.whl") and not w.endswith("-py2.py3-none-any.whl")]
    if bad:
        return False, [f"not pure-Python wheels, so not valid for the target platform: {', '.join(bad)}"]
    return True, [f"{req}: PyPI has an sdist only; built {', '.join(built)} from it for the resolve ({why})"
                  for req, why in ((r, SDIST_ONLY_DEPS.get(r, "")) for r in requirements)]


def resolve(requirements: list[str], constraints: list[str] | None = None, *, timeout: float = 900,
            python_version: str = TARGET_PYTHON, platforms: list[str] | None = None,
            local_wheels: Path | None = None) -> Resolution:
    """pip's dry-run resolve of `requirements` for CPython `python_version` on x86_64 Linux.

    `local_wheels`: a directory of wheels built from PyPI sdists (build_sdist_wheels), offered to the
    resolver with --find-links; a package may come from there only if it is one of those wheels."""
    with tempfile.TemporaryDirectory(prefix="verl-ds4-resolve-") as tmp:
        report = Path(tmp) / "report.json"
        cmd = [sys.executable]
        if sys.version_info[:2] != tuple(int(p) for p in python_version.split(".")):
            target = dict(TARGET_MARKERS, python_version=python_version)
            cmd += ["-c", _LAUNCHER, json.dumps(target)]
        else:
            cmd += ["-m", "pip"]
        cmd += ["install", "--isolated", "--dry-run", "--ignore-installed", "--no-input",
                "--disable-pip-version-check", "--report", str(report),
                # pip refuses platform options without --target; with --dry-run nothing lands there.
                "--target", str(Path(tmp) / "target"),
                "--index-url", INDEX_URL, "--timeout", "60",
                "--python-version", python_version, "--implementation", "cp", "--only-binary=:all:"]
        for plat in platforms or PLATFORMS:
            cmd += ["--platform", plat]
        if _has_fast_deps():
            # Metadata by HTTP range requests where the index does not serve it on its own (PEP 658):
            # without it, pip downloads every wheel (torch alone is ~530 MB).
            cmd += ["--use-feature=fast-deps"]
        if os.environ.get("PIP_CERT"):
            cmd += ["--cert", os.environ["PIP_CERT"]]
        if local_wheels is not None:
            cmd += ["--find-links", str(local_wheels)]
        if constraints:
            cfile = Path(tmp) / "constraints.txt"
            cfile.write_text("\n".join(constraints) + "\n")
            cmd += ["--constraint", str(cfile)]
        cmd += list(requirements)
        start = time.monotonic()
        try:
            out = subprocess.run(cmd, capture_output=True, text=True, env=_pip_env(), timeout=timeout)
        except subprocess.TimeoutExpired:
            return Resolution(False, f"pip did not finish the resolve in {timeout:.0f} s", seconds=timeout)
        seconds = time.monotonic() - start
        if out.returncode != 0 or not report.exists():
            if "ResolutionImpossible" in out.stderr or "conflicting dependencies" in out.stderr:
                what = "NOT RESOLVABLE (conflicting requirements)"
            elif "No matching distribution" in out.stderr or "Could not find a version" in out.stderr:
                what = "NOT RESOLVABLE (a pinned version has no wheel for this platform on PyPI)"
            elif re.search(r"(?i)connection|timed out|SSL|Temporary failure|Max retries", out.stderr):
                what = f"PyPI not reachable ({INDEX_URL})"
            else:
                what = f"pip failed (exit {out.returncode})"
            return Resolution(False, f"{what} for CPython {python_version} x86_64:\n{_conflict_summary(out.stderr)}",
                              seconds=seconds, stderr=out.stderr)
        data = json.loads(report.read_text())
        installs, foreign = {}, []
        for item in data.get("install", []):
            meta = item["metadata"]
            installs[_canon(meta["name"])] = meta["version"]
            url = item.get("download_info", {}).get("url", "")
            if local_wheels is not None and url.startswith("file:"):
                local = Path(urllib.request.url2pathname(urllib.parse.urlparse(url).path))
                if local.parent.resolve() == Path(local_wheels).resolve():
                    continue  # built from its PyPI sdist (build_sdist_wheels)
            if not url.startswith(PYPI_FILE_HOSTS):
                foreign.append(f"{meta['name']}=={meta['version']} from {url}")
        if foreign:
            return Resolution(False, "resolved, but not only from PyPI:\n" + "\n".join(foreign), installs, seconds)
        return Resolution(True, f"resolvable for CPython {python_version} x86_64: {len(installs)} packages",
                          installs, seconds, out.stderr)


def sdist_exists(name: str, version: str, timeout: float = 60) -> tuple[bool, str]:
    """Whether the index has an sdist of name==version (its JSON simple API, PEP 691; no download)."""
    url = f"{INDEX_URL}/{_canon(name)}/"
    request = urllib.request.Request(url, headers={"Accept": "application/vnd.pypi.simple.v1+json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as resp:  # noqa: S310 (a fixed https URL)
            data = json.load(resp)
    except urllib.error.HTTPError as e:
        return False, f"{name}=={version}: not on PyPI (HTTP {e.code} for {url})"
    except (urllib.error.URLError, TimeoutError, OSError) as e:
        return False, f"{name}=={version}: PyPI not reachable ({e})"
    parts = [re.escape(p) for p in _canon(name).split("-")]
    stem = re.compile("^" + "[-_.]".join(parts) + "-" + re.escape(version) + r"\.(tar\.gz|zip)$", re.I)
    sdists = [f["filename"] for f in data.get("files", []) if stem.match(f["filename"]) and not f.get("yanked")]
    if not sdists:
        return False, f"{name}=={version}: PyPI has no sdist of this version"
    return True, f"{name}=={version}: sdist on PyPI ({sdists[0]}; built in the image, not resolved)"


def check(dockerfile: Path = DOCKERFILE, timeout: float = 900) -> tuple[bool, list[str], Resolution]:
    """The whole check: the resolve, the pinned versions it chose, and the sdist-only pins."""
    from packaging.requirements import Requirement

    pins = image_pins(dockerfile)
    with tempfile.TemporaryDirectory(prefix="verl-ds4-sdist-wheels-") as tmp:
        wheels = Path(tmp)
        built, built_lines = build_sdist_wheels(list(SDIST_ONLY_DEPS), wheels)
        if not built:
            res = Resolution(False, "\n".join(built_lines))
            return False, built_lines + ["(the resolve did not run)"], res
        res = resolve(pins.requirements, pins.constraints, timeout=timeout, local_wheels=wheels)
    lines = [res.message] + built_lines
    ok = res.ok
    if res.ok:
        for text in pins.requirements + pins.constraints:
            req = Requirement(text)
            exact = [s.version for s in req.specifier if s.operator == "=="]
            got = res.installs.get(_canon(req.name))
            if exact and got is not None and got.split("+")[0] != exact[0]:
                ok = False
                lines.append(f"{req.name}: resolved {got}, pinned {exact[0]}")
    for name, version in pins.sdist_only:
        found, msg = sdist_exists(name, version)
        ok &= found
        lines.append(msg)
    lines.append(f"(resolve took {res.seconds:.0f} s; git-sourced, not resolved: {', '.join(pins.git)})")
    return ok, lines, res


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--print", action="store_true", help="print the requirement list and exit")
    parser.add_argument("--timeout", type=float, default=900, help="seconds for pip's resolve")
    args = parser.parse_args(argv)
    if args.print:
        pins = image_pins()
        for r in pins.requirements:
            print(f"{r:60s} # {pins.sources[r]}")
        print("# constraints: " + " ".join(pins.constraints))
        print("# sdist only: " + " ".join(f"{n}=={v}" for n, v in pins.sdist_only))
        print("# git-sourced: " + " ".join(pins.git))
        return 0
    ok, lines, _ = check(timeout=args.timeout)
    print("\n".join(lines))
    print("check_pins_resolve: " + ("OK" if ok else "FAILED"))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
