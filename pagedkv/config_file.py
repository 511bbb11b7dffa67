"""vLLM's `--config FILE`: a YAML mapping of a command's long flags (`max-num-seqs: 8`, dashes or
underscores), read as if written on the command line before the flags that are, so that those
override it. `model:` is the model unless the command line names one.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import yaml

from pagedkv.config import ConfigError

FLAG = "--config"


def split_config_flag(argv: list[str]) -> tuple[list[str], str | None]:
    """argv without `--config FILE` (or `--config=FILE`), and FILE (None if not given)."""
    for i, token in enumerate(argv):
        if token == FLAG:
            if i + 1 == len(argv):
                raise ConfigError(f"{FLAG} needs a file")
            return argv[:i] + argv[i + 2 :], argv[i + 1]
        if token.startswith(FLAG + "="):
            return argv[:i] + argv[i + 1 :], token[len(FLAG) + 1 :]
    return argv, None


def config_tokens(path: str, parser: argparse.ArgumentParser) -> tuple[list[str], str | None]:
    """The file's flags as command-line tokens for `parser`, and its `model` (None if it has none).

    true is the flag alone, false its `--no-` form where there is one (else nothing), a list
    the flag and each item, a mapping the flag and its JSON (`speculative-config: {...}`)."""
    try:
        data = yaml.safe_load(Path(path).expanduser().read_text())
    except OSError as e:
        raise ConfigError(f"{FLAG} {path}: {e.strerror}") from None
    except yaml.YAMLError as e:
        raise ConfigError(f"{FLAG} {path}: not YAML: {str(e).splitlines()[0]}") from None
    if data is None:
        return [], None
    if not isinstance(data, dict):
        raise ConfigError(f"{FLAG} {path}: wants a mapping of flags to values")
    known = set(parser._option_string_actions)  # noqa: SLF001 - argparse keeps no public list
    tokens: list[str] = []
    model = None
    for key, value in data.items():
        flag = "--" + str(key).replace("_", "-")
        if flag == "--model":
            model = None if value is None else str(value)
            continue
        if flag not in known or flag == FLAG:
            raise ConfigError(f"{FLAG} {path}: {key!r} is not a flag of this command")
        if value is None:
            continue
        takes_none = parser._option_string_actions[flag].nargs == 0  # noqa: SLF001
        if takes_none != isinstance(value, bool):
            wants = "true or false" if takes_none else "a value, not true or false"
            raise ConfigError(f"{FLAG} {path}: {key!r} wants {wants}, got {value!r}")
        if value is True:
            tokens.append(flag)
        elif value is False:
            off = "--no-" + flag[2:]
            tokens += [off] if off in known else []
        elif isinstance(value, list):
            tokens += [flag, *(str(v) for v in value)]
        elif isinstance(value, dict):
            tokens += [flag, json.dumps(value)]
        else:
            tokens += [flag, str(value)]
    return tokens, model
