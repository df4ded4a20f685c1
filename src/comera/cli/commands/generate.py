"""``comera generate RUN_DIR --prompt TEXT``: print a continuation of a prompt by the trained language model
of a ``comera train llm`` run folder (greedy unless ``--temperature``, stopped at the end-of-sequence
token); errors are one line with exit status 2. Details: docs/llm.md, 'Generation'.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
from tokenizers import Tokenizer

from comera.cli.commands.paths import path_argument
from comera.data.bpe import SPECIAL_TOKENS
from comera.data.special_tokens import CONVENTIONAL_NAMES
from comera.data.tokenize import tokenizer_digest
from comera.io import DamagedFileError
from comera.recipes.saved import load_run_model
from comera.workloads.llm.generate import generate
from comera.workloads.llm.model import LlamaLM

__all__ = [
    "DEFAULT_NEW_TOKENS",
    "EOS_TOKEN",
    "TOKENIZER_NAME",
    "continue_text",
    "end_token_id",
    "load_run",
    "main",
]

EOS_TOKEN = SPECIAL_TOKENS[2]
"""The end-of-sequence token of comera's byte-level BPE (``</s>``): generation stops once it is produced."""
TOKENIZER_NAME = "tokenizer.json"
"""The tokenizer's file in a run's ``model/`` folder."""


def end_token_id(tokenizer: Tokenizer) -> int | None:
    """The id of ``tokenizer``'s end-of-document token, the first of
    :data:`comera.data.special_tokens.CONVENTIONAL_NAMES` ``["eos"]`` it holds (:data:`EOS_TOKEN` for
    comera's BPE, ``<|endoftext|>`` for GPT-2's), or None when it has none."""
    found = (tokenizer.token_to_id(name) for name in CONVENTIONAL_NAMES["eos"])
    return next((index for index in found if index is not None), None)


RESULTS_NAME = "results.json"
"""The run's results, which record the digest of its tokenizer (``data.identity.tokenizer``)."""
DEFAULT_NEW_TOKENS = 64
"""Tokens added when ``--max-new-tokens`` is not given (fewer when the model's context ends first)."""
_WHY = "comera generate works on the run folders of `comera train llm`"


def load_run(run_dir: str | Path) -> tuple[LlamaLM, Tokenizer]:
    """The trained model (in eval mode) and the tokenizer of an ``llm`` run folder.

    Raises:
        FileNotFoundError: ``run_dir``, its ``model/`` (an unfinished run) or ``model/tokenizer.json`` is
            missing. ValueError: a saved file is damaged (named), the saved model is not a :class:`LlamaLM`,
            or the tokenizer is unreadable, has more tokens than the model's vocabulary, or is not the one
            whose digest ``results.json`` records.
    """
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise FileNotFoundError(f"RUN_DIR {run_dir} is not a folder; {_WHY}")
    model_dir = run_dir / "model"
    if not model_dir.is_dir():
        if (run_dir / "config.json").is_file():
            raise FileNotFoundError(
                f"{run_dir} holds no model/ yet: the run has not finished; finish it (or resume it with the "
                "comera train command that started it plus --resume), then generate"
            )
        raise FileNotFoundError(f"{run_dir} holds no model/ folder; {_WHY}")
    try:
        model = load_run_model(run_dir)
    except DamagedFileError as error:
        raise ValueError(f"the run's saved model is damaged: {error}") from None
    except ValueError as error:
        raise ValueError(f"{model_dir}: not a language model ({error}); {_WHY}") from None
    if not isinstance(model, LlamaLM):
        raise ValueError(
            f"{model_dir} holds a {type(model).__name__}, not a language model (LlamaLM); {_WHY}"
        )
    path = model_dir / TOKENIZER_NAME
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found: an llm run saves its tokenizer beside the model")
    try:
        tokenizer = Tokenizer.from_file(str(path))
    except Exception as error:  # tokenizers raises its own exception type
        raise ValueError(f"{path}: not a tokenizers tokenizer.json ({error})") from None
    if tokenizer.get_vocab_size() > model.config.vocab_size:
        raise ValueError(
            f"{path} has {tokenizer.get_vocab_size()} tokens but the model's vocabulary has "
            f"{model.config.vocab_size}: the tokenizer is not the model's"
        )
    _check_tokenizer_digest(run_dir, path, tokenizer)
    return model.eval(), tokenizer


