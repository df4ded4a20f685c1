"""Contract of ``comera.recipes.settings``: how ``--set`` text is split, which layer wins, the exact messages
naming a bad setting or config file, and how an old run header is read."""

import re

import pytest
import toy

from comera.methods import get_method
from comera.recipes.settings import SECTIONS, parse_assignment, resolve_settings

PRESETS = toy.ToyRecipe.presets


def _preset(**sections):
    """The toy's smoke preset with ``sections`` replacing its own (``None`` drops a section)."""
    smoke = {**PRESETS["smoke"], **sections}
    return {"smoke": {key: value for key, value in smoke.items() if value is not None}}


def _resolve(assignments=(), presets=PRESETS, method="comera", config_file=None):
    return resolve_settings(
        presets, "smoke", get_method(method), config_file=config_file, assignments=assignments
    )


def test_an_assignment_splits_at_the_first_equals_sign_and_the_first_dot():
    """``a.b.c=x=y`` is section ``a``, key ``b.c``, value ``x=y`` (not the last ``=`` or ``.``)."""
    assert parse_assignment("data.path=a=b") == ("data", "path", "a=b")
    assert parse_assignment("data.a.b=1") == ("data", "a.b", 1)


@pytest.mark.parametrize("text", ["model.hidden", ".hidden=3", "model.=3", "=3"])
def test_an_assignment_without_a_section_key_or_value_names_the_expected_form(text):
    """Each missing part (``=``, the section, the key) is refused with the whole message and the sections."""
    expected = (
        f"--set expects section.key=value (sections: model, data, train, tensorize, method), got {text!r}"
    )
    with pytest.raises(ValueError, match=f"^{re.escape(expected)}$"):
        parse_assignment(text)


def test_a_missing_config_file_is_named(tmp_path):
    """A ``--config`` path that does not exist: ``FileNotFoundError`` naming it."""
    path = tmp_path / "missing.toml"
    with pytest.raises(FileNotFoundError, match=f"^{re.escape(f'--config {path}: file not found')}$"):
        _resolve(config_file=path)


def test_an_unreadable_config_file_names_the_reason(tmp_path):
    """A path under a file cannot be read: the message names the path and the OS reason (its strerror)."""
    blocker = tmp_path / "file"
    blocker.write_text("")
    path = blocker / "run.toml"
    expected = f"--config {path}: cannot be read (Not a directory)"
    with pytest.raises(ValueError, match=f"^{re.escape(expected)}$"):
        _resolve(config_file=path)


def test_a_config_file_that_is_not_toml_is_named(tmp_path):
    """A file that is not TOML: the message names the path and the parser's reason."""
    path = tmp_path / "run.toml"
    path.write_text("[train\n")
    with pytest.raises(ValueError, match=f"^{re.escape(f'--config {path}: not valid TOML (')}.+\\)$"):
        _resolve(config_file=path)


def test_a_config_file_with_a_utf8_byte_order_mark_is_read(tmp_path):
    """A BOM (as Windows Notepad writes one) is not part of the first line; an error after it still names
    the line and the column as an editor shows them."""
    path = tmp_path / "run.toml"
    path.write_bytes(b"\xef\xbb\xbf[train]\nbatch_size = 4\n")
    assert _resolve(config_file=path)["train"]["batch_size"] == 4
    path.write_bytes(b"\xef\xbb\xbf[train]\n# caf\xe9\n")
    with pytest.raises(ValueError, match=re.escape(f"--config {path}: line 2, column 6: byte 0xe9")):
        _resolve(config_file=path)


def test_an_unknown_config_table_names_the_valid_tables(tmp_path):
    """A table not in SECTIONS is refused naming the valid tables."""
    path = tmp_path / "run.toml"
    path.write_text("[optim]\nlr = 3\n")
    expected = f"--config {path}: unknown table [optim]; valid tables: {list(SECTIONS)}"
    with pytest.raises(ValueError, match=f"^{re.escape(expected)}$"):
        _resolve(config_file=path)


@pytest.mark.parametrize("text, shown", [("model = 3\n", "3"), ('train = "fast"\n', "'fast'")])
def test_a_known_section_given_as_a_plain_value_is_told_to_be_a_table(tmp_path, text, shown):
    """``train = 5`` at the top level: the section is known, so the message says it must be a table (it
    used to call a valid table unknown)."""
    path = tmp_path / "run.toml"
    path.write_text(text)
    section = text.split(" ")[0]
    expected = (
        f"--config {path}: {section} = {shown} at the top level; [{section}] must be a table of settings "
        f"(e.g. [{section}] then key = value lines)"
    )
    with pytest.raises(ValueError, match=f"^{re.escape(expected)}$"):
        _resolve(config_file=path)


