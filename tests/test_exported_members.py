import asyncgen


def test_all_is_sorted_and_complete():
    assert asyncgen.__all__ == sorted(asyncgen.__all__)
    public = {name for name in dir(asyncgen) if not name.startswith("_")}
    # Subpackages that importing the package makes visible are modules, not API members.
    modules = {"config", "engine", "errors", "outputs", "sampling_params", "model", "worker", "fetch", "openai", "metrics", "structured", "tools", "reasoning", "regex"}
    assert public - modules == set(asyncgen.__all__)


def test_every_exported_member_exists():
    for name in asyncgen.__all__:
        assert getattr(asyncgen, name) is not None
