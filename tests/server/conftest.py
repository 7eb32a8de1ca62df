"""Fixtures for the front-end tests: a FakeEngine, the app on it, and Quart's test client."""

from __future__ import annotations

from collections.abc import Callable

import pytest
from quart import Quart

from server.app import create_app
from server.config import ServerConfig
from tests.server.fake_engine import FakeEngine


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture
def engine() -> FakeEngine:
    return FakeEngine()


@pytest.fixture
def make_app(engine: FakeEngine) -> Callable[..., Quart]:
    def make(**config: object) -> Quart:
        return create_app(engine, ServerConfig(**config))  # type: ignore[arg-type]

    return make


@pytest.fixture
def app(make_app: Callable[..., Quart]) -> Quart:
    return make_app(enable_per_request_metrics=True)
