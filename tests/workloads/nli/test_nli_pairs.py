"""The embedded docstring-code task: extraction, same-module negatives, a leak-free deterministic split."""

import textwrap
from pathlib import Path

import pytest

from comera.workloads.nli import pairs
from comera.workloads.nli.pairs import build_docstring_pairs, documented_functions, stdlib_modules

SOURCE = textwrap.dedent(
    '''
    import functools


    def area(width, height):
        """Return the area of a rectangle of the given width and height."""
        # multiply the sides
        return width * height


    def only_doc():
        """This function has nothing but its docstring."""


    def short():
        """Too short."""
        return 1


    class Shape:
        @functools.cache
        def perimeter(self, width, height):
            """Sum of the four sides of the rectangle.

            Twice the width plus twice the height.
            """
            return 2 * (width + height)

        if True:
            def hidden(self):
                """A method defined inside an if block."""
                return None
    '''
)


def test_documented_functions_pair_each_docstring_with_its_code_without_the_docstring():
    functions = documented_functions(SOURCE)
    assert [f.name for f in functions] == ["area", "perimeter", "hidden"]
    area, perimeter, hidden = functions
    assert area.doc == "Return the area of a rectangle of the given width and height."
    assert area.code == "def area(width, height):\n    # multiply the sides\n    return width * height"
    assert perimeter.doc == "Sum of the four sides of the rectangle. Twice the width plus twice the height."
    assert perimeter.code == (
        "@functools.cache\ndef perimeter(self, width, height):\n    return 2 * (width + height)"
    )
    assert hidden.code == "def hidden(self):\n    return None"
    assert documented_functions("def broken(:\n") == []


def _fake_library(root, modules=10, functions=3):
    """Modules whose functions are numbered so every code string names its module."""
    root.mkdir(exist_ok=True)
    for m in range(modules):
        body = "\n".join(
            f'def fn_{m}_{f}(value_{f}):\n    """Compute quantity {f} of module {m} from the value."""\n'
            f"    return value_{f} + {m * 10 + f}\n"
            for f in range(functions)
        )
        (root / f"mod{m}.py").write_text(body)
    (root / "test").mkdir()
    (root / "test" / "test_mod.py").write_text(body)
    (root / "site-packages").mkdir()
    (root / "site-packages" / "pkg.py").write_text(body)


def test_modules_skip_tests_and_site_packages(tmp_path):
    _fake_library(tmp_path, modules=2)
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "__init__.py").write_text("")
    (tmp_path / "pkg" / "sub.py").write_text("")
    assert list(stdlib_modules(tmp_path)) == ["mod0", "mod1", "pkg", "pkg.sub"]


def _module_of(code: str) -> str:
    return "mod" + code.split("fn_")[1].split("_")[0]


