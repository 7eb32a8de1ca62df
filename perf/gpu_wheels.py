"""Prints NAME==VERSION, one a line, for every package pipeline-serve and pytest need at run time
besides torch and triton, as installed here: what `make gpu-wheels` downloads into .whl/ for
perf/gpu_check.sh on a GPU machine without network."""

from __future__ import annotations

import importlib.metadata as metadata

from packaging.requirements import Requirement

# The GPU machine brings these; matplotlib only draws --report charts.
NOT_NEEDED = frozenset({"torch", "triton", "matplotlib", "pipeline-serve"})


def _key(name: str) -> str:
    return name.lower().replace("_", "-").replace(".", "-")


def runtime_closure(roots: list[str]) -> dict[str, str]:
    """{name: version} of `roots` and everything they require (extras left out), as installed."""
    found: dict[str, str] = {}
    pending = list(roots)
    while pending:
        name = pending.pop()
        key = _key(name)
        if key in found or key in NOT_NEEDED or key.startswith("nvidia-"):
            continue
        dist = metadata.distribution(name)
        found[key] = dist.version
        for text in dist.requires or []:
            requirement = Requirement(text)
            if requirement.marker is None or requirement.marker.evaluate({"extra": ""}):
                pending.append(requirement.name)
    return found


def main() -> int:
    roots = [
        Requirement(text).name
        for text in metadata.requires("pipeline-serve") or []
        if "extra ==" not in text
    ]
    for name, version in sorted(runtime_closure([*roots, "pytest"]).items()):
        print(f"{name}=={version}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
