"""The engine's health check on real Ray (tiny models, the session's local Ray): a forward that
outlasts the stall window but keeps finishing layers is healthy, a forward wedged without progress
fails the check within the stall limit, and a killed shard fails it at once.

Slowness and wedges come from the test hooks of `specdec.engine.progress` (a sleep after every decoder
layer; a layer that blocks forever), set on the shard actor through `__ray_call__` once its model
is loaded, so the request is held at the point of the fault."""

from __future__ import annotations

import threading
import time
from collections import Counter

import pytest

from actors import RayEngineConfig, RolePlacement, build_ray_engine
from actors.groups import HEALTH_GROUP
from specdec import EngineConfig, SamplingParams
from tests.tiny_models import make_model

#: The stall window of these tests' engines (the default is minutes; see RayEngineConfig.health_stall_s).
STALL_S = 3.0
#: Sleep after each of the deep model's 8 layers: every layer finishes within the window, a forward
#: takes over 2x the window, so no shard call completes for longer than the window.
LAYER_DELAY_S = 1.0
SMALL = RolePlacement(num_cpus=0.1, num_threads=1)


@pytest.fixture(scope="module")
def tiny_deep_llama(tmp_path_factory):
    """tiny_llama's shape with 8 decoder layers (a forward is 8 layer delays long)."""
    return make_model(tmp_path_factory.mktemp("tiny-deep-llama"), "llama", vocab_size=96, seed=1, layers=8)


def _engine(target):
    return build_ray_engine(RayEngineConfig(engine=EngineConfig(target=str(target), draft="none"), target_role=SMALL,
                                            health_stall_s=STALL_S))


def _set_hooks(ray, shard, **hooks) -> None:
    """Set test hooks of the shard's `ForwardProgress` (a value, or a function of it) while it is idle."""
    def apply(actor):
        for name, value in hooks.items():
            setattr(actor.forward_progress, name, value(actor.forward_progress) if callable(value) else value)

    ray.get(shard.__ray_call__.remote(apply))


def _consume(engine, prompt, sampling, into: dict) -> threading.Thread:
    def run():
        try:
            into["output"] = engine.generate(prompt_token_ids=prompt, sampling=sampling)
        except Exception as e:  # noqa: BLE001 - the test looks at it
            into["error"] = e

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def _check(ray, engine):
    """The coordinator's health check: its state, or the exception that failed it."""
    try:
        return ray.get(engine.coordinator.check_health.remote(), timeout=30)
    except ray.exceptions.RayTaskError as e:
        return e.cause if e.cause is not None else e


def test_slow_forward_outlasting_the_stall_window_stays_healthy(ray_session, tiny_deep_llama):
    engine = _engine(tiny_deep_llama)
    try:
        engine.generate(prompt_token_ids=[5, 6, 7], sampling=SamplingParams(max_tokens=2))  # a shard call just completed
        _set_hooks(ray_session, engine.handles()["shards"][0], layer_delay_s=LAYER_DELAY_S)
        result: dict = {}
        request = _consume(engine, [5], SamplingParams(max_tokens=1), result)  # one forward
        states = []
        while request.is_alive():
            states.append(_check(ray_session, engine))
            time.sleep(0.5)
        print(f"checks while the slow request ran: {Counter(map(str, states))}")
        assert [s for s in states if isinstance(s, Exception)] == []
        assert "slow" in states  # a check found no shard call completed within the window, and passed
        assert len(result["output"].token_ids) == 1
        assert _check(ray_session, engine) == "idle"
    finally:
        engine.shutdown()


def test_wedged_shard_fails_the_check_within_the_stall_limit(ray_session, tiny_llama):
    engine = _engine(tiny_llama)
    try:
        shard = engine.handles()["shards"][0]
        # This request's prefill runs; its next forward blocks in the first layer, finishing none.
        _set_hooks(ray_session, shard, wedge_forward=lambda p: p.num_calls + 2)
        result: dict = {}
        _consume(engine, [5, 6, 7], SamplingParams(max_tokens=20, ignore_eos=True), result)
        started = time.monotonic()
        deadline = started + 8 * STALL_S
        while time.monotonic() < deadline:
            state = _check(ray_session, engine)
            if isinstance(state, Exception):
                break
            time.sleep(0.5)
        print(f"the check failed {time.monotonic() - started:.1f}s after the request started: {state}")
        assert isinstance(state, RuntimeError), state
        assert "stuck" in str(state) and "target shard 0 has been in forward" in str(state)
        assert ray_session.get(shard.progress.options(concurrency_group=HEALTH_GROUP).remote())["call"] == "forward"
        assert "output" not in result  # the request is still held by the wedge
    finally:
        engine.shutdown()


def test_killed_shard_fails_the_check_at_once(ray_session, tiny_llama):
    engine = _engine(tiny_llama)
    try:
        assert len(engine.generate(prompt_token_ids=[5, 6, 7], sampling=SamplingParams(max_tokens=2)).token_ids) == 2
        assert _check(ray_session, engine) == "idle"
        ray_session.kill(engine.handles()["shards"][0], no_restart=True)
        started = time.monotonic()
        # `ray.kill` returns before the process is gone: a check in that instant may still find it idle.
        state = _check(ray_session, engine)
        while not isinstance(state, Exception) and time.monotonic() - started < 5:
            time.sleep(0.1)
            state = _check(ray_session, engine)
        print(f"the check failed {time.monotonic() - started:.2f}s after the kill: {state}")
        assert isinstance(state, RuntimeError) and "target shard 0 is dead" in str(state), state
    finally:
        engine.shutdown()
