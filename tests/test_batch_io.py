"""Saved E/U batches: a reloaded run reproduces the original bit for bit; the fingerprint's file
digests are of whole files; a pair is saved as one unit; loaded contents are checked."""
from __future__ import annotations

import errno
import hashlib
import json
import os
import shutil
from dataclasses import fields
from pathlib import Path

import pytest
import torch

from conftest import DATA, compose_cfg
from entprobe.config import ConfigError
from entprobe.cli.probe_job import run
from entprobe.runtime.input_files import InputFileError
from entprobe.pipeline.config_checks import to_typed
from entprobe.rollouts.saved_batches import (BatchSaveError, check_saved, check_tokens, load_batches, model_identity,
                                             save_batches)
from entprobe.rollouts.sampling import RolloutBatch

KEYS = ("deltaH1", "SE_deltaH1", "deltaH_true", "deltaH1_step", "H_orig", "bars_dot")


def test_loaded_batches_reproduce_the_run_bit_for_bit(tmp_path):
    saved = tmp_path / "batches"
    first = run(compose_cfg(tmp_path / "a", f"batch.save='{saved}'"))
    assert sorted(p.name for p in saved.iterdir()) == [".lock", "E.pt", "U.pt", "batches.json"]
    again = run(compose_cfg(tmp_path / "b", f"batch.load='{saved}'", "seed=13"))  # not a sampling seed
    for k in KEYS:
        assert again[k] == first[k], k  # bit-identical, not approximately equal
    for k in ("batch_E/reward_mean", "batch_U/reward_mean", "batch_E/mean_gen_length"):
        assert again[k] == first[k], k
    # Other sampling seeds would record draws the run did not make: refused, naming the key.
    with pytest.raises(ConfigError, match=r"sampled with batch\.seed_E=1, the config says batch\.seed_E=11"):
        run(compose_cfg(tmp_path / "c", f"batch.load='{saved}'", "batch.seed_E=11"))


def _batch(seed: int) -> RolloutBatch:
    g = torch.Generator().manual_seed(seed)
    B, G, T = 3, 2, 7
    resp = torch.zeros(B, G, T, dtype=torch.long)
    resp[..., 4:] = (torch.rand(B, G, 3, generator=g) < 0.8).long()
    return RolloutBatch(
        input_ids=torch.randint(0, 18, (B, G, T), generator=g),
        attention_mask=torch.ones(B, G, T, dtype=torch.long),
        response_mask=resp,
        sampler_logprobs=-torch.rand(B, G, T, generator=g) * resp,
        rewards=torch.rand(B, G, generator=g).round(),
        advantages=torch.randn(B, G, generator=g),
        prompt_index=torch.tensor([5, 0, 2]),
        temperature=0.7,
    )


def test_rollout_batch_save_load_round_trip(tmp_path):
    b = _batch(0)
    b.save(tmp_path / "sub" / "E.pt")  # creates the folder, writes atomically
    assert sorted(p.name for p in (tmp_path / "sub").iterdir()) == ["E.pt"]
    c = RolloutBatch.load(tmp_path / "sub" / "E.pt")
    for f in fields(RolloutBatch):
        x, y = getattr(b, f.name), getattr(c, f.name)
        if isinstance(x, torch.Tensor):
            assert x.dtype == y.dtype and torch.equal(x, y), f.name
        else:
            assert x == y, f.name
    assert torch.equal(c.Lmax, b.Lmax) and torch.equal(c.S_sampler, b.S_sampler)


def test_loading_with_a_different_G_is_refused(tmp_path):
    saved = tmp_path / "batches"
    _batch(1).save(saved / "E.pt")
    _batch(2).save(saved / "U.pt")
    with pytest.raises(ConfigError, match=r"the saved E has G=2 responses per prompt, the config batch\.G=4; set batch\.G=2"):
        run(compose_cfg(tmp_path / "run", f"batch.load='{saved}'"))
    assert not (tmp_path / "run" / "results.json").exists()


