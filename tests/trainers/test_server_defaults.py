"""ADV_IGNORE_TOKEN_IDS: the server's ignore_token_ids for requests that give none."""

from __future__ import annotations

import pytest
from advantage_service.config import Settings
from advantage_service.wire.request import parse_request, with_server_defaults
from pydantic import ValidationError


def request(ignore: list[int] | None = None) -> dict:
    body: dict = {
        "estimator": "ktae",
        "groups": [
            {
                "id": "g",
                "rollouts": [{"tokens": [1, 2], "reward": 1.0}, {"tokens": [2, 3], "reward": 0.0}],
            }
        ],
    }
    if ignore is not None:
        body["ignore_token_ids"] = ignore
    return body


def test_the_setting_reads_comma_lists_and_json_lists(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ADV_IGNORE_TOKEN_IDS", "151643, 151645")
    assert Settings().ignore_token_ids == (151643, 151645)
    monkeypatch.setenv("ADV_IGNORE_TOKEN_IDS", "[151643]")
    assert Settings().ignore_token_ids == (151643,)
    monkeypatch.delenv("ADV_IGNORE_TOKEN_IDS")
    assert Settings().ignore_token_ids == ()
    assert Settings(ignore_token_ids="7").ignore_token_ids == (7,)
    with pytest.raises(ValidationError):
        Settings(ignore_token_ids="eos")


def test_a_request_without_its_own_list_takes_the_servers() -> None:
    default = (151643,)
    assert with_server_defaults(parse_request(request()), default).ignore_token_ids == [151643]
    own = with_server_defaults(parse_request(request([5])), default)
    assert own.ignore_token_ids == [5]
    assert with_server_defaults(parse_request(request()), ()).ignore_token_ids == []
