"""Package discovery (everything else is in pyproject.toml).

The four import roots live in folders of other names (`hsx_service` in service/, ...), which
setuptools' automatic discovery cannot map, so each folder's packages are found here under
its import name: a sub-package added to any of them ships without a list to keep up to date.
The mapping itself is `package-dir` in pyproject.toml."""

from setuptools import find_packages, setup

try:  # Python 3.11+
    import tomllib
except ModuleNotFoundError:  # 3.10: setuptools vendors tomli
    from setuptools._vendor import tomli as tomllib

with open("pyproject.toml", "rb") as f:
    ROOTS: dict[str, str] = tomllib.load(f)["tool"]["setuptools"]["package-dir"]


def discovered() -> list[str]:
    packages = []
    for name, folder in ROOTS.items():
        packages.append(name)
        packages += [f"{name}.{sub}" for sub in find_packages(folder)]
    return sorted(packages)


setup(packages=discovered())
