from __future__ import annotations

from slicebox.core.recent import Recent


def test_the_least_recently_used_entry_goes_first_and_a_get_counts_as_a_use() -> None:
    recent: Recent[str, int] = Recent(2)
    recent.put("a", 1)
    recent.put("b", 2)
    assert recent.get("a") == 1  # a is now the most recently used
    recent.put("c", 3)
    assert "b" not in recent
    assert (recent.get("a"), recent.get("c")) == (1, 3)


def test_put_again_replaces_and_pop_of_a_missing_key_is_fine() -> None:
    recent: Recent[str, int] = Recent(2)
    recent.put("a", 1)
    recent.put("a", 2)
    assert recent.get("a") == 2
    recent.pop("a")
    recent.pop("a")
    assert recent.get("a") is None
    assert "a" not in recent