# ----------------------------------------------------------------------------- full file digests
def test_a_mid_file_overwrite_changes_the_digest_the_chunked_one_missed(tmp_path, monkeypatch):
    """200 kB overwritten between two of the 16 sampled chunks of a 4.7 MB weights file, size and
    mtime kept: the chunked digest of earlier fingerprints did not move, the full sha256 does."""
    from entprobe.rollouts.saved_batches import file_digest

    monkeypatch.setenv("ENTPROBE_DIGEST_CACHE", str(tmp_path / "digests.json"))
    f = tmp_path / "model.safetensors"
    size = 4_700_000
    f.write_bytes(bytes(size))
    st = f.stat()
    full, chunked = file_digest(f), file_digest(f, full=False)
    step = (size - (1 << 16)) // 15  # the chunks start at multiples of it
    with open(f, "r+b") as fh:
        fh.seek(step + (1 << 16) + 1000)
        fh.write(b"\x01" * 200_000)
    os.utime(f, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert f.stat().st_size == size and f.stat().st_mtime_ns == st.st_mtime_ns
    assert file_digest(f, full=False) == chunked  # the defect: batches of the old model loaded into this one
    assert file_digest(f) != full


def test_the_digest_cache_is_hit_while_unchanged_and_invalidated_by_any_change(tmp_path, monkeypatch):
    from entprobe.runtime import file_digest as fd

    cache = tmp_path / "cache" / "digests.json"
    monkeypatch.setenv("ENTPROBE_DIGEST_CACHE", str(cache))
    hashed = []
    real = fd.hash_file
    monkeypatch.setattr(fd, "hash_file", lambda p: (hashed.append(p), real(p))[1])
    f = tmp_path / "w.bin"
    f.write_bytes(b"a" * 1000)
    first = fd.sha256_file(f)
    assert first == hashlib.sha256(b"a" * 1000).hexdigest() and len(hashed) == 1 and cache.is_file()
    assert fd.sha256_file(f) == first and len(hashed) == 1  # remembered
    st = f.stat()
    os.utime(f, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))  # mtime only
    assert fd.sha256_file(f) == first and len(hashed) == 2
    f.write_bytes(b"a" * 1001)  # size
    assert fd.sha256_file(f) == hashlib.sha256(b"a" * 1001).hexdigest() and len(hashed) == 3
    other = tmp_path / "copy.bin"
    shutil.copy2(f, other)
    os.replace(other, f)  # same contents, another inode
    assert fd.sha256_file(f) != first and len(hashed) == 4
    assert fd.sha256_file(f) and len(hashed) == 4
    cache.write_text("{ not json")  # a corrupt cache is ignored, then rewritten
    assert fd.sha256_file(f) == hashlib.sha256(b"a" * 1001).hexdigest() and len(hashed) == 5
    assert str(f.resolve()) in json.loads(cache.read_text())
    monkeypatch.setenv("ENTPROBE_DIGEST_CACHE", "")  # no cache: every call hashes
    fd.sha256_file(f)
    assert len(hashed) == 6


# ----------------------------------------------------------------------------- a pair is one unit
def _saved_pair(folder: Path, seed: int) -> tuple[RolloutBatch, RolloutBatch]:
    E, U = _batch(seed), _batch(seed + 100)
    save_batches(folder, E, U, {"G": 2}, 5)
    return E, U


def _same(a: RolloutBatch, b: RolloutBatch) -> bool:
    return torch.equal(a.input_ids, b.input_ids) and torch.equal(a.advantages, b.advantages)


def test_a_save_killed_between_E_and_U_leaves_the_earlier_pair_whole(tmp_path, monkeypatch):
    folder = tmp_path / "b"
    E0, U0 = _saved_pair(folder, 0)
    assert set(json.loads((folder / "batches.json").read_text())["sha256"]) == {"E.pt", "U.pt"}
    real, calls = RolloutBatch.save, []

    def killed_at_U(self, path):
        calls.append(Path(path).name)
        if Path(path).name == "U.pt":
            raise KeyboardInterrupt  # SIGINT / SIGTERM turned into an exception, after E was written
        real(self, path)
    monkeypatch.setattr(RolloutBatch, "save", killed_at_U)
    with pytest.raises(KeyboardInterrupt):
        _saved_pair(folder, 1)
    assert calls == ["E.pt", "U.pt"]
    monkeypatch.setattr(RolloutBatch, "save", real)
    E, U, meta = load_batches(folder, 5)
    assert _same(E, E0) and _same(U, U0) and meta["G"] == 2
    # SIGKILL runs no handler: its staging folder stays, the next reader drops it
    (folder / ".saving-dead").mkdir()
    _batch(7).save(folder / ".saving-dead" / "E.pt")
    E, U, _ = load_batches(folder, 5)
    assert _same(E, E0) and _same(U, U0) and not (folder / ".saving-dead").exists()


def test_a_save_killed_while_moving_the_pair_in_is_finished_by_the_next_reader(tmp_path, monkeypatch):
    from entprobe.rollouts import saved_batches as sb

    folder = tmp_path / "b"
    _saved_pair(folder, 0)
    real_replace = os.replace

    def killed_after_E(src, dst):
        real_replace(src, dst)
        if Path(dst) == folder / "E.pt":  # moved into place (not the write into the staging folder)
            raise SystemExit(1)
    monkeypatch.setattr(sb.os, "replace", killed_after_E)  # os.replace itself, as atomic_io uses it too
    with pytest.raises(SystemExit):
        E1, U1 = _batch(1), _batch(101)
        save_batches(folder, E1, U1, {"G": 2}, 5)
    monkeypatch.setattr(sb.os, "replace", real_replace)
    assert sb.is_complete(folder)
    E, U, _ = load_batches(folder, 5)  # the committed pair, moved in whole
    assert _same(E, E1) and _same(U, U1)
    assert sorted(p.name for p in folder.iterdir()) == [".lock", "E.pt", "U.pt", "batches.json"]


