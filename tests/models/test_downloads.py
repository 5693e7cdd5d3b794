"""The download manager against the loopback Hub: resume, faults, verification, queue, security."""

from __future__ import annotations

import hashlib
import json
import threading
import time
from collections import namedtuple

import pytest

from models import downloads, hub
from models.downloads import DownloadJob, DownloadManager, DownloadSettings, download_file, partial_path
from tests.models.hubserver import TOKEN, HubServer, isolate_hf, payload

CHUNK = 16 * 1024
FAST = DownloadSettings(
    chunk_size=CHUNK, timeout=0.3, max_retries=4, backoff_base=0.001, backoff_max=0.01, disk_margin=0
)
SIZE = 192 * 1024
REPO = "org/model-GGUF"
FILE = "model-Q4_K_M.gguf"


@pytest.fixture
def server(monkeypatch, tmp_path):
    s = HubServer(seed=7)
    s.stall_seconds = 1.0
    isolate_hf(monkeypatch, tmp_path, s)
    s.add_repo(
        REPO,
        {FILE: payload(SIZE, 1), "sub/other-Q8_0.gguf": payload(70_000, 2), "config.json": b'{"a": 1}'},
    )
    s.add_repo("org/gated", {"m.gguf": payload(50_000, 3)}, gated=True)
    yield s
    s.close()


def _job(server, filename=FILE, repo=REPO, **kw) -> DownloadJob:
    data = server.repos[repo].files[filename]
    sha = hashlib.sha256(data).hexdigest() if server.repos[repo].is_lfs(filename) else None
    return DownloadJob(repo, filename, size=len(data), sha256=sha, **kw)


def _leftovers(root):
    return [p for p in root.rglob("*") if p.name.endswith(downloads.PARTIAL_SUFFIX)]


def test_download_follows_redirect_verifies_and_keeps_the_token_home(server, tmp_path, monkeypatch):
    root = tmp_path / "lib"
    monkeypatch.setenv("HF_TOKEN", TOKEN)
    job = _job(server, "m.gguf", "org/gated")
    seen = []
    path, stats = download_file(job, root, FAST, on_bytes=lambda d, t: seen.append((d, t)))
    assert path == root / "hub" / "org" / "gated" / "m.gguf"
    assert path.read_bytes() == server.repos["org/gated"].files["m.gguf"]
    assert seen[-1] == (50_000, 50_000) and len(seen) == 4
    assert job.commit == server.repos["org/gated"].commit and job.path == str(path)
    hub_hits = [e for e in server.log if "/resolve/" in e["path"]]
    cdn_hits = [e for e in server.log if e["path"].startswith("/cdn/")]
    assert hub_hits[0]["auth"] == f"Bearer {TOKEN}"
    assert cdn_hits and all(e["auth"] is None for e in cdn_hits), "the token never goes to the CDN host"
    assert not _leftovers(root) and stats.restarts_from_zero == 0


def test_small_non_lfs_file_is_checked_by_git_blob_id(server, tmp_path):
    job = _job(server, "config.json")
    job.blob_id = hub.repo_details(REPO, with_card=False).files[0].blob_id
    path, _ = download_file(job, tmp_path, FAST)
    assert path.read_bytes() == b'{"a": 1}'
    server.sticky.add("corrupt")
    path.unlink()
    with pytest.raises(downloads.IntegrityError, match="git blob id"):
        download_file(_job(server, "config.json", blob_id=job.blob_id), tmp_path, FAST)
    assert not path.exists() and not _leftovers(tmp_path)


@pytest.mark.parametrize("fault", ["cut", "stall", "500", "429", "ignore_range", "corrupt"])
def test_each_fault_is_survived(server, tmp_path, fault):
    server.faults = ["cut", fault] if fault == "ignore_range" else [fault]  # ignore_range needs a resume
    path, stats = download_file(_job(server), tmp_path, FAST)
    assert hashlib.sha256(path.read_bytes()).hexdigest() == _job(server).sha256
    assert not server.faults, "the fault was exercised"
    assert stats.retries >= 1 or stats.restarts_from_zero >= 1
    if fault in ("ignore_range", "corrupt"):
        assert stats.restarts_from_zero == 1
    assert not _leftovers(tmp_path)


