from __future__ import annotations

from collections.abc import Mapping
from typing import IO, Any

from rest_framework import parsers
from rest_framework.exceptions import ParseError


class JSONParser(parsers.JSONParser):
    """DRF's JSON parser, answering 400 rather than 500 to absurdly deep nesting."""

    def parse(
        self,
        stream: IO[Any],
        media_type: str | None = None,
        parser_context: Mapping[str, Any] | None = None,
    ) -> Any:
        try:
            return super().parse(stream, media_type, parser_context)
        except RecursionError:
            # json raises RecursionError, not ValueError, which is all DRF catches.
            raise ParseError("JSON parse error - nested too deeply") from None
