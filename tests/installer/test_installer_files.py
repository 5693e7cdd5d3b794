"""The installer's metadata and build script, without building anything (no PyInstaller here).

The bundle itself is checked by installer/test_installer.sh, a release check (minutes).
"""

from __future__ import annotations

import configparser
import re
import shutil
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from models.version import VERSION

ROOT = Path(__file__).resolve().parents[2]
INSTALLER = ROOT / "installer"
BUILD_SH = INSTALLER / "build.sh"
ICON_SIZES = (16, 24, 32, 48, 64, 128, 256, 512)

needs_bash = pytest.mark.skipif(sys.platform == "win32" or not shutil.which("bash"), reason="needs bash")


def _scripts() -> set[str]:
    text = (ROOT / "pyproject.toml").read_text(encoding="utf-8")
    block = text.split("[project.scripts]", 1)[1].split("\n[", 1)[0]
    return set(re.findall(r"^([\w-]+)\s*=", block, re.MULTILINE))


def _desktop() -> configparser.SectionProxy:
    parser = configparser.ConfigParser(interpolation=None)
    parser.optionxform = str  # keys are case-sensitive
    parser.read(INSTALLER / "linux" / "hearth.desktop", encoding="utf-8")
    return parser["Desktop Entry"]


def _metainfo(version: str = VERSION) -> str:
    template = (INSTALLER / "linux" / "hearth.metainfo.xml.in").read_text(encoding="utf-8")
    return template.replace("@VERSION@", version).replace("@DATE@", "2026-01-31")


def test_desktop_entry_launches_the_app_with_a_packaged_icon():
    entry = _desktop()
    assert entry["Type"] == "Application"
    assert entry["Name"] == "Hearth"
    assert entry["Exec"].split()[0] in _scripts()
    assert entry["Exec"].split()[0] == "hearth-app"
    assert entry["Terminal"] == "false"
    assert entry["Categories"].endswith(";")
    for size in ICON_SIZES:
        assert (INSTALLER / "art" / "png" / f"{entry['Icon']}-{size}.png").is_file()
    assert (INSTALLER / "art" / f"{entry['Icon']}.svg").is_file()


def test_metainfo_names_the_desktop_entry_the_binaries_and_the_version():
    root = ET.fromstring(_metainfo("9.8.7"))
    assert root.tag == "component" and root.get("type") == "desktop-application"
    assert root.findtext("id") == "org.hearth.Hearth"
    assert root.find("launchable").text == "hearth.desktop"
    assert root.find("icon").text == _desktop()["Icon"]
    assert {b.text for b in root.find("provides")} == _scripts()
    assert [r.get("version") for r in root.find("releases")] == ["9.8.7"]
    assert root.findtext("metadata_license") and root.findtext("project_license") == "Apache-2.0"
    assert root.find("description").find("p") is not None


@pytest.mark.skipif(not shutil.which("appstreamcli"), reason="appstreamcli is not installed")
def test_metainfo_passes_appstreamcli(tmp_path):
    path = tmp_path / "org.hearth.Hearth.metainfo.xml"
    path.write_text(_metainfo(), encoding="utf-8")
    r = subprocess.run(["appstreamcli", "validate", "--no-net", str(path)], capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr


@pytest.mark.skipif(not shutil.which("desktop-file-validate"), reason="desktop-file-utils is not installed")
def test_desktop_entry_passes_desktop_file_validate():
    r = subprocess.run(
        ["desktop-file-validate", str(INSTALLER / "linux" / "hearth.desktop")], capture_output=True, text=True
    )
    assert r.returncode == 0 and not r.stdout.strip(), r.stdout + r.stderr


def test_spec_and_installers_agree_on_the_executables():
    spec = (INSTALLER / "hearth.spec").read_text(encoding="utf-8")
    names = set(re.findall(r'EXE\(.*?name="([\w-]+)"', spec, re.DOTALL))
    assert names == _scripts() == {"hearth", "hearth-app"}
    for hook in re.findall(r'HERE / "(rthook_\w+\.py)"', spec):
        assert (INSTALLER / hook).is_file()
    for never in ("torch", "pytest", "_pytest", "numba.tests"):
        assert f'"{never}"' in spec
    iss = (INSTALLER / "windows" / "hearth.iss").read_text(encoding="utf-8")
    assert r"build\dist\hearth\*" in iss and r"{app}\hearth-app.exe" in iss
    assert "#ifndef AppVersion" in iss


def _build_sh_copy(tmp_path: Path, version: str) -> Path:
    """build.sh in a scratch tree whose pyproject.toml has `version`."""
    (tmp_path / "installer").mkdir()
    script = tmp_path / "installer" / "build.sh"
    shutil.copy(BUILD_SH, script)
    (tmp_path / "pyproject.toml").write_text(f'[project]\nname = "hearth"\nversion = "{version}"\n')
    return script


def _run(script: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(script), *args], capture_output=True, text=True, timeout=30)


@needs_bash
def test_build_sh_reads_the_version_from_pyproject():
    r = _run(BUILD_SH, "--print-version")
    assert r.returncode == 0, r.stderr
    assert r.stdout.splitlines() == [f"version {VERSION}", f"deb {VERSION}"]


@needs_bash
@pytest.mark.parametrize(
    "version, deb",
    [("1.2.0", "1.2.0"), ("1.2.0rc1", "1.2.0~rc1"), ("2.0b3", "2.0~b3"), ("1.0.dev4", "1.0~dev4"),
     ("1.0.post1", "1.0.post1"), ("1.0+abc", "1.0+abc")],
)
def test_build_sh_maps_pep440_to_debian_versions(tmp_path, version, deb):
    r = _run(_build_sh_copy(tmp_path, version), "--print-version")
    assert r.returncode == 0, r.stderr
    assert r.stdout.splitlines() == [f"version {version}", f"deb {deb}"]


@needs_bash
def test_build_sh_refuses_a_version_dpkg_cannot_take(tmp_path):
    r = _run(_build_sh_copy(tmp_path, "1.0_beta"), "--print-version")
    assert r.returncode == 1
    assert "cannot be a Debian version" in r.stderr


@needs_bash
def test_build_sh_rejects_unknown_options_and_bad_arguments(tmp_path):
    r = _run(BUILD_SH, "--bogus")
    assert r.returncode == 2 and "unknown option '--bogus'" in r.stderr and "usage:" in r.stderr
    r = _run(BUILD_SH, "--out")
    assert r.returncode == 1 and "--out needs a directory" in r.stderr
    r = _run(BUILD_SH, "--model-file", str(tmp_path / "missing.gguf"))
    assert r.returncode == 1 and "no such file" in r.stderr
    r = _run(BUILD_SH, "--help")
    assert r.returncode == 0 and "--with-model" in r.stdout
