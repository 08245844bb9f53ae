"""`StorageTracker` against hand counts: new storages, views, deaths, and storages resized in
place (as FSDP2 frees and re-allocates its unsharded parameters)."""

from __future__ import annotations

import torch

from scheduler.measurement.storage import StorageTracker


def test_it_counts_new_storages_once_and_their_deaths() -> None:
    t = StorageTracker()
    with t:
        a = torch.zeros(256)  # 1 KiB
        v = a.view(16, 16)  # a view: nothing new
        b = a + 1
        assert t.current_bytes == 2048
        del a, v, b
    assert t.current_bytes == 0 and t.peak_bytes == 2048


def test_a_storage_resized_in_place_is_recounted_when_told() -> None:
    t = StorageTracker()
    with t:
        a = torch.zeros(256)
    st = a.untyped_storage()
    st.resize_(0)  # (no op dispatch sees this)
    assert t.current_bytes == 1024
    t.resized(a)
    assert t.current_bytes == 0
    st.resize_(2048)
    t.resized(a)
    assert t.current_bytes == 2048 and t.peak_bytes == 2048
    del a, st
    assert t.current_bytes == 0  # (its death subtracts its size now, not its first one)
