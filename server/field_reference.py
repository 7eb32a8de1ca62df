"""docs/FIELDS.md: the request bodies' fields, generated from their definitions in
server/schemas.py (type, default, and the comment the code gives each field or group), so that
the reference cannot drift from what the server decodes. `python -m server.field_reference
docs/FIELDS.md` writes it; tests/server/test_cli.py checks it is current.
"""

from __future__ import annotations

import ast
import inspect
import io
import sys
import tokenize
from dataclasses import dataclass

import msgspec

from server import schemas

# Each body with the fields its class declares (a subclass's table adds to its base's).
BODIES: tuple[tuple[str, type[msgspec.Struct]], ...] = (
    (
        "Chat and text completions alike (`/v1/chat/completions`, `/v1/completions`)",
        schemas._GenerationRequest,
    ),
    ("`/v1/chat/completions` (besides the fields above)", schemas.ChatCompletionRequest),
    (
        "`/v1/chat/completions/batch` (the chat fields, `messages` a list of conversations)",
        schemas.BatchChatCompletionRequest,
    ),
    ("`/v1/completions` (besides the fields above)", schemas.CompletionRequest),
    ("`stream_options`", schemas.StreamOptions),
    ("`/tokenize`", schemas.TokenizeRequest),
    ("`/detokenize`", schemas.DetokenizeRequest),
)


@dataclass(frozen=True, slots=True)
class _Row:
    name: str  # "" for a comment that heads the fields after it
    annotation: str
    default: str
    comment: str


def _comments(source: str) -> dict[int, str]:
    """Each line's comment (without its #), by line number within `source`."""
    found: dict[int, str] = {}
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type == tokenize.COMMENT:
            text = token.string.lstrip("#").strip()
            if text and not text.startswith("type:"):
                found[token.start[0]] = text
    return found


def _rows(kind: type[msgspec.Struct]) -> list[_Row]:
    """The fields the class itself declares, in order, with the comments of the source: a line's
    own comment describes its field. A comment block above a field describes that field alone
    when the field after it is described in its turn (or there is none); else it heads a group."""
    source = inspect.getsource(kind)
    comments = _comments(source)
    node = ast.parse(source).body[0]
    assert isinstance(node, ast.ClassDef)
    fields = set(kind.__struct_fields__)
    declared: list[tuple[str, str, str, str, str]] = []  # name, type, default, above, own
    previous_end = node.lineno
    for item in node.body:
        end = item.end_lineno or item.lineno
        if (
            isinstance(item, ast.AnnAssign)
            and isinstance(item.target, ast.Name)
            and item.target.id in fields
        ):
            above = " ".join(
                comments[n] for n in range(previous_end + 1, item.lineno) if n in comments
            )
            own = " ".join(comments[n] for n in range(item.lineno, end + 1) if n in comments)
            default = "required" if item.value is None else ast.unparse(item.value)
            declared.append((item.target.id, ast.unparse(item.annotation), default, above, own))
        previous_end = end
    rows: list[_Row] = []
    for index, (name, annotation, default, above, own) in enumerate(declared):
        following = declared[index + 1] if index + 1 < len(declared) else None
        alone = following is None or bool(following[3] or following[4])
        if above and not (alone and not own):
            rows.append(_Row("", "", "", above))
            above = ""
        rows.append(_Row(name, annotation, default, " ".join(c for c in (above, own) if c)))
    return rows


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def reference_markdown() -> str:
    lines = [
        "# Request fields",
        "",
        "Generated from `server/schemas.py` by `python -m server.field_reference docs/FIELDS.md`;",
        "a test fails when this file and the schemas differ. Types are the schemas' own (their",
        "bounds are in `server/schemas.py`); a value out of bounds is a 400 naming the field.",
        "docs/SERVING.md says how the fields beyond OpenAI's work together.",
    ]
    for heading, kind in BODIES:
        lines += ["", f"## {heading}", "", "| field | type | default | note |", "|---|---|---|---|"]
        for row in _rows(kind):
            name = f"`{row.name}`" if row.name else ""
            note = f"*{_cell(row.comment)}*" if not row.name else _cell(row.comment)
            annotation = f"`{_cell(row.annotation)}`" if row.annotation else ""
            default = (
                f"`{_cell(row.default)}`" if row.default not in ("", "required") else row.default
            )
            lines.append(f"| {name} | {annotation} | {default} | {note} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    text = reference_markdown()
    with open(sys.argv[1], "w", encoding="utf-8") as out:
        out.write(text)
