"""`pipeline.executor.cluster._get`: how the stage waits on one prompt's result from a Ray actor when a node is lost
(the real loss is tests/integration/test_ray_cluster.py, slow; this is the rule, fast). `ray.get` and the actor are
stand-ins: each call of `ray.get` takes the next outcome of a script."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import ray
import ray.exceptions as rex

from pipeline.config.schema import ExecutorConfig
from pipeline.errors import UserError
from pipeline.executor import cluster

UNAVAILABLE = rex.ActorUnavailableError("the node is gone", None)
LOST = rex.ObjectLostError("00" * 28, None, "")
DIED = rex.ActorDiedError()


class Actor:
    """Records every prompt sent again (`run.remote`) and hands back a new reference."""

    def __init__(self):
        self.sent: list[str] = []
        self.run = SimpleNamespace(remote=self._remote)

    def _remote(self, root, config, model, pid):
        self.sent.append(pid)
        return f"ref{len(self.sent)}"


@pytest.fixture
def script(monkeypatch):
    """-> set(outcomes): `ray.get` raises each exception in turn, or returns a value (with the reference it got)."""
    got: list = []
    monkeypatch.setattr(cluster, "RESEND_PAUSE_S", 0.0)

    def set_outcomes(outcomes):
        queue = list(outcomes)

        def get(ref, timeout):
            got.append((ref, timeout))
            outcome = queue.pop(0)
            if isinstance(outcome, BaseException):
                raise outcome
            return (outcome, ref)
        monkeypatch.setattr(ray, "get", get)
        return got
    return set_outcomes


STAGE = SimpleNamespace(stage="forward", root="/repo", config={}, model=None)


def _send(actor: Actor):
    """The call run_prompts hands `_get`: the prompt sent to its actor again."""
    return lambda: actor.run.remote(STAGE.root, STAGE.config, STAGE.model, "p3")


@pytest.mark.parametrize("error", [UNAVAILABLE, LOST], ids=["actor unavailable", "object lost"])
def test_a_lost_nodes_call_is_sent_again_until_the_actor_answers(script, error):
    got = script([error, error, "result"])
    actor = Actor()
    assert cluster._get(STAGE, ExecutorConfig(kind="ray"), "p3", _send(actor), "ref0") == ("result", "ref2")
    assert actor.sent == ["p3", "p3"]                              # the same prompt, once per failed wait
    assert [ref for ref, _ in got] == ["ref0", "ref1", "ref2"]
    assert all(0 < t <= 600 for _, t in got)                        # every wait within the bound


def test_an_actor_unavailable_past_the_bound_is_one_line_naming_the_prompt(script, monkeypatch):
    clock = iter(range(0, 10_000, 4))                               # 4 s pass per look at the clock
    monkeypatch.setattr(cluster, "time", SimpleNamespace(monotonic=lambda: next(clock), sleep=lambda s: None))
    script([UNAVAILABLE] * 100)
    actor = Actor()
    with pytest.raises(UserError) as err:
        cluster._get(STAGE, ExecutorConfig(kind="ray", prompt_timeout_s=10), "p3", _send(actor), "ref0")
    message = str(err.value)
    assert "\n" not in message and "prompt p3" in message and "executor.prompt_timeout_s=10" in message, message
    assert "ActorUnavailableError" in message and 0 < len(actor.sent) < 3, (message, actor.sent)


def test_an_actor_dead_for_good_is_not_sent_again(script):
    script([DIED])
    actor = Actor()
    with pytest.raises(UserError, match=r"^stage forward: prompt p3 failed on Ray after executor.max_retries=2 "):
        cluster._get(STAGE, ExecutorConfig(kind="ray"), "p3", _send(actor), "ref0")
    assert actor.sent == []