def _check_tokenizer_digest(run_dir: Path, path: Path, tokenizer: Tokenizer) -> None:
    """``ValueError`` when ``RUN_DIR/results.json`` records the digest of the tokenizer the run trained with
    (``data.identity.tokenizer``) and ``tokenizer`` is another; a run without that record passes."""
    try:
        recorded = json.loads((run_dir / RESULTS_NAME).read_text())["data"]["identity"]["tokenizer"]
    except (OSError, ValueError, KeyError, TypeError):
        return
    digest = tokenizer_digest(tokenizer)
    if recorded != digest:
        raise ValueError(
            f"{path} is not the tokenizer the run trained with (sha256 {str(recorded)[:12]} in "
            f"{run_dir / RESULTS_NAME}, {digest[:12]} in the file): put the run's own tokenizer.json back"
        )


def continue_text(
    model: LlamaLM,
    tokenizer: Tokenizer,
    prompt: str,
    max_new_tokens: int | None = None,
    temperature: float = 0.0,
    top_k: int | None = None,
    seed: int | None = None,
) -> str:
    """The text ``model`` generates after ``prompt`` (the new tokens decoded, special tokens left out):
    ``max_new_tokens`` tokens at most, by default :data:`DEFAULT_NEW_TOKENS` or as many as the model's
    context leaves after the prompt if that is fewer.

    Raises:
        ValueError: an empty prompt, a prompt and continuation longer than the model's context, or a bad
            setting (naming the option).
    """
    ids = tokenizer.encode(prompt).ids
    if not ids:
        raise ValueError("--prompt must hold some text (it encoded to no token)")
    context = model.config.max_seq_len
    room = context - len(ids)
    if room < 1:
        raise ValueError(
            f"the prompt's {len(ids)} tokens fill the model's context of {context} tokens; "
            "use a shorter --prompt"
        )
    max_new_tokens = min(DEFAULT_NEW_TOKENS, room) if max_new_tokens is None else max_new_tokens
    if max_new_tokens > room:
        raise ValueError(
            f"the prompt's {len(ids)} tokens plus --max-new-tokens {max_new_tokens} exceed the model's "
            f"context of {context} tokens; use --max-new-tokens {room} or fewer"
        )
    output = generate(
        model,
        torch.tensor([ids], device=model.norm.weight.device),
        max_new_tokens,
        temperature=temperature,
        top_k=top_k,
        seed=seed,
        eos_id=end_token_id(tokenizer),
    )
    return tokenizer.decode(output[0, len(ids) :].tolist(), skip_special_tokens=True)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="comera generate",
        description="Print a continuation of a prompt by the model of a `comera train llm` run folder.",
    )
    parser.add_argument(
        "run_dir", type=path_argument, help="a run folder of comera train llm (its model/ holds the model)"
    )
    parser.add_argument("--prompt", required=True, metavar="TEXT", help="the text to continue")
    parser.add_argument(
        "--max-new-tokens",
        type=int,
        default=None,
        metavar="N",
        help=f"tokens to add, >= 1 (default {DEFAULT_NEW_TOKENS}, fewer if the model's context ends first)",
    )
    parser.add_argument(
        "--temperature",
        type=float,
        default=0.0,
        metavar="T",
        help="0 (default): greedy; above 0: sample at that temperature",
    )
    parser.add_argument(
        "--top-k",
        type=int,
        default=None,
        metavar="K",
        help="with --temperature above 0: draw among the K most likely tokens only (refused without it)",
    )
    parser.add_argument(
        "--seed", type=int, default=None, metavar="S", help="seed of the sampling (default: a fresh one)"
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    """``comera generate``: print the continuation; exit status 0, or 2 with a one-line error."""
    args = _parser().parse_args(argv)
    try:
        _check_sampling(args)
        model, tokenizer = load_run(args.run_dir)
        text = continue_text(
            model, tokenizer, args.prompt, args.max_new_tokens, args.temperature, args.top_k, args.seed
        )
    except (FileNotFoundError, ValueError) as error:
        print(f"comera generate: {_as_options(str(error))}", file=sys.stderr)
        return 2
    print(text)
    return 0


def _check_sampling(args: argparse.Namespace) -> None:
    """``ValueError`` for ``--top-k`` without sampling (``--temperature`` 0, the default), naming both."""
    if args.top_k is not None and args.temperature == 0:
        raise ValueError(
            f"--top-k {args.top_k} needs sampling: give --temperature above 0 with it (without --temperature "
            "decoding is greedy, and --top-k would change nothing)"
        )


_OPTIONS = {
    "max_new_tokens": "--max-new-tokens",
    "temperature": "--temperature",
    "top_k": "--top-k",
    "seed": "--seed",
}
"""The options of the arguments that :func:`comera.workloads.llm.generate.generate` names in its errors."""


def _as_options(message: str) -> str:
    """``message`` with an opening argument name spelled as the option the user typed (``top_k must be``
    -> ``--top-k must be``)."""
    for name, option in _OPTIONS.items():
        if message.startswith(f"{name} "):
            return option + message[len(name) :]
    return message


if __name__ == "__main__":
    raise SystemExit(main())
