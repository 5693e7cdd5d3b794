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
from tests.models.hubserver import TOKEN, HubServer, isolate_hf, mmproj_bytes, payload

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

    target.parent.mkdir(parents=True)
    (target.parent / "m-BF16-00001-of-00002.gguf").write_bytes(payload(9_000, 3))  # its model is there
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


# ------------------------------------------------------------ a tower's header, read before it is fetched


def _cdn_requests(server, data: bytes) -> list[dict]:
    sha = hashlib.sha256(data).hexdigest()
    return [e for e in server.log if e["path"] == f"/cdn/{sha}"]


def test_a_tower_hearth_cannot_read_is_not_fetched_its_header_says_so(server, tmp_path, monkeypatch):
    root = tmp_path / "lib"
    llava = mmproj_bytes(tmp_path / "a.gguf", "llava", 400_000)
    repo, files = _vision_repo(server, {"m-Q4_K_M.gguf": payload(5_000, 1), "mmproj-m-f16.gguf": llava})
    choice = downloads.vision_tower(repo, files, "m-Q4_K_M.gguf", "main", root)
    assert choice.job is None
    assert choice.note.startswith("vision tower not fetched: projector llava is not one Hearth reads")
    assert "m-Q4_K_M.gguf works for text" in choice.note and "gemma3" in choice.note
    reads = _cdn_requests(server, llava)
    assert [e["range"] for e in reads] == ["bytes=0-65535"], "one Range request for the first 64 KiB"
    assert server.sent_bytes(reads[0]["path"]) <= 65536 and not root.exists()

    # a header larger than the first read: the read grows until the key/value section is whole
    big = mmproj_bytes(tmp_path / "b.gguf", "llava", 600_000, kv_padding=150_000)
    repo, files = _vision_repo(server, {"m-Q4_0.gguf": payload(5_000, 2), "mmproj-big.gguf": big}, "org/big")
    assert downloads.vision_tower(repo, files, "m-Q4_0.gguf", "main", root).note is not None
    assert [e["range"] for e in _cdn_requests(server, big)] == ["bytes=0-65535", "bytes=0-262143"]

    # an audio-only projector (no vision encoder) is skipped too
    audio = mmproj_bytes(tmp_path / "c.gguf", "ultravox", 100_000, has_vision=False)
    repo, files = _vision_repo(server, {"m-Q8_0.gguf": payload(5_000, 3), "mmproj-a.gguf": audio}, "org/au")
    assert "no vision encoder" in downloads.vision_tower(repo, files, "m-Q8_0.gguf", "main", root).note

    # a gated repo: the header request carries the user's token to the Hub, and not on to the CDN
    gated = mmproj_bytes(tmp_path / "d.gguf", "llava", 100_000)
    server.add_repo("org/gated-vision", {"m-Q4_0.gguf": payload(500, 4), "mmproj.gguf": gated}, gated=True)
    monkeypatch.setenv("HF_TOKEN", TOKEN)
    files = hub.repo_details("org/gated-vision", with_card=False).files
    assert downloads.vision_tower("org/gated-vision", files, "m-Q4_0.gguf", "main", root).note is not None
    asked = [e for e in server.log if e["path"] == "/org/gated-vision/resolve/main/mmproj.gguf"]
    assert asked and asked[-1]["auth"] == f"Bearer {TOKEN}" and asked[-1]["range"] == "bytes=0-65535"
    assert _cdn_requests(server, gated)[-1]["auth"] is None


