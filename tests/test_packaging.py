"""Packaging: `import radixlora` and the command line's parser load neither torch nor triton
(triton is a Linux-only dependency); pyproject.toml declares its license as an SPDX string and
ships every demo data directory as a listed package (setuptools warns otherwise)."""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

try:
    import tomllib
except ImportError:  # Python 3.10: pytest's own dependency
    import tomli as tomllib

import radixlora

ROOT = Path(__file__).resolve().parent.parent
BLOCK_TRITON = """
import importlib.abc, sys
class NoTriton(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "triton" or name.startswith("triton."):
            raise ImportError(f"No module named {name!r} (blocked by the test)")
sys.meta_path.insert(0, NoTriton())
"""


def run_python(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", BLOCK_TRITON + code], capture_output=True,
                          text=True, timeout=60, cwd=ROOT)


def test_import_and_cli_parser_need_neither_torch_nor_triton():
    done = run_python(
        "import radixlora\n"
        "from radixlora.cli import build_parser\n"
        "build_parser().parse_args(['serve', 'org/model', '--lora-modules', 'a=/x'])\n"
        "assert not {'torch', 'triton'} & set(sys.modules), sorted(sys.modules)\n"
        "print(radixlora.__version__, 'Engine' in dir(radixlora))\n")
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == [radixlora.__version__, "True"]


def test_public_names_resolve_on_first_use():
    assert radixlora.SamplingParams.__name__ == "SamplingParams"
    assert set(radixlora.__all__) <= set(dir(radixlora))
    try:
        radixlora.NoSuchName  # noqa: B018
    except AttributeError as e:
        assert "NoSuchName" in str(e)
    else:
        raise AssertionError("an unknown name must raise AttributeError")


def test_pyproject_license_version_and_demo_data():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert project["project"]["license"] == "Apache-2.0"
    assert project["project"]["version"] == radixlora.__version__
    assert "huggingface_hub" in " ".join(project["project"]["optional-dependencies"]["hf"])
    setuptools = project["tool"]["setuptools"]
    demo = ROOT / "radixlora" / "demo"
    data_dirs = {
        ".".join(p.relative_to(ROOT).parts) for p in demo.rglob("*")
        if p.is_dir() and not (p / "__init__.py").exists() and any(
            f.is_file() for f in p.iterdir()) and p.name != "__pycache__"
    }
    found = setuptools["packages"]["find"]  # namespace packages included: the data directories
    assert data_dirs and "radixlora.*" in found["include"] and found.get("namespaces", True)
    assert all(setuptools["package-data"].get(name) == ["*"] for name in data_dirs)


def test_the_cpu_demo_runs_without_triton():
    """The kernel modules import without Triton (their torch references are the CPU path), the
    demo answers as it does with Triton installed, and launching a kernel says what is
    missing."""
    demo = "from radixlora.cli import main\nsys.argv = ['radixlora', 'demo']\nmain()\n"
    blocked = run_python(demo)
    assert blocked.returncode == 0, blocked.stderr
    plain = subprocess.run([sys.executable, "-c", "import sys\n" + demo], capture_output=True,
                           text=True, timeout=120, cwd=ROOT)
    assert plain.returncode == 0, plain.stderr
    assert blocked.stdout == plain.stdout and "THE RED FOX" in blocked.stdout
    launch = run_python(
        "import torch\n"
        "from radixlora_kernels.triton_compat import HAVE_TRITON\n"
        "from radixlora_kernels.rmsnorm import rmsnorm\n"
        "assert not HAVE_TRITON\n"
        "try:\n"
        "    rmsnorm(torch.ones(2, 8), torch.ones(8), 1e-6)\n"
        "except ImportError as e:\n"
        "    print(e)\n")
    assert launch.returncode == 0, launch.stderr
    assert "Triton is not installed" in launch.stdout


def test_the_host_launch_arithmetic_is_tritons():
    import triton

    from radixlora_kernels.triton_compat import cdiv, next_power_of_2

    for n in range(0, 300):
        assert next_power_of_2(n) == triton.next_power_of_2(n)
        for d in (1, 3, 16, 64):
            assert cdiv(n, d) == triton.cdiv(n, d)


def test_the_repository_root_shadows_no_installed_package():
    """From the repository root (sys.path[0] under `python -c`, and under pytest), transformers
    imports Hugging Face's `kernels`, not the kernels/ folder, and no top-level folder but the
    package itself and the test suite is a regular package another one could be shadowed by."""
    done = subprocess.run(
        [sys.executable, "-c", "import transformers.integrations.hub_kernels, peft, kernels\n"
                               "print(kernels.__file__)"],
        capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert done.returncode == 0, done.stderr
    assert not Path(done.stdout.strip()).resolve().is_relative_to(ROOT / "kernels")
    regular = {p.name for p in ROOT.iterdir() if (p / "__init__.py").is_file()}
    assert regular == {"radixlora", "tests"}


def test_kernels_and_the_language_are_packages_of_their_own_with_no_links(tmp_path):
    """kernels/ and frontend/ hold the packages radixlora_kernels and radixlora_frontend; no
    file of the repository is a link; one wheel of the project ships the three packages (and
    the kernels import nothing of radixlora: scripts/import_graph.py)."""
    from radixlora_frontend import Runtime, runtime
    from radixlora_kernels import sgmv_shrink

    assert Path(sgmv_shrink.__file__).resolve().parent == ROOT / "kernels" / "radixlora_kernels"
    assert Runtime is runtime.Runtime
    links = [p for top in ("radixlora", "kernels", "frontend", "tests", "scripts", "docs")
             for p in (ROOT / top).rglob("*") if p.is_symlink()]
    assert links == []
    done = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps",
                           "--no-build-isolation", "-q", "-w", str(tmp_path), str(ROOT)],
                          capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    (wheel,) = tmp_path.glob("radixlora-*.whl")
    with zipfile.ZipFile(wheel) as z:
        tops = {name.split("/")[0] for name in z.namelist()}
        assert "radixlora/demo/model/model.safetensors" in z.namelist()
    assert {"radixlora", "radixlora_kernels", "radixlora_frontend"} <= tops


def test_every_script_imports_beside_the_installed_kernels_package():
    """Each script's imports resolve (runpy without running main) while Hugging Face's
    `kernels` is importable: a script must reach the LoRA kernels as radixlora_kernels."""
    code = (
        "import runpy, sys, pathlib\n"
        "for path in sorted(pathlib.Path('scripts').glob('*.py')):\n"
        "    sys.argv = [str(path)]\n"
        "    runpy.run_path(str(path), run_name='imported_by_the_test')\n"
        "    print(path.name)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=300, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    printed = set(done.stdout.split())
    assert printed == {p.name for p in (ROOT / "scripts").glob("*.py")}
