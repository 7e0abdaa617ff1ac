"""optimizer.rank_rules is part of what a checkpoint means: a resume must keep them (each target's sketch, factor
and momentum shapes follow its rank); a config saved before the field existed resumes with none."""

import pytest

from logra_jax.job.lifecycle import RESUME_FIXED, check_resume, is_fixed
from logra_jax.job.run_config import RunConfig


def _config(**optimizer):
    return RunConfig.from_dict({"optimizer": optimizer}).to_dict()


def test_resume_refuses_changed_rank_rules_and_names_them():
    assert "optimizer.rank_rules" in RESUME_FIXED and is_fixed("optimizer.rank_rules")
    saved = _config(rank=16, rank_rules="mlp=8")
    assert check_resume(saved, _config(rank=16, rank_rules="mlp=8", update_ratio=1e-4), "w") == {
        "optimizer.update_ratio": (6e-5, 1e-4)}
    for now in ("mlp=4", "", "mlp=8, attn=16"):
        with pytest.raises(ValueError, match=rf"cannot resume the run in w with a changed config: "
                                             rf"optimizer\.rank_rules: 'mlp=8' in the checkpointed run, {now!r} now"):
            check_resume(saved, _config(rank=16, rank_rules=now), "w")


def test_a_config_saved_before_rank_rules_resumes_without_them():
    saved = _config(rank=16)
    del saved["optimizer"]["rank_rules"]
    assert check_resume(saved, _config(rank=16), "w") == {}
    with pytest.raises(ValueError, match=r"optimizer\.rank_rules: '' in the checkpointed run, 'mlp=8' now"):
        check_resume(saved, _config(rank=16, rank_rules="mlp=8"), "w")
    del saved["optimizer"]["rank"]  # any other fixed field a saved config lacks still refuses
    with pytest.raises(ValueError, match=r"optimizer\.rank: None in the checkpointed run, 16 now"):
        check_resume(saved, _config(rank=16), "w")
