"""The default install is the runtime alone: `pip install edgelm` in a fresh virtual environment
(no system site-packages) brings onnxruntime, numpy and tokenizers but not torch, runs
`edgelm generate`, and turns `edgelm export` into a one-line error that names the missing extra."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
# what the wheel is built from
SOURCES = ["pyproject.toml", "README.md", "edgelm", "export", "quantize", "runtime", "writers"]
# pip's words for an index it cannot reach (offline machine, no DNS, proxy refusing): skip, do not fail
NETWORK_ERRORS = (
    "NewConnectionError",
    "Max retries exceeded",
    "Temporary failure in name resolution",
    "Network is unreachable",
    "ConnectTimeoutError",
    "ProxyError",
    "(from versions: none)",
)

pytestmark = pytest.mark.slow


def clean_env() -> dict[str, str]:
    """The environment minus anything that would let the venv see this interpreter's packages."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")}
    env["PYTHONNOUSERSITE"] = "1"
    return env


@pytest.fixture(scope="module")
def venv_bin(tmp_path_factory) -> Path:
    work = tmp_path_factory.mktemp("runtime-only")
    # build from a copy: pip builds in the source tree (build/, *.egg-info), which is not ours to litter
    source = work / "edgelm-src"
    source.mkdir()
    for name in SOURCES:
        if (REPO / name).is_dir():
            shutil.copytree(REPO / name, source / name, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy2(REPO / name, source / name)
    venv = work / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=300)
    bin_dir = venv / ("Scripts" if os.name == "nt" else "bin")
    install = subprocess.run(
        [bin_dir / "python", "-m", "pip", "install", "--quiet", str(source)],
        cwd=work,
        env=clean_env(),
        capture_output=True,
        text=True,
        timeout=1200,
    )
    if install.returncode != 0:
        output = install.stdout + install.stderr
        if any(marker in output for marker in NETWORK_ERRORS):
            errors = [line.strip() for line in output.splitlines() if line.strip().startswith("ERROR:")]
            pytest.skip(f"pip cannot reach the package index: {(errors or ['no ERROR line'])[0]}")
        pytest.fail(f"pip install of the runtime-only package failed:\n{output[-3000:]}")
    return bin_dir


def run(venv_bin: Path, *args: str, cwd: Path) -> subprocess.CompletedProcess:
    # cwd outside the repo: `python -c` puts the working directory first on sys.path, and the repo
    # root holds an edgelm/ folder that would shadow the installed one
    return subprocess.run(
        [str(venv_bin / args[0]), *args[1:]], cwd=cwd, env=clean_env(), capture_output=True, text=True, timeout=300
    )


def test_runtime_only_install(venv_bin, package, hf_checkpoint, tmp_path):
    where = run(venv_bin, "python", "-c", "import edgelm, edgelm.runtime; print(edgelm.__file__)", cwd=tmp_path)
    assert where.returncode == 0, where.stderr
    assert Path(where.stdout.strip()).is_relative_to(venv_bin.parent), f"edgelm imported from {where.stdout}"

    torch = run(venv_bin, "python", "-c", "import torch", cwd=tmp_path)
    assert torch.returncode != 0 and "No module named 'torch'" in torch.stderr, "the default install pulled in torch"

    help_ = run(venv_bin, "edgelm", "--help", cwd=tmp_path)
    assert help_.returncode == 0, help_.stderr
    assert "generate" in help_.stdout and "export" in help_.stdout

    generate = run(
        venv_bin, "edgelm", "generate", str(package), "hi", "--max-new-tokens", "5", "--provider", "cpu", cwd=tmp_path
    )
    assert generate.returncode == 0, generate.stderr
    assert "tokens, finish:" in generate.stderr, generate.stderr

    export = run(venv_bin, "edgelm", "export", str(hf_checkpoint), str(tmp_path / "out"), cwd=tmp_path)
    assert export.returncode == 1, export.stderr
    lines = export.stderr.strip().splitlines()
    assert len(lines) == 1, f"expected a one-line error, got:\n{export.stderr}"
    assert "missing Python package" in lines[0] and "edgelm[export]" in lines[0], lines[0]
    assert not (tmp_path / "out").exists()

    # a model folder runs directly only where export can make its package once: the error names the extra
    direct = subprocess.run(
        [str(venv_bin / "edgelm"), "generate", str(hf_checkpoint), "hi"],
        cwd=tmp_path,
        env=clean_env() | {"EDGELM_CACHE": str(tmp_path / "cache")},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert direct.returncode == 1 and len(direct.stderr.strip().splitlines()) == 1, direct.stderr
    assert "is a Hugging Face model folder" in direct.stderr and "pip install 'edgelm[export]'" in direct.stderr
