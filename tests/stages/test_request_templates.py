"""A request's own chat template (--trust-request-chat-template) renders in a child process of
render's, with --chat-template-timeout and --chat-template-memory: a template that loops for
minutes, or builds a gigabyte string, is a 400 for its request alone. Render goes on serving the
others meanwhile, is never restarted for it, and the next request's template renders as before."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from pipeline.clock import now_ns
from stages.api import ChatPrompt, EngineError, GenerateRequest, SamplingParams
from tests.stages.test_recovery import request

TIMEOUT_S = 1.5
MESSAGES = [{"role": "user", "content": "hello there"}]
LOOP = "{% for i in range(100000) %}{% for j in range(30000) %}{% endfor %}{% endfor %}"
STRING = "{{ ('%999999999s' % 'a')|length }}"
OWN = "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}"


def _templated(name: str, template: str) -> GenerateRequest:
    prompt = ChatPrompt(MESSAGES, chat_template=template)
    sampling = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    return GenerateRequest(name, prompt, sampling, arrival_ns=now_ns())


async def _outcome(engine, req: GenerateRequest) -> tuple[float, str | EngineError]:
    """When it ended (monotonic s), and its text or its error."""
    text = ""
    try:
        async for out in engine.generate(req):
            text += out.text
    except EngineError as error:
        return time.monotonic(), error
    return time.monotonic(), text


@pytest.fixture
def engine(pipeline):
    return pipeline(chat_template_timeout_s=TIMEOUT_S, chat_template_memory_bytes=256 << 20)


@pytest.mark.slow  # the sandbox's own tests (tests/stages/text) run in make test-fast
def test_a_template_past_its_limits_is_a_400_and_the_others_are_served_meanwhile(engine):
    engine, runner = engine
    render_pid = engine.supervisor.pids()["render"]

    async def attack(template: str) -> tuple[float, float, object, list[float]]:
        started = time.monotonic()
        bomb = asyncio.create_task(_outcome(engine, _templated("bomb", template)))
        # plain requests one after another while the template runs
        served = []
        for i in range(3):
            ended, text = await _outcome(engine, request(i, max_tokens=4))
            assert isinstance(text, str) and text
            served.append(ended - started)
        ended, answer = await bomb
        return started, ended, answer, served

    for template, words in ((LOOP, "--chat-template-timeout"), (STRING, "--chat-template-memory")):
        started, ended, answer, served = runner.run(attack(template), 60)
        assert isinstance(answer, EngineError) and answer.status == 400, answer
        assert words in answer.message
        assert served[-1] < ended - started  # all three were served before the template ended
        if template == LOOP:
            assert TIMEOUT_S * 0.9 < ended - started < TIMEOUT_S + 5
    # the next template renders (in a fresh child), and render was never restarted
    _, text = runner.run(_outcome(engine, _templated("own", OWN)), 60)
    assert isinstance(text, str) and text
    assert engine.supervisor.pids()["render"] == render_pid
    assert engine.stats()["num_stage_recoveries_total"] == 0


def test_tokenize_renders_a_requests_own_template_as_render_does(engine):
    """/tokenize (Engine.tokenize, in the server process) takes the request's template, to the
    same ids as render's, and in a sandbox with the same limits: a looping one is a 400."""
    engine, runner = engine
    own = engine.tokenize(ChatPrompt(MESSAGES, chat_template=OWN))
    assert own != engine.tokenize(ChatPrompt(MESSAGES))  # the model's template is another
    assert own == engine.bundle.encode("<user>hello there", add_bos=False)
    assert runner.run(engine.render(_templated("own", OWN))).token_ids == own
    outcome: list[object] = []

    def tokenize_loop() -> None:
        try:
            outcome.append(engine.tokenize(ChatPrompt(MESSAGES, chat_template=LOOP)))
        except EngineError as error:
            outcome.append(error)

    # a daemon thread: a template rendered outside the sandbox would loop past the test's end
    worker = threading.Thread(target=tokenize_loop, daemon=True)
    worker.start()
    worker.join(TIMEOUT_S + 5)
    (answer,) = outcome
    assert isinstance(answer, EngineError) and answer.status == 400, answer
    assert "--chat-template-timeout" in answer.message
