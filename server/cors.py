"""CORS for browsers, with vLLM's flags and the rules of its (Starlette's) CORSMiddleware:
--allowed-origins, --allowed-methods, --allowed-headers and --allow-credentials. Installed only
when --allowed-origins is given; preflights are answered before any other hook (the API key's)."""

from __future__ import annotations

from dataclasses import dataclass

from quart import Quart, Response, request

from server.config import ServerConfig
from server.errors import error_body
from server.openai_serving import json_response

ALL_METHODS = ("DELETE", "GET", "HEAD", "OPTIONS", "PATCH", "POST", "PUT")
# Request headers a browser may always send (the CORS safelist).
SAFELISTED_HEADERS = frozenset({"accept", "accept-language", "content-language", "content-type"})
PREFLIGHT_MAX_AGE_S = 600


@dataclass(slots=True, frozen=True)
class CorsPolicy:
    origins: frozenset[str]
    methods: tuple[str, ...]
    headers: frozenset[str]  # lower case
    allow_credentials: bool

    @classmethod
    def of(cls, config: ServerConfig) -> CorsPolicy:
        methods = tuple(m.upper() for m in config.allowed_methods)
        return cls(
            origins=frozenset(config.allowed_origins or ()),
            methods=ALL_METHODS if "*" in methods else methods,
            headers=frozenset(h.lower() for h in config.allowed_headers),
            allow_credentials=config.allow_credentials,
        )

    @property
    def any_origin(self) -> bool:
        return "*" in self.origins

    @property
    def any_header(self) -> bool:
        return "*" in self.headers

    def allows_origin(self, origin: str) -> bool:
        return self.any_origin or origin in self.origins

    def preflight(self, origin: str, method: str, asked_headers: str | None) -> Response:
        """The answer to an OPTIONS preflight: 200, or 400 naming what is not allowed."""
        headers = {
            "Access-Control-Allow-Methods": ", ".join(self.methods),
            "Access-Control-Max-Age": str(PREFLIGHT_MAX_AGE_S),
        }
        explicit_origin = not self.any_origin or self.allow_credentials
        refused = []
        if not self.allows_origin(origin):
            refused.append("origin")
        if explicit_origin:
            headers["Vary"] = "Origin"
            if not refused:
                headers["Access-Control-Allow-Origin"] = origin
        else:
            headers["Access-Control-Allow-Origin"] = "*"
        if method.upper() not in self.methods:
            refused.append("method")
        if self.any_header:
            if asked_headers is not None:
                headers["Access-Control-Allow-Headers"] = asked_headers
        else:
            allowed = SAFELISTED_HEADERS | self.headers
            headers["Access-Control-Allow-Headers"] = ", ".join(sorted(allowed))
            asked = {h.strip().lower() for h in (asked_headers or "").split(",") if h.strip()}
            if not asked <= allowed:
                refused.append("headers")
        if self.allow_credentials:
            headers["Access-Control-Allow-Credentials"] = "true"
        if refused:
            response = json_response(
                error_body(f"Disallowed CORS {', '.join(refused)}", "BadRequestError"), 400
            )
        else:
            response = Response(b"OK", status=200, content_type="text/plain")
        response.headers.update(headers)
        return response

    def add_headers(self, response: Response, origin: str, has_cookie: bool) -> None:
        """The headers of an actual (not preflight) response to a request from `origin`."""
        if self.allow_credentials:
            response.headers["Access-Control-Allow-Credentials"] = "true"
        if self.any_origin and not has_cookie:
            response.headers["Access-Control-Allow-Origin"] = "*"
        elif self.allows_origin(origin):
            response.headers["Access-Control-Allow-Origin"] = origin
            response.vary.add("Origin")


def _is_preflight() -> bool:
    return (
        request.method == "OPTIONS"
        and "Origin" in request.headers
        and "Access-Control-Request-Method" in request.headers
    )


def install_cors(app: Quart, config: ServerConfig) -> None:
    policy = CorsPolicy.of(config)

    @app.before_request
    async def answer_preflight() -> Response | None:
        if not _is_preflight():
            return None
        return policy.preflight(
            request.headers["Origin"],
            request.headers["Access-Control-Request-Method"],
            request.headers.get("Access-Control-Request-Headers"),
        )

    @app.after_request
    async def allow_origin(response: Response) -> Response:
        origin = request.headers.get("Origin")
        if origin is not None and not _is_preflight():
            policy.add_headers(response, origin, "Cookie" in request.headers)
        return response
