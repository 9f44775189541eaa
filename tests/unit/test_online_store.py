"""Promoted heads on disk (decode/spec/online/store.py): a restarted trainer resumes, per tenant,
the newest version that held up over its window, for the same target weights and base head; a
version on probation or rolled back is never resumed; numbers continue past every saved one."""
import pytest
import torch

from decode.spec.online.store import HeadStore

NAMES = ("a.weight", "b.weight")


def _tensors(value: float) -> dict[str, torch.Tensor]:
    return {n: torch.full((2, 3), value) for n in NAMES}


def _everyone(tenant: str) -> bool:
    return True


def test_the_newest_kept_version_is_resumed(tmp_path):
    store = HeadStore(tmp_path, "fp-1", "head-a")
    for version, state in ((1, "kept"), (2, "kept"), (3, "rolled_back"), (4, "promoted")):
        store.save("acme", version, _tensors(version))
        store.mark("acme", version, state)
    [resumed] = HeadStore(tmp_path, "fp-1", "head-a").resume(NAMES, _everyone)
    assert (resumed.tenant, resumed.version, resumed.next_version) == ("acme", 2, 5)
    assert all(torch.equal(resumed.tensors[n], torch.full((2, 3), 2.0)) for n in NAMES)


def test_versions_for_other_weights_or_another_base_head_are_not_resumed(tmp_path):
    HeadStore(tmp_path, "fp-old", "head-a").save("acme", 1, _tensors(1))
    HeadStore(tmp_path, "fp-old", "head-a").mark("acme", 1, "kept")
    HeadStore(tmp_path, "fp-1", "head-b").save("acme", 2, _tensors(2))
    HeadStore(tmp_path, "fp-1", "head-b").mark("acme", 2, "kept")
    [resumed] = HeadStore(tmp_path, "fp-1", "head-a").resume(NAMES, _everyone)
    assert (resumed.version, resumed.tensors, resumed.next_version) == (None, None, 3)


def test_tenants_stay_apart_and_only_opted_in_ones_resume(tmp_path):
    store = HeadStore(tmp_path, "fp", "head")
    for tenant, version in (("acme", 1), ("other", 1), ("", 2)):
        store.save(tenant, version, _tensors(version))
        store.mark(tenant, version, "kept")
    resumed = store.resume(NAMES, lambda tenant: tenant != "other")
    assert sorted((r.tenant, r.version) for r in resumed) == [("", 2), ("acme", 1)]
    assert (tmp_path / "_anonymous" / "v2" / "state").read_text() == "kept"


def test_a_file_with_other_tensors_is_refused_and_no_directory_writes_nothing(tmp_path):
    store = HeadStore(tmp_path, "fp", "head")
    store.save("acme", 1, {"a.weight": torch.zeros(2)})
    store.mark("acme", 1, "kept")
    with pytest.raises(ValueError, match="must carry exactly"):
        store.resume(NAMES, _everyone)
    with pytest.raises(ValueError, match="is one of"):
        store.mark("acme", 1, "maybe")
    nowhere = HeadStore(None, "fp", "head")
    nowhere.save("acme", 1, _tensors(1))
    nowhere.mark("acme", 1, "kept")
    assert nowhere.resume(NAMES, _everyone) == []
