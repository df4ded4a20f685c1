"""The trained model of a run folder, for use after the run: :func:`load_run_model`, which rebuilds through
the method's ``prepare`` and the run's ``config.json`` the models whose layers only the method holds (CoLA,
LTE). Details: docs/recipes.md, 'The run folder'.
"""

from __future__ import annotations

from pathlib import Path

from torch import nn

from comera.io import DamagedFileError, load_pretrained, saved_base_model
from comera.methods import MethodContext, get_method
from comera.recipes.run import read_run_config
from comera.recipes.settings import check_recorded_settings, tensorize_config
from comera.train.config import TrainConfig

__all__ = ["load_run_model"]


def load_run_model(run_dir: str | Path) -> nn.Module:
    """The model a finished run saved in ``RUN_DIR/model``, in eval mode, on the CPU.

    Raises:
        FileNotFoundError: ``RUN_DIR/model`` or a file in it is missing. DamagedFileError (a ``ValueError``):
            a saved file cannot be read (truncated or corrupt; named). ValueError: the saved files do not
            make a model (the message of :func:`comera.load_pretrained`; for a method's own layers, of the
            rebuild through the run's ``config.json``).
    """
    run_dir = Path(run_dir)
    model_dir = run_dir / "model"
    try:
        return load_pretrained(model_dir).eval()
    except DamagedFileError:  # no rebuild reads a file that cannot be read
        raise
    except ValueError as direct:
        header_path = run_dir / "config.json"
        if not header_path.is_file():
            raise
        try:
            return _rebuilt_by_method(model_dir, header_path).eval()
        except (KeyError, TypeError, ValueError) as error:
            raise ValueError(
                f"{direct}; rebuilding it as its run did ({header_path}) failed too: {error}"
            ) from None


def _rebuilt_by_method(model_dir: Path, header_path: Path) -> nn.Module:
    recorded = read_run_config(header_path)
    method = get_method(recorded["method"])
    check_recorded_settings(recorded, header_path, "this version of comera cannot load the run's model")
    settings = recorded["settings"]
    context = MethodContext(
        tensorize=tensorize_config(settings),
        settings=settings["method"],
        train=TrainConfig.from_dict(settings["train"]),
    )
    model = method.prepare(saved_base_model(model_dir), context)
    return load_pretrained(model_dir, base_model=model)