def test_an_error_names_the_layer_that_set_the_value():
    """A bad key from the preset's per-method table names the preset; from ``--set``, the assignment."""
    presets = _preset(method={"comera": {"train": {"batchsize": 3}}})
    with pytest.raises(ValueError, match=r"^preset 'smoke': unknown key train\.batchsize; "):
        _resolve(presets=presets)
    with pytest.raises(ValueError, match=r"^--set 'model\.width=3': unknown key model\.width; "):
        _resolve(["model.width=3"])


def test_a_bool_is_not_an_int():
    """``true`` for an int field (declared, or by its default) is refused, naming the type and default."""
    expected = "--set 'train.batch_size=true': train.batch_size must be of type int, got True"
    with pytest.raises(ValueError, match=f"^{re.escape(expected)}$"):
        _resolve(["train.batch_size=true"])
    expected = "--set 'model.hidden=true': model.hidden must be of type int like its default 32, got True"
    with pytest.raises(ValueError, match=f"^{re.escape(expected)}$"):
        _resolve(["model.hidden=true"])


def test_a_mapping_field_takes_a_table_and_refuses_a_number():
    """``tensorize.rank_pattern`` (a Mapping) takes an inline table; a number is refused naming Mapping."""
    settings = _resolve(['tensorize.rank_pattern={ "0" = 2 }'])
    assert settings["tensorize"]["rank_pattern"] == {"0": 2}
    expected = "--set 'tensorize.rank_pattern=3': tensorize.rank_pattern must be of type Mapping, got 3"
    with pytest.raises(ValueError, match=f"^{re.escape(expected)}$"):
        _resolve(["tensorize.rank_pattern=3"])


def test_a_preset_value_of_none_takes_any_value_and_a_float_default_makes_a_float():
    """A recipe key whose preset value is None takes any type; a later int over a float becomes a float."""
    presets = _preset(model={"hidden": 32, "extra": None})
    assert _resolve(["model.extra=3"], presets=presets)["model"]["extra"] == 3
    config = ["model.extra=1.5", "model.extra=2"]
    value = _resolve(config, presets=presets)["model"]["extra"]
    assert type(value) is float and value == 2.0


@pytest.mark.parametrize("assignment", ["train.weight_decay=1", "method.gamma=1", "train.lr_other=1"])
def test_an_int_for_a_float_field_is_stored_as_a_float(assignment):
    """An int given for a float setting (absent from the preset or not) is stored as a float."""
    section, key, _ = parse_assignment(assignment)
    value = _resolve([assignment])[section][key]
    assert type(value) is float and value == 1.0


def test_tensorize_preset_without_a_preset_value_names_the_empty_default():
    """Without a preset's ``tensorize.preset``, a non-string value is refused naming the default ``''``."""
    presets = _preset(tensorize=None)
    expected = "--set 'tensorize.preset=3': tensorize.preset must be of type str like its default '', got 3"
    with pytest.raises(ValueError, match=f"^{re.escape(expected)}$"):
        _resolve(["tensorize.preset=3"], presets=presets)


def test_a_preset_without_per_method_overrides_resolves():
    """A preset with no ``method`` table resolves to its own values."""
    presets = _preset(method=None)
    settings = _resolve(presets=presets, method="dense")
    assert settings["train"]["lr_other"] == 1e-2 and settings["method"] == {}


def test_the_result_shares_no_list_with_the_presets():
    """Changing a list in the returned settings leaves the recipe's presets as they were."""
    presets = _preset(model={"hidden": 32, "sizes": [1, 2]})
    _resolve(presets=presets)["model"]["sizes"].append(3)
    assert presets["smoke"]["model"]["sizes"] == [1, 2]
    assert _resolve(presets=presets)["model"]["sizes"] == [1, 2]


@pytest.mark.parametrize(
    "assignment, message",
    [
        ("train.batch_size=0", "train.batch_size must be an int >= 1, got 0"),
        ("train.lr_other=-1.0", "train.lr_other must be a finite number in [0.0, inf), got -1.0"),
    ],
)
def test_a_train_setting_out_of_range_is_named_with_its_section(assignment, message):
    """The Trainer's checks name the bare field; from the settings, the message names ``train.FIELD``, as
    the user wrote it in ``--set`` or the TOML file."""
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        _resolve(assignments=[assignment])
