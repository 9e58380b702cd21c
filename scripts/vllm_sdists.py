"""vLLM's source distributions from PyPI for scripts/check_vllm_range.py: the release list, each
sdist downloaded once into a cache (resumed where a download stopped, checked against PyPI's
sha256) and its ``vllm/**.py`` files unpacked once."""

from __future__ import annotations

import hashlib
import json
import re
import shutil
import tarfile
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urljoin

PYPI_JSON = "https://pypi.org/pypi/vllm/json"
MINORS = range(24, 34)  # 0.24 ... 0.33: the range the plugin claims
CHUNK = 1 << 20
UNREACHABLE = (urllib.error.URLError, OSError, tarfile.TarError)  # what getting a release can raise


@dataclass(frozen=True)
class Release:
    version: str
    url: str
    sha256: str
    size: int


def _version_key(version: str) -> tuple[int, ...]:
    return tuple(int(part) for part in version.split("."))


def releases_from_listing(listing: dict, wanted: list[str] | None) -> list[Release]:
    """The sdists of ``wanted`` (or of the newest final patch release of each minor in MINORS)."""
    found: dict[str, Release] = {}
    for version, files in listing["releases"].items():
        if not re.fullmatch(r"0\.\d+\.\d+", version):
            continue  # pre-releases, dev and post releases: not what users install
        sdists = [f for f in files if f.get("packagetype") == "sdist" and not f.get("yanked")]
        if sdists:
            sdist = sdists[0]
            found[version] = Release(version, urljoin(PYPI_JSON, sdist["url"]), sdist["digests"]["sha256"],
                                     int(sdist["size"]))
    if wanted:
        missing = [v for v in wanted if v not in found]
        if missing:
            raise SystemExit(f"check_vllm_range: PyPI has no source distribution of vLLM {', '.join(missing)}")
        return [found[v] for v in wanted]
    newest: dict[int, Release] = {}
    for version in sorted(found, key=_version_key):
        minor = _version_key(version)[1]
        if minor in MINORS:
            newest[minor] = found[version]
    return [newest[m] for m in sorted(newest)]


def read_listing(cache: Path, offline: bool) -> dict:
    """PyPI's JSON for vLLM, kept in the cache; the cached copy where PyPI cannot be reached."""
    cached = cache / "pypi-vllm.json"
    if not offline:
        try:
            with urllib.request.urlopen(PYPI_JSON, timeout=60) as response:
                listing = json.load(response)
            cache.mkdir(parents=True, exist_ok=True)
            cached.write_text(json.dumps({"releases": listing["releases"]}))
            return listing
        except (urllib.error.URLError, OSError) as exc:
            print(f"PyPI unreachable ({exc}); using the cached release list", flush=True)
    if not cached.exists():
        raise SystemExit(f"check_vllm_range: no cached release list in {cache}: run once with network")
    return json.loads(cached.read_text())


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(CHUNK), b""):
            digest.update(block)
    return digest.hexdigest()


def download(release: Release, cache: Path) -> Path:
    """The release's sdist in the cache: resumed from a partial download, checked by sha256."""
    target = cache / f"vllm-{release.version}.tar.gz"
    if target.exists():
        return target
    partial = target.with_name(target.name + ".part")
    have = partial.stat().st_size if partial.exists() else 0
    if have < release.size:
        _fetch(release, partial, have)
    if _sha256(partial) != release.sha256:
        partial.unlink()
        raise SystemExit(f"check_vllm_range: vLLM {release.version}'s sdist does not match PyPI's sha256; "
                         "the partial file was removed: run again")
    partial.rename(target)
    return target


def _fetch(release: Release, partial: Path, have: int) -> None:
    """Append the rest of the sdist to ``partial`` (all of it where the server ignores ``Range``),
    saying how far it got at each quarter."""
    request = urllib.request.Request(release.url, headers={"Range": f"bytes={have}-"} if have else {})
    with urllib.request.urlopen(request, timeout=120) as response:
        if have and response.status != 206:
            have = 0
        with partial.open("ab" if have else "wb") as out:
            done, shown = have, -1
            for block in iter(lambda: response.read(CHUNK), b""):
                out.write(block)
                done += len(block)
                quarter = 4 * done // max(release.size, 1)
                if quarter != shown:
                    shown = quarter
                    print(f"  vLLM {release.version}: {done / 1e6:.0f} of {release.size / 1e6:.0f} MB", flush=True)


def unpack(release: Release, cache: Path) -> Path:
    """A directory holding the release's ``vllm/`` Python files, unpacked once from its sdist."""
    tree = cache / release.version
    if (tree / "vllm").is_dir():
        return tree
    sdist = download(release, cache)
    print(f"  vLLM {release.version}: unpacking vllm/**.py", flush=True)
    scratch = cache / f"{release.version}.unpacking"
    shutil.rmtree(scratch, ignore_errors=True)
    with tarfile.open(sdist) as archive:
        for member in archive:
            parts = Path(member.name).parts
            inside = ".." not in parts and not Path(member.name).is_absolute()
            if inside and member.isfile() and len(parts) > 2 and parts[1] == "vllm" and parts[-1].endswith(".py"):
                destination = scratch.joinpath(*parts[1:])
                destination.parent.mkdir(parents=True, exist_ok=True)
                with archive.extractfile(member) as source:
                    destination.write_bytes(source.read())
    scratch.rename(tree)
    return tree
