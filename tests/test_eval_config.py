"""eval.* is typed, in its domains, and checked at load."""

import pytest

from gyre.config.domain import ConfigValueError
from gyre.config.load import compose

pytestmark = pytest.mark.unit


def test_eval_defaults_are_off_and_held_out():
    cfg = compose([])
    assert cfg.eval.every == 0 and cfg.eval.held_out and cfg.eval.samples >= 1
    assert cfg.eval.held_out_families and set(cfg.eval.held_out_families).isdisjoint(cfg.tasks.families)


def test_eval_overrides_compose():
    cfg = compose(["eval.every=2", "eval.samples=3", "eval.temperature=0.5", "eval.max_tasks=5"])
    assert (cfg.eval.every, cfg.eval.samples, cfg.eval.temperature, cfg.eval.max_tasks) == (2, 3, 0.5, 5)
    cfg = compose(["eval.held_out=false", "eval.tasks.families=[echo_files]"])
    assert cfg.eval.tasks.families == ["echo_files"]


@pytest.mark.parametrize(
    "override, key",
    [
        ("eval.every=-1", "eval.every"),
        ("eval.samples=0", "eval.samples"),
        ("eval.temperature=-0.1", "eval.temperature"),
        ("eval.max_tasks=0", "eval.max_tasks"),  # builtin instances are drawn: how many must be said
        ("eval.tasks.split=nope", "tasks.split"),  # TaskConfig checks itself under its own prefix
    ],
)
def test_eval_values_out_of_domain_fail_at_load(override, key):
    with pytest.raises(ConfigValueError, match=key.replace(".", r"\.")):
        compose([override])


def test_held_out_split_of_a_suite_that_trains_on_everything_is_refused():
    with pytest.raises(ConfigValueError, match="eval.held_out"):
        compose(["tasks=harbor_examples", "tasks.split=all", "eval.every=2"])
