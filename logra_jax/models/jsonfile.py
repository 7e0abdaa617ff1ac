"""The JSON files of a checkpoint directory (config.json, the shard index, tokenizer_config.json), read so that a
bad one is a ValueError naming the file and the place rather than a bare JSONDecodeError or KeyError later."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

_JSON_TYPES = {list: "an array", str: "a string", int: "a number", float: "a number", bool: "a boolean",
               type(None): "null"}


def read_json_object(path: Path) -> dict[str, Any]:
    """The JSON object in `path`.

    Raises:
      ValueError: the file is not UTF-8, not JSON (line and column named) or holds something other than an object.
    """
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except UnicodeDecodeError as err:
        raise ValueError(f"{path}: not UTF-8 text (byte {err.start}: {err.reason})") from err
    except json.JSONDecodeError as err:
        raise ValueError(f"{path}: not valid JSON: {err.msg} at line {err.lineno}, column {err.colno}") from err
    if not isinstance(value, dict):
        raise ValueError(f"{path}: expected a JSON object, got {_JSON_TYPES[type(value)]}")
    return value