def test_a_pair_left_half_moved_in_a_read_only_folder_is_refused(tmp_path):
    """When the committed pair cannot be moved in, the sha256 in batches.json catches the mix."""
    folder = tmp_path / "b"
    _saved_pair(folder, 0)
    _batch(9).save(folder / "E.pt")  # E of another save beside this pair's U and fingerprint
    with pytest.raises(InputFileError, match=r"E\.pt: not the file batches\.json beside it recorded"):
        load_batches(folder, 5)


def test_folders_of_the_earlier_layout_still_load(tmp_path):
    """tests/data/batches/*: E.pt, U.pt and batches.json without sha256 or digests."""
    for name in ("readme", "cold", "fsdp"):
        shutil.copytree(DATA / "batches" / name, tmp_path / name)
        E, U, meta = load_batches(tmp_path / name, 5)
        assert "sha256" not in meta and E.G == 4


def test_an_old_fingerprint_that_cannot_see_the_whole_model_is_refused(tmp_path, monkeypatch):
    """A batches.json without "digests" fingerprinted each model file by 16 chunks of 64 KiB. Up to
    16 x 64 KiB = 1 MiB they cover the file (a byte changed anywhere changes the digest: refused as
    other weights; the committed folders, of a 0.3 MB model, load); past it a byte between the
    chunks went unseen and the changed model was taken silently: such a fingerprint is refused,
    with what to do, whether or not the model changed."""
    monkeypatch.setenv("ENTPROBE_DIGEST_CACHE", "")  # every identity hashed from the files as they are now
    cfg = to_typed(compose_cfg(tmp_path, "batch.G=2", "batch.B_E=3", "batch.B_U=3", "sampling.temperature=0.7"))
    E, U = _batch(0), _batch(1)

    def model(size: int) -> Path:
        m = tmp_path / f"m{size}"
        m.mkdir()
        (m / "config.json").write_text("{}")
        (m / "tokenizer.json").write_text("{}")
        (m / "model.safetensors").write_bytes(bytes(range(256)) * (size // 256))
        return m

    def old_meta(m: Path) -> dict:  # what an entprobe before full digests recorded
        before = model_identity(m, None, None)["before"]
        return {"model": before["model"], "tokenizer": before["tokenizer"]}

    def flip(m: Path, at: int) -> None:
        data = bytearray((m / "model.safetensors").read_bytes())
        data[at] ^= 0xFF
        (m / "model.safetensors").write_bytes(bytes(data))

    whole = model(16 << 16)  # exactly what 16 chunks of 64 KiB cover
    meta = old_meta(whole)
    check_saved(tmp_path, E, U, meta, cfg, model_identity(whole, None, None))
    for at in (0, (1 << 16) + 12345, (16 << 16) - 1):
        flip(whole, at)
        with pytest.raises(ConfigError, match="sampled by other model weights"):
            check_saved(tmp_path, E, U, meta, cfg, model_identity(whole, None, None))
        flip(whole, at)

    big = model(32 << 16)  # 2 MiB: the chunks leave 64 KiB gaps
    meta = old_meta(big)
    flip(big, (32 << 16) // 2 - 1000)  # between two chunks
    assert old_meta(big) == meta  # unseen: the old check took it
    with pytest.raises(ConfigError, match=rf"batch\.load={tmp_path}: batches\.json predates whole-file digests: "
                                          rf".*do not cover {big / 'model.safetensors'} \(over 1 MiB\).*save the "
                                          r"batches again from the model they came from, with the same model, "
                                          r"task and sampling keys: sampling\.temperature=0\.7 sampling\.top_k=0 "
                                          r"sampling\.top_p=1\.0 sampling\.max_new_tokens=\d+ batch\.G=2 "
                                          r"batch\.B_E=3 batch\.B_U=3 batch\.seed_E=\d+ batch\.seed_U=\d+ "
                                          r"batch\.advantage=\S+ batch\.adv_eps=\S+ batch\.save=DIR "
                                          r"\(batch\.load dropped\), then batch\.load=DIR$"):
        check_saved(tmp_path, E, U, meta, cfg, model_identity(big, None, None))
    full = model_identity(big, None, None)  # a fingerprint with digests: compared on the whole files
    check_saved(tmp_path, E, U, {"model": full["model"], "tokenizer": full["tokenizer"], "digests": "sha256"},
                cfg, full)

    committed = json.loads((DATA / "batches" / "readme" / "batches.json").read_text())
    ident = model_identity(DATA / "default_model", None, None)
    assert ident["before"]["unseen"] == ""  # every file of the committed model is read whole
    assert (committed["model"], committed["tokenizer"]) == (ident["before"]["model"], ident["before"]["tokenizer"])


def test_a_full_disk_names_the_folder_and_keeps_the_earlier_pair(tmp_path, monkeypatch):
    folder = tmp_path / "b"
    E0, U0 = _saved_pair(folder, 0)

    def no_space(self, path):
        raise OSError(errno.ENOSPC, "No space left on device")
    monkeypatch.setattr(RolloutBatch, "save", no_space)
    with pytest.raises(BatchSaveError, match=rf"batch\.save={folder}: cannot write the batches there \(No space "
                                             r"left on device\); free space or set batch\.save elsewhere"):
        _saved_pair(folder, 1)
    monkeypatch.undo()
    E, U, _ = load_batches(folder, 5)
    assert _same(E, E0) and _same(U, U0)
    assert not [p for p in folder.iterdir() if p.name.startswith(".saving")]


@pytest.mark.parametrize("edit, says", [
    (lambda b: b.input_ids.view(-1).__setitem__(0, -1), "negative token id -1"),
    (lambda b: b.response_mask[1, 0].zero_(), "response 0 of prompt 1 has no response tokens"),
    (lambda b: setattr(b, "advantages", torch.zeros(3, 3)), "advantages has shape (3, 3)"),
    (lambda b: b.advantages.view(-1).__setitem__(0, float("nan")), "advantages hold non-finite values"),
    (lambda b: b.advantages.view(-1).__setitem__(0, 1e7), "beyond +-1e+06"),
    (lambda b: b.rewards.view(-1).__setitem__(0, float("inf")), "rewards hold infinite values"),
    (lambda b: b.sampler_logprobs.view(-1).__setitem__(5, 0.5), "NaN or positive log-probabilities"),
    (lambda b: b.sampler_logprobs.view(-1).__setitem__(5, float("nan")), "NaN or positive log-probabilities"),
    (lambda b: b.attention_mask.view(-1).__setitem__(0, 2), "attention_mask holds values other than 0 and 1"),
])
def test_loaded_batch_contents_are_checked(tmp_path, edit, says):
    b = _batch(0)
    b.rewards[0, 0] = float("nan")  # an unscorable response is not a defect
    b.save(tmp_path / "ok.pt")
    RolloutBatch.load(tmp_path / "ok.pt")
    edit(b)
    b.save(tmp_path / "E.pt")
    with pytest.raises(InputFileError) as info:
        RolloutBatch.load(tmp_path / "E.pt")
    assert str(tmp_path / "E.pt") in str(info.value) and says in str(info.value)


def test_token_ids_beyond_the_vocabulary_name_the_file(tmp_path):
    E = _batch(0)
    check_tokens(tmp_path, E, E, 18)
    with pytest.raises(InputFileError, match=r"E\.pt: token id 17 is outside this model's vocabulary \(0\.\.16\)"):
        check_tokens(tmp_path, E, E, 17)


def test_concurrent_writers_leave_a_readable_digest_cache(tmp_path, monkeypatch):
    """Eight threads hashing eight files into one cache: each gets its file's digest, the cache
    stays valid JSON (atomic replaces; a lost entry is only hashed again)."""
    from concurrent.futures import ThreadPoolExecutor

    from entprobe.runtime import file_digest as fd

    cache = tmp_path / "digests.json"
    monkeypatch.setenv("ENTPROBE_DIGEST_CACHE", str(cache))
    files = []
    for i in range(8):
        files.append(tmp_path / f"f{i}")
        files[-1].write_bytes(bytes([i]) * 10_000)
    with ThreadPoolExecutor(8) as pool:
        got = list(pool.map(fd.sha256_file, files * 3))
    assert got == [hashlib.sha256(f.read_bytes()).hexdigest() for f in files * 3]
    assert set(json.loads(cache.read_text())) <= {str(f.resolve()) for f in files}
    assert not [p for p in tmp_path.iterdir() if p.name.endswith(".tmp")]


def test_the_sweep_cache_key_separates_what_the_fingerprint_refuses(tmp_path):
    """A single_batch job without importance saves E = U, and objective=trl tokenizes as TRL: a
    job that needs E drawn on its own, or tokenizes otherwise, must not hit that cache entry
    (check_saved would refuse it mid-sweep)."""
    from entprobe.cli.probe_job import to_typed
    from entprobe.reporting import sweep

    def key(*o: str) -> str:
        return sweep.batch_cache_key(to_typed(compose_cfg(tmp_path, *o)), 1)
    single = ("probe.mode=single_batch",)
    assert key(*single, "importance.enabled=false") != key(*single, "importance.enabled=true")
    assert key("model=hf", "model.path=/m", "objective=trl") != key("model=hf", "model.path=/m")