def test_retry_counter_resets_when_bytes_arrive(server, tmp_path):
    # ten cuts in a row, but each delivers bytes: four retries allowed in a row are enough
    server.faults = ["cut"] * 10
    _, stats = download_file(_job(server), tmp_path, FAST)
    assert stats.retries == 10


def test_failures_end_clean(server, tmp_path):
    target = hub.library_path(tmp_path, REPO, FILE)
    cases = [
        (["401"], set(), hub.GatedRepoError, "HF_TOKEN"),
        (["403"], set(), hub.GatedRepoError, "gated"),
        (["404"], set(), hub.RemoteNotFoundError, "404"),
        ([], {"corrupt"}, downloads.IntegrityError, "still wrong"),
        ([], {"500"}, downloads.DownloadInterruptedError, "gave up"),
        ([], {"429"}, hub.RateLimitedError, "429"),
    ]
    for faults, sticky, error, message in cases:
        server.faults, server.sticky = list(faults), set(sticky)
        with pytest.raises(error, match=message):
            download_file(_job(server), tmp_path, FAST)
        assert not target.exists() and not _leftovers(tmp_path), (faults, sticky)
    server.sticky = set()
    with pytest.raises(hub.GatedRepoError, match="token"):
        download_file(_job(server, "m.gguf", "org/gated"), tmp_path, FAST)


def test_resume_uses_range_and_bad_partial_restarts(server, tmp_path):
    job = _job(server)
    data = server.repos[REPO].files[FILE]
    part = partial_path(hub.library_path(tmp_path, REPO, FILE))
    part.parent.mkdir(parents=True)
    part.write_bytes(data[:100_000])
    _, stats = download_file(job, tmp_path, FAST)
    assert stats.resumed_from == 100_000 and stats.restarts_from_zero == 0
    # any entry: under heavy load a request the client gave up on may be logged after the one that served it
    served = [e for e in server.log if e["range"] == "bytes=100000-"]
    assert served and any(e["sent"] == SIZE - 100_000 for e in served)

    hub.library_path(tmp_path, REPO, FILE).unlink()
    part.write_bytes(b"\0" * 50_000)  # not a prefix of the file: the checksum catches it
    path, stats = download_file(_job(server), tmp_path, FAST)
    assert path.read_bytes() == data and stats.restarts_from_zero == 1

    path.unlink()
    part.write_bytes(data + b"extra")  # longer than the file: dropped before any request
    assert download_file(_job(server), tmp_path, FAST)[0].read_bytes() == data


def test_sha_from_etag_when_metadata_has_none(server, tmp_path):
    job = DownloadJob(REPO, FILE)  # no size, no sha256: learnt from X-Linked-Etag / Content-Length
    server.faults = ["corrupt"]
    path, stats = download_file(job, tmp_path, FAST)
    assert job.sha256 == hashlib.sha256(path.read_bytes()).hexdigest() and stats.restarts_from_zero == 1


def test_disk_space_is_checked_before_downloading(server, tmp_path, monkeypatch):
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(downloads.shutil, "disk_usage", lambda p: usage(10**9, 10**9 - 1000, 1000))
    with pytest.raises(downloads.DiskSpaceError, match="free space"):
        download_file(_job(server), tmp_path, FAST)
    assert not [e for e in server.log if "/cdn/" in e["path"]] and not _leftovers(tmp_path)


