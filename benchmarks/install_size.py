"""Installed size of edgelm with its dependencies: every distribution an install pulls in (the
transitive closure of edgelm's requirements, with the chosen extras), summed over the files each
one recorded at install time (its RECORD), measured on disk.

    python benchmarks/install_size.py                                    # this interpreter, edgelm[export]
    python benchmarks/install_size.py --extras "" --site-packages VENV/lib/python3.11/site-packages

Needs `packaging` (any environment with pip tooling has it) to read requirement markers.
"""

from __future__ import annotations

import argparse
import importlib.metadata as metadata
import re

from packaging.requirements import Requirement


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def dist_size(dist: metadata.Distribution) -> int:
    total = 0
    for file in dist.files or []:
        path = dist.locate_file(file)
        if path.is_file():  # RECORD lists files a later uninstall of a shared folder may have removed
            total += path.stat().st_size
    return total


def closure(root: str, path: list[str] | None) -> dict[str, metadata.Distribution]:
    """Name -> distribution for root (e.g. "edgelm[export]") and everything it requires, recursively."""
    installed = {canonical(d.metadata["Name"]): d for d in metadata.distributions(**({"path": path} if path else {}))}
    found: dict[str, metadata.Distribution] = {}
    todo = [Requirement(root)]
    while todo:
        requirement = todo.pop()
        name = canonical(requirement.name)
        if name not in installed:
            raise SystemExit(f"{requirement.name} is required but not installed")
        first_visit = name not in found
        found[name] = installed[name]
        for text in installed[name].requires or []:
            needed = Requirement(text)
            markers = [{"extra": extra} for extra in requirement.extras | {""}]
            if needed.marker is None or any(needed.marker.evaluate(m) for m in markers):
                # revisit a known dist only to pick up extras asked for by a new path
                if first_visit or needed.extras:
                    todo.append(needed)
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--extras", default="export", help='comma-separated extras of edgelm ("" = runtime only)')
    parser.add_argument("--site-packages", default=None, help="a site-packages folder (default: this interpreter's)")
    args = parser.parse_args()
    root = f"edgelm[{args.extras}]" if args.extras else "edgelm"
    dists = closure(root, [args.site_packages] if args.site_packages else None)
    sizes = sorted(((dist_size(d), name) for name, d in dists.items()), reverse=True)
    for size, name in sizes:
        print(f"{size / 2**20:9.1f} MiB  {name} {dists[name].version}")
    print(f"{sum(s for s, _ in sizes) / 2**20:9.1f} MiB  total for {root} ({len(sizes)} distributions)")


if __name__ == "__main__":
    main()