def test_a_tower_hearth_reads_is_fetched_after_its_header_and_unreadable_headers_fall_back(
    server, tmp_path, monkeypatch
):
    root = tmp_path / "lib"
    gemma = mmproj_bytes(tmp_path / "a.gguf", "gemma3", 300_000)
    repo, files = _vision_repo(server, {"m-Q4_K_M.gguf": payload(5_000, 1), "mmproj-m-f16.gguf": gemma})
    choice = downloads.vision_tower(repo, files, "m-Q4_K_M.gguf", "main", root)
    assert choice.note is None and choice.job.filename == "mmproj-m-f16.gguf"
    assert [e["range"] for e in _cdn_requests(server, gemma)] == ["bytes=0-65535"]

    # a server that ignores Range answers 200: only the first bytes are read before hanging up
    llava = mmproj_bytes(tmp_path / "b.gguf", "llava", 2_000_000)
    repo, files = _vision_repo(server, {"m-Q4_0.gguf": payload(500, 2), "mmproj-x.gguf": llava}, "org/nr")
    server.faults = ["ignore_range"]
    assert downloads.vision_tower(repo, files, "m-Q4_0.gguf", "main", root).job is None
    assert not server.faults and _cdn_requests(server, llava)[-1]["status"] == 200

    # the header cannot be had (a Hub error, offline mode, bytes that are no GGUF): fetched as before
    server.faults = ["500"]
    assert downloads.vision_tower(repo, files, "m-Q4_0.gguf", "main", root).job is not None
    assert not server.faults
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    time.sleep(0.2)  # the server logs a response after sending it
    n = len(server.log)
    assert downloads.vision_tower(repo, files, "m-Q4_0.gguf", "main", root).job is not None
    assert len(server.log) == n, "offline: no request"
    monkeypatch.delenv("HF_HUB_OFFLINE")
    raw = {"m.gguf": payload(500, 3), "mmproj-raw.gguf": payload(9_000, 4)}
    repo, files = _vision_repo(server, raw, "org/r")
    assert downloads.vision_tower(repo, files, "m.gguf", "main", root).job is not None
    assert downloads.vision_tower(repo, files, "m.gguf", "main", root, read_header=False).job is not None


# ---------------------------------------------------------------------------- a tower follows its model


def _model_and_tower(server, tmp_path, tower_size=20_000, model_size=SIZE, repo="org/follow-GGUF"):
    model = payload(model_size, 11)
    tower = mmproj_bytes(tmp_path / f"t{tower_size}.gguf", "gemma3", tower_size)
    server.add_repo(repo, {"m-Q4_K_M.gguf": model, "mmproj-m-f16.gguf": tower})
    files = hub.repo_details(repo, with_card=False).files
    by = {f.path: f for f in files}
    f = by["m-Q4_K_M.gguf"]
    model_job = DownloadJob(repo, f.path, size=f.size, sha256=f.sha256)
    tower_job = downloads.vision_tower_job(repo, files, f.path, "main", tmp_path / "lib")
    assert tower_job is not None
    return model_job, tower_job


def test_cancelling_a_model_cancels_its_tower_and_leaves_no_tower_behind(server, tmp_path):
    root = tmp_path / "lib"
    folder = root / "hub" / "org" / "follow-GGUF"
    server.throttle = 200_000
    # the tower (small) is done while the model still runs: cancelling the model deletes the lone tower
    manager = DownloadManager(root, parallel=2, settings=FAST, state_file=tmp_path / "s.json")
    model, tower = _model_and_tower(server, tmp_path)
    model, tower = manager.add(model), manager.add(tower)
    assert manager.towers_of(model.id) == [tower] and manager.towers_of(tower.id) == []
    assert manager.wait([tower.id], timeout=10) and tower.state == "done"
    assert (folder / "mmproj-m-f16.gguf").is_file() and model.state == "running"
    manager.cancel(model.id)
    assert manager.wait(timeout=10) and model.state == "cancelled"
    assert not folder.exists() or not list(folder.iterdir()), "no model, no tower, no partial"

    # both running: both stop, both partials go
    model2, tower2 = _model_and_tower(server, tmp_path, tower_size=400_000, repo="org/both-GGUF")
    model2, tower2 = manager.add(model2), manager.add(tower2)
    assert _wait_for(lambda: model2.state == tower2.state == "running")
    manager.cancel(model2.id)
    assert manager.wait(timeout=10) and (model2.state, tower2.state) == ("cancelled", "cancelled")
    assert not _leftovers(root) and not list((root / "hub" / "org" / "both-GGUF").glob("*.gguf"))
    manager.close()

    # the tower still queued behind the model (one at a time): cancelled with it at once
    manager = DownloadManager(root, parallel=1, settings=FAST, state_file=tmp_path / "s2.json")
    model3, tower3 = _model_and_tower(server, tmp_path, repo="org/queued-GGUF")
    model3, tower3 = manager.add(model3), manager.add(tower3)
    assert _wait_for(lambda: model3.state == "running")
    manager.cancel(model3.id)
    assert tower3.state == "cancelled"
    assert manager.wait(timeout=10) and model3.state == "cancelled"
    manager.close()
    assert not _leftovers(root)


