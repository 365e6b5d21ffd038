"""Optional libraries megarl's connectors import (`pip install 'megarl[envs]'`): the installed version
checked against the range megarl supports, with the fix in the error."""
from __future__ import annotations

import importlib.metadata

from packaging.specifiers import SpecifierSet
from packaging.version import Version

from megarl.config.errors import ConfigError


def supported_version(package: str, supported: SpecifierSet, needed_by: str, install: str) -> str:
    """The installed version of `package` (a distribution name); ConfigError naming `needed_by` (what
    needs it, e.g. "megarl's OpenEnv connector") and the `install` command when it is missing or
    outside `supported`."""
    try:
        version = importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        raise ConfigError(f"{package} is not installed; {needed_by} needs {package}{supported}: {install}") from None
    if Version(version) not in supported:
        raise ConfigError(f"{package} {version} is installed; megarl supports {package}{supported}: {install}")
    return version
