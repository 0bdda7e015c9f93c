"""What `pip install 'multigpu[hf]'` admits is what the zoo recorded: the transformers range in pyproject.toml
holds the release tests/zoo_expected.json was recorded on (constraints.txt's pin) and no other minor release,
whose zoo nobody recorded (5.25 was pulled in while the zoo's outcomes were for 5.24)."""

from __future__ import annotations

import json
import pathlib
import re
import tomllib

from packaging.requirements import Requirement
from packaging.version import Version

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _transformers(extra: str) -> Requirement:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    found = [Requirement(r) for r in project["optional-dependencies"][extra] if Requirement(r).name == "transformers"]
    assert len(found) == 1, (extra, found)
    return found[0]


def test_the_transformers_range_admits_the_recorded_zoo_and_no_later_release():
    recorded = Version(json.loads((ROOT / "tests" / "zoo_expected.json").read_text())["transformers"])
    pin = re.search(r"^transformers==(\S+)$", (ROOT / "constraints.txt").read_text(), flags=re.M)
    assert pin and Version(pin.group(1)) == recorded  # CI tests the release the zoo was recorded on
    hf, test = _transformers("hf"), _transformers("test")
    assert hf.specifier == test.specifier  # the tests install what users get
    assert hf.specifier.contains(recorded)
    later = Version(f"{recorded.major}.{recorded.minor + 1}.0")
    assert not hf.specifier.contains(later), f"{hf} admits {later}, whose zoo is not recorded"
    # Nor an earlier minor release: their zoos are not recorded either (5.0 refuses Qwen3's TP plan 5.24 runs).
    if recorded.minor:
        earlier = Version(f"{recorded.major}.{recorded.minor - 1}.0")
        assert not hf.specifier.contains(earlier), f"{hf} admits {earlier}, whose zoo is not recorded"
