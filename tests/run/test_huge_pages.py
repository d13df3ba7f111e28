"""hetero.run.huge_pages: the environment that asks glibc's malloc for transparent huge pages, and what it tells."""

from hetero.run import huge_pages


def test_the_tunable_is_added_once_beside_the_users_own():
    assert huge_pages.env({}) == {"GLIBC_TUNABLES": "glibc.malloc.hugetlb=1"}
    assert huge_pages.env({"GLIBC_TUNABLES": "glibc.malloc.arena_max=2"}) == \
        {"GLIBC_TUNABLES": "glibc.malloc.arena_max=2:glibc.malloc.hugetlb=1"}
    assert huge_pages.env({"GLIBC_TUNABLES": "glibc.malloc.hugetlb=1"}) == {}
    assert huge_pages.env({"GLIBC_TUNABLES": "glibc.malloc.arena_max=2:glibc.malloc.hugetlb=0"}) == {}  # theirs


def test_in_use_needs_the_tunable_and_a_kernel_mode_that_honours_it(tmp_path, monkeypatch):
    mode = tmp_path / "enabled"
    monkeypatch.setattr(huge_pages, "THP_MODE", mode)
    asked = {"GLIBC_TUNABLES": "glibc.malloc.hugetlb=1"}
    for text, expected in (("always [madvise] never\n", "madvise"), ("[always] madvise never\n", "always"),
                           ("always madvise [never]\n", "never")):
        mode.write_text(text)
        assert huge_pages.mode() == expected
        assert huge_pages.in_use(asked) == (expected != "never")
        assert not huge_pages.in_use({})
        assert not huge_pages.in_use({"GLIBC_TUNABLES": "glibc.malloc.hugetlb=0"})
    mode.unlink()
    assert huge_pages.mode() is None and not huge_pages.in_use(asked)
