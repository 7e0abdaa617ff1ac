"""Every config in configs/ declares its variants (`--config=configs/x.py:variant`), loads each of them, and
rejects any other with an error naming the file, the variant given and the valid ones."""

import re
import runpy
from pathlib import Path

import ml_collections
import pytest
from absl import flags
from ml_collections import config_flags

from logra_jax.job.run_config import RunConfig

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
NAMES = sorted(path.name for path in CONFIGS.glob("*.py"))


def _module(name):
    return runpy.run_path(str(CONFIGS / name))


VARIANTS = {name: _module(name).get("VARIANTS", ()) for name in NAMES}


@pytest.mark.parametrize("name", NAMES)
def test_every_config_declares_its_variants(name):
    variants = _module(name).get("VARIANTS")
    assert isinstance(variants, tuple) and variants and all(isinstance(v, str) for v in variants), (
        f"configs/{name} must declare VARIANTS, a tuple of the variant strings get_config accepts ('' = none)")


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("variant", ["runlcoal", "RUNLOCAL", "runlocal,runlocal", "3b", " "])
def test_unknown_variant_names_file_variant_and_valid_ones(name, variant):
    module = _module(name)
    with pytest.raises(ValueError) as info:
        module["get_config"](variant)
    message = str(info.value)
    assert str(CONFIGS / name) in message and repr(variant) in message
    assert str(list(module["VARIANTS"])) in message


@pytest.mark.parametrize(("name", "variant"), [(n, v) for n in NAMES for v in VARIANTS[n]])
def test_every_declared_variant_loads_and_validates(name, variant):
    config = _module(name)["get_config"](variant)
    assert isinstance(config, ml_collections.ConfigDict)
    # what a user must still provide (the paper recipe points at local copies of the checkpoint and data)
    if not config.model.checkpoint and config.model.tokenizer == "checkpoint":
        config.model.checkpoint = "/data/checkpoint"
    if config.task.kind == "jsonl":
        config.task.jsonl_train, config.task.jsonl_eval = "/data/train.jsonl", "/data/eval.jsonl"
    assert RunConfig.from_dict(config).train.steps >= 1


@pytest.mark.parametrize("name", NAMES)
def test_documented_commands_use_declared_variants(name):
    module = _module(name)
    documented = re.findall(rf"--config=configs/{re.escape(name)}(?::(\S+))?", module["__doc__"])
    assert documented, f"configs/{name}: the docstring carries no run command (--config=configs/{name})"
    for variant in documented:
        if variant:
            assert variant in module["VARIANTS"], f"configs/{name}: documented variant {variant!r} is not declared"
        module["get_config"](*([variant] if variant else []))


def test_typo_on_the_command_line_is_an_error(monkeypatch):
    argv = ["main", f"--config={CONFIGS / 'demo.py'}:runlcoal"]
    monkeypatch.setattr("sys.argv", argv)  # config_flags reads overrides from sys.argv
    flag_values = flags.FlagValues()
    config_flags.DEFINE_config_file("config", flag_values=flag_values)
    expected = r"demo\.py: unknown variant 'runlcoal'; valid variants: \['', 'runlocal', 'moe', 'moe,runlocal'\]"
    with pytest.raises(flags.IllegalFlagValueError, match=expected):
        flag_values(argv)