def test_offline(server, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(hub.OfflineError, match="offline mode"):
        download_file(_job(server), tmp_path, FAST)
    monkeypatch.delenv("HF_HUB_OFFLINE")
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")
    with pytest.raises(hub.OfflineError, match="cannot reach"):
        download_file(_job(server), tmp_path, FAST)
    assert not _leftovers(tmp_path)


@pytest.mark.parametrize("filename", ["../../escape.gguf", "/abs.gguf", "C:\\x.gguf", "a/../../b.gguf"])
def test_hostile_names_never_write_outside(server, tmp_path, filename):
    root = tmp_path / "lib"
    with pytest.raises(hub.UnsafeNameError):
        download_file(DownloadJob(REPO, filename), root, FAST)
    with pytest.raises(hub.UnsafeNameError):
        download_file(DownloadJob("../evil", FILE), root, FAST)
    with pytest.raises(hub.UnsafeNameError):
        DownloadManager(root, autostart=False, state_file=tmp_path / "s.json").add(
            DownloadJob(REPO, filename)
        )
    assert not root.exists(), "nothing was created, not even folders"
    assert not list(tmp_path.parent.rglob("escape.gguf")) and not list(tmp_path.parent.rglob("b.gguf"))


def test_symlink_in_library_is_not_followed(server, tmp_path):
    root, outside = tmp_path / "lib", tmp_path / "outside"
    outside.mkdir()
    (root / "hub" / "org").mkdir(parents=True)
    (root / "hub" / "org" / "model-GGUF").symlink_to(outside)
    with pytest.raises(hub.UnsafeNameError):
        download_file(_job(server), root, FAST)
    assert not list(outside.iterdir())


def test_manager_queue_progress_and_parallelism(server, tmp_path):
    events, states = [], []
    manager = DownloadManager(
        tmp_path / "lib",
        parallel=2,
        settings=FAST,
        on_progress=events.append,
        on_state=lambda j: states.append((j.filename, j.state)),
        state_file=tmp_path / "state.json",
    )
    jobs = [manager.add(_job(server)), manager.add(_job(server, "sub/other-Q8_0.gguf"))]
    assert manager.add(_job(server)) is jobs[0], "adding twice returns the known job"
    assert manager.wait(timeout=20)
    assert [j.state for j in jobs] == ["done", "done"]
    last = [e for e in events if e.filename == FILE][-1]
    assert last.done == last.total == SIZE and last.speed > 0 and last.eta == 0
    assert ("sub/other-Q8_0.gguf", "running") in states
    assert json.loads((tmp_path / "state.json").read_text())["jobs"] == [], "finished jobs are not persisted"
    manager.close()


def _wait_for(predicate, timeout=10.0):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if predicate():
            return True
        time.sleep(0.01)
    return False


def test_pause_resume_cancel_and_restart(server, tmp_path):
    server.throttle = 200_000  # ~1 s for the file: time to pause it midway
    root, state = tmp_path / "lib", tmp_path / "state.json"
    part = partial_path(hub.library_path(root, REPO, FILE))
    manager = DownloadManager(root, parallel=1, settings=FAST, state_file=state)
    job = manager.add(_job(server))
    assert _wait_for(lambda: part.exists() and part.stat().st_size >= 3 * CHUNK)
    manager.pause(job.id)
    assert manager.wait([job.id], timeout=5) and job.state == "paused"
    paused_at = part.stat().st_size
    assert json.loads(state.read_text())["jobs"][0]["state"] == "paused"
    n = len(server.log)
    manager.resume(job.id)
    assert manager.wait([job.id], timeout=10) and job.state == "done"
    resumed = [e for e in server.log[n:] if e["path"].startswith("/cdn/")]
    assert resumed[0]["range"] == f"bytes={paused_at}-", "pause/resume re-fetches nothing already on disk"

    other = manager.add(_job(server, "sub/other-Q8_0.gguf"))
    other_part = partial_path(hub.library_path(root, REPO, "sub/other-Q8_0.gguf"))
    assert _wait_for(lambda: other_part.exists() and other_part.stat().st_size > 0)
    manager.cancel(other.id)
    assert manager.wait([other.id], timeout=5) and other.state == "cancelled"
    assert not other_part.exists() and not hub.library_path(root, REPO, "sub/other-Q8_0.gguf").exists()
    manager.close()

    # an app restart: close() mid-download persists the job, a new manager resumes it by itself
    hub.library_path(root, REPO, FILE).unlink()
    first = DownloadManager(root, parallel=1, settings=FAST, state_file=state)
    again = first.add(_job(server))
    assert _wait_for(lambda: part.exists() and part.stat().st_size >= 2 * CHUNK)
    first.close()
    assert json.loads(state.read_text())["jobs"][0]["state"] == "queued" and again.state == "queued"
    kept = part.stat().st_size
    n = len(server.log)
    second = DownloadManager(root, parallel=1, settings=FAST, state_file=state)
    assert second.wait(timeout=10)
    assert second.get(again.id).state == "done"
    assert [e for e in server.log[n:] if e["path"].startswith("/cdn/")][0]["range"] == f"bytes={kept}-"
    second.close()
    assert not _leftovers(root)


def test_tampered_state_file_cannot_escape(tmp_path, server):
    state = tmp_path / "state.json"
    state.write_text(
        json.dumps({"jobs": [{"repo_id": REPO, "filename": "../../x.gguf", "state": "queued"}, {"bad": 1}]})
    )
    manager = DownloadManager(tmp_path / "lib", settings=FAST, state_file=state, autostart=False)
    assert manager.jobs() == []


def test_manager_reports_failures(server, tmp_path):
    server.faults = ["404"]
    manager = DownloadManager(tmp_path / "lib", settings=FAST, state_file=tmp_path / "s.json")
    job = manager.add(_job(server))
    assert manager.wait(timeout=10) and job.state == "failed" and "404" in job.error
    server.faults = []
    manager.resume(job.id)
    assert manager.wait(timeout=10) and job.state == "done"
    manager.close()
    assert threading.active_count() < 50


def _vision_repo(server, files: dict[str, bytes], repo="org/vision-GGUF") -> tuple[str, tuple]:
    server.add_repo(repo, files)
    return repo, hub.repo_details(repo, with_card=False).files


def test_vision_tower_goes_into_the_models_folder_through_the_same_machinery(server, tmp_path):
    root = tmp_path / "lib"
    tower_bytes = payload(40_000, 5)
    repo, files = _vision_repo(
        server,
        {
            "BF16/m-BF16-00001-of-00002.gguf": payload(9_000, 3),
            "BF16/m-BF16-00002-of-00002.gguf": payload(9_000, 4),
            "m-Q4_K_M.gguf": payload(5_000, 6),
            "mmproj-m-f16.gguf": tower_bytes,
            "mmproj-m-Q8_0.gguf": payload(20_000, 7),
        },
    )
    job = downloads.vision_tower_job(repo, files, "BF16/m-BF16-00001-of-00002.gguf", "main", root)
    assert (job.filename, job.beside, job.size) == (
        "mmproj-m-f16.gguf",
        "BF16/m-BF16-00001-of-00002.gguf",
        40_000,
    )
    assert job.sha256 == hashlib.sha256(tower_bytes).hexdigest()
    target = root / "hub" / "org" / "vision-GGUF" / "BF16" / "mmproj-m-f16.gguf"
    assert downloads.target_path(job, root) == target and job.id.endswith(":BF16/mmproj-m-f16.gguf")
    top = downloads.vision_tower_job(repo, files, "m-Q4_K_M.gguf", "main", root)
    assert top.id != job.id and downloads.target_path(top, root) == target.parent.parent / "mmproj-m-f16.gguf"

    server.faults = ["cut", "corrupt"]  # resumed after a cut, then the sha256 catches a flipped byte
    manager = DownloadManager(root, settings=FAST, state_file=tmp_path / "s.json")
    manager.add(job)
    assert manager.wait(timeout=20) and job.state == "done", job.error
    assert target.read_bytes() == tower_bytes and manager.stats[job.id].restarts_from_zero == 1
    assert not server.faults
    manager.close()
    assert downloads.vision_tower_job(repo, files, "BF16/m-BF16-00001-of-00002.gguf", "main", root) is None, (
        "a folder with a tower gets no second one"
    )
    assert not [e for e in server.log if e["path"].endswith(hashlib.sha256(payload(20_000, 7)).hexdigest())]


def test_no_vision_tower_job_without_a_tower_or_for_a_tower(server, tmp_path):
    repo, files = _vision_repo(server, {"m-Q4_K_M.gguf": payload(100, 1), "mmproj-f16.gguf": payload(50, 2)})
    assert downloads.vision_tower_job(repo, files, "mmproj-f16.gguf", "main", tmp_path) is None
    assert downloads.vision_tower_job(REPO, hub.repo_details(REPO).files, FILE, "main", tmp_path) is None


def test_vision_tower_disk_full_and_hostile_beside(server, tmp_path, monkeypatch):
    repo, files = _vision_repo(
        server, {"m-Q4_K_M.gguf": payload(100, 1), "mmproj-f16.gguf": payload(5000, 2)}
    )
    job = downloads.vision_tower_job(repo, files, "m-Q4_K_M.gguf", "main", tmp_path)
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(downloads.shutil, "disk_usage", lambda p: usage(10**9, 10**9 - 1000, 1000))
    with pytest.raises(downloads.DiskSpaceError, match="free space"):
        download_file(job, tmp_path, FAST)
    for beside in ("../../x.gguf", "/abs.gguf"):
        with pytest.raises(hub.UnsafeNameError):
            DownloadJob(repo, "mmproj-f16.gguf", beside=beside).validate()