def test_split_by_module_with_same_module_negatives(tmp_path):
    _fake_library(tmp_path / "lib")
    splits, tokenizer, info = build_docstring_pairs(
        tmp_path / "cache",
        stdlib=tmp_path / "lib",
        train_pairs=12,
        validation_pairs=6,
        vocab_size=200,
        validation_fraction=0.5,
        max_length=64,
    )
    assert set(info["modules"]["train"]).isdisjoint(info["modules"]["validation"])
    assert len(splits["train"]) == 12 and len(splits["validation"]) == 6
    for name, examples in splits.items():
        assert examples.labels == [1, 0] * (len(examples) // 2)
        for doc, code, label in zip(examples.first, examples.second, examples.labels):
            module = "mod" + doc.split("module ")[1].split()[0]
            assert _module_of(code) == module and module in info["modules"][name]
            number = doc.split("quantity ")[1].split()[0]
            assert (f"value_{number} +" in code) == (label == 1)
    assert tokenizer.vocab_size <= 200 and tokenizer.max_length == 64


def test_build_is_deterministic_and_cached(tmp_path):
    _fake_library(tmp_path / "lib")
    options = {"stdlib": tmp_path / "lib", "train_pairs": 10, "validation_pairs": 4, "vocab_size": 200}
    first, tokenizer, _ = build_docstring_pairs(tmp_path / "a", **options)
    second, _, _ = build_docstring_pairs(tmp_path / "b", **options)
    cached, cached_tokenizer, info = build_docstring_pairs(tmp_path / "a", **options)
    for name in first:
        assert vars(first[name]) == vars(second[name]) == vars(cached[name])
    assert cached_tokenizer.tokenizer.get_vocab() == tokenizer.tokenizer.get_vocab()
    other_seed, _, _ = build_docstring_pairs(tmp_path / "a", seed=3, **options)
    assert vars(other_seed["train"]) != vars(first["train"])
    assert len(list((tmp_path / "a").glob("docstring-pairs-*"))) == 2


@pytest.mark.parametrize("name", ["pairs.json", "tokenizer.json"])
def test_a_damaged_cached_task_is_built_again_and_replaced(tmp_path, cache_damage, name, monkeypatch):
    _fake_library(tmp_path / "lib")
    options = {"stdlib": tmp_path / "lib", "train_pairs": 10, "validation_pairs": 4, "vocab_size": 200}
    clean, tokenizer, info = build_docstring_pairs(tmp_path / "cache", **options)
    file = Path(info["cache"]) / name
    cache_damage(file)
    with cache_damage.rebuilt(file):
        again, again_tokenizer, _ = build_docstring_pairs(tmp_path / "cache", **options)
    assert {split: vars(examples) for split, examples in again.items()} == {
        split: vars(examples) for split, examples in clean.items()
    }
    if name == "pairs.json":  # the vocabulary is kept: trained again, it may have other pieces and ids
        assert again_tokenizer.tokenizer.to_str() == tokenizer.tokenizer.to_str()
    monkeypatch.setattr(pairs, "train_wordpiece", lambda *args: pytest.fail("built again"))
    read, read_tokenizer, _ = build_docstring_pairs(tmp_path / "cache", **options)
    assert vars(read["train"]) == vars(clean["train"])
    assert read_tokenizer.tokenizer.to_str() == again_tokenizer.tokenizer.to_str()


def test_standard_library_split_has_no_module_on_both_sides(tmp_path):
    splits, tokenizer, info = build_docstring_pairs(
        tmp_path, train_pairs=40, validation_pairs=20, vocab_size=500
    )
    assert set(info["modules"]["train"]).isdisjoint(info["modules"]["validation"])
    assert len(splits["train"]) == 40 and len(splits["validation"]) == 20
    assert sum(splits["validation"].labels) == 10
    assert set(splits["train"].first).isdisjoint(splits["validation"].first)


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"train_pairs": 1}, "train_pairs must be an int >= 2"),
        ({"validation_fraction": 1.0}, r"validation_fraction must be a finite number in \(0.0, 1.0\)"),
        ({"vocab_size": 3}, r"vocab_size must be an int in \[6, 1048576\]"),
    ],
)
def test_bad_settings_are_named(tmp_path, options, message):
    with pytest.raises(ValueError, match=message):
        build_docstring_pairs(tmp_path, **options)


def test_negatives_from_other_modules_stay_in_their_split(tmp_path):
    _fake_library(tmp_path / "lib")
    splits, _, info = build_docstring_pairs(
        tmp_path / "cache",
        stdlib=tmp_path / "lib",
        train_pairs=24,
        validation_pairs=12,
        vocab_size=200,
        validation_fraction=0.5,
        same_module_negatives=0.0,
    )
    assert all(len(info["modules"][name]) >= 2 for name in splits)
    for name, examples in splits.items():
        for doc, code, label in zip(examples.first, examples.second, examples.labels):
            module = "mod" + doc.split("module ")[1].split()[0]
            assert (_module_of(code) == module) == (label == 1)
            assert _module_of(code) in info["modules"][name]


def test_another_max_length_reads_the_cached_task_and_a_bad_one_leaves_it_untouched(tmp_path, recwarn):
    """``max_length`` is applied to the cached tokenizer after it is read: a valid one reuses the entry, a
    bad one is refused by name before it, and neither is taken for a damaged entry (rebuilding it would
    train another vocabulary and strand the runs made with this one)."""
    _fake_library(tmp_path / "lib")
    options = {"stdlib": tmp_path / "lib", "train_pairs": 10, "validation_pairs": 4, "vocab_size": 200}
    build_docstring_pairs(tmp_path / "cache", max_length=64, **options)
    before = {file: file.read_bytes() for file in (tmp_path / "cache").rglob("*") if file.is_file()}
    _, tokenizer, _ = build_docstring_pairs(tmp_path / "cache", max_length=16, **options)
    assert tokenizer.max_length == 16
    with pytest.raises(ValueError, match="max_length must be an int >= 4, got 1"):
        build_docstring_pairs(tmp_path / "cache", max_length=1, **options)
    assert {file: file.read_bytes() for file in (tmp_path / "cache").rglob("*") if file.is_file()} == before
    assert not [warning for warning in recwarn if "damaged" in str(warning.message)]