def test_cancelling_the_tower_alone_leaves_the_model_and_pause_resume_carry_the_tower(server, tmp_path):
    root = tmp_path / "lib"
    folder = root / "hub" / "org" / "follow-GGUF"
    server.throttle = 400_000
    manager = DownloadManager(root, parallel=2, settings=FAST, state_file=tmp_path / "s.json")
    model, tower = _model_and_tower(server, tmp_path, tower_size=300_000)
    model, tower = manager.add(model), manager.add(tower)
    assert _wait_for(lambda: model.state == tower.state == "running")
    manager.pause(model.id)
    assert manager.wait(timeout=10) and (model.state, tower.state) == ("paused", "paused")
    manager.resume(model.id)
    assert (model.state, tower.state) == ("queued", "queued")
    assert _wait_for(lambda: tower.state == "running")
    manager.pause(tower.id)
    assert manager.wait([tower.id], timeout=10) and tower.state == "paused"
    assert model.state in ("running", "done"), "pausing the tower leaves its model going"
    manager.cancel(tower.id)
    assert tower.state == "cancelled"
    assert manager.wait(timeout=10) and model.state == "done"
    assert [p.name for p in folder.iterdir()] == ["m-Q4_K_M.gguf"]
    manager.close()


def test_a_tower_that_arrives_after_its_model_was_deleted_is_not_kept(server, tmp_path):
    root = tmp_path / "lib"
    server.throttle = 150_000
    manager = DownloadManager(root, parallel=1, settings=FAST, state_file=tmp_path / "s.json")
    model, tower = _model_and_tower(server, tmp_path, tower_size=150_000, model_size=10_000)
    model, tower = manager.add(model), manager.add(tower)
    assert _wait_for(lambda: tower.state == "running")
    target = downloads.target_path(model, root)
    assert model.state == "done" and target.is_file()
    target.unlink()  # what the library's Delete does with a downloaded model
    assert manager.wait(timeout=10) and tower.state == "cancelled" and "not kept" in tower.note
    assert not list(target.parent.iterdir())
    manager.close()


def test_free_space_is_checked_for_the_model_and_its_tower_together(server, tmp_path, monkeypatch):
    root = tmp_path / "lib"
    model, tower = _model_and_tower(server, tmp_path, tower_size=100_000)
    usage = namedtuple("usage", "total used free")
    need = model.size + tower.size
    monkeypatch.setattr(downloads.shutil, "disk_usage", lambda p: usage(10**9, 10**9 - need, need - 1))
    with pytest.raises(downloads.DiskSpaceError) as e:
        downloads.check_free_space([model, tower], root, margin=0)
    message = str(e.value)
    assert f"the model needs {model.size / 2**20:,.1f} MiB" in message
    assert f"its vision tower {tower.size / 2**20:,.1f} MiB" in message
    assert f"has {(need - 1) / 2**20:,.1f} MiB free" in message and str(tmp_path) in message
    downloads.check_free_space([model], root, margin=0)  # each alone would fit
    downloads.check_free_space([tower], root, margin=0)
    # bytes already in a partial count as fetched
    part = partial_path(downloads.target_path(model, root))
    part.parent.mkdir(parents=True)
    part.write_bytes(b"x" * 10)
    downloads.check_free_space([model, tower], root, margin=0)
