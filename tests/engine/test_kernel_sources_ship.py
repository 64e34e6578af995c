"""Every C source and header of the engine ships in the package: the kernels are compiled at
first use from the installed files, so one left out of package-data breaks the build of every
library that includes it on an installed Baton (a wheel, the container image)."""

import tomllib
from pathlib import Path

import engine
from engine.native import source_files

ENGINE_DIR = Path(engine.__file__).resolve().parent
PYPROJECT = ENGINE_DIR.parent / "pyproject.toml"


def shipped_patterns() -> list[str]:
    """The engine's package-data globs, relative to engine/ (setuptools globs them there)."""
    data = tomllib.loads(PYPROJECT.read_text())
    return data["tool"]["setuptools"]["package-data"]["engine"]


def test_every_kernel_source_and_what_it_includes_is_package_data():
    patterns = shipped_patterns()
    sources = sorted(ENGINE_DIR.rglob("*.c"))
    assert sources, "no C sources found under engine/"
    needed = {path for source in sources for path in source_files(source)}
    assert any(path.suffix == ".h" and path.parent != ENGINE_DIR for path in needed)
    shipped = {path.resolve() for pattern in patterns for path in ENGINE_DIR.glob(pattern)}
    missing = sorted(str(path.relative_to(ENGINE_DIR)) for path in needed - shipped)
    assert missing == []
